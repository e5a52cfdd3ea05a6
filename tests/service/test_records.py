"""Each record is defined once and crosses the wire field by field (protos.convert).

    python -m pytest -q tests/service/test_records.py

The issue: "Status, registration, ... are each defined in one place and converted by
code driven from that definition". A field added to a core record, a shared record
or the proto without a way across fails here.
"""

import dataclasses

import numpy as np
import pytest

from protos import codec, convert
from protos import tfps_pb2 as pb
from ps_common.records import PushReply, Registration
from ps_server import service
from ps_server.core.membership import WorkerRecord
from ps_server.core.modes.base import PushResult
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer, Status


@pytest.mark.parametrize("conversion", service.CONVERSIONS, ids=lambda c: c.record.__name__)
def test_every_field_of_each_record_and_its_message_has_a_way_across(conversion):
    assert conversion.problems() == []


def test_a_field_added_to_a_record_without_a_wire_field_is_reported():
    @dataclasses.dataclass(frozen=True)
    class Grown(PushReply):
        novel: int = 0

    problems = convert.Conversion(Grown, pb.PushResponse, wire_only=convert.PUSH_REPLY.wire_only).problems()
    assert problems == ["Grown.novel has no field 'novel' in PushResponse: rename it, or list it as local"]
    with pytest.raises(ValueError, match="novel"):
        convert.Conversion(Grown, pb.PushResponse).to_wire(Grown(version=1, staleness=0))


def test_a_message_field_no_record_fills_is_reported():
    problems = convert.Conversion(PushReply, pb.PushResponse, wire_only=convert.PUSH_REPLY.wire_only - {"incarnation"}).problems()
    assert problems == ["PushResponse.incarnation is filled by no field of PushReply: add one, or list it as "
                        "wire-only"]


def test_the_core_and_the_client_share_one_registration_and_one_push_reply():
    assert PushResult is PushReply
    reg = ParameterServer("sync", 2).register(0, 2, "w0")
    assert type(reg) is Registration


def test_a_registration_comes_back_from_the_wire_as_it_left_with_the_client_s_shm():
    reg = Registration(worker_id=1, mode="ssp", num_workers=3, initialized=True, version=7, barrier_timeout=12.5,
                       round=4, lease_timeout=3.0, incarnation="abc")
    msg = convert.REGISTRATION.to_wire(reg)
    assert (msg.mode, msg.barrier_timeout_s, msg.lease_timeout_s) == (pb.SSP, 12.5, 3.0)
    assert convert.REGISTRATION.from_wire(msg) == reg
    assert convert.REGISTRATION.from_wire(msg, shm=True) == dataclasses.replace(reg, shm=True)


def test_a_push_reply_comes_back_from_the_wire_as_it_left():
    metrics = {"acc/total": np.array([1.5, -2.0], np.float32), "acc/count": np.array(7.0)}
    reply = PushReply(version=9, staleness=2, contributors=3, dropped=True, next_step=5, replayed=True,
                      learning_rate=0.0125, metrics=metrics)
    msg = convert.PUSH_REPLY.to_wire(reply)
    assert msg.learning_rate == 0.0125 and [t.name for t in msg.metrics] == ["acc/count", "acc/total"]
    back = convert.PUSH_REPLY.from_wire(msg)
    assert back == reply  # every field but metrics, which == leaves out (arrays)
    assert {n: (a.dtype, a.shape, a.tobytes()) for n, a in back.metrics.items()} \
        == {n: (a.dtype, a.shape, a.tobytes()) for n, a in metrics.items()}


def test_the_sync_shortcut_s_values_and_elastic_work_are_the_only_wire_only_push_reply_fields():
    # The service sets them itself: the values (return_values) and, while an elastic round
    # goes on, the work to do next (ps_server.core.modes.elastic_mode.ElasticReply).
    assert convert.PUSH_REPLY.wire_only == {"variables", "incarnation", "assignment"}


def test_a_malformed_metric_in_a_push_reply_is_a_codec_error():
    msg = pb.PushResponse(metrics=[pb.Tensor(name="m", dtype=pb.FLOAT32, shape=[2], data=b"\x00" * 4)])
    with pytest.raises(codec.CodecError, match="'m'"):
        convert.PUSH_REPLY.from_wire(msg)


def test_the_status_on_the_wire_carries_every_core_field_with_ages_taken_at_the_call():
    core = ParameterServer("ssp", 2, staleness=2, stale_gradient_policy="drop", max_staleness=4)
    core.register(0, 2, "w0")
    s = core.status()
    record = s.workers[0]
    msg = service.status_to_wire(s, now=record.last_seen + 1.5)
    assert msg.workers[0].last_seen_age_s == pytest.approx(1.5)
    assert msg.workers[0].worker_name == "w0"
    assert msg.mode == pb.SSP and msg.lease_timeout_s == s.lease_timeout
    renamed = {"lease_timeout": "lease_timeout_s"}
    for f in dataclasses.fields(Status):
        if f.name in ("mode", "workers", "optimizer", "membership"):
            continue
        value, want = getattr(msg, renamed.get(f.name, f.name)), getattr(s, f.name)
        if isinstance(want, tuple):
            assert list(value) == list(want), f.name
        else:
            assert value == pytest.approx(want, nan_ok=True) if isinstance(want, float) else value == want, f.name
    assert (msg.staleness, msg.stale_gradient_policy, msg.max_staleness) == (2, "drop", 4)
    assert [service.MEMBERSHIP_EVENT.from_wire(e) for e in msg.membership] == list(s.membership)
    assert [(e.event, e.worker_id, e.worker_name) for e in msg.membership] == [("joined", 0, "w0")]


def test_an_optimizer_spec_crosses_by_its_fields():
    spec = OptimizerSpec("adam", learning_rate=0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-6)
    assert service.optimizer_from_wire(service.optimizer_to_wire(spec)) == spec
    assert service.optimizer_to_wire(None) == pb.OptimizerConfig()


def test_the_server_s_own_clock_readings_stay_local():
    assert service.WORKER_STATUS.local == {"registered_at", "dead_since", "last_push_done", "process", "replaced"}
    assert {f.name for f in dataclasses.fields(WorkerRecord)} - service.WORKER_STATUS.local \
        == {"worker_id", "name", "last_step", "pushes", "dropped", "left", "dead", "last_seen", "work_s", "wait_s",
            "incarnation"}


def test_a_registration_states_the_same_facts_as_the_status_it_is_read_from():
    core = ParameterServer("ssp", 2, barrier_timeout=7.0, lease_timeout=4.0, staleness=1)
    reg = core.register(1, 2, "w1")
    s = core.status()
    assert (reg.worker_id, reg.barrier_timeout, reg.shm) == (1, 7.0, False)
    assert (reg.mode, reg.num_workers, reg.initialized, reg.version, reg.round, reg.lease_timeout,
            reg.incarnation) == ("ssp", 2, False, 0, s.round, 4.0, s.incarnation)
