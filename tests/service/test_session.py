"""The Session stream (rpc Session, ``worker.transports.CallStream``): a worker's one-message
Pull, Push and Work calls on one long-lived stream, each answered as its unary call.

What the stream must keep of the unary calls: the same values (the transport tests in
test_keras_push, test_delta_pull and test_sparse_push run each on the session and as
unary calls), the same refusal (code, details, reason), a deadline that ends the call
alone, and a broken connection that fails the calls in flight and is replaced by the
next call. What it adds: calls that run concurrently on one stream (a pull is answered
while a push of the same client waits at the barrier). The fuzz tests (test_fuzz.py)
send it arbitrary calls and bytes; the token tests (tests/security) send it without one.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from protos import tfps_pb2 as pb
from protos import wire
from ps_common.reasons import Reason
from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.client import PSClient, PSClientError

from .conftest import CLIENT_TIMEOUT

Code = grpc.StatusCode
SGD = {"name": "sgd", "learning_rate": 0.5}
W0 = {"w": np.array([1.0, 2.0, 3.0], np.float32)}


def _ready(ps, mode="sync", workers=1):
    running, client = ps(mode=mode, num_workers=workers)
    client.register(0, workers)
    client.initialize(0, W0, SGD)
    client.pull(0)  # the pull cache holds the model: the next pulls are one message each
    return running, client


def _worker_1_completes_round_0(running) -> None:
    """Worker 1 of 2 registers and pushes round 0, which completes it (version 1)."""
    other = PSClient(running.address, timeout=CLIENT_TIMEOUT)
    try:
        other.register(1, 2)
        assert other.push(1, 0, 0, 1, {"w": np.ones(3, np.float32)}).version == 1
    finally:
        other.close()


def _streams_opened(client: PSClient) -> list:
    """Every Session stream ``client`` opens from now on."""
    opened, real = [], client.calls._method

    def opening(*a, **kw):
        call = real(*a, **kw)
        opened.append(call)
        return call

    client.calls._method = opening
    return opened


def test_a_training_client_sends_its_pulls_and_pushes_on_one_stream(ps):
    running, client = _ready(ps, mode="async")
    opened = _streams_opened(client)
    version = 0
    for step in range(5):
        reply = client.push(0, step, version, 1, {"w": np.ones(3, np.float32)})
        version, values = client.pull(0)
        assert reply.version == version == step + 1
    np.testing.assert_array_equal(values["w"], W0["w"] - 0.5 * 5)
    assert len(opened) == 1
    assert running.core.status().pushes_applied == 5


def test_a_refusal_on_the_session_is_the_unary_call_s_code_details_and_reason(ps):
    running, client = _ready(ps)
    unary = PSClient(running.address, timeout=CLIENT_TIMEOUT, session=False)
    try:
        refusals = []
        for c in (client, unary):
            with pytest.raises(PSClientError) as info:
                c.push(0, 0, 0, 1, {"w": np.ones(4, np.float32)})  # the wrong shape
            refusals.append((info.value.call, info.value.code, info.value.reason, info.value.details))
    finally:
        unary.close()
    assert refusals[0] == refusals[1]
    assert refusals[0][:3] == ("Push", Code.INVALID_ARGUMENT, Reason.INVALID)
    assert running.core.status().version == 0


def test_a_pull_is_answered_while_a_push_of_the_same_client_waits_at_the_barrier(ps, bg):
    running, client = _ready(ps, workers=2)
    opened = _streams_opened(client)
    waiting = bg(client.push, 0, 0, 0, 1, {"w": np.ones(3, np.float32)})
    version, values = client.pull(0)  # while worker 0's push waits for worker 1's
    assert version == 0 and not waiting.done()
    np.testing.assert_array_equal(values["w"], W0["w"])
    _worker_1_completes_round_0(running)
    assert waiting.result(timeout=10).version == 1
    assert len(opened) == 1


def test_a_call_past_its_deadline_ends_alone_and_the_stream_goes_on(ps):
    running, client = _ready(ps, mode="sync", workers=2)
    opened = _streams_opened(client)
    with pytest.raises(PSClientError) as info:
        client.push(0, 0, 0, 1, {"w": np.ones(3, np.float32)}, timeout=0.3)  # worker 1 never pushes
    assert info.value.code == Code.DEADLINE_EXCEEDED
    version, values = client.pull(0)
    assert version == 0
    np.testing.assert_array_equal(values["w"], W0["w"])
    assert len(opened) == 1


def test_a_lost_server_fails_the_call_in_flight_and_the_next_call_opens_a_new_stream(bg):
    config = ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=2, barrier_timeout=20.0)
    first = build_server(config).start()
    port = int(first.address.rsplit(":", 1)[1])
    client = PSClient(first.address, timeout=CLIENT_TIMEOUT)
    second = None
    try:
        client.register(0, 2)
        client.initialize(0, W0, SGD)
        client.pull(0)
        opened = _streams_opened(client)
        waiting = bg(client.push, 0, 0, 0, 1, {"w": np.ones(3, np.float32)})
        _wait_for(lambda: running_waits(first), "the push to wait at the barrier")
        first.stop(grace=0.0)
        with pytest.raises(PSClientError) as info:
            waiting.result(timeout=10)
        assert info.value.code in (Code.UNAVAILABLE, Code.CANCELLED), info.value
        second = build_server(ServerConfig(host="127.0.0.1", port=port, mode="async", num_workers=1)).start()
        client.register(0, 1)
        client.initialize(0, W0, SGD)
        assert client.push(0, 0, 0, 1, {"w": np.ones(3, np.float32)}).version == 1
        assert len(opened) == 2
    finally:
        client.close()
        for running in (first, second):
            if running is not None:
                running.stop(grace=0.5)


def running_waits(running) -> bool:
    return bool(running.core.status().waiting_for)


def _wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


def test_a_second_call_under_a_running_call_s_id_is_refused_and_the_first_goes_on(ps):
    running, client = _ready(ps, workers=2)
    push = pb.PushRequest(worker_id=0, step=0, base_version=0, batch_size=1,
                          gradients=[pb.Tensor(name="w", dtype=pb.FLOAT32, shape=[3],
                                               data=np.ones(3, np.float32).tobytes())])
    channel = grpc.insecure_channel(running.address, options=wire.channel_options())
    try:
        call = channel.stream_stream(f"/{wire.SERVICE_NAME}/Session", request_serializer=None,
                                     response_deserializer=pb.SessionReply.FromString)
        replies = call(iter([pb.SessionRequest(call=5, push=push).SerializeToString(),
                             pb.SessionRequest(call=5, pull=pb.PullRequest(worker_id=0)).SerializeToString()]),
                       timeout=10)
        refused = next(replies)  # the push waits at the barrier: the second call is answered first
        assert refused.call == 5 and refused.failure.code == Code.INVALID_ARGUMENT.value[0]
        assert "already running" in refused.failure.details
        _worker_1_completes_round_0(running)
        done = next(replies)
        assert done.call == 5 and done.push.version == 1
        assert list(replies) == []
    finally:
        channel.close()
