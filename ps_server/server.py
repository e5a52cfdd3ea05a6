"""Build and run a parameter-server process.

    running = build_server(ServerConfig(port=0, mode="sync", num_workers=2))
    running.server.start(); print(running.port)     # tests bind port 0
    serve(config)                                    # ps-server: runs until SIGTERM/SIGINT

With ``checkpoint_dir`` set, ``build_server`` restores the newest valid
checkpoint there (skipping damaged ones with a warning), a thread writes one
every ``checkpoint_interval`` seconds when the version changed since the last,
and ``serve`` writes a final one on SIGTERM/SIGINT (or, with ``exit_when_done``,
once every worker finished or died) after the last call ended
(``RunningServer.stop(checkpoint=True)``). A restart therefore loses at most
the updates of one interval; workers find out from the new incarnation and say
how many steps were lost.

With ``metrics_port`` set (``ps-server --metrics-port P``), ``build_server`` also
binds a Prometheus endpoint on ``metrics_host`` (default: ``host``); ``start``
serves it and ``stop`` closes it once the final checkpoint is written
(``ps_server.metrics``). Tests ask for a free port with
``build_server(config, metrics_port=0)`` and read ``RunningServer.metrics_port``.

``build_server`` returns the started-or-not gRPC server, the port it bound and the
core, apart from ``serve()``, so tests can run a real server in-process. The
standard gRPC health service reports SERVING for "" and for the tfps service
once the server has started, and NOT_SERVING while it shuts down. gRPC server
reflection (``grpc.reflection.v1alpha.ServerReflection``: grpcurl, grpc_cli) is
served unless ``reflection`` is off (``--no-reflection``); with a bearer token
it needs the token like every call but the health check (``ps_common.security``).
The first INFO line ``build_server`` logs says what the server is:
``sync, 2 workers, listening on 127.0.0.1:50051 (TLS off, token off, reflection on)``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protos import wire
from ps_server import peers
from ps_server.aio import LoopServer
from ps_server.config import ConfigError, ServerConfig
from ps_common import security
from ps_common.procs import write_atomically
from ps_server.core import checkpoint
from ps_server.core.errors import ConfigMismatch, SpecConflict
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.settings import Settings
from ps_server.metrics import Metrics, MetricsEndpoint
from ps_server.service import ParameterServerServicer, add_to_server

log = logging.getLogger("ps_server")


@dataclasses.dataclass
class RunningServer:
    server: LoopServer
    port: int
    core: ParameterServer
    health: health.aio.HealthServicer
    config: ServerConfig
    _stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    _ticker: threading.Thread | None = None
    _checkpointer: threading.Thread | None = None
    _checkpoint_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)  # one writer at a time
    last_checkpoint_version: int | None = None  # written or restored; None: none yet
    servicer: ParameterServerServicer | None = None
    metrics: MetricsEndpoint | None = None  # bound, served from start(); None: no metrics

    @property
    def metrics_port(self) -> int:
        """The port the metrics endpoint bound; 0 without one."""
        return self.metrics.port if self.metrics is not None else 0

    def start(self) -> "RunningServer":
        self.server.start()
        if self.metrics is not None:
            self.metrics.start()
        self._ticker = threading.Thread(target=self._tick_leases, name="ps-leases", daemon=True)
        self._ticker.start()
        if self.config.checkpoint_dir:
            self._checkpointer = threading.Thread(target=self._checkpoint_periodically, name="ps-checkpoints",
                                                  daemon=True)
            self._checkpointer.start()
        for service in ("", wire.SERVICE_NAME):
            self.server.call(self.health.set(service, health_pb2.HealthCheckResponse.SERVING))
        return self

    def _tick_leases(self) -> None:
        """Declare silent workers dead a few times per lease timeout (and apply the policy)."""
        period = min(1.0, self.config.lease_timeout / 4)
        while not self._stopping.wait(period):
            try:
                self.core.tick()
            except Exception:  # never let the lease checker die silently
                log.exception("lease check failed")

    def _checkpoint_periodically(self) -> None:
        # Snapshots start every interval on a fixed schedule (not interval after the last
        # write ended), so at most one interval of updates is ever missing from disk.
        interval = self.config.checkpoint_interval
        due = time.monotonic() + interval
        while not self._stopping.wait(max(0.0, due - time.monotonic())):
            due = max(due + interval, time.monotonic())
            try:
                self.write_checkpoint()
            except Exception:  # a full disk must not stop training; the next interval tries again
                log.exception("writing a checkpoint to %s failed", self.config.checkpoint_dir)

    def write_checkpoint(self, force: bool = False, why: str = "periodic") -> str | None:
        """Write a checkpoint unless nothing is initialized or (without ``force``) the version
        has not changed since the last one; returns its path, or None if none was written."""
        with self._checkpoint_lock:
            state = self.core.checkpoint_state()
            if state is None:
                return None
            try:  # the row-wise tables' snapshots end with the write, or without it (core.store)
                if not force and state.version == self.last_checkpoint_version:
                    return None
                t0 = time.perf_counter()
                path = checkpoint.write_checkpoint(self.config.checkpoint_dir, state, self.config.checkpoint_keep)
            finally:
                state.release()
            self.last_checkpoint_version = state.version
            self.core.checkpointed(state.version)
            log.info("%s checkpoint: version %d%s written to %s in %.0f ms", why, state.version,
                     _round(state), path, (time.perf_counter() - t0) * 1e3)
            return path

    def stop(self, grace: float | None = 2.0, checkpoint: bool = False) -> None:
        """Stop serving; with ``checkpoint`` (and a checkpoint_dir) write a final checkpoint
        once every call has ended, so it holds every update the server acknowledged."""
        self._stopping.set()
        if not self.server.loop.is_closed():
            self.server.call(self.health.enter_graceful_shutdown())
        self.server.stop(grace).wait()
        self.server.close()
        if self._ticker is not None:
            self._ticker.join(timeout=5.0)
        if self._checkpointer is not None:
            self._checkpointer.join(timeout=30.0)
        try:
            if checkpoint and self.config.checkpoint_dir:
                if self.write_checkpoint(force=True, why="final") is None:
                    log.info("final checkpoint: nothing to write (no variables initialized)")
        finally:  # scrapes see the server until its very end
            if self.metrics is not None:
                self.metrics.stop()

    @property
    def address(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"


def build_server(config: ServerConfig, metrics_port: int | None = None) -> RunningServer:
    """Everything bound, nothing served yet (``RunningServer.start``). ``metrics_port``
    overrides ``config.metrics_port``, and there 0 binds a free port (tests); None keeps
    the configuration's, where 0 means no metrics endpoint.

    Its first INFO line says what this server is (``describe``); the checkpoint it
    restored, its metrics endpoint and shared memory follow."""
    config.validate()
    core = ParameterServer(**dataclasses.asdict(Settings.of(config)))
    token = security.load_token(config.auth_token_file, os.environ)
    lines = peers.Peers(config, token)
    core.clip_peer = lines.clip_norm  # global_clipnorm over shards: shard 0's norms
    core.round_peer = lines.commit_round  # elastic sync over shards: shard 0 commits rounds on the others
    credentials = security.server_credentials(config)
    server = LoopServer(
        options=wire.server_options(config.max_message_bytes, config.num_workers),
        # The token guards every call but the health check, reflection included.
        interceptors=[security.AsyncTokenAuthInterceptor(token)] if token else None,
        pool_threads=config.pool_threads,
    )
    servicer = ParameterServerServicer(core, allow_shm=config.shm)
    servicer.pool, servicer.control = server.pool, server.control
    serve_metrics = bool(config.metrics_port) if metrics_port is None else True
    metrics = Metrics(core) if serve_metrics else None
    add_to_server(servicer, server, traffic=metrics)
    health_servicer = server.call(_health_servicer())
    server.run(lambda: health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server.server))
    if config.reflection:
        server.run(lambda: enable_reflection(server.server))
    host = config.host if ":" not in config.host or config.host.startswith("[") else f"[{config.host}]"
    try:
        if credentials is None:
            port = server.add_insecure_port(f"{host}:{config.port}")
        else:
            port = server.add_secure_port(f"{host}:{config.port}", credentials)
    except RuntimeError as e:
        server.close()
        raise ConfigError(f"cannot bind {config.host}:{config.port}: {e}") from None
    if port == 0:
        server.close()
        raise ConfigError(f"cannot bind {config.host}:{config.port} (in use, or not an address of this host)")
    log.info("%s", describe(config, port, tls=credentials is not None, token=token is not None))
    try:
        restored = _restore(core, config.checkpoint_dir) if config.checkpoint_dir else None
        endpoint = None
        if metrics is not None:
            endpoint = metrics.bind(config.metrics_address, config.metrics_port if metrics_port is None
                                    else metrics_port)
            log.info("metrics: %s (plain HTTP, no token)", endpoint.url)
    except ConfigError:
        server.stop(None).wait()  # release the gRPC port bound above
        server.close()
        raise
    log.debug("same-host shared memory: %s", "accepted from workers that ask" if config.shm else "refused (--no-shm)")
    if token and credentials is None:
        log.warning("the bearer token is checked without TLS, in clear text: anyone who can see "
                    "the traffic can read it (add --tls-cert-file/--tls-key-file except on loopback)")
    return RunningServer(server, port, core, health_servicer, config, last_checkpoint_version=restored,
                         servicer=servicer, metrics=endpoint)


async def _health_servicer() -> health.aio.HealthServicer:
    """grpc_health's servicer for grpc.aio, made on the loop (its conditions belong to it)."""
    servicer = health.aio.HealthServicer()
    for service in ("", wire.SERVICE_NAME):
        await servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    return servicer


def describe(config: ServerConfig, port: int, tls: bool, token: bool) -> str:
    """The server in one line: mode, workers, address, and what guards it (never the token itself).

    sync, 2 workers, listening on 127.0.0.1:50051 (TLS off, token off, reflection on)
    """
    tls_text = ("mutual TLS" if config.tls_client_ca_file else "TLS on") if tls else "TLS off"
    workers = f"{config.num_workers} worker{'s' if config.num_workers != 1 else ''}"
    apply = f" ({config.async_apply} apply)" if config.async_apply != "locked" else ""
    return (f"{config.mode}{apply}, {workers}, listening on {config.host}:{port} ({tls_text}, "
            f"token {'on' if token else 'off'}, reflection {'on' if config.reflection else 'off'})")


def enable_reflection(server: grpc.Server) -> None:
    """Serve gRPC reflection (``grpc.reflection.v1alpha.ServerReflection``) for the tfps
    service, the health service and reflection itself, so grpcurl and grpc_cli can list
    them and describe every message without the .proto files."""
    from grpc_reflection.v1alpha import reflection

    names = (wire.SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)


def _round(state: checkpoint.ServerState) -> str:
    return f" (round {state.round})" if state.mode == "sync" else ""


def _restore(core: ParameterServer, directory: str) -> int | None:
    """Restore the newest valid checkpoint in ``directory`` into ``core``; its version, or None."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--checkpoint-dir {directory}: {e}") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"--checkpoint-dir {directory} is not writable")
    removed = checkpoint.remove_temporary_files(directory)
    if removed:
        log.warning("removed %d unfinished checkpoint file(s) in %s (a write was interrupted): %s",
                    len(removed), directory, ", ".join(removed))
    found = checkpoint.latest_valid(directory)
    if found is None:
        log.info("no checkpoint in %s: starting empty", directory)
        return None
    state, path = found
    try:
        core.restore(state)
    except (ConfigMismatch, SpecConflict) as e:
        raise ConfigError(f"cannot restore {path}: {e}") from None
    info = checkpoint.describe(state, path)
    log.info("restored version %d%s from %s, written %s by incarnation %s; %d worker(s) known, "
             "%d variables, %d parameters", state.version, _round(state), path, info["written"] or "?",
             state.incarnation or "?", len(state.members), info["variables"], info["parameters"])
    if state.data is not None:
        progress = (f"{state.data.done_task_ids.size} task(s) done" if state.data.kind == "tasks" else
                    f"epoch(s) {list(state.data.epochs_complete)} complete, {sorted(state.data.epochs_seen)} "
                    f"in progress")
        log.info("restored the data plan (%s): %s", info["data_plan"], progress)
    return state.version


def serve(config: ServerConfig) -> int:
    allocator = wire.tune_allocator()  # before the first large buffer (a restored checkpoint's)
    running = build_server(config).start()
    log.debug("serving: threads=%d max_message=%d MiB barrier_timeout=%gs pid=%d", config.pool_threads,
             config.max_message_bytes // 2**20, config.barrier_timeout, os.getpid())
    log.debug(allocator)
    if config.port_file:
        write_atomically(config.port_file, f"{running.port}\n")
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(0.5):
        if config.exit_when_done:
            done, left, dead = running.core.finished()
            if done:
                log.info("every worker is done (finished: %s, declared dead: %s): exiting (--exit-when-done)",
                         left or "none", dead or "none")
                break
    try:
        running.stop(grace=2.0, checkpoint=True)
    except Exception:
        log.exception("final checkpoint to %s failed", config.checkpoint_dir)
        return 1
    status = running.core.status()
    log.info("stopped at version %d after %d pushes", status.version, status.pushes_applied)
    return 0
