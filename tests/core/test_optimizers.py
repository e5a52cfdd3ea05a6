"""Tests of ps_server.core.optim.optimizers: the rules by hand, and parity with Keras.

    python -m pytest tests/core/test_optimizers.py -q

The parity tests import TensorFlow lazily (fixture ``keras``), with oneDNN off
as everywhere we compare bits; the other tests need only NumPy. Two kinds: SGD and
Adam through the user's path (GradientTape, ``apply_gradients``, also inside
``tf.function``, every dtype); and every optimizer, option and schedule through
``opt.apply(grads, vars)`` called eagerly, the spec read from the Keras optimizer
itself (``OptimizerSpec.from_keras``).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ps_common.names import KERAS_OPTIMIZER_CLASSES, OPTIMIZER_DEFAULTS
from ps_server.core.errors import InvalidArgument
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.registry import make_optimizer

KERAS_CLASS = {name: cls for cls, name in KERAS_OPTIMIZER_CLASSES.items()}

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

    kwargs = {k: getattr(spec, k) for k in OPTIMIZER_DEFAULTS[spec.name]}
    opt = getattr(keras.optimizers, KERAS_CLASS[spec.name])(**kwargs)
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
        (dict(name="shampoo"), "optimizer name must be one of sgd, adam, adamw, .*; got 'shampoo'"),
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
        (dict(name="adam", amsgrad=1), "amsgrad must be True or False; got 1"),
        (dict(name="rmsprop", rho=1.0), r"rho must be in \[0, 1\); got 1.0"),
        (dict(name="rmsprop", momentum=-0.5), r"momentum must be in \[0, 1\); got -0.5"),
        (dict(name="adagrad", initial_accumulator_value=-1.0), "initial_accumulator_value must be >= 0; got -1.0"),
        (dict(name="adamw", weight_decay=0.0), "adamw needs weight_decay > 0"),
        (dict(name="sgd", weight_decay=-0.1), "weight_decay must be >= 0; got -0.1"),
        (dict(name="sgd", clipnorm=-1.0), r"clipnorm must be > 0 \(or None\); got -1.0"),
        (dict(name="sgd", clipnorm=1.0, clipvalue=0.5), "only one of clipnorm, clipvalue and global_clipnorm"),
        (dict(name="adam", global_clipnorm=float("inf")), "global_clipnorm must be a finite number; got inf"),
        (dict(name="adam", use_ema=True, ema_momentum=1.5, ema_overwrite_frequency=1),
         r"ema_momentum must be in \[0, 1\]; got 1.5"),
        (dict(name="adam", use_ema=True, ema_overwrite_frequency=2.5),
         "ema_overwrite_frequency must be an integer >= 1"),
        (dict(name="sgd", learning_rate_schedule={"class_name": "MySchedule", "config": {}}),
         "learning-rate schedule MySchedule is not one the server can run"),
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
    assert {k: d[k] for k in ("name", "learning_rate", "momentum", "nesterov", "beta_1", "beta_2", "epsilon",
                              "amsgrad", "weight_decay", "use_ema")} == {
        "name": "adam",
        "learning_rate": 3e-4,
        "momentum": 0.0,
        "nesterov": False,
        "beta_1": 0.9,
        "beta_2": 0.98,
        "epsilon": 1e-7,
        "amsgrad": False,
        "weight_decay": None,
        "use_ema": False,
    }
    assert OptimizerSpec.from_dict(d) == spec


def test_a_spec_written_before_the_keras_fields_reads_with_keras_defaults():
    old = {"name": "sgd", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True,
           "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}  # a checkpoint header of the first format
    assert OptimizerSpec.from_dict(old) == OptimizerSpec("sgd", 0.1, momentum=0.9, nesterov=True)


def test_defaults_are_keras_defaults_of_the_named_optimizer_and_unused_fields_are_neutral():
    assert OptimizerSpec("adamw").weight_decay == 0.004 and OptimizerSpec("adamw").learning_rate == 0.001
    assert OptimizerSpec("sgd").learning_rate == 0.01 and OptimizerSpec("sgd").weight_decay is None
    assert OptimizerSpec("rmsprop").rho == 0.9 and OptimizerSpec("adagrad").initial_accumulator_value == 0.1
    # A field the optimizer does not take does not make two specs differ.
    assert OptimizerSpec("sgd", 0.1, beta_1=0.0, rho=0.5) == OptimizerSpec("sgd", 0.1)
    # The wire's forms: 0 for a None option, the schedule as JSON.
    assert OptimizerSpec("adam", clipnorm=0.0, ema_overwrite_frequency=0) == OptimizerSpec("adam")
    schedule = {"class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.1, "decay_steps": 10,
                                                             "decay_rate": 0.5}}
    assert OptimizerSpec("sgd", learning_rate_schedule=json.dumps(schedule)).learning_rate_schedule == schedule


def test_spec_from_dict_rejects_unknown_fields():
    with pytest.raises(InvalidArgument, match="unknown optimizer spec fields: lr"):
        OptimizerSpec.from_dict({"name": "sgd", "lr": 0.1})


def test_importing_optimizers_loads_neither_tensorflow_nor_grpc():
    code = (
        "import sys, ps_server.core.optim.optimizers\n"
        "bad = sorted(m for m in ('tensorflow', 'keras', 'grpc') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True)


# -- every optimizer, option and schedule against eager Keras ---------------------------------

# Small variables, a 0-d one among them, and one long enough for several of TensorFlow's vector lanes.
APPLY_SHAPES = [(4, 5), (7,), (), (40,)]

# Keras optimizers by a name for the test: (class, arguments); the options below are added to them.
KERAS_OPTIMIZERS = {
    "sgd": ("SGD", dict(learning_rate=0.1)),
    "sgd_nesterov": ("SGD", dict(learning_rate=0.1, momentum=0.9, nesterov=True)),
    "adam": ("Adam", dict(learning_rate=0.01)),
    "adam_amsgrad": ("Adam", dict(learning_rate=0.01, amsgrad=True)),
    "adamw": ("AdamW", dict(learning_rate=0.01)),
    "adamw_amsgrad": ("AdamW", dict(learning_rate=0.01, weight_decay=0.1, amsgrad=True, beta_1=0.8)),
    "adagrad": ("Adagrad", dict()),
    "adagrad_unusual": ("Adagrad", dict(learning_rate=0.05, initial_accumulator_value=0.5, epsilon=1e-5)),
    "rmsprop": ("RMSprop", dict()),
    "rmsprop_momentum": ("RMSprop", dict(momentum=0.9, rho=0.8)),
    "rmsprop_centered": ("RMSprop", dict(centered=True)),
    "rmsprop_centered_momentum": ("RMSprop", dict(learning_rate=0.01, centered=True, momentum=0.5)),
    "muon": ("Muon", dict(learning_rate=0.01)),  # the (4, 5) variable by its Muon rule, the others by AdamW
    "muon_plain": ("Muon", dict(learning_rate=0.05, nesterov=False, rms_rate=None, adam_lr_ratio=0.5)),
}
# Muon's matrix products are NumPy's, not TensorFlow's (ps_server.core.optim.muon): a matrix it
# steps by its Muon rule ends within this of Keras' largest element; everything else to the bit.
MUON_BOUND = 1e-6
OPTIONS = {
    "weight_decay": dict(weight_decay=0.05),
    "clipvalue": dict(clipvalue=0.05),
    "clipnorm": dict(clipnorm=0.1),  # clips every variable here
    "clipnorm_not_clipping": dict(clipnorm=100.0),
    "global_clipnorm": dict(global_clipnorm=0.5),
    "ema": dict(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3),
    "ema_kept": dict(use_ema=True, ema_momentum=0.9),  # never overwritten while training
}
SCHEDULES = {
    "exponential": ("ExponentialDecay", dict(initial_learning_rate=0.01, decay_steps=5, decay_rate=0.5)),
    "cosine_warmup": ("CosineDecay", dict(initial_learning_rate=0.0, decay_steps=20, warmup_target=0.01,
                                          warmup_steps=5)),
    "piecewise": ("PiecewiseConstantDecay", dict(boundaries=[5, 10], values=[0.1, 0.01, 0.001])),
}
APPLY_CASES = (
    [(case, None) for case in KERAS_OPTIMIZERS]
    + [(case, option) for case in ("sgd_nesterov", "adam_amsgrad", "adagrad", "rmsprop_centered_momentum")
       for option in OPTIONS]
    + [("adamw", "global_clipnorm"), ("rmsprop", "ema"), ("adam", "ema_kept")]
    + [("muon", option) for option in ("weight_decay", "clipnorm", "global_clipnorm", "ema")]
)


def apply_problem(seed=0, dtype=np.float32, shapes=APPLY_SHAPES):
    rng = np.random.default_rng(seed)
    init = [np.asarray(rng.standard_normal(s), dtype) for s in shapes]
    grads = [[np.asarray(0.1 * rng.standard_normal(s), dtype) for s in shapes] for _ in range(STEPS)]
    return init, grads


def keras_apply(keras, optimizer, init, grads):
    """``optimizer.apply`` eagerly, once per step, on Keras variables of ``init``."""
    variables = [keras.Variable(x) for x in init]
    for step_grads in grads:
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in step_grads], variables)
    return [v.numpy() for v in variables]


def ours_apply(spec, init, grads):
    """What the store does with one update: the global clip scale over all of it, then each variable."""
    opt = make_optimizer(spec)
    values = list(init)
    states = [opt.init_state(v) for v in values]
    for step_grads in grads:
        scale = opt.global_clip_scale(step_grads)
        for i, g in enumerate(step_grads):
            values[i], states[i] = opt.apply(values[i], g, states[i], clip_scale=scale)
    return values


def assert_like_keras(ours, theirs, muon=False):
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        if muon and a.ndim == 2:
            assert np.abs(a - b).max() <= MUON_BOUND * np.abs(b).max(), f"variable of shape {a.shape}"
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"variable of shape {a.shape}")


def make_keras(keras, case, option=None, schedule=None):
    class_name, kwargs = KERAS_OPTIMIZERS[case]
    kwargs = {**kwargs, **OPTIONS.get(option, {})}
    if schedule is not None:
        name, config = SCHEDULES[schedule]
        kwargs["learning_rate"] = getattr(keras.optimizers.schedules, name)(**config)
    return getattr(keras.optimizers, class_name)(**kwargs)


@pytest.mark.parametrize("case,option", APPLY_CASES, ids=[f"{c}-{o}" for c, o in APPLY_CASES])
def test_every_optimizer_and_option_matches_eager_keras_after_20_updates(keras, case, option):
    init, grads = apply_problem()
    optimizer = make_keras(keras, case, option)
    spec = OptimizerSpec.from_keras(type(optimizer).__name__, optimizer.get_config())
    ours = ours_apply(spec, init, grads)
    assert_like_keras(ours, keras_apply(keras, optimizer, init, grads), muon=spec.name == "muon")


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("case,option", [("adam", None), ("sgd_nesterov", "weight_decay")])
def test_a_learning_rate_schedule_matches_eager_keras_bit_for_bit(keras, schedule, case, option):
    """The schedule at the update count before the step, for the step and for weight decay."""
    init, grads = apply_problem(seed=1)
    optimizer = make_keras(keras, case, option, schedule)
    spec = OptimizerSpec.from_keras(type(optimizer).__name__, optimizer.get_config())
    assert spec.learning_rate_schedule["class_name"] == SCHEDULES[schedule][0]
    assert_like_keras(ours_apply(spec, init, grads), keras_apply(keras, optimizer, init, grads))


MORE = ("Adamax", "Nadam", "Ftrl", "Lion")  # ps_server/core/optim/more_optimizers.py


@pytest.mark.parametrize("class_name,option", [(c, o) for c in MORE for o in OPTIONS])
def test_every_option_applies_around_the_more_optimizers_too(keras, class_name, option):
    init, grads = apply_problem(seed=2)
    optimizer = getattr(keras.optimizers, class_name)(**OPTIONS[option])
    spec = OptimizerSpec.from_keras(class_name, optimizer.get_config())
    assert type(make_optimizer(spec)).__name__ == class_name
    assert_like_keras(ours_apply(spec, init, grads), keras_apply(keras, optimizer, init, grads))


def test_from_keras_reads_every_argument_of_the_keras_config(keras):
    optimizer = keras.optimizers.RMSprop(learning_rate=0.02, rho=0.8, momentum=0.5, epsilon=1e-6, centered=True,
                                         clipvalue=0.5, use_ema=True, ema_momentum=0.95, ema_overwrite_frequency=7)
    spec = OptimizerSpec.from_keras("RMSprop", optimizer.get_config())
    assert spec == OptimizerSpec("rmsprop", learning_rate=np.float32(0.02).item(), rho=0.8, momentum=0.5,
                                 epsilon=1e-6, centered=True, clipvalue=0.5, use_ema=True, ema_momentum=0.95,
                                 ema_overwrite_frequency=7)
    assert OptimizerSpec.from_keras("AdamW", keras.optimizers.AdamW(weight_decay=0.0).get_config()).name == "adam"


@pytest.mark.parametrize("class_name,config,message", [
    ("Muon", {"rms_rate": 0}, "Muon with rms_rate=0 cannot run on the server"),
    ("LossScaleOptimizer", {}, "optimizer LossScaleOptimizer cannot run on the server"),
    ("SGD", {"loss_scale_factor": 128.0}, "SGD with loss_scale_factor=128.0 cannot run on the server"),
    ("SGD", {"lr": 0.1}, "SGD has config keys the server does not know: lr"),
    ("SGD", {"learning_rate": {"class_name": "MySchedule", "config": {}, "module": None,
                               "registered_name": "MySchedule"}}, "learning-rate schedule MySchedule"),
    ("Adam", {"learning_rate": 0.0}, "learning_rate must be > 0"),
    ("RMSprop", {"rho": 1.5}, r"rho must be in \[0, 1\)"),
])
def test_from_keras_refuses_what_the_server_cannot_run_in_one_line_naming_it(class_name, config, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        OptimizerSpec.from_keras(class_name, {"name": "x", "is_legacy_optimizer": False, **config})
    assert "\n" not in str(e.value)


def test_global_clip_scale_is_clipnorm_over_the_norm_of_all_gradients_and_one_below_it():
    opt = make_optimizer(OptimizerSpec("sgd", learning_rate=1.0, global_clipnorm=1.0))
    grads = [np.array([3.0, 0.0], np.float32), np.array([4.0], np.float32)]  # norm 5
    assert opt.global_clip_scale(grads) == np.float32(0.2)
    assert opt.global_clip_scale([g / 10 for g in grads]) == np.float32(1.0)
    w = np.zeros(2, np.float32)
    np.testing.assert_array_equal(opt.apply(w, grads[0], opt.init_state(w), clip_scale=np.float32(0.2))[0],
                                  np.array([-3 * np.float32(0.2), 0.0], np.float32))
    with pytest.raises(InvalidArgument, match="global_clipnorm clips by the norm of the whole update"):
        opt.apply(w, grads[0], opt.init_state(w))
    assert make_optimizer(OptimizerSpec("sgd")).global_clip_scale(grads) is None


def test_ema_slot_is_the_moving_average_and_overwrites_the_variable_every_frequency_steps():
    opt = make_optimizer(OptimizerSpec("sgd", learning_rate=1.0, use_ema=True, ema_momentum=0.5,
                                       ema_overwrite_frequency=2))
    w = np.zeros(1, np.float32)
    state = opt.init_state(w)
    w, state = opt.apply(w, np.ones(1, np.float32), state)  # w = -1; first step: ema = w
    assert w[0] == -1.0 and state["ema"][0] == -1.0
    w, state = opt.apply(w, np.ones(1, np.float32), state)  # w = -2; ema = 0.5*-1 + 0.5*-2; w = ema
    assert state["ema"][0] == -1.5 and w[0] == -1.5


K = 3  # gradient_accumulation_steps of the tests below


def ours_windows(spec, values, states, windows):
    """One update per window of K batches' gradients, with the mean the worker pushes
    (``worker.keras.Window``: each batch's added to zeros in turn, ``(g + sum) / K``)."""
    opt = make_optimizer(spec)
    for window in windows:
        for i in range(len(values)):
            sums = np.zeros_like(values[i]) + window[0][i]
            for batch in window[1:-1]:
                sums = sums + batch[i]
            mean = np.asarray(np.divide(window[-1][i] + sums, np.asarray(K, values[i].dtype)))  # 0-d: an array
            values[i], states[i] = opt.apply(values[i], mean, states[i])
    return opt


@pytest.mark.parametrize("frequency", [None, 2])
@pytest.mark.parametrize("case,option,schedule", [("adam", None, None), ("sgd_nesterov", "weight_decay", None),
                                                  ("rmsprop_centered_momentum", "clipvalue", "exponential")])
def test_ema_under_accumulation_moves_at_every_batch_as_keras_moves_it(keras, case, option, schedule, frequency):
    """Keras moves the average at each of a window's K batches, momentum 0 through the
    first window (its ``iterations``, ``_iterations // K``, is 0): the server's update
    moves it K - 1 times with the value before, then once after. With
    ``ema_overwrite_frequency`` 2 the windows of ``iterations`` 1 and 3 overwrite the variable
    at each batch: the moves after the first are of the average with itself, and the update
    steps from the average (the 11 batches end 2 batches into such a window). After 11 batches (three
    updates, two batches of the fourth window) the variables and the averages are Keras',
    bit for bit, the averages once the end of a fit (``averaged``) moves them for the batches
    held, a second ask moving nothing. Then, as a second fit after Keras'
    ``finalize_variable_values``: the variables are the averages, the window's last batch
    comes (its update moves the average once, after the step: the fit's end moved it for the
    window's other batches, ``ema_moved``) and one window more."""
    init, grads = apply_problem(seed=3)
    optimizer = make_keras(keras, case, option, schedule)
    optimizer.gradient_accumulation_steps = K
    optimizer.use_ema, optimizer.ema_momentum, optimizer.ema_overwrite_frequency = True, 0.8, frequency
    spec = OptimizerSpec.from_keras(type(optimizer).__name__, optimizer.get_config())
    assert spec.gradient_accumulation_steps == K and spec.use_ema and spec.ema_overwrite_frequency == frequency
    variables = [keras.Variable(x) for x in init]

    def keras_batches(batches):
        for step_grads in batches:
            optimizer.apply([keras.ops.convert_to_tensor(g) for g in step_grads], variables)
        return [v.numpy() for v in variables], [a.numpy() for a in optimizer._model_variables_moving_average]

    values, _ = keras_batches(grads[:9])
    ours = list(init)
    states = [make_optimizer(spec).init_state(v) for v in ours]
    opt = ours_windows(spec, ours, states, [grads[0:3], grads[3:6], grads[6:9]])
    assert_like_keras(ours, values)
    _, averages = keras_batches(grads[9:11])
    taken = [opt.averaged(v, s, batches=2) for v, s in zip(ours, states)]
    assert_like_keras([t[0] for t in taken], averages)
    ours, states = [t[0] for t in taken], [t[1] for t in taken]
    again = [opt.averaged(v, s, batches=2) for v, s in zip(ours, states)]  # another worker's ask
    assert all(a[0] is s["ema"] and a[1] is s for a, s in zip(again, states))
    optimizer.finalize_variable_values(variables)
    values, averages = keras_batches(grads[11:15])
    ours_windows(spec, ours, states, [grads[9:12], grads[12:15]])
    assert_like_keras(ours, values)
    assert_like_keras([s["ema"] for s in states], averages)
    assert all(s["ema_moved"] == 0 and s["iterations"] == 5 for s in states)


def test_keras_overwrites_at_every_batch_of_an_overwrite_window_and_the_server_steps_from_the_average(keras):
    """``ema_overwrite_frequency`` with accumulation, by hand: with frequency 2 and K = 3
    batches an update, Keras overwrites at every batch of the windows whose ``iterations`` is 1
    and 3, not only at updates: batch 10, the first of the fourth window, changes the variable
    to the average, and the window's next gradients are taken there (``tfps.keras`` moves the
    server's average for them). The server's updates are Keras' at batches 3, 6 and 9."""
    optimizer = keras.optimizers.SGD(1.0, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2,
                                     gradient_accumulation_steps=K)
    w = keras.Variable(np.zeros(1, np.float32))
    seen = []
    for _ in range(3 * K + 1):
        optimizer.apply([keras.ops.ones((1,))], [w])
        seen.append(float(w.numpy()[0]))
    # by hand: the updates (batches 3, 6, 9) step by -1; the average a, momentum 0 in the first window:
    # a = -1 after batch 3; batch 6: a = (-1 + -2) / 2, overwritten; batch 9: a = (-1.5 + -2.5) / 2,
    # not overwritten (iterations 2); batch 10: a = (-2 + -2.5) / 2, overwritten, though no update
    assert seen == [0.0, 0.0, -1.0, -1.0, -1.0, -1.5, -1.5, -1.5, -2.5, -2.25]
    spec, ours = OptimizerSpec.from_keras("SGD", optimizer.get_config()), [np.zeros(1, np.float32)]
    states, one = [make_optimizer(spec).init_state(ours[0])], [np.ones(1, np.float32)]
    for update in range(3):
        ours_windows(spec, ours, states, [[one] * K])
        assert float(ours[0][0]) == seen[K * update + K - 1]


@pytest.mark.parametrize("ema", [None, "ema", "ema-overwrite"])
@pytest.mark.parametrize("case,option,schedule", [("adam", "global_clipnorm", None),
                                                  ("rmsprop_centered_momentum", "clipvalue", "exponential")])
def test_a_window_the_server_holds_is_keras_accumulation_batch_by_batch(keras, case, option, schedule, ema):
    """Elastic sync: each round a batch, the server holds the window (``accumulate``, then
    ``apply`` of ``window_mean`` at its K-th batch). After every one of 14 batches the variables,
    the averages and Keras' accumulators are Keras' own, bit for bit: between updates the
    variables stand still, but in a window whose update overwrites (``ema_overwrite_frequency``
    2) they are the moved average after each batch, as Keras overwrites them."""
    init, grads = apply_problem(seed=5)
    optimizer = make_keras(keras, case, option, schedule)
    optimizer.gradient_accumulation_steps = K
    if ema:
        optimizer.use_ema, optimizer.ema_momentum = True, 0.8
        optimizer.ema_overwrite_frequency = 2 if ema == "ema-overwrite" else None
    spec = OptimizerSpec.from_keras(type(optimizer).__name__, optimizer.get_config())
    opt, variables, ours = make_optimizer(spec), [keras.Variable(x) for x in init], list(init)
    states = [opt.init_state(v) for v in ours]
    moved_between = False  # the variables changed at a batch that was not an update
    for batch, step_grads in enumerate(grads[:14]):
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in step_grads], variables)
        ends, before = opt.window_ends(states[0]), ours
        if ends:
            means = [opt.window_mean(g, s) for g, s in zip(step_grads, states)]
            scale = opt.global_clip_scale(means)
            stepped = [opt.apply(v, g, s, clip_scale=scale) for v, g, s in zip(ours, means, states)]
        else:
            stepped = [opt.accumulate(v, g, s) for v, g, s in zip(ours, step_grads, states)]
        ours, states = [x[0] for x in stepped], [x[1] for x in stepped]
        moved_between |= not ends and any(not np.array_equal(a, b) for a, b in zip(ours, before))
        assert_like_keras(ours, [v.numpy() for v in variables])
        assert_like_keras([s["accumulated"] for s in states], [a.numpy() for a in optimizer._accumulated_gradients])
        if ema:
            averages = optimizer._model_variables_moving_average
            assert_like_keras([s["ema"] for s in states], [a.numpy() for a in averages])
        assert all(int(s["iterations"]) * K + int(s["accumulated_batches"]) == batch + 1 for s in states)
    assert moved_between == (ema == "ema-overwrite")
    with pytest.raises(InvalidArgument, match="is its update: apply window_mean"):
        opt.accumulate(ours[0], grads[0][0], {**states[0], "accumulated_batches": np.asarray(K - 1, np.float32)})


def test_averaged_takes_the_batches_of_a_window_under_way_only_under_accumulation():
    w = np.zeros(2, np.float32)
    plain = make_optimizer(OptimizerSpec("sgd", use_ema=True))
    with pytest.raises(InvalidArgument, match="a window under way holds 1 to gradient_accumulation_steps - 1"):
        plain.averaged(w, plain.init_state(w), batches=1)
    windowed = make_optimizer(OptimizerSpec("sgd", use_ema=True, gradient_accumulation_steps=K))
    with pytest.raises(InvalidArgument, match=f"this optimizer's {K}\\); got {K}"):
        windowed.averaged(w, windowed.init_state(w), batches=K)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("option", ["clipnorm", "global_clipnorm"])
def test_the_norms_add_as_tensorflow_adds_so_clipping_is_bit_identical_too(keras, option, dtype):
    """Variables of every size class of the sum: under a packet, under four, a remainder, and over
    1024 packets (the sum splits in halves)."""
    shapes = [(3,), (29,), (7, 13), (9000,)]
    init, grads = apply_problem(seed=3, dtype=dtype, shapes=shapes)
    optimizer = make_keras(keras, "adam", option)
    spec = OptimizerSpec.from_keras("Adam", optimizer.get_config())
    assert_like_keras(ours_apply(spec, init, grads), keras_apply(keras, optimizer, init, grads))


def test_tf_sum_adds_in_tensorflow_s_order(keras):
    import tensorflow as tf

    from ps_server.core.optim.optimizers import tf_sum

    rng = np.random.default_rng(4)
    other_order = 0
    for n in [1, 7, 8, 31, 32, 33, 70, 257, 4097, 8191, 8193, 20001, 45001]:
        for dtype in (np.float32, np.float64):
            x = np.square(rng.standard_normal(n)).astype(dtype)
            assert tf_sum(x) == tf.reduce_sum(x).numpy(), (n, dtype)
            other_order += tf_sum(x) != np.sum(x, dtype=np.float64).astype(dtype)
    assert other_order > 0  # the order matters: the exact sum rounded once is not it


@pytest.mark.parametrize("option", ["clipnorm", "global_clipnorm"])
def test_a_variable_whose_sum_tensorflow_shares_out_among_threads_is_clipped_within_1e_6(keras, option):
    """Above ~100,000 float32 elements TensorFlow's reduce_sum splits by its thread pool: the bound."""
    init, grads = apply_problem(seed=5, shapes=[(300, 501), (10,)])
    optimizer = make_keras(keras, "rmsprop_momentum", option)
    spec = OptimizerSpec.from_keras("RMSprop", optimizer.get_config())
    for a, b in zip(ours_apply(spec, init, grads), keras_apply(keras, optimizer, init, grads)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.max(np.abs(b)))


@pytest.mark.parametrize("class_name", ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", *MORE])
@pytest.mark.parametrize("schedule", ["exponential", "piecewise"])
def test_every_optimizer_steps_a_schedule_bit_for_bit(keras, class_name, schedule):
    init, grads = apply_problem(seed=3)
    name, config = SCHEDULES[schedule]
    optimizer = getattr(keras.optimizers, class_name)(
        learning_rate=getattr(keras.optimizers.schedules, name)(**config))
    spec = OptimizerSpec.from_keras(class_name, optimizer.get_config())
    assert_like_keras(ours_apply(spec, init, grads), keras_apply(keras, optimizer, init, grads))
