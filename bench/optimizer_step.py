"""Optimizer step bandwidth: the fused kernels and the NumPy steps against NumPy's add, in one run.

    python bench/optimizer_step.py --sizes 1,64,256 --reps 7 --json-out optimizer_step.json

For each ``--sizes`` MiB of float32 and each optimizer of ``--optimizers``
(default sgd, sgd_momentum, adam, adam_amsgrad, adagrad, rmsprop), one
``Optimizer.apply`` (Keras-exact, copy-on-write: a new value and new slots each
call) timed:

- fused: ``ps_server.core.optim.kernels``, one pass, one thread (the default);
- fused 2t: the same with ``TFPS_KERNEL_THREADS=2``, a helper thread from
  ``kernels.THREAD_MIN_ELEMENTS`` elements (16 MiB) on;
- numpy: ``kernels.ENABLED = False``, the NumPy ufunc per operation;

against numpy add, ``acc += g`` (``np.add(acc, g, out=acc)``), the bandwidth to
beat. Each is gradient bytes in per second, the median of ``--reps`` after one
warm-up, everything taking turns within each repetition (so a burst of other
work on the machine slows all alike) in a shuffled order (so that what the
previous call left in the cache favours none), and a ratio to numpy add of the
same size.
The process tunes its allocator as ``ps-server`` does
(``protos.wire.tune_allocator``), so a step's fresh arrays reuse freed memory
instead of faulting in new pages.

Needs numba (the ``fast`` extra) for the fused columns; without it they are
left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from protos import wire  # noqa: E402
from ps_server.core.optim import kernels  # noqa: E402
from ps_server.core.optim.optimizers import OptimizerSpec  # noqa: E402
from ps_server.core.optim.registry import make_optimizer  # noqa: E402

MIB = 2**20
SPECS = {
    "sgd": OptimizerSpec("sgd", 0.01),
    "sgd_momentum": OptimizerSpec("sgd", 0.01, momentum=0.9),
    "adam": OptimizerSpec("adam", 1e-3),
    "adam_amsgrad": OptimizerSpec("adam", 1e-3, amsgrad=True),
    "adagrad": OptimizerSpec("adagrad", 0.01),
    "rmsprop": OptimizerSpec("rmsprop", 1e-3),
    "adamax": OptimizerSpec("adamax", 1e-3),
    "lion": OptimizerSpec("lion", 1e-4),
}


@contextlib.contextmanager
def _path(enabled: bool, threads: int):
    """The kernels' switch and thread count set for one call."""
    saved = kernels.ENABLED, kernels.THREADS, kernels.MIN_ELEMENTS
    # Every size fused when on: the server's own threshold (kernels.MIN_ELEMENTS) is what
    # this benchmark measures the case for.
    kernels.ENABLED, kernels.THREADS, kernels.MIN_ELEMENTS = enabled, threads, 0
    try:
        yield
    finally:
        kernels.ENABLED, kernels.THREADS, kernels.MIN_ELEMENTS = saved


def measure(mib: int, names: list[str], reps: int) -> dict:
    """GiB/s of gradient bytes per (optimizer, path), and numpy add's."""
    n = mib * MIB // 4
    rng = np.random.default_rng(0)
    g = rng.standard_normal(n, dtype=np.float32)
    acc = np.zeros(n, np.float32)
    paths = {"numpy": (False, 1)}
    if kernels.available():
        paths = {"fused": (True, 1), "fused_2t": (True, 2), **paths}
    work = {"numpy_add": lambda: np.add(acc, g, out=acc)}
    for name in names:
        opt = make_optimizer(SPECS[name])
        value = rng.standard_normal(n, dtype=np.float32)
        state = opt.init_state(value)
        value, state = opt.apply(value, g, state)  # slots no longer zero
        for path, (enabled, threads) in paths.items():
            def step(opt=opt, value=value, state=state, enabled=enabled, threads=threads):
                with _path(enabled, threads):
                    opt.apply(value, g, state)
            work[f"{name}/{path}"] = step
    for fn in work.values():
        fn()  # warm-up: compiles, first-touch allocations
    times: dict[str, list[float]] = {k: [] for k in work}
    order = list(work)
    for _ in range(reps):
        rng.shuffle(order)  # each call after a different one: what stays in cache from the last favours none
        for k in order:
            t = time.perf_counter()
            work[k]()
            times[k].append(time.perf_counter() - t)
    return {k: mib / 1024 / statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,64,256", help="MiB of float32, comma-separated (default 1,64,256)")
    p.add_argument("--optimizers", default="sgd,sgd_momentum,adam,adam_amsgrad,adagrad,rmsprop",
                   help=f"comma-separated, of {', '.join(SPECS)}")
    p.add_argument("--reps", type=int, default=7, help="repetitions (default 7)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    names = args.optimizers.split(",")
    if args.reps < 1 or not set(names) <= set(SPECS):
        p.error(f"--reps must be positive; --optimizers of {', '.join(SPECS)}")
    print(wire.tune_allocator())
    sizes = [int(s) for s in args.sizes.split(",")]
    fused = kernels.available()
    state = f"on; 2t from {kernels.THREAD_MIN_ELEMENTS} elements" if fused else "off (no numba)"
    print(f"fused kernels: {state}; {os.cpu_count()} CPUs")
    print(f"GiB/s of gradient bytes (median of {args.reps}); in brackets, the ratio to numpy add, same size")
    paths = ("fused", "fused_2t", "numpy") if fused else ("numpy",)
    print(f"{'MiB':>4} {'numpy add':>9}  {'optimizer':<13}" + "".join(f"{p:>14}" for p in paths))
    results = {}
    for mib in sizes:
        r = results[mib] = measure(mib, names, args.reps)
        add = r["numpy_add"]
        for i, name in enumerate(names):
            size = f"{mib:>4} {add:9.2f}" if i == 0 else " " * 14
            print(f"{size}  {name:<13}" + "".join(f"{r[f'{name}/{p}']:7.2f} ({r[f'{name}/{p}'] / add:4.2f})"
                                                   for p in paths))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"sizes_mib": sizes, "reps": args.reps, "thread_min_elements": kernels.THREAD_MIN_ELEMENTS,
                       "gib_per_s": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
