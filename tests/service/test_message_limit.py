"""A message above the server's limit is refused as RESOURCE_EXHAUSTED and changes nothing.

    python -m pytest tests/service/test_message_limit.py -q

Rule (protos/wire.py): "One setting, the largest message, raises gRPC's 4 MiB
default on the client and the server alike ... It is the ``max_message_mb`` field
of both processes' configurations (``--max-message-mb``, ``TFPS_MAX_MESSAGE_MB``)."
The server runs in its own process (``python -m ps_server``, as users start it)
with TFPS_MAX_MESSAGE_MB=1 in its environment, which its configuration resolves
and hands to ``wire.server_options``; the test's channel sends up to 64 MiB.

The oversized push is a valid push plus an unknown field (protobuf skips unknown
fields, as for a message from a newer client) that makes it just over 1 MiB: the
same push padded to just under the limit is accepted, so the size alone is what
the server refuses. Expected values are computed by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec, wire
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from ps_common.procs import ServerStartError, dying_with_parent, wait_for_port_file

LIMIT = 2**20  # TFPS_MAX_MESSAGE_MB=1
CALL_TIMEOUT = 30.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W0 = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
G = np.array([2.0, 4.0, -2.0, 0.0], np.float32)


class Server:
    def __init__(self, tmp_path):
        port_file = tmp_path / "port"
        self.log_path = tmp_path / "ps.log"
        env = dict(os.environ, TFPS_MAX_MESSAGE_MB="1", PYTHONUNBUFFERED="1")
        env.pop("TF_CONFIG", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                dying_with_parent(  # never outlive pytest
                    [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--port-file",
                     str(port_file), "--mode", "sync", "--num-workers", "1", "--lease-timeout", "3600",
                     "--log-level", "DEBUG"]),  # the serving line, with its limit, is a start-up detail
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
            )
        try:
            self.address = f"127.0.0.1:{wait_for_port_file(str(port_file), self.proc, 60)}"
        except ServerStartError as e:
            self.proc.kill()
            self.proc.wait(timeout=15)
            pytest.fail(f"{e}: {self.log_path.read_text()}")
        self.channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_send_message_length", 64 * LIMIT), ("grpc.max_receive_message_length", 64 * LIMIT)])
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def raw(self, method: str):
        return self.channel.unary_unary(f"/{wire.SERVICE_NAME}/{method}", request_serializer=None,
                                        response_deserializer=None)

    def state(self):
        pulled = self.stub.Pull(pb.PullRequest(worker_id=-1), timeout=CALL_TIMEOUT)
        s = self.stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT)
        return (pulled.version, [(t.name, t.data) for t in pulled.variables],
                (s.round, list(s.waiting_for), s.pushes_applied, s.examples_applied))

    def stop(self):
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("limit"))
    s.stub.Register(pb.RegisterRequest(worker_index=0, num_workers=1), timeout=CALL_TIMEOUT)
    s.stub.Initialize(pb.InitializeRequest(worker_id=0, optimizer=pb.OptimizerConfig(name="sgd", learning_rate=0.5),
                                           variables=[codec.encode("w", W0)]), timeout=CALL_TIMEOUT)
    yield s
    s.stop()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def padded(message, total: int) -> bytes:
    """``message`` encoded, plus unknown field 99 (length-delimited) so that it is ``total`` bytes."""
    body = message.SerializeToString()
    tag = _varint(99 << 3 | 2)
    size = total - len(body) - len(tag) - len(_varint(total))  # the length prefix is at most that long
    encoded = body + tag + _varint(size) + b"\0" * size
    assert abs(len(encoded) - total) <= 4
    parsed = type(message).FromString(encoded)
    parsed.DiscardUnknownFields()
    assert parsed == message  # apart from the padding, the same push
    return encoded


def push(step: int, base: int) -> pb.PushRequest:
    return pb.PushRequest(worker_id=0, step=step, base_version=base, batch_size=1, gradients=[codec.encode("w", G)])


def refused(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=CALL_TIMEOUT)
    return info.value


def test_the_server_process_runs_with_the_lowered_limit(server):
    assert "max_message=1 MiB" in server.log_path.read_text()


def test_push_just_over_the_limit_is_resource_exhausted_and_changes_nothing(server):
    before = server.state()
    request = padded(push(step=before[2][0], base=before[0]), LIMIT + 64)
    assert len(request) > LIMIT
    error = refused(server.raw("Push"), request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert "larger than max" in error.details()
    assert server.state() == before


def test_typed_push_of_a_gradient_over_the_limit_is_resource_exhausted_and_changes_nothing(server):
    before = server.state()
    big = np.zeros(LIMIT // 4 + 1, np.float32)  # under the limit it would be INVALID_ARGUMENT (shape)
    request = pb.PushRequest(worker_id=0, step=before[2][0], base_version=before[0], batch_size=1,
                             gradients=[codec.encode("w", big)])
    assert request.ByteSize() > LIMIT
    error = refused(server.stub.Push, request)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
    assert server.state() == before


def test_the_same_push_just_under_the_limit_is_applied_and_the_server_still_serves(server):
    before = server.state()
    version, round_ = before[0], before[2][0]
    reply = pb.PushResponse.FromString(server.raw("Push")(padded(push(round_, version), LIMIT - 4096),
                                                          timeout=CALL_TIMEOUT))
    assert (reply.version, reply.contributors, reply.replayed) == (version + 1, 1, False)
    pulled = server.stub.Pull(pb.PullRequest(worker_id=0), timeout=CALL_TIMEOUT)
    _, w = codec.decode(pulled.variables[0])
    # One SGD step per accepted push (earlier tests in this module refused theirs): w - 0.5 * g.
    np.testing.assert_array_equal(w, W0 - (version + 1) * np.float32(0.5) * G)
    for service in ("", wire.SERVICE_NAME):
        check = server.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert server.proc.poll() is None
