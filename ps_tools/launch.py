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
server holds at the end). ``--save-model F.keras``: the chief saves the trained
model. ``--metrics-port P``: Prometheus endpoints on loopback, server shard I on
P+I and worker I on P+M+I (M servers).
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
from ps_common.names import MODES, STALE_POLICIES
from ps_common.procs import ServerStartError, dying_with_parent, wait_for_port_file
from worker.config import ConfigError, WorkerConfig, add_training_flags, training_flags

class LaunchError(RuntimeError):
    pass


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


def _non_negative_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {raw!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {raw!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-launch",
        description="Train with one ps-server and N ps-worker processes on this machine.",
    )
    p.add_argument("--mode", choices=MODES, default="sync", help=f"{', '.join(MODES)} (default sync)")
    p.add_argument("--workers", type=int, default=2, help="number of worker processes (default 2)")
    p.add_argument("--barrier-timeout", type=float, default=60.0, help="sync barrier timeout in seconds (default 60)")
    p.add_argument("--metrics-json", help="write the run's metrics here")
    p.add_argument("--save-model", help="the chief saves the trained model here as a Keras file (.keras)")
    p.add_argument("--server-start-timeout", type=float, default=60.0, help="seconds to wait for the server (default 60)")
    p.add_argument("--num-ps", type=int, default=1,
                   help="server shards: the variables are spread over this many ps-server processes (default 1)")
    p.add_argument("--replicas-to-aggregate", type=int,
                   help="sync backup workers: finish each round with the first K pushes (one server only)")
    p.add_argument("--checkpoint-dir", help="servers checkpoint here (shard I of several in DIR/shard-I)")
    # Passed to the server(s) only when given; ps-server checks them and says what is wrong.
    p.add_argument("--staleness", type=_non_negative_int, help="ps-server --staleness (ssp: the bound S)")
    p.add_argument("--stale-gradient-policy", choices=STALE_POLICIES, help="ps-server --stale-gradient-policy")
    p.add_argument("--max-staleness", type=_non_negative_int, help="ps-server --max-staleness (policy drop)")
    p.add_argument("--worker-args", nargs=2, action="append", metavar=("I", "ARGS"), default=[],
                   help="more ps-worker arguments for worker I only, as one shell-quoted string, e.g. "
                   "--worker-args 1 \"--slowdown 3 --history-json h1.json\" (repeatable; a lone flag "
                   "needs a space to stay one string: \" --no-shm\")")
    add_training_flags(p)
    return p


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
    return [sys.executable, "-m", "worker", "--ps", ",".join(addresses), "--worker-index", str(index),
            "--num-workers", str(args.workers), *flags, *extra]


def server_argv(args: argparse.Namespace, shard: int, port_file: str) -> list[str]:
    """The command line of server ``shard`` (0 .. --num-ps - 1)."""
    argv = [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
            "--mode", args.mode, "--num-workers", str(args.workers), "--barrier-timeout", str(args.barrier_timeout)]
    if args.replicas_to_aggregate is not None:
        argv += ["--replicas-to-aggregate", str(args.replicas_to_aggregate)]
    if args.checkpoint_dir:
        directory = args.checkpoint_dir if args.num_ps == 1 else os.path.join(args.checkpoint_dir, f"shard-{shard}")
        argv += ["--checkpoint-dir", directory]
    for flag in ("--staleness", "--stale-gradient-policy", "--max-staleness"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    if args.auth_token_file:
        argv += ["--auth-token-file", args.auth_token_file]
    if args.metrics_port:  # Prometheus: shard I on --metrics-port + I (workers after them)
        argv += ["--metrics-port", str(args.metrics_port + shard)]
    return argv


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise LaunchError(f"--workers must be >= 1, got {args.workers}")
    if args.num_ps < 1:
        raise LaunchError(f"--num-ps must be >= 1, got {args.num_ps}")
    if args.replicas_to_aggregate is not None and args.num_ps > 1:
        raise LaunchError(f"--replicas-to-aggregate (backup workers) cannot be used with --num-ps {args.num_ps}: "
                          "each server shard would drop different workers' gradients")
    if args.tls_ca_file or args.tls_cert_file or args.tls_key_file or args.tls_server_name:
        raise LaunchError("ps-launch runs every process on loopback without TLS; for TLS start ps-server "
                          "and ps-worker by hand (README, Security). A bearer token works: TFPS_AUTH_TOKEN "
                          "or --auth-token-file reaches the server and every worker")
    extra = worker_extra_args(args)
    # Fail on a bad combination now, with the worker's own message, not in N processes.
    for i in sorted({0, *extra}):
        try:
            WorkerConfig.from_args(training_flags(args) + extra.get(i, []) + ["--num-workers", str(args.workers),
                                                                              "--worker-index", str(i)], environ={})
        except ConfigError as e:
            raise LaunchError(f"worker {i}: {e}" if i in extra else str(e)) from None

    out_lock = threading.Lock()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)  # the launcher describes the cluster itself
    for key, value in wire.ALLOCATOR_ENV.items():  # large messages without page faults (BENCHMARKS.md)
        env.setdefault(key, value)
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
        "mode": args.mode,
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
        f"ps-launch: {args.mode} with {args.workers} workers{servers_text}: {metrics['steps']} steps, "
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
