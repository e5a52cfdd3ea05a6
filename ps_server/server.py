"""Build and run a parameter-server process.

    running = build_server(ServerConfig(port=0, mode="sync", num_workers=2))
    running.server.start(); print(running.port)     # tests bind port 0
    serve(config)                                    # ps-server: runs until SIGTERM/SIGINT

``build_server`` returns the started-or-not gRPC server, the port it bound and the
core, apart from ``serve()``, so tests can run a real server in-process. The
standard gRPC health service reports SERVING for "" and for the tfps service
once the server has started, and NOT_SERVING while it shuts down.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import tfps_pb2_grpc as pb_grpc
from protos import wire
from ps_server.config import ConfigError, ServerConfig
from ps_server import security
from ps_server.core.parameter_server import ParameterServer
from ps_server.service import ParameterServerServicer

log = logging.getLogger("ps_server")


@dataclasses.dataclass
class RunningServer:
    server: grpc.Server
    port: int
    core: ParameterServer
    health: health.HealthServicer
    config: ServerConfig
    _stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    _ticker: threading.Thread | None = None

    def start(self) -> "RunningServer":
        self.server.start()
        self._ticker = threading.Thread(target=self._tick_leases, name="ps-leases", daemon=True)
        self._ticker.start()
        for service in ("", wire.SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self

    def _tick_leases(self) -> None:
        """Declare silent workers dead a few times per lease timeout (and apply the policy)."""
        period = min(1.0, self.config.lease_timeout / 4)
        while not self._stopping.wait(period):
            try:
                self.core.tick()
            except Exception:  # never let the lease checker die silently
                log.exception("lease check failed")

    def stop(self, grace: float | None = 2.0) -> None:
        self._stopping.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self._ticker is not None:
            self._ticker.join(timeout=5.0)

    @property
    def address(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"


def build_server(config: ServerConfig) -> RunningServer:
    config.validate()
    core = ParameterServer(
        config.mode,
        config.num_workers,
        config.barrier_timeout,
        lease_timeout=config.lease_timeout,
        dead_worker_policy=config.dead_worker_policy,
        replacement_timeout=config.replacement_timeout,
        replicas_to_aggregate=config.replicas_to_aggregate,
        allow_nonfinite=config.allow_nonfinite,
    )
    token = security.load_token(config.auth_token_file, os.environ)
    credentials = security.server_credentials(config)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.pool_threads, thread_name_prefix="ps-rpc"),
        options=wire.server_options(),
        interceptors=[security.TokenAuthInterceptor(token)] if token else None,
    )
    pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(core), server)
    health_servicer = health.HealthServicer()
    for service in ("", wire.SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host = config.host if ":" not in config.host or config.host.startswith("[") else f"[{config.host}]"
    try:
        if credentials is None:
            port = server.add_insecure_port(f"{host}:{config.port}")
        else:
            port = server.add_secure_port(f"{host}:{config.port}", credentials)
    except RuntimeError as e:
        raise ConfigError(f"cannot bind {config.host}:{config.port}: {e}") from None
    if port == 0:
        raise ConfigError(f"cannot bind {config.host}:{config.port} (in use, or not an address of this host)")
    log.info("security: TLS %s, client certificates %s, bearer token %s",
             "on" if credentials is not None else "off", "required" if config.tls_client_ca_file else "not required",
             "required" if token else "off")  # never the token itself
    if token and credentials is None:
        log.warning("the bearer token is checked without TLS, in clear text: anyone who can see "
                    "the traffic can read it (add --tls-cert-file/--tls-key-file except on loopback)")
    return RunningServer(server, port, core, health_servicer, config)


def serve(config: ServerConfig) -> int:
    running = build_server(config).start()
    log.info(
        "serving tfps on %s:%d mode=%s workers=%d barrier_timeout=%gs threads=%d max_message=%d MiB pid=%d",
        config.host, running.port, config.mode, config.num_workers, config.barrier_timeout,
        config.pool_threads, wire.MAX_MESSAGE_BYTES // 2**20, os.getpid(),
    )
    if config.port_file:
        tmp = config.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{running.port}\n")
        os.replace(tmp, config.port_file)  # readers never see a half-written file
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    running.stop(grace=2.0)
    status = running.core.status()
    log.info("stopped at version %d after %d pushes", status.version, status.pushes_applied)
    return 0
