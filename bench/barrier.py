"""Barrier benchmark: the latency of one sync round of a tiny model with 2, 4, 8
and 16 workers, through our server and through a bare gRPC barrier, in one run.

    python bench/barrier.py --workers 2,4,8,16 --rounds 500 --json-out barrier.json

For each worker count N it starts, one after the other, two servers as fresh
processes on 127.0.0.1 and the same N simulated workers against each:

- ours: a real ``ps-server --mode sync --num-workers N`` holding one float32
  variable of 10 elements (SGD). Worker 0 initializes it; then every round each
  worker pulls (``PSClient.pull``) and pushes a gradient (``PSClient.push``),
  which returns when all N pushes of the round arrived and the step was applied.
  The calls ride each worker's Session stream (one long-lived call, issue 29).
- unary: the same with ``PSClient(session=False)``: one Push call per round.
- bare: the bare barrier round trip, a gRPC server in this file with a generic
  handler and two raw-bytes methods (no protobuf, no store): ``Get`` answers 40
  bytes at once (the pull), ``Arrive`` answers every caller once the Nth caller
  of the round arrived (the push). Same channel options as ``PSClient``, same
  handler pool as ours before its handlers stopped blocking (a sync gRPC server,
  2N + 8 threads: a bare barrier holds one thread per waiting worker; ours now
  holds none, ``ps_server.aio``), same client loop.

A round's latency is measured by each worker from sending its push (or Arrive)
to the reply: N samples per round. The first ``--warmup`` rounds are left out
(process start-up skew). It prints p50 and p99 of each, the ratios ours/bare
at each N, each pair from the same run. Every process is started with the
tuned allocator setting (``protos.wire.ALLOCATOR_ENV``, which ``ps-launch``
uses).

Workers as threads or as processes: the N workers run as threads spread over
``--procs`` client processes (0: one process per worker). Measured on 2 shared
cores, 500 rounds, twice each: with all workers as threads of one process the
GIL serializes the clients' Python, and ours (more Python per call than bare)
suffers most: p50 ratio 3.0-3.6. With one process per worker, 17 processes
share the 2 cores: ours' p99 at N=16 rose to 27-29 ms (16-19 ms with 2
processes). Two client processes, the default (as in ``bench/load_test.py``),
gave p50 ratios of 2.3-3.2 with the steadiest p99; bare's own p50 hardly
moved with the setting (0.44-0.50 ms at N=2, 3.0-3.8 ms at N=16).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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

KINDS = ("ours", "unary", "bare")
BARE_SERVICE = "tfps.bench.BareBarrier"
ELEMENTS = 10  # the tiny model: one float32 variable of 10 elements
CALL_TIMEOUT = 60.0  # every call and every barrier wait is bounded by this
SGD = {"name": "sgd", "learning_rate": 1e-3}


def _env() -> dict:
    env = dict(os.environ, **wire.ALLOCATOR_ENV)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TF_CONFIG", None)
    return env


# -- the bare barrier server ---------------------------------------------------------
def serve_bare(num_workers: int, port_file: str) -> None:
    """A gRPC server that only holds a barrier: Arrive answers all callers of a round at once."""
    import grpc

    barrier = threading.Barrier(num_workers)  # cyclic: each round is a new generation
    payload = np.zeros(ELEMENTS, np.float32).tobytes()

    def get(request: bytes, context) -> bytes:
        return payload

    def arrive(request: bytes, context) -> bytes:
        try:
            barrier.wait(CALL_TIMEOUT)
        except threading.BrokenBarrierError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the barrier broke: a worker never arrived")
        return b"\x01"

    handler = grpc.method_handlers_generic_handler(BARE_SERVICE, {
        "Get": grpc.unary_unary_rpc_method_handler(get),
        "Arrive": grpc.unary_unary_rpc_method_handler(arrive),
    })
    pool = futures.ThreadPoolExecutor(max(16, 2 * num_workers + 8))  # a thread per waiter, and room
    server = grpc.server(pool, handlers=[handler], options=wire.server_options())
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with open(port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(port_file + ".tmp", port_file)
    server.wait_for_termination()


# -- the simulated workers -------------------------------------------------------------
def _ours_worker(address: str, index: int, n: int, rounds: int, session: bool = True) -> list[float]:
    from worker.client import PSClient

    grads = {"w": np.ones(ELEMENTS, np.float32)}
    latencies = []
    with PSClient(address, timeout=CALL_TIMEOUT, session=session) as client:
        reg = client.register(index, n, name=f"barrier-bench-{index}")
        if index == 0:
            client.initialize(reg.worker_id, {"w": np.zeros(ELEMENTS, np.float32)}, SGD)
        client.wait_initialized(reg.worker_id, CALL_TIMEOUT)
        for step in range(rounds):
            version, _ = client.pull(reg.worker_id)
            t = time.perf_counter()
            reply = client.push(reg.worker_id, step, version, 1, grads)
            latencies.append(time.perf_counter() - t)
            if reply.version != step + 1 or reply.contributors != n:
                raise RuntimeError(f"round {step} answered version {reply.version} "
                                   f"with {reply.contributors} of {n} contributors")
    return latencies


def _bare_worker(address: str, index: int, n: int, rounds: int) -> list[float]:
    import grpc

    from worker.client import SERVICE_CONFIG

    options = wire.channel_options() + [("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]
    payload = np.ones(ELEMENTS, np.float32).tobytes()
    latencies = []
    with grpc.insecure_channel(address, options=options) as channel:
        get = channel.unary_unary(f"/{BARE_SERVICE}/Get")
        arrive = channel.unary_unary(f"/{BARE_SERVICE}/Arrive")
        get(b"", timeout=CALL_TIMEOUT, wait_for_ready=True)
        for _ in range(rounds):
            get(b"", timeout=CALL_TIMEOUT)
            t = time.perf_counter()
            arrive(payload, timeout=CALL_TIMEOUT)
            latencies.append(time.perf_counter() - t)
    return latencies


def run_clients(kind: str, address: str, indices: list[int], n: int, rounds: int) -> dict[int, list[float]]:
    """Workers ``indices`` of ``n`` as threads of this process; their latencies in seconds."""
    fn = {"ours": _ours_worker, "unary": functools.partial(_ours_worker, session=False), "bare": _bare_worker}[kind]
    with futures.ThreadPoolExecutor(len(indices)) as pool:
        jobs = {i: pool.submit(fn, address, i, n, rounds) for i in indices}
        return {i: job.result() for i, job in jobs.items()}


# -- one measurement -------------------------------------------------------------------
def measure(kind: str, n: int, rounds: int, warmup: int, procs: int) -> dict:
    """p50 and p99 of the round latency, in ms, for ``n`` workers against a fresh server of ``kind``."""
    env = _env()
    with tempfile.TemporaryDirectory(prefix="tfps-barrier-") as tmp:
        port_file = os.path.join(tmp, "port")
        if kind in ("ours", "unary"):
            argv = [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
                    "--mode", "sync", "--num-workers", str(n), "--lease-timeout", "3600",
                    "--barrier-timeout", str(CALL_TIMEOUT), "--log-level", "WARNING"]
        else:
            argv = [sys.executable, os.path.abspath(__file__), "--child", "bare-server", "--workers", str(n),
                    "--port-file", port_file]
        log_path = os.path.join(tmp, "server.log")
        with open(log_path, "w") as log:
            server = subprocess.Popen(dying_with_parent(argv), env=env, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT)
        clients: list[subprocess.Popen] = []
        try:
            address = f"127.0.0.1:{wait_for_port_file(port_file, server, 60)}"
            nprocs = n if procs == 0 else min(procs, n)
            for p in range(nprocs):
                indices = ",".join(str(i) for i in range(p, n, nprocs))
                clients.append(subprocess.Popen(
                    dying_with_parent([sys.executable, os.path.abspath(__file__), "--child", "clients", "--kind", kind,
                                       "--address", address, "--indices", indices, "--workers", str(n),
                                       "--rounds", str(warmup + rounds)]),
                    env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            per_worker: dict[int, list[float]] = {}
            for c in clients:
                out, err = c.communicate(timeout=CALL_TIMEOUT * (warmup + rounds))
                if c.returncode != 0:
                    with open(log_path) as f:
                        raise RuntimeError(f"{kind} clients failed (N={n}): {err[-1500:]}\nserver: {f.read()[-1500:]}")
                per_worker.update({int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()})
        finally:
            for p in [*clients, server]:
                if p.poll() is None:
                    p.kill()
                p.wait()
    samples = np.array([x for lat in per_worker.values() for x in lat[warmup:]]) * 1e3
    return {"p50_ms": float(np.percentile(samples, 50)), "p99_ms": float(np.percentile(samples, 99)),
            "samples": int(samples.size)}


# -- driver ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4,8,16", help="worker counts N, comma-separated (default 2,4,8,16)")
    p.add_argument("--rounds", type=int, default=500, help="measured rounds per N and kind (default 500)")
    p.add_argument("--warmup", type=int, default=20, help="rounds left out first (default 20)")
    p.add_argument("--procs", type=int, default=2,
                   help="client processes the workers are spread over as threads; 0: one per worker (default 2)")
    p.add_argument("--json-out")
    p.add_argument("--child", choices=("bare-server", "clients"), help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--indices", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "bare-server":
        serve_bare(int(args.workers), args.port_file)
        return 0
    if args.child == "clients":
        indices = [int(i) for i in args.indices.split(",")]
        print(json.dumps(run_clients(args.kind, args.address, indices, int(args.workers), args.rounds)))
        return 0
    counts = [int(s) for s in args.workers.split(",")]
    if args.rounds < 1 or args.warmup < 0 or args.procs < 0 or min(counts) < 1:
        p.error("--rounds and --workers must be positive, --warmup and --procs not negative")
    results: dict = {}
    for n in counts:
        results[n] = {kind: measure(kind, n, args.rounds, args.warmup, args.procs) for kind in KINDS}
    procs = "one per worker" if args.procs == 0 else str(args.procs)
    print(f"sync-round latency, ms: push sent -> reply, {args.rounds} rounds x N workers, client processes: {procs}")
    print("ours: pushes on the worker's Session stream; unary: one Push call each (PSClient(session=False))")
    print(f"{'N':>3} {'ours p50':>9} {'ours p99':>9} {'unary p50':>10} {'bare p50':>9} {'bare p99':>9} "
          f"{'p50 ratio':>10} {'p99 ratio':>10} {'unary/bare':>11}")
    for n, r in results.items():
        ours, unary, bare = r["ours"], r["unary"], r["bare"]
        r["p50_ratio"] = ours["p50_ms"] / bare["p50_ms"]
        r["p99_ratio"] = ours["p99_ms"] / bare["p99_ms"]
        r["unary_p50_ratio"] = unary["p50_ms"] / bare["p50_ms"]
        print(f"{n:>3} {ours['p50_ms']:9.3f} {ours['p99_ms']:9.3f} {unary['p50_ms']:10.3f} {bare['p50_ms']:9.3f} "
              f"{bare['p99_ms']:9.3f} {r['p50_ratio']:10.2f} {r['p99_ratio']:10.2f} {r['unary_p50_ratio']:11.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"workers": counts, "rounds": args.rounds, "warmup": args.warmup, "procs": args.procs,
                       "elements": ELEMENTS, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
