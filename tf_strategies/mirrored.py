"""TensorFlow's MirroredStrategy, one process, ``spec.num_workers`` replicas.

    python -m tf_strategies.mirrored --spec-json '{"model": "cnn", "steps": 3}' --out DIR
    result = tf_strategies.mirrored.run(RunSpec(...))   # first TensorFlow use in the process

Replicas are ``spec.num_workers`` GPUs if that many are visible, otherwise the
CPU split into as many logical devices (which must happen before TensorFlow
initialises its runtime, hence "first TensorFlow use"). A custom training loop
calls ``strategy.run``; replica i gets exactly shard i of each global batch
(``experimental_distribute_values_from_function``), computes its loss with the
oracle's ``replica_loss`` and hands its gradients to the Keras optimizer, which
sums them across replicas (an all-reduce) before applying. The step's loss is
``strategy.reduce(SUM)`` of the replica losses. After training the replicas'
copies of every variable are checked to be bit-identical.

The CLI exits 0 after writing the result, or 3 with one line
``runner mirrored cannot start: <why>``.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from tf_strategies import common
from tf_strategies.oracle import (
    CannotStart, build_and_load, cli, finish, per_example_loss, replica_loss, setup_tf, train,
)


def replica_devices(tf, n: int) -> list[str]:
    """n GPUs if there are n, else n logical CPUs; before TensorFlow initialises."""
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= n:
        return [f"/gpu:{i}" for i in range(n)]
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError as e:  # "Virtual devices cannot be modified after being initialized"
        raise CannotStart(f"cannot split the CPU into {n} logical devices ({e}); run in a fresh process") from None
    return [f"/cpu:{i}" for i in range(n)]


def _check_replicas_agree(model) -> None:
    for v in model.trainable_variables:
        copies = [np.asarray(c.numpy()) for c in getattr(v.value, "values", ())]
        if any(not np.array_equal(copies[0], c) for c in copies[1:]):
            raise AssertionError(f"{v.path}: replicas of a mirrored variable differ")


def run(spec: common.RunSpec) -> common.RunResult:
    started = time.perf_counter()
    tf = setup_tf(spec)  # env, threads, determinism: configuration only, nothing initialised yet
    devices = replica_devices(tf, spec.num_workers)
    strategy = tf.distribute.MirroredStrategy(devices)
    from worker.data import load_dataset

    data = load_dataset(spec.dataset)
    with strategy.scope():
        model = build_and_load(spec)
        opt = spec.keras_optimizer()
        opt.build(model.trainable_variables)  # optimizer variables mirrored, before the first apply
    variables = model.trainable_variables

    def replica_step(x, y, global_batch_size):
        with tf.GradientTape() as tape:
            loss = replica_loss(per_example_loss(model, x, y), global_batch_size, spec.loss_scaling)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))  # all-reduce SUM inside
        return loss

    @tf.function(reduce_retracing=True)
    def apply(x, y, global_batch_size):
        losses = strategy.run(replica_step, args=(x, y, global_batch_size))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    worker_devices = strategy.extended.worker_devices

    def step(batch, shards):
        def shard_of(array):
            def value_fn(ctx):
                i = ctx.replica_id_in_sync_group
                with tf.device(worker_devices[i]):
                    return tf.constant(array[shards[i]])

            return strategy.experimental_distribute_values_from_function(value_fn)

        return apply(shard_of(data.x_train), shard_of(data.y_train), tf.constant(len(batch), tf.int32))

    trained = train(spec, data, model, step)
    _check_replicas_agree(model)
    return finish("mirrored", data, model, trained, started,
                  notes=f"MirroredStrategy over {', '.join(devices)}")


def main(argv: list[str] | None = None) -> int:
    return cli("mirrored", lambda spec, _: run(spec), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
