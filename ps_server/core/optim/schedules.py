"""Learning-rate schedules of ``keras.optimizers.schedules``, evaluated on the server.

    spec = optimizer.get_config()["learning_rate"]  # a float, or serialize(schedule)
    validate(spec)                                  # before training starts
    lr = learning_rate(spec, step)                  # np.float32, at each update

``spec`` is a plain number (a constant learning rate) or the dict that
``keras.optimizers.schedules.serialize(schedule)`` returns (``class_name``,
``config``, ``module``, ``registered_name``) for one of Keras' own schedules:
``ExponentialDecay`` (staircase or not), ``PiecewiseConstantDecay``,
``PolynomialDecay`` (any power, cycle or not), ``InverseTimeDecay`` (staircase
or not), ``CosineDecay`` (alpha, warmup_target/warmup_steps) and
``CosineDecayRestarts`` (t_mul, m_mul, alpha).

``step`` is the server's update count: the number of optimizer steps already
applied, what Keras calls ``optimizer.iterations`` when it reads the learning
rate of the next step (so the first update uses step 0).

Guarantee: the value is the float32 that the Keras 3.15 schedule returns at
that step on TensorFlow 2.21 CPU when called eagerly (``schedule(step)``, or
the optimizer's ``learning_rate`` at ``iterations == step``), bit for bit,
for every schedule and option above (``tests/core/test_schedules.py``: steps
0..200 and up to 10**10). Each schedule repeats Keras' operations in Keras'
order, every intermediate a float32 as in Keras (``ops.cast`` of each
hyperparameter; a Python-float operand such as ``1 - alpha`` of
``CosineDecay`` rounded from float64 once, as TensorFlow converts it).
TensorFlow's scalar Pow, Cos and Log kernels call the C library's ``powf``,
``cosf`` and ``logf``, which are not correctly rounded, so the server calls
the same functions (``C_LIBRARY``, through ctypes): bit-identity holds when the
server's C library is the workers' (glibc 2.36 here). With another one, or
none (float64 ``math`` rounded to float32 then stands in), a value can be
1 ulp off in ``pow``/``cos``/``log``; measured here without libm: 3 of the
tests' 3,952 values differ, by at most 8.9e-8 relative (1e-6 is tested).

Inside a compiled step (``tf.function``, as ``model.fit`` runs it) Keras itself
rounds differently from eager Keras: Grappler turns a division by a constant
into a multiplication by its float32 reciprocal, XLA fuses further. Measured
on these tests, that compiled value differs from this module's (= eager) by
at most 6.2e-7 of the schedule's largest value (1e-6 is tested), both with
and without XLA, with one exception that is Keras' bug: under XLA,
``PolynomialDecay`` with ``power=0.5`` gives NaN at ``step == decay_steps``
(measured on steps 80..399 with decay_steps 90; not investigated further);
here it is ``end_learning_rate``, as eagerly.

Anything else is refused with ``InvalidArgument`` naming it, never replaced by
something close: a user's own ``LearningRateSchedule`` subclass (registered or
not), an unknown ``class_name``, a config key this module does not know, a
missing or non-finite number. ``validate`` checks a spec fully without
evaluating it; ``learning_rate`` validates too, and refuses a step at which
Keras' value is not finite (``CosineDecayRestarts`` with ``t_mul < 1`` runs out
of restarts and gives NaN).

The result is a float32, as Keras' schedule returns for Python-float
hyperparameters; the optimizers cast it to the variable's dtype as they cast
a constant learning rate. Plain Python (ctypes for the C library) and NumPy
only: the server never imports TensorFlow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from numbers import Real

import numpy as np

from ps_server.core.errors import InvalidArgument

KERAS_MODULE = "keras.optimizers.schedules"

f32 = np.float32


# --- The C library's float32 functions, as TensorFlow's scalar kernels call them ---------------
# TensorFlow's Pow, Cos and Log kernels call std::pow/cos/log on float, that is the C
# library's powf, cosf and logf. Those are not correctly rounded (glibc 2.36's cosf is 1 ulp
# off the float64 cos rounded to float32 at some arguments), and NumPy's float32 functions are
# others again; so the server calls the same C functions through ctypes. Without a C library
# that has them, float64 `math` rounded to float32 stands in (within 1 ulp of it).


def _load_c_float_functions():
    # glibc's name first: find_library runs ldconfig in a subprocess.
    for find in (lambda: "libm.so.6", lambda: ctypes.util.find_library("m")):
        name = find()
        if not name:
            continue
        try:
            libm = ctypes.CDLL(name)
            functions = (libm.powf, libm.cosf, libm.logf)
        except (OSError, AttributeError):
            continue
        for function, arity in zip(functions, (2, 1, 1)):
            function.restype = ctypes.c_float
            function.argtypes = [ctypes.c_float] * arity
        return name, functions
    return None, None


C_LIBRARY, _C_FUNCTIONS = _load_c_float_functions()


def _pow(base: np.float32, exponent: np.float32) -> np.float32:
    """``tf.pow`` of two float32 scalars: ``powf``."""
    if _C_FUNCTIONS:
        return f32(_C_FUNCTIONS[0](base, exponent))
    try:
        return f32(math.pow(float(base), float(exponent)))
    except (ValueError, OverflowError):  # math raises where powf returns nan / inf
        with np.errstate(all="ignore"):
            return f32(np.power(np.float64(base), np.float64(exponent)))


def _cos(x: np.float32) -> np.float32:
    """``tf.math.cos`` of a float32 scalar: ``cosf``."""
    if _C_FUNCTIONS:
        return f32(_C_FUNCTIONS[1](x))
    return f32(math.cos(float(x)))


def _log(x: np.float32) -> np.float32:
    """``tf.math.log`` of a float32 scalar: ``logf``."""
    if _C_FUNCTIONS:
        return f32(_C_FUNCTIONS[2](x))
    if x > 0:
        return f32(math.log(float(x)))
    return f32(-math.inf) if x == 0 else f32(math.nan)


# --- Each schedule: Keras' __call__, operation by operation -------------------------------------
# Names follow Keras' source (keras/src/optimizers/schedules/learning_rate_schedule.py).
# Every name holding an np.float32 is a float32 tensor there; `c` is the config with
# defaults filled in.

def _exponential_decay(c: dict, step: int) -> np.float32:
    initial_learning_rate = f32(c["initial_learning_rate"])
    decay_steps = f32(c["decay_steps"])
    decay_rate = f32(c["decay_rate"])
    global_step_recomp = f32(step)
    p = global_step_recomp / decay_steps
    if c["staircase"]:
        p = np.floor(p)
    return initial_learning_rate * _pow(decay_rate, p)


def _piecewise_constant_decay(c: dict, step: int) -> np.float32:
    # Keras casts each boundary to the step's integer dtype (int64 for optimizer.iterations):
    # an int stays exact, a float becomes a float32 and is truncated toward zero.
    boundaries = [b if isinstance(b, int) else int(np.trunc(f32(b))) for b in c["boundaries"]]
    values = [f32(v) for v in c["values"]]
    result_value = f32(0)
    result_value += f32(step <= boundaries[0]) * values[0]
    result_value += f32(step > boundaries[-1]) * values[-1]
    for low, high, value in zip(boundaries[:-1], boundaries[1:], values[1:-1]):
        result_value += f32(low < step <= high) * value
    return result_value


def _polynomial_decay(c: dict, step: int) -> np.float32:
    initial_learning_rate = f32(c["initial_learning_rate"])
    end_learning_rate = f32(c["end_learning_rate"])
    power = f32(c["power"])
    global_step_recomp = f32(step)
    decay_steps_recomp = f32(c["decay_steps"])
    if c["cycle"]:
        if global_step_recomp == 0:
            multiplier = f32(1.0)
        else:
            multiplier = np.ceil(global_step_recomp / f32(c["decay_steps"]))
        decay_steps_recomp = decay_steps_recomp * multiplier
    else:
        global_step_recomp = min(global_step_recomp, decay_steps_recomp)
    p = global_step_recomp / decay_steps_recomp
    return (initial_learning_rate - end_learning_rate) * _pow(f32(1) - p, power) + end_learning_rate


def _inverse_time_decay(c: dict, step: int) -> np.float32:
    initial_learning_rate = f32(c["initial_learning_rate"])
    decay_steps = f32(c["decay_steps"])
    decay_rate = f32(c["decay_rate"])
    global_step_recomp = f32(step)
    p = global_step_recomp / decay_steps
    if c["staircase"]:
        p = np.floor(p)
    denom = f32(1) + decay_rate * p
    return initial_learning_rate / denom


def _cosine_decay(c: dict, step: int) -> np.float32:
    initial_learning_rate = f32(c["initial_learning_rate"])
    decay_steps = f32(c["decay_steps"])
    global_step_recomp = f32(step)
    # alpha is not cast in Keras: `(1 - alpha)` is a Python float, rounded to float32 once.
    one_minus_alpha, alpha = f32(1 - c["alpha"]), f32(c["alpha"])

    def decay_function(step, decay_from_lr):
        completed_fraction = step / decay_steps
        cosine_decayed = f32(0.5) * (f32(1.0) + _cos(f32(math.pi) * completed_fraction))
        decayed = one_minus_alpha * cosine_decayed + alpha
        return decay_from_lr * decayed

    if c["warmup_target"] is None:
        return decay_function(min(global_step_recomp, decay_steps), initial_learning_rate)
    warmup_target = f32(c["warmup_target"])
    warmup_steps = f32(c["warmup_steps"])
    global_step_recomp = min(global_step_recomp, decay_steps + warmup_steps)
    if global_step_recomp < warmup_steps:
        completed_fraction = global_step_recomp / warmup_steps
        total_step_delta = warmup_target - initial_learning_rate
        return total_step_delta * completed_fraction + initial_learning_rate
    return decay_function(global_step_recomp - warmup_steps, warmup_target)


def _cosine_decay_restarts(c: dict, step: int) -> np.float32:
    initial_learning_rate = f32(c["initial_learning_rate"])
    first_decay_steps = f32(c["first_decay_steps"])
    alpha = f32(c["alpha"])
    t_mul = f32(c["t_mul"])
    m_mul = f32(c["m_mul"])
    global_step_recomp = f32(step)
    completed_fraction = global_step_recomp / first_decay_steps
    one = f32(1.0)
    if t_mul == one:
        i_restart = np.floor(completed_fraction)
        completed_fraction = completed_fraction - i_restart
    else:
        i_restart = np.floor(_log(one - completed_fraction * (one - t_mul)) / _log(t_mul))
        sum_r = (one - _pow(t_mul, i_restart)) / (one - t_mul)
        completed_fraction = (completed_fraction - sum_r) / _pow(t_mul, i_restart)
    m_fac = _pow(m_mul, i_restart)
    cosine_decayed = f32(0.5) * m_fac * (one + _cos(f32(math.pi) * completed_fraction))
    decayed = (one - alpha) * cosine_decayed + alpha
    return initial_learning_rate * decayed


# --- What each schedule's config may hold -------------------------------------------------------
# Keras' own defaults; REQUIRED marks an argument without one. "name" is accepted and ignored.

REQUIRED = object()

_SCHEDULES = {
    "ExponentialDecay": (_exponential_decay, {
        "initial_learning_rate": REQUIRED, "decay_steps": REQUIRED, "decay_rate": REQUIRED,
        "staircase": False,
    }),
    "PiecewiseConstantDecay": (_piecewise_constant_decay, {
        "boundaries": REQUIRED, "values": REQUIRED,
    }),
    "PolynomialDecay": (_polynomial_decay, {
        "initial_learning_rate": REQUIRED, "decay_steps": REQUIRED,
        "end_learning_rate": 0.0001, "power": 1.0, "cycle": False,
    }),
    "InverseTimeDecay": (_inverse_time_decay, {
        "initial_learning_rate": REQUIRED, "decay_steps": REQUIRED, "decay_rate": REQUIRED,
        "staircase": False,
    }),
    "CosineDecay": (_cosine_decay, {
        "initial_learning_rate": REQUIRED, "decay_steps": REQUIRED, "alpha": 0.0,
        "warmup_target": None, "warmup_steps": 0,
    }),
    "CosineDecayRestarts": (_cosine_decay_restarts, {
        "initial_learning_rate": REQUIRED, "first_decay_steps": REQUIRED,
        "t_mul": 2.0, "m_mul": 1.0, "alpha": 0.0,
    }),
}

SCHEDULES = tuple(_SCHEDULES)


def learning_rate(spec, step: int) -> np.float32:
    """The float32 learning rate that ``spec`` gives after ``step`` optimizer steps.

    Raises InvalidArgument for a spec ``validate`` refuses, a step that is not an
    int >= 0, or a step at which the schedule's value is not finite."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise InvalidArgument(f"learning-rate step must be an int >= 0; got {step!r}")
    step = int(step)
    if _is_number(spec):
        _check_positive("learning_rate", spec)
        return f32(spec)
    name, config = _resolve(spec)
    function = _SCHEDULES[name][0]
    with np.errstate(all="ignore"):  # a nan or inf is refused just below, by name
        value = f32(function(config, step))
    if not np.isfinite(value):
        raise InvalidArgument(
            f"learning-rate schedule {name} gives {value} at step {step} (as Keras does); "
            "the server will not apply it"
        )
    return value


def validate(spec) -> None:
    """Check ``spec`` fully before training: raise InvalidArgument naming the first problem."""
    if _is_number(spec):
        _check_positive("learning_rate", spec)
        return
    _resolve(spec)


def _resolve(spec) -> tuple[str, dict]:
    """(class_name, config with Keras' defaults filled in) of a valid serialized schedule."""
    if not isinstance(spec, dict):
        raise InvalidArgument(
            "learning_rate must be a number or a serialized keras.optimizers.schedules "
            f"schedule (a dict); got {type(spec).__name__}"
        )
    name = spec.get("class_name")
    if not isinstance(name, str):
        raise InvalidArgument(f"serialized learning-rate schedule has no class_name; got keys {sorted(spec)}")
    refusal = (
        f"learning-rate schedule {name} is not one the server can run; it runs "
        f"{', '.join(SCHEDULES)} of {KERAS_MODULE}"
    )
    if name not in _SCHEDULES:
        raise InvalidArgument(refusal)
    # A user's class may share a built-in's name; Keras marks its own with its module
    # and no registered name, and a registered or user-module class otherwise.
    if spec.get("module", KERAS_MODULE) != KERAS_MODULE or spec.get("registered_name") is not None:
        raise InvalidArgument(
            f"{refusal} (this {name} is module={spec.get('module')!r}, "
            f"registered_name={spec.get('registered_name')!r}: a user's own class)"
        )
    unknown_fields = sorted(set(spec) - {"class_name", "config", "module", "registered_name"})
    if unknown_fields:
        raise InvalidArgument(f"learning-rate schedule {name} has unknown fields: {', '.join(unknown_fields)}")
    given = spec.get("config")
    if not isinstance(given, dict):
        raise InvalidArgument(f"learning-rate schedule {name} has no config dict")
    _, defaults = _SCHEDULES[name]
    unknown = sorted(set(given) - set(defaults) - {"name"})
    if unknown:
        raise InvalidArgument(
            f"learning-rate schedule {name} has config keys the server does not know: "
            f"{', '.join(unknown)}"
        )
    missing = [k for k, v in defaults.items() if v is REQUIRED and k not in given]
    if missing:
        raise InvalidArgument(f"learning-rate schedule {name} lacks {', '.join(missing)}")
    config = {k: given.get(k, v) for k, v in defaults.items()}
    _check_config(name, config)
    return name, config


def _check_config(name: str, c: dict) -> None:
    where = f"learning-rate schedule {name}"
    if name == "PiecewiseConstantDecay":
        boundaries, values = c["boundaries"], c["values"]
        for key, xs in (("boundaries", boundaries), ("values", values)):
            if not isinstance(xs, (list, tuple)) or not xs or not all(_is_finite(x) for x in xs):
                raise InvalidArgument(f"{where}: {key} must be a non-empty list of finite numbers; got {xs!r}")
        if len(values) != len(boundaries) + 1:
            raise InvalidArgument(
                f"{where}: values must be one more than boundaries; got {len(boundaries)} "
                f"boundaries and {len(values)} values"
            )
        if any(not a < b for a, b in zip(boundaries, boundaries[1:])):
            raise InvalidArgument(f"{where}: boundaries must be strictly increasing; got {list(boundaries)}")
        _check_floats(where, "values", values)
        return
    for key, value in c.items():
        if key in ("staircase", "cycle"):
            if not isinstance(value, bool):
                raise InvalidArgument(f"{where}: {key} must be True or False; got {value!r}")
        elif not (key == "warmup_target" and value is None) and not _is_finite(value):
            raise InvalidArgument(f"{where}: {key} must be a finite number; got {value!r}")
    _check_floats(where, "initial_learning_rate", [c["initial_learning_rate"]])
    steps_key = "first_decay_steps" if name == "CosineDecayRestarts" else "decay_steps"
    if not c[steps_key] > 0:
        raise InvalidArgument(f"{where}: {steps_key} must be > 0; got {c[steps_key]!r}")
    if name == "CosineDecay" and not c["warmup_steps"] >= 0:
        raise InvalidArgument(f"{where}: warmup_steps must be >= 0; got {c['warmup_steps']!r}")
    if name == "CosineDecayRestarts" and not c["t_mul"] > 0:
        raise InvalidArgument(f"{where}: t_mul must be > 0; got {c['t_mul']!r}")


def _check_floats(where: str, key: str, xs) -> None:
    # Keras takes the schedule's dtype from this number: an int makes it integer arithmetic
    # (ExponentialDecay(1, 10, 0.9)(5) is 0), which the server does not imitate.
    ints = [x for x in xs if not isinstance(x, float)]
    if ints:
        raise InvalidArgument(
            f"{where}: {key} must be floats (Keras computes in the dtype of an int, "
            f"integer arithmetic); got {ints[0]!r}"
        )


def _check_positive(key: str, x) -> None:
    if not _is_finite(x) or not x > 0:
        raise InvalidArgument(f"{key} must be a finite number > 0; got {x!r}")


def _is_number(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _is_finite(x) -> bool:
    return _is_number(x) and math.isfinite(x)
