#!/opt/tfps/bin/python
"""tfps-healthcheck [HOST:PORT]: exit 0 if the server's gRPC health service says SERVING.

The HEALTHCHECK of the server image and of docker/compose.yaml. It asks the
standard service (grpc.health.v1.Health/Check, service ""), which the server
answers without the bearer token. The default address is 127.0.0.1 and
TFPS_PORT (50051). Plaintext only: a server with TLS needs its own check.
"""
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:" + os.environ.get("TFPS_PORT", "50051")
with grpc.insecure_channel(target) as channel:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    except grpc.RpcError as e:
        sys.exit(f"{target}: {e.code().name}")
if reply.status != health_pb2.HealthCheckResponse.SERVING:
    sys.exit(f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
