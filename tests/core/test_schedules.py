"""Tests of ps_server.core.optim.schedules: parity with Keras' schedules, and refusals.

    python -m pytest tests/core/test_schedules.py -q

The parity tests serialize a real Keras schedule, evaluate the dict on our side
and compare with the Keras schedule called on the same step, bit for bit. They
import TensorFlow lazily (fixture ``keras``), with oneDNN off as everywhere we
compare bits; the refusal tests need only NumPy.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from ps_server.core.optim import schedules
from ps_server.core.errors import InvalidArgument
from ps_server.core.optim.schedules import SCHEDULES, learning_rate, validate

GRAPH_BOUND = 1e-6  # of the schedule's largest value, inside tf.function; see the module docstring
STEPS = list(range(201)) + [1000, 4999, 5000, 10**5, 10**6, 2**24 + 1, 10**9]

# (Keras class, arguments); every option of every schedule the server runs.
PARITY_CASES = {
    "exponential": ("ExponentialDecay", dict(initial_learning_rate=0.1, decay_steps=7, decay_rate=0.93)),
    "exponential_staircase": (
        "ExponentialDecay", dict(initial_learning_rate=0.05, decay_steps=10, decay_rate=0.5, staircase=True)),
    "exponential_float_steps": (
        "ExponentialDecay", dict(initial_learning_rate=3e-4, decay_steps=12.5, decay_rate=0.96)),
    "piecewise": ("PiecewiseConstantDecay", dict(boundaries=[10, 50, 120], values=[0.1, 0.05, 0.01, 1e-3])),
    "piecewise_one_boundary": ("PiecewiseConstantDecay", dict(boundaries=[100], values=[1.0, 0.5])),
    "piecewise_float_boundaries": (
        "PiecewiseConstantDecay", dict(boundaries=[9.5, 60.0, 150.7], values=[0.3, 0.2, 0.1, 0.05])),
    "polynomial": ("PolynomialDecay", dict(initial_learning_rate=0.1, decay_steps=150)),
    "polynomial_power": (
        "PolynomialDecay", dict(initial_learning_rate=0.1, decay_steps=90, end_learning_rate=0.001, power=0.5)),
    "polynomial_cycle": (
        "PolynomialDecay",
        dict(initial_learning_rate=0.01, decay_steps=33, end_learning_rate=1e-5, power=2.0, cycle=True)),
    "inverse_time": ("InverseTimeDecay", dict(initial_learning_rate=0.1, decay_steps=11, decay_rate=0.7)),
    "inverse_time_staircase": (
        "InverseTimeDecay", dict(initial_learning_rate=0.1, decay_steps=8, decay_rate=0.5, staircase=True)),
    "cosine": ("CosineDecay", dict(initial_learning_rate=0.1, decay_steps=170)),
    "cosine_alpha": ("CosineDecay", dict(initial_learning_rate=0.02, decay_steps=130, alpha=0.1)),
    "cosine_warmup": (
        "CosineDecay",
        dict(initial_learning_rate=0.0, decay_steps=150, alpha=0.05, warmup_target=0.1, warmup_steps=30)),
    "cosine_warmup_from_nonzero": (
        "CosineDecay", dict(initial_learning_rate=1e-3, decay_steps=60, warmup_target=0.3, warmup_steps=17)),
    "restarts": ("CosineDecayRestarts", dict(initial_learning_rate=0.1, first_decay_steps=10)),
    "restarts_t_mul_1": (
        "CosineDecayRestarts", dict(initial_learning_rate=0.1, first_decay_steps=13, t_mul=1.0, m_mul=0.9)),
    "restarts_all_options": (
        "CosineDecayRestarts",
        dict(initial_learning_rate=0.05, first_decay_steps=7, t_mul=1.5, m_mul=0.8, alpha=0.01)),
    "restarts_t_mul_3": ("CosineDecayRestarts", dict(initial_learning_rate=1.0, first_decay_steps=2, t_mul=3.0)),
}


@pytest.fixture(scope="module")
def keras():
    # oneDNN changes TensorFlow's bits; it must be off before TensorFlow loads.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras as keras_module

    return keras_module


def keras_schedule(keras, case):
    class_name, kwargs = PARITY_CASES[case]
    return getattr(keras.optimizers.schedules, class_name)(**kwargs)


def differences(ours, theirs):
    """(steps where the bits differ, largest relative difference)."""
    ours, theirs = np.array(ours, np.float32), np.array(theirs, np.float32)
    assert ours.dtype == theirs.dtype == np.float32
    bad = [s for s, a, b in zip(STEPS, ours, theirs) if a != b]
    rel = np.abs(ours.astype(np.float64) - theirs) / np.maximum(np.abs(theirs.astype(np.float64)), 1e-30)
    return bad, float(rel.max())


def test_every_schedule_the_module_runs_has_a_parity_case():
    assert sorted({name for name, _ in PARITY_CASES.values()}) == sorted(SCHEDULES)


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_value_is_bit_identical_to_the_keras_schedule_at_every_step(keras, case):
    schedule = keras_schedule(keras, case)
    spec = keras.optimizers.schedules.serialize(schedule)
    validate(spec)
    theirs = [schedule(step).numpy() for step in STEPS]
    ours = [learning_rate(spec, step) for step in STEPS]
    assert all(type(x) is np.float32 for x in ours)
    bad, rel = differences(ours, theirs)
    assert rel <= 1e-6, f"largest relative difference {rel}"
    assert not bad, f"not bit-identical at steps {bad[:10]}, largest relative difference {rel}"


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_value_at_optimizer_iterations_equals_what_the_eager_keras_optimizer_reads(keras, case):
    # The optimizer calls the schedule on `iterations`, an int64 variable, not a Python int.
    schedule = keras_schedule(keras, case)
    spec = keras.optimizers.schedules.serialize(schedule)
    optimizer = keras.optimizers.SGD(learning_rate=schedule)
    optimizer.build([keras.Variable(np.zeros(2, np.float32))])
    for step in (0, 1, 9, 10, 11, 49, 50, 51, 150, 171, 10**6, 10**10):
        optimizer.iterations.assign(step)
        assert learning_rate(spec, step) == optimizer.learning_rate.numpy(), f"step {step}"


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_inside_tf_function_keras_rounds_differently_within_the_documented_bound(keras, case):
    # Grappler rewrites a division by a constant into a multiplication by its float32
    # reciprocal, so a compiled step reads intermediates up to 1 ulp different from eager
    # Keras (and the server). The bound is on the difference relative to the schedule's
    # largest value: near a cosine's end a 1-ulp step difference is a large relative one.
    import tensorflow as tf

    schedule = keras_schedule(keras, case)
    spec = keras.optimizers.schedules.serialize(schedule)
    step_variable = tf.Variable(0, dtype=tf.int64)
    compiled = tf.function(lambda: schedule(step_variable))
    theirs = []
    for step in STEPS:
        step_variable.assign(step)
        theirs.append(compiled().numpy())
    ours = np.array([learning_rate(spec, step) for step in STEPS], np.float64)
    theirs = np.array(theirs, np.float64)
    peak = np.abs(theirs).max()
    worst = np.abs(ours - theirs).max() / peak
    assert worst <= GRAPH_BOUND, f"largest difference {worst} of the peak"


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_without_the_c_library_values_are_within_the_documented_bound(keras, case, monkeypatch):
    monkeypatch.setattr(schedules, "_C_FUNCTIONS", None)  # the float64 `math` stand-in
    schedule = keras_schedule(keras, case)
    spec = keras.optimizers.schedules.serialize(schedule)
    _, rel = differences([learning_rate(spec, s) for s in STEPS], [schedule(s).numpy() for s in STEPS])
    assert rel <= 1e-6, f"largest relative difference {rel}"


def test_the_server_calls_the_c_library_float_functions_here():
    # Bit-identity with TensorFlow rests on calling its powf/cosf/logf (see the docstring).
    assert schedules.C_LIBRARY is not None


def test_the_config_from_an_optimizer_is_accepted_as_the_spec(keras):
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 100, warmup_target=0.2, warmup_steps=5)
    spec = keras.optimizers.Adam(learning_rate=schedule).get_config()["learning_rate"]
    assert learning_rate(spec, 3) == schedule(3).numpy()


def test_a_plain_number_is_a_constant_float32_learning_rate():
    assert learning_rate(0.1, 0) == learning_rate(0.1, 10**6) == np.float32(0.1)
    assert type(learning_rate(1, 5)) is np.float32


# --- Values computable by hand ---------------------------------------------------------------

def serialized(class_name, **config):
    return {"module": "keras.optimizers.schedules", "class_name": class_name,
            "config": config, "registered_name": None}


def test_piecewise_constant_takes_the_value_of_the_interval_including_its_upper_boundary():
    spec = serialized("PiecewiseConstantDecay", boundaries=[2, 4], values=[1.0, 0.5, 0.25])
    assert [learning_rate(spec, s) for s in range(6)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25]


def test_exponential_staircase_halves_once_every_decay_steps():
    spec = serialized("ExponentialDecay", initial_learning_rate=1.0, decay_steps=3, decay_rate=0.5,
                      staircase=True)
    assert [learning_rate(spec, s) for s in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.25]


def test_cosine_warmup_rises_linearly_to_the_target_then_decays_to_alpha_times_it():
    spec = serialized("CosineDecay", initial_learning_rate=0.0, decay_steps=4, alpha=0.5,
                      warmup_target=1.0, warmup_steps=4)
    assert [learning_rate(spec, s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert learning_rate(spec, 8) == learning_rate(spec, 100) == 0.5


# --- Refusals --------------------------------------------------------------------------------

def test_an_unknown_class_name_is_refused_naming_it():
    with pytest.raises(InvalidArgument, match="learning-rate schedule CyclicLR is not one the server can run"):
        validate(serialized("CyclicLR", initial_learning_rate=0.1))
    with pytest.raises(InvalidArgument, match="CyclicLR"):
        learning_rate(serialized("CyclicLR", initial_learning_rate=0.1), 0)


def test_a_users_own_schedule_serialized_by_keras_is_refused_naming_it(keras):
    class MySchedule(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.1

        def get_config(self):
            return {}

    spec = keras.optimizers.schedules.serialize(MySchedule())
    with pytest.raises(InvalidArgument, match="learning-rate schedule MySchedule is not one the server can run"):
        validate(spec)


def test_a_users_subclass_of_a_keras_schedule_is_refused_even_under_the_same_name(keras):
    @keras.saving.register_keras_serializable(package="mine")
    class ExponentialDecay(keras.optimizers.schedules.ExponentialDecay):
        pass

    spec = keras.optimizers.schedules.serialize(ExponentialDecay(0.1, 10, 0.9))
    assert spec["class_name"] == "ExponentialDecay"
    with pytest.raises(InvalidArgument, match=r"ExponentialDecay is not one .*a user's own class"):
        validate(spec)


@pytest.mark.parametrize(
    "spec,message",
    [
        (serialized("ExponentialDecay", initial_learning_rate=0.1, decay_steps=10, decay_rate=0.9, cycle=True),
         "ExponentialDecay has config keys the server does not know: cycle"),
        (serialized("ExponentialDecay", initial_learning_rate=0.1, decay_steps=10),
         "ExponentialDecay lacks decay_rate"),
        (serialized("PolynomialDecay", initial_learning_rate=0.1, decay_steps=0),
         "PolynomialDecay: decay_steps must be > 0; got 0"),
        (serialized("CosineDecay", initial_learning_rate=float("nan"), decay_steps=10),
         "CosineDecay: initial_learning_rate must be a finite number; got nan"),
        (serialized("CosineDecay", initial_learning_rate=0.1, decay_steps=10, alpha="0.1"),
         "CosineDecay: alpha must be a finite number; got '0.1'"),
        (serialized("CosineDecay", initial_learning_rate=0.1, decay_steps=10, warmup_steps=-1),
         "CosineDecay: warmup_steps must be >= 0; got -1"),
        (serialized("InverseTimeDecay", initial_learning_rate=0.1, decay_steps=10, decay_rate=0.5,
                    staircase="yes"),
         "InverseTimeDecay: staircase must be True or False; got 'yes'"),
        (serialized("ExponentialDecay", initial_learning_rate=1, decay_steps=10, decay_rate=0.9),
         "ExponentialDecay: initial_learning_rate must be floats .*integer arithmetic.*; got 1"),
        (serialized("CosineDecayRestarts", initial_learning_rate=0.1, first_decay_steps=10, t_mul=0.0),
         "CosineDecayRestarts: t_mul must be > 0; got 0.0"),
        ({"class_name": "CosineDecay", "module": "keras.optimizers.schedules", "registered_name": None},
         "CosineDecay has no config dict"),
        ({"config": {}}, "serialized learning-rate schedule has no class_name"),
        ("0.1", "learning_rate must be a number or a serialized keras.optimizers.schedules schedule"),
        (0.0, "learning_rate must be a finite number > 0; got 0.0"),
        (float("inf"), "learning_rate must be a finite number > 0; got inf"),
    ],
    ids=["unknown_key", "missing_key", "zero_decay_steps", "nan", "string_number", "negative_warmup",
         "non_bool_staircase", "int_initial_lr", "zero_t_mul", "no_config", "no_class_name",
         "string_spec", "zero_constant", "inf_constant"],
)
def test_a_malformed_spec_is_refused_naming_the_problem(spec, message):
    with pytest.raises(InvalidArgument, match=message):
        validate(spec)
    with pytest.raises(InvalidArgument, match=message):
        learning_rate(spec, 0)


@pytest.mark.parametrize(
    "boundaries,values,message",
    [
        ([10, 10], [0.1, 0.01, 0.001], r"boundaries must be strictly increasing; got \[10, 10\]"),
        ([20, 10], [0.1, 0.01, 0.001], r"boundaries must be strictly increasing; got \[20, 10\]"),
        ([10, 20], [0.1, 0.01], "values must be one more than boundaries; got 2 boundaries and 2 values"),
        ([], [0.1], r"boundaries must be a non-empty list of finite numbers; got \[\]"),
        ([10, float("inf")], [0.1, 0.01, 0.001], "boundaries must be a non-empty list of finite numbers"),
        ([10], [0.1, None], "values must be a non-empty list of finite numbers"),
        ([10], [1, 0.5], "values must be floats"),
    ],
)
def test_piecewise_boundaries_and_values_are_checked_before_training(boundaries, values, message):
    spec = serialized("PiecewiseConstantDecay", boundaries=boundaries, values=values)
    with pytest.raises(InvalidArgument, match=message):
        validate(spec)


@pytest.mark.parametrize("step", [-1, 1.0, True, "3"])
def test_the_step_must_be_a_nonnegative_int(step):
    with pytest.raises(InvalidArgument, match="learning-rate step must be an int >= 0"):
        learning_rate(0.1, step)


def test_a_step_where_keras_gives_nan_is_refused_not_applied():
    # t_mul < 1: the restarts' periods sum to first_decay_steps / (1 - t_mul) = 20 steps; after
    # that Keras takes the log of a negative number.
    spec = serialized("CosineDecayRestarts", initial_learning_rate=0.1, first_decay_steps=10, t_mul=0.5)
    assert np.isfinite(learning_rate(spec, 5))
    with pytest.raises(InvalidArgument, match="CosineDecayRestarts gives nan at step 30"):
        learning_rate(spec, 30)


def test_importing_schedules_loads_neither_tensorflow_nor_grpc_nor_protobuf():
    code = (
        "import sys, ps_server.core.optim.schedules\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'grpc')"
        " or m.startswith('google.protobuf'))\n"
        "assert not bad, bad\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True)
