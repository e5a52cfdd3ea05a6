"""The one-process oracle: every replica's tape in turn, no strategy at all.

    python -m tf_strategies.oracle --spec-json '{"model": "cnn", "steps": 3}' --out DIR
    result = tf_strategies.oracle.run(RunSpec(...))   # first TensorFlow use in the process

For each step, for each replica i (shard i of the global batch, ``spec.num_workers``
shards, ``common.step_batches``), one ``GradientTape`` computes the replica's
loss with the one loss-scaling rule (``replica_loss``); the replicas' gradients
are summed in replica order with ``tf.add_n`` and applied by
``spec.keras_optimizer()``. The step's loss is the sum of the replica losses
(the global batch's mean; with ``wrong-local-mean`` the sum of the local means,
too large by the same factor as the gradients).

This is what ``MirroredStrategy`` and ``MultiWorkerMirroredStrategy`` compute,
written out by hand. With 2 replicas and equal TensorFlow settings
(``worker.model.tf_setup``) they are bit-identical to it, SGD and Adam. With 3
or more they are not quite: both strategies all-reduce with TensorFlow's RING
collective (MirroredStrategy too, when its devices are CPUs), which sums each
chunk of a tensor starting from a different replica, so float rounding differs
from ``add_n`` in replica order (measured: ~4e-8 after 20 Adam steps, 3
replicas; the two strategies stay bit-identical to each other). A sum of two
is the same in either order, hence the exact match at 2. The strategy runners
reuse this module's ``replica_loss``, ``train`` and ``finish`` so that a
difference between them can only come from the strategy.

``run`` configures TensorFlow (threads, op determinism), so it must be the
first TensorFlow use in its process; the CLI guarantees that. The CLI exits 0
after writing the result (``common.save_result``), or 3 with one line
``runner oracle cannot start: <why>`` when this environment cannot run it.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import numpy as np

from tf_strategies import common

EXIT_CANNOT_START = 3


class CannotStart(Exception):
    """This environment cannot run the runner (not a bug in the run itself)."""


def setup_tf(spec: common.RunSpec):
    """``worker.model.tf_setup`` for this spec; CannotStart if TensorFlow is missing."""
    try:
        from worker import model as models

        return models.tf_setup(spec.deterministic, spec.intra_op_threads)
    except ImportError as e:
        raise CannotStart(f"tensorflow is not importable ({e})") from None


def replica_loss(per_example, global_batch_size, loss_scaling: str):
    """The one loss-scaling rule, as every runner computes it (see ``common``).

    ``global``: sum of the replica's per-example losses / the global batch size,
    so that summed replica gradients are the gradient of the global mean.
    ``wrong-local-mean``: the replica's own mean (a deliberate scaling bug).
    ``global_batch_size`` is an integer scalar (tensor or int).
    """
    import tensorflow as tf

    if loss_scaling == "global":
        return tf.nn.compute_average_loss(per_example, global_batch_size=global_batch_size)
    if loss_scaling == "wrong-local-mean":
        return tf.nn.compute_average_loss(per_example, global_batch_size=tf.shape(per_example)[0])
    raise ValueError(f"unknown loss_scaling {loss_scaling!r}; choose one of {', '.join(common.LOSS_SCALINGS)}")


def per_example_loss(model, x, y):
    import keras

    return keras.losses.sparse_categorical_crossentropy(y, model(x, training=True))


def build_and_load(spec: common.RunSpec):
    """The spec's model with the spec's initial weights (call inside a strategy scope if any)."""
    from worker import model as models

    model = models.build_model(spec.model, spec.seed)
    if spec.initial_weights:
        common.assign_weights(model.trainable_variables, common.load_initial_weights(spec.initial_weights))
    return model


def weights_of(model) -> list[np.ndarray]:
    return [np.array(v.numpy()) for v in model.trainable_variables]


def train(spec: common.RunSpec, data, model, step: Callable) -> dict:
    """Run ``step(batch_indices, shard_indices) -> loss`` for every step; record what a RunResult needs.

    ``steps_per_s`` counts the whole loop, including the first step's tracing.
    """
    losses, step1, examples, ends = [], None, 0, []
    start = time.perf_counter()
    for k, (batch, shards) in enumerate(common.step_batches(spec, len(data.y_train)), 1):
        losses.append(step(batch, shards))
        ends.append(time.perf_counter() - start)  # a step runs to its end on the CPU before it returns
        examples += len(batch)
        if k == 1:
            step1 = weights_of(model)
    final = weights_of(model)  # reading the weights waits for the last step
    loop_s = time.perf_counter() - start
    return {
        "losses": [float(loss) for loss in losses],
        "weights_step1": step1,
        "weights_final": final,
        "examples": examples,
        "steps_per_s": len(losses) / loop_s if loop_s > 0 else 0.0,
        "step_ends_s": ends,
    }


def finish(runner: str, data, model, trained: dict, started: float, notes: str = "") -> common.RunResult:
    from worker import model as models

    _, accuracy = models.evaluate(model, data.x_test, data.y_test)
    return common.RunResult(runner=runner, test_accuracy=accuracy, wall_s=time.perf_counter() - started,
                            notes=notes, **trained)


def run(spec: common.RunSpec) -> common.RunResult:
    started = time.perf_counter()
    tf = setup_tf(spec)
    from worker.data import load_dataset

    data = load_dataset(spec.dataset)
    model = build_and_load(spec)
    opt = spec.keras_optimizer()
    opt.build(model.trainable_variables)
    variables = model.trainable_variables

    @tf.function(reduce_retracing=True)
    def apply(xs, ys, global_batch_size):
        losses, grads = [], []
        for x, y in zip(xs, ys):  # replica order; unrolled at trace time
            with tf.GradientTape() as tape:
                loss = replica_loss(per_example_loss(model, x, y), global_batch_size, spec.loss_scaling)
            losses.append(loss)
            grads.append(tape.gradient(loss, variables))
        summed = [tf.add_n(list(per_var)) for per_var in zip(*grads)]
        opt.apply_gradients(zip(summed, variables))
        return tf.add_n(losses)

    def step(batch, shards):
        xs = [tf.constant(data.x_train[s]) for s in shards]
        ys = [tf.constant(data.y_train[s]) for s in shards]
        return apply(xs, ys, tf.constant(len(batch), tf.int32))

    trained = train(spec, data, model, step)
    return finish("oracle", data, model, trained, started, notes=f"{spec.num_workers} replicas in one process")


def cli(name: str, run_fn: Callable[[common.RunSpec, argparse.Namespace], common.RunResult],
        argv: list[str] | None, doc: str, add_flags: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """``python -m tf_strategies.<name> --spec-json JSON --out DIR``: 0 with a result, 3 if it cannot start."""
    p = argparse.ArgumentParser(prog=f"python -m tf_strategies.{name}", description=doc.splitlines()[0])
    p.add_argument("--spec-json", required=True, help="a common.RunSpec as JSON")
    p.add_argument("--out", required=True, help="directory for result.json and weights.npz")
    if add_flags:
        add_flags(p)
    args = p.parse_args(argv)
    spec = common.RunSpec.from_json(args.spec_json)
    try:
        result = run_fn(spec, args)
    except CannotStart as e:
        print(f"runner {name} cannot start: {e}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_START
    common.save_result(args.out, result)
    last = result.losses[-1] if result.losses else float("nan")
    print(f"{name}: {len(result.losses)} steps, last loss {last:.6f}, {result.steps_per_s:.1f} steps/s, "
          f"test accuracy {result.test_accuracy:.4f}, wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli("oracle", lambda spec, _: run(spec), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
