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
(``tfps_received_bytes_total`` of Push and PushStream, scraped before and after),
the median push latency (the client's push call, apply included), and the
ratios dense/sparse of both. No pulls are timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ps_server.core.sparse import SparseRows, densify  # noqa: E402
from ps_common.procs import dying_with_parent, wait_for_port_file  # noqa: E402
from tf_strategies.isolation import free_ports  # noqa: E402
from worker.client import PSClient  # noqa: E402

ADAM = {"name": "adam", "learning_rate": 0.001, "momentum": 0.0, "nesterov": False, "beta_1": 0.9,
        "beta_2": 0.999, "epsilon": 1e-7}


def _received_push_bytes(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tfps_received_bytes_total{") and ('method="Push"' in line or 'method="PushStream"' in line):
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=100_000, help="embedding table rows (default 100000)")
    p.add_argument("--dim", type=int, default=64, help="embedding width (default 64)")
    p.add_argument("--touched", default="256,1024,10000", help="distinct rows a push touches, comma-separated")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
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
