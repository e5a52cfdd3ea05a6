#!/opt/tfps/bin/python
"""tfps-healthcheck [HOST:PORT]: exit 0 if the server's gRPC health service says SERVING.

The HEALTHCHECK of the server image and of docker/compose.yaml. It asks the
standard service (grpc.health.v1.Health/Check, service ""), which the server
answers without the bearer token. The default address is 127.0.0.1 and
TFPS_PORT (50051). It reads the server's own environment:

- plaintext, unless TFPS_TLS_CERT_FILE is set (the server speaks TLS);
- with TLS it trusts TFPS_HEALTHCHECK_CA_FILE, else the server's certificate
  itself (enough for a self-signed one), and checks the certificate against
  TFPS_HEALTHCHECK_SERVER_NAME, else the host it calls (127.0.0.1);
- with mutual TLS (TFPS_TLS_CLIENT_CA_FILE) it presents
  TFPS_HEALTHCHECK_CERT_FILE and TFPS_HEALTHCHECK_KEY_FILE.

Anything else than SERVING exits 1 with one line saying what it got.
"""
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _read(variable: str) -> bytes:
    path = os.environ[variable]
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        sys.exit(f"tfps-healthcheck: {variable}={path}: {e.strerror}")


def channel(target: str) -> grpc.Channel:
    env = os.environ
    if not env.get("TFPS_TLS_CERT_FILE"):
        return grpc.insecure_channel(target)
    root = _read("TFPS_HEALTHCHECK_CA_FILE" if env.get("TFPS_HEALTHCHECK_CA_FILE") else "TFPS_TLS_CERT_FILE")
    key = chain = None
    if env.get("TFPS_TLS_CLIENT_CA_FILE"):
        if not (env.get("TFPS_HEALTHCHECK_CERT_FILE") and env.get("TFPS_HEALTHCHECK_KEY_FILE")):
            sys.exit("tfps-healthcheck: the server requires client certificates (TFPS_TLS_CLIENT_CA_FILE): "
                     "set TFPS_HEALTHCHECK_CERT_FILE and TFPS_HEALTHCHECK_KEY_FILE")
        chain, key = _read("TFPS_HEALTHCHECK_CERT_FILE"), _read("TFPS_HEALTHCHECK_KEY_FILE")
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    name = env.get("TFPS_HEALTHCHECK_SERVER_NAME")
    return grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", name)] if name else [])


def main() -> None:
    target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:" + os.environ.get("TFPS_PORT", "50051")
    with channel(target) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as e:
            sys.exit(f"tfps-healthcheck: {target}: {e.code().name}")
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        sys.exit(f"tfps-healthcheck: {target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")


if __name__ == "__main__":
    main()
