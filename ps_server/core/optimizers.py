"""Server-side optimizers that compute exactly what Keras 3 computes.

    opt = make_optimizer(OptimizerSpec("adam", learning_rate=1e-3))
    state = opt.init_state(value)
    value, state = opt.apply(value, grad, state)

Guarantee: ``SGD`` (plain, momentum, Nesterov) and ``Adam`` give values
bit-identical to ``keras.optimizers.SGD`` / ``Adam`` of Keras 3.15 on
TensorFlow 2.21 CPU, called eagerly or inside ``tf.function``, for float16,
float32 and float64 variables (``tests/core/test_optimizers.py`` checks
float32 after 20 updates). To get there each step repeats Keras' operations
in Keras' order, every intermediate in the variable's dtype, with Keras' own
rounding of each hyperparameter (``_constants``) and of ``beta ** step``
(``_scalar_pow``). Two known limits, both on TensorFlow's side:
- under XLA (``jit_compile=True``, which ``model.fit`` picks by default)
  TensorFlow fuses ``a*b - c`` into one FMA, so it drifts from eager Keras
  (and from us) by about 1 unit in the last place per step;
- TensorFlow flushes float32/float64 subnormals to zero and NumPy does not,
  so a slot decaying below ~1e-38 (Adam's ``m`` after hundreds of zero
  gradients) keeps a subnormal here and a zero or tiny normal there. The
  variable's value is not affected in practice.

``apply`` is pure: it returns a new value and a new state and never writes
into its arguments. The server hands stored arrays to readers (a pull being
serialized, a checkpoint being written) without copying; writing in place
would change an array under a reader, so an update builds new arrays and the
caller swaps them in (copy-on-write).

Each variable's state carries its own ``iterations``: one ``apply`` is one
optimizer step for that variable. It equals Keras' global ``iterations``
when every step updates every variable.

Plain Python and NumPy only: the server process never imports TensorFlow.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from ps_common.names import OPTIMIZER_DEFAULTS, OPTIMIZERS
from ps_server.core.errors import InvalidArgument

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer, with Keras' argument names; callers set learning_rate."""

    name: str  # one of ps_common.names.OPTIMIZERS
    learning_rate: float = OPTIMIZER_DEFAULTS["sgd"]["learning_rate"]
    momentum: float = OPTIMIZER_DEFAULTS["sgd"]["momentum"]  # sgd only
    nesterov: bool = OPTIMIZER_DEFAULTS["sgd"]["nesterov"]  # sgd only
    beta_1: float = OPTIMIZER_DEFAULTS["adam"]["beta_1"]  # adam only
    beta_2: float = OPTIMIZER_DEFAULTS["adam"]["beta_2"]  # adam only
    epsilon: float = OPTIMIZER_DEFAULTS["adam"]["epsilon"]  # adam only

    def validate(self) -> None:
        """Raise InvalidArgument naming the first field that is out of range."""
        if self.name not in OPTIMIZERS:
            raise InvalidArgument(
                f"optimizer name must be one of {', '.join(OPTIMIZERS)}; got {self.name!r}"
            )
        for field in ("learning_rate", "momentum", "beta_1", "beta_2", "epsilon"):
            x = getattr(self, field)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise InvalidArgument(f"{field} must be a finite number; got {x!r}")
        if self.learning_rate <= 0:
            raise InvalidArgument(f"learning_rate must be > 0; got {self.learning_rate!r}")
        for field in ("momentum", "beta_1", "beta_2"):
            x = getattr(self, field)
            if not 0 <= x < 1:
                raise InvalidArgument(f"{field} must be in [0, 1); got {x!r}")
        if self.epsilon < 0:
            raise InvalidArgument(f"epsilon must be >= 0; got {self.epsilon!r}")
        # nesterov=True with momentum=0 is plain SGD; Keras accepts it, so do we.
        if not isinstance(self.nesterov, bool):
            raise InvalidArgument(f"nesterov must be True or False; got {self.nesterov!r}")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerSpec":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidArgument(f"unknown optimizer spec fields: {', '.join(unknown)}")
        if "name" not in d:
            raise InvalidArgument("optimizer spec has no 'name'")
        return cls(**d)


def _constants(spec: OptimizerSpec, dtype: np.dtype) -> dict:
    """The hyperparameters rounded into ``dtype`` the way Keras rounds each.

    Keras does not round them all alike; for float16 and float64 it shows
    (each of these choices is needed for float64 bit-identity):
    - learning_rate lives in a float32 variable that is then cast to dtype;
    - ``ops.cast(python_float, dtype)`` (momentum, beta_1, beta_2 before the
      power) goes through float32, as ``tf.cast`` first makes a Python float
      a float32 tensor;
    - a Python float that is an operand of an op (``1 - beta_1`` and
      ``1 - beta_2``, computed by Python in float64, and epsilon) is
      converted to dtype directly.
    """
    via_float32 = lambda x: np.float32(x).astype(dtype)  # noqa: E731
    direct = lambda x: np.array(x, dtype=dtype)[()]  # noqa: E731
    return {
        "lr": via_float32(spec.learning_rate),
        "momentum": via_float32(spec.momentum),
        "beta_1": via_float32(spec.beta_1),
        "beta_2": via_float32(spec.beta_2),
        "one_minus_beta_1": direct(1 - spec.beta_1),
        "one_minus_beta_2": direct(1 - spec.beta_2),
        "epsilon": direct(spec.epsilon),
        "one": direct(1),
    }


def _scalar_pow(base: np.floating, exponent: np.floating) -> np.floating:
    """``base ** exponent`` rounded as TensorFlow rounds a scalar ``Pow``.

    TensorFlow computes it with the C library: ``pow`` for float64, ``powf``
    for float32 (and float16, through float32). ``math.pow`` is that ``pow``,
    and its result rounded to float32 equals ``powf``'s. ``np.power`` is not
    the same function: it is 1 ulp off for about one step in ten.
    """
    p = math.pow(float(base), float(exponent))
    if base.dtype == np.float64:
        return np.float64(p)
    return np.float32(p).astype(base.dtype)


class Optimizer:
    """One update rule. Subclasses name their slots and define ``_step``."""

    slot_names: tuple[str, ...] = ()

    def __init__(self, spec: OptimizerSpec):
        spec.validate()
        self.spec = spec
        self._constants = {dtype: _constants(spec, dtype) for dtype in FLOAT_DTYPES}

    def init_state(self, value: np.ndarray) -> dict:
        """Zeroed slots shaped like ``value``, plus ``iterations = 0``."""
        _check_float_array("variable", value)
        state: dict = {name: np.zeros_like(value) for name in self.slot_names}
        state["iterations"] = 0
        return state

    def apply(self, value: np.ndarray, grad: np.ndarray, state: dict,
              lr_scale: float = 1.0) -> tuple[np.ndarray, dict]:
        """Pure: returns (new_value, new_state); never mutates `value`, `grad` or arrays in `state`.

        ``lr_scale`` multiplies the learning rate of this one step (async/SSP stale-gradient
        policy "scale"); 1.0 computes exactly what Keras computes."""
        _check_float_array("variable", value)
        _check_float_array("gradient", grad)
        _check_like("gradient", grad, value)
        missing = [k for k in (*self.slot_names, "iterations") if k not in state]
        if missing:
            raise InvalidArgument(f"optimizer state lacks {', '.join(missing)}")
        for name in self.slot_names:
            _check_like(f"slot {name!r}", state[name], value)
        iterations = int(state["iterations"])
        shape = value.shape
        if not shape:  # NumPy turns 0-d results into scalars, which take no ``out=``: step on shape [1]
            value, grad = value.reshape(1), grad.reshape(1)
            state = {name: state[name].reshape(1) for name in self.slot_names}
        constants = self._constants[value.dtype]
        if lr_scale != 1.0:
            if not 0.0 < lr_scale <= 1.0:
                raise InvalidArgument(f"lr_scale must be in (0, 1], got {lr_scale!r}")
            constants = {**constants, "lr": (constants["lr"] * np.float64(lr_scale)).astype(value.dtype)}
        new_value, slots = self._step(value, grad, state, iterations, constants)
        slots = {name: x.reshape(shape) for name, x in slots.items()}
        return new_value.reshape(shape), {**slots, "iterations": iterations + 1}

    def _step(self, w, g, state, iterations, c) -> tuple[np.ndarray, dict]:
        raise NotImplementedError


class SGD(Optimizer):
    """``keras.optimizers.SGD``: w - g*lr; with momentum m = m*mu - g*lr, w + m."""

    def __init__(self, spec: OptimizerSpec):
        super().__init__(spec)
        # Like Keras, keep a momentum slot only when momentum is not 0.
        self.slot_names = ("momentum",) if spec.momentum != 0 else ()

    def _step(self, w, g, state, iterations, c):
        # The same IEEE operations as the formulas above, in as few fresh arrays as
        # possible (``out=`` into temporaries): a fresh array is fresh pages to fault in.
        step = np.multiply(g, c["lr"])  # g*lr
        if not self.slot_names:
            return np.subtract(w, step, out=step), {}
        m = np.multiply(state["momentum"], c["momentum"])
        np.subtract(m, step, out=m)  # m*mu - g*lr
        if self.spec.nesterov:
            ahead = np.multiply(m, c["momentum"])
            np.subtract(ahead, step, out=ahead)  # m*mu - g*lr, with the new m
            return np.add(w, ahead, out=ahead), {"momentum": m}
        return np.add(w, m, out=step), {"momentum": m}


class Adam(Optimizer):
    """``keras.optimizers.Adam`` (amsgrad=False), bias correction folded into alpha."""

    slot_names = ("m", "v")

    def _step(self, w, g, state, iterations, c):
        with np.errstate(over="ignore"):  # float16 step > 65504 is inf, as in Keras
            local_step = np.array(iterations + 1).astype(w.dtype)[()]
        beta_1_power = _scalar_pow(c["beta_1"], local_step)
        beta_2_power = _scalar_pow(c["beta_2"], local_step)
        alpha = c["lr"] * np.sqrt(c["one"] - beta_2_power) / (c["one"] - beta_1_power)
        # m + (g - m) * (1 - beta_1); v + (g^2 - v) * (1 - beta_2); w - (m * alpha) / (sqrt(v) + eps),
        # operation by operation as written, into reused temporaries (see SGD).
        m = np.subtract(g, state["m"])
        np.multiply(m, c["one_minus_beta_1"], out=m)
        np.add(state["m"], m, out=m)
        v = np.square(g)
        np.subtract(v, state["v"], out=v)
        np.multiply(v, c["one_minus_beta_2"], out=v)
        np.add(state["v"], v, out=v)
        denominator = np.sqrt(v)
        np.add(denominator, c["epsilon"], out=denominator)
        update = np.multiply(m, alpha)
        np.divide(update, denominator, out=update)
        return np.subtract(w, update, out=update), {"m": m, "v": v}


def make_optimizer(spec: OptimizerSpec) -> Optimizer:
    """The optimizer ``spec`` names; raises InvalidArgument for a bad spec."""
    spec.validate()
    return {"sgd": SGD, "adam": Adam}[spec.name](spec)


def _check_float_array(what: str, x) -> None:
    if not isinstance(x, np.ndarray) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise InvalidArgument(f"{what} must be a float16/float32/float64 ndarray; got {got}")


def _check_like(what: str, x: np.ndarray, value: np.ndarray) -> None:
    if x.shape != value.shape or x.dtype != value.dtype:
        raise InvalidArgument(
            f"{what} is {x.dtype}{list(x.shape)} but the variable is "
            f"{value.dtype}{list(value.shape)}"
        )
