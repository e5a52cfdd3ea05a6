"""Tests of ps_server.core.optim.more_optimizers: Adamax, Nadam, Ftrl, Lion, Adadelta, Lamb and
Adafactor against Keras.

    python -m pytest tests/core/test_more_optimizers.py -q

The parity tests import TensorFlow lazily (fixture ``keras``), with oneDNN off as
everywhere we compare bits, and run Keras eagerly: ``opt.apply(grads, variables)``
once per step. Hyperparameters not given take Keras' own defaults, read from the
Keras constructor's signature.
"""

import inspect
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest

from ps_common import names
from ps_server.core.errors import InvalidArgument
from ps_server.core.optim.more_optimizers import (Adadelta, Adafactor, Adamax, Ftrl, Lamb, Lion, Nadam,
                                                  ScheduleFreeAdamW, _tf_mean, _tf_pow)

CLASSES = {"adamax": Adamax, "nadam": Nadam, "ftrl": Ftrl, "lion": Lion, "adadelta": Adadelta, "lamb": Lamb,
           "adafactor": Adafactor, "schedule_free_adamw": ScheduleFreeAdamW}
KERAS_NAMES = {"adamax": "Adamax", "nadam": "Nadam", "ftrl": "Ftrl", "lion": "Lion", "adadelta": "Adadelta",
               "lamb": "Lamb", "adafactor": "Adafactor", "schedule_free_adamw": "ScheduleFreeAdamW"}
# The spec attributes each class reads: Keras' constructor arguments of the same names.
HYPERPARAMETERS = {
    "adamax": ("learning_rate", "beta_1", "beta_2", "epsilon"),
    "nadam": ("learning_rate", "beta_1", "beta_2", "epsilon"),
    "lion": ("learning_rate", "beta_1", "beta_2"),
    "ftrl": ("learning_rate", "learning_rate_power", "initial_accumulator_value",
             "l1_regularization_strength", "l2_regularization_strength",
             "l2_shrinkage_regularization_strength", "beta"),
    "adadelta": ("learning_rate", "rho", "epsilon"),
    "lamb": ("learning_rate", "beta_1", "beta_2", "epsilon"),
    "adafactor": ("learning_rate", "beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold", "relative_step"),
    "schedule_free_adamw": ("learning_rate", "beta_1", "beta_2", "epsilon", "warmup_steps"),
}
# The Keras slots, by our slot names (Keras' private lists, one entry per variable).
KERAS_SLOTS = {
    "adamax": {"m": "_m", "u": "_u"},
    "nadam": {"m": "_momentums", "v": "_velocities"},
    "lion": {"m": "_momentums"},
    "ftrl": {"accumulator": "_accumulators", "linear": "_linears"},
    "adadelta": {"accumulated_grad": "_accumulated_grads", "accumulated_delta_var": "_accumulated_delta_vars"},
    "lamb": {"m": "_momentums", "v": "_velocities"},
    "adafactor": {"v": "_v"},  # and r, c of a matrix (test_adafactor_...)
    "schedule_free_adamw": {"momentum": "_momentums", "velocity": "_velocities"},
}

SHAPES = [(3, 4), (5,), (), (37, 9)]  # (37, 9): 41 whole AVX packets of float32 and a tail
STEPS = 20

PARITY_CASES = {
    "adamax": dict(name="adamax"),
    "adamax_unusual": dict(name="adamax", learning_rate=0.0123, beta_1=0.85, beta_2=0.9876, epsilon=3e-8),
    "nadam": dict(name="nadam"),
    "nadam_unusual": dict(name="nadam", learning_rate=0.0123, beta_1=0.85, beta_2=0.9876, epsilon=3e-8),
    "lion": dict(name="lion"),
    "lion_unusual": dict(name="lion", learning_rate=0.0123, beta_1=0.85, beta_2=0.9876),
    "ftrl": dict(name="ftrl"),
    "ftrl_unusual": dict(
        name="ftrl", learning_rate=0.05, learning_rate_power=-0.3, initial_accumulator_value=0.2,
        l1_regularization_strength=0.01, l2_regularization_strength=0.02,
        l2_shrinkage_regularization_strength=0.03, beta=0.1,
    ),
    "ftrl_from_zero": dict(  # pow(0, p), pow(x, 1) and an l1 that clips
        name="ftrl", learning_rate=0.2, learning_rate_power=-1.0, initial_accumulator_value=0.0,
        l1_regularization_strength=0.05,
    ),
    "adadelta": dict(name="adadelta"),
    "adadelta_unusual": dict(name="adadelta", learning_rate=1.0, rho=0.8765, epsilon=3e-6),
    "lamb": dict(name="lamb"),
    "lamb_unusual": dict(name="lamb", learning_rate=0.0123, beta_1=0.85, beta_2=0.9876, epsilon=3e-8),
    "adafactor": dict(name="adafactor"),
    # lr above 1 / sqrt(t) for the first steps; clip_threshold small enough to clip
    "adafactor_clipped": dict(name="adafactor", learning_rate=0.5, beta_2_decay=-0.6, epsilon_1=1e-20,
                              epsilon_2=0.02, clip_threshold=0.05, relative_step=False),
    "schedule_free_adamw": dict(name="schedule_free_adamw"),
    "schedule_free_adamw_warmup_decay": dict(name="schedule_free_adamw", learning_rate=0.0123, beta_1=0.85,
                                             beta_2=0.9876, epsilon=3e-8, warmup_steps=7, weight_decay=0.05),
}

# (optimizer, dtype) -> how far a variable may be from Keras' where a Keras op has no exact NumPy
# twin, in units in the last place of the variable's largest magnitude; every other pair, and
# every slot, is bit-identical.
ULP_BOUNDS = {
    # Lamb's trust ratio: ops.sum of float16 squares is TensorFlow's half reduce_sum, whose
    # order and rounding tf_sum does not reproduce (it adds float16 in float64, rounded once;
    # neither sequential float16 nor Eigen's float32 packet order matches it either). After 20
    # updates, seeds 0-2: the 0-d and 5-element variables exact, the 12 and 333-element ones
    # 0.06 to 1.0 of that unit apart in up to 59 elements.
    ("lamb", "float16"): 1,
}


@dataclass(frozen=True)
class _Spec:
    """Stands in for an ``OptimizerSpec`` that does not know these optimizers yet: the
    attributes the base ``Optimizer`` reads, plus ours, by Keras' names."""

    name: str
    learning_rate: float
    momentum: float = 0.0
    nesterov: bool = False
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    learning_rate_power: float = 0.0
    initial_accumulator_value: float = 0.0
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0

    def validate(self) -> None:
        pass  # our classes check their own hyperparameters


@pytest.fixture(scope="module")
def keras():
    # oneDNN changes TensorFlow's bits; it must be off before TensorFlow loads.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras as keras_module

    return keras_module


def keras_kwargs(keras, case: dict) -> dict:
    """Every hyperparameter of the case: the given ones, else the Keras constructor's default."""
    name = case["name"]
    signature = inspect.signature(getattr(keras.optimizers, KERAS_NAMES[name]))
    kwargs = {k: signature.parameters[k].default for k in HYPERPARAMETERS[name]}
    kwargs.update({k: v for k, v in case.items() if k != "name"})
    return kwargs


def make_spec(name: str, **kwargs):
    """The project's OptimizerSpec once it knows ``name``; until then ``_Spec``."""
    if name in names.OPTIMIZERS:
        from ps_server.core.optim.optimizers import OptimizerSpec

        return OptimizerSpec(name, **kwargs)
    return _Spec(name, **kwargs)


def random_problem(dtype, seed=0):
    rng = np.random.default_rng(seed)
    init = [np.asarray(rng.standard_normal(s)).astype(dtype) for s in SHAPES]
    grads = [[np.asarray(0.1 * rng.standard_normal(s)).astype(dtype) for s in SHAPES]
             for _ in range(STEPS)]
    return init, grads


def run_ours(opt, init, grads):
    values = list(init)
    states = [opt.init_state(v) for v in values]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            values[i], states[i] = opt.apply(values[i], g, states[i])
    return values, states


def run_keras(keras, name, kwargs, init, grads, dtype):
    import tensorflow as tf

    opt = getattr(keras.optimizers, KERAS_NAMES[name])(**kwargs)
    variables = [keras.Variable(x, dtype=dtype) for x in init]
    for step_grads in grads:
        opt.apply([tf.constant(g) for g in step_grads], variables)
    return opt, [v.numpy() for v in variables]


@pytest.mark.parametrize("case", list(PARITY_CASES))
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_matches_eager_keras_bit_for_bit_after_20_updates(keras, case, dtype):
    name = PARITY_CASES[case]["name"]
    kwargs = keras_kwargs(keras, PARITY_CASES[case])
    opt = CLASSES[name](make_spec(name, **kwargs))
    init, grads = random_problem(dtype)
    ours, states = run_ours(opt, init, grads)
    keras_opt, theirs = run_keras(keras, name, kwargs, init, grads, dtype)
    for i, (shape, a, b) in enumerate(zip(SHAPES, ours, theirs)):
        assert a.dtype == b.dtype and a.shape == b.shape == shape
        if (name, dtype) in ULP_BOUNDS:
            bound = ULP_BOUNDS[name, dtype] * np.spacing(np.abs(b).max())
            assert np.abs(a.astype(np.float64) - b).max() <= bound, f"{case} {dtype} variable {shape}"
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{case} {dtype} variable {shape}")
        for slot, keras_slot in KERAS_SLOTS[name].items():
            np.testing.assert_array_equal(
                states[i][slot], getattr(keras_opt, keras_slot)[i].numpy(),
                err_msg=f"{case} {dtype} slot {slot} of {shape}",
            )
        assert states[i]["iterations"] == STEPS
    if name == "adafactor":  # a matrix's factored moments; a vector's (and a 0-d's) are unfactored
        for i, shape in enumerate(SHAPES):
            factored = {"r", "c"} if len(shape) >= 2 else set()
            assert set(states[i]) == {"v", "iterations"} | factored
            for slot in factored:
                np.testing.assert_array_equal(states[i][slot], getattr(keras_opt, f"_{slot}")[i].numpy())
    if name == "nadam":  # one u_product in Keras, the same in every variable's state here
        for state in states:
            assert state["u_product"].shape == () and state["u_product"].dtype == dtype
            np.testing.assert_array_equal(state["u_product"], keras_opt._u_product.numpy())


@pytest.mark.parametrize("dtype,ints", [(np.float32, np.uint32), (np.float64, np.uint64), (np.float16, np.uint16)])
def test_pow_matches_tensorflow_bit_for_bit(keras, dtype, ints):
    """Ftrl's ``ops.power(accumulator, -learning_rate_power)``: TensorFlow's Pow kernel
    (float32/float64: Eigen's packet pow on whole packets, the C library's on the tail;
    float16: the C library's powf on every element) over a wide range, specials included."""
    import tensorflow as tf

    rng = np.random.default_rng(3)
    low, high = {np.float32: (-40, 38), np.float64: (-310, 308), np.float16: (-8, 4.8)}[dtype]
    with np.errstate(over="ignore"):
        x = (10.0 ** rng.uniform(low, high, 20_003)).astype(dtype)
    x[:3000] = rng.uniform(0, 3, 3000)  # an accumulator's range
    x[3000:3008] = [0, np.inf, np.nan, -1, -2, 1, np.finfo(dtype).tiny / 4, -0.0]
    for y in (0.5, 0.3, 1.0, 0.0, -0.5, 1.7, 2.0, 3.0):
        for n in (x.size, 13, 5, 1):
            expected = tf.pow(tf.constant(x[:n]), tf.constant(dtype(y))).numpy()
            got = _tf_pow(x[:n], dtype(y))
            same = (got.view(ints) == expected.view(ints)) | (np.isnan(got) & np.isnan(expected))
            assert same.all(), f"y={y} n={n}: x={x[:n][~same][:3]} tf={expected[~same][:3]} ours={got[~same][:3]}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_adafactor_means_match_tensorflow_bit_for_bit(keras, dtype):
    """Adafactor's ``ops.mean`` over all, the last and the second-last axis: Eigen's sums (by
    packets, four accumulators over the rows of a column), float16 through float32 as Keras casts."""
    import tensorflow as tf

    rng = np.random.default_rng(4)
    for shape in [(3, 4), (37, 9), (100, 33), (5, 300), (2, 37, 9), (17, 3), (7,)]:
        x = np.square(rng.standard_normal(shape)).astype(dtype)
        for axis in (None, -1, -2)[:3 if len(shape) >= 2 else 2]:
            expected = keras.ops.mean(tf.constant(x), axis=axis, keepdims=True).numpy()
            np.testing.assert_array_equal(_tf_mean(x, axis), expected, err_msg=f"{shape} axis={axis}")


@pytest.mark.parametrize("name", list(CLASSES))
def test_apply_does_not_mutate_its_inputs(name):
    opt = CLASSES[name](make_spec(name, learning_rate=0.1, beta_2=0.99, learning_rate_power=-0.5,
                              initial_accumulator_value=0.1, l2_shrinkage_regularization_strength=0.1))
    rng = np.random.default_rng(1)
    for shape in [(4, 5), ()]:
        w = np.asarray(rng.standard_normal(shape)).astype(np.float32)
        state = opt.init_state(w)
        w, state = opt.apply(w, np.asarray(rng.standard_normal(shape)).astype(np.float32), state)
        g = np.asarray(rng.standard_normal(shape)).astype(np.float32)
        arrays = [w, g] + [x for x in state.values() if isinstance(x, np.ndarray)]
        copies = [a.copy() for a in arrays]
        for a in arrays:
            a.setflags(write=False)  # any in-place write would raise
        state_before = dict(state)

        new_w, new_state = opt.apply(w, g, state)

        for a, c in zip(arrays, copies):
            assert np.array_equal(a, c)
        assert state.keys() == state_before.keys() == new_state.keys()
        assert all(state[k] is state_before[k] for k in state)
        assert isinstance(new_w, np.ndarray) and new_w.shape == shape and new_w.dtype == np.float32
        assert not np.shares_memory(new_w, w)
        for key, x in new_state.items():
            if isinstance(x, np.ndarray):
                assert x.dtype == np.float32 and not np.shares_memory(x, state[key])
        assert new_state["iterations"] == state["iterations"] + 1
    assert not hasattr(opt, "_u_product_t")  # Nadam's per-step value stays off the shared optimizer


def test_nadam_state_holds_u_product_and_needs_it():
    opt = Nadam(make_spec("nadam", learning_rate=0.1))
    w = np.zeros((2, 3), np.float64)
    state = opt.init_state(w)
    assert set(state) == {"m", "v", "u_product", "iterations"}
    assert state["u_product"].shape == () and state["u_product"].dtype == np.float64 and state["u_product"] == 1
    _, after = opt.apply(w, np.ones_like(w), state)
    # u_1 = beta_1 * (1 - 0.5 * 0.96 ** 1)
    np.testing.assert_allclose(after["u_product"], 0.9 * (1 - 0.5 * 0.96), rtol=1e-15)
    with pytest.raises(InvalidArgument, match="optimizer state lacks u_product"):
        opt.apply(w, w, {k: v for k, v in state.items() if k != "u_product"})
    with pytest.raises(InvalidArgument, match=r"u_product.*float32\[\]"):
        opt.apply(w, w, {**state, "u_product": np.ones((), np.float32)})


def test_ftrl_accumulator_starts_at_initial_accumulator_value():
    opt = Ftrl(make_spec("ftrl", learning_rate=0.1, learning_rate_power=-0.5, initial_accumulator_value=0.1))
    state = opt.init_state(np.zeros(3, np.float64))
    # Keras' Constant initializer: ops.cast(0.1, float64), through float32.
    assert np.array_equal(state["accumulator"], np.full(3, np.float32(0.1), np.float64))
    assert np.array_equal(state["linear"], np.zeros(3))


@pytest.mark.parametrize(
    "name,fields,message",
    [
        ("ftrl", dict(initial_accumulator_value=-0.1), "initial_accumulator_value must be >= 0"),
        ("ftrl", dict(learning_rate_power=0.5), "learning_rate_power must be <= 0"),
        ("ftrl", dict(l1_regularization_strength=-1.0), "l1_regularization_strength must be >= 0"),
        ("ftrl", dict(l2_regularization_strength=-1.0), "l2_regularization_strength must be >= 0"),
        ("ftrl", dict(l2_shrinkage_regularization_strength=-1.0),
         "l2_shrinkage_regularization_strength must be >= 0"),
        ("ftrl", dict(beta=float("nan")), "beta must be a finite number"),
        ("lion", dict(beta_1=0.0), r"beta_1 must be in \(0, 1\]"),
        ("lion", dict(beta_1=1.5), r"beta_1 must be in \(0, 1\]"),
        ("adamax", dict(beta_2=1.0), r"beta_2 must be in \[0, 1\)"),
        ("nadam", dict(epsilon=-1e-7), "epsilon must be >= 0"),
        ("nadam", dict(beta_1="0.9"), "beta_1 must be a finite number"),
    ],
)
def test_bad_hyperparameters_are_rejected_like_keras(name, fields, message):
    with pytest.raises(InvalidArgument, match=message):
        CLASSES[name](make_spec(name, learning_rate=0.1, **fields))


def test_lion_takes_beta_1_of_one_as_keras_does():
    Lion(make_spec("lion", learning_rate=0.1, beta_1=1.0))


def test_importing_more_optimizers_loads_neither_tensorflow_nor_grpc():
    code = (
        "import sys, ps_server.core.optim.more_optimizers\n"
        "bad = sorted(m for m in ('tensorflow', 'keras', 'grpc') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True)
