"""Tests of worker.keras_optimizer: a compiled Keras optimizer as the server's fields.

    python -m pytest tests/worker/test_keras_optimizer.py -q

With real Keras 3 optimizers: what the worker sends is what the server reads from the
same optimizer (``OptimizerSpec.from_keras``), across the wire's OptimizerConfig; what
the server cannot run is refused in one line naming it.
"""

import dataclasses
import json
import os

import pytest

from protos import tfps_pb2 as pb
from ps_common import names
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.service import optimizer_from_wire
from worker.keras_optimizer import spec_fields


@pytest.fixture(scope="module")
def keras():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras as keras_module

    return keras_module


def optimizers(keras):
    O, S = keras.optimizers, keras.optimizers.schedules
    return [
        O.SGD(learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
        O.Adam(amsgrad=True, clipnorm=1.0),
        O.AdamW(learning_rate=S.CosineDecay(0.0, 100, warmup_target=0.01, warmup_steps=10)),
        O.Adagrad(initial_accumulator_value=0.5, global_clipnorm=2.0),
        O.RMSprop(rho=0.8, momentum=0.5, centered=True, use_ema=True, ema_overwrite_frequency=5),
        O.Adamax(clipvalue=0.5),
        O.Nadam(learning_rate=S.PiecewiseConstantDecay([10, 20], [0.1, 0.01, 0.001])),
        O.Ftrl(l1_regularization_strength=0.01, beta=0.1),
        O.Lion(learning_rate=S.ExponentialDecay(1e-4, 100, 0.9, staircase=True)),
        O.Adadelta(rho=0.9, clipnorm=1.0),
        O.Lamb(beta_1=0.8, weight_decay=0.01),
        O.Adafactor(clip_threshold=0.5, relative_step=False, epsilon_2=0.002),
        O.ScheduleFreeAdamW(warmup_steps=10, weight_decay=0.01),
        O.Muon(exclude_layers=["head"], exclude_embeddings=False, rms_rate=None, adam_weight_decay=None, ns_steps=3),
    ]


def test_the_server_reads_from_the_wire_what_it_reads_from_the_optimizer_itself(keras):
    for optimizer in optimizers(keras):
        fields = spec_fields(optimizer)
        assert set(fields) == {f.name for f in pb.OptimizerConfig.DESCRIPTOR.fields}
        sent = optimizer_from_wire(pb.OptimizerConfig(**fields))
        expected = OptimizerSpec.from_keras(type(optimizer).__name__, optimizer.get_config())
        # and the rule Keras steps repeated rows by, which the server takes where it was given none
        assert sent == dataclasses.replace(expected, sparse_rule="keras"), type(optimizer).__name__
        sent.validate()


def test_a_schedule_travels_as_the_json_of_its_serialization(keras):
    schedule = keras.optimizers.schedules.InverseTimeDecay(0.1, 10, 0.5)
    fields = spec_fields(keras.optimizers.SGD(learning_rate=schedule))
    assert json.loads(fields["learning_rate_schedule"]) == keras.optimizers.schedules.serialize(schedule)
    assert spec_fields(keras.optimizers.SGD())["learning_rate_schedule"] == ""


def test_adamw_without_weight_decay_is_sent_as_adam(keras):
    assert spec_fields(keras.optimizers.AdamW(weight_decay=0.0))["name"] == "adam"


def refusals(keras):
    O = keras.optimizers

    class MySchedule(O.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.1

        def get_config(self):
            return {}

    class MyAdam(O.Adam):
        pass

    wd, muon = O.AdamW(), O.Muon(weight_decay=None)
    wd.exclude_from_weight_decay(var_names=["bias"])
    muon.exclude_from_weight_decay(var_names=["bias"])  # adam_weight_decay is still 0.004
    return [
        (O.Muon(rms_rate=0), "Muon with rms_rate=0 cannot run on the server"),
        (muon, "Muon with exclude_from_weight_decay cannot run on the server"),
        (MyAdam(), r"optimizer tests\.worker\.test_keras_optimizer\.MyAdam cannot run on the server"),
        (type("Adam", (O.Adam,), {"__module__": "my_program"})(), "optimizer my_program.Adam cannot run"),
        (O.LossScaleOptimizer(O.SGD()), "optimizer LossScaleOptimizer cannot run on the server: it scales"),
        (O.MultiOptimizer(O.OptimizerMap(O.SGD())), "optimizer MultiOptimizer cannot run on the server: it steps"),
        (O.SGD(learning_rate=MySchedule()), "learning-rate schedule MySchedule .* cannot run on the server"),
        (wd, "AdamW with exclude_from_weight_decay cannot run on the server"),
    ]


def test_every_keras_optimizer_is_run_by_the_server_or_refused_with_a_reason(keras):
    """A Keras release that adds an optimizer fails here until the server runs it
    (KERAS_OPTIMIZER_CLASSES) or refuses it with a reason (REFUSED_KERAS_OPTIMIZERS)."""
    O = keras.optimizers
    classes = {n for n in dir(O) if isinstance(getattr(O, n), type) and issubclass(getattr(O, n), O.Optimizer)}
    run, refused = set(names.KERAS_OPTIMIZER_CLASSES), set(names.REFUSED_KERAS_OPTIMIZERS)
    assert not run & refused
    assert classes - run - refused == set(), "neither run nor refused"
    assert {"Adadelta", "Lamb", "Adafactor", "Muon"} <= run
    for class_name, reason in names.REFUSED_KERAS_OPTIMIZERS.items():
        with pytest.raises(ValueError) as e:
            names.keras_optimizer_fields(class_name, {})
        assert str(e.value) == f"optimizer {class_name} cannot run on the server: {reason}"
        assert "\n" not in reason


def test_what_the_server_cannot_run_is_refused_in_one_line_naming_it(keras):
    for optimizer, message in refusals(keras):
        with pytest.raises(ValueError, match=message) as e:
            spec_fields(optimizer)
        assert "\n" not in str(e.value)


def test_a_spec_crosses_the_wire_and_back_unchanged():
    from ps_server.service import optimizer_to_wire

    specs = [
        OptimizerSpec("adamw", learning_rate=0.002, amsgrad=True, global_clipnorm=1.5),
        OptimizerSpec("rmsprop", centered=True, use_ema=True, ema_overwrite_frequency=4, weight_decay=0.01,
                      learning_rate_schedule={"class_name": "PolynomialDecay",
                                              "config": {"initial_learning_rate": 0.1, "decay_steps": 50}}),
        OptimizerSpec("sgd", 0.1),
        OptimizerSpec("muon", exclude_layers=("head", "^out/"), exclude_embeddings=False, rms_rate=None, ns_steps=3),
    ]
    for spec in specs:
        assert optimizer_from_wire(optimizer_to_wire(spec)) == spec
