"""The async apply alone, locked against hogwild: threads pushing into one core ``AsyncMode``.

    python bench/hogwild_apply.py --threads 8 --pushes 200 --repeat 5 --json-out apply.json

No gRPC and no serialization: each of ``--threads`` threads pushes ``--pushes``
all-ones gradients for load_test's variables (``big/kernel`` 512x512 float32 and
three small ones) straight into ``AsyncMode(store, members, apply=...)``, as the
service's handler threads do after decoding. Per optimizer (SGD lr 1, SGD with
momentum, Adam) and apply it reports the median over ``--repeat`` interleaved runs
of pushes/s, the process's CPU seconds per push, and, for plain SGD, the element
updates lost (each landed update subtracts exactly 1 from zeros). The allocator is
tuned as ``ps-server`` tunes it (``protos.wire.tune_allocator``). It measures what
the lock costs or saves where the apply is all the server does; ``bench/load_test.py``
measures it behind the wire.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from protos import wire  # noqa: E402
from ps_server.core.modes.async_mode import AsyncMode  # noqa: E402
from ps_server.core.membership import Membership  # noqa: E402
from ps_server.core.modes.base import Push  # noqa: E402
from ps_server.core.optim.optimizers import OptimizerSpec  # noqa: E402
from ps_server.core.store import VariableStore  # noqa: E402

VARIABLES = {"big/kernel": (512, 512), "dense/kernel": (256, 128), "dense/bias": (128,), "scale": ()}
SPECS = {
    "sgd": OptimizerSpec("sgd", learning_rate=1.0),
    "sgd-momentum": OptimizerSpec("sgd", learning_rate=0.01, momentum=0.9),
    "adam": OptimizerSpec("adam", learning_rate=0.001),
}


def run_once(spec: OptimizerSpec, apply: str, threads: int, pushes: int) -> dict:
    store = VariableStore()
    store.initialize({n: np.zeros(s, np.float32) for n, s in VARIABLES.items()}, spec)
    mode = AsyncMode(store, Membership(threads), apply=apply)
    grads = {n: np.ones(s, np.float32) for n, s in VARIABLES.items()}
    go = threading.Barrier(threads + 1)

    def worker(w: int) -> None:
        go.wait()
        for step in range(pushes):
            mode.submit(Push(worker_id=w, step=step, base_version=store.version, batch_size=1,
                             gradients=grads)).result()

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    cpu0, t0 = time.process_time(), time.perf_counter()
    go.wait()
    for t in pool:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    applied = mode.stats.pushes_applied
    out = {"pushes": applied, "wall_s": wall, "pushes_per_s": applied / wall, "cpu_ms_per_push": 1e3 * cpu / applied,
           "cpu_percent": 100 * cpu / wall}
    if spec.name == "sgd" and spec.momentum == 0:
        _, values = store.read()
        out["lost_element_updates"] = int(sum(float((v.astype(np.float64) + applied).sum()) for v in values.values()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--pushes", type=int, default=200, help="pushes per thread (default 200)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--optimizers", default=",".join(SPECS))
    p.add_argument("--json-out")
    opts = p.parse_args(argv)
    print(wire.tune_allocator(), "(as ps-server does)")
    rows = []
    for name in opts.optimizers.split(","):
        runs: dict[str, list[dict]] = {"locked": [], "hogwild": []}
        for _ in range(opts.repeat):  # interleaved: the machine's other load hits both alike
            for apply in runs:
                runs[apply].append(run_once(SPECS[name], apply, opts.threads, opts.pushes))
        for apply, rs in runs.items():
            row = {"optimizer": name, "apply": apply, "runs": len(rs)}
            for key in rs[0]:
                values = [r[key] for r in rs]
                row[key] = statistics.median(values)
                row[key + "_all"] = [round(v, 3) for v in values]
            rows.append(row)
            print(f"{name:>13} {apply:>8}: {row['pushes_per_s']:8.1f} pushes/s (runs {row['pushes_per_s_all']}), "
                  f"{row['cpu_ms_per_push']:.3f} CPU ms/push, CPU {row['cpu_percent']:.0f} %"
                  + (f", lost {row['lost_element_updates']:.0f} (runs {row['lost_element_updates_all']})"
                     if "lost_element_updates" in row else ""))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"command": " ".join(["python", "bench/hogwild_apply.py", *(argv or sys.argv[1:])]),
                       "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                                   "numpy": np.__version__, "platform": platform.platform()},
                       "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
