"""Cost curves: what one server's costs grow with, each beside the slope an ideal system has.

    python bench/cost_curves.py --workers 2,16,64,256,1024 --sizes-mib 1,16,256,512 --json-out curves.json

1. Sync rounds against workers, at a fixed model (``bench/load_test.py``'s, 1.15 MB): for
   each N, one load test (``--seconds`` s) in its own run; its sync-round p50 (a push's
   time from sent to answered), peak server RSS, peak server threads, and Status/Health
   latency while workers wait. Ideal: RSS and threads flat in N; a round's time grows
   as N x model / the server's receive bandwidth (its bytes must all arrive).
2. Push plus apply against model size (async, SGD, one worker, ``--reps`` pushes after a
   warm-up): the median time of ``PSClient.push`` (its bytes streamed, the optimizer
   step applied before the reply) for one float32 variable of each ``--sizes-mib``, and
   GiB/s of gradient. Ideal: time proportional to the size (flat GiB/s). A variable
   over half the message limit is initialized through InitializeStream (``PSClient``).
   ``--workers ''`` runs this part alone.

Sparse pushes against table rows are ``bench/sparse.py --steps`` (BENCHMARKS.md).
Every server is a fresh ``ps-server`` process on 127.0.0.1.
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

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.load_test import RssSampler, Server  # noqa: E402
from worker.client import PSClient  # noqa: E402

MIB = 2**20


def workers_curve(ns: list[int], seconds: float) -> list[dict]:
    rows = []
    for n in ns:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "load.json")
            subprocess.run([sys.executable, os.path.join(ROOT, "bench", "load_test.py"), "--mode", "sync",
                            "--clients", str(n), "--seconds", str(seconds), "--json-out", out],
                           check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
            with open(out) as f:
                run = json.load(f)
        r = run["results"][0]
        rows.append({"workers": n, "rounds": r.get("rounds"), "errors": r.get("errors"),
                     "push_p50_ms": r.get("push_p50_ms"),
                     "rss_peak_mib": r["memory"]["peak_mib"], "rss_start_mib": r["memory"]["start_mib"],
                     "threads_peak": r.get("server_threads_peak"), "control": r.get("control_calls"),
                     "ok": r.get("ok")})
        print(f"  N={n:5d}: {rows[-1]}", flush=True)
    return rows


def size_curve(sizes_mib: list[int], reps: int) -> list[dict]:
    rows = []
    for mib in sizes_mib:
        with tempfile.TemporaryDirectory() as tmp:
            server = Server("async", 1, tmp, 0)
            sampler = RssSampler(server.pid)
            sampler.start()
            try:
                with PSClient(server.address, timeout=600) as client:
                    client.wait_ready(60)
                    client.register(0, 1)
                    n = mib * MIB // 4
                    client.initialize(0, {"w": np.zeros(n, np.float32)}, {"name": "sgd", "learning_rate": 0.001})
                    g = {"w": np.full(n, 1e-3, np.float32)}
                    client.push(0, 0, 0, 1, g)  # warm-up
                    times = []
                    for step in range(1, reps + 1):
                        started = time.perf_counter()
                        client.push(0, step, step, 1, g)
                        times.append(time.perf_counter() - started)
            finally:
                sampler.stop()
                server.stop()
        median = statistics.median(times)
        rows.append({"size_mib": mib, "push_apply_ms": round(1e3 * median, 2),
                     "gib_per_s": round(mib / 1024 / median, 3),
                     "rss_peak_mib": round(max(r for _, r in sampler.samples) / MIB, 1) if sampler.samples else None})
        print(f"  {mib:5d} MiB: {rows[-1]}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,16,64,256,1024")
    p.add_argument("--seconds", type=float, default=30.0, help="each load test's length (default 30)")
    p.add_argument("--sizes-mib", default="1,16,256,512",
                   help="model sizes (default 1,16,256,512; 1024 and above are initialized through "
                        "InitializeStream; at 1024 the server peaked at ~3.5x the size in memory)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    print("sync rounds against workers (bench/load_test.py's model, 1.15 MB):", flush=True)
    workers = workers_curve([int(x) for x in args.workers.split(",") if x], args.seconds)
    print("push + apply against model size (async, SGD, one worker):", flush=True)
    sizes = size_curve([int(x) for x in args.sizes_mib.split(",") if x], args.reps)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"workers": workers, "sizes": sizes, "seconds": args.seconds, "reps": args.reps}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
