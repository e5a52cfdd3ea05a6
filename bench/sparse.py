"""Sparse embedding pushes against dense ones: bytes on the wire and push latency, side by side.

    python bench/sparse.py --rows 100000 --dim 64 --touched 256,1024,10000 --reps 10 --json-out sparse.json

One real ``ps-server`` on 127.0.0.1 (async mode, Adam, ``--metrics-port``) holds
an embedding table of ``rows x dim`` float32 and a small dense kernel. For each
count of touched rows K, one client pushes, ``--reps`` times after a warm-up,
the gradient of a batch that touched K distinct rows: once as ``SparseRows``
(the K rows and their row numbers: what a worker sends for ``tf.IndexedSlices``)
and once made dense (the whole table, mostly zeros: what a worker without sparse
pushes sends). Both are applied the same way on the server (made dense, one
Adam step over the table).

Reported per K: request bytes per push as the server counted them
(``tfps_received_bytes_total`` of Push, PushStream and Session, scraped before and after),
the median push latency (the client's push call, apply included), and the
ratios dense/sparse of both. No pulls are timed.

    python bench/sparse.py --steps --tables 10000,100000,1000000,10000000 --touched 10000 --dim 64 \
        --reps 50 --json-out steps.json

``--steps``: training steps as an embedding worker takes them, one push of the
K touched rows (``SparseRows``, distinct rows) and one full pull (which with
row deltas brings the changed rows only), for each table size and each way the
server applies them (``--sparse-updates``, ``--configs``): ``dense:sgd`` (the
table made dense and stepped whole, the whole table pulled: what tfps did
before), ``exact:sgd`` and ``exact:adagrad`` (the touched rows stepped, the
dense step's bits), ``lazy:adam`` (TF Addons' LazyAdam). One fresh
``ps-server`` (async, one worker) per table and configuration, seeded through
Initialize. A table above 512 MiB is made by the server's own process instead:
``build_server`` of the same configuration in a child process that makes the
table itself and hands it to its core before serving (``--serve-seeded``,
internal). That path dates from when Initialize was one message (at most 2 GiB);
InitializeStream now carries any size, but seeding in place keeps this one
machine from holding the table twice (the client's and the server's). Reported: steps/s over ``--reps`` timed
steps after three warm-up ones (``--dense-reps`` for ``dense``, whose steps take
seconds at 10^7 rows), the median step, bytes the server sent per pull
(``tfps_sent_bytes_total`` of Pull and PullStream), and the first (whole) pull.
At the end the client's copy is checked bit for bit against a fresh full pull.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ps_server.core.optim.optimizers import OptimizerSpec  # noqa: E402
from ps_server.core.optim.sparse import SparseRows, densify  # noqa: E402
from ps_common.procs import dying_with_parent, wait_for_port_file  # noqa: E402
from tf_strategies.isolation import free_ports  # noqa: E402
from worker.client import PSClient  # noqa: E402

ADAM = {"name": "adam", "learning_rate": 0.001, "momentum": 0.0, "nesterov": False, "beta_1": 0.9,
        "beta_2": 0.999, "epsilon": 1e-7}


def _received_push_bytes(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tfps_received_bytes_total{") and any(
                f'method="{m}"' in line for m in ("Push", "PushStream", "Session")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _measure(client: PSClient, metrics_port: int, grads: dict, reps: int, step0: int) -> tuple[float, float, int]:
    """(request bytes per push, median seconds per push, next step)."""
    step = step0
    client.push(0, step, 0, 1, grads)  # warm-up
    step += 1
    before = _received_push_bytes(metrics_port)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        client.push(0, step, 0, 1, grads)
        times.append(time.perf_counter() - start)
        step += 1
    after = _received_push_bytes(metrics_port)
    return (after - before) / reps, statistics.median(times), step


def _sent_pull_bytes(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tfps_sent_bytes_total{") and ('method="Pull"' in line
                                                               or 'method="PullStream"' in line))


CONFIGS = {"dense:sgd": ("dense", OptimizerSpec("sgd", learning_rate=0.01)),
           "exact:sgd": ("exact", OptimizerSpec("sgd", learning_rate=0.01)),
           "exact:adagrad": ("exact", OptimizerSpec("adagrad", learning_rate=0.01)),
           "lazy:adam": ("lazy", OptimizerSpec("adam", learning_rate=0.001))}
SEEDED_ABOVE = 512 << 20  # bytes: a larger table is made by the server process itself (--serve-seeded)


def _variables(rows: int, dim: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"embedding": rng.standard_normal((rows, dim), dtype=np.float32),
            "kernel": rng.standard_normal((dim, 16)).astype(np.float32)}


def serve_seeded(argv: list[str]) -> int:
    """``--serve-seeded ROWS DIM OPTIMIZER -- ps-server flags``: a ps-server (build_server of
    those flags) whose variables this process makes and gives its core, then serves until
    killed; writes the port to --port-file once the table is in."""
    rows, dim, optimizer = int(argv[0]), int(argv[1]), argv[2]
    from protos import wire
    from ps_server.config import ServerConfig
    from ps_server.server import build_server
    wire.tune_allocator()
    config = ServerConfig.from_args(argv[4:])
    running = build_server(dataclasses.replace(config, port_file="")).start()
    running.core.register(0, 1)
    _, spec = CONFIGS[optimizer]
    variables = _variables(rows, dim)
    running.core.initialize(0, variables, spec)
    del variables
    with open(config.port_file + ".tmp", "w") as f:
        f.write(f"{running.port}\n")
    os.replace(config.port_file + ".tmp", config.port_file)
    threading.Event().wait()
    return 0


def _touched_sets(rng, rows: int, k: int, count: int) -> list[np.ndarray]:
    """``count`` sets of min(k, rows) distinct rows, increasing (what a worker pushes)."""
    k = min(k, rows)
    sets = []
    for _ in range(count):
        if rows <= 10 * k:
            sets.append(np.sort(rng.choice(rows, size=k, replace=False)).astype(np.int64))
            continue
        chosen = np.unique(rng.integers(0, rows, size=k))
        while len(chosen) < k:
            chosen = np.unique(np.concatenate([chosen, rng.integers(0, rows, size=k - len(chosen))]))
        sets.append(chosen.astype(np.int64))
    return sets


def _steps_one(rows: int, dim: int, k: int, config: str, reps: int, shm: bool, verify: bool, tmp: str) -> dict:
    sparse_updates, spec = CONFIGS[config]
    rng = np.random.default_rng(1)
    grpc_port, metrics_port = free_ports(2)
    seeded = rows * dim * 4 > SEEDED_ABOVE
    port_file = os.path.join(tmp, f"port-{rows}-{config.replace(':', '-')}")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    flags = ["--host", "127.0.0.1", "--port", str(grpc_port), "--port-file", port_file, "--mode", "async",
             "--num-workers", "1", "--metrics-port", str(metrics_port), "--sparse-updates", sparse_updates,
             "--log-level", "WARNING", "--lease-timeout", "600"]
    command = ([sys.executable, os.path.abspath(__file__), "--serve-seeded", str(rows), str(dim), config, "--"]
               if seeded else [sys.executable, "-m", "ps_server"]) + flags
    server = subprocess.Popen(dying_with_parent(command), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    sets = _touched_sets(rng, rows, k, 8)
    grads = [rng.standard_normal((len(r), dim), dtype=np.float32) for r in sets]
    try:
        port = wait_for_port_file(port_file, server, 600)
        with PSClient(f"127.0.0.1:{port}", timeout=600, shm=shm) as client:
            client.register(0, 1)
            if not seeded:
                client.initialize(0, _variables(rows, dim), spec.as_dict())
            kernel_grad = np.full((dim, 16), 1e-3, np.float32)
            start = time.perf_counter()
            version, _ = client.pull(0)
            first_pull_s = time.perf_counter() - start
            step, times = 0, []
            sent_before = None
            for i in range(3 + reps):
                if i == 3:
                    sent_before = _sent_pull_bytes(metrics_port)
                g = {"embedding": SparseRows(sets[i % len(sets)], grads[i % len(grads)]), "kernel": kernel_grad}
                start = time.perf_counter()
                client.push(0, step, version, 1, g)
                version, _ = client.pull(0)
                times.append(time.perf_counter() - start)
                step += 1
            timed = times[3:]
            pulled = (_sent_pull_bytes(metrics_port) - sent_before) / reps
            exact = None
            if verify:
                mine = client.pull(0)[1]  # nothing changed since: served from the held copy
                with PSClient(f"127.0.0.1:{port}", timeout=600) as other:
                    theirs = other.pull()[1]
                exact = all(np.array_equal(mine[n], theirs[n]) for n in theirs)
                del mine, theirs
    finally:
        server.kill()
        server.wait(timeout=60)
    return {"rows": rows, "config": config, "sparse_updates": sparse_updates, "optimizer": spec.name,
            "touched": len(sets[0]), "reps": reps, "steps_per_s": reps / sum(timed),
            "median_step_ms": 1e3 * statistics.median(timed), "pull_bytes_per_step": pulled,
            "first_pull_s": first_pull_s, "copy_bit_equal": exact, "seeded_in_the_server": seeded}


def steps(args) -> int:
    tables = [int(r) for r in args.tables.split(",")]
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    k = int(args.touched.split(",")[0])
    results = []
    print(f"push of {k} touched rows + full pull (row deltas), dim {args.dim} float32 + a {args.dim}x16 kernel; "
          f"async, one worker, {'shared memory' if args.shm else 'gRPC streams on loopback'}")
    print(f"{'rows':>10} {'table MiB':>9} {'config':>14} {'steps/s':>8} {'median ms':>9} {'pull KiB':>10} "
          f"{'1st pull s':>10} {'bit-equal':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for rows in tables:
            for config in configs:
                reps = args.dense_reps if config.startswith("dense") else args.reps
                verify = not args.no_verify and rows * args.dim * 4 <= args.verify_max_mib * 2**20
                r = _steps_one(rows, args.dim, k, config, reps, args.shm, verify, tmp)
                results.append(r)
                print(f"{rows:>10} {rows * args.dim * 4 / 2**20:>9.1f} {config:>14} {r['steps_per_s']:>8.1f} "
                      f"{r['median_step_ms']:>9.2f} {r['pull_bytes_per_step'] / 1024:>10.1f} "
                      f"{r['first_pull_s']:>10.2f} {str(r['copy_bit_equal']):>9}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"dim": args.dim, "touched": k, "shm": args.shm, "results": results}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-seeded"]:
        return serve_seeded(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000, help="embedding table rows (default 100000)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--touched", default="256,1024,10000", help="distinct rows a push touches, comma-separated "
                   "(--steps: the first)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json-out")
    p.add_argument("--steps", action="store_true", help="time push + pull steps over a table-size sweep "
                   "(module docstring)")
    p.add_argument("--tables", default="10000,100000,1000000,10000000", help="--steps: table rows, comma-separated")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"--steps: of {', '.join(CONFIGS)}")
    p.add_argument("--dense-reps", type=int, default=5, help="--steps: timed steps of dense:sgd (default 5)")
    p.add_argument("--shm", action="store_true", help="--steps: the same-host shared-memory path")
    p.add_argument("--no-verify", action="store_true", help="--steps: skip the bit-for-bit check at the end")
    p.add_argument("--verify-max-mib", type=float, default=4096, help="--steps: check tables up to this size "
                   "only (the check holds two more copies; default 4096)")
    args = p.parse_args(argv)
    if args.steps:
        return steps(args)
    touched = [int(k) for k in args.touched.split(",")]
    if any(not 0 < k <= args.rows for k in touched):
        p.error("--touched counts must be in 1..--rows")

    rng = np.random.default_rng(0)
    table = rng.standard_normal((args.rows, args.dim)).astype(np.float32)
    kernel = rng.standard_normal((args.dim, 16)).astype(np.float32)
    grpc_port, metrics_port = free_ports(2)
    with tempfile.TemporaryDirectory() as tmp:
        port_file = os.path.join(tmp, "port")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        server = subprocess.Popen(dying_with_parent(
            [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", str(grpc_port), "--port-file",
             port_file, "--mode", "async", "--num-workers", "1", "--metrics-port", str(metrics_port),
             "--log-level", "WARNING"]), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port = wait_for_port_file(port_file, server, 60)
            results = {}
            with PSClient(f"127.0.0.1:{port}", timeout=120) as client:
                client.register(0, 1)
                client.initialize(0, {"embedding": table, "kernel": kernel}, ADAM)
                step = 0
                for k in touched:
                    rows = np.sort(rng.choice(args.rows, size=k, replace=False)).astype(np.int64)
                    sparse = {"embedding": SparseRows(rows, rng.standard_normal((k, args.dim)).astype(np.float32)),
                              "kernel": np.ones_like(kernel)}
                    dense = {"embedding": densify(sparse["embedding"], table.shape, np.float32),
                             "kernel": sparse["kernel"]}
                    s_bytes, s_time, step = _measure(client, metrics_port, sparse, args.reps, step)
                    d_bytes, d_time, step = _measure(client, metrics_port, dense, args.reps, step)
                    results[str(k)] = {
                        "touched_fraction": k / args.rows,
                        "sparse": {"bytes_per_push": s_bytes, "push_ms": 1e3 * s_time},
                        "dense": {"bytes_per_push": d_bytes, "push_ms": 1e3 * d_time},
                        "bytes_ratio_dense_over_sparse": d_bytes / s_bytes,
                        "latency_ratio_dense_over_sparse": d_time / s_time,
                    }
        finally:
            server.terminate()
            server.wait(timeout=30)

    table_mib = table.nbytes / 2**20
    print(f"embedding {args.rows} x {args.dim} float32 ({table_mib:.1f} MiB) + kernel {args.dim} x 16; "
          f"async, Adam; median of {args.reps} pushes")
    print(f"{'touched':>8} {'fraction':>8} {'sparse KiB':>11} {'dense KiB':>10} {'bytes x':>8} "
          f"{'sparse ms':>10} {'dense ms':>9} {'latency x':>10}")
    for k, r in results.items():
        print(f"{k:>8} {r['touched_fraction']:>8.2%} {r['sparse']['bytes_per_push'] / 1024:>11.1f} "
              f"{r['dense']['bytes_per_push'] / 1024:>10.1f} {r['bytes_ratio_dense_over_sparse']:>8.1f} "
              f"{r['sparse']['push_ms']:>10.2f} {r['dense']['push_ms']:>9.2f} "
              f"{r['latency_ratio_dense_over_sparse']:>10.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"rows": args.rows, "dim": args.dim, "reps": args.reps, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
