"""Runner: our parameter server, sync or async, through the real gRPC server.

    python -m tf_strategies.ours --mode sync --spec-json '{"steps": 20, ...}' --out DIR

Starts one ``ps-server`` and ``spec.num_workers`` ``ps-worker`` processes on
127.0.0.1 (our server binds loopback only), from ``spec.initial_weights``,
with the spec's data order, seed and TensorFlow settings. Per-step losses come
from the workers' histories: in sync mode the batch-weighted mean of the
workers' shard losses per round (the loss of the global batch); in async mode
one entry per applied push, in the order the server applied them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tf_strategies.common import RunResult, RunSpec, load_initial_weights, save_result
from ps_common.procs import ServerStartError, dying_with_parent, wait_for_port_file

MODES = ("sync", "async")


class RunnerError(RuntimeError):
    pass


def _worker_flags(spec: RunSpec) -> list[str]:
    flags = ["--dataset", spec.dataset, "--model", spec.model, "--steps", str(spec.steps),
             "--global-batch-size", str(spec.global_batch_size), "--optimizer", spec.optimizer,
             "--learning-rate", repr(spec.lr), "--seed", str(spec.seed),
             "--intra-op-threads", str(spec.intra_op_threads),
             "--deterministic" if spec.deterministic else "--no-deterministic", "--log-every", "1000000"]
    if spec.loss_scaling != "global":
        raise RunnerError(f"our workers implement only the 'global' loss scaling, not {spec.loss_scaling!r}")
    return flags


def _worker_argv(spec: RunSpec, mode: str, i: int, address: str, tmp: str, snap: str, shm: bool) -> list[str]:
    """Worker ``i``'s command line; the chief's also writes the result and the snapshots."""
    argv = [sys.executable, "-m", "worker", "--ps", address, "--worker-index", str(i),
            "--num-workers", str(spec.num_workers), *_worker_flags(spec), *(["--shm"] if shm else []),
            "--history-json", os.path.join(tmp, f"history{i}.json")]
    if i == 0:
        argv += ["--result-json", os.path.join(tmp, "result.json"), "--snapshot-dir", snap]
        if spec.initial_weights:
            argv += ["--initial-weights", spec.initial_weights]
        if mode == "sync":
            argv += ["--snapshot-steps", "1"]
    return argv


def _outputs(spec: RunSpec, mode: str, tmp: str, snap: str) -> tuple:
    """What the finished workers wrote: (the chief's result, every worker's steps, the final
    weights, the weights after step 1 in sync, else None)."""
    with open(os.path.join(tmp, "result.json")) as f:
        chief = json.load(f)
    histories = []
    for i in range(spec.num_workers):
        with open(os.path.join(tmp, f"history{i}.json")) as f:
            histories.append(json.load(f)["steps"])
    final = load_initial_weights(os.path.join(snap, "final.npz"))
    step1 = load_initial_weights(os.path.join(snap, "step1.npz")) if mode == "sync" else None
    return chief, histories, final, step1


def run(spec: RunSpec, mode: str, timeout: float = 900.0, shm: bool = False) -> RunResult:
    """Train ``spec`` with one ps-server and ``spec.num_workers`` ps-worker processes;
    ``shm``: the workers ask for the same-host fast path (``ps-worker --shm``)."""
    if mode not in MODES:
        raise RunnerError(f"mode must be sync or async, got {mode!r}")
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="tfps-ours-") as tmp:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TF_CONFIG", None)

        def start(argv, name):
            log = open(os.path.join(tmp, f"{name}.log"), "w")
            p = subprocess.Popen(dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env)
            p.log_name = name
            procs.append(p)
            return p

        def log_tail(p) -> str:
            with open(os.path.join(tmp, f"{p.log_name}.log")) as f:
                return "".join(f.readlines()[-15:])

        try:
            port_file = os.path.join(tmp, "port")
            server = start([sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                            "--port-file", port_file, "--mode", mode, "--num-workers", str(spec.num_workers),
                            "--log-level", "WARNING"], "ps")
            try:
                address = f"127.0.0.1:{wait_for_port_file(port_file, server, 60)}"
            except ServerStartError as e:
                raise RunnerError(f"{e}:\n{log_tail(server)}") from None
            snap = os.path.join(tmp, "snap")
            os.makedirs(snap)
            workers = [start(_worker_argv(spec, mode, i, address, tmp, snap, shm), f"worker{i}")
                       for i in range(spec.num_workers)]
            deadline = time.monotonic() + timeout
            for w in workers:
                try:
                    code = w.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RunnerError(f"{w.log_name} still running after {timeout:g} s") from None
                if code != 0:
                    raise RunnerError(f"{w.log_name} exited with status {code}:\n{log_tail(w)}")
            chief, histories, final, step1 = _outputs(spec, mode, tmp, snap)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    return RunResult(
        runner=f"ours-{mode}" + ("-shm" if shm else ""),
        losses=_losses(histories, mode),
        weights_step1=step1,
        weights_final=final,
        test_accuracy=chief["test_accuracy"],
        steps_per_s=spec.steps / chief["train_s"] if chief["train_s"] > 0 else 0.0,
        examples=int(chief["examples"]),
        wall_s=time.monotonic() - started,
        notes=f"{spec.num_workers} workers, 1 ps, "
        + ("shared memory for payloads over 1 MiB, gRPC for the rest" if shm else "gRPC on loopback")
        + (f", mean staleness {chief['mean_staleness']:.2f}" if mode == "async" else ""),
    )


def _losses(histories: list[list[dict]], mode: str) -> list[float]:
    if mode == "sync":
        out = []
        for records in zip(*histories):
            total = sum(r["batch_size"] for r in records)
            out.append(sum(r["loss"] * r["batch_size"] for r in records) / total)
        return out
    pushes = sorted((r["version"], r["loss"]) for h in histories for r in h)
    return [loss for _, loss in pushes]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tf_strategies.ours", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--spec-json", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--shm", action="store_true", help="workers use the same-host fast path (shared memory)")
    args = p.parse_args(argv)
    try:
        result = run(RunSpec.from_json(args.spec_json), args.mode, args.timeout, shm=args.shm)
    except RunnerError as e:
        print(f"runner ours-{args.mode} failed: {e}", file=sys.stderr)
        return 1
    save_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
