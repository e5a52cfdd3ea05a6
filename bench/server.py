"""Server benchmark: aggregation and Adam apply against NumPy's own add bandwidth,
and pushes/s of 64 simulated workers against 1 server vs 2 servers, in one run.

    python bench/server.py --sizes 1,10,100 --reps 9 --clients 64 --steps 30 --json-out server.json

In-process (no network), for each allocator setting (glibc's default, and
"tuned" = ``protos.wire.ALLOCATOR_ENV``), in a fresh process started with it,
on float32 arrays of each ``--sizes`` MiB:

- numpy add: ``acc += g`` (``np.add(acc, g, out=acc)``), the bandwidth to beat;
- aggregate k: ``ps_server.core.modes.aggregation.weighted_mean`` of k = 2 and 8
  pushes, the sync round's batch-weighted mean (a fresh result array each call,
  as in the server), by the rule a server uses for that round: held whole and
  summed in worker order while the k pushes fit ``HELD_BYTES`` (256 MiB), else
  folded exactly;
- fold 8: the exact fold of 8 pushes whatever their size (``RoundSum(hold=False)``),
  what a round beyond ``HELD_BYTES`` costs;
- adam apply: ``VariableStore.apply_all`` of one gradient with Adam (Keras-exact,
  copy-on-write: new value and slots each step), fused into one pass where numba
  is installed (``ps_server.core.optim.kernels``; ``TFPS_KERNELS=numpy`` for the NumPy
  step; ``bench/optimizer_step.py`` times both side by side).

Throughput is gradient bytes in per second (k x size for aggregate k), the
median of ``--reps`` after one warm-up, all of them taking turns in each
repetition; each is also given as a ratio to numpy add of the same size in
the same process.

Load (``--clients`` simulated workers, in ``--procs`` client processes as
threads, as ``bench/load_test.py`` runs them; every process started with the
tuned allocator): a model of 4 float32 variables of ``--model-mib`` / 4 each,
Adam. Against 1 server, each worker pulls and pushes the whole model per step;
against 2 servers, each server holds 2 of the 4 variables (half the bytes), and
each worker pulls and pushes its half to each server from two threads in
parallel, and starts its next step when both answered. Every worker does
``--steps`` steps, in ``--modes`` sync and async. A push here is one worker's
gradient for the whole model (to 2 servers it is two calls, counted once);
MiB/s counts gradient bytes pushed. The ratio is 2 servers / 1 server. The
time runs from the moment every worker is registered to the last worker's
last reply; the CPU the servers and the client processes used in it is
printed beside (x 100 of one CPU: on 2 cores, 200 % is the whole machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from protos import wire  # noqa: E402
from ps_common.procs import dying_with_parent, wait_for_port_file  # noqa: E402

MIB = 2**20
TUNED = wire.ALLOCATOR_ENV
ALLOCATORS = {"default": {}, "tuned": TUNED}
ADAM = {"name": "adam", "learning_rate": 1e-3}
CALL_TIMEOUT = 120.0
NUM_VARIABLES = 4


def _env(alloc: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TUNED}
    env.update(ALLOCATORS[alloc])
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    return env


# -- in-process: aggregation and apply vs NumPy ------------------------------------------
def measure_inprocess(sizes: list[int], reps: int) -> dict:
    """GiB/s of gradient bytes for numpy add, aggregate 2 and 8, adam apply, per size in MiB."""
    return {mib: _measure_size(mib, reps) for mib in sizes}


def _measure_size(mib: int, reps: int) -> dict[str, float]:
    """They take turns within each repetition, so a burst of other work on the
    machine slows all of them alike rather than one."""
    from ps_server.core.modes.aggregation import RoundSum, weighted_mean
    from ps_server.core.optim.optimizers import OptimizerSpec
    from ps_server.core.store import VariableStore

    n = mib * MIB // 4
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(n, dtype=np.float32) for _ in range(8)]
    acc = np.zeros(n, np.float32)
    store = VariableStore()
    store.initialize({"w": np.zeros(n, np.float32)}, OptimizerSpec("adam", learning_rate=1e-3))
    pushes = {k: [(32, {"w": g}) for g in grads[:k]] for k in (2, 8)}
    gib = mib / 1024
    work = {  # name: (GiB of gradients in, one call)
        "numpy_add": (gib, lambda: np.add(acc, grads[0], out=acc)),
        "aggregate_2": (2 * gib, lambda: weighted_mean(pushes[2])),
        "aggregate_8": (8 * gib, lambda: weighted_mean(pushes[8])),
        "fold_8": (8 * gib, lambda: _folded(RoundSum(), pushes[8])),
        "adam_apply": (gib, lambda: store.apply_all({"w": grads[0]})),
    }
    times: dict[str, list[float]] = {name: [] for name in work}
    for _, fn in work.values():
        fn()  # warm-up: first-touch allocations
    for _ in range(reps):
        for name, (_, fn) in work.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: size / statistics.median(times[name]) for name, (size, _) in work.items()}


def _folded(total, pushes):
    for worker, (b, grads) in enumerate(pushes):
        total.add(worker, b, grads)
    return total.mean()


# -- load: 64 workers against 1 or 2 servers -------------------------------------------
def _variables(model_mib: float) -> dict[str, np.ndarray]:
    n = max(1, int(model_mib * MIB / 4 / NUM_VARIABLES))
    return {f"w{i}": np.zeros(n, np.float32) for i in range(NUM_VARIABLES)}


def _placement(names: list[str], num_servers: int) -> list[list[str]]:
    """Server s holds a contiguous, equal share of the (equal-sized) variables."""
    per = len(names) // num_servers
    return [names[s * per:(s + 1) * per] for s in range(num_servers)]


def _start_servers(mode: str, clients: int, num_servers: int, workdir: str) -> tuple[list, list[str]]:
    procs, addresses = [], []
    for s in range(num_servers):
        port_file = os.path.join(workdir, f"port-{mode}-{num_servers}-{s}")
        proc = subprocess.Popen(
            dying_with_parent([sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                               "--port-file", port_file, "--mode", mode, "--num-workers", str(clients),
                               "--threads", str(2 * clients + 16), "--lease-timeout", "3600",
                               "--barrier-timeout", str(CALL_TIMEOUT), "--log-level", "WARNING"]),
            env=dict(os.environ), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(proc)
        addresses.append(f"127.0.0.1:{wait_for_port_file(port_file, proc, 60)}")
    return procs, addresses


def _worker_shard(address: str, names: list[str], index: int, clients: int, steps: int, variables: dict,
                  ready: threading.Barrier, go: threading.Event, together: threading.Barrier) -> None:
    """One worker's traffic to one server: ``steps`` pulls and pushes of its variables."""
    from worker.client import PSClient

    grads = {name: np.ones_like(variables[name]) for name in names}
    with PSClient(address, timeout=CALL_TIMEOUT) as client:
        reg = client.register(index, clients, name=f"server-bench-{index}")
        if index == 0:  # the chief's job
            client.initialize(reg.worker_id, {name: variables[name] for name in names}, ADAM)
        client.wait_initialized(reg.worker_id, CALL_TIMEOUT)
        ready.wait(CALL_TIMEOUT)
        go.wait(CALL_TIMEOUT)
        for step in range(steps):
            version, _ = client.pull(reg.worker_id)
            client.push(reg.worker_id, step, version, 1, grads)
            together.wait(CALL_TIMEOUT)  # the worker's next step needs every server's answer


def run_client_process(addresses: list[str], indices: list[int], clients: int, steps: int,
                       model_mib: float) -> dict:
    """The workers ``indices`` as threads (one per worker and server).

    Prints ``ready`` once all of them registered, starts them when a line
    arrives on stdin; returns the time the last one finished and the CPU
    seconds this process used from the start.
    """
    variables = _variables(model_mib)
    shares = _placement(list(variables), len(addresses))
    ready = threading.Barrier(len(indices) * len(addresses) + 1)
    go = threading.Event()
    with futures.ThreadPoolExecutor(len(indices) * len(addresses)) as pool:
        jobs = []
        for i in indices:
            together = threading.Barrier(len(addresses))
            jobs += [pool.submit(_worker_shard, a, names, i, clients, steps, variables, ready, go, together)
                     for a, names in zip(addresses, shares)]
        ready.wait(CALL_TIMEOUT)
        print("ready", flush=True)
        sys.stdin.readline()
        cpu = sum(os.times()[:2])
        go.set()
        for job in jobs:
            job.result()
    # CLOCK_MONOTONIC: comparable across processes of one machine.
    return {"end": time.monotonic(), "cpu_s": sum(os.times()[:2]) - cpu}


def _cpu_s(pid: int) -> float:
    """utime + stime of a live process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_load(mode: str, num_servers: int, clients: int, procs: int, steps: int, model_mib: float) -> dict:
    """Pushes/s and MiB/s of ``clients`` workers against ``num_servers`` fresh servers.

    This process never uses gRPC itself (the workers initialize the servers).
    """
    variables = _variables(model_mib)
    with tempfile.TemporaryDirectory(prefix="tfps-server-bench-") as workdir:
        servers, addresses = _start_servers(mode, clients, num_servers, workdir)
        children: list[subprocess.Popen] = []
        try:
            nprocs = max(1, min(procs, clients))
            for p in range(nprocs):
                children.append(subprocess.Popen(
                    dying_with_parent([sys.executable, os.path.abspath(__file__), "--child", "clients",
                                       "--addresses", ",".join(addresses),
                                       "--indices", ",".join(map(str, range(p, clients, nprocs))),
                                       "--clients", str(clients), "--steps", str(steps),
                                       "--model-mib", str(model_mib)]),
                    env=dict(os.environ), cwd=ROOT, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            for c in children:  # every worker registered: start them all at once
                if c.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"client process failed to start: {c.communicate()[1][-1500:]}")
            t_start = time.monotonic()
            server_cpu = sum(_cpu_s(s.pid) for s in servers)
            for c in children:
                c.stdin.write("go\n")
                c.stdin.flush()
            tallies = []
            for c in children:
                out, err = c.communicate(timeout=CALL_TIMEOUT * (steps + 1))
                if c.returncode != 0:
                    raise RuntimeError(f"{mode} clients against {num_servers} server(s) failed: {err[-1500:]}")
                tallies.append(json.loads(out.strip().splitlines()[-1]))
            server_cpu = sum(_cpu_s(s.pid) for s in servers) - server_cpu
        finally:
            for p in [*children, *servers]:
                if p.poll() is None:
                    p.kill()
                p.wait()
    elapsed = max(t["end"] for t in tallies) - t_start
    pushes = clients * steps
    model_bytes = sum(v.nbytes for v in variables.values())
    return {"pushes": pushes, "elapsed_s": elapsed, "pushes_per_s": pushes / elapsed,
            "mib_per_s": pushes * model_bytes / elapsed / MIB,
            # Of the machine's CPUs, x 100: where the time went (servers vs the simulated workers).
            "server_cpu_percent": 100 * server_cpu / elapsed,
            "client_cpu_percent": 100 * sum(t["cpu_s"] for t in tallies) / elapsed}


# -- driver ----------------------------------------------------------------------------
def _child(args: argparse.Namespace) -> None:
    if args.child == "inprocess":
        sizes = [int(s) for s in args.sizes.split(",")]
        print(json.dumps(measure_inprocess(sizes, args.reps)))
    elif args.child == "load":
        print(json.dumps({mode: {n: measure_load(mode, n, args.clients, args.procs, args.steps, args.model_mib)
                                 for n in (1, 2)} for mode in args.modes.split(",")}))
    else:
        indices = [int(i) for i in args.indices.split(",")]
        print(json.dumps(run_client_process(args.addresses.split(","), indices, args.clients, args.steps,
                                            args.model_mib)))


def _run_child(argv: list[str], alloc: str) -> dict:
    run = subprocess.run(dying_with_parent([sys.executable, os.path.abspath(__file__), *argv]),
                         capture_output=True, text=True, env=_env(alloc), timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"{argv[1]} ({alloc}) failed: {run.stderr[-1500:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,10,100", help="in-process sizes in MiB, comma-separated (default 1,10,100)")
    p.add_argument("--reps", type=int, default=9, help="in-process repetitions (default 9)")
    p.add_argument("--clients", type=int, default=64, help="simulated workers for the load part (default 64)")
    p.add_argument("--procs", type=int, default=2, help="client processes they run in, as threads (default 2)")
    p.add_argument("--steps", type=int, default=30, help="steps per worker (default 30)")
    p.add_argument("--model-mib", type=float, default=2.0, help="the load part's model, MiB of float32 (default 2)")
    p.add_argument("--modes", default="sync,async", help="load modes, comma-separated (default sync,async)")
    p.add_argument("--json-out")
    p.add_argument("--child", choices=("inprocess", "load", "clients"), help=argparse.SUPPRESS)
    p.add_argument("--addresses", help=argparse.SUPPRESS)
    p.add_argument("--indices", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    modes = args.modes.split(",")
    if args.reps < 1 or args.clients < 1 or args.procs < 1 or args.steps < 1 or not args.model_mib > 0 \
            or not set(modes) <= {"sync", "async"}:
        p.error("--reps, --clients, --procs, --steps and --model-mib must be positive; --modes sync and/or async")
    sizes = [int(s) for s in args.sizes.split(",")]
    inprocess = {alloc: {int(k): v for k, v in _run_child(["--child", "inprocess", "--sizes", args.sizes,
                                                            "--reps", str(args.reps)], alloc).items()}
                 for alloc in ALLOCATORS}
    load = _run_child(["--child", "load", "--clients", str(args.clients), "--procs", str(args.procs),
                       "--steps", str(args.steps), "--model-mib", str(args.model_mib), "--modes", args.modes],
                      "tuned")
    load = {mode: {int(k): v for k, v in r.items()} for mode, r in load.items()}

    print(f"in-process, GiB/s of gradient bytes (median of {args.reps}); ratios to numpy add, same process")
    print(f"{'allocator':<9} {'MiB':>4} {'numpy add':>9} {'agg 2':>7} {'agg 8':>7} {'fold 8':>7} {'adam':>7} "
          f"{'agg2/add':>9} {'agg8/add':>9} {'fold8/add':>9} {'adam/add':>9}")
    for alloc, rows in inprocess.items():
        for mib in sizes:
            r = rows[mib]
            for k in ("aggregate_2", "aggregate_8", "fold_8", "adam_apply"):
                r[f"{k}_ratio"] = r[k] / r["numpy_add"]
            print(f"{alloc:<9} {mib:>4} {r['numpy_add']:9.2f} {r['aggregate_2']:7.2f} {r['aggregate_8']:7.2f} "
                  f"{r['fold_8']:7.2f} {r['adam_apply']:7.2f} {r['aggregate_2_ratio']:9.2f} "
                  f"{r['aggregate_8_ratio']:9.2f} {r['fold_8_ratio']:9.2f} {r['adam_apply_ratio']:9.2f}")
    model_mib = NUM_VARIABLES * max(1, int(args.model_mib * MIB / 4 / NUM_VARIABLES)) * 4 / MIB
    print(f"\nload: {args.clients} workers in {args.procs} processes, {args.steps} steps each, "
          f"{model_mib:g} MiB model, Adam, tuned allocator")
    print(f"{'mode':<6} {'servers':>7} {'pushes/s':>9} {'MiB/s':>8} {'elapsed s':>9} {'server CPU %':>12} "
          f"{'client CPU %':>12} {'2 / 1':>6}")
    for mode, r in load.items():
        r["ratio_2_over_1"] = r[2]["pushes_per_s"] / r[1]["pushes_per_s"]
        for n in (1, 2):
            ratio = f"{r['ratio_2_over_1']:6.2f}" if n == 2 else ""
            print(f"{mode:<6} {n:>7} {r[n]['pushes_per_s']:9.1f} {r[n]['mib_per_s']:8.1f} {r[n]['elapsed_s']:9.2f} "
                  f"{r[n]['server_cpu_percent']:12.0f} {r[n]['client_cpu_percent']:12.0f} {ratio}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"sizes_mib": sizes, "reps": args.reps, "gib_per_s": inprocess,
                       "load": {"clients": args.clients, "procs": args.procs, "steps": args.steps,
                                "model_mib": model_mib, "results": load}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
