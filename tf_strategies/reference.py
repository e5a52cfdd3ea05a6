"""One-process reference runs: what the parameter server should compute.

    python -m tf_strategies.reference --workers 2 --steps 5 --optimizer sgd --out ref.npz
    python -m tf_strategies.reference --full-batch --steps 5 --optimizer sgd --out full.npz

``sharded``: for each step, one process computes each worker's shard gradient
with the workers' own gradient path (``worker.gradients.Gradients`` with the
built-in models' loss, ``worker.model.loss``),
combines them with the server's own aggregation (``ps_server.core.modes.aggregation``)
and applies the server's own optimizer through a ``VariableStore``. A sync
parameter-server run with the same data, seed and TensorFlow settings must be
bit-identical to it: the only thing the server adds is the network.

``full_batch``: one gradient on the whole global batch per step. It differs
from the sharded run only by float rounding (a mean of shard means versus one
mean), so a sync run matches it within ~1e-5 after a few steps.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ps_server.core.modes.aggregation import weighted_mean
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.store import VariableStore
from worker.config import WorkerConfig, add_training_flags, training_flags
from worker.data import global_batches, load_dataset, shard, steps_per_epoch
from worker.gradients import Gradients, get_values, set_values, zeros


def run_reference(config: WorkerConfig, full_batch: bool = False) -> tuple[dict[str, np.ndarray], list[float]]:
    """Final parameters and the per-step (batch-weighted) loss of a one-process run."""
    from worker import model as models

    tf = models.tf_setup(config.deterministic, config.intra_op_threads)
    data = load_dataset(config.dataset)
    n = len(data.y_train)
    per_epoch = steps_per_epoch(n, config.global_batch_size)
    total = config.steps or config.epochs * per_epoch
    with tf.device(models.device_name()):
        model = models.build_model(config.model, config.seed)
    gradients = Gradients(model, models.loss)
    store = VariableStore()
    store.initialize(get_values(model), OptimizerSpec(**config.optimizer_spec()))
    parts = 1 if full_batch else config.num_workers
    losses = []
    batches = global_batches(n, config.global_batch_size, -(-total // per_epoch), config.seed)
    for _, batch in zip(range(total), batches):
        _, values = store.read()
        set_values(model, values)
        contributions, step_losses = [], []
        for i in range(parts):
            mine = shard(batch, i, parts)
            if len(mine):
                loss, grads = gradients(data.x_train[mine], data.y_train[mine], values)
            else:
                loss, grads = 0.0, zeros(values)
            contributions.append((len(mine), grads))
            step_losses.append(loss * len(mine))
        store.apply_all(weighted_mean(contributions))
        losses.append(sum(step_losses) / len(batch))
    return store.read()[1], losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tf_strategies.reference", description=__doc__.splitlines()[0])
    add_training_flags(p)
    p.add_argument("--workers", type=int, default=2, help="shards per global batch (default 2)")
    p.add_argument("--full-batch", action="store_true", help="one gradient on the whole batch per step")
    p.add_argument("--out", required=True, help="write the final parameters here (.npz)")
    args = p.parse_args(argv)
    from worker import model as models

    config = WorkerConfig.from_args(training_flags(args) + ["--num-workers", str(args.workers)], environ={})
    values, losses = run_reference(config, full_batch=args.full_batch)
    models.save_npz(args.out, values)
    print(f"reference: {len(losses)} steps, last loss {losses[-1]:.6f}, wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
