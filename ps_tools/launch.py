"""``ps-launch``: one server (or M server shards) and N workers as separate OS processes on loopback.

    ps-launch --mode sync --workers 2 --dataset digits --epochs 3 --metrics-json m.json
    ps-launch --num-ps 2 --mode sync --workers 2 --dataset digits --epochs 3
    ps-launch --mode ssp --staleness 2 --workers 3 --worker-args 2 "--slowdown 3" --dataset digits
    ps-launch --elastic 2:4 --workers 2 --scale-at 10:4 --scale-at 20:3 --dataset digits

Starts ``ps-server`` on a free loopback port (``--num-ps M``: M of them, each
with the same mode, worker count and flags, and ``--checkpoint-dir D/shard-<i>``
when a checkpoint directory is given), waits until every health check says
SERVING, then starts the workers (worker 0 is the chief) with the training
flags given here and ``--ps`` listing every server, plus, for worker I only,
the arguments of each ``--worker-args I "ARGS"`` (say an experiment knob that
makes it a straggler). Every line the children print is shown prefixed with
``[ps]`` (``[ps I]`` for shard I) or ``[worker I]``. It stops them all at the
end, on Ctrl-C, or as soon as any one fails, and exits non-zero if any failed.
Children are also told by the kernel to stop if the launcher itself dies (no
orphans). On success the chief's metrics are written to ``--metrics-json`` as
``{"mode", "workers", "steps", "test_accuracy", "final_loss", "wall_s",
"examples_per_s"}`` (plus a few more keys, among them ``shards``: what each
server holds at the end). ``--save-model F.keras`` and ``--save-weights F.npz``:
the chief saves the trained model and its parameters. ``--metrics-port P``:
Prometheus endpoints on loopback, server shard I on P+I and worker I on P+M+I
(M servers).

The server flags are ps-server's own (``ServerConfig.parser``), with its
defaults, passed to every shard when given; ps-launch sets ``--host``,
``--port``, ``--port-file``, ``--num-workers`` (``--workers``) and
``--no-exit-when-done`` itself. A flag both commands have with the same meaning
(``--log-level``, ``--auth-token-file``, ``--metrics-host``,
``--max-message-mb``; ``--metrics-port`` with the offsets above) reaches the
servers and the workers; ``--shm`` is the workers' (servers accept shared
memory by default). Every child gets this process's environment, so the old
variables that server and worker read differently (``TFPS_SHM``,
``TFPS_TLS_CERT_FILE``, ``TFPS_TLS_KEY_FILE``, ``TFPS_METRICS_PORT``) are
refused: ``TFPS_SERVER_*`` and ``TFPS_WORKER_*`` say which side is meant.
``--print-config`` prints every child's resolved configuration as JSON and exits.

Elastic training, workers added and removed during the run (docs/elastic.md)::

    ps-launch --elastic MIN:MAX [--workers N] [--micro-batches K] [--scale-at ROUND:N ...]

Sync: the server runs with ``--elastic-min-workers MIN --num-workers MAX`` (and
``--micro-batches K`` when given; the server's default is MAX). Async and ssp: with
``--num-workers MAX`` (MIN is only the floor SIGUSR2 keeps), the workers train on the
server's tasks (whole ``--epochs``), and ROUND below is the server's version. Every
worker runs ``ps-worker --elastic --num-workers MAX``; ``--workers`` start (within MIN..MAX).
``ElasticPool`` then polls the server's Status and applies the ``Scaler``: each
``--scale-at ROUND:N`` once the server's round reaches ROUND, and SIGUSR1 (+1) and
SIGUSR2 (-1) sent to ps-launch, each within MIN..MAX, one change at a time (a change
waits until the workers the last one started registered, and until enough indices
are free). More workers: started on the lowest indices whose process exited. Fewer:
the newest running workers but the chief get SIGTERM (ps-worker --elastic leaves the
job, the server dealing its undelivered part to the others), SIGKILL 60 s later
(``_LEAVE_GRACE_S``). A worker stopped on purpose is no failure whatever its status
(one that exited other than 0 or 143, left, is named, with how it ended); any other worker
failing, or the server exiting, stops the run as above. Refused in one line: MIN >
MAX, ``--workers`` or a step's N outside MIN..MAX, two steps at one round,
``--scale-at`` without ``--elastic``, async or ssp with ``--steps``, ``--num-ps`` > 1, and
ps-server's ``--elastic-min-workers`` itself. The metrics add ``elastic`` and the server's
``membership`` history (``core.membership``), printed at the end. With a command after
``--``, every worker runs it with ``TF_CONFIG`` listing every index up to MAX and
``TFPS_ELASTIC=true`` (a ``tfps.keras`` fit then trains on the data the server deals: sync's
micro-batches, async and ssp's tasks); at the end ps-launch prints the membership and the
examples the server applied per epoch, and exits with the chief's status.

Your own script as every worker, as torchrun and horovodrun do it::

    ps-launch --mode sync --workers 2 -- python train.py --lr 0.1

Everything after the first ``--`` is a command that ps-launch runs once per worker,
after starting the servers exactly as above (every server flag applies). Worker I
gets this process's environment with, added or replaced:

* ``TF_CONFIG``: ``{"cluster": {"ps": [every server's HOST:PORT], "worker": [one
  127.0.0.1:PORT per worker]}, "task": {"type": "worker", "index": I}}``, as
  TensorFlow would set it; worker 0 is the chief (no ``chief`` entry). tfps
  workers do not listen, so the worker entries are placeholders: distinct ports
  that were unused when picked. ``WorkerConfig.from_args([], os.environ)`` (and
  ``worker.api``) resolve ``worker_index`` I, ``num_workers`` N and ``ps`` the
  server addresses, comma-joined.
* for each of these flags given to ps-launch, the variable WorkerConfig reads it
  from (``ps_common.settings.env_name``): ``--auth-token-file``
  (``TFPS_AUTH_TOKEN_FILE``), ``--shm`` (``TFPS_WORKER_SHM``), ``--max-message-mb``
  (``TFPS_MAX_MESSAGE_MB``), ``--grad-wire-dtype`` (``TFPS_GRAD_WIRE_DTYPE``),
  ``--connect-timeout``, ``--init-timeout``, ``--reconnect-timeout``,
  ``--heartbeat-interval`` (``TFPS_<FLAG>``), ``--log-level`` (``TFPS_LOG_LEVEL``),
  ``--metrics-host`` (``TFPS_METRICS_HOST``), ``--metrics-port P``
  (``TFPS_WORKER_METRICS_PORT`` = P + M + I). Nothing is set for a flag not given.

and without ``TFPS_PS``, ``TFPS_WORKER_INDEX`` and ``TFPS_NUM_WORKERS``, which would
win over ``TF_CONFIG``. ``TFPS_AUTH_TOKEN`` and any other variable reach it as they
are. The flags only the built-in ps-worker uses (what to train and how: ``--dataset``,
``--model``, ``--epochs``, ``--steps``, ``--global-batch-size``, ``--optimizer`` ...,
the experiment knobs, ``--progress``, ``--logdir``) and ``--metrics-json``,
``--save-model``, ``--save-weights``, ``--worker-args`` are refused with a command, in
one line naming them. Each worker's stdout and stderr go to ps-launch's stdout and
stderr, each line prefixed ``[worker I]``. ps-launch exits with the chief's status
(128 + S if a signal S killed it) once the chief exited; after a chief that
succeeded, the other workers get 5 s to finish, then are stopped. If another worker exits non-zero, or a server exits,
before the chief finished, ps-launch says which and with what status in one line,
stops the workers, then the servers (SIGTERM, SIGKILL 5 s later), and exits 1. A
worker is sent SIGKILL if ps-launch itself dies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

from protos import wire
from ps_common import security
from ps_common.ports import free_ports
from ps_common.procs import LEFT_JOB_STATUS, ServerStartError, dying_with_parent, wait_for_port_file, write_atomically
from ps_common.settings import deprecated_env, env_names, to_json
from ps_server.config import ServerConfig
from worker.config import ConfigError, WorkerConfig, add_training_flags, training_flags


class LaunchError(RuntimeError):
    pass


_NO_TLS = ("ps-launch runs every process on loopback without TLS; for TLS start ps-server "
           "and ps-worker by hand (docs/security.md). A bearer token works: TFPS_AUTH_TOKEN "
           "or --auth-token-file reaches the server and every worker")


class Child:
    """A child process whose output is relayed line by line, each line prefixed with ``[label]``:
    its stdout and stderr together to this stdout, or (``split_stderr``) each to its own."""

    def __init__(self, label: str, argv: list[str], out_lock: threading.Lock, env: dict,
                 split_stderr: bool = False, death_signal: int = signal.SIGTERM):
        self.label = label
        self.proc = subprocess.Popen(
            dying_with_parent(argv, death_signal),  # if ps-launch dies; SIGTERM: a server still checkpoints
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if split_stderr else subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )
        self._lock = out_lock
        self.tail: list[str] = []
        self._pumps = [threading.Thread(target=self._relay, args=(self.proc.stdout, False),
                                        name=f"relay-{label}", daemon=True)]
        if split_stderr:
            self._pumps.append(threading.Thread(target=self._relay, args=(self.proc.stderr, True),
                                                name=f"relay-{label}-stderr", daemon=True))
        for pump in self._pumps:
            pump.start()

    def _relay(self, stream, to_stderr: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            self.tail = (self.tail + [line])[-20:]
            with self._lock:
                print(f"[{self.label}] {line}", file=sys.stderr if to_stderr else sys.stdout, flush=True)

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.join_relay()

    def join_relay(self) -> None:
        for pump in self._pumps:
            pump.join(timeout=2.0)


def stop_all(children: list[Child], grace: float = 5.0) -> None:
    """SIGTERM to every child still running, at once; SIGKILL to those still running ``grace`` s later."""
    alive = [c for c in children if c.poll() is None]
    for c in alive:
        c.proc.terminate()
    deadline = time.monotonic() + grace
    for c in alive:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
    for c in children:
        c.join_relay()


_SET_BY_LAUNCH = ("ps", "worker_index", "num_workers", "result_json")  # --worker-args may not override these
# ps-server flags ps-launch sets itself, that are no setting of the server, or (TLS) that
# ps-launch, all on loopback, does without.
_SERVER_SET_BY_LAUNCH = ("help", "print_config", "host", "port", "port_file", "num_workers", "exit_when_done",
                         "tls_client_ca_file", "elastic_min_workers")  # the last: --elastic MIN:MAX
# Flags ps-worker and ps-server both have with the same meaning: given once, they reach both
# (--metrics-port too, with an offset per process). The others both have are the workers' alone:
# --shm (servers accept shared memory by default), and the TLS files, which ps-launch refuses.
_FOR_BOTH = ("log_level", "auth_token_file", "metrics_host", "max_message_mb", "metrics_port")
_WORKERS_ONLY = ("shm", "tls_cert_file", "tls_key_file")
_TLS_FIELDS = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name", "tls_client_ca_file")

# With a `--` command: the workers' settings ps-launch passes on, as the variables WorkerConfig reads
# (ps_common.settings.env_name): how a tfps client reaches and talks to the servers, and the process's
# log level and metrics endpoint. The other training flags (what to train, for how long, with which
# optimizer, the knobs, the outputs) are the built-in worker's: a script sets them itself, so they
# and ps-launch's own chief outputs and --worker-args are refused with a command (``built_in_only_flags``).
_SCRIPT_SETTINGS = ("auth_token_file", "shm", "max_message_mb", "grad_wire_dtype", "connect_timeout",
                    "init_timeout", "reconnect_timeout", "heartbeat_interval", "log_level", "metrics_host",
                    "metrics_port")
_BUILT_IN_LAUNCH_FLAGS = ("metrics_json", "save_model", "save_weights", "worker_args")
# What TF_CONFIG tells a `--` command; the same variables in this environment would win over it.
_CLUSTER_FIELDS = ("ps", "worker_index", "num_workers")
_AFTER_CHIEF_S = 5.0  # with a command: how long the other workers may run on once the chief exited
_STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL this much later
# A worker scaled down leaves the job (worker.elastic: SIGTERM sets a flag that the loop
# checks between calls, then Leave over a fresh channel). On a loaded machine that took
# more than 5 s once: SIGKILL came first, no Leave, and the server declared it dead 10 s
# later. SIGKILL is only for a worker that hangs.
_LEAVE_GRACE_S = 60.0


def _how_it_exited(status: int) -> str:
    """A child's exit status in words: "with status 1", "killed by SIGKILL"."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"with status {status}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-launch",
        description="Train with one ps-server (or --num-ps shards) and N ps-worker processes on this machine.",
        conflict_handler="resolve",  # --elastic MIN:MAX below replaces ps-worker's --elastic (it sets that itself)
    )
    p.add_argument("--workers", type=int, default=2,
                   help="number of worker processes (default %(default)s); with --elastic, how many start")
    p.add_argument("--num-ps", type=int, default=1,
                   help="server shards: the variables are spread over this many ps-server processes (default %(default)s)")
    p.add_argument("--metrics-json", help="write the run's metrics here")
    p.add_argument("--save-model", help="the chief saves the trained model here as a Keras file (.keras)")
    p.add_argument("--save-weights", help="the chief saves the final parameters here (.npz)")
    p.add_argument("--server-start-timeout", type=float, default=60.0,
                   help="seconds to wait for the server (default %(default)g)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration of every server and worker as JSON and exit")
    p.add_argument("--worker-args", nargs=2, action="append", metavar=("I", "ARGS"), default=[],
                   help="more ps-worker arguments for worker I only, as one shell-quoted string, e.g. "
                   "--worker-args 1 \"--slowdown 3 --history-json h1.json\" (repeatable; a lone flag "
                   "needs a space to stay one string: \" --no-shm\")")
    add_training_flags(p)
    g = p.add_argument_group("elastic training", "workers added and removed during the run (docs/elastic.md)")
    g.add_argument("--elastic", dest="elastic_workers", type=elastic_range, metavar="MIN:MAX",
                   help="MIN to MAX workers on data the server deals: sync, each round's batch cut into "
                   "--micro-batches (default MAX; ps-server --elastic-min-workers MIN --num-workers MAX); async "
                   "and ssp, tasks each applied once (--epochs); --workers start; SIGUSR1 to ps-launch adds a "
                   "worker, SIGUSR2 stops the newest but the chief")
    g.add_argument("--scale-at", dest="scale_at", type=scale_step, action="append", default=[],
                   metavar="ROUND:N", help="with --elastic: once the server reaches round ROUND (async, ssp: "
                   "version ROUND), start or stop "
                   "workers until N run (repeatable; each step waits for the workers the last one started "
                   "to register)")
    add_server_flags(p)
    p.add_argument("command", nargs="*", metavar="-- COMMAND ARGS",
                   help="run this command as every worker instead of ps-worker (after --, e.g. "
                   "-- python train.py --lr 0.1), each with TF_CONFIG and its TFPS_* settings (module docstring)")
    return p


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """ps-server's flags (``ServerConfig.parser``) that ps-launch passes on, as the server
    declares them: same names, choices and help, no defaults of their own (the server's apply)."""
    g = p.add_argument_group("ps-server", "passed to every server shard when given (ps-server --help)")
    taken = {option for action in p._actions for option in action.option_strings}
    for action in ServerConfig.parser()._actions:
        if action.dest in _SERVER_SET_BY_LAUNCH:
            continue
        if set(action.option_strings) & taken:  # a flag the workers have too
            if action.dest not in _FOR_BOTH + _WORKERS_ONLY:
                raise TypeError(f"ps-server's {action.option_strings[0]} is also a ps-worker flag: say in "
                                "_FOR_BOTH or _WORKERS_ONLY whom ps-launch passes it to")
            continue
        kwargs = dict(dest=action.dest, help=action.help, default=None)
        if isinstance(action, argparse.BooleanOptionalAction):
            g.add_argument(action.option_strings[0], action=argparse.BooleanOptionalAction, **kwargs)
        elif type(action) is argparse._StoreAction:
            g.add_argument(*action.option_strings, type=action.type, choices=action.choices, metavar=action.metavar,
                           **kwargs)
        else:
            raise TypeError(f"ps-launch cannot pass on ps-server's {action.option_strings} ({type(action).__name__})")


def server_flag_dests() -> list[str]:
    """The ps-server settings ps-launch passes on, in ps-server's order (``_FOR_BOTH`` among them)."""
    return [a.dest for a in ServerConfig.parser()._actions
            if a.dest not in _SERVER_SET_BY_LAUNCH + _WORKERS_ONLY]


def worker_extra_args(args: argparse.Namespace) -> dict[int, list[str]]:
    """Each ``--worker-args I "ARGS"`` as {I: argv}, checked to be ps-worker flags that
    ps-launch does not set itself; several for the same I are joined in order."""
    extra: dict[int, list[str]] = {}
    for raw_index, raw_args in args.worker_args:
        try:
            index = int(raw_index)
        except ValueError:
            raise LaunchError(f"--worker-args takes a worker index and a string, got index {raw_index!r}") from None
        if not 0 <= index < capacity(args):
            raise LaunchError(f"--worker-args {index}: the workers are 0..{capacity(args) - 1}")
        try:
            argv = shlex.split(raw_args)
        except ValueError as e:
            raise LaunchError(f"--worker-args {index} {raw_args!r}: {e}") from None
        parsed = _worker_parser(index).parse_args(argv)
        taken = [f"--{name.replace('_', '-')}" for name in _SET_BY_LAUNCH if getattr(parsed, name) is not None]
        if taken:
            raise LaunchError(f"--worker-args {index}: ps-launch sets {', '.join(taken)} itself")
        extra.setdefault(index, []).extend(argv)
    return extra


def _worker_parser(index: int) -> argparse.ArgumentParser:
    """ps-worker's parser, with errors raised as one-line LaunchErrors instead of a usage exit."""
    p = WorkerConfig.parser()

    def error(message: str):
        raise LaunchError(f"--worker-args {index}: {message}")

    p.error = error
    return p


def worker_argv(args: argparse.Namespace, index: int, addresses: list[str], extra: list[str] = ()) -> list[str]:
    """The command line of worker ``index``: the training flags, then its ``--worker-args``."""
    flags = training_flags(args)
    if args.metrics_port:  # one port each: server shards take P, P+1, ..., then the workers
        at = flags.index("--metrics-port")
        flags[at + 1] = str(args.metrics_port + args.num_ps + index)
    if index == 0 and args.save_model:
        flags += ["--save-model", args.save_model]
    if index == 0 and args.save_weights:
        flags += ["--save-weights", args.save_weights]
    if getattr(args, "elastic_workers", None):
        flags.append("--elastic")
    return [sys.executable, "-m", "worker", "--ps", ",".join(addresses), "--worker-index", str(index),
            "--num-workers", str(capacity(args)), *flags, *extra]


def server_argv(args: argparse.Namespace, shard: int, port_file: str) -> list[str]:
    """The command line of server ``shard`` (0 .. --num-ps - 1): the ps-server flags given, in
    ps-server's order, a checkpoint directory of its own and its metrics port (``--metrics-port + shard``)."""
    argv = [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
            "--num-workers", str(capacity(args)), "--no-exit-when-done"]  # the launcher stops its servers
    if getattr(args, "elastic_workers", None) and args.mode in (None, "sync"):
        argv += ["--elastic-min-workers", str(args.elastic_workers[0])]  # async, ssp: MIN is ps-launch's floor
    for dest in server_flag_dests():
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if dest == "checkpoint_dir" and args.num_ps > 1:
            value = os.path.join(value, f"shard-{shard}")
        elif dest == "metrics_port" and value:  # Prometheus: shard I on --metrics-port + I (workers after them)
            value += shard
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def child_environment() -> dict:
    """The environment every child gets: this one without TF_CONFIG (the launcher describes
    the cluster itself), unbuffered, with the allocator settings for large messages."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    for key, value in wire.ALLOCATOR_ENV.items():  # large messages without page faults (BENCHMARKS.md)
        env.setdefault(key, value)
    return env


def _refuse_ambiguous(env: dict) -> None:
    """The old variables server and worker read differently would reach both sides here."""
    renamed: dict[str, list[str]] = {}
    for cls in (ServerConfig, WorkerConfig):
        for old, new in deprecated_env(cls).items():
            renamed.setdefault(old, []).append(new)
    given = [old for old in renamed if env.get(old)]
    if given:
        old = given[0]
        raise LaunchError(f"{old} means different things to ps-server and ps-worker, and ps-launch starts both: "
                          f"set {' or '.join(renamed[old])} instead")


def resolved(args: argparse.Namespace, extra: dict[int, list[str]], env: dict,
             workers: bool = True) -> tuple[ServerConfig, list]:
    """The configuration each server and each worker will resolve from its command line and
    ``env`` (servers: that of shard 0; the others differ in checkpoint directory and metrics
    port), so that a bad combination fails now, with the child's own message, not in N processes."""
    try:
        server = ServerConfig.from_args(server_argv(args, 0, "(temporary)")[3:], environ=env)
    except ConfigError as e:
        raise LaunchError(f"ps-server: {e}") from None
    placeholders = [f"127.0.0.1:{i + 1}" for i in range(args.num_ps)]  # the ports are picked at start
    configs = []
    for i in range(capacity(args) if workers else 0):  # elastic: every index a worker may be started with
        try:
            configs.append(WorkerConfig.from_args(worker_argv(args, i, placeholders, extra.get(i, []))[3:],
                                                  environ=env))
        except ConfigError as e:
            raise LaunchError(f"worker {i}: {e}" if i in extra else str(e)) from None
    return server, configs


def print_config(args: argparse.Namespace, server: ServerConfig, workers: list) -> None:
    import dataclasses
    import json

    servers = []
    for i in range(args.num_ps):
        shard = json.loads(to_json(dataclasses.replace(server, **_shard_fields(args, i))))
        shard["port_file"] = "(temporary)"
        servers.append(shard)
    ps = ",".join(f"127.0.0.1:<port of server {i}>" for i in range(args.num_ps))
    doc = {"launch": {k: getattr(args, k) for k in ("workers", "num_ps", "metrics_json", "save_model",
                                                    "save_weights", "server_start_timeout",
                                                    "elastic_workers", "scale_at")},
           "servers": servers,
           "workers": [{**json.loads(to_json(w)), "ps": ps} for w in workers]}
    command = getattr(args, "command", None)
    if command:  # what a script using tfps' API resolves, and the variables ps-launch sets for it
        doc["launch"] = {k: getattr(args, k) for k in ("workers", "num_ps", "server_start_timeout", "command")}
        ps_list = ps.split(",")
        others = [f"127.0.0.1:<unused port {i}>" for i in range(args.workers)]
        doc["worker_environment"] = [
            {"TF_CONFIG": json.dumps({"cluster": {"ps": ps_list, "worker": others},
                                      "task": {"type": "worker", "index": i}}), **script_settings(args, i)}
            for i in range(args.workers)]
    print(json.dumps(doc, indent=2), flush=True)


def _shard_fields(args: argparse.Namespace, shard: int) -> dict:
    """What server ``shard`` has of its own (``server_argv``): its checkpoint directory and metrics port."""
    fields = {}
    if args.checkpoint_dir and args.num_ps > 1:
        fields["checkpoint_dir"] = os.path.join(args.checkpoint_dir, f"shard-{shard}")
    if args.metrics_port:
        fields["metrics_port"] = args.metrics_port + shard
    return fields


# -- a `--` command as every worker ----------------------------------------------------------


def built_in_only_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that only the built-in ps-worker uses (``_SCRIPT_SETTINGS``), as typed."""
    probe = argparse.ArgumentParser(add_help=False)
    add_training_flags(probe)
    built_in = {a.dest for a in probe._actions if a.dest not in _SCRIPT_SETTINGS + _TLS_FIELDS}
    built_in.update(_BUILT_IN_LAUNCH_FLAGS)
    given = []
    for action in parser()._actions:
        value = getattr(args, action.dest, None)
        if action.dest in built_in and value not in (None, []):
            flag = action.option_strings[0]
            given.append("--no-" + flag[2:] if value is False else flag)
    return given


def placeholder_worker_addresses(count: int) -> list[str]:
    """One 127.0.0.1:PORT per worker for TF_CONFIG's ``cluster.worker``. tfps workers do not
    listen: the entries only give TF_CONFIG the shape TensorFlow gives it. The ports are
    distinct and free when picked (``ps_common.ports``), so a script that does bind its own
    entry is unlikely to collide with anything."""
    return [f"127.0.0.1:{port}" for port in free_ports(count)]


def script_settings(args: argparse.Namespace, index: int) -> dict[str, str]:
    """The ``_SCRIPT_SETTINGS`` flags given, for worker ``index``, as {WorkerConfig's variable: text}
    (``--metrics-port P``: P + --num-ps + index, as for ps-worker)."""
    names = env_names(WorkerConfig)
    out = {}
    for field in _SCRIPT_SETTINGS:
        value = getattr(args, field, None)
        if value is None:
            continue
        if field == "metrics_port" and value:
            value += args.num_ps + index
        out[names[field]] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return out


def script_environment(args: argparse.Namespace, index: int, ps_addresses: list[str],
                       worker_addresses: list[str], base: dict) -> dict:
    """The environment of worker ``index`` of a `--` command: ``base`` (``child_environment``)
    without TFPS_PS, TFPS_WORKER_INDEX and TFPS_NUM_WORKERS (they would win over TF_CONFIG),
    plus TF_CONFIG and ``script_settings``."""
    env = dict(base)
    names = env_names(WorkerConfig)
    for field in _CLUSTER_FIELDS:
        env.pop(names[field], None)
    env["TF_CONFIG"] = json.dumps({"cluster": {"ps": list(ps_addresses), "worker": list(worker_addresses)},
                                   "task": {"type": "worker", "index": index}})
    env.update(script_settings(args, index))
    if getattr(args, "elastic_workers", None):  # tfps.keras.Strategy() trains on the data the server deals
        env[names["elastic"]] = "true"
        env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # the same bits in every worker (worker.keras._seeded)
    return env


def resolved_for_script(args: argparse.Namespace, env: dict) -> tuple[ServerConfig, list]:
    """As ``resolved``, for a `--` command: each worker's configuration as
    ``WorkerConfig.from_args([], its environment)`` (tfps' API in the script) will resolve it."""
    server, _ = resolved(args, {}, env, workers=False)
    ps = [f"127.0.0.1:{i + 1}" for i in range(args.num_ps)]  # the ports are picked at start
    others = [f"127.0.0.1:{args.num_ps + i + 1}" for i in range(capacity(args))]
    workers = []
    for i in range(capacity(args)):  # elastic: every index a worker may be started with
        try:
            workers.append(WorkerConfig.from_args([], environ=script_environment(args, i, ps, others, env)))
        except ConfigError as e:
            raise LaunchError(str(e)) from None
    return server, workers


def _check_command(command: list[str]) -> None:
    import shutil

    if shutil.which(command[0]) is None:
        raise LaunchError(f"{command[0]}: no such command (the command after -- runs as every worker)")


def run_command(args: argparse.Namespace, server_config: ServerConfig, env: dict) -> int:
    """Start the servers, then ``args.command`` once per worker (``script_environment``); the
    chief's exit status, or 1 when another worker or a server failed first."""
    servers_text = "1 ps-server" if args.num_ps == 1 else f"{args.num_ps} ps-server shards"
    print(f"ps-launch: {server_config.mode}, {args.workers} workers and {servers_text} on loopback, "
          f"running {shlex.join(args.command)}", flush=True)
    out_lock = threading.Lock()
    servers: list[Child] = []
    workers: list[Child] = []
    elastic = getattr(args, "elastic_workers", None)
    scaler = Scaler(elastic[0], elastic[1], args.scale_at) if elastic else None
    with tempfile.TemporaryDirectory(prefix="ps-launch-") as tmp, scale_signals(scaler):
        try:
            addresses = _start_servers(args, tmp, out_lock, env, servers)
            others = placeholder_worker_addresses(capacity(args))

            def start(index: int) -> Child:
                # SIGKILL when ps-launch dies: a TensorFlow task in a cluster may outlive a SIGTERM
                return Child(f"worker {index}", args.command, out_lock,
                             script_environment(args, index, addresses, others, env),
                             split_stderr=True, death_signal=signal.SIGKILL)

            if elastic:  # workers started and stopped during the run, as for ps-worker (ElasticPool)
                return _wait_for_elastic_command(ElasticPool(args, scaler, addresses, start, out_lock, workers),
                                                 servers, addresses)
            workers.extend(start(i) for i in range(args.workers))
            return _wait_for_command(workers, servers)
        except KeyboardInterrupt:
            print("ps-launch: interrupted, stopping all processes", file=sys.stderr)
            return 130
        finally:
            stop_all(workers, _STOP_GRACE_S)
            stop_all(servers, _STOP_GRACE_S)


def _wait_for_elastic_command(pool: "ElasticPool", servers: list[Child], addresses: list[str]) -> int:
    """An elastic job of a command: 0 once every worker not stopped on purpose exited 0, else the
    chief's status (or 1); then the server's membership history and its examples per epoch."""
    failed = pool.run(servers)
    if failed:
        chief = pool.workers.get(0)
        for c in failed:
            print(f"ps-launch: {c.label} exited {_how_it_exited(c.proc.returncode)}", file=sys.stderr, flush=True)
        code = chief.proc.returncode if chief in failed else 1
        return code if code >= 0 else 128 - code
    shards, membership = _shard_summary(addresses, pool.args.auth_token_file)
    for e in membership:
        print(f"ps-launch: round {e['round']}: worker {e['worker_id']} {e['event']}", flush=True)
    for shard in shards:
        tasks = f"; tasks done {shard['tasks_done']} of {shard['tasks_total']}" if shard["tasks_total"] else ""
        print(f"ps-launch: the server applied {shard['examples_applied']} examples in {shard['version']} updates; "
              f"examples per epoch {shard['epoch_examples']} of {shard['num_examples']}{tasks}", flush=True)
    return 0


def _wait_for_command(workers: list[Child], servers: list[Child]) -> int:
    """The chief's exit status once it exited (the others get ``_AFTER_CHIEF_S`` to finish);
    1 as soon as another worker exits non-zero or a server exits before it."""
    chief = workers[0]
    while True:
        code = chief.poll()
        if code is not None:
            return _after_chief(workers, code)
        for w in workers[1:]:
            if w.poll() not in (None, 0):
                print(f"ps-launch: {w.label} exited with status {w.proc.returncode} before the chief finished; "
                      "stopping the other workers and the servers", file=sys.stderr, flush=True)
                return 1
        for i, server in enumerate(servers):
            if server.poll() is not None:
                name = "ps-server" if len(servers) == 1 else f"ps-server shard {i}"
                print(f"ps-launch: {name} exited with status {server.proc.returncode} before the chief finished; "
                      "stopping the workers", file=sys.stderr, flush=True)
                return 1
        time.sleep(0.1)


def _after_chief(workers: list[Child], code: int) -> int:
    """The launcher's status for a chief that exited with ``code``: the others get
    ``_AFTER_CHIEF_S`` to finish after a chief that succeeded, none after one that failed."""
    deadline = time.monotonic() + (_AFTER_CHIEF_S if code == 0 else 0.0)
    while any(w.poll() is None for w in workers[1:]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for w in workers[1:]:
        if w.poll() is None and code == 0:
            print(f"ps-launch: {w.label} still running {_AFTER_CHIEF_S:g} s after the chief exited; stopping it",
                  file=sys.stderr, flush=True)
        elif w.proc.returncode != 0:
            print(f"ps-launch: {w.label} exited with status {w.proc.returncode} (after the chief)",
                  file=sys.stderr, flush=True)
    if code != 0:
        print(f"ps-launch: worker 0 (the chief) exited with status {code}", file=sys.stderr, flush=True)
    return code if code >= 0 else 128 - code  # killed by signal S: 128 + S, as a shell says


def _start_servers(args: argparse.Namespace, tmp: str, out_lock: threading.Lock, env: dict,
                   children: list[Child]) -> list[str]:
    """Start every server shard (appended to ``children`` as it starts), all at once, then wait
    until each one serves; their addresses, in shard order."""
    servers, port_files = [], []
    for i in range(args.num_ps):
        port_files.append(os.path.join(tmp, f"port-{i}"))
        servers.append(Child("ps" if args.num_ps == 1 else f"ps {i}", server_argv(args, i, port_files[-1]),
                             out_lock, env))
        children.append(servers[-1])
    deadline = time.monotonic() + args.server_start_timeout
    return [_wait_for_server(server, port_file, max(1.0, deadline - time.monotonic()))
            for server, port_file in zip(servers, port_files)]



# -- elastic sync: workers started and stopped during the run ---------------------------------


def elastic_range(raw: str) -> tuple[int, int]:
    """``--elastic MIN:MAX`` as (MIN, MAX), 1 <= MIN <= MAX."""
    try:
        low, high = (int(x) for x in raw.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes MIN:MAX, two integers (e.g. 2:4), got {raw!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"needs 1 <= MIN <= MAX, got {raw!r}")
    return low, high


def scale_step(raw: str) -> tuple[int, int]:
    """``--scale-at ROUND:N`` as (ROUND, N), ROUND >= 0 (N is checked against --elastic later)."""
    try:
        at, count = (int(x) for x in raw.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes ROUND:N, two integers (e.g. 10:4), got {raw!r}") from None
    if at < 0:
        raise argparse.ArgumentTypeError(f"ROUND must be >= 0, got {raw!r}")
    return at, count


def capacity(args: argparse.Namespace) -> int:
    """The server's --num-workers: --elastic's MAX, else --workers."""
    elastic = getattr(args, "elastic_workers", None)
    return elastic[1] if elastic else args.workers


def position(status) -> int:
    """Where a job is, for ``--scale-at``: sync, the round; async and ssp, the version (the
    updates applied: one per task)."""
    return int(status.round) if wire.mode_from_wire(status.mode) == "sync" else int(status.version)


def check_elastic(args: argparse.Namespace) -> None:
    """Refuse, in one line, what an elastic launch (or a schedule without one) cannot do."""
    elastic, steps = getattr(args, "elastic_workers", None), getattr(args, "scale_at", [])
    if not elastic:
        if steps:
            raise LaunchError("--scale-at changes the worker count of an elastic job: add --elastic MIN:MAX")
        return
    low, high = elastic
    if args.mode not in (None, "sync") and getattr(args, "steps", None):
        raise LaunchError(f"--elastic with --mode {args.mode}: the server hands out whole epochs as tasks; "
                          f"say --epochs, not --steps {args.steps}")
    if not low <= args.workers <= high:
        raise LaunchError(f"--workers {args.workers} (the workers started) must lie in {low}..{high} "
                          f"(--elastic {low}:{high})")
    rounds = [r for r, _ in steps]
    if len(set(rounds)) != len(rounds):
        raise LaunchError(f"--scale-at: two steps at the same round ({sorted(rounds)})")
    for at, count in steps:
        if not low <= count <= high:
            raise LaunchError(f"--scale-at {at}:{count}: N must lie in {low}..{high} (--elastic {low}:{high})")


class Scaler:
    """When to change an elastic job's worker count, and to what: the ``--scale-at`` schedule
    (ROUND:N, applied in round order once the server's round reaches ROUND) and the requests
    (+1 or -1: SIGUSR1, SIGUSR2), in the order they became due. Plain, no processes:

        scaler = Scaler(low=2, high=4, schedule=[(10, 4), (20, 3)])
        scaler.request(+1)                 # interactive
        n = scaler.due(round=12, running=2) # the count to reach now, or None

    A request beyond MIN..MAX is dropped with a line saying why (``refused``)."""

    def __init__(self, low: int, high: int, schedule: list[tuple[int, int]] = ()):
        self.low, self.high = low, high
        self.schedule = sorted(schedule)
        self.requests: list[int] = []
        self.refused: list[str] = []

    def request(self, delta: int) -> None:
        self.requests.append(delta)

    def due(self, round: int, running: int, free: int | None = None) -> int | None:
        """The count to reach now, or None. ``free``: how many more workers can start now (the
        indices whose process exited); a change that needs more waits, first in line."""
        if self.schedule and round >= self.schedule[0][0]:
            want = self.schedule[0][1]
            if free is not None and want - running > free:
                return None
            return self.schedule.pop(0)[1]
        while self.requests:
            want = running + self.requests[0]
            if not self.low <= want <= self.high:
                self.requests.pop(0)
                self.refused.append(f"{'SIGUSR1 (add a worker)' if want > running else 'SIGUSR2 (stop a worker)'} "
                                    f"ignored: {running} run, and --elastic is {self.low}:{self.high}")
                continue
            if free is not None and want - running > free:
                return None
            self.requests.pop(0)
            return want
        return None


@contextlib.contextmanager
def scale_signals(scaler: "Scaler | None"):
    """Inside: SIGUSR1 and SIGUSR2 are ``scaler``'s +1 and -1 requests (from before the servers
    start, so that an early one is queued, not ps-launch's end: their default). Nothing without
    a scaler, or outside the main thread (where signals arrive)."""
    if scaler is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {signal.SIGUSR1: +1, signal.SIGUSR2: -1}
    previous = {sig: signal.signal(sig, lambda signum, frame: scaler.request(handlers[signum])) for sig in handlers}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ElasticPool:
    """The worker processes of an elastic launch: started at free indices, stopped on purpose
    (SIGTERM: ``ps-worker --elastic`` leaves the job, its undelivered part moving to the others;
    SIGKILL ``_LEAVE_GRACE_S`` later), never the chief. ``run`` waits for the job as
    ``_wait_for_workers`` does, applying the ``Scaler`` meanwhile; a worker stopped on purpose
    is no failure, whatever its status."""

    def __init__(self, args, scaler: Scaler, addresses: list[str], make, out_lock: threading.Lock,
                 children: list[Child]):
        """``make(index)``: a new worker process at ``index`` (``ps-worker --elastic``, or the
        command after ``--``)."""
        self.args, self.addresses, self.make = args, addresses, make
        self.out_lock, self.children = out_lock, children
        self.scaler = scaler
        self.workers: dict[int, Child] = {}  # index -> its newest process
        self.started: list[Child] = []  # every worker process, in start order
        self.stopping: dict[Child, float] = {}  # stopped on purpose -> when (monotonic)
        self.unregistered: set[int] = set()  # started by the last step, not yet registered
        self.reported: set[Child] = set()  # stopped on purpose, and how it exited said

    def say(self, text: str) -> None:
        with self.out_lock:
            print(f"ps-launch: {text}", flush=True)

    def running(self) -> list[Child]:
        """Workers neither exited nor stopped on purpose, in start order."""
        return [c for c in self.started if c.poll() is None and c not in self.stopping]

    def start(self, index: int) -> None:
        child = self.make(index)
        self.workers[index] = child
        self.started.append(child)
        self.children.append(child)
        self.unregistered.add(index)

    def free_indices(self) -> list[int]:
        """The indices whose process (if any) has exited: an index is never run twice at once
        (one stopped on purpose is busy until it exited)."""
        busy = {i for i, c in self.workers.items() if c.poll() is None}
        return [i for i in range(capacity(self.args)) if i not in busy]

    def scale_to(self, count: int, round: int) -> None:
        running = self.running()
        if count > len(running):
            new = self.free_indices()[:count - len(running)]  # Scaler.due saw that there are enough
            for index in new:
                self.start(index)
            self.say(f"round {round}: {len(running)} -> {count} workers: started worker(s) "
                     f"{', '.join(map(str, new))}")
        elif count < len(running):
            newest = [c for c in running if c is not self.workers.get(0)][::-1][:len(running) - count]
            for c in newest:
                c.proc.terminate()  # ps-worker --elastic leaves the job (worker.elastic)
                self.stopping[c] = time.monotonic()
            self.say(f"round {round}: {len(running)} -> {count} workers: stopping "
                     f"{', '.join(c.label for c in newest)} (SIGTERM: it leaves the job)")

    def run(self, servers: list[Child]) -> list[Child]:
        """Until every worker not stopped on purpose exited; the failed ones (or a server that exited)."""
        from worker.client import PSClient, PSClientError

        for i in range(self.args.workers):
            self.start(i)
        token = security.load_token(self.args.auth_token_file, os.environ)
        with PSClient(self.addresses[0], timeout=10.0, token=token) as client:
            while True:
                failed = self._check(servers)
                if failed is not None:
                    return failed
                try:
                    self._scale(client.status())
                except PSClientError:
                    pass  # busy or restarting: the next poll asks again
                time.sleep(0.2)

    def _check(self, servers: list[Child]) -> list[Child] | None:
        for c, since in list(self.stopping.items()):
            if c.poll() is None and time.monotonic() - since > _LEAVE_GRACE_S:
                c.proc.kill()
            elif c.poll() is not None and c not in self.reported:
                self.reported.add(c)
                if c.poll() not in (0, LEFT_JOB_STATUS):  # no failure of the job, but no clean leave either
                    self.say(f"{c.label} was stopped but exited {_how_it_exited(c.poll())}, not with "
                             f"{LEFT_JOB_STATUS} (left the job): unless it had finished, the server declares "
                             f"it dead when its lease runs out")
        failed = [c for c in self.started if c.poll() not in (None, 0) and c not in self.stopping]
        if failed:
            return failed
        for i, server in enumerate(servers):
            if server.poll() is not None:
                print(f"ps-launch: ps-server exited with status {server.proc.returncode} while training",
                      file=sys.stderr)
                return [server]
        if all(c.poll() is not None for c in self.started):
            for c in self.stopping:
                c.join_relay()
            return []
        return None

    def _scale(self, status) -> None:
        if self.workers[0].poll() is not None:
            return  # the chief finished: no more changes
        alive = {w.worker_id for w in status.workers if not w.left and not w.dead}
        self.unregistered = {i for i in self.unregistered if i not in alive and self.workers[i].poll() is None}
        for line in self.scaler.refused:
            self.say(line)
        self.scaler.refused.clear()
        if self.unregistered:
            return  # the last step's workers are still starting: the next one waits for them
        at = position(status)
        count = self.scaler.due(at, len(self.running()), free=len(self.free_indices()))
        if count is not None:
            self.scale_to(count, at)


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    command = getattr(args, "command", None) or []
    extra = worker_extra_args(args)
    env = child_environment()
    _refuse_ambiguous(env)
    server_config, worker_configs = resolved_for_script(args, env) if command else resolved(args, extra, env)
    if server_config.tls_cert_file or any(w.tls_ca_file for w in worker_configs):
        raise LaunchError(_NO_TLS + " (TLS is set in the environment)")
    if args.print_config:
        print_config(args, server_config, worker_configs)
        return 0
    if command:
        return run_command(args, server_config, env)
    chief = worker_configs[0]
    elastic = getattr(args, "elastic_workers", None)
    servers_text = "1 ps-server" if args.num_ps == 1 else f"{args.num_ps} ps-server shards"
    elastic_text = ""
    if elastic:
        dealt = (f"{server_config.micro_batches or elastic[1]} micro-batches a round" if server_config.mode == "sync"
                 else "the server's tasks")
        elastic_text = f" (elastic {elastic[0]}:{elastic[1]}, {dealt})"
    print(f"ps-launch: {server_config.mode}, {args.workers} workers{elastic_text} and {servers_text} on loopback, "
          f"training {chief.model} on {chief.dataset}", flush=True)
    outcome = _train(args, extra, env, elastic)
    if isinstance(outcome, int):
        return outcome
    _report(args, server_config, elastic, *outcome)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Refuse a combination ps-launch cannot run, before anything starts."""
    if args.workers < 1:
        raise LaunchError(f"--workers must be >= 1, got {args.workers}")
    if args.num_ps < 1:
        raise LaunchError(f"--num-ps must be >= 1, got {args.num_ps}")
    if any(getattr(args, name, None) for name in _TLS_FIELDS):
        raise LaunchError(_NO_TLS)
    check_elastic(args)
    command = getattr(args, "command", None) or []
    if command:
        refused = built_in_only_flags(args)
        if refused:
            raise LaunchError(f"{', '.join(refused)}: the built-in ps-worker's, not for a command after -- "
                              "(the command sets what it trains itself)")
        _check_command(command)


def _train(args: argparse.Namespace, extra: dict, env: dict, elastic) -> int | tuple:
    """Start the servers and the built-in workers, wait for them, stop them all: the exit
    status if the job failed or was interrupted, else (the chief's result, wall seconds,
    the shards' summary, the membership events)."""
    out_lock = threading.Lock()
    children: list[Child] = []
    shards: list[dict] = []
    membership: list[dict] = []
    started = time.monotonic()
    scaler = Scaler(elastic[0], elastic[1], args.scale_at) if elastic else None
    with tempfile.TemporaryDirectory(prefix="ps-launch-") as tmp, scale_signals(scaler):
        result_file = os.path.join(tmp, "result.json")
        try:
            addresses = _start_servers(args, tmp, out_lock, env, children)
            servers = list(children)
            if elastic:  # workers started and stopped during the run (ElasticPool)
                def start(index: int) -> Child:
                    argv = worker_argv(args, index, addresses, extra.get(index, []))
                    return Child(f"worker {index}", argv + (["--result-json", result_file] if index == 0 else []),
                                 out_lock, env)

                failed = ElasticPool(args, scaler, addresses, start, out_lock, children).run(servers)
            else:
                for i in range(args.workers):
                    argv = worker_argv(args, i, addresses, extra.get(i, []))
                    if i == 0:
                        argv += ["--result-json", result_file]
                    children.append(Child(f"worker {i}", argv, out_lock, env))
                failed = _wait_for_workers(children[len(servers):], servers)
            if not failed:
                shards, membership = _shard_summary(addresses, args.auth_token_file)
        except KeyboardInterrupt:
            print("ps-launch: interrupted, stopping all processes", file=sys.stderr)
            for c in reversed(children):
                c.stop()
            return 130
        finally:
            for c in reversed(children):
                c.stop()
        wall_s = time.monotonic() - started
        if failed:
            for c in failed:
                print(f"ps-launch: {c.label} exited with status {c.proc.returncode}", file=sys.stderr)
            return 1
        try:
            with open(result_file) as f:
                result = json.load(f)
        except (OSError, ValueError) as e:
            raise LaunchError(f"the chief finished but wrote no metrics ({e})") from None
    return result, wall_s, shards, membership


def _report(args: argparse.Namespace, server_config: ServerConfig, elastic, result: dict, wall_s: float,
            shards: list[dict], membership: list[dict]) -> None:
    """The job's lines on stdout and its metrics in ``--metrics-json``."""
    metrics = {
        "mode": server_config.mode,
        "workers": args.workers,
        "steps": result["steps"],
        "test_accuracy": result["test_accuracy"],
        "final_loss": result["final_loss"],
        "wall_s": wall_s,
        "examples_per_s": result["examples_per_s"],
        "train_s": result["train_s"],
        "test_loss": result["test_loss"],
        "mean_staleness": result["mean_staleness"],
        "max_staleness": result["max_staleness"],
        "num_ps": args.num_ps,
        "shards": shards,
        "membership": membership,
    }
    if elastic:
        metrics["elastic"] = {"min_workers": elastic[0], "max_workers": elastic[1],
                              "micro_batches": (server_config.micro_batches or elastic[1])
                              if server_config.mode == "sync" else 0,
                              "scale_at": [list(step) for step in args.scale_at]}
        for e in membership:
            print(f"ps-launch: round {e['round']}: worker {e['worker_id']} {e['event']}", flush=True)
    if args.num_ps > 1:
        for i, shard in enumerate(shards):
            print(f"ps-launch: shard {i} at {shard['address']} holds {shard['variables']} pieces "
                  f"({shard['parameters']:,} parameters), version {shard['version']}, round {shard['round']}",
                  flush=True)
    servers_text = f" and {args.num_ps} server shards" if args.num_ps > 1 else ""
    started_text = f" at the start (elastic {elastic[0]}:{elastic[1]})" if elastic else ""
    print(
        f"ps-launch: {server_config.mode} with {args.workers} workers{started_text}{servers_text}: "
        f"{metrics['steps']} steps, "
        f"test accuracy {metrics['test_accuracy']:.4f}, final loss {metrics['final_loss']:.4f}, "
        f"{metrics['examples_per_s']:.0f} examples/s, wall {wall_s:.1f} s",
        flush=True,
    )
    if args.metrics_json:
        write_atomically(args.metrics_json, json.dumps(metrics, indent=2))


def _wait_for_server(server: Child, port_file: str, timeout: float) -> str:
    from worker.client import PSClient, PSClientError

    deadline = time.monotonic() + timeout
    try:
        address = f"127.0.0.1:{wait_for_port_file(port_file, server.proc, timeout)}"
    except ServerStartError as e:
        raise LaunchError(str(e)) from None
    with PSClient(address) as client:
        try:
            client.wait_ready(max(1.0, deadline - time.monotonic()))
        except PSClientError as e:
            raise LaunchError(f"ps-server at {address} is not healthy: {e}") from None
    return address


def _shard_summary(addresses: list[str], token_file: str | None) -> tuple[list[dict], list[dict]]:
    """What each server holds at the end, and shard 0's membership history, from their
    Status (both empty if one does not answer)."""
    from worker.client import PSClient, PSClientError

    out, membership = [], []
    for i, address in enumerate(addresses):
        try:
            with PSClient(address, timeout=10.0, token=security.load_token(token_file, os.environ)) as client:
                s = client.status()
        except (PSClientError, ConfigError) as e:
            print(f"ps-launch: no status from {address}: {e}", file=sys.stderr)
            return [], []
        out.append({"address": address, "variables": int(s.num_variables), "parameters": int(s.num_parameters),
                    "version": int(s.version), "round": int(s.round), "pushes_applied": int(s.pushes_applied),
                    "examples_applied": int(s.examples_applied),
                    # When the server deals the data (--elastic): each epoch's examples, each counted once.
                    "epoch_examples": [int(n) for n in s.epoch_examples], "num_examples": int(s.num_examples),
                    "tasks_total": int(s.tasks_total), "tasks_done": int(s.tasks_done)})
        if i == 0:
            membership = [{"wall_time": e.wall_time, "round": int(e.round), "version": int(e.version),
                           "event": e.event, "worker_id": int(e.worker_id), "worker_name": e.worker_name}
                          for e in s.membership]
    return out, membership


def _wait_for_workers(workers: list[Child], servers: list[Child]) -> list[Child]:
    """Until every worker exited; returns the failed ones (stopping the rest at the first failure)."""
    while True:
        codes = [w.poll() for w in workers]
        failed = [w for w, c in zip(workers, codes) if c not in (None, 0)]
        if failed:
            return failed
        for i, server in enumerate(servers):
            if server.poll() is not None:
                name = "ps-server" if len(servers) == 1 else f"ps-server shard {i}"
                print(f"ps-launch: {name} exited with status {server.proc.returncode} while training",
                      file=sys.stderr)
                return [server]
        if all(c == 0 for c in codes):
            return []
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    dashes = "--" in argv  # everything after the first -- is the command, as given
    before, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if dashes else (argv, [])
    if "--elastic-min-workers" in before:  # ps-server's flag; ps-launch sets it from --elastic
        print("ps-launch: error: --elastic-min-workers: give --elastic MIN:MAX (the server's minimum and most "
              "workers; the workers then run ps-worker --elastic)", file=sys.stderr)
        return 2
    args = parser().parse_args(before)
    try:
        if args.command:
            raise LaunchError(f"unrecognized arguments: {' '.join(args.command)} (a command to run goes after --)")
        if dashes and not command:
            raise LaunchError("-- needs a command after it")
        args.command = command
        return run(args)
    except LaunchError as e:
        print(f"ps-launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
