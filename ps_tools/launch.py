"""``ps-launch``: one server (or M server shards) and N workers as separate OS processes on loopback.

    ps-launch --mode sync --workers 2 --dataset digits --epochs 3 --metrics-json m.json
    ps-launch --num-ps 2 --mode sync --workers 2 --dataset digits --epochs 3
    ps-launch --mode ssp --staleness 2 --workers 3 --worker-args 2 "--slowdown 3" --dataset digits

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
"""

from __future__ import annotations

import argparse
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
from ps_common.procs import ServerStartError, dying_with_parent, wait_for_port_file
from ps_common.settings import deprecated_env, to_json
from ps_server.config import ServerConfig
from worker.config import ConfigError, WorkerConfig, add_training_flags, training_flags


class LaunchError(RuntimeError):
    pass


_NO_TLS = ("ps-launch runs every process on loopback without TLS; for TLS start ps-server "
           "and ps-worker by hand (docs/security.md). A bearer token works: TFPS_AUTH_TOKEN "
           "or --auth-token-file reaches the server and every worker")


class Child:
    def __init__(self, label: str, argv: list[str], out_lock: threading.Lock, env: dict):
        self.label = label
        self.proc = subprocess.Popen(
            dying_with_parent(argv, signal.SIGTERM),  # SIGTERM: a server still writes its checkpoint
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )
        self._lock = out_lock
        self.tail: list[str] = []
        self._pump = threading.Thread(target=self._relay, name=f"relay-{label}", daemon=True)
        self._pump.start()

    def _relay(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail = (self.tail + [line])[-20:]
            with self._lock:
                print(f"[{self.label}] {line}", flush=True)

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
        self._pump.join(timeout=2.0)


_SET_BY_LAUNCH = ("ps", "worker_index", "num_workers", "result_json")  # --worker-args may not override these
# ps-server flags ps-launch sets itself, that are no setting of the server, or (TLS) that
# ps-launch, all on loopback, does without.
_SERVER_SET_BY_LAUNCH = ("help", "print_config", "host", "port", "port_file", "num_workers", "exit_when_done",
                         "tls_client_ca_file")
# Flags ps-worker and ps-server both have with the same meaning: given once, they reach both
# (--metrics-port too, with an offset per process). The others both have are the workers' alone:
# --shm (servers accept shared memory by default), and the TLS files, which ps-launch refuses.
_FOR_BOTH = ("log_level", "auth_token_file", "metrics_host", "max_message_mb", "metrics_port")
_WORKERS_ONLY = ("shm", "tls_cert_file", "tls_key_file")


def _non_negative_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {raw!r}")
    return value


# Stricter at the launcher than at the server, which says the same once it has started.
_LAUNCH_TYPES = {"staleness": _non_negative_int, "max_staleness": _non_negative_int}
_TLS_FIELDS = ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name", "tls_client_ca_file")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-launch",
        description="Train with one ps-server (or --num-ps shards) and N ps-worker processes on this machine.",
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker processes (default 2)")
    p.add_argument("--num-ps", type=int, default=1,
                   help="server shards: the variables are spread over this many ps-server processes (default 1)")
    p.add_argument("--metrics-json", help="write the run's metrics here")
    p.add_argument("--save-model", help="the chief saves the trained model here as a Keras file (.keras)")
    p.add_argument("--save-weights", help="the chief saves the final parameters here (.npz)")
    p.add_argument("--server-start-timeout", type=float, default=60.0, help="seconds to wait for the server (default 60)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration of every server and worker as JSON and exit")
    p.add_argument("--worker-args", nargs=2, action="append", metavar=("I", "ARGS"), default=[],
                   help="more ps-worker arguments for worker I only, as one shell-quoted string, e.g. "
                   "--worker-args 1 \"--slowdown 3 --history-json h1.json\" (repeatable; a lone flag "
                   "needs a space to stay one string: \" --no-shm\")")
    add_training_flags(p)
    add_server_flags(p)
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
            kind = _LAUNCH_TYPES.get(action.dest, action.type)
            g.add_argument(*action.option_strings, type=kind, choices=action.choices, metavar=action.metavar,
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
        if not 0 <= index < args.workers:
            raise LaunchError(f"--worker-args {index}: the workers are 0..{args.workers - 1}")
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
    return [sys.executable, "-m", "worker", "--ps", ",".join(addresses), "--worker-index", str(index),
            "--num-workers", str(args.workers), *flags, *extra]


def server_argv(args: argparse.Namespace, shard: int, port_file: str) -> list[str]:
    """The command line of server ``shard`` (0 .. --num-ps - 1): the ps-server flags given, in
    ps-server's order, a checkpoint directory of its own and its metrics port (``--metrics-port + shard``)."""
    argv = [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
            "--num-workers", str(args.workers), "--no-exit-when-done"]  # the launcher stops its servers
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


def resolved(args: argparse.Namespace, extra: dict[int, list[str]], env: dict) -> tuple[ServerConfig, list]:
    """The configuration each server and each worker will resolve from its command line and
    ``env`` (servers: that of shard 0; the others differ in checkpoint directory and metrics
    port), so that a bad combination fails now, with the child's own message, not in N processes."""
    try:
        server = ServerConfig.from_args(server_argv(args, 0, "(temporary)")[3:], environ=env)
    except ConfigError as e:
        raise LaunchError(f"ps-server: {e}") from None
    placeholders = [f"127.0.0.1:{i + 1}" for i in range(args.num_ps)]  # the ports are picked at start
    workers = []
    for i in range(args.workers):
        try:
            workers.append(WorkerConfig.from_args(worker_argv(args, i, placeholders, extra.get(i, []))[3:],
                                                  environ=env))
        except ConfigError as e:
            raise LaunchError(f"worker {i}: {e}" if i in extra else str(e)) from None
    return server, workers


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
                                                    "save_weights", "server_start_timeout")},
           "servers": servers,
           "workers": [{**json.loads(to_json(w)), "ps": ps} for w in workers]}
    print(json.dumps(doc, indent=2), flush=True)


def _shard_fields(args: argparse.Namespace, shard: int) -> dict:
    """What server ``shard`` has of its own (``server_argv``): its checkpoint directory and metrics port."""
    fields = {}
    if args.checkpoint_dir and args.num_ps > 1:
        fields["checkpoint_dir"] = os.path.join(args.checkpoint_dir, f"shard-{shard}")
    if args.metrics_port:
        fields["metrics_port"] = args.metrics_port + shard
    return fields


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise LaunchError(f"--workers must be >= 1, got {args.workers}")
    if args.num_ps < 1:
        raise LaunchError(f"--num-ps must be >= 1, got {args.num_ps}")
    if args.replicas_to_aggregate is not None and args.num_ps > 1:
        raise LaunchError(f"--replicas-to-aggregate (backup workers) cannot be used with --num-ps {args.num_ps}: "
                          "each server shard would drop different workers' gradients")
    if any(getattr(args, name, None) for name in _TLS_FIELDS):
        raise LaunchError(_NO_TLS)
    extra = worker_extra_args(args)
    env = child_environment()
    _refuse_ambiguous(env)
    server_config, worker_configs = resolved(args, extra, env)
    if server_config.tls_cert_file or any(w.tls_ca_file for w in worker_configs):
        raise LaunchError(_NO_TLS + " (TLS is set in the environment)")
    if args.print_config:
        print_config(args, server_config, worker_configs)
        return 0
    chief = worker_configs[0]
    servers_text = "1 ps-server" if args.num_ps == 1 else f"{args.num_ps} ps-server shards"
    print(f"ps-launch: {server_config.mode}, {args.workers} workers and {servers_text} on loopback, "
          f"training {chief.model} on {chief.dataset}", flush=True)

    out_lock = threading.Lock()
    children: list[Child] = []
    shards: list[dict] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ps-launch-") as tmp:
        result_file = os.path.join(tmp, "result.json")
        try:
            servers, port_files = [], []
            for i in range(args.num_ps):  # all start at once, then each is waited for
                port_files.append(os.path.join(tmp, f"port-{i}"))
                servers.append(Child("ps" if args.num_ps == 1 else f"ps {i}", server_argv(args, i, port_files[-1]),
                                     out_lock, env))
                children.append(servers[-1])
            deadline = time.monotonic() + args.server_start_timeout
            addresses = [_wait_for_server(server, port_file, max(1.0, deadline - time.monotonic()))
                         for server, port_file in zip(servers, port_files)]
            for i in range(args.workers):
                argv = worker_argv(args, i, addresses, extra.get(i, []))
                if i == 0:
                    argv += ["--result-json", result_file]
                children.append(Child(f"worker {i}", argv, out_lock, env))
            failed = _wait_for_workers(children[len(servers):], servers)
            if not failed:
                shards = _shard_summary(addresses, args.auth_token_file)
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
    }
    if args.num_ps > 1:
        for i, shard in enumerate(shards):
            print(f"ps-launch: shard {i} at {shard['address']} holds {shard['variables']} pieces "
                  f"({shard['parameters']:,} parameters), version {shard['version']}, round {shard['round']}",
                  flush=True)
    servers_text = f" and {args.num_ps} server shards" if args.num_ps > 1 else ""
    print(
        f"ps-launch: {server_config.mode} with {args.workers} workers{servers_text}: {metrics['steps']} steps, "
        f"test accuracy {metrics['test_accuracy']:.4f}, final loss {metrics['final_loss']:.4f}, "
        f"{metrics['examples_per_s']:.0f} examples/s, wall {wall_s:.1f} s",
        flush=True,
    )
    if args.metrics_json:
        tmp_path = args.metrics_json + ".tmp"
        with open(tmp_path, "w") as f:
            json.dump(metrics, f, indent=2)
        os.replace(tmp_path, args.metrics_json)
    return 0


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


def _shard_summary(addresses: list[str], token_file: str | None) -> list[dict]:
    """What each server holds at the end, from its Status (empty if one does not answer)."""
    from worker.client import PSClient, PSClientError

    out = []
    for address in addresses:
        try:
            with PSClient(address, timeout=10.0, token=security.load_token(token_file, os.environ)) as client:
                s = client.status()
        except (PSClientError, ConfigError) as e:
            print(f"ps-launch: no status from {address}: {e}", file=sys.stderr)
            return []
        out.append({"address": address, "variables": int(s.num_variables), "parameters": int(s.num_parameters),
                    "version": int(s.version), "round": int(s.round), "pushes_applied": int(s.pushes_applied)})
    return out


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
    args = parser().parse_args(argv)
    try:
        return run(args)
    except LaunchError as e:
        print(f"ps-launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
