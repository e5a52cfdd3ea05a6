"""Server-side optimizers that compute exactly what Keras 3 computes.

    spec = OptimizerSpec.from_keras(type(opt).__name__, opt.get_config())  # or OptimizerSpec("adam", 1e-3)
    opt = make_optimizer(spec)                 # ps_server.core.optim.registry
    state = opt.init_state(value)
    value, state = opt.apply(value, grad, state)

The optimizers: ``SGD`` (plain, momentum, Nesterov), ``Adam`` (and amsgrad),
``AdamW`` (Adam with Keras' weight decay, default 0.004), ``Adagrad``,
``RMSprop`` (momentum, centered), and from ``ps_server.core.optim.more_optimizers``
``Adamax``, ``Nadam``, ``Ftrl``, ``Lion``, ``Adadelta``, ``Lamb``, ``Adafactor`` and
``ScheduleFreeAdamW``, and ``Muon`` (``ps_server.core.optim.muon``). Options of every one, as Keras'
``BaseOptimizer.apply`` runs them on one update: the gradient clipped
(``clipnorm`` per variable, ``clipvalue``, or ``global_clipnorm`` over all the
variables of the update), then ``weight_decay`` (``w - w * wd * lr``), then the
optimizer's step, then ``use_ema`` (an ``ema`` slot: the moving average, and every
``ema_overwrite_frequency`` updates the variable overwritten with it; at the end of a
Keras ``fit`` too, ``averaged``, ``VariableStore.take_averages``). With
``gradient_accumulation_steps`` k Keras moves the average at each of the window's k
batches: the update moves it k - 1 times with the value before it, then once after. In a
window whose update overwrites (Keras counts the overwrites in updates, ``iterations // k``),
Keras overwrites the variable at each of its batches: the moves after the first are of the
average with itself, and the update steps from the average (the worker computed the window's
later gradients there: ``tfps.keras``). The learning
rate is a constant or one of Keras' schedules (``ps_server.core.optim.schedules``),
evaluated at the variable's update count before the update, as Keras evaluates it
at ``optimizer.iterations``.

Guarantee, against eager Keras 3.15 on TensorFlow 2.21 CPU (``opt.apply(grads,
vars)`` called eagerly): the values are bit-identical for every optimizer and
option above, with a constant learning rate or a schedule (Muon: but for its matrix
products, ``ps_server.core.optim.muon``). Each step repeats
Keras' operations in Keras' order, every intermediate in the variable's dtype,
with Keras' own rounding of each hyperparameter (``_constants``) and of
``beta ** step`` (``_scalar_pow``); the norms of ``clipnorm`` and
``global_clipnorm`` add their squares in the order of TensorFlow's ``reduce_sum``
(``tf_sum``). ``tests/core/test_optimizers.py`` checks float32 after 20 updates
against Keras itself, and float64 for the clipping. The exceptions are two sums
TensorFlow adds otherwise: float16 norms (summed here in float64, within an ulp or
so of TensorFlow's), and a variable of more than about 100,000 float32 (50,000
float64) elements, whose sum TensorFlow's cost model splits across its intra-op
threads, as many as the machine has: there our norm is within an ulp or so of its
(tested: the variables after 20 clipped updates within 1e-6 relative).

Known limits, on TensorFlow's side:
- inside a compiled step (``tf.function``, as ``model.fit`` runs it) a schedule's
  value differs from eager Keras' by at most 6.2e-7 of its largest value
  (Grappler and XLA rewrite it; ``ps_server.core.optim.schedules``), and under XLA
  (``jit_compile=True``, ``model.fit``'s default) TensorFlow fuses ``a*b - c`` into
  one FMA, so it drifts from eager Keras (and from us) by about 1 unit in the last
  place per step;
- TensorFlow flushes float32/float64 subnormals to zero and NumPy does not,
  so a slot decaying below ~1e-38 (Adam's ``m`` after hundreds of zero
  gradients) keeps a subnormal here and a zero or tiny normal there. The
  variable's value is not affected in practice;
- ``weight_decay=0`` is taken as None: Keras' ``w - w * 0 * lr`` is ``w`` except that
  it turns a ``-0.0`` into ``+0.0``.

Refused (``OptimizerSpec.validate``/``from_keras``, InvalidArgument naming it):
another optimizer class, ``loss_scale_factor``, a schedule
that is not one of Keras' six, and a config key this module does not know
(``ps_common.names.keras_optimizer_fields``, which the worker applies too).

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

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Sequence

import numpy as np

from ps_common.names import (NONE_AS_ZERO, OPTIMIZER_DEFAULTS, OPTIMIZERS, SHARED_MARK, UNUSED_FIELD_VALUES,
                             keras_optimizer_fields, stepped_names)
from ps_server.core.optim import kernels, schedules
from ps_server.core.errors import InvalidArgument

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer, with Keras' argument names (those of the wire's OptimizerConfig).

    A field left None takes the named optimizer's Keras default
    (``ps_common.names.OPTIMIZER_DEFAULTS``); a field the optimizer does not take holds a
    neutral value whatever was given (``UNUSED_FIELD_VALUES``), so two specs are equal
    exactly when they compute the same. The wire's forms are accepted too:
    ``learning_rate_schedule`` as JSON ("" for none), 0 for a None option.
    """

    name: str  # one of ps_common.names.OPTIMIZERS
    learning_rate: float | None = None  # constant; unused with a schedule
    momentum: float | None = None  # sgd, rmsprop
    nesterov: bool | None = None  # sgd
    beta_1: float | None = None  # adam, adamw, adamax, nadam, lion, lamb
    beta_2: float | None = None
    epsilon: float | None = None  # adam, adamw, adagrad, rmsprop, adamax, nadam, adadelta, lamb
    learning_rate_schedule: dict | None = None  # keras.optimizers.schedules.serialize(...)
    amsgrad: bool | None = None  # adam, adamw
    rho: float | None = None  # rmsprop, adadelta
    centered: bool | None = None  # rmsprop
    initial_accumulator_value: float | None = None  # adagrad, ftrl
    learning_rate_power: float | None = None  # ftrl
    l1_regularization_strength: float | None = None
    l2_regularization_strength: float | None = None
    l2_shrinkage_regularization_strength: float | None = None
    beta: float | None = None
    weight_decay: float | None = None  # every optimizer, from here on (None: none)
    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None
    use_ema: bool | None = None
    ema_momentum: float | None = None
    ema_overwrite_frequency: int | None = None
    beta_2_decay: float | None = None  # adafactor
    epsilon_1: float | None = None
    epsilon_2: float | None = None
    clip_threshold: float | None = None
    relative_step: bool | None = None
    warmup_steps: int | None = None  # schedule_free_adamw
    adam_beta_1: float | None = None  # muon (ps_server.core.optim.muon), momentum and nesterov above
    adam_beta_2: float | None = None
    adam_weight_decay: float | None = None
    adam_lr_ratio: float | None = None
    muon_a: float | None = None
    muon_b: float | None = None
    muon_c: float | None = None
    ns_steps: int | None = None
    rms_rate: float | None = None
    exclude_embeddings: bool | None = None
    exclude_layers: tuple | None = None  # regular expressions searched in a variable's name (Keras' path)
    # A repeated row of a sparse gradient where the server has no --sparse-rule ("keras", "sum";
    # None: sum): core.optim.sparse. The Keras front door asks "keras".
    sparse_rule: str | None = None
    # Keras' gradient_accumulation_steps (every optimizer; None: none): each update is the mean
    # of that many batches' gradients (the worker's), its schedule at Keras' real iterations.
    gradient_accumulation_steps: int | None = None
    # The optimizers a model's step applies, each to its own variables (a GAN's two, of one
    # config or not): ((variable names, spec), ...); None: this one, to every variable. A push
    # may then name some of the trainable variables, each stepped by its group's optimizer
    # (each variable counts its own steps); the fields above are the first group's. A variable
    # that a later group names again is that group's by ``ps_common.names.shared_name`` (its own
    # state, the same value: ``core.store``).
    groups: tuple | None = None

    def __post_init__(self):
        takes = OPTIMIZER_DEFAULTS.get(self.name)
        object.__setattr__(self, "sparse_rule", self.sparse_rule or None)  # the wire's "" is None
        object.__setattr__(self, "gradient_accumulation_steps", self.gradient_accumulation_steps or None)  # 0: None
        try:  # one form: a tuple of (names, OptimizerSpec); a checkpoint's JSON gives lists and dicts
            groups = tuple((tuple(names), spec if isinstance(spec, OptimizerSpec) else OptimizerSpec.from_dict(spec))
                           for names, spec in self.groups) if self.groups else None
        except (TypeError, ValueError):
            raise InvalidArgument(f"groups must be (variable names, optimizer spec) pairs; got {self.groups!r}")
        object.__setattr__(self, "groups", groups)
        if isinstance(self.exclude_layers, Iterable) and not isinstance(self.exclude_layers, str):
            object.__setattr__(self, "exclude_layers", tuple(self.exclude_layers))  # a JSON list, the wire's field
        for f in fields(self):
            if f.name in ("name", "sparse_rule", "gradient_accumulation_steps", "groups"):
                continue
            value = getattr(self, f.name)
            if takes is not None and f.name not in takes and f.name != "learning_rate_schedule":
                value = UNUSED_FIELD_VALUES[f.name]
            elif value is None:
                value = (takes or UNUSED_FIELD_VALUES).get(f.name, UNUSED_FIELD_VALUES[f.name])
            elif f.name in NONE_AS_ZERO and value == 0 and not isinstance(value, bool) \
                    and not (f.name == "weight_decay" and self.name == "adamw"):
                value = None  # Keras: 0 clips nothing, overwrites never; w - w*0*lr is w
            object.__setattr__(self, f.name, value)
        schedule = self.learning_rate_schedule
        try:  # one form: the dict of the JSON the wire carries
            if isinstance(schedule, str):
                schedule = json.loads(schedule) if schedule else None
            elif isinstance(schedule, dict):
                schedule = json.loads(json.dumps(schedule, sort_keys=True, allow_nan=False))
        except (TypeError, ValueError):
            pass  # validate() says what is wrong with it
        object.__setattr__(self, "learning_rate_schedule", schedule)

    def validate(self) -> None:
        """Raise InvalidArgument, one line naming the field, for anything out of range."""
        if self.name not in OPTIMIZERS:
            raise InvalidArgument(
                f"optimizer name must be one of {', '.join(OPTIMIZERS)}; got {self.name!r}"
            )
        takes = OPTIMIZER_DEFAULTS[self.name]
        for field, default in takes.items():
            x = getattr(self, field)
            if isinstance(default, bool):
                if not isinstance(x, bool):
                    raise InvalidArgument(f"{field} must be True or False; got {x!r}")
            elif x is None and field in NONE_AS_ZERO:
                continue
            elif isinstance(default, tuple):
                if not isinstance(x, tuple) or not all(isinstance(p, str) for p in x):
                    raise InvalidArgument(f"{field} must be a list of strings; got {x!r}")
            elif isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise InvalidArgument(f"{field} must be a finite number; got {x!r}")
        if self.sparse_rule not in (None, "sum", "keras"):
            raise InvalidArgument(f"sparse_rule must be sum, keras or unset; got {self.sparse_rule!r}")
        steps = self.gradient_accumulation_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 2):
            raise InvalidArgument(f"gradient_accumulation_steps must be an integer >= 2 or unset; got {steps!r}")
        self._validate_groups()
        if self.learning_rate <= 0:
            raise InvalidArgument(f"learning_rate must be > 0; got {self.learning_rate!r}")
        ranges = {"momentum": (0, 1), "rho": (0, 1)}
        if self.name in ("adam", "adamw"):  # the other optimizers check their own (more_optimizers)
            ranges.update(beta_1=(0, 1), beta_2=(0, 1))
        for field, (low, high) in ranges.items():
            if field in takes and not low <= getattr(self, field) < high:
                raise InvalidArgument(f"{field} must be in [{low}, {high}); got {getattr(self, field)!r}")
        for field in ("epsilon", "initial_accumulator_value", "weight_decay"):
            if field in takes and getattr(self, field) is not None and getattr(self, field) < 0:
                raise InvalidArgument(f"{field} must be >= 0; got {getattr(self, field)!r}")
        if self.name == "adamw" and not self.weight_decay:
            raise InvalidArgument(f"adamw needs weight_decay > 0 (without it, it is adam); got {self.weight_decay!r}")
        clipping = [f for f in ("clipnorm", "clipvalue", "global_clipnorm") if getattr(self, f) is not None]
        for field in clipping:
            if getattr(self, field) < 0:
                raise InvalidArgument(f"{field} must be > 0 (or None); got {getattr(self, field)!r}")
        if len(clipping) > 1:
            raise InvalidArgument(f"only one of clipnorm, clipvalue and global_clipnorm may be set; got "
                                  f"{', '.join(f'{f}={getattr(self, f)!r}' for f in clipping)}")
        if not 0 <= self.ema_momentum <= 1:
            raise InvalidArgument(f"ema_momentum must be in [0, 1]; got {self.ema_momentum!r}")
        frequency = self.ema_overwrite_frequency
        if frequency is not None and (isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1):
            raise InvalidArgument(f"ema_overwrite_frequency must be an integer >= 1 (or None); got {frequency!r}")
        if self.learning_rate_schedule is not None:
            schedules.validate(self.learning_rate_schedule)

    def _validate_groups(self) -> None:
        for names, spec in self.groups or ():
            if spec.groups:
                raise InvalidArgument("an optimizer group holds no groups of its own")
            if (spec.sparse_rule, spec.gradient_accumulation_steps) != (self.sparse_rule,
                                                                       self.gradient_accumulation_steps):
                raise InvalidArgument("every optimizer group has the sparse_rule and gradient_accumulation_steps "
                                      "of the spec")
            twice = sorted(n for n in set(names) if list(names).count(n) > 1)
            if twice or not names or not all(isinstance(n, str) and n and SHARED_MARK not in n for n in names):
                raise InvalidArgument(f"each optimizer group names variables, at least one, each once, none with "
                                      f"{SHARED_MARK!r} in its name; got {list(names)}"
                                      + (f" ({twice[0]!r} twice)" if twice else ""))
            spec.validate()

    def stepped_names(self) -> list[list[str]]:
        """The names each group's optimizer steps its variables by (``ps_common.names.stepped_names``)."""
        return stepped_names([names for names, _ in self.groups or ()])

    def shared(self) -> dict[str, str]:
        """Each second name of a variable a later group names again (``shared_name``): its variable's."""
        return {s: n for (names, _), stepped in zip(self.groups or (), self.stepped_names())
                for n, s in zip(names, stepped) if s != n}

    def every(self) -> list["OptimizerSpec"]:
        """This spec and each group's (``Optimizer.every`` of the specs)."""
        return [self, *(spec for _, spec in self.groups or ())]

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line for a log: the name, the learning rate (or its schedule), and only the
        fields this optimizer takes that differ from its Keras default: ``adam learning_rate=0.001``,
        ``sgd learning_rate=0.1 momentum=0.9``."""
        if self.groups:
            return "; ".join(f"{spec.describe()} ({len(names)} variables)" for names, spec in self.groups)
        takes = OPTIMIZER_DEFAULTS.get(self.name, {})
        schedule = self.learning_rate_schedule
        if isinstance(schedule, dict):
            arguments = ", ".join(f"{k}={v!r}" for k, v in schedule.get("config", {}).items())
            rate = f"learning_rate_schedule={schedule.get('class_name', '?')}({arguments})"
        else:
            rate = f"learning_rate={self.learning_rate!r}"
        changed = [f"{f}={getattr(self, f)!r}" for f, default in takes.items()
                   if f != "learning_rate" and getattr(self, f) != default]
        return " ".join([self.name, rate, *changed])

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerSpec":
        """From ``as_dict`` (a checkpoint's header); fields it lacks (an older one) take their defaults."""
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidArgument(f"unknown optimizer spec fields: {', '.join(unknown)}")
        if "name" not in d:
            raise InvalidArgument("optimizer spec has no 'name'")
        return cls(**d)

    @classmethod
    def from_keras(cls, class_name: str, config: dict) -> "OptimizerSpec":
        """The spec of a Keras 3 optimizer: ``type(opt).__name__`` and ``opt.get_config()``.

        InvalidArgument, one line naming it, for what the server cannot run
        (``ps_common.names.keras_optimizer_fields``) or a value out of range (``validate``).
        """
        try:
            given = keras_optimizer_fields(class_name, config)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        spec = cls(**given)
        spec.validate()
        return spec


def _constants(spec: OptimizerSpec, dtype: np.dtype) -> dict:
    """The hyperparameters rounded into ``dtype`` the way Keras rounds each.

    Keras does not round them all alike; for float16 and float64 it shows
    (each of these choices is needed for float64 bit-identity):
    - learning_rate lives in a float32 variable that is then cast to dtype
      (a schedule's value is a float32 too);
    - ``ops.cast(python_float, dtype)`` (momentum, beta_1, beta_2 before the
      power, weight_decay, Adagrad's initial accumulator) goes through float32,
      as ``tf.cast`` first makes a Python float a float32 tensor;
    - a Python float that is an operand of an op (``1 - beta_1`` and
      ``1 - beta_2``, computed by Python in float64, epsilon, RMSprop's rho and
      momentum, clipnorm, clipvalue, ema_momentum) is converted to dtype directly.
    """
    via_float32 = lambda x: np.float32(x).astype(dtype)  # noqa: E731
    direct = lambda x: np.array(x, dtype=dtype)[()]  # noqa: E731
    c = {
        "lr": via_float32(spec.learning_rate),
        "momentum": via_float32(spec.momentum),
        "beta_1": via_float32(spec.beta_1),
        "beta_2": via_float32(spec.beta_2),
        "one_minus_beta_1": direct(1 - spec.beta_1),
        "one_minus_beta_2": direct(1 - spec.beta_2),
        "epsilon": direct(spec.epsilon),
        "one": direct(1),
        "zero": direct(0),
        "rho": direct(spec.rho),
        "one_minus_rho": direct(1 - spec.rho),
        "rms_momentum": direct(spec.momentum),
        "initial_accumulator": via_float32(spec.initial_accumulator_value),
        "ema_momentum": direct(spec.ema_momentum),
    }
    if spec.weight_decay is not None:
        c["weight_decay"] = via_float32(spec.weight_decay)
    if spec.clipnorm is not None:
        c["clipnorm"] = direct(spec.clipnorm)
    if spec.clipvalue is not None:
        c["clipvalue"], c["minus_clipvalue"] = direct(spec.clipvalue), direct(-spec.clipvalue)
    if spec.global_clipnorm is not None:
        c["global_clipnorm"] = direct(spec.global_clipnorm)
        c["inverse_global_clipnorm"] = direct(1.0 / spec.global_clipnorm)  # Python's 1.0 / clip_norm
    return c


def squares(g: "np.ndarray | Occurrences") -> np.floating:
    """``ops.sum(ops.square(g))``: the squares in g's dtype, added as TensorFlow adds them
    (a float16/32/64 gradient's; InvalidArgument for another dtype). Of ``Occurrences``
    (an ``IndexedSlices``, ``--sparse-rule keras``): each occurrence squared, densified
    (a repeated row adds its occurrences' squares), then summed."""
    if isinstance(g, Occurrences):
        _check_float_array("gradient", g.values)
        return tf_sum(g.dense(np.square(g.values)).ravel())
    g = np.asarray(g)
    if g.dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"gradients must be float16/float32/float64; got {g.dtype}")
    return tf_sum(np.square(g).ravel())


def tf_sum(x: np.ndarray) -> np.floating:
    """The sum of the 1-D array ``x`` in the order of TensorFlow's CPU ``reduce_sum``, so
    rounded alike: Eigen's full reduction. Above 1024 packets it halves the range (at a
    packet boundary) and adds the two halves' sums; below, four packet accumulators
    (8 float32 or 4 float64 lanes) take 4 packets at a time, the rest of the packets is
    added to their sum ``((p0 + p1) + p2) + p3``, the last elements go one by one into a
    scalar, and the lanes are folded by halves into it. Checked against TensorFlow 2.21
    (``tests/core/test_optimizers.py``; by hand on every size to 300 and on random sizes to
    100,000 float32 / 50,000 float64 elements, above which TensorFlow shares the sum out
    among its threads). float16, which Eigen adds otherwise, is summed in float64 and
    rounded once.
    """
    if x.dtype == np.float16:
        return np.sum(x, dtype=np.float64).astype(np.float16)
    return tf_sum_range(x, 0, len(x))


def tf_sum_range(x: np.ndarray, first: int, n: int) -> np.floating:
    """Eigen's ``InnerMostDimReducer`` over ``x[first:first + n]`` (``tf_sum``)."""
    lanes = 32 // x.dtype.itemsize  # one AVX register
    scalar = x.dtype.type

    def leaf(seg: np.ndarray) -> np.floating:
        n = len(seg)
        unrolled, vectorized = n // (4 * lanes) * (4 * lanes), n // lanes * lanes
        if unrolled:  # add.accumulate adds strictly in order (np.add.reduce would pair)
            p = np.add.accumulate(seg[:unrolled].reshape(-1, 4, lanes), axis=0)[-1]
            packet = ((p[0] + p[1]) + p[2]) + p[3]
        else:
            packet = np.zeros(lanes, x.dtype)
        for j in range(unrolled, vectorized, lanes):
            packet = packet + seg[j:j + lanes]
        total = scalar(0)
        for v in seg[vectorized:]:
            total = scalar(total + v)
        while len(packet) > 1:
            half = len(packet) // 2
            packet = packet[:half] + packet[half:]
        return scalar(total + packet[0])

    def tree(first: int, n: int) -> np.floating:
        if n <= lanes * 1024:
            return leaf(x[first:first + n])
        split = lanes * -(-(first + -(-n // 2)) // lanes)
        left = min(split - first, n)
        total = tree(first, left)
        return scalar(total + tree(split, n - left)) if left < n else total

    return tree(first, n)


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
    """One update rule. Subclasses name their slots and define ``_step``; ``apply`` adds
    what Keras' ``BaseOptimizer.apply`` adds around every step (see the module docstring)."""

    slot_names: tuple[str, ...] = ()

    def __init__(self, spec: OptimizerSpec):
        spec.validate()
        self.spec = spec
        self._constants = {dtype: _constants(spec, dtype) for dtype in FLOAT_DTYPES}
        self._scheduled: tuple[int, np.float32] = (-1, np.float32(0))  # (update count, its scheduled rate)
        self.groups: dict[str, Optimizer] = {}  # spec.groups: each group's variables' optimizer (make_optimizer)

    def of(self, name: str) -> "Optimizer":
        """The optimizer that steps variable ``name``: its group's (as that one steps it), else this one."""
        group = self.groups.get(name)
        return self if group is None else group.of(name)

    def every(self) -> list["Optimizer"]:
        """This optimizer and each group's."""
        return [self, *{id(o): o for o in self.groups.values()}.values()]

    def _initial_slots(self, value: np.ndarray) -> dict:
        """The slots' values before the first step (zeros, as Keras' ``add_variable_from_reference``)."""
        return {name: np.zeros_like(value) for name in self.slot_names}

    def init_state(self, value: np.ndarray) -> dict:
        """The slots shaped like ``value`` (with ``use_ema`` an ``ema`` slot), plus ``iterations =
        0``. With ``gradient_accumulation_steps`` also Keras' accumulator, ``accumulated``, and
        0-d counts of the window under way: its batches in the accumulator (``accumulate``) and,
        with ``use_ema``, those whose moves are made already (``ema_moved``: ``averaged``)."""
        _check_float_array("variable", value)
        state: dict = self._initial_slots(value)
        if self.spec.use_ema:
            state["ema"] = np.zeros_like(value)  # Keras' "average" variables start at zero
        if self.spec.gradient_accumulation_steps:
            state["accumulated"] = np.zeros_like(value)
            state["accumulated_batches"] = np.zeros((), value.dtype)
            if self.spec.use_ema:
                state["ema_moved"] = np.zeros((), value.dtype)
        state["iterations"] = 0
        return state

    def accumulate(self, value: np.ndarray, grad: np.ndarray, state: dict) -> tuple[np.ndarray, dict]:
        """Pure, like ``apply``: a batch of a ``gradient_accumulation_steps`` window before its
        last, as Keras' optimizer takes it where the server holds the window (elastic sync: a
        round is a batch): the gradient added to ``accumulated``, the average moved for the batch
        (``averaged``) and, in a window whose update overwrites, the variable made the average.
        The window's last batch is ``apply`` of ``window_mean``."""
        held = int(state["accumulated_batches"])
        if held + 1 >= (self.spec.gradient_accumulation_steps or 0):
            raise InvalidArgument(f"batch {held + 1} of a window of {self.spec.gradient_accumulation_steps} "
                                  "is its update: apply window_mean")
        _check_like("gradient", grad, value)
        state = {**state, "accumulated": np.add(state["accumulated"], grad),
                 "accumulated_batches": np.asarray(held + 1, value.dtype)}
        if self.spec.use_ema:
            average, state = self.averaged(value, state, held + 1)
            value = average.copy() if self._overwrites(int(state["iterations"])) else value
        return value, state

    def window_ends(self, state: dict) -> bool:
        """Whether the next batch ends the window ``accumulate`` holds (its update)."""
        return int(state["accumulated_batches"]) + 1 >= self.spec.gradient_accumulation_steps

    def window_mean(self, grad: np.ndarray, state: dict) -> np.ndarray:
        """The window's last batch's gradient as Keras' update takes it: ``(g + accumulated) / k``."""
        _check_like("gradient", grad, state["accumulated"])
        return np.asarray(np.divide(np.add(grad, state["accumulated"]),
                                    np.asarray(self.spec.gradient_accumulation_steps, grad.dtype)))

    def global_clip_scale(self, grads: Iterable[np.ndarray]) -> np.floating | None:
        """With ``global_clipnorm``: the factor Keras' ``clip_by_global_norm`` multiplies every
        gradient of one update by, from all of them (the trainable ones, in the model's
        order); else None (``clip_scale_of`` of their ``squares``)."""
        if self.spec.global_clipnorm is None:
            return None
        return self.clip_scale_of([squares(g) for g in grads])

    def clip_scale_of(self, squared: Sequence[np.floating]) -> np.floating | None:
        """``global_clip_scale`` from each gradient's ``squares``, in the model's order:
        ``clip_norm * min(1 / norm, 1 / clip_norm) + (norm - norm)``, in the gradients'
        dtype, as Keras writes it (NaN for a non-finite norm, as Keras). Several server
        shards hand their squares to one (``core.clip_group``) and get this same factor."""
        if self.spec.global_clipnorm is None or not squared:
            return None
        dtype = np.result_type(*(np.asarray(s).dtype for s in squared))
        if dtype not in FLOAT_DTYPES:
            raise InvalidArgument(f"gradients must be float16/float32/float64; got {dtype}")
        c = self._constants[dtype]
        stacked = np.array(squared).astype(dtype)  # ops.stack
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            norm = np.sqrt(tf_sum(stacked))
            scale = c["global_clipnorm"] * np.minimum(c["one"] / norm, c["inverse_global_clipnorm"])
            return (scale + (norm - norm)).astype(dtype)

    def step_constants(self, dtype: np.dtype, iterations: int, lr_scale: float = 1.0) -> dict:
        """The step's constants in ``dtype``, with the learning rate the step takes: Keras'
        schedule at ``iterations`` (before the step; with ``gradient_accumulation_steps`` k,
        update j is at Keras' real iterations j * k + k - 1), times ``lr_scale``."""
        c = self._constants[dtype]
        k = self.spec.gradient_accumulation_steps
        if k:
            iterations = iterations * k + k - 1
        lr = c["lr"]
        if self.spec.learning_rate_schedule is not None:
            at, scheduled = self._scheduled  # one tuple, read and replaced whole: safe across threads
            if at != iterations:
                scheduled = schedules.learning_rate(self.spec.learning_rate_schedule, iterations)
                self._scheduled = (iterations, scheduled)
            lr = scheduled.astype(dtype)
        if lr_scale != 1.0:
            if not 0.0 < lr_scale <= 1.0:
                raise InvalidArgument(f"lr_scale must be in (0, 1], got {lr_scale!r}")
            lr = (lr * np.float64(lr_scale)).astype(dtype)
        return c if lr is c["lr"] else {**c, "lr": lr}

    def apply(self, value: np.ndarray, grad: np.ndarray, state: dict,
              lr_scale: float = 1.0, clip_scale: np.floating | None = None) -> tuple[np.ndarray, dict]:
        """Pure: returns (new_value, new_state); never mutates `value`, `grad` or arrays in `state`.

        ``lr_scale`` multiplies the learning rate of this one step (async/SSP stale-gradient
        policy "scale"); 1.0 computes exactly what Keras computes. ``clip_scale`` is this
        update's ``global_clip_scale`` (required with ``global_clipnorm``). ``grad`` may be
        ``Occurrences`` (``--sparse-rule keras``): the step Keras 3 takes for an ``IndexedSlices``."""
        _check_float_array("variable", value)
        if isinstance(grad, Occurrences):
            grad.check(value)
            if spec_refusal := slices_refusal(self.spec):
                raise InvalidArgument(spec_refusal)
            if self.spec.global_clipnorm is not None:  # Keras' ``v * scale`` makes the slices dense
                grad = grad.dense()
        else:
            _check_float_array("gradient", grad)
            _check_like("gradient", grad, value)
        spec = self.spec
        slot_names = (*self.slot_names, "ema") if spec.use_ema else self.slot_names
        missing = [k for k in (*slot_names, "iterations") if k not in state]
        if missing:
            raise InvalidArgument(f"optimizer state lacks {', '.join(missing)}")
        for name in slot_names:
            _check_like(f"slot {name!r}", state[name], value)
        if spec.global_clipnorm is not None and clip_scale is None:
            raise InvalidArgument("global_clipnorm clips by the norm of the whole update: pass its "
                                  "global_clip_scale (VariableStore.apply_all/apply_push do)")
        iterations, moved = int(state["iterations"]), int(state.get("ema_moved", 0))
        accumulated, accumulated_batches = state.get("accumulated"), state.get("accumulated_batches", 0)
        shape = value.shape
        if not shape:  # NumPy turns 0-d results into scalars, which take no ``out=``: step on shape [1]
            value, grad = value.reshape(1), grad.reshape(1)
            state = {name: state[name].reshape(1) for name in slot_names}
        dtype, before = value.dtype, value
        c = self.step_constants(dtype, iterations, lr_scale)
        k, overwrites = spec.gradient_accumulation_steps, self._overwrites(iterations)
        if spec.use_ema and k:  # the window's k - 1 batches that only accumulated (those a fit's end moved aside)
            state = {**state, "ema": self._moved(state["ema"], before, iterations, c, k - 1 - moved, overwrites)}
            value = state["ema"] if overwrites else value
        with np.errstate(invalid="ignore", divide="ignore"):  # Keras' NaN/inf where it has them
            grad = grad.clipped(self._clip, c) if isinstance(grad, Occurrences) else self._clip(grad, c, clip_scale)
        if spec.weight_decay is not None:  # TensorFlow's _apply_weight_decay: w.assign_sub(w * wd * lr)
            decay = np.multiply(value, c["weight_decay"])
            np.multiply(decay, c["lr"], out=decay)
            value = np.subtract(value, decay, out=decay)
        if isinstance(grad, Occurrences):  # --sparse-rule keras
            new_value, slots = self._slices_step(value, grad, state, iterations, c)
        else:
            new_value, slots = self._step(value, grad, state, iterations, c)
        if spec.use_ema:
            # Keras moves the average at every batch, with the variable as it is then: here the
            # update's (with gradient_accumulation_steps the window's others moved above).
            slots["ema"] = ema = self._moved(state["ema"], new_value, iterations, c)
            if k:
                slots["ema_moved"] = np.zeros((), dtype)
            if overwrites:
                new_value = ema.copy()
        # Back to the variable's shape: the slots shaped like it (not Adafactor's factored moments).
        slots = {name: (x.reshape(shape) if name in slot_names else x) for name, x in slots.items()}
        if k:  # the window stepped: an empty accumulator (the one it was, where accumulate held none)
            slots["accumulated"] = accumulated if accumulated is not None and not int(accumulated_batches) \
                else np.zeros(shape, dtype)
            slots["accumulated_batches"] = np.zeros((), dtype)
        return new_value.reshape(shape), {**slots, "iterations": iterations + 1}

    def _overwrites(self, iterations: int) -> bool:
        """Whether the update after ``iterations`` overwrites the variable with its average (every
        ``ema_overwrite_frequency`` updates: Keras, ``(iterations + 1) % frequency == 0``)."""
        frequency = self.spec.ema_overwrite_frequency
        return bool(self.spec.use_ema and frequency and (iterations + 1) % frequency == 0)

    @staticmethod
    def _moved(ema: np.ndarray, value: np.ndarray, iterations: int, c: dict, times: int = 1,
               overwriting: bool = False) -> np.ndarray:
        """``times`` of Keras' moves of the average (a new array): ``momentum * average + (1 -
        momentum) * w``, momentum 0 while ``iterations`` (updates; Keras' ``_iterations // k``) is 0.
        ``overwriting``: ``w`` is ``value`` for the first move, then the average (Keras overwrote it)."""
        momentum = c["ema_momentum"] if iterations != 0 else c["zero"]
        for _ in range(times):
            ema = np.multiply(ema, momentum)
            ema += np.multiply(value, c["one"] - momentum)
            value = ema if overwriting else value
        return ema

    def averaged(self, value: np.ndarray, state: dict, batches: int = 0) -> tuple[np.ndarray, dict]:
        """Pure: (the moving average, the new state), Keras' ``finalize_variable_values`` with
        ``use_ema`` (the end of ``fit``). ``batches``: those of a ``gradient_accumulation_steps``
        window under way, for each of which Keras moved the average with the variable's ``value``;
        they are moved here first, those an earlier call moved (``ema_moved``) not again."""
        k = self.spec.gradient_accumulation_steps
        if batches and (not k or isinstance(batches, bool) or not 0 < batches < k):
            raise InvalidArgument(f"a window under way holds 1 to gradient_accumulation_steps - 1 batches "
                                  f"(this optimizer's {k}); got {batches!r}")
        moved = int(state.get("ema_moved", 0))
        if batches <= moved:
            return state["ema"], state
        c = self._constants[value.dtype]
        iterations = int(state["iterations"])
        ema = np.asarray(self._moved(state["ema"], value, iterations, c, batches - moved, self._overwrites(iterations)),
                         value.dtype)
        return ema, {**state, "ema": ema, "ema_moved": np.asarray(batches, value.dtype)}

    def apply_rows(self, value: np.ndarray, rows: np.ndarray, grad: np.ndarray, state: dict,
                   lr_scale: float = 1.0, clip_scale: np.floating | None = None) -> tuple[np.ndarray, dict]:
        """Pure, like ``apply``: one step of rows ``rows`` (distinct) of ``value`` for their
        gradient ``grad`` (``grad[i]`` is row ``rows[i]``'s), every other row left out.

        Returns (the new values of those rows, the new state): each slot shaped like the
        variable holds only those rows (in the order of ``rows``), a slot of another shape
        (Nadam's 0-d ``u_product``) and ``iterations`` are whole. The caller writes the rows
        back (``VariableStore``). Every step here is elementwise once its scalars are fixed,
        so these are those rows' bits of ``apply`` on the whole variable with zeros
        elsewhere; the exceptions need the whole variable (``clipnorm``,
        ``global_clipnorm``, ``use_ema``: ``core.optim.sparse.row_wise``) and are not for here.
        ``grad`` may be ``Occurrences`` whose positions index ``rows``."""
        _check_float_array("variable", value)
        if not value.shape:
            raise InvalidArgument("apply_rows needs a variable with rows; this one is 0-d")
        # np.take: the same rows as value[rows], several times faster for a 2-D table
        gathered = {k: (np.take(v, rows, axis=0) if isinstance(v, np.ndarray) and v.shape == value.shape else v)
                    for k, v in state.items()}
        return self.apply(np.take(value, rows, axis=0), grad, gathered, lr_scale, clip_scale)

    def _clip(self, g: np.ndarray, c: dict, clip_scale) -> np.ndarray:
        """Keras' ``_clip_gradients`` for one variable (``clip_scale``: the global one)."""
        spec = self.spec
        if spec.clipnorm is not None:  # _clip_by_norm: g * clipnorm / max(norm, clipnorm), norm 0 if l2sum <= 0
            l2sum = squares(g)
            l2norm = np.sqrt(l2sum) if l2sum > 0 else l2sum
            clipped = np.multiply(g, c["clipnorm"])
            return np.divide(clipped, np.maximum(l2norm, c["clipnorm"]), out=clipped)
        if spec.global_clipnorm is not None:
            return np.multiply(g, np.asarray(clip_scale).astype(g.dtype))
        if spec.clipvalue is not None:
            return np.clip(g, c["minus_clipvalue"], c["clipvalue"])
        return g

    def _step(self, w, g, state, iterations, c) -> tuple[np.ndarray, dict]:
        raise NotImplementedError

    def _slices_step(self, w, occ: "Occurrences", state, iterations, c) -> tuple[np.ndarray, dict]:
        """``_step`` for a gradient held as Keras holds an ``IndexedSlices`` (``Occurrences``)."""
        raise InvalidArgument(f"--sparse-rule keras: Keras' step of {self.spec.name} for an IndexedSlices "
                              f"gradient is not implemented here; run the server with --sparse-rule sum")


class SGD(Optimizer):
    """``keras.optimizers.SGD``: w - g*lr; with momentum m = m*mu - g*lr, w + m."""

    def __init__(self, spec: OptimizerSpec):
        super().__init__(spec)
        # Like Keras, keep a momentum slot only when momentum is not 0.
        self.slot_names = ("momentum",) if spec.momentum != 0 else ()

    def _step(self, w, g, state, iterations, c):
        # The same IEEE operations as the formulas above, in as few fresh arrays as
        # possible (``out=`` into temporaries): a fresh array is fresh pages to fault in;
        # first, the same operations fused into one pass (ps_server.core.optim.kernels).
        if not self.slot_names:
            fused = kernels.sgd(w, g, c["lr"])
            if fused is not None:
                return fused[0], {}
        else:
            fused = kernels.sgd_momentum(w, g, state["momentum"], c["lr"], c["momentum"], self.spec.nesterov)
            if fused is not None:
                return fused[0], {"momentum": fused[1]}
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

    def _slices_step(self, w, occ, state, iterations, c):
        step = np.multiply(occ.values, c["lr"])  # g*lr, per occurrence
        if not self.slot_names:
            return occ.scatter_sub(w, step), {}  # assign_sub of slices: one occurrence after another
        summed = occ.dense(step)  # m*mu - g*lr densifies g*lr
        m = np.multiply(state["momentum"], c["momentum"])
        np.subtract(m, summed, out=m)
        if self.spec.nesterov:
            ahead = np.multiply(m, c["momentum"])
            np.subtract(ahead, summed, out=ahead)
            return np.add(w, ahead, out=ahead), {"momentum": m}
        return np.add(w, m), {"momentum": m}


class Adam(Optimizer):
    """``keras.optimizers.Adam`` and ``AdamW`` (Adam with weight_decay, which ``apply``
    adds), bias correction folded into alpha; with amsgrad a ``v_hat`` slot."""

    def __init__(self, spec: OptimizerSpec):
        super().__init__(spec)
        self.slot_names = ("m", "v", "v_hat") if spec.amsgrad else ("m", "v")

    def _step(self, w, g, state, iterations, c):
        alpha = self._alpha(w.dtype, iterations, c)
        fused = kernels.adam(w, g, state["m"], state["v"], state["v_hat"] if self.spec.amsgrad else None,
                             c["one_minus_beta_1"], c["one_minus_beta_2"], alpha, c["epsilon"])
        if fused is not None:  # the operations below, in one pass
            new_w, m, v, v_hat = fused
            return new_w, ({"m": m, "v": v, "v_hat": v_hat} if self.spec.amsgrad else {"m": m, "v": v})
        return self._moments_step(w, g, np.square(g), state, alpha, c)

    def _slices_step(self, w, occ, state, iterations, c):
        # g - m and square(g) - v densify: the occurrences summed, and their squares summed
        return self._moments_step(w, occ.dense(), occ.dense(np.square(occ.values)), state,
                                  self._alpha(w.dtype, iterations, c), c)

    def _alpha(self, dtype, iterations, c):
        with np.errstate(over="ignore"):  # float16 step > 65504 is inf, as in Keras
            local_step = np.array(iterations + 1).astype(dtype)[()]
        beta_1_power = _scalar_pow(c["beta_1"], local_step)
        beta_2_power = _scalar_pow(c["beta_2"], local_step)
        return c["lr"] * np.sqrt(c["one"] - beta_2_power) / (c["one"] - beta_1_power)

    def _moments_step(self, w, g, squared, state, alpha, c):
        # m + (g - m) * (1 - beta_1); v + (g^2 - v) * (1 - beta_2); w - (m * alpha) / (sqrt(v) + eps),
        # operation by operation as written, into reused temporaries (see SGD). ``squared`` is g^2.
        m = np.subtract(g, state["m"])
        np.multiply(m, c["one_minus_beta_1"], out=m)
        np.add(state["m"], m, out=m)
        v = squared
        np.subtract(v, state["v"], out=v)
        np.multiply(v, c["one_minus_beta_2"], out=v)
        np.add(state["v"], v, out=v)
        slots = {"m": m, "v": v}
        if self.spec.amsgrad:  # v_hat = max(v_hat, v); the step divides by sqrt(v_hat)
            v = slots["v_hat"] = np.maximum(state["v_hat"], v)
        denominator = np.sqrt(v)
        np.add(denominator, c["epsilon"], out=denominator)
        update = np.multiply(m, alpha)
        np.divide(update, denominator, out=update)
        return np.subtract(w, update, out=update), slots


class Adagrad(Optimizer):
    """``keras.optimizers.Adagrad``: acc + g^2; w - (lr * g) / sqrt(acc + eps)."""

    slot_names = ("accumulator",)

    def _initial_slots(self, value):
        # Keras: initializers.Constant(initial_accumulator_value), through float32.
        return {"accumulator": np.full_like(value, self._constants[value.dtype]["initial_accumulator"])}

    def _step(self, w, g, state, iterations, c):
        fused = kernels.adagrad(w, g, state["accumulator"], c["lr"], c["epsilon"])
        if fused is not None:  # the operations below, in one pass
            return fused[0], {"accumulator": fused[1]}
        accumulator = np.square(g)
        np.add(state["accumulator"], accumulator, out=accumulator)
        denominator = np.add(accumulator, c["epsilon"])
        np.sqrt(denominator, out=denominator)
        update = np.multiply(g, c["lr"])
        np.divide(update, denominator, out=update)
        return np.subtract(w, update, out=update), {"accumulator": accumulator}

    def _slices_step(self, w, occ, state, iterations, c):
        # assign_add(acc, square(g)) scatters each occurrence's square; lr * g / sqrt(acc + eps)
        # stays slices (the denominator's rows gathered), and assign_sub scatters them in turn.
        accumulator = occ.scatter_add(state["accumulator"], np.square(occ.values))
        denominator = np.add(accumulator, c["epsilon"])
        np.sqrt(denominator, out=denominator)
        update = np.multiply(occ.values, c["lr"])
        np.divide(update, occ.gather(denominator), out=update)
        return occ.scatter_sub(w, update), {"accumulator": accumulator}


class RMSprop(Optimizer):
    """``keras.optimizers.RMSprop``: v = rho*v + (1-rho)*g^2 (centered: a = rho*a + (1-rho)*g,
    v - a^2); increment (lr*g) / sqrt(v + eps); with momentum m = momentum*m + increment, w - m."""

    def __init__(self, spec: OptimizerSpec):
        super().__init__(spec)
        self.slot_names = (("velocity",) + (("momentum",) if spec.momentum > 0 else ())
                           + (("average_gradient",) if spec.centered else ()))

    def _step(self, w, g, state, iterations, c):
        momentum = "momentum" in self.slot_names
        fused = kernels.rmsprop(w, g, state["velocity"], state["momentum"] if momentum else None,
                                state["average_gradient"] if self.spec.centered else None,
                                c["lr"], c["rho"], c["one_minus_rho"], c["rms_momentum"], c["epsilon"])
        if fused is not None:  # the operations below, in one pass
            new_w, velocity, m, average = fused
            slots = {"velocity": velocity}
            if momentum:
                slots["momentum"] = m
            if self.spec.centered:
                slots["average_gradient"] = average
            return new_w, slots
        slots, denominator = self._denominator(state, c, np.multiply(np.square(g), c["one_minus_rho"]),
                                               lambda: np.multiply(g, c["one_minus_rho"]))
        increment = np.multiply(g, c["lr"])
        np.divide(increment, denominator, out=increment)
        if "momentum" in self.slot_names:
            m = np.multiply(state["momentum"], c["rms_momentum"])
            m += increment
            slots["momentum"] = m
            return np.subtract(w, m, out=increment), slots
        return np.subtract(w, increment, out=increment), slots

    def _denominator(self, state, c, scaled_squares, scaled_gradient) -> tuple[dict, np.ndarray]:
        """(the new velocity, and centered the average, as slots; sqrt of the denominator):
        ``rho * v + scaled_squares``, centered less the square of ``rho * a + scaled_gradient()``."""
        velocity = np.multiply(state["velocity"], c["rho"])
        velocity += scaled_squares
        slots = {"velocity": velocity}
        if self.spec.centered:
            average = np.multiply(state["average_gradient"], c["rho"])
            average += scaled_gradient()
            slots["average_gradient"] = average
            denominator = np.subtract(velocity, np.square(average))
            denominator += c["epsilon"]
        else:
            denominator = np.add(velocity, c["epsilon"])
        return slots, np.sqrt(denominator, out=denominator)

    def _slices_step(self, w, occ, state, iterations, c):
        # rho*v + (1-rho)*square(g): the scaled squares per occurrence, densified when added;
        # so (1-rho)*g for the centered average. lr*g / sqrt(denominator) stays slices (its rows
        # gathered): momentum densifies it, else assign_sub scatters it occurrence by occurrence.
        slots, denominator = self._denominator(state, c, occ.dense(np.multiply(np.square(occ.values),
                                                                              c["one_minus_rho"])),
                                               lambda: occ.dense(np.multiply(occ.values, c["one_minus_rho"])))
        increment = np.multiply(occ.values, c["lr"])
        np.divide(increment, occ.gather(denominator), out=increment)
        if "momentum" in self.slot_names:
            m = np.multiply(state["momentum"], c["rms_momentum"])
            m += occ.dense(increment)
            slots["momentum"] = m
            return np.subtract(w, m), slots
        return occ.scatter_sub(w, increment), slots


# The optimizers whose Keras step of an IndexedSlices gradient ``_slices_step`` repeats.
SLICES_OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adamax", "nadam", "ftrl", "lion",
                     "schedule_free_adamw", "muon")


def slices_refusal(spec: OptimizerSpec) -> str | None:
    """Why ``--sparse-rule keras`` cannot run optimizer ``spec`` (one line), or None."""
    if spec.name not in SLICES_OPTIMIZERS:
        return (f"--sparse-rule keras: Keras' step of {spec.name} for an IndexedSlices gradient is not "
                f"implemented here (only {', '.join(SLICES_OPTIMIZERS)}); run the server with --sparse-rule sum")
    if spec.name == "adagrad" and spec.epsilon == 0 and spec.initial_accumulator_value == 0:
        return ("--sparse-rule keras: Adagrad with epsilon 0 and initial_accumulator_value 0 divides by zero, "
                "where Keras' IndexedSlices division takes another path; run the server with --sparse-rule sum")
    return None


class Occurrences:
    """A gradient as Keras 3's TensorFlow backend holds a ``tf.IndexedSlices`` (``--sparse-rule
    keras``): occurrence ``i`` adds ``values[i]`` to row ``positions[i]`` of the variable (or
    of the rows ``apply_rows`` gathered); a row may occur several times and is not summed first.

    The backend's ops on such a gradient, which each optimizer's ``_slices_step`` repeats:
    an elementwise op with a scalar (``square``, ``abs``, ``g * lr``) works on each
    occurrence (``values``); an op that mixes them with a dense slot densifies them first,
    ``tf.convert_to_tensor``: from zeros, each occurrence added in order (``dense``); a
    division by a dense array takes its rows at the occurrences (``gather``); and
    ``assign_add``/``assign_sub`` of slices scatter them into the variable one occurrence
    after another (``scatter_add``, ``scatter_sub``)."""

    def __init__(self, positions: np.ndarray, values: np.ndarray):
        self.positions = np.asarray(positions, dtype=np.intp)
        self.values = values
        self.rows = 0  # the block's row count: set by check()

    def check(self, value: np.ndarray) -> None:
        _check_float_array("gradient", self.values)
        if not value.shape:
            raise InvalidArgument("a sparse gradient needs a variable with rows; this one is 0-d")
        if self.values.shape != (len(self.positions),) + value.shape[1:] or self.values.dtype != value.dtype:
            raise InvalidArgument(f"sparse gradient is {self.values.dtype}{list(self.values.shape)} for "
                                  f"{len(self.positions)} row(s) of a variable {value.dtype}{list(value.shape)}")
        if len(self.positions) and (self.positions.min() < 0 or self.positions.max() >= value.shape[0]):
            raise InvalidArgument(f"sparse gradient names a row outside 0..{value.shape[0] - 1}")
        self.rows = value.shape[0]

    def clipped(self, clip, c: dict) -> "Occurrences":
        """``clipvalue`` and ``clipnorm`` as TensorFlow clips an ``IndexedSlices``: its values."""
        out = Occurrences(self.positions, clip(self.values, c, None))
        out.rows = self.rows
        return out

    def dense(self, values: np.ndarray | None = None) -> np.ndarray:
        """``values`` (default: the gradient's own) densified: ``unsorted_segment_sum``."""
        values = self.values if values is None else values
        out = np.zeros((self.rows,) + values.shape[1:], values.dtype)
        np.add.at(out, self.positions, values)
        return out

    def gather(self, x: np.ndarray) -> np.ndarray:
        return np.take(x, self.positions, axis=0)

    def scatter_add(self, x: np.ndarray, values: np.ndarray) -> np.ndarray:
        out = x.copy()
        np.add.at(out, self.positions, values)
        return out

    def scatter_sub(self, x: np.ndarray, values: np.ndarray) -> np.ndarray:
        out = x.copy()
        np.subtract.at(out, self.positions, values)
        return out


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
