"""Hogwild! apply: one optimizer step written into the stored arrays themselves, under no lock.

    check_supported(spec)                       # InvalidArgument, one line, for what cannot run in place
    view, value, state = adopt(store_value, store_state)   # private writable copies, once per variable
    step_in_place(optimizer, value, grad, state, lr_scale, clip_scale)

What ``ps-server --async-apply hogwild`` runs (``VariableStore.apply_in_place``,
``core.modes.async_mode``). The arithmetic is that of ``core.optim.optimizers``, operation by
operation in the same order and dtype, so a step that no other step overlaps is
bit-identical to the locked, copy-on-write one (``Optimizer.apply``;
``tests/core/test_hogwild.py`` checks every supported option). What differs is
where the results go:

- the value is updated by one in-place pass (``w -= update``, ``w += m``: a NumPy
  ufunc with ``out=w``, which releases the GIL; with ``weight_decay`` two, the
  decay and then the step), so steps of concurrent pushes race element by
  element and one may overwrite another's (a lost update);
- an optimizer slot (SGD's ``momentum``, Adam's ``m``, ``v``, ``v_hat``, Adagrad's
  ``accumulator``, RMSprop's ``velocity`` and ``momentum``) is
  read once (Adam's ``m`` and ``v``, which the formula reads twice, from a copy
  taken when the step starts) and written in one pass. Every element of a slot
  therefore always holds the result of one whole update of a value it really
  had, never an intermediate: Adam's ``v`` stays >= 0 whatever interleaves, so
  its square root never turns a step into NaN. The value's update then reads the
  slots as they are (this push's new ones, or a concurrent push's written since);
- the step index (Adam's bias correction, a learning-rate schedule's argument) is
  the variable's count of completed steps when this step starts: concurrent steps
  may use the same one. The store counts each completed step exactly once.

Supported: ``sgd`` (plain, ``momentum``, ``nesterov``), ``adam`` (and ``amsgrad``),
``adamw``, ``adagrad`` and ``rmsprop`` (with ``momentum``; not ``centered``, whose
``v - a^2`` is >= 0 only while ``v`` and ``a`` share one history), with every clipping option, ``weight_decay``, a constant or
scheduled learning rate and the stale-gradient policy's ``lr_scale``; and
non-trainable variables (the pushed change added in place). Refused: the other
optimizers (adamax, nadam, ftrl, lion), centered rmsprop and ``use_ema`` (``check_supported``: ``--async-apply locked`` runs them).

Plain NumPy, like the rest of the core.
"""

from __future__ import annotations

import numpy as np

from ps_common.names import ASYNC_APPLIES
from ps_server.core.errors import InvalidArgument
from ps_server.core.optim.optimizers import Adagrad, Adam, Optimizer, OptimizerSpec, RMSprop, SGD, _scalar_pow

IN_PLACE = ("sgd", "adam", "adamw", "adagrad", "rmsprop")

__all__ = ["ASYNC_APPLIES", "IN_PLACE", "adopt", "check_supported", "step_in_place"]


def check_supported(spec: OptimizerSpec) -> None:
    """Raise InvalidArgument, one line naming the optimizer or option, unless Hogwild runs ``spec``."""
    if spec.name not in IN_PLACE:
        raise InvalidArgument(f"--async-apply hogwild updates in place only {', '.join(IN_PLACE)}; the optimizer "
                              f"is {spec.name}: start the server with --async-apply locked to train it")
    if spec.name == "rmsprop" and spec.centered:
        # v - a^2 >= 0 only while v and a come from the same history; racing pushes may tear them.
        raise InvalidArgument("--async-apply hogwild does not run rmsprop with centered=True (its v - a^2 could "
                              "go negative when pushes race): start the server with --async-apply locked to train it")
    if spec.use_ema:
        raise InvalidArgument(f"--async-apply hogwild does not run use_ema ({spec.name} with use_ema=True): start "
                              "the server with --async-apply locked to train it")
    if spec.shared():
        raise InvalidArgument("--async-apply hogwild does not run a variable two optimizer groups step (each "
                              "writes it in place): start the server with --async-apply locked to train it")


def adopt(value: np.ndarray, state: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """(published view, writable value, state with writable slots) for a stored variable.

    The value and every slot are copied once into arrays only the Hogwild steps write;
    readers are handed ``view``, a read-only view of the writable value (it changes
    under them; nothing they hold is ever freed or resized). The arrays given here are
    left as they are: a reader still holding one keeps a whole, unchanging array."""
    owned = np.array(value, copy=True, order="C")
    view = owned.view()
    view.flags.writeable = False
    slots = {k: (np.array(a, copy=True, order="C") if isinstance(a, np.ndarray) else a) for k, a in state.items()}
    return view, owned, slots


def step_in_place(optimizer: Optimizer, w: np.ndarray, g: np.ndarray, state: dict, lr_scale: float = 1.0,
                  clip_scale=None, non_trainable: bool = False) -> None:
    """One step of ``optimizer`` on the writable ``w`` and the slots of ``state``, in place.

    ``g`` is checked already (``VariableStore.check_gradients``: shape, dtype, finite).
    ``state["iterations"]`` is read, not advanced: the caller counts the step once it is
    written. A non-trainable variable gets ``w += g`` (its pushed change)."""
    if non_trainable:  # the locked path: (value + grad) in the value's dtype
        np.add(w, g, out=w)
        return
    spec = optimizer.spec
    check_supported(spec)
    slot_names = optimizer.slot_names
    missing = [k for k in (*slot_names, "iterations") if k not in state]
    if missing:
        raise InvalidArgument(f"optimizer state lacks {', '.join(missing)}")
    if spec.global_clipnorm is not None and clip_scale is None:
        raise InvalidArgument("global_clipnorm clips by the norm of the whole update: pass its global_clip_scale")
    iterations = int(state["iterations"])
    slots = {name: state[name] for name in slot_names}
    if not w.shape:  # 0-d: step on shape [1] views, as Optimizer.apply does (they write through)
        w, g = w.reshape(1), g.reshape(1)
        slots = {name: s.reshape(1) for name, s in slots.items()}
    c = optimizer.step_constants(w.dtype, iterations, lr_scale)
    with np.errstate(invalid="ignore", divide="ignore"):
        g = optimizer._clip(g, c, clip_scale)
    if spec.weight_decay is not None:  # w - w * wd * lr, as Optimizer.apply: its own in-place pass
        decay = np.multiply(w, c["weight_decay"])
        np.multiply(decay, c["lr"], out=decay)
        np.subtract(w, decay, out=w)
    if isinstance(optimizer, SGD):
        _sgd(optimizer, w, g, slots, c)
    elif isinstance(optimizer, Adam):
        _adam(optimizer, w, g, slots, iterations, c)
    elif isinstance(optimizer, Adagrad):
        _adagrad(w, g, slots, c)
    elif isinstance(optimizer, RMSprop):
        _rmsprop(optimizer, w, g, slots, c)
    else:  # check_supported names the in-place ones; a new class there must come here too
        raise InvalidArgument(f"--async-apply hogwild has no in-place step for {type(optimizer).__name__}")


def _sgd(optimizer: SGD, w, g, slots, c) -> None:
    # SGD._step's operations: w - g*lr; with momentum m = m*mu - g*lr, then w + m (Nesterov: w + (m*mu - g*lr)).
    step = np.multiply(g, c["lr"])
    if not optimizer.slot_names:
        np.subtract(w, step, out=w)
        return
    live = slots["momentum"]
    m = np.multiply(live, c["momentum"])  # the slot's one read
    np.subtract(m, step, out=live)  # its one write: m*mu - g*lr
    if optimizer.spec.nesterov:
        np.multiply(live, c["momentum"], out=m)
        np.subtract(m, step, out=m)
        np.add(w, m, out=w)
    else:
        np.add(w, live, out=w)


def _adam(optimizer: Adam, w, g, slots, iterations, c) -> None:
    # Adam._step's operations. m and v each from one copy taken now, written back in one pass
    # (m + (g - m) * (1 - beta_1) reads m twice: from the copy, both reads see the same m);
    # the step then reads them as written. Two scratch arrays serve every temporary.
    with np.errstate(over="ignore"):
        local_step = np.array(iterations + 1).astype(w.dtype)[()]
    beta_1_power = _scalar_pow(c["beta_1"], local_step)
    beta_2_power = _scalar_pow(c["beta_2"], local_step)
    alpha = c["lr"] * np.sqrt(c["one"] - beta_2_power) / (c["one"] - beta_1_power)
    old = slots["m"].copy()
    new = np.subtract(g, old)
    np.multiply(new, c["one_minus_beta_1"], out=new)
    np.add(old, new, out=slots["m"])
    np.copyto(old, slots["v"])
    np.square(g, out=new)
    np.subtract(new, old, out=new)
    np.multiply(new, c["one_minus_beta_2"], out=new)
    np.add(old, new, out=slots["v"])
    v = slots["v"]
    if optimizer.spec.amsgrad:  # v_hat = max(v_hat, v): one read, one write of each element
        v = np.maximum(slots["v_hat"], v, out=slots["v_hat"])
    denominator = np.sqrt(v, out=old)
    np.add(denominator, c["epsilon"], out=denominator)
    update = np.multiply(slots["m"], alpha, out=new)
    np.divide(update, denominator, out=update)
    np.subtract(w, update, out=w)


def _adagrad(w, g, slots, c) -> None:
    # Adagrad._step's operations: acc + g^2 (the slot's one read and write); w - (g*lr) / sqrt(acc + eps).
    scratch = np.square(g)
    accumulator = np.add(slots["accumulator"], scratch, out=slots["accumulator"])
    denominator = np.add(accumulator, c["epsilon"], out=scratch)
    np.sqrt(denominator, out=denominator)
    update = np.multiply(g, c["lr"])
    np.divide(update, denominator, out=update)
    np.subtract(w, update, out=w)


def _rmsprop(optimizer: RMSprop, w, g, slots, c) -> None:
    # RMSprop._step's operations (not centered): v*rho + g^2*(1-rho), each slot read once and
    # written once; w - (g*lr) / sqrt(v + eps), with momentum w - (m*momentum + that).
    scaled = np.multiply(slots["velocity"], c["rho"])
    squared = np.multiply(np.square(g), c["one_minus_rho"])
    velocity = np.add(scaled, squared, out=slots["velocity"])
    denominator = np.add(velocity, c["epsilon"], out=scaled)
    np.sqrt(denominator, out=denominator)
    increment = np.multiply(g, c["lr"], out=squared)
    np.divide(increment, denominator, out=increment)
    if "momentum" in optimizer.slot_names:
        m = np.multiply(slots["momentum"], c["rms_momentum"], out=denominator)
        increment = np.add(m, increment, out=slots["momentum"])
    np.subtract(w, increment, out=w)

