"""Configuration of one ``ps-server`` process.

    config = ServerConfig.from_args(sys.argv[1:])   # flags, then TFPS_* env, then TF_CONFIG; validated

Every flag ``--num-workers`` has the environment fallback ``TFPS_NUM_WORKERS``;
a flag given on the command line wins. Four fields mean something else to a
worker and so have variables of their own: ``TFPS_SERVER_SHM``,
``TFPS_SERVER_TLS_CERT_FILE``, ``TFPS_SERVER_TLS_KEY_FILE`` and
``TFPS_SERVER_METRICS_PORT`` (the old ``TFPS_SHM``, ``TFPS_TLS_CERT_FILE``,
``TFPS_TLS_KEY_FILE`` and ``TFPS_METRICS_PORT`` still work, with a deprecation
warning). With ``TF_CONFIG`` of task type ``ps`` (index i), the port is that of
``cluster.ps[i]`` and the worker count that of the chief and worker tasks,
unless set. With ``TFPS_CLUSTER=slurm`` the Slurm environment of an ``srun`` task
stands in for ``TF_CONFIG`` (``ps_common.slurm``, docs/slurm.md): a task among the
first ``TFPS_SLURM_NUM_PS`` gets its port (port base + its position on its node),
all interfaces and the worker count. ``ps_common.settings`` does all of this mapping.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from ps_common import defaults as d
from ps_common.names import ASYNC_APPLIES, DEAD_WORKER_POLICIES, MODES, STALE_POLICIES
from ps_server.core.optim.sparse import SPARSE_RULES, SPARSE_UPDATES

from protos.wire import check_max_message_mb, max_message_bytes
from ps_common.settings import ConfigError, FromFlags, check_shared_fields, setting


@dataclasses.dataclass(frozen=True)
class ServerConfig(FromFlags):  # from_args, from_namespace
    ROLE = "ps"
    host: str = d.HOST
    port: int = d.PORT
    mode: str = "sync"
    num_workers: int = 1
    barrier_timeout: float = d.BARRIER_TIMEOUT
    threads: int = 0  # 0: the default, see pool_threads
    port_file: str = ""
    log_level: str = "INFO"
    # Liveness: a worker silent for lease_timeout seconds is dead.
    lease_timeout: float = d.LEASE_TIMEOUT
    dead_worker_policy: str = "abort"  # sync: abort | wait | shrink
    replacement_timeout: float = d.REPLACEMENT_TIMEOUT  # policy "wait": how long a dead worker's index may stay empty
    replicas_to_aggregate: int = 0  # sync backup workers: finish a round with the first K pushes (0: all)
    allow_nonfinite: bool = False
    # Bounded staleness (mode ssp) and stale gradients (async, ssp).
    staleness: int = d.STALENESS  # ssp: S, how many steps a worker may run ahead of the slowest
    stale_gradient_policy: str = "none"  # none | drop | scale
    max_staleness: int = d.MAX_STALENESS  # policy drop: drop pushes staler than this many versions
    # Async and ssp: locked (a lock per variable, copy-on-write, no lost update) or hogwild
    # (in place, no lock, lost updates possible; ps_server/core/modes/async_mode.py).
    async_apply: str = "locked"
    # Sparse gradients (ps_server/core/optim/sparse.py): step only the touched rows where that is exact
    # (exact: SGD, Adagrad; the others densely), always (lazy: TF Addons' LazyAdam), or never (dense).
    sparse_updates: str = "exact"
    # A row repeated in one sparse gradient: its occurrences summed first, the dense step (sum),
    # or each applied as Keras 3 applies a tf.IndexedSlices, one-process model.fit's step (keras).
    # "": the initializing optimizer's ask (tfps.keras asks keras), else sum.
    sparse_rule: str = ""
    # Elastic sync (ps_server/core/modes/elastic_mode.py): > 0, rounds start with this many workers
    # and take up to --num-workers, joining and leaving at any time; each global batch is
    # cut into micro_batches (0: --num-workers) that the server deals out to ps-worker
    # --elastic (the built-in data or your dataset read once, one server; docs/elastic.md).
    elastic_min_workers: int = 0
    micro_batches: int = 0
    # Same-host fast path (protos/shm.py): workers on this machine that ask for it may pass
    # tensors through their shared-memory segments. --no-shm refuses it: they stream.
    shm: bool = setting(True, env="TFPS_SERVER_SHM", old_env="TFPS_SHM")
    # Stop by itself (final checkpoint, exit 0) once every worker finished or died:
    # a compose run then ends when its training does.
    exit_when_done: bool = False
    # Checkpoints.
    checkpoint_dir: str = ""
    checkpoint_interval: float = d.CHECKPOINT_INTERVAL
    checkpoint_keep: int = d.CHECKPOINT_KEEP
    # Security: paths to PEM files. The bearer token never comes from a flag (it would
    # show in `ps`): TFPS_AUTH_TOKEN in the environment, or --auth-token-file.
    tls_cert_file: str = setting("", env="TFPS_SERVER_TLS_CERT_FILE", old_env="TFPS_TLS_CERT_FILE")
    tls_key_file: str = setting("", env="TFPS_SERVER_TLS_KEY_FILE", old_env="TFPS_TLS_KEY_FILE")
    tls_client_ca_file: str = ""  # set: mutual TLS, clients must present a certificate signed by this CA
    auth_token_file: str = ""
    # Prometheus metrics (ps_server/metrics.py): plain HTTP GET /metrics on this port; 0: off.
    metrics_port: int = setting(0, env="TFPS_SERVER_METRICS_PORT", old_env="TFPS_METRICS_PORT")
    metrics_host: str = ""  # "": the address the gRPC server binds (--host)
    # gRPC server reflection (grpcurl, grpc_cli, Postman list the services and messages),
    # behind the bearer token like every call but the health check.
    reflection: bool = True
    # The largest message either way, in MiB (protos.wire); workers must use the same.
    max_message_mb: float = d.MAX_MESSAGE_MB

    @property
    def pool_threads(self) -> int:
        # Up to num_workers handlers can sit in a barrier; keep room for pulls,
        # health checks and status calls beside them.
        # The threads that do the calls' work (ps_server.aio): a worker waiting at a barrier
        # holds none, so the pool does not grow with the workers.
        return self.threads or max(d.MIN_THREADS, d.THREADS_PER_CPU * (os.cpu_count() or 1))

    @property
    def max_message_bytes(self) -> int:
        return max_message_bytes(self.max_message_mb)

    def validate(self) -> "ServerConfig":
        if self.num_workers < 1:
            raise ConfigError(f"--num-workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if not self.barrier_timeout > 0:
            raise ConfigError(f"--barrier-timeout must be > 0 seconds, got {self.barrier_timeout}")
        if self.threads and self.threads < 2:
            raise ConfigError(f"--threads must be >= 2 (one call's work beside another's), got {self.threads}")
        if not self.lease_timeout > 0:
            raise ConfigError(f"--lease-timeout must be > 0 seconds, got {self.lease_timeout}")
        if self.dead_worker_policy not in DEAD_WORKER_POLICIES:
            raise ConfigError(f"--dead-worker-policy must be one of {', '.join(DEAD_WORKER_POLICIES)}, "
                              f"got {self.dead_worker_policy!r}")
        if not self.replacement_timeout > 0:
            raise ConfigError(f"--replacement-timeout must be > 0 seconds, got {self.replacement_timeout}")
        if not 0 <= self.replicas_to_aggregate <= self.num_workers:
            raise ConfigError(f"--replicas-to-aggregate must be in 1..{self.num_workers} (or 0 for all), "
                              f"got {self.replicas_to_aggregate}")
        if self.staleness < 0:
            raise ConfigError(f"--staleness must be >= 0, got {self.staleness}")
        if self.stale_gradient_policy not in STALE_POLICIES:
            raise ConfigError(f"--stale-gradient-policy must be one of {', '.join(STALE_POLICIES)}, "
                              f"got {self.stale_gradient_policy!r}")
        if self.async_apply not in ASYNC_APPLIES:
            raise ConfigError(f"--async-apply must be one of {', '.join(ASYNC_APPLIES)}, got {self.async_apply!r}")
        if self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if self.sparse_updates not in SPARSE_UPDATES:
            raise ConfigError(f"--sparse-updates must be one of {', '.join(SPARSE_UPDATES)}, "
                              f"got {self.sparse_updates!r}")
        conflict = d.sparse_rule_conflict(self.sparse_rule, self.async_apply)
        if conflict:
            raise ConfigError(conflict)
        if self.elastic_min_workers < 0 or self.micro_batches < 0:
            raise ConfigError("--elastic-min-workers and --micro-batches must be >= 0")
        conflict = d.server_settings_conflict(self.mode, self.num_workers, self.stale_gradient_policy,
                                              self.async_apply, self.elastic_min_workers, self.micro_batches,
                                              self.replicas_to_aggregate)
        if conflict:
            raise ConfigError(conflict)
        if not self.checkpoint_interval > 0:
            raise ConfigError(f"--checkpoint-interval must be > 0 seconds, got {self.checkpoint_interval}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"--checkpoint-keep must be >= 1, got {self.checkpoint_keep}")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("--tls-client-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file")
        check_shared_fields(self)
        if self.metrics_port and self.metrics_port == self.port:
            raise ConfigError(f"--metrics-port {self.metrics_port} is the gRPC --port; give it another")
        check_max_message_mb(self.max_message_mb)
        return self

    @property
    def metrics_address(self) -> str:
        """The host the metrics endpoint binds: --metrics-host, else --host."""
        return self.metrics_host or self.host

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="ps-server",
            description="tfps parameter server: stores variables, aggregates gradients (sync) "
            "or applies them on arrival (async, ssp). Every flag falls back to TFPS_<FLAG> in the environment.",
        )
        p.add_argument("--host", help=f"address to bind (default {d.HOST}; 0.0.0.0 for all interfaces)")
        p.add_argument("--port", type=int, help=f"port to bind; 0 picks a free one (default {d.PORT})")
        p.add_argument("--mode", choices=MODES, help="sync (barrier per step), async (apply on arrival) or ssp "
                       "(apply on arrival, nobody more than --staleness steps ahead of the slowest)")
        p.add_argument("--num-workers", type=int, help="how many workers train (default 1)")
        p.add_argument("--barrier-timeout", type=float,
                       help=f"seconds a sync round may wait for its last push (default {d.BARRIER_TIMEOUT:g})")
        p.add_argument("--threads", type=int, help="threads that do the calls' work; waiting calls hold none "
                                                   f"(default max({d.MIN_THREADS}, {d.THREADS_PER_CPU} x CPUs))")
        p.add_argument("--port-file", help="write the bound port to this file once serving")
        p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
        p.add_argument("--exit-when-done", action=argparse.BooleanOptionalAction,
                       help="once all --num-workers workers registered and each since finished or was declared "
                       "dead, write a final checkpoint and exit 0 (default: serve until SIGTERM)")
        p.add_argument("--print-config", action="store_true", default=None,
                       help="print the resolved configuration (flags, environment, TF_CONFIG) as JSON and exit")
        g = p.add_argument_group("faults")
        g.add_argument("--lease-timeout", type=float,
                       help=f"seconds without a heartbeat before a worker is dead (default {d.LEASE_TIMEOUT:g})")
        g.add_argument("--dead-worker-policy", choices=DEAD_WORKER_POLICIES,
                       help="sync: abort the round (default), wait for a replacement, or shrink to the live workers")
        g.add_argument("--replacement-timeout", type=float,
                       help=f"policy wait: seconds to wait for a replacement (default {d.REPLACEMENT_TIMEOUT:g})")
        g.add_argument("--replicas-to-aggregate", type=int,
                       help="sync backup workers: finish each round with the first K pushes (default: all)")
        g.add_argument("--allow-nonfinite", action=argparse.BooleanOptionalAction,
                       help="accept NaN/Inf gradients (default: rejected)")
        g = p.add_argument_group("staleness")
        g.add_argument("--staleness", type=int, help="ssp: how many steps a worker may run ahead of the slowest "
                       f"(default {d.STALENESS}; 0 is lockstep)")
        g.add_argument("--stale-gradient-policy", choices=STALE_POLICIES,
                       help="async/ssp: none (default), drop pushes staler than --max-staleness versions, or "
                       "scale their learning rate by 1/(1+staleness)")
        g.add_argument("--max-staleness", type=int, help=f"policy drop: the staleness above which a push is dropped "
                       f"(default {d.MAX_STALENESS})")
        g.add_argument("--async-apply", choices=ASYNC_APPLIES,
                       help="async/ssp: locked (default: a lock per variable, copy-on-write, no update lost) or "
                       "hogwild (in place under no lock: pushes race, an update may be lost, a pull may see a "
                       "variable half-updated; sgd, adam, adamw, adagrad and rmsprop)")
        g = p.add_argument_group("sparse gradients")
        g.add_argument("--elastic-min-workers", type=int,
                       help="sync: elastic rounds with ps-worker --elastic (in progress, docs/elastic.md): start with this "
                       "many workers, take up to --num-workers, joining or leaving at any time, the server dealing "
                       "each round's micro-batches (default 0: off)")
        g.add_argument("--micro-batches", type=int,
                       help="elastic sync: micro-batches per global batch (default: --num-workers)")
        g.add_argument("--sparse-updates", choices=SPARSE_UPDATES,
                       help="how an embedding's sparse gradient is applied: exact (default) steps only the touched "
                       "rows where that gives the dense step's bits (SGD without momentum, Adagrad) and the whole "
                       "table otherwise; lazy steps only the touched rows and their slots for every optimizer (TF "
                       "Addons' LazyAdam; not Keras' result); dense always steps the whole table "
                       "(environment TFPS_SPARSE_UPDATES)")
        g.add_argument("--sparse-rule", choices=SPARSE_RULES,
                       help="a row that occurs several times in one sparse gradient (an id looked up twice in a "
                       "batch): sum sums its occurrences first, the dense gradient's step (TF1, ElasticDL); "
                       "keras applies each occurrence as Keras 3 applies a tf.IndexedSlices, one-process model.fit's "
                       "step. Default: the initializing optimizer's (tfps.keras: keras), else sum "
                       "(environment TFPS_SPARSE_RULE)")
        _add_transport_flags(p)
        return p



def _add_transport_flags(p: argparse.ArgumentParser) -> None:
    """ps-server's transport, checkpoint, security and metrics flags."""
    g = p.add_argument_group("transport")
    g.add_argument("--shm", action=argparse.BooleanOptionalAction,
                   help="let workers on this host that ask for it (PSClient(shm=True)) pass tensors through "
                   "shared memory in /dev/shm (default: on; --no-shm makes them stream over gRPC; "
                   "environment TFPS_SERVER_SHM)")
    g.add_argument("--max-message-mb", type=float, help=f"largest message either way, in MiB; workers need "
                   f"the same (default {d.MAX_MESSAGE_MB:g})")
    g.add_argument("--reflection", action=argparse.BooleanOptionalAction,
                   help="gRPC server reflection, for grpcurl and grpc_cli; behind the bearer token like every "
                   "call but the health check (default: on; --no-reflection turns it off)")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", help="write checkpoints here and restore the newest valid one at start")
    g.add_argument("--checkpoint-interval", type=float,
                   help=f"seconds between checkpoints (default {d.CHECKPOINT_INTERVAL:g})")
    g.add_argument("--checkpoint-keep", type=int,
                   help=f"how many checkpoints to keep (default {d.CHECKPOINT_KEEP})")
    g = p.add_argument_group("security")
    g.add_argument("--tls-cert-file", help="server certificate (PEM); enables TLS "
                   "(environment TFPS_SERVER_TLS_CERT_FILE)")
    g.add_argument("--tls-key-file", help="server private key (PEM) (environment TFPS_SERVER_TLS_KEY_FILE)")
    g.add_argument("--tls-client-ca-file", help="CA (PEM) that signs client certificates; enables mutual TLS")
    g.add_argument("--auth-token-file", help="file holding the bearer token clients must send "
                   "(or TFPS_AUTH_TOKEN in the environment; never a flag)")
    g = p.add_argument_group("metrics")
    g.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics "
                   "(plain HTTP, no token; default 0: off; environment TFPS_SERVER_METRICS_PORT)")
    g.add_argument("--metrics-host", help="address the metrics endpoint binds (default: --host)")
