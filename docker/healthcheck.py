#!/opt/tfps/bin/python
"""tfps-healthcheck [HOST:PORT]: exit 0 if the server's gRPC health service says SERVING.

The HEALTHCHECK of the server image and of docker/compose.yaml. It asks the
standard service (grpc.health.v1.Health/Check, service ""), which the server
answers without the bearer token. It reads the server's own environment the
way the server does, through the configuration resolver (``ServerConfig``,
``ps_common.settings``): the port (TFPS_PORT, or TF_CONFIG's ps task), the
address when the server binds one address only (TFPS_HOST; 127.0.0.1 when it
binds all), and:

- plaintext, unless the server speaks TLS (TFPS_SERVER_TLS_CERT_FILE);
- with TLS it trusts TFPS_HEALTHCHECK_CA_FILE, else the server's certificate
  itself (enough for a self-signed one), and checks the certificate against
  TFPS_HEALTHCHECK_SERVER_NAME, else the host it calls;
- with mutual TLS (TFPS_TLS_CLIENT_CA_FILE) it presents
  TFPS_HEALTHCHECK_CERT_FILE and TFPS_HEALTHCHECK_KEY_FILE.

Anything else than SERVING, or a server environment the server itself would
refuse, exits 1 with one line saying what it got.
"""
import dataclasses
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps_common.settings import ConfigError, resolve, setting
from ps_server.config import ServerConfig

_ANY_ADDRESS = ("0.0.0.0", "::", "[::]", "")


@dataclasses.dataclass(frozen=True)
class HealthcheckConfig:
    """The check's own settings, from the environment only."""

    ca_file: str = setting("", env="TFPS_HEALTHCHECK_CA_FILE")
    cert_file: str = setting("", env="TFPS_HEALTHCHECK_CERT_FILE")
    key_file: str = setting("", env="TFPS_HEALTHCHECK_KEY_FILE")
    server_name: str = setting("", env="TFPS_HEALTHCHECK_SERVER_NAME")


def _read(path: str, variable: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        sys.exit(f"tfps-healthcheck: {variable}={path}: {e.strerror}")


def channel(target: str, server: ServerConfig, check: HealthcheckConfig) -> grpc.Channel:
    if not server.tls_cert_file:
        return grpc.insecure_channel(target)
    if check.ca_file:
        root = _read(check.ca_file, "TFPS_HEALTHCHECK_CA_FILE")
    else:
        root = _read(server.tls_cert_file, "TFPS_SERVER_TLS_CERT_FILE")
    key = chain = None
    if server.tls_client_ca_file:
        if not (check.cert_file and check.key_file):
            sys.exit("tfps-healthcheck: the server requires client certificates (TFPS_TLS_CLIENT_CA_FILE): "
                     "set TFPS_HEALTHCHECK_CERT_FILE and TFPS_HEALTHCHECK_KEY_FILE")
        chain = _read(check.cert_file, "TFPS_HEALTHCHECK_CERT_FILE")
        key = _read(check.key_file, "TFPS_HEALTHCHECK_KEY_FILE")
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    options = [("grpc.ssl_target_name_override", check.server_name)] if check.server_name else []
    return grpc.secure_channel(target, credentials, options=options)


def main() -> None:
    try:
        server = resolve(ServerConfig, None, os.environ, role="ps")  # read as the server reads it, not judged
        check = resolve(HealthcheckConfig, None, os.environ)
    except ConfigError as e:
        sys.exit(f"tfps-healthcheck: the server's environment: {e}")
    host = "127.0.0.1" if server.host in _ANY_ADDRESS else server.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    target = sys.argv[1] if len(sys.argv) > 1 else f"{host}:{server.port}"
    with channel(target, server, check) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as e:
            sys.exit(f"tfps-healthcheck: {target}: {e.code().name}")
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        sys.exit(f"tfps-healthcheck: {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")


if __name__ == "__main__":
    main()
