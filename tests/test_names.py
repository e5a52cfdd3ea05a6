"""The shared names are the one definition the wire conversion is driven from."""

import json

import pytest

from protos import tfps_pb2 as pb
from protos import wire
from ps_common.names import (KERAS_OPTIMIZER_CLASSES, LEARNING_RATE_SCHEDULES, MODES, OPTIMIZER_DEFAULTS, OPTIMIZERS,
                             SCHEDULES_MODULE, keras_optimizer_fields, optimizer_fields)


def test_every_mode_name_is_a_value_of_the_proto_enum_and_back():
    on_wire = {v.name.lower() for v in pb.Mode.DESCRIPTOR.values if v.number != 0}
    assert set(MODES) == on_wire
    for name in MODES:
        assert wire.mode_from_wire(wire.mode_to_wire(name)) == name


def test_an_unknown_mode_value_reads_as_unknown():
    assert wire.mode_from_wire(pb.MODE_UNSPECIFIED) == "unknown"
    assert wire.mode_from_wire(99) == "unknown"


def test_optimizer_fields_fill_every_wire_field_with_that_optimizers_keras_default():
    assert set(optimizer_fields("adam")) == {f.name for f in pb.OptimizerConfig.DESCRIPTOR.fields}
    assert optimizer_fields("adam")["learning_rate"] == 0.001
    assert optimizer_fields("sgd")["learning_rate"] == 0.01
    assert optimizer_fields("sgd", momentum=0.9)["momentum"] == 0.9
    assert optimizer_fields("adam")["epsilon"] == OPTIMIZER_DEFAULTS["adam"]["epsilon"]
    assert optimizer_fields("adamw")["weight_decay"] == 0.004
    assert optimizer_fields("sgd")["weight_decay"] == 0  # None travels as 0
    assert optimizer_fields("rmsprop")["rho"] == 0.9 and optimizer_fields("ftrl")["learning_rate_power"] == -0.5
    schedule = {"class_name": "CosineDecay", "config": {"initial_learning_rate": 0.1, "decay_steps": 100}}
    assert json.loads(optimizer_fields("adam", learning_rate_schedule=schedule)["learning_rate_schedule"]) == schedule
    assert optimizer_fields("adam")["learning_rate_schedule"] == ""
    pb.OptimizerConfig(**optimizer_fields("nadam"))  # every value of a type the wire takes


def test_every_optimizer_has_a_keras_class_and_every_argument_a_wire_field():
    wire = {f.name for f in pb.OptimizerConfig.DESCRIPTOR.fields}
    assert sorted(KERAS_OPTIMIZER_CLASSES.values()) == sorted(OPTIMIZERS)
    for name, defaults in OPTIMIZER_DEFAULTS.items():
        assert set(defaults) <= wire, name


def test_the_shared_schedule_names_are_the_ones_the_server_evaluates():
    from ps_server.core.optim import schedules

    assert LEARNING_RATE_SCHEDULES == schedules.SCHEDULES and SCHEDULES_MODULE == schedules.KERAS_MODULE


@pytest.mark.parametrize("class_name,config,message", [
    ("Shampoo", {}, "optimizer Shampoo cannot run on the server; it runs SGD, Adam"),
    ("Muon", {"rms_rate": 0}, "Muon with rms_rate=0 cannot run on the server: the wire's 0 is None"),
    ("Adam", {"loss_scale_factor": 2.0}, "Adam with loss_scale_factor=2.0 cannot run on the server"),
    ("SGD", {"beta_1": 0.9}, "SGD has config keys the server does not know: beta_1"),
    ("SGD", {"learning_rate": "0.1"}, "SGD's learning_rate must be a number or a serialized"),
])
def test_keras_optimizer_fields_refuses_in_one_line_naming_what(class_name, config, message):
    with pytest.raises(ValueError, match=message):
        keras_optimizer_fields(class_name, config)


def test_keras_optimizer_fields_keeps_the_arguments_and_moves_a_schedule_aside():
    schedule = {"class_name": "ExponentialDecay", "config": {}, "module": "keras.optimizers.schedules",
                "registered_name": None}
    fields = keras_optimizer_fields("Adam", {"name": "adam", "learning_rate": schedule, "amsgrad": True})
    assert fields == {"name": "adam", "learning_rate": 0.001, "learning_rate_schedule": schedule, "amsgrad": True}


def test_a_keras_none_whose_default_is_not_none_travels_as_the_wire_s_none_zero():
    fields = keras_optimizer_fields("Muon", {"rms_rate": None, "adam_weight_decay": None, "weight_decay": None})
    assert fields == {"name": "muon", "rms_rate": 0, "adam_weight_decay": 0, "weight_decay": 0}
    assert keras_optimizer_fields("Adam", {"weight_decay": None}) == {"name": "adam", "weight_decay": None}
