"""The shared names are the one definition the wire conversion is driven from."""

import pytest

from protos import tfps_pb2 as pb
from protos import wire
from ps_common.names import MODES, OPTIMIZER_DEFAULTS, optimizer_fields


def test_every_mode_name_is_a_value_of_the_proto_enum_and_back():
    on_wire = {v.name.lower() for v in pb.Mode.DESCRIPTOR.values if v.number != 0}
    assert set(MODES) == on_wire
    for name in MODES:
        assert wire.mode_from_wire(wire.mode_to_wire(name)) == name


def test_an_unknown_mode_value_reads_as_unknown():
    assert wire.mode_from_wire(pb.MODE_UNSPECIFIED) == "unknown"
    assert wire.mode_from_wire(99) == "unknown"


@pytest.mark.xfail(strict=True, reason="TODO(keras): the new OptimizerConfig fields' Keras defaults")
def test_optimizer_fields_fill_every_wire_field_with_that_optimizers_keras_default():
    assert set(optimizer_fields("adam")) == {f.name for f in pb.OptimizerConfig.DESCRIPTOR.fields}
    assert optimizer_fields("adam")["learning_rate"] == 0.001
    assert optimizer_fields("sgd")["learning_rate"] == 0.01
    assert optimizer_fields("sgd", momentum=0.9)["momentum"] == 0.9
    assert optimizer_fields("adam")["epsilon"] == OPTIMIZER_DEFAULTS["adam"]["epsilon"]
