"""A model larger than one message is initialized through InitializeStream.

    python -m pytest tests/service/test_initialize_stream.py -q

Rules (protos/tfps.proto, InitializeHeader; worker/client.py, ``PSClient.initialize``):
"Variables of up to half the channel's message limit in all go as one Initialize
message ...; larger ones are streamed in ~2 MiB chunks (InitializeStream), so a model
of any size can be initialized"; "a malformed stream (a missing or second header, more
or fewer bytes than announced) is INVALID_ARGUMENT and stores nothing"; repeating an
identical initialization answers created=False. The servers here have a 4 MiB message
limit and a 16 MiB variable; expected values are computed by hand.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos import codec, stream, wire
from protos import tfps_pb2 as pb
from worker.client import PSClient, PSClientError

LIMIT_MB = 4
SGD = {"name": "sgd", "learning_rate": 0.5}
N = 4 * 2**20  # float32: 16 MiB, four times the limit
W = (np.arange(N) % 1024).astype(np.float32)  # integers: every SGD step below is exact
G = np.full(N, 2.0, np.float32)
SMALL = np.arange(1000, dtype=np.float32)  # 4,000 bytes: two chunks of 3,000 and 1,000


def test_a_variable_four_times_the_message_limit_is_initialized_pulled_and_stepped_exactly(ps, raw_stub):
    running, client = ps(mode="async", num_workers=1, max_message_mb=LIMIT_MB)
    client.register(0, 1)
    unary = pb.InitializeRequest(worker_id=0, optimizer=pb.OptimizerConfig(**SGD), variables=[codec.encode("w", W)])
    with pytest.raises(grpc.RpcError) as refused:  # what the stream is for: one message cannot carry it
        raw_stub(running).Initialize(unary, timeout=30)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert not client.status().initialized

    assert client.initialize(0, {"w": W}, SGD) is True
    version, values = client.pull(0)
    assert version == 0
    np.testing.assert_array_equal(values["w"], W)
    assert values["w"].dtype == np.float32

    reply = client.push(0, 0, version, 1, {"w": G})  # 16 MiB: streamed too
    assert reply.version == 1
    _, values = client.pull(0)
    np.testing.assert_array_equal(values["w"], W - np.float32(0.5) * G)  # w - lr * g = w - 1


def test_a_repeated_identical_streamed_initialize_answers_not_created_and_keeps_the_trained_values(ps):
    running, client = ps(mode="async", num_workers=1, max_message_mb=LIMIT_MB)
    client.register(0, 1)
    assert client.initialize(0, {"w": W}, SGD) is True
    client.push(0, 0, 0, 1, {"w": G})
    assert client.initialize(0, {"w": W}, SGD) is False
    version, values = client.pull(0)
    assert version == 1
    np.testing.assert_array_equal(values["w"], W - 1.0)


def test_a_streamed_initialize_that_differs_from_the_stored_one_is_already_exists(ps):
    running, client = ps(mode="async", num_workers=1, max_message_mb=LIMIT_MB)
    client.register(0, 1)
    assert client.initialize(0, {"w": W}, SGD) is True
    with pytest.raises(PSClientError) as refused:
        client.initialize(0, {"w": W, "b": np.zeros(3, np.float32)}, SGD)
    assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS, refused.value.details


def test_a_small_model_still_goes_as_one_initialize_message(ps):
    running, client = ps(mode="async", num_workers=1, max_message_mb=LIMIT_MB)
    client.register(0, 1)
    calls = []
    client.streams.initialize = lambda *a: calls.append(a)  # would record a streamed call
    assert client.initialize(0, {"w": SMALL}, SGD) is True
    assert calls == []
    np.testing.assert_array_equal(client.pull(0)[1]["w"], SMALL)


# -- malformed streams, sent message by message ----------------------------------------------


def header(**overrides) -> pb.InitializeHeader:
    fields = dict(worker_id=0, optimizer=pb.OptimizerConfig(**SGD),
                  variables=[pb.TensorMeta(name="w", dtype=pb.FLOAT32, shape=[SMALL.size])])
    fields.update(overrides)
    return pb.InitializeHeader(**fields)


def messages(mangle: str) -> list[bytes]:
    data = SMALL.tobytes()
    first = pb.InitializeChunk(header=header()).SerializeToString()
    good = [first, stream.frame([data[:3000]]), stream.frame([data[3000:]])]
    return {
        "short": good[:2],  # 1,000 bytes missing
        "long": good + [stream.frame([b"\0\0\0\0"])],
        "headless": good[1:],
        "empty": [],
        "second header": good[:2] + [first] + good[2:],
        "data in the header": [pb.InitializeChunk(header=header(), data=data).SerializeToString()],
        "garbage": good[:2] + [b"\xff\xff\xff"] + good[2:],
        "sparse": [pb.InitializeChunk(header=header(variables=[pb.TensorMeta(
            name="w", dtype=pb.FLOAT32, shape=[SMALL.size], sparse=True, rows=[0])])).SerializeToString()] + good[1:],
        "bad shape": [pb.InitializeChunk(header=header(variables=[pb.TensorMeta(
            name="w", dtype=pb.FLOAT32, shape=[-1000])])).SerializeToString()] + good[1:],
        "bad dtype": [pb.InitializeChunk(header=header(variables=[pb.TensorMeta(
            name="w", dtype=99, shape=[SMALL.size])])).SerializeToString()] + good[1:],
    }[mangle]


MANGLES = ["short", "long", "headless", "empty", "second header", "data in the header", "garbage", "sparse",
           "bad shape", "bad dtype"]


@pytest.mark.parametrize("mangle", MANGLES)
def test_a_malformed_initialize_stream_is_invalid_argument_and_leaves_the_server_uninitialized(ps, mangle):
    running, client = ps(mode="sync", num_workers=1)
    client.register(0, 1)
    channel = grpc.insecure_channel(running.address, options=wire.channel_options())
    try:
        call = channel.stream_unary(f"/{wire.SERVICE_NAME}/InitializeStream", request_serializer=None,
                                    response_deserializer=pb.InitializeResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            call(iter(messages(mangle)), timeout=30)
    finally:
        channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert not client.status().initialized
    assert client.initialize(0, {"w": SMALL}, SGD) is True  # nothing was stored: this one creates


def test_a_streamed_initialize_from_an_unregistered_worker_is_refused_before_its_bytes(ps):
    running, client = ps(mode="async", num_workers=1, max_message_mb=LIMIT_MB)
    with pytest.raises(PSClientError) as refused:
        client.initialize(0, {"w": W}, SGD)
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details
    assert not client.status().initialized
