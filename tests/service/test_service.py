"""The gRPC service over a real server on port 0: answers, and the precise status of every refusal.

    python -m pytest tests/service/test_service.py -q

Rules checked (STYLE.md 7, ps_server/service.py, ps_server/core/*):
- "One error table ... No exception leaves a servicer as UNKNOWN": every refusal
  below asserts its exact code, and an unexpected exception comes back INTERNAL;
- "A rejected call never changes stored state" (core/errors.py): after every
  refusal the pulled bytes and the version are unchanged;
- sync: "a sync round with gradients g1..gn gives w - lr*mean(g)" (batch-weighted),
  applied once, every push of the round answered with the same version;
- async: "Every push is applied on arrival", staleness = server version - base_version.
"""

import dataclasses
import logging

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec
from protos import tfps_pb2 as pb
from ps_common.names import optimizer_fields
from ps_common.reasons import Reason
from ps_server.core import errors
from ps_server.service import status_code_for
from worker.client import PSClientError

Code = grpc.StatusCode

# Values chosen so every SGD step below is exact in float32 and checkable by hand.
W0 = {
    "w": np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32),
    "b": np.array([0.5, -0.5, 0.25], np.float32),
}
SGD = {"name": "sgd", "learning_rate": 0.5}
ONES = {name: np.ones_like(v) for name, v in W0.items()}


def refused(code: grpc.StatusCode, fn, *args, reason: Reason | None = None, **kwargs) -> str:
    """Call fn, expect it to fail with exactly ``code`` (and ``reason``, the trailing metadata
    ps_common.reasons names); return the server's details."""
    try:
        fn(*args, **kwargs)
    except PSClientError as e:
        got, details, why = e.code, e.details, e.reason
    except grpc.RpcError as e:
        got, details, why = e.code(), e.details(), None
    else:
        pytest.fail(f"expected {code.name}, but the call succeeded")
    assert got == code, f"expected {code.name}, got {got.name}: {details}"
    assert got != Code.UNKNOWN
    assert reason is None or why is reason, f"expected reason {reason}, got {why}: {details}"
    return details


def with_(grads, **changes):
    return {**grads, **changes}


# -- Register ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_register_returns_mode_num_workers_worker_id_and_barrier_timeout(ps, mode):
    _, client = ps(mode=mode, num_workers=3, barrier_timeout=7.5)
    reg = client.register(worker_index=2, num_workers=3, name="host-c:3")
    assert reg.mode == mode
    assert reg.num_workers == 3
    assert reg.worker_id == 2
    assert reg.barrier_timeout == 7.5
    assert reg.initialized is False
    assert reg.version == 0


def test_register_without_a_claimed_cluster_size_is_accepted(ps):
    _, client = ps(num_workers=2)
    assert client.register(worker_index=1, num_workers=0).num_workers == 2


def test_register_reports_initialized_state_and_version_to_a_late_worker(ps):
    _, client = ps(mode="async", num_workers=2)
    client.register(0, 2)
    client.initialize(0, W0, SGD)
    client.push(0, 0, 0, 4, ONES)
    reg = client.register(1, 2)
    assert reg.initialized is True
    assert reg.version == 1


def test_register_with_mismatched_num_workers_is_failed_precondition(ps):
    _, client = ps(num_workers=2)
    details = refused(Code.FAILED_PRECONDITION, client.register, worker_index=0, num_workers=3,
                      reason=Reason.CONFIG_MISMATCH)
    assert "--num-workers 3" in details and "server runs with 2" in details


@pytest.mark.parametrize("index", [-2, 2, 100])
def test_register_with_out_of_range_index_is_invalid_argument(ps, index):
    _, client = ps(num_workers=2)
    details = refused(Code.INVALID_ARGUMENT, client.register, worker_index=index, num_workers=2, reason=Reason.INVALID)
    assert f"worker index {index} is outside 0..1" in details


def test_register_with_index_minus_one_gets_the_lowest_free_index_until_none_is_left(ps):
    _, client = ps(num_workers=2)
    assert client.register(worker_index=1, num_workers=2).worker_id == 1
    assert client.register(worker_index=-1, num_workers=2).worker_id == 0
    details = refused(Code.RESOURCE_EXHAUSTED, client.register, worker_index=-1, num_workers=2,
                      reason=Reason.NO_FREE_INDEX)
    assert "all 2 worker indexes are taken (alive: [0, 1], finished: [])" in details


def test_register_without_a_worker_index_is_refused_never_taken_as_the_chief(ps, raw_stub):
    running, client = ps(num_workers=2)
    details = refused(Code.INVALID_ARGUMENT, raw_stub(running).Register, pb.RegisterRequest(num_workers=2), timeout=10)
    assert "Register needs worker_index" in details
    # A worker_index of the wrong wire type (length-delimited): proto3 keeps it as an unknown field.
    raw = pb.RegisterRequest(num_workers=2).SerializeToString() + b"\x0a\x01x"
    with grpc.insecure_channel(running.address) as channel:
        register = channel.unary_unary("/tfps.v1.ParameterServer/Register",
                                       response_deserializer=pb.RegisterResponse.FromString)
        refused(Code.INVALID_ARGUMENT, register, raw, timeout=10)
    assert client.status().workers == []


def test_a_worker_process_whose_index_another_process_took_is_refused_as_superseded(ps, connect):
    running, old = ps(num_workers=2)
    old.register(1, 2)
    connect(running).register(1, 2)  # a new process on the same index
    details = refused(Code.FAILED_PRECONDITION, old.register, 1, 2, reason=Reason.SUPERSEDED)
    assert "worker index 1 is held by another process" in details
    assert [w.incarnation for w in old.status().workers] == [2]


# -- Initialize ----------------------------------------------------------------------------------


def test_repeated_identical_initialize_is_harmless_and_keeps_trained_values(ps, snapshot):
    _, client = ps(mode="sync", num_workers=1)
    client.register(0, 1)
    assert client.initialize(0, W0, SGD) is True
    assert client.push(0, step=0, base_version=0, batch_size=2, gradients=ONES).version == 1
    trained = snapshot(client)
    assert client.initialize(0, W0, SGD) is False  # a restarted chief repeats it
    assert snapshot(client) == trained
    version, values = client.pull()
    assert version == 1
    np.testing.assert_array_equal(values["w"], W0["w"] - 0.5)


def test_initialize_logs_the_optimizer_as_one_line_of_its_own_fields_that_were_changed(ps, caplog):
    """The server's INFO line names the optimizer, its learning rate and only the fields of
    that optimizer off their Keras defaults, never another optimizer's fields (issue 27)."""
    _, client = ps(mode="sync", num_workers=1)
    client.register(0, 1)
    # Every field, as a worker sends it (worker.config): rmsprop's rho too, which adam ignores.
    adam = optimizer_fields("adam", learning_rate=0.01, beta_1=0.9, beta_2=0.98, rho=0.5)
    with caplog.at_level(logging.INFO, logger="ps_server.service"):
        assert client.initialize(0, W0, adam) is True
    lines = [r.getMessage() for r in caplog.records if r.name == "ps_server.service" and "initialized" in r.getMessage()]
    assert lines == ["initialized 2 variables (9 parameters) by worker 0, optimizer: adam learning_rate=0.01 "
                     "beta_2=0.98"]


@pytest.mark.parametrize(
    "variables, optimizer, names_in_details",
    [
        (with_(W0, w=np.zeros((3, 2), np.float32)), SGD, ["'w'", "[2, 3]", "[3, 2]"]),
        (with_(W0, b=W0["b"].astype(np.float64)), SGD, ["'b'", "float32", "float64"]),
        (with_(W0, extra=np.zeros(1, np.float32)), SGD, ["'extra' is new"]),
        ({"w": W0["w"]}, SGD, ["'b' is stored but not in the new spec"]),
        (W0, {"name": "sgd", "learning_rate": 0.1}, ["optimizer", "0.5", "0.1"]),
        (W0, {"name": "adam", "learning_rate": 0.5}, ["optimizer", "adam"]),
    ],
    ids=["shape", "dtype", "extra_variable", "missing_variable", "learning_rate", "optimizer_name"],
)
def test_conflicting_initialize_is_already_exists_and_changes_nothing(ps, snapshot, variables, optimizer,
                                                                      names_in_details):
    _, client = ps(mode="async", num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    client.push(0, 0, 0, 1, ONES)  # trained: a conflict must not reset it either
    before, status_before = snapshot(client), client.status()
    details = refused(Code.ALREADY_EXISTS, client.initialize, 0, variables, optimizer, reason=Reason.SPEC_CONFLICT)
    assert "conflicts with the stored state" in details
    for part in names_in_details:
        assert part in details
    assert snapshot(client) == before
    status = client.status()
    assert status.optimizer == status_before.optimizer
    assert (status.num_variables, status.num_parameters) == (2, 9)


def test_initialize_from_unregistered_worker_is_failed_precondition(ps):
    _, client = ps(num_workers=2)
    details = refused(Code.FAILED_PRECONDITION, client.initialize, 1, W0, SGD, reason=Reason.NOT_REGISTERED)
    assert "worker 1 is not registered" in details
    assert client.status().initialized is False


@pytest.mark.parametrize(
    "variables, optimizer, fragment",
    [
        ({"steps": np.zeros(2, np.int64)}, SGD, "only floating variables train"),
        ({}, SGD, "at least one variable"),
        (W0, {"name": "shampoo", "learning_rate": 0.1}, "optimizer name"),
        (W0, {"name": "sgd", "learning_rate": -1.0}, "learning_rate must be > 0"),
        (W0, {"name": "sgd", "learning_rate": 0.1, "momentum": 1.5}, "momentum must be in [0, 1)"),
    ],
    ids=["integer_variable", "no_variables", "unknown_optimizer", "negative_lr", "momentum_out_of_range"],
)
def test_invalid_initialize_is_invalid_argument_and_stores_nothing(ps, variables, optimizer, fragment):
    _, client = ps(num_workers=1)
    client.register(0, 1)
    details = refused(Code.INVALID_ARGUMENT, client.initialize, 0, variables, optimizer)
    assert fragment in details
    assert client.status().initialized is False


def test_pull_before_initialize_is_failed_precondition(ps):
    _, client = ps(num_workers=1)
    client.register(0, 1)
    details = refused(Code.FAILED_PRECONDITION, client.pull, 0, reason=Reason.NOT_INITIALIZED)
    assert "not initialized" in details


def test_a_worker_waiting_for_the_chief_is_logged_at_debug_and_a_refusal_at_info(ps, caplog):
    """A start of N workers pulls until the chief initialized: a wait they expect, not N
    refusals in the server's log (issue 27, "a quiet start")."""
    _, client = ps(num_workers=2)
    client.register(0, 2)
    with caplog.at_level(logging.DEBUG, logger="ps_server.service"):
        refused(Code.FAILED_PRECONDITION, client.pull, 0, reason=Reason.NOT_INITIALIZED)
        refused(Code.FAILED_PRECONDITION, client.pull, 1, reason=Reason.NOT_REGISTERED)
    levels = {reason: [r.levelname for r in caplog.records if f"({reason})" in r.getMessage()]
              for reason in ("not-initialized", "not-registered")}
    assert levels == {"not-initialized": ["DEBUG"], "not-registered": ["INFO"]}


def test_push_before_initialize_is_failed_precondition(ps):
    _, client = ps(mode="async", num_workers=1)
    client.register(0, 1)
    details = refused(Code.FAILED_PRECONDITION, client.push, 0, 0, 0, 1, ONES, reason=Reason.NOT_INITIALIZED)
    assert "not initialized" in details


# -- Pull ----------------------------------------------------------------------------------


def test_pull_returns_the_initial_values_bit_for_bit(ps):
    _, client = ps(num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    version, values = client.pull(0)
    assert version == 0
    assert sorted(values) == ["b", "w"]
    for name in W0:
        assert values[name].dtype == W0[name].dtype
        assert values[name].tobytes() == W0[name].tobytes()


def test_pull_by_name_returns_only_those_variables(ps):
    _, client = ps(num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    _, values = client.pull(0, names=["b"])
    assert list(values) == ["b"]


def test_pull_of_an_unknown_variable_is_not_found(ps):
    _, client = ps(num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    assert "'nope'" in refused(Code.NOT_FOUND, client.pull, 0, names=["b", "nope"], reason=Reason.NOT_FOUND)


def test_a_refusal_too_long_for_a_header_comes_back_as_itself_cut_short(ps):
    """A message over gRPC's 16 KiB of headers would reach the client as RESOURCE_EXHAUSTED
    (a barrier timeout naming 1024 workers did): the reply carries its first 2000 characters."""
    _, client = ps(num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    details = refused(Code.NOT_FOUND, client.pull, 0, names=["x" * 20_000], reason=Reason.NOT_FOUND)
    assert details.startswith("unknown variable(s): 'xxx") and len(details) < 2100
    assert details.endswith("more characters in the server's log)")


def test_pull_from_an_unregistered_worker_is_failed_precondition(ps):
    _, client = ps(num_workers=2)
    client.register(0, 2)
    client.initialize(0, W0, SGD)
    assert "worker 1 is not registered" in refused(Code.FAILED_PRECONDITION, client.pull, 1, reason=Reason.NOT_REGISTERED)


# -- Sync rounds ----------------------------------------------------------------------------------


def test_sync_round_applies_batch_weighted_mean_once_and_answers_both_workers_with_one_version(ps, connect, bg):
    running, chief = ps(mode="sync", num_workers=2)
    chief.register(0, 2)
    chief.initialize(0, W0, SGD)
    # Worker 0 saw 1 example, worker 1 saw 3: the round's gradient is 1/4 g0 + 3/4 g1.
    grads = {
        0: {"w": np.array([[4, 0, 8], [-4, 4, 0]], np.float32), "b": np.array([4, 4, 4], np.float32)},
        1: {"w": np.array([[0, 4, -8], [4, 0, 4]], np.float32), "b": np.array([0, 0, -4], np.float32)},
    }
    batch = {0: 1, 1: 3}
    mean = {"w": np.array([[1, 3, -4], [2, 1, 3]], np.float32), "b": np.array([1, 1, -2], np.float32)}
    expected = {name: W0[name] - 0.5 * mean[name] for name in W0}
    assert expected["w"].tolist() == [[0.5, 0.5, 5.0], [3.0, 4.5, 4.5]]  # by hand

    def worker(i):
        client = connect(running)
        reg = client.register(i, 2, name=f"worker-{i}")
        version, _ = client.wait_initialized(reg.worker_id, timeout=10)
        reply = client.push(reg.worker_id, step=0, base_version=version, batch_size=batch[i],
                            gradients=grads[i], loss=float(i))
        return reply, client.pull(reg.worker_id)

    calls = [bg(worker, i) for i in (0, 1)]
    results = [c.result(timeout=20) for c in calls]
    for reply, (version, values) in results:
        assert (reply.version, reply.staleness, reply.contributors) == (1, 0, 2)
        assert version == 1
        for name in W0:
            assert values[name].tobytes() == expected[name].tobytes()
    status = chief.status()
    assert (status.version, status.round, status.pushes_applied, status.examples_applied) == (1, 1, 2, 4)
    assert status.last_loss == pytest.approx(0.75)  # 1/4 * 0.0 + 3/4 * 1.0


def test_retried_push_for_completed_round_is_replayed_and_changes_nothing(ps, snapshot):
    _, client = ps(mode="sync", num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    first = client.push(0, step=0, base_version=0, batch_size=1, gradients=ONES)
    before = snapshot(client)
    again = client.push(0, 0, 0, 1, ONES)  # the reply was lost: the same (worker, step) again
    assert again.version == first.version == 1
    assert snapshot(client) == before
    status = client.status()
    assert (status.pushes_applied, status.pushes_replayed) == (1, 1)


def test_late_push_for_a_forgotten_round_is_failed_precondition_and_changes_nothing(ps, snapshot):
    _, client = ps(mode="sync", num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    for step in range(17):  # replies are remembered for the last 16 rounds only
        client.push(0, step=step, base_version=step, batch_size=1, gradients=ONES)
    before = snapshot(client)
    details = refused(Code.FAILED_PRECONDITION, client.push, 0, 0, 0, 1, ONES, reason=Reason.LATE)
    assert "step 0 is late" in details and "round 0 already completed" in details
    assert snapshot(client) == before
    assert client.status().pushes_applied == 17


def test_push_for_a_future_round_is_out_of_range_and_changes_nothing(ps, snapshot):
    _, client = ps(mode="sync", num_workers=2)
    client.register(0, 2)
    client.initialize(0, W0, SGD)
    before = snapshot(client)
    assert "step 3 is early" in refused(Code.OUT_OF_RANGE, client.push, 0, 3, 0, 1, ONES, reason=Reason.EARLY)
    assert snapshot(client) == before
    assert list(client.status().waiting_for) == []


def test_retried_push_in_a_round_waits_for_the_same_answer_and_counts_once(ps, connect, bg, snapshot, wait_until):
    running, client = ps(mode="sync", num_workers=2)
    client.register(0, 2)
    client.register(1, 2)
    client.initialize(0, W0, SGD)
    first = bg(connect(running).push, 0, 0, 0, 1, ONES)
    wait_until(lambda: list(client.status().waiting_for) == [1], what="worker 0 waiting in the barrier")
    twice = {name: 100 * g for name, g in ONES.items()}
    retry = bg(connect(running).push, 0, 0, 0, 1, twice)  # a retry: same (worker, step)
    assert not first.done() and not retry.done()
    reply = client.push(1, 0, 0, 1, ONES)
    # The retry either joined the wait (same answer) or, if it reached the server only after
    # the round completed, was answered from the record (same answer, marked replayed).
    late = retry.result(timeout=10)
    assert first.result(timeout=10) == reply == dataclasses.replace(late, replayed=False)
    _, values = client.pull()
    # mean of worker 0's first gradient (ones) and worker 1's (ones): the retry never counted.
    np.testing.assert_array_equal(values["w"], W0["w"] - 0.5)


def test_sync_barrier_timeout_is_deadline_exceeded_naming_the_missing_worker(ps, connect, snapshot):
    running, client = ps(mode="sync", num_workers=2, barrier_timeout=0.5)
    client.register(0, 2, name="host-a:10")
    client.register(1, 2, name="host-b:77")
    client.initialize(0, W0, SGD)
    before = snapshot(client)
    details = refused(Code.DEADLINE_EXCEEDED, client.push, 0, 0, 0, 1, ONES, timeout=10,
                      reason=Reason.BARRIER_TIMEOUT)
    assert "worker(s) 1 (host-b:77)" in details
    assert "pushed: 0 (host-a:10)" in details
    assert "parameters unchanged at version 0" in details
    # The server still answers, the round is discarded and state is unchanged.
    assert client.health() == "SERVING"
    status = client.status()
    assert (status.rounds_timed_out, status.round, list(status.waiting_for)) == (1, 0, [])
    assert snapshot(client) == before


def test_timed_out_round_can_be_pushed_again(ps, connect, bg):
    running, client = ps(mode="sync", num_workers=2, barrier_timeout=0.5)
    client.register(0, 2)
    client.register(1, 2)
    client.initialize(0, W0, SGD)
    refused(Code.DEADLINE_EXCEEDED, client.push, 0, 0, 0, 1, ONES, timeout=10)
    calls = [bg(connect(running).push, i, 0, 0, 1, ONES) for i in (0, 1)]
    assert [c.result(timeout=10).version for c in calls] == [1, 1]


# -- Async ----------------------------------------------------------------------------------


def test_async_push_applies_immediately_and_reports_staleness(ps, connect):
    running, c0 = ps(mode="async", num_workers=2)
    c1 = connect(running)
    c0.register(0, 2)
    c1.register(1, 2)
    c0.initialize(0, W0, SGD)
    base0, _ = c0.pull(0)
    base1, _ = c1.pull(1)
    assert base0 == base1 == 0

    r0 = c0.push(0, step=0, base_version=base0, batch_size=2, gradients=ONES, loss=1.0)
    assert (r0.version, r0.staleness, r0.contributors) == (1, 0, 1)
    version, values = c1.pull(1)  # applied on arrival: visible to the other worker at once
    assert version == 1
    np.testing.assert_array_equal(values["w"], W0["w"] - 0.5)

    # Worker 1's gradient was computed on version 0; the server is at 1 when it applies.
    twos = {name: 2 * g for name, g in ONES.items()}
    r1 = c1.push(1, step=0, base_version=base1, batch_size=6, gradients=twos, loss=3.0)
    assert (r1.version, r1.staleness) == (2, 1)
    version, values = c0.pull(0)
    assert version == 2
    np.testing.assert_array_equal(values["w"], W0["w"] - 0.5 - 1.0)
    np.testing.assert_array_equal(values["b"], W0["b"] - 1.5)

    status = c0.status()
    assert status.mode == pb.ASYNC
    assert (status.pushes_applied, status.examples_applied) == (2, 8)
    assert (status.mean_staleness, status.max_staleness_seen) == (0.5, 1)
    assert status.last_loss == 3.0
    assert list(status.waiting_for) == []


# -- Every bad push: a precise code, and nothing changes -------------------------------------------


def _tensor(name, dtype, shape, data):
    return pb.Tensor(name=name, dtype=dtype, shape=shape, data=data)


GOOD_W = codec.encode("w", ONES["w"])
GOOD_B = codec.encode("b", ONES["b"])

# (id, gradients for PSClient, or raw Tensor list for the stub, expected code, fragment of details)
BAD_GRADIENTS = [
    ("unknown_variable", with_(ONES, nope=np.ones(1, np.float32)), Code.NOT_FOUND, "'nope'"),
    ("wrong_shape", with_(ONES, w=np.ones((3, 2), np.float32)), Code.INVALID_ARGUMENT,
     "'w' has shape [3, 2], variable has [2, 3]"),
    ("wrong_dtype", with_(ONES, b=np.ones(3, np.float64)), Code.INVALID_ARGUMENT, "'b' has dtype float64"),
    ("missing_gradient", {"w": ONES["w"]}, Code.INVALID_ARGUMENT, "missing gradient(s) for: 'b'"),
    ("nan", with_(ONES, w=np.array([[1, np.nan, 1], [1, 1, 1]], np.float32)), Code.INVALID_ARGUMENT,
     "'w' contains NaN or Inf"),
    ("inf", with_(ONES, b=np.array([1, 1, -np.inf], np.float32)), Code.INVALID_ARGUMENT, "'b' contains NaN or Inf"),
    ("wrong_byte_length", [_tensor("w", pb.FLOAT32, [2, 3], GOOD_W.data[:-4]), GOOD_B], Code.INVALID_ARGUMENT,
     "tensor 'w': 20 bytes do not match shape [2, 3]"),
    ("unknown_wire_dtype", [_tensor("w", 42, [2, 3], GOOD_W.data), GOOD_B], Code.INVALID_ARGUMENT,
     "tensor 'w': unknown wire dtype 42"),
    ("unspecified_wire_dtype", [_tensor("w", pb.DTYPE_UNSPECIFIED, [2, 3], GOOD_W.data), GOOD_B],
     Code.INVALID_ARGUMENT, "tensor 'w': unknown wire dtype 0"),
    ("negative_dimension", [_tensor("w", pb.FLOAT32, [-2, -3], GOOD_W.data), GOOD_B], Code.INVALID_ARGUMENT,
     "tensor 'w': negative dimension"),
    ("overflowing_shape", [_tensor("w", pb.FLOAT32, [2**32, 2**32], b""), GOOD_B], Code.INVALID_ARGUMENT,
     "tensor 'w'"),
    ("duplicate_name", [GOOD_W, GOOD_B, GOOD_W], Code.INVALID_ARGUMENT, "tensor 'w' appears twice"),
]


@pytest.fixture(params=["sync", "async"])
def one_worker_registered(request, ps):
    """A server of 2 workers, initialized, where only worker 0 has registered."""
    running, client = ps(mode=request.param, num_workers=2)
    client.register(0, 2)
    client.initialize(0, W0, SGD)
    return running, client


def _assert_nothing_changed(client, before):
    version, values = client.pull()
    assert (version, {n: a.tobytes() for n, a in values.items()}) == before
    status = client.status()
    assert (status.version, status.pushes_applied, status.examples_applied) == (0, 0, 0)
    assert list(status.waiting_for) == []  # nothing entered a sync round
    assert [w.last_step for w in status.workers] == [-1]


@pytest.mark.parametrize("case", BAD_GRADIENTS, ids=[c[0] for c in BAD_GRADIENTS])
def test_bad_gradient_is_refused_with_a_precise_code_and_changes_nothing(one_worker_registered, raw_stub, snapshot,
                                                                         case):
    running, client = one_worker_registered
    _, gradients, code, fragment = case
    before = snapshot(client)
    if isinstance(gradients, dict):
        details = refused(code, client.push, 0, 0, 0, 1, gradients, timeout=10)
    else:
        request = pb.PushRequest(worker_id=0, step=0, base_version=0, batch_size=1, gradients=gradients)
        details = refused(code, raw_stub(running).Push, request, timeout=10)
    assert fragment in details
    _assert_nothing_changed(client, before)


@pytest.mark.parametrize(
    "worker_id, step, base_version, batch_size, code, fragment",
    [
        (1, 0, 0, 1, Code.FAILED_PRECONDITION, "worker 1 is not registered; call Register first"),
        (7, 0, 0, 1, Code.FAILED_PRECONDITION, "worker 7 is not registered"),
        (0, -1, 0, 1, Code.INVALID_ARGUMENT, "step must be >= 0"),
        (0, 0, -1, 1, Code.INVALID_ARGUMENT, "base_version must be >= 0"),
        (0, 0, 0, -5, Code.INVALID_ARGUMENT, "batch_size must be >= 0"),
        (0, 0, 3, 1, Code.INVALID_ARGUMENT, "version 0"),
    ],
    ids=["unregistered_worker", "unknown_worker_id", "negative_step", "negative_base_version",
         "negative_batch_size", "base_version_ahead_of_server"],
)
def test_bad_push_fields_are_refused_with_a_precise_code_and_change_nothing(
        one_worker_registered, snapshot, worker_id, step, base_version, batch_size, code, fragment):
    _, client = one_worker_registered
    before = snapshot(client)
    details = refused(code, client.push, worker_id, step, base_version, batch_size, ONES, timeout=10)
    assert fragment in details
    _assert_nothing_changed(client, before)


def test_async_push_without_examples_is_invalid_argument(ps, snapshot):
    _, client = ps(mode="async", num_workers=1)
    client.register(0, 1)
    client.initialize(0, W0, SGD)
    before = snapshot(client)
    assert "batch_size 0" in refused(Code.INVALID_ARGUMENT, client.push, 0, 0, 0, 0, ONES, reason=Reason.INVALID)
    assert snapshot(client) == before


# -- Status, Leave, Health ----------------------------------------------------------------------------


def test_status_names_the_worker_that_has_not_pushed_while_another_waits(ps, connect, bg, wait_until):
    running, client = ps(mode="sync", num_workers=2)
    client.register(0, 2, name="host-a:10")
    client.register(1, 2, name="host-b:77")
    client.initialize(0, W0, SGD)

    status = client.status()
    assert (status.round, list(status.waiting_for)) == (0, [])  # nobody pushed: not waiting on anyone
    assert [(w.worker_id, w.worker_name, w.last_step, w.pushes) for w in status.workers] == [
        (0, "host-a:10", -1, 0), (1, "host-b:77", -1, 0)]

    waiting = bg(connect(running).push, 0, 0, 0, 5, ONES, 2.0)
    status = wait_until(lambda: (s := client.status()).waiting_for and s, what="a waiter in the barrier")
    assert list(status.waiting_for) == [1]
    assert (status.round, status.version, status.pushes_applied) == (0, 0, 0)

    client.push(1, 0, 0, 3, ONES, 4.0)
    waiting.result(timeout=10)
    status = client.status()
    assert status.mode == pb.SYNC
    assert (status.num_workers, status.initialized, status.version, status.round) == (2, True, 1, 1)
    assert list(status.waiting_for) == []
    assert [(w.worker_id, w.last_step, w.pushes, w.left) for w in status.workers] == [
        (0, 0, 1, False), (1, 0, 1, False)]
    assert all(0 <= w.last_seen_age_s < 30 for w in status.workers)
    assert (status.pushes_applied, status.examples_applied) == (2, 8)
    assert (status.mean_staleness, status.max_staleness_seen, status.rounds_timed_out) == (0.0, 0, 0)
    assert status.last_loss == pytest.approx(5 / 8 * 2.0 + 3 / 8 * 4.0)
    assert (status.num_variables, status.num_parameters) == (2, 9)
    assert (status.optimizer.name, status.optimizer.learning_rate) == ("sgd", 0.5)
    assert status.uptime_s > 0


def test_status_before_any_worker_is_answered(ps):
    _, client = ps(mode="async", num_workers=3)
    status = client.status()
    assert (status.mode, status.num_workers, status.initialized, status.version) == (pb.ASYNC, 3, False, 0)
    assert list(status.workers) == []
    assert status.optimizer.name == ""


def test_leave_marks_the_worker_left(ps):
    _, client = ps(num_workers=2)
    client.register(1, 2)
    client.leave(1)
    assert [(w.worker_id, w.left) for w in client.status().workers] == [(1, True)]


def test_leave_from_unregistered_worker_is_failed_precondition(ps):
    _, client = ps(num_workers=2)
    assert "worker 1 is not registered" in refused(Code.FAILED_PRECONDITION, client.leave, 1, reason=Reason.NOT_REGISTERED)


@pytest.mark.parametrize("service", ["", "tfps.v1.ParameterServer"])
def test_health_reports_serving_for_the_server_and_the_tfps_service_after_start(ps, service):
    running, _ = ps()
    with grpc.insecure_channel(running.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_health_of_an_unknown_service_is_not_found(ps):
    running, _ = ps()
    with grpc.insecure_channel(running.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        refused(Code.NOT_FOUND, stub.Check, health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)


# -- The error table ----------------------------------------------------------------------------------


def test_every_core_error_class_has_a_status_code_other_than_internal():
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.PSError) and c is not errors.PSError]
    assert len(classes) >= 11
    for cls in classes:
        exc = cls("x")
        assert status_code_for(exc) not in (Code.INTERNAL, Code.UNKNOWN, Code.OK), cls.__name__


def test_unexpected_exception_in_a_handler_is_internal_not_unknown(ps, monkeypatch):
    running, client = ps()

    def broken():
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(running.core, "status", broken)
    details = refused(Code.INTERNAL, client.status, reason=Reason.UNSPECIFIED)
    assert "internal error in Status: ZeroDivisionError: boom" in details
    monkeypatch.undo()
    assert client.status().num_workers == 1  # the server keeps serving
