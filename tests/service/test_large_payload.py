"""Messages far above gRPC's 4 MiB default travel both ways.

    python -m pytest tests/service/test_large_payload.py -q

Rule (protos/wire.py): "One setting, MAX_MESSAGE_BYTES, raises gRPC's 4 MiB
default on the client and the server alike, so a payload one side can send the
other can receive." A 40 MB variable is initialized (client -> server), pulled
(server -> client) and a 40 MB gradient pushed; a channel left at gRPC's
defaults is refused the same pull, so the payload really is above the default.
"""

import grpc
import numpy as np
import pytest

from protos import codec, wire
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc

N = 10_000_000  # float32: 40 MB
GRPC_DEFAULT_MAX_RECEIVE = 4 * 2**20


@pytest.fixture(scope="module")
def big():
    # Integers below 2**24 are exact in float32, so the SGD step below is exact too.
    w = np.arange(N, dtype=np.float32)
    g = (np.arange(N) % 7).astype(np.float32) * np.float32(2)
    return w, g


def test_forty_megabyte_variable_and_gradient_cross_the_wire_both_ways(ps, big):
    w, g = big
    assert GRPC_DEFAULT_MAX_RECEIVE < w.nbytes < wire.MAX_MESSAGE_BYTES
    running, client = ps(mode="sync", num_workers=1)
    client.register(0, 1)
    assert client.initialize(0, {"big": w}, {"name": "sgd", "learning_rate": 0.25}) is True

    version, values = client.pull(0)
    assert version == 0
    assert values["big"].dtype == np.float32 and values["big"].shape == (N,)
    assert values["big"].tobytes() == w.tobytes()  # bit-identical
    del values

    reply = client.push(0, step=0, base_version=0, batch_size=1, gradients={"big": g})
    assert (reply.version, reply.contributors) == (1, 1)
    version, values = client.pull(0)
    assert version == 1
    expected = w - g * np.float32(0.25)  # Keras' SGD: w - g*lr, in float32
    # by hand: i - 0.25 * 2 * (i % 7)
    np.testing.assert_array_equal(expected[:9], [0, 0.5, 1, 1.5, 2, 2.5, 3, 7, 7.5])
    assert values["big"].tobytes() == expected.tobytes()


def test_a_channel_at_grpc_defaults_cannot_receive_the_same_pull(ps, big):
    running, client = ps(mode="async", num_workers=1)
    client.register(0, 1)
    client.initialize(0, {"big": big[0]}, {"name": "sgd", "learning_rate": 0.5})
    with grpc.insecure_channel(running.address) as channel:  # no wire.channel_options()
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ParameterServerStub(channel).Pull(pb.PullRequest(worker_id=0), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The server itself is fine: the PSClient, with the raised limit, still pulls it.
    _, values = client.pull(0)
    assert values["big"].nbytes == big[0].nbytes


def test_server_accepts_a_forty_megabyte_push_from_a_raised_channel(ps, big, raw_stub):
    # gRPC clients send without a cap by default; what this proves is the server's receive limit.
    w, g = big
    running, client = ps(mode="async", num_workers=1)
    client.register(0, 1)
    client.initialize(0, {"big": w}, {"name": "sgd", "learning_rate": 0.5})
    request = pb.PushRequest(worker_id=0, step=0, base_version=0, batch_size=1, gradients=[codec.encode("big", g)])
    assert request.ByteSize() > GRPC_DEFAULT_MAX_RECEIVE
    reply = raw_stub(running).Push(request, timeout=30)
    assert (reply.version, reply.staleness) == (1, 0)
