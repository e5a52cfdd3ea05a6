"""gRPC server reflection, asked with grpcio-reflection's own client, against a real server on port 0.

    python -m pytest tests/service/test_reflection.py -q

Rules (ps_server/server.py, ps_common/security.py): reflection is on by default
and lists the tfps service, whose messages it describes; ``--no-reflection``
turns it off (UNIMPLEMENTED); with a bearer token it is guarded like every call
but the health check (UNAUTHENTICATED without the token, served with it).
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from protos import wire
from ps_common import security
from ps_server.config import ServerConfig
from ps_server.server import build_server

TOKEN = "reflection-token-0123456789"


@pytest.fixture
def serve():
    """``serve(*ps-server flags) -> RunningServer`` on 127.0.0.1 port 0, from the flags as users give them."""
    started = []

    def start(*flags):
        config = ServerConfig.from_args(["--host", "127.0.0.1", "--port", "0", *flags], environ={})
        started.append(build_server(config).start())
        return started[-1]

    yield start
    for running in started:
        running.stop(grace=0.5)


def services(channel: grpc.Channel) -> list[str]:
    return ProtoReflectionDescriptorDatabase(channel).get_services()


def test_reflection_lists_the_tfps_service_and_describes_its_messages(serve):
    running = serve()
    with grpc.insecure_channel(running.address) as channel:
        names = services(channel)
        assert wire.SERVICE_NAME == "tfps.v1.ParameterServer" and wire.SERVICE_NAME in names
        assert "grpc.health.v1.Health" in names
        pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        status = pool.FindMessageTypeByName("tfps.v1.StatusResponse")
        assert {"version", "num_variables", "pushes_applied"} <= set(status.fields_by_name)
        method = pool.FindServiceByName(wire.SERVICE_NAME).methods_by_name["Status"]
        assert method.output_type.full_name == "tfps.v1.StatusResponse"


def test_no_reflection_flag_makes_reflection_unimplemented(serve):
    running = serve("--no-reflection")
    with grpc.insecure_channel(running.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            services(channel)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("token", [None, "wrong-token"], ids=["no_token", "wrong_token"])
def test_reflection_needs_the_token_like_every_call_but_the_health_check(serve, tmp_path, token):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    running = serve("--auth-token-file", str(token_file))
    with security.client_channel(running.address, token=token) as channel:
        with pytest.raises(grpc.RpcError) as info:
            services(channel)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING  # the one call without the token
    with security.client_channel(running.address, token=TOKEN) as channel:
        assert wire.SERVICE_NAME in services(channel)
