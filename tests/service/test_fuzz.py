"""Arbitrary messages at every RPC of the ParameterServer service.

    python -m pytest tests/service/test_fuzz.py -q

Hypothesis builds PushRequest, PullRequest, InitializeRequest, RegisterRequest,
HeartbeatRequest, LeaveRequest and BroadcastRequest with arbitrary integers (negative, int32 and
int64 extremes), strings, dtype enums (unknown values too), shapes and bytes, and
sends them through the generated stub (pushes are often near the server's own
step and version, so that some are applied, replayed or one round off); a
second test sends raw random bytes, mangled encodings of real requests, and real
requests with an unknown field appended to each of the eight unary methods through
``channel.unary_unary`` with no serializer. One real in-process server per mode
(sync with one worker, so an accepted push never waits at a barrier; async with
two), module-scoped; runs are derandomized, so CI sees the same examples.

Properties (service.py: "an unexpected exception is logged and becomes INTERNAL,
never UNKNOWN"; errors.py: "A rejected call never changes stored state"):

- every call ends within its deadline, either OK or with a code of the error
  table that this server can produce here (INVALID_ARGUMENT, NOT_FOUND,
  FAILED_PRECONDITION, ALREADY_EXISTS, OUT_OF_RANGE). Never UNKNOWN, never
  INTERNAL (a servicer bug), and never DEADLINE_EXCEEDED, ABORTED or
  UNAVAILABLE: with one sync worker and an hour-long lease nothing can wait
  or die, so those would mean a hang. The one wait allowed: a Broadcast from a
  worker other than the chief, for a key not posted, ends after its timeout_s
  (kept to a few milliseconds here) in DEADLINE_EXCEEDED "... was not posted by
  the chief".
  Raw bytes that do not parse as the method's request are INVALID_ARGUMENT
  ("not a valid tfps.v1...": the service's tolerant deserializers), and only
  when the bytes really do not parse.
- "state" is what a good client sees: the version and the dtype, shape and
  bytes of every variable (a pull), plus the status counters (round, pushes,
  examples, dropped, replayed, aborted and timed-out rounds, waiting workers,
  active workers, optimizer) and the worker table (id, name, last step, left,
  pushes, dead, dropped; not lease ages). A rejected call leaves all of it as
  it was. Pull, Heartbeat, Initialize (the server is initialized: an identical
  spec is harmless, any other is refused) and Status leave it as it was even
  when accepted.
- Register: an accepted registration may change that worker's row of the
  worker table (it replaces the record: a new name, not left, not dead;
  counters of the index are kept) and nothing else, never the variables or
  counters. A refused one changes nothing, worker table included.
- Leave: an accepted leave sets ``left`` on that worker's row and nothing else.
- Push: an accepted push answered ``replayed`` leaves version and variables as
  they were; any other accepted push advances the version by exactly one (one
  async apply, or one round of the only sync worker) and says so in its reply.
- the server is still SERVING on the standard health service after each test.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from google.protobuf.message import DecodeError

from protos import codec, stream, wire
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.client import PSClient
from worker.transports import STATUS_CODES

Code = grpc.StatusCode
EXPECTED = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.ALREADY_EXISTS, Code.OUT_OF_RANGE,
            Code.RESOURCE_EXHAUSTED}  # Register(worker_index=-1, auto) with every index taken
CALL_TIMEOUT = 10.0

VARIABLES = {"w": np.array([1.0, -2.0, 3.0], np.float32), "b": np.array([[0.5, 0.25]], np.float64)}
OPTIMIZER = {"name": "sgd", "learning_rate": 0.5}

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
RAW = settings(FUZZ, max_examples=120)

REQUESTS = {
    "Register": pb.RegisterRequest,
    "Initialize": pb.InitializeRequest,
    "Pull": pb.PullRequest,
    "Push": pb.PushRequest,
    "Leave": pb.LeaveRequest,
    "Heartbeat": pb.HeartbeatRequest,
    "Status": pb.StatusRequest,
    "Broadcast": pb.BroadcastRequest,
    "Work": pb.WorkRequest,
    "ClipNorm": pb.ClipNormRequest,
    "CommitRound": pb.CommitRoundRequest,
}
STREAMS = {"PushStream", "PullStream", "PushPull", "InitializeStream", "Session"}  # fuzzed below, message by message
assert set(REQUESTS) | STREAMS == set(pb.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name)


# -- the server under test -------------------------------------------------------------


class Target:
    """One running server, a good client, the raw stub, and the last state seen."""

    def __init__(self, mode: str):
        num_workers = 1 if mode == "sync" else 2
        config = ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=num_workers,
                              barrier_timeout=5.0, lease_timeout=3600.0)
        self.mode, self.num_workers = mode, num_workers
        self.running = build_server(config).start()
        self.client = PSClient(self.running.address, timeout=CALL_TIMEOUT)
        for worker in range(num_workers):
            self.client.register(worker, num_workers, name=f"good {worker}")
        assert self.client.initialize(0, VARIABLES, OPTIMIZER) is True
        self.channel = grpc.insecure_channel(self.running.address, options=wire.channel_options())
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.state = self.read_state()

    def read_state(self) -> dict:
        version, values = self.client.pull()
        s = self.client.status()
        return {
            "version": version,
            "values": {n: (a.dtype.str, a.shape, a.tobytes()) for n, a in values.items()},
            "counters": (s.initialized, s.version, s.round, tuple(s.waiting_for), s.pushes_applied,
                         s.examples_applied, s.pushes_dropped, s.pushes_replayed, s.rounds_aborted,
                         s.rounds_timed_out, s.max_staleness_seen, tuple(s.active_workers),
                         s.optimizer.SerializeToString(deterministic=True)),
            "workers": {w.worker_id: (w.worker_name, w.last_step, w.left, w.pushes, w.dead, w.dropped)
                        for w in s.workers},
        }

    def close(self):
        self.channel.close()
        self.client.close()
        self.running.stop(grace=0.5)


@pytest.fixture(scope="module", params=["sync", "async"])
def target(request):
    t = Target(request.param)
    yield t
    t.close()


@pytest.fixture(autouse=True)
def still_serving(target):
    yield
    for service in ("", wire.SERVICE_NAME):
        reply = target.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- the property ------------------------------------------------------------------------


def outcome(call, request):
    """(code, details, reply) of one call; the reply only when OK."""
    try:
        return Code.OK, "", call(request, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        return e.code(), e.details(), None


def allowed_change(method: str, request, reply, before: dict, after: dict) -> None:
    """Assert that an accepted call of ``method`` changed only what it may."""
    if method == "Push":
        if reply.replayed or reply.dropped:  # answered from the record: nothing applied
            assert (after["version"], after["values"]) == (before["version"], before["values"])
        else:  # one gradient (async) or one round of the only worker (sync)
            assert after["version"] == reply.version == before["version"] + 1
        return
    same = ("version", "values", "counters")
    assert {k: after[k] for k in same} == {k: before[k] for k in same}, f"accepted {method} changed the store"
    if method not in ("Register", "Leave"):
        assert after["workers"] == before["workers"], f"accepted {method} changed the worker table"
        return
    # Register: its own row is the index it asked for, or with -1 (auto) the one it was given.
    worker = (reply.worker_id if request.worker_index == -1 else request.worker_index) if method == "Register" \
        else request.worker_id
    others = lambda state: {w: row for w, row in state["workers"].items() if w != worker}  # noqa: E731
    assert others(after) == others(before), f"accepted {method} changed another worker's row"
    row = after["workers"][worker]
    if method == "Leave":
        assert row == before["workers"][worker][:2] + (True,) + before["workers"][worker][3:]
    else:
        name, _, left, _, dead, _ = row
        assert not left and not dead
        assert name == request.worker_name or not request.worker_name


def check(target: Target, method: str, request, code, details, reply) -> None:
    after = target.read_state()
    before, target.state = target.state, after
    if code == Code.OK:
        allowed_change(method, request, reply, before, after)
        return
    # A non-chief's Broadcast for a key the chief never posted ends when its (short) wait does.
    waited = method == "Broadcast" and code == Code.DEADLINE_EXCEEDED and "was not posted by the chief" in details
    assert code in EXPECTED or waited, f"{method} answered {code.name}: {details!r} to {request!r}"
    assert after == before, f"refused {method} ({code.name}: {details}) changed state"


def fuzz(target: Target, method: str, request) -> None:
    code, details, reply = outcome(getattr(target.stub, method), request)
    check(target, method, request, code, details, reply)


# -- strategies ------------------------------------------------------------------------------

INT32 = st.one_of(st.sampled_from([0, 1, 2, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
WORKER = st.one_of(st.just(0), st.just(1), INT32)  # mostly registered workers: the calls get further
INT64 = st.one_of(
    st.integers(-3, 20),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 2, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
NAMES = st.one_of(st.sampled_from(["w", "b", "", "W", "w ", "w\x00", "ü", "w/0"]), TEXT)
DTYPES = st.one_of(st.sampled_from(list(pb.DType.values())), st.integers(-(2**31), 2**31 - 1))
DIMS = st.one_of(st.integers(0, 4), st.sampled_from([-1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]))
DOUBLES = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def any_tensor(draw):
    """Anything a Tensor message can hold."""
    return pb.Tensor(name=draw(NAMES), dtype=draw(DTYPES), shape=draw(st.lists(DIMS, max_size=4)),
                     data=draw(st.binary(max_size=80)))


@st.composite
def consistent_tensor(draw):
    """A tensor the codec decodes (random bit patterns: NaN, Inf, huge, denormal), for any name."""
    code = draw(st.sampled_from([pb.FLOAT16, pb.FLOAT32, pb.FLOAT64, pb.INT32, pb.INT64]))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    size = math.prod(shape) * codec.numpy_dtype(code).itemsize
    return pb.Tensor(name=draw(NAMES), dtype=code, shape=shape, data=draw(st.binary(min_size=size, max_size=size)))


def _little(xs, dtype) -> bytes:
    with np.errstate(over="ignore"):  # a double beyond float32 becomes Inf, which is what we want
        return np.array(xs, np.float64).astype(dtype.newbyteorder("<")).tobytes()


@st.composite
def matching_tensor(draw, name=None):
    """A tensor with a stored variable's name, dtype and shape: it reaches the core's checks."""
    name = name or draw(st.sampled_from(sorted(VARIABLES)))
    value = VARIABLES[name]
    data = draw(st.one_of(
        st.binary(min_size=value.nbytes, max_size=value.nbytes),
        st.lists(DOUBLES, min_size=value.size, max_size=value.size).map(lambda xs: _little(xs, value.dtype)),
    ))
    return pb.Tensor(name=name, dtype=codec.dtype_code(value.dtype), shape=value.shape, data=data)


TENSORS = st.lists(st.one_of(any_tensor(), consistent_tensor(), matching_tensor()), max_size=4)
ALL_MATCHING = st.permutations(sorted(VARIABLES)).flatmap(
    lambda names: st.tuples(*[matching_tensor(n) for n in names]).map(list))
GRADIENTS = st.one_of(TENSORS, ALL_MATCHING)

OPTIMIZERS = st.builds(
    pb.OptimizerConfig,
    name=st.one_of(st.sampled_from(["sgd", "adam", "SGD", ""]), TEXT),
    learning_rate=st.one_of(st.just(0.5), DOUBLES),
    momentum=st.one_of(st.just(0.0), DOUBLES),
    nesterov=st.booleans(),
    beta_1=DOUBLES,
    beta_2=DOUBLES,
    epsilon=DOUBLES,
)
SAME_SPEC = pb.InitializeRequest(worker_id=0, optimizer=pb.OptimizerConfig(**OPTIMIZER),
                                 variables=codec.encode_many(VARIABLES))

STRATEGIES = {
    "Register": st.builds(pb.RegisterRequest, worker_index=WORKER,
                          num_workers=st.one_of(st.sampled_from([0, 1, 2]), INT32), worker_name=TEXT),
    "Initialize": st.one_of(
        st.just(SAME_SPEC),
        st.builds(pb.InitializeRequest, worker_id=WORKER, optimizer=OPTIMIZERS, variables=TENSORS),
        st.builds(pb.InitializeRequest, worker_id=WORKER, optimizer=st.just(SAME_SPEC.optimizer), variables=GRADIENTS),
    ),
    "Pull": st.builds(pb.PullRequest, worker_id=WORKER, names=st.lists(NAMES, max_size=4),
                      known_version=st.one_of(st.integers(-2, 3), INT64), known_incarnation=st.one_of(TEXT)),
    "Push": st.builds(pb.PushRequest, worker_id=WORKER, step=INT64, base_version=INT64, batch_size=INT64,
                      gradients=GRADIENTS, loss=DOUBLES),
    "Leave": st.builds(pb.LeaveRequest, worker_id=WORKER),
    "Heartbeat": st.builds(pb.HeartbeatRequest, worker_id=WORKER, step=INT64),
    "Status": st.just(pb.StatusRequest()),
    # Short waits only (a non-chief asking for a key not posted waits timeout_s, here at
    # most the barrier's 5 s); tests/service/test_keras_push.py has the long ones.
    "Broadcast": st.builds(pb.BroadcastRequest, worker_id=WORKER, key=st.one_of(st.sampled_from(["k", "", "k" * 257]),
                                                                                  TEXT),
                           value=st.binary(max_size=16),
                           timeout_s=st.sampled_from([0.0, 0.001, 0.01, -1.0, float("nan"), -float("inf")])),
    "Work": st.builds(pb.WorkRequest, worker_id=WORKER),  # these servers are not elastic: refused
    # These servers are no clip group's shard 0: refused, whatever the squares.
    "ClipNorm": st.builds(pb.ClipNormRequest, key=TEXT, shard=INT32, names=st.lists(NAMES, max_size=3),
                          squares=st.lists(DOUBLES, max_size=3), dtypes=st.lists(TEXT, max_size=3),
                          timeout_s=DOUBLES),
    # These servers follow no elastic shard 0: refused, whatever the round.
    "CommitRound": st.builds(pb.CommitRoundRequest, round=st.integers(-2**63, 2**63 - 1), timeout_s=DOUBLES),
}


# -- typed messages through the generated stub ------------------------------------------------


def pushes_near(target: Target):
    """Pushes of registered workers whose step and base version are the server's own or one
    off (accepted, replayed, stale, early, from the future), with gradients for every variable."""
    version = target.state["version"]
    step = target.state["counters"][2] if target.mode == "sync" else version  # async: steps only grow
    near = lambda x: st.sampled_from([x, x, x - 1, x + 1])  # noqa: E731
    rarely = lambda usual, extremes: st.one_of(*[usual] * 9, st.sampled_from(extremes))  # noqa: E731
    return st.builds(pb.PushRequest, worker_id=st.sampled_from(range(target.num_workers)),
                     step=rarely(near(step), [2**62, 2**63 - 2, 2**63 - 1]), base_version=near(version),
                     batch_size=rarely(st.integers(0, 4), [2**32, 2**32 + 1, 2**62, 2**63 - 1]),
                     gradients=ALL_MATCHING, loss=DOUBLES)


@FUZZ
@given(data=st.data())
def test_fuzzed_push_is_answered_with_a_table_code_and_a_refusal_changes_nothing(target, data):
    fuzz(target, "Push", data.draw(st.one_of(STRATEGIES["Push"], pushes_near(target)), label="request"))


@FUZZ
@given(request=STRATEGIES["Pull"])
def test_fuzzed_pull_is_answered_with_a_table_code_and_changes_nothing(target, request):
    fuzz(target, "Pull", request)


@FUZZ
@given(request=STRATEGIES["Initialize"])
def test_fuzzed_initialize_of_an_initialized_server_is_harmless_or_refused(target, request):
    fuzz(target, "Initialize", request)


@FUZZ
@given(request=STRATEGIES["Register"])
def test_fuzzed_register_changes_at_most_its_own_worker_row(target, request):
    fuzz(target, "Register", request)


@FUZZ
@given(request=STRATEGIES["Heartbeat"])
def test_fuzzed_heartbeat_is_answered_with_a_table_code_and_changes_nothing(target, request):
    fuzz(target, "Heartbeat", request)


@FUZZ
@given(request=STRATEGIES["Broadcast"])
def test_fuzzed_broadcast_is_answered_with_a_table_code_and_changes_nothing(target, request):
    fuzz(target, "Broadcast", request)


@FUZZ
@given(request=STRATEGIES["Work"])
def test_fuzzed_work_is_answered_with_a_table_code_and_changes_nothing(target, request):
    fuzz(target, "Work", request)


@FUZZ
@given(request=STRATEGIES["ClipNorm"])
def test_fuzzed_clip_norm_is_answered_with_a_table_code_and_changes_nothing(target, request):
    fuzz(target, "ClipNorm", request)


@FUZZ
@given(request=STRATEGIES["CommitRound"])
def test_fuzzed_commit_round_is_answered_with_a_table_code_and_changes_nothing(target, request):
    fuzz(target, "CommitRound", request)


@FUZZ
@given(request=STRATEGIES["Leave"])
def test_fuzzed_leave_changes_at_most_the_left_flag_of_its_worker(target, request):
    fuzz(target, "Leave", request)


# -- raw bytes ----------------------------------------------------------------------------------


@st.composite
def mangled(draw, method: str):
    """A real encoding of the method's request, cut short, with junk spliced in."""
    encoded = draw(STRATEGIES[method]).SerializeToString()
    encoded = encoded[: draw(st.integers(1, max(len(encoded), 1)))]
    at = draw(st.integers(0, len(encoded)))
    return encoded[:at] + draw(st.binary(max_size=16)) + encoded[at:]


def with_unknown_field(method: str):
    """A real encoding with an unknown field appended (a newer client): it parses."""
    field = st.integers(16, 2**29 - 1)
    varint = st.tuples(field, st.integers(0, 2**64 - 1)).map(lambda t: _varint(t[0] << 3) + _varint(t[1]))
    blob = st.tuples(field, st.binary(max_size=32)).map(lambda t: _varint(t[0] << 3 | 2) + _varint(len(t[1])) + t[1])
    return st.tuples(STRATEGIES[method], st.one_of(varint, blob)).map(lambda t: t[0].SerializeToString() + t[1])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def raw_bytes(method: str):
    return st.one_of(st.binary(max_size=256), mangled(method), with_unknown_field(method))


def parses(method: str, data: bytes) -> bool:
    try:
        REQUESTS[method].FromString(data)
    except DecodeError:
        return False
    return True


@pytest.mark.parametrize("method", sorted(REQUESTS))
@RAW
@given(data=st.data())
def test_raw_bytes_to_every_method_are_refused_or_harmless(target, method, data):
    payload = data.draw(raw_bytes(method), label="payload")
    call = target.channel.unary_unary(f"/{wire.SERVICE_NAME}/{method}", request_serializer=None,
                                      response_deserializer=None)
    code, details, reply = outcome(call, payload)
    if code == Code.INVALID_ARGUMENT and "the request is not a valid" in details:
        assert not parses(method, payload), f"the server failed to parse bytes that parse: {payload!r}"
        assert target.read_state() == target.state
        return
    request = REQUESTS[method].FromString(payload)  # the server parsed it: so does this
    if reply is not None:
        reply = getattr(pb, f"{method}Response").FromString(reply)
    check(target, method, request, code, details, reply)


# -- the streamed forms: PushStream, PullStream, InitializeStream, message by message ------------


def as_stream(request: pb.PushRequest, data) -> list[bytes]:
    """The push as PushStream messages: a header, then its tensors' bytes cut at drawn
    points; sometimes mangled (bytes missing or extra, a second header, garbage, no header)."""
    header = pb.PushHeader(worker_id=request.worker_id, step=request.step, base_version=request.base_version,
                           batch_size=request.batch_size, loss=request.loss,
                           gradients=[pb.TensorMeta(name=t.name, dtype=t.dtype, shape=t.shape)
                                      for t in request.gradients])
    return chunked(pb.PushChunk(header=header), request.gradients, data)


def chunked(first, tensors, data) -> list[bytes]:
    """``first`` (a header message), then the bytes of ``tensors`` cut at drawn points,
    sometimes mangled (``as_stream``)."""
    payload = b"".join(t.data for t in tensors)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(payload)), max_size=4), label="cuts"))
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)]) if b > a]
    messages = [first.SerializeToString()] + [stream.frame([p]) for p in pieces]
    mangle = data.draw(st.sampled_from(["none"] * 6 + ["short", "long", "header", "garbage", "headless"]),
                       label="mangle")
    if mangle == "short" and pieces:
        messages[-1] = stream.frame([pieces[-1][:-1]])
    elif mangle == "long":
        messages.append(stream.frame([b"\x00\x01\x02"]))
    elif mangle == "header":
        messages.insert(data.draw(st.integers(1, len(messages)), label="at"), messages[0])
    elif mangle == "garbage":
        messages.insert(data.draw(st.integers(1, len(messages)), label="at"),
                        data.draw(st.binary(min_size=1, max_size=16), label="garbage"))
    elif mangle == "headless":
        messages = messages[1:]
    return messages


@FUZZ
@given(data=st.data())
def test_fuzzed_push_stream_is_answered_with_a_table_code_and_a_refusal_changes_nothing(target, data):
    """PushStream keeps Push's promises whatever the messages: a stream is applied whole or not at all."""
    request = data.draw(st.one_of(STRATEGIES["Push"], pushes_near(target)), label="request")
    call = target.channel.stream_unary(f"/{wire.SERVICE_NAME}/PushStream", request_serializer=None,
                                       response_deserializer=pb.PushResponse.FromString)
    code, details, reply = outcome(call, iter(as_stream(request, data)))
    check(target, "Push", request, code, details, reply)


@FUZZ
@given(data=st.data())
def test_fuzzed_push_pull_is_answered_with_a_table_code_and_a_refusal_changes_nothing(target, data):
    """PushPull is PushStream with the round's values streamed back: the same promises, and
    a reply that ends with the push's answer (``done``) whenever the call succeeds."""
    request = data.draw(st.one_of(STRATEGIES["Push"], pushes_near(target)), label="request")
    call = target.channel.stream_stream(f"/{wire.SERVICE_NAME}/PushPull", request_serializer=None,
                                        response_deserializer=None)

    def push_pull(messages, timeout):
        replies = [pb.PushPullChunk.FromString(r) for r in call(messages, timeout=timeout)
                   if stream.unframe(r) is None]
        assert replies and replies[0].HasField("header") and replies[-1].HasField("done"), replies
        return replies[-1].done

    code, details, reply = outcome(push_pull, iter(as_stream(request, data)))
    check(target, "Push", request, code, details, reply)


@FUZZ
@given(request=STRATEGIES["Pull"])
def test_fuzzed_pull_stream_is_answered_with_a_table_code_and_changes_nothing(target, request):
    call = target.channel.unary_stream(f"/{wire.SERVICE_NAME}/PullStream", request_serializer=None,
                                       response_deserializer=None)
    code, details, reply = outcome(lambda r, timeout: list(call(r.SerializeToString(), timeout=timeout)), request)
    check(target, "Pull", request, code, details, reply)


@FUZZ
@given(request=STRATEGIES["Initialize"], data=st.data())
def test_fuzzed_initialize_stream_of_an_initialized_server_is_harmless_or_refused(target, request, data):
    """InitializeStream keeps Initialize's promises whatever the messages."""
    header = pb.InitializeHeader(worker_id=request.worker_id, optimizer=request.optimizer,
                                 variables=[pb.TensorMeta(name=t.name, dtype=t.dtype, shape=t.shape)
                                            for t in request.variables],
                                 non_trainable=request.non_trainable)
    call = target.channel.stream_unary(f"/{wire.SERVICE_NAME}/InitializeStream", request_serializer=None,
                                       response_deserializer=pb.InitializeResponse.FromString)
    code, details, reply = outcome(call, iter(chunked(pb.InitializeChunk(header=header), request.variables, data)))
    check(target, "Initialize", request, code, details, reply)


# -- the Session stream: the calls it carries keep their unary promises ------------------------

SESSION_CALLS = {"pull": "Pull", "push": "Push", "work": "Work"}


def session_replies(target: Target, messages: list[bytes]) -> list[pb.SessionReply]:
    call = target.channel.stream_stream(f"/{wire.SERVICE_NAME}/Session", request_serializer=None,
                                        response_deserializer=pb.SessionReply.FromString)
    return list(call(iter(messages), timeout=CALL_TIMEOUT))


def session_outcome(reply: pb.SessionReply, kind: str):
    """(code, details, reply) of one call on a Session, as ``outcome`` gives a unary call's."""
    if reply.HasField("failure"):
        return STATUS_CODES[reply.failure.code], reply.failure.details, None
    assert reply.WhichOneof("reply") == kind, reply
    return Code.OK, "", getattr(reply, kind)


@FUZZ
@given(data=st.data())
def test_fuzzed_calls_on_a_session_keep_the_promises_of_their_unary_calls(target, data):
    """Two calls on one stream, each answered once under its own id, each with a table code,
    a refusal changing nothing, an accepted call only what its unary call may."""
    kinds = data.draw(st.lists(st.sampled_from(sorted(SESSION_CALLS)), min_size=1, max_size=2), label="kinds")
    requests = []
    for kind in kinds:  # drawn near the state as of the stream's start: later ones may be replayed or stale
        method = SESSION_CALLS[kind]
        strategy = st.one_of(STRATEGIES["Push"], pushes_near(target)) if kind == "push" else STRATEGIES[method]
        requests.append(data.draw(strategy, label=method))
    messages = [pb.SessionRequest(call=i + 1, **{k: r}).SerializeToString()
                for i, (k, r) in enumerate(zip(kinds, requests))]
    replies = session_replies(target, messages)
    assert sorted(r.call for r in replies) == list(range(1, len(kinds) + 1)), replies
    if len(kinds) == 1:
        check(target, SESSION_CALLS[kinds[0]], requests[0], *session_outcome(replies[0], kinds[0]))
        return
    for reply in replies:  # the two ran concurrently: each one's codes, then the state as a good client sees it
        code, details, _ = session_outcome(reply, kinds[reply.call - 1])
        assert code in EXPECTED or code == Code.OK, f"{kinds[reply.call - 1]} answered {code.name}: {details!r}"
    target.state = target.read_state()


@RAW
@given(data=st.data())
def test_raw_bytes_on_a_session_end_it_as_invalid_or_keep_the_unary_promises(target, data):
    """Bytes that are no SessionRequest end the stream INVALID_ARGUMENT and change nothing;
    bytes that are one are the call they name (none, or a cancel of a call not running:
    no answer or INVALID_ARGUMENT, nothing changed)."""
    kind = data.draw(st.sampled_from(sorted(SESSION_CALLS)), label="kind")
    method = SESSION_CALLS[kind]
    payload = data.draw(st.one_of(
        st.binary(max_size=256),
        raw_bytes(method).map(lambda inner: pb.SessionRequest(call=3).SerializeToString()
                              + _varint(list(SESSION_CALLS).index(kind) + 2 << 3 | 2) + _varint(len(inner)) + inner)),
        label="payload")
    try:
        request = pb.SessionRequest.FromString(payload)
    except DecodeError:
        request = None
    try:
        replies = session_replies(target, [payload])
    except grpc.RpcError as e:
        assert request is None, f"the server failed to parse bytes that parse: {payload!r}"
        assert e.code() == Code.INVALID_ARGUMENT and "the request is not a valid" in e.details(), e
        assert target.read_state() == target.state
        return
    assert request is not None, f"the server took bytes that do not parse: {payload!r}"
    named = request.WhichOneof("request")
    if named in SESSION_CALLS:
        assert [r.call for r in replies] == [request.call], replies
        inner = getattr(request, named)
        check(target, SESSION_CALLS[named], inner, *session_outcome(replies[0], named))
        return
    if named is None:
        assert len(replies) == 1 and replies[0].failure.code == Code.INVALID_ARGUMENT.value[0], replies
    else:
        assert replies == [], replies  # a cancel of no running call: nothing to answer
    assert target.read_state() == target.state
