"""Peak memory of one checkpoint of a big row-wise embedding table, in process (tracemalloc).

    PYTHONPATH=. python bench/checkpoint_memory.py --rows 1000000 --dim 64 --dir /tmp/ckpt
    PYTHONPATH=. python bench/checkpoint_memory.py --rows 1000000 --dim 64 --dir /tmp/ckpt --touch 4096 --pushes 200

The table is trained with lazy Adam (value, m and v: 3 x rows x dim float32), made
row-wise by one sparse push; then ``checkpoint_state`` and ``write_checkpoint`` run
under tracemalloc, which counts NumPy's arrays. With ``--pushes``, that many async
pushes of ``--touch`` random rows each run between the file's slices (from the
writing thread, before each write), as training does while a checkpoint is written.
Prints the table's bytes, the checkpoint's traced peak and the time it took.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from ps_server.core import checkpoint
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_common.sparse import SparseRows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dir", required=True, help="checkpoint directory (a file of 3 x rows x dim x 4 bytes)")
    p.add_argument("--touch", type=int, default=4096, help="rows each push during the write steps")
    p.add_argument("--pushes", type=int, default=0, help="pushes between the slices, at most one per slice")
    args = p.parse_args()

    ps = ParameterServer(mode="async", num_workers=1, sparse_updates="lazy")
    ps.register(0, 1)
    ps.initialize(0, {"emb": np.zeros((args.rows, args.dim), np.float32)}, OptimizerSpec("adam", learning_rate=0.01))
    rng = np.random.default_rng(0)
    step = 0

    def push() -> None:
        nonlocal step
        rows = np.sort(rng.choice(args.rows, size=args.touch, replace=False)).astype(np.int64)
        grad = rng.standard_normal((args.touch, args.dim)).astype(np.float32)
        ps.submit(Push(0, step, ps.store.version, 1, {"emb": SparseRows(rows, grad)})).result()
        step += 1

    push()  # the table turns row-wise
    left = args.pushes

    class Pushing:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            nonlocal left
            if left:
                left -= 1
                push()
            return self.f.write(data)

    written = checkpoint.write_to

    def write_to(f, state):  # write_checkpoint's own write, with pushes between its slices
        return written(Pushing(f), state)

    checkpoint.write_to = write_to
    table = 3 * args.rows * args.dim * 4
    tracemalloc.start()
    t0 = time.perf_counter()
    state = ps.checkpoint_state()
    path = checkpoint.write_checkpoint(args.dir, state, keep=1)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    if hasattr(state, "release"):
        state.release()
    tracemalloc.stop()
    print(f"table (value, m, v): {table / 2**20:.0f} MiB; pushes during the write: {args.pushes - left} of "
          f"{args.touch} rows; checkpoint peak (tracemalloc): {peak / 2**20:.1f} MiB; {seconds:.1f} s; {path}")


if __name__ == "__main__":
    main()
