"""Configuration of one ``ps-server`` process.

    config = ServerConfig.from_args(sys.argv[1:])   # flags, then TFPS_* env, then TF_CONFIG
    config.validate()

Every flag ``--num-workers`` has the environment fallback ``TFPS_NUM_WORKERS``;
a flag given on the command line wins. With ``TF_CONFIG`` of task type ``ps``,
the port and worker count come from the cluster description unless set.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from ps_server.core.parameter_server import MODES
from ps_server.settings import ConfigError, cast, resolve
from ps_server.tf_config import parse_tf_config


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    mode: str = "sync"
    num_workers: int = 1
    barrier_timeout: float = 60.0
    threads: int = 0  # 0: sized from num_workers, see pool_threads
    port_file: str = ""
    log_level: str = "INFO"

    @property
    def pool_threads(self) -> int:
        # Up to num_workers handlers can sit in a barrier; keep room for pulls,
        # health checks and status calls beside them.
        return self.threads or max(16, 2 * self.num_workers + 8)

    def validate(self) -> "ServerConfig":
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if not self.barrier_timeout > 0:
            raise ConfigError(f"--barrier-timeout must be > 0 seconds, got {self.barrier_timeout}")
        if self.threads and self.threads <= self.num_workers:
            raise ConfigError(
                f"--threads {self.threads} would let {self.num_workers} workers blocked in a barrier "
                f"starve every other call; use more than {self.num_workers}"
            )
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        return self

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="ps-server",
            description="tfps parameter server: stores variables, aggregates gradients (sync) "
            "or applies them on arrival (async). Every flag falls back to TFPS_<FLAG> in the environment.",
        )
        p.add_argument("--host", help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
        p.add_argument("--port", type=int, help="port to bind; 0 picks a free one (default 50051)")
        p.add_argument("--mode", choices=MODES, help="sync (barrier per step) or async (apply on arrival)")
        p.add_argument("--num-workers", type=int, help="how many workers train (default 1)")
        p.add_argument("--barrier-timeout", type=float, help="seconds a sync round may wait for its last push (default 60)")
        p.add_argument("--threads", type=int, help="gRPC handler threads (default max(16, 2N+8))")
        p.add_argument("--port-file", help="write the bound port to this file once serving")
        p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
        return p

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: dict | None = None) -> "ServerConfig":
        environ = os.environ if environ is None else environ
        args = cls.parser().parse_args(argv)
        values: dict = {}
        spec = parse_tf_config(environ.get("TF_CONFIG"))
        if spec is not None and spec.task_type == "ps" and spec.ps_addresses:
            if spec.task_index >= len(spec.ps_addresses):
                raise ConfigError(f"TF_CONFIG task.index {spec.task_index} has no entry in cluster.ps")
            _, _, port = spec.ps_addresses[spec.task_index].rpartition(":")
            values["port"] = cast("port", port, int)
            values["host"] = "0.0.0.0"  # the address other tasks use names this host
            if spec.num_workers:
                values["num_workers"] = spec.num_workers
        return resolve(cls, args, environ, values).validate()

