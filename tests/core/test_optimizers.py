"""Tests of ps_server.core.optimizers: the rules by hand, and parity with Keras.

    python -m pytest tests/core/test_optimizers.py -q

The parity tests import TensorFlow lazily (fixture ``keras``), with oneDNN off
as everywhere we compare bits; the other tests need only NumPy.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from ps_server.core.errors import InvalidArgument
from ps_server.core.optimizers import OptimizerSpec, make_optimizer

SHAPES = [(3, 3, 1, 32), (32,), (5408, 10)]
STEPS = 20

PARITY_CASES = {
    "sgd": dict(name="sgd", learning_rate=0.01),
    "sgd_momentum": dict(name="sgd", learning_rate=0.01, momentum=0.9),
    "sgd_nesterov": dict(name="sgd", learning_rate=0.01, momentum=0.9, nesterov=True),
    "adam": dict(name="adam", learning_rate=1e-3),
    "adam_unusual": dict(
        name="adam", learning_rate=0.0123, beta_1=0.85, beta_2=0.9876, epsilon=3e-8
    ),
}


@pytest.fixture(scope="module")
def keras():
    # oneDNN changes TensorFlow's bits; it must be off before TensorFlow loads.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras as keras_module

    return keras_module


def random_problem(dtype, seed=0):
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(s).astype(dtype) for s in SHAPES]
    grads = [[(0.1 * rng.standard_normal(s)).astype(dtype) for s in SHAPES] for _ in range(STEPS)]
    return init, grads


def run_ours(spec, init, grads):
    opt = make_optimizer(spec)
    values = list(init)
    states = [opt.init_state(v) for v in values]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            values[i], states[i] = opt.apply(values[i], g, states[i])
    return values


def run_keras(keras, spec, init, grads, use_tf_function):
    """The ordinary user path: a GradientTape loop and optimizer.apply_gradients.

    The loss sum(w * g) has gradient exactly g, so Keras sees our gradients.
    """
    import tensorflow as tf

    kwargs = {k: v for k, v in spec.as_dict().items() if k != "name"}
    if spec.name == "sgd":
        for k in ("beta_1", "beta_2", "epsilon"):
            del kwargs[k]
        opt = keras.optimizers.SGD(**kwargs)
    else:
        for k in ("momentum", "nesterov"):
            del kwargs[k]
        opt = keras.optimizers.Adam(**kwargs)
    variables = [keras.Variable(x) for x in init]

    def train_step(step_grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, step_grads)])
        tape_grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(tape_grads, variables))
        return tape_grads

    if use_tf_function:
        train_step = tf.function(train_step)
    for step_grads in grads:
        tape_grads = train_step([tf.constant(g) for g in step_grads])
        for tg, g in zip(tape_grads, step_grads):
            assert np.array_equal(tg.numpy(), g)  # the test itself is sound
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("case", list(PARITY_CASES))
@pytest.mark.parametrize(
    "dtype,use_tf_function",
    [("float32", False), ("float32", True), ("float16", False), ("float64", False)],
)
def test_matches_keras_bit_for_bit_after_20_updates(keras, case, dtype, use_tf_function):
    spec = OptimizerSpec(**PARITY_CASES[case])
    init, grads = random_problem(dtype)
    ours = run_ours(spec, init, grads)
    theirs = run_keras(keras, spec, init, grads, use_tf_function)
    for shape, a, b in zip(SHAPES, ours, theirs):
        diff = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))
        assert diff <= 1e-6, f"{shape}: max abs diff {diff}"
        assert np.array_equal(a, b), f"{shape}: not bit-identical, max abs diff {diff}"


def test_sgd_step_is_w_minus_lr_times_g():
    opt = make_optimizer(OptimizerSpec("sgd", learning_rate=0.5))
    w = np.array([1.0, -2.0, 0.5], np.float32)
    g = np.array([0.5, 0.25, -1.0], np.float32)
    new_w, state = opt.apply(w, g, opt.init_state(w))
    assert np.array_equal(new_w, np.array([0.75, -2.125, 1.0], np.float32))
    assert state == {"iterations": 1}


def test_momentum_velocity_is_mu_times_velocity_minus_lr_times_g():
    opt = make_optimizer(OptimizerSpec("sgd", learning_rate=0.5, momentum=0.5))
    w = np.zeros(2, np.float32)
    g = np.ones(2, np.float32)
    state = opt.init_state(w)
    w, state = opt.apply(w, g, state)  # m = -0.5
    w, state = opt.apply(w, g, state)  # m = 0.5*-0.5 - 0.5 = -0.75
    assert np.array_equal(state["momentum"], np.full(2, -0.75, np.float32))
    assert np.array_equal(w, np.full(2, -1.25, np.float32))


def test_nesterov_adds_mu_times_new_velocity_minus_lr_times_g():
    opt = make_optimizer(OptimizerSpec("sgd", learning_rate=0.5, momentum=0.5, nesterov=True))
    w = np.zeros(2, np.float32)
    g = np.ones(2, np.float32)
    state = opt.init_state(w)
    w, state = opt.apply(w, g, state)  # m = -0.5;  w += 0.5*-0.5 - 0.5
    w, state = opt.apply(w, g, state)  # m = -0.75; w += 0.5*-0.75 - 0.5
    assert np.array_equal(w, np.full(2, -0.75 - 0.875, np.float32))


def test_nesterov_without_momentum_is_allowed_and_is_plain_sgd():
    plain = make_optimizer(OptimizerSpec("sgd", learning_rate=0.1))
    nesterov = make_optimizer(OptimizerSpec("sgd", learning_rate=0.1, nesterov=True))
    w = np.array([1.0, 2.0], np.float32)
    g = np.array([0.3, -0.7], np.float32)
    assert nesterov.init_state(w) == {"iterations": 0}
    assert np.array_equal(
        nesterov.apply(w, g, nesterov.init_state(w))[0], plain.apply(w, g, plain.init_state(w))[0]
    )


def test_first_adam_step_is_lr_times_g_over_abs_g_plus_scaled_epsilon():
    # Step 1: m = (1-b1) g, v = (1-b2) g^2, alpha = lr sqrt(1-b2) / (1-b1),
    # so w moves by lr * g / (|g| + eps / sqrt(1-b2)): about lr against g's sign.
    opt = make_optimizer(OptimizerSpec("adam", learning_rate=0.01))
    w = np.array([1.0, 1.0, 1.0], np.float32)
    g = np.array([3.0, -0.5, 0.02], np.float32)
    new_w, state = opt.apply(w, g, opt.init_state(w))
    g64 = g.astype(np.float64)
    expected = 1.0 - 0.01 * g64 / (np.abs(g64) + 1e-7 / np.sqrt(1 - 0.999))
    np.testing.assert_allclose(new_w, expected, rtol=0, atol=1e-7)
    assert state["iterations"] == 1


@pytest.mark.parametrize(
    "spec",
    [
        OptimizerSpec("sgd", learning_rate=0.1, momentum=0.9, nesterov=True),
        OptimizerSpec("adam", learning_rate=0.1),
    ],
    ids=["sgd_nesterov", "adam"],
)
def test_apply_does_not_mutate_its_inputs(spec):
    opt = make_optimizer(spec)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    state = opt.init_state(w)
    w, state = opt.apply(w, rng.standard_normal((4, 5)).astype(np.float32), state)
    g = rng.standard_normal((4, 5)).astype(np.float32)
    arrays = [w, g] + [x for x in state.values() if isinstance(x, np.ndarray)]
    copies = [a.copy() for a in arrays]
    for a in arrays:
        a.setflags(write=False)  # any in-place write would raise
    state_before = dict(state)

    new_w, new_state = opt.apply(w, g, state)

    for a, c in zip(arrays, copies):
        assert np.array_equal(a, c)
    assert state.keys() == state_before.keys()
    assert all(state[k] is state_before[k] for k in state)
    assert new_w is not w and not np.shares_memory(new_w, w)
    for name in opt.slot_names:
        assert not np.shares_memory(new_state[name], state[name])
    assert new_state["iterations"] == state["iterations"] + 1


def test_iterations_count_the_steps_applied_to_that_variable():
    opt = make_optimizer(OptimizerSpec("adam", learning_rate=0.1))
    w = np.ones(3, np.float64)
    state = opt.init_state(w)
    assert state["iterations"] == 0
    for _ in range(3):
        w, state = opt.apply(w, np.ones(3, np.float64), state)
    assert state["iterations"] == 3


def test_zero_dimensional_variable_stays_an_ndarray():
    opt = make_optimizer(OptimizerSpec("adam", learning_rate=0.1))
    w = np.array(1.0, np.float32)
    state = opt.init_state(w)
    for _ in range(2):
        w, state = opt.apply(w, np.array(0.5, np.float32), state)
    assert isinstance(w, np.ndarray) and w.shape == () and w.dtype == np.float32
    assert isinstance(state["m"], np.ndarray)


def test_gradient_of_another_shape_is_rejected():
    opt = make_optimizer(OptimizerSpec("sgd", learning_rate=0.1))
    w = np.zeros((2, 3), np.float32)
    with pytest.raises(InvalidArgument, match=r"gradient is float32\[3, 2\] but the variable is float32\[2, 3\]"):
        opt.apply(w, np.zeros((3, 2), np.float32), opt.init_state(w))


def test_gradient_of_another_dtype_is_rejected():
    opt = make_optimizer(OptimizerSpec("adam", learning_rate=0.1))
    w = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgument, match=r"gradient is float64\[3\]"):
        opt.apply(w, np.zeros(3, np.float64), opt.init_state(w))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_, np.complex64])
def test_only_floating_variables_are_accepted(dtype):
    opt = make_optimizer(OptimizerSpec("sgd", learning_rate=0.1))
    with pytest.raises(InvalidArgument, match="float16/float32/float64"):
        opt.init_state(np.zeros(3, dtype))


def test_state_missing_a_slot_is_rejected():
    opt = make_optimizer(OptimizerSpec("adam", learning_rate=0.1))
    w = np.zeros(3, np.float32)
    with pytest.raises(InvalidArgument, match="optimizer state lacks v"):
        opt.apply(w, w, {"m": np.zeros(3, np.float32), "iterations": 0})


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(name="rmsprop"), "optimizer name must be one of sgd, adam; got 'rmsprop'"),
        (dict(name="sgd", learning_rate=0.0), "learning_rate must be > 0; got 0.0"),
        (dict(name="sgd", learning_rate=-0.1), "learning_rate must be > 0; got -0.1"),
        (dict(name="sgd", learning_rate=float("nan")), "learning_rate must be a finite number; got nan"),
        (dict(name="adam", learning_rate=float("inf")), "learning_rate must be a finite number; got inf"),
        (dict(name="sgd", learning_rate="0.1"), "learning_rate must be a finite number; got '0.1'"),
        (dict(name="sgd", momentum=1.0), r"momentum must be in \[0, 1\); got 1.0"),
        (dict(name="sgd", momentum=-0.1), r"momentum must be in \[0, 1\); got -0.1"),
        (dict(name="adam", beta_1=1.0), r"beta_1 must be in \[0, 1\); got 1.0"),
        (dict(name="adam", beta_2=-0.5), r"beta_2 must be in \[0, 1\); got -0.5"),
        (dict(name="adam", epsilon=-1e-8), "epsilon must be >= 0; got -1e-08"),
        (dict(name="sgd", nesterov="yes"), "nesterov must be True or False; got 'yes'"),
    ],
)
def test_validate_rejects_bad_spec_with_a_precise_message(fields, message):
    spec = OptimizerSpec(**fields)
    with pytest.raises(InvalidArgument, match=message):
        spec.validate()
    with pytest.raises(InvalidArgument, match=message):
        make_optimizer(spec)


def test_spec_round_trips_through_a_plain_dict():
    spec = OptimizerSpec("adam", learning_rate=3e-4, beta_2=0.98)
    d = spec.as_dict()
    assert d == {
        "name": "adam",
        "learning_rate": 3e-4,
        "momentum": 0.0,
        "nesterov": False,
        "beta_1": 0.9,
        "beta_2": 0.98,
        "epsilon": 1e-7,
    }
    assert OptimizerSpec.from_dict(d) == spec


def test_spec_from_dict_rejects_unknown_fields():
    with pytest.raises(InvalidArgument, match="unknown optimizer spec fields: lr"):
        OptimizerSpec.from_dict({"name": "sgd", "lr": 0.1})


def test_importing_optimizers_loads_neither_tensorflow_nor_grpc():
    code = (
        "import sys, ps_server.core.optimizers\n"
        "bad = sorted(m for m in ('tensorflow', 'keras', 'grpc') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True)
