"""Configuration of one ``ps-worker`` process.

    config = WorkerConfig.from_args(sys.argv[1:])   # flags, then TFPS_* env, then TF_CONFIG

Every flag ``--global-batch-size`` has the environment fallback
``TFPS_GLOBAL_BATCH_SIZE``; a flag on the command line wins. The fields that mean
something else to the server have variables of their own (``TFPS_WORKER_SHM``,
``TFPS_WORKER_TLS_CERT_FILE``, ``TFPS_WORKER_TLS_KEY_FILE``, ``TFPS_WORKER_METRICS_PORT``);
``TF_CONFIG`` and ``TFPS_CLUSTER=slurm`` give the servers, index and worker count unless
flags say otherwise (``ps_common.settings``; all of it: docs/running.md). ``--worker-index
auto`` lets the server assign the index; ``--ps`` may list several shards
(``worker.sharded_client``); the experiment knobs live in ``worker.knobs``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from ps_common import defaults as d
from ps_common.names import OPTIMIZER_DEFAULTS, OPTIMIZERS, optimizer_fields
from ps_common.settings import ConfigError, FromFlags, check_shared_fields, setting
from protos.stream import WIRE_DTYPES
from protos.wire import check_max_message_mb, max_message_bytes
from worker.data import DATASETS
from worker.model import MODELS
from worker.observe import PROGRESS_MODES
from worker.task import SHARDINGS, is_function_spec

AUTO_INDEX = -1  # --worker-index auto: the server assigns one at registration
# (field, floor, note): "--field must be >= floor", checked before the rest; NaN and infinity never pass.
FLOORS = (("num_workers", 1, ""), ("train_examples", 0, " (0: all)"), ("steps", 0, ""), ("log_every", 1, ""),
          ("eval_every", 0, ""), ("slowdown", 1, ""), ("bandwidth_mbps", 0, ""), ("added_latency_ms", 0, ""),
          ("pause_at_step", 0, ""), ("pause_for", 0, ""), ("learning_rate", 0, " (0: the optimizer's default)"),
          ("global_clipnorm", 0, " (0: off)"), ("heartbeat_interval", 0, " (0: from the server's lease)"))


def _index(raw: str) -> int:
    if raw.strip().lower() == "auto":
        return AUTO_INDEX
    try:
        return int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or auto, got {raw!r}") from None


@dataclasses.dataclass(frozen=True)
class WorkerConfig(FromFlags):  # from_args, from_namespace
    ROLE = "worker"
    ps: str = d.PS_ADDRESS
    worker_index: int = setting(0, parse=_index)  # TFPS_WORKER_INDEX=auto too
    num_workers: int = 1
    dataset: str = "digits"
    model: str = "cnn"
    train_examples: int = 0  # built-in data: train on this many (a fixed stratified subset); 0: all
    epochs: int = d.EPOCHS
    steps: int = 0  # 0: epochs * steps per epoch
    global_batch_size: int = d.GLOBAL_BATCH_SIZE
    optimizer: str = "adam"
    learning_rate: float = 0.0  # 0: the optimizer's Keras default
    momentum: float = 0.0
    nesterov: bool = False
    global_clipnorm: float = 0.0  # 0: off; else Keras' clip_by_global_norm over every gradient of an update
    seed: int = 0
    log_every: int = d.LOG_EVERY
    result_json: str = ""
    save_weights: str = ""
    save_model: str = ""  # chief: the trained model as a Keras file (.keras or .h5)
    initial_weights: str = ""  # .npz of w0, w1, ... in trainable_variables order
    history_json: str = ""
    snapshot_steps: str = ""  # e.g. "1,20": chief saves the pulled parameters after these steps
    snapshot_dir: str = ""
    heartbeat_interval: float = 0.0  # 0: the server's lease timeout / d.HEARTBEATS_PER_LEASE
    reconnect_timeout: float = d.RECONNECT_TIMEOUT  # how long to keep retrying a lost server before giving up
    # Security (see ps-server): server CA, optional client certificate, token from file or TFPS_AUTH_TOKEN.
    tls_ca_file: str = ""
    tls_cert_file: str = setting("", env="TFPS_WORKER_TLS_CERT_FILE", old_env="TFPS_TLS_CERT_FILE")
    tls_key_file: str = setting("", env="TFPS_WORKER_TLS_KEY_FILE", old_env="TFPS_TLS_KEY_FILE")
    tls_server_name: str = ""  # override the name checked against the server certificate
    auth_token_file: str = ""
    connect_timeout: float = d.CONNECT_TIMEOUT
    init_timeout: float = d.INIT_TIMEOUT
    final_wait: float = d.FINAL_WAIT
    deterministic: bool = True
    intra_op_threads: int = 0
    log_level: str = "INFO"
    grad_wire_dtype: str = "float32"  # float16/bfloat16 halve the pushed bytes (protos.stream)
    shm: bool = setting(False, env="TFPS_WORKER_SHM", old_env="TFPS_SHM")
    overlap: bool = True  # sync: PushPull, the round's new values back while the push still sends
    overlap_block_kib: int = 0  # slow links: every sync push a PushPull, in blocks of this many KiB
    elastic: bool = False  # the server deals the data (worker.elastic)
    max_message_mb: float = d.MAX_MESSAGE_MB  # the largest message either way (protos.wire); as the server's
    # Experiment knobs (worker.knobs): a straggler, a slow link, a stall. The defaults do nothing.
    slowdown: float = 1.0  # compute F times slower: sleep (F-1) * the step's compute time
    bandwidth_mbps: float = 0.0  # each push sleeps its bytes / (X * 1e6 / 8) first; 0: unlimited
    added_latency_ms: float = 0.0  # each pull and push sleeps this long first
    pause_at_step: int = 0  # before this step (from 0) sleep --pause-for seconds, once; 0: never
    pause_for: float = 0.0
    eval_every: int = 0  # chief: test accuracy of the pulled parameters every K steps, into the history; 0: off
    dataset_sharding: str = "batch"  # your tf.data: "batch" splits every global batch, "none": already this worker's
    # Seeing the training (worker.observe): progress bar or lines, TensorBoard, Prometheus.
    progress: str = "auto"  # auto (a bar on a terminal, lines otherwise), bar, lines, off
    logdir: str = ""  # TensorBoard summaries under logdir/worker<i>; "": none
    metrics_port: int = setting(0, env="TFPS_WORKER_METRICS_PORT", old_env="TFPS_METRICS_PORT")  # 0: off
    metrics_host: str = d.HOST

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    @property
    def max_message_bytes(self) -> int:
        return max_message_bytes(self.max_message_mb)

    @property
    def snapshot_step_list(self) -> list[int]:
        return [int(s) for s in self.snapshot_steps.split(",") if s.strip()]

    def optimizer_spec(self) -> dict:
        """The optimizer as every field of the wire's OptimizerConfig (``optimizer_fields``):
        Keras' defaults of ``--optimizer`` but the learning rate, momentum and nesterov given
        (the last two count only for the optimizers that take them: sgd, rmsprop), and
        ``--global-clipnorm``."""
        takes = OPTIMIZER_DEFAULTS.get(self.optimizer, {})
        given = {k: getattr(self, k) for k in ("momentum", "nesterov") if k in takes}
        return optimizer_fields(self.optimizer, learning_rate=self.learning_rate or takes["learning_rate"],
                                global_clipnorm=self.global_clipnorm, **given)

    @property
    def ps_addresses(self) -> list[str]:
        """The server shards: ``--ps HOST:PORT`` is one, ``HOST:PORT,HOST:PORT`` several."""
        return [a.strip() for a in self.ps.split(",")] if "," in self.ps else [self.ps]

    def validate(self) -> "WorkerConfig":
        addresses = self.ps_addresses  # one unless --ps has a comma
        for i, a in enumerate(addresses):
            host, sep, port = a.rpartition(":")
            if not (sep and host and port.isdigit()):
                raise ConfigError(f"--ps must be HOST:PORT, got {self.ps!r}" if len(addresses) == 1 else
                                  f"--ps must be HOST:PORT or a comma-separated list of them, got {self.ps!r} "
                                  f"(entry {i + 1} is {a!r})")
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        if twice:
            raise ConfigError(f"--ps lists {', '.join(twice)} more than once, got {self.ps!r}")
        low, high = d.MIN_OVERLAP_BLOCK_BYTES >> 10, d.MAX_OVERLAP_BLOCK_BYTES >> 10
        if self.overlap_block_kib and not low <= self.overlap_block_kib <= high:
            raise ConfigError(f"--overlap-block-kib must be 0 (off) or {low} to {high}, got {self.overlap_block_kib}")
        for name, floor, note in FLOORS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= floor):
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {floor}{note}, got {value:g}")
        if self.worker_index != AUTO_INDEX and not 0 <= self.worker_index < self.num_workers:
            raise ConfigError(f"--worker-index must be in 0..{self.num_workers - 1} or auto, got {self.worker_index}")
        for flag, value, builtin in (("dataset", self.dataset, DATASETS), ("model", self.model, MODELS)):
            if value not in builtin and not is_function_spec(value):
                raise ConfigError(f"--{flag} must be one of {', '.join(builtin)} or module:function, got {value!r}")
        if is_function_spec(self.model) != is_function_spec(self.dataset):
            raise ConfigError("--model module:function goes with --dataset module:function (the built-in models fit "
                              "only the built-in datasets, and your model needs your data)")
        if self.train_examples and is_function_spec(self.dataset):
            raise ConfigError("--train-examples subsets the built-in datasets; --dataset module:function makes "
                              "its own data")
        for flag, value, choices in (("dataset-sharding", self.dataset_sharding, SHARDINGS),
                                     ("progress", self.progress, PROGRESS_MODES), ("optimizer", self.optimizer, OPTIMIZERS)):
            if value not in choices:
                raise ConfigError(f"--{flag} must be one of {', '.join(choices)}, got {value!r}")
        if self.elastic and self.dataset_sharding != "batch":
            raise ConfigError(f"--dataset-sharding {self.dataset_sharding} with --elastic: the server deals the "
                              "examples, so every worker reads the whole dataset (its function gets worker 0 of 1)")
        check_shared_fields(self)
        if self.epochs < 1 and self.steps < 1:
            raise ConfigError("give --epochs >= 1 or --steps >= 1")
        if self.global_batch_size < self.num_workers:
            raise ConfigError(f"--global-batch-size {self.global_batch_size} is smaller than --num-workers "
                              f"{self.num_workers}: some workers would get no examples")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        for name in ("connect_timeout", "init_timeout", "final_wait", "reconnect_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds")
        if self.tls_cert_file and not self.tls_ca_file:
            raise ConfigError("a client certificate (--tls-cert-file) needs --tls-ca-file")
        if self.save_model and not self.save_model.endswith((".keras", ".h5")):
            raise ConfigError(f"--save-model must end in .keras (or .h5), got {self.save_model!r}")
        if self.snapshot_steps and not self.snapshot_dir:
            raise ConfigError("--snapshot-steps needs --snapshot-dir")
        try:
            steps = self.snapshot_step_list
        except ValueError:
            raise ConfigError(f"--snapshot-steps must be comma-separated step numbers, got {self.snapshot_steps!r}") from None
        if any(s < 1 for s in steps):
            raise ConfigError(f"--snapshot-steps counts steps from 1, got {self.snapshot_steps!r}")
        if self.pause_for > 0 and self.pause_at_step == 0:
            raise ConfigError("--pause-for needs --pause-at-step K >= 1 (the step to pause before, from 0)")
        if self.pause_at_step > 0 and self.pause_for == 0:
            raise ConfigError("--pause-at-step needs --pause-for S > 0 (seconds)")
        check_max_message_mb(self.max_message_mb)
        return self

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(
            prog="ps-worker",
            description="tfps worker: pulls parameters, computes gradients with tf.GradientTape on its shard "
            "of each global batch, pushes them. Every flag falls back to TFPS_<FLAG> in the environment.",
        )
        add_training_flags(p)
        p.add_argument("--ps", help=f"parameter server HOST:PORT (default {d.PS_ADDRESS}), or several "
                       "server shards as HOST:PORT,HOST:PORT,... (every worker lists the same shards)")
        p.add_argument("--worker-index", type=_index, help="this worker's index, 0 is the chief (default 0); "
                       "auto: the server assigns the lowest free one")
        p.add_argument("--num-workers", type=int, help="how many workers train (default 1)")
        p.add_argument("--result-json", help="chief: write the final metrics here")
        p.add_argument("--save-weights", help="chief: save the final parameters here (.npz)")
        p.add_argument("--save-model", help="chief: save the trained model here as a Keras file (.keras), "
                       "which keras.models.load_model opens")
        p.add_argument("--initial-weights", help="start from these weights (.npz of w0, w1, ... in model order) "
                       "instead of the seeded initialization (chief)")
        p.add_argument("--history-json", help="write this worker's per-step loss, batch size, version, staleness here")
        p.add_argument("--snapshot-steps", help="chief: after these steps (from 1, comma-separated) save the "
                       "pulled parameters to --snapshot-dir/step<N>.npz")
        p.add_argument("--snapshot-dir", help="where --snapshot-steps writes")
        p.add_argument("--print-config", action="store_true", default=None,
                       help="print the resolved configuration (flags, environment, TF_CONFIG) as JSON and exit")
        return p


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """Flags that describe the training; ps-launch forwards them to every worker."""
    p.add_argument("--dataset", help="digits (default, offline), digits-large (digits' training set augmented "
                   "tenfold: shifted and noised copies), mnist, synthetic, or module:function returning "
                   "a tf.data.Dataset of (features, labels) batches, or a (train, eval) pair (worker.task)")
    p.add_argument("--model", help=f"{', '.join(MODELS)} (default cnn), or module:function returning a Keras model "
                   "compiled with its loss and metrics (goes with --dataset module:function)")
    p.add_argument("--train-examples", type=int, help="built-in data: train on N examples of the training set, "
                   "a stratified choice that is the same for every --seed (the test set unchanged; an epoch "
                   "is N examples); default 0: all")
    p.add_argument("--dataset-sharding", choices=SHARDINGS,
                   help="with --dataset module:function: batch (default) splits every global batch by worker "
                        "index; none: the function made this worker's own batches (it takes a context argument)")
    p.add_argument("--epochs", type=int, help=f"passes over the training data (default {d.EPOCHS})")
    p.add_argument("--steps", type=int, help="stop after this many global steps (default: all epochs)")
    p.add_argument("--global-batch-size", type=int,
                   help=f"examples per step over all workers (default {d.GLOBAL_BATCH_SIZE})")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="the Keras optimizer the server applies: "
                   f"{', '.join(OPTIMIZERS)} (default adam); a Keras program's own: tfps.keras")
    p.add_argument("--learning-rate", type=float, help="default: the optimizer's Keras default ("
                   f"{OPTIMIZER_DEFAULTS['adam']['learning_rate']:g} for adam, "
                   f"{OPTIMIZER_DEFAULTS['sgd']['learning_rate']:g} for sgd)")
    p.add_argument("--momentum", type=float, help="sgd momentum (default 0)")
    p.add_argument("--nesterov", action=argparse.BooleanOptionalAction, help="sgd Nesterov momentum")
    p.add_argument("--global-clipnorm", type=float, help="clip every update's gradients by their global norm, as "
                   "Keras' global_clipnorm (over several server shards too; default 0: off)")
    p.add_argument("--seed", type=int, help="seed of the initial weights and the data order (default 0)")
    p.add_argument("--log-every", type=int, help=f"progress line every this many steps (default {d.LOG_EVERY})")
    p.add_argument("--eval-every", type=int, help="chief: every K steps evaluate the pulled parameters on the "
                   "test set, recorded in --history-json (default 0: off)")
    p.add_argument("--connect-timeout", type=float,
                   help=f"seconds to wait for the server (default {d.CONNECT_TIMEOUT:g})")
    p.add_argument("--init-timeout", type=float,
                   help=f"seconds to wait for the chief's initialization (default {d.INIT_TIMEOUT:g})")
    p.add_argument("--final-wait", type=float,
                   help=f"async and ssp chief: seconds to wait for the others to finish (default {d.FINAL_WAIT:g})")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                   help="oneDNN off and op determinism on, for bitwise reproducible gradients (default on)")
    p.add_argument("--intra-op-threads", type=int, help="TensorFlow intra-op threads (default: TensorFlow's)")
    p.add_argument("--elastic", action=argparse.BooleanOptionalAction,
                   help="train on the data the server deals: elastic sync's micro-batches (ps-server "
                        "--elastic-min-workers), or async and ssp's tasks, each applied exactly once "
                        "(--epochs); the built-in data or your dataset read once, one server (default off)")
    p.add_argument("--grad-wire-dtype", choices=WIRE_DTYPES,
                   help="send float32 gradients as float16 or bfloat16 (half the bytes, some accuracy; "
                        "default float32: exact)")
    p.add_argument("--shm", action=argparse.BooleanOptionalAction,
                   help="move tensors through shared memory when the server is on this host (or shares "
                        "/dev/shm); detected at registration, falls back to gRPC streams (default off; "
                        "environment TFPS_WORKER_SHM)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction,
                   help="sync: a streamed push gets each variable's new value back as soon as the server has "
                        "it, while the rest still goes out, so the link works both ways at once (PushPull; "
                        "the same bits; default on)")
    p.add_argument("--overlap-block-kib", type=int,
                   help="sync on slow links (hosts apart, to 1 Gbit/s): every push a PushPull, its new values "
                        "back in blocks of this many KiB; 32 on 100 Mbit/s; costs the server work per block, "
                        "so off on one machine (default 0: PushPull over 1 MiB, 512 KiB blocks)")
    p.add_argument("--max-message-mb", type=float, help=f"largest message either way, in MiB; as the server's "
                   f"(default {d.MAX_MESSAGE_MB:g})")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    p.add_argument("--progress", choices=PROGRESS_MODES,
                   help="a progress bar on a terminal, plain log lines otherwise (auto, the default), or force one")
    p.add_argument("--logdir", help="write TensorBoard summaries (loss, accuracy, staleness, step time) under "
                   "DIR/worker<index>")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics (step time, examples/s, pull/push "
                   "time) on this port (default 0: off; environment TFPS_WORKER_METRICS_PORT)")
    p.add_argument("--metrics-host", help=f"address the metrics endpoint binds to (default {d.HOST})")
    p.add_argument("--heartbeat-interval", type=float,
                   help=f"seconds between heartbeats (default: lease timeout / {d.HEARTBEATS_PER_LEASE})")
    p.add_argument("--reconnect-timeout", type=float,
                   help=f"seconds to keep retrying a lost server (default {d.RECONNECT_TIMEOUT:g})")
    p.add_argument("--tls-ca-file", help="CA (PEM) that signed the server certificate; enables TLS")
    p.add_argument("--tls-cert-file", help="client certificate (PEM) for mutual TLS "
                   "(environment TFPS_WORKER_TLS_CERT_FILE)")
    p.add_argument("--tls-key-file", help="client private key (PEM) for mutual TLS "
                   "(environment TFPS_WORKER_TLS_KEY_FILE)")
    p.add_argument("--tls-server-name", help="name to check the server certificate against (default: the --ps host)")
    p.add_argument("--auth-token-file", help="file holding the bearer token (or TFPS_AUTH_TOKEN; never a flag)")
    _add_knob_flags(p)


def _add_knob_flags(p: argparse.ArgumentParser) -> None:
    """The experiment knobs (worker.knobs): training flags, which ps-launch forwards too."""
    k = p.add_argument_group("experiment knobs", "conditions to compare the modes under (each sleeps; "
                             "the history records how long)")
    k.add_argument("--slowdown", type=float, help="this worker computes F times slower: after a step's "
                   "gradients (c seconds) it sleeps (F-1)*c (default 1)")
    k.add_argument("--bandwidth-mbps", type=float, help="before each push sleep bytes/(X*1e6/8) s, the time "
                   "the gradients take at X Mbit/s (default 0: unlimited)")
    k.add_argument("--added-latency-ms", type=float, help="sleep L ms before each pull and each push (default 0)")
    k.add_argument("--pause-at-step", type=int, help="before step K (from 0) sleep --pause-for seconds, once; "
                   "heartbeats go on, so it is a straggler, not a death (default 0: never)")
    k.add_argument("--pause-for", type=float, help="seconds of the --pause-at-step pause")


def training_flags(args: argparse.Namespace) -> list[str]:
    """The training flags the user gave, as argv for every worker."""
    out: list[str] = []
    probe = argparse.ArgumentParser(add_help=False)
    add_training_flags(probe)
    for action in probe._actions:
        value = getattr(args, action.dest, None)
        if value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out

