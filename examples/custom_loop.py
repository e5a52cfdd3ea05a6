"""A hand-written training step on tfps: keep your tf.GradientTape, wrap it, and it pushes.

    # a server, then one process per worker (here two, in two shells):
    ps-server --port 50051 --mode sync --num-workers 2
    python examples/custom_loop.py --ps 127.0.0.1:50051 --worker-index 0 --num-workers 2
    python examples/custom_loop.py --ps 127.0.0.1:50051 --worker-index 1 --num-workers 2

The model and data are ``examples.recommender``'s. Each worker takes its half of
every global batch itself (``worker.task.shard_bounds``), pulls the server's
parameters, computes its loss under a ``tf.GradientTape`` it writes by hand,
and lets ``Session.wrap(tape).gradient`` push the gradients: there is no local
optimizer, the server's applies. The pull and the push are ps-worker's own
(``worker.connection``), and the tape's gradients become a push through the
same function as ps-worker's (``worker.gradients.as_pushed``: the embeddings'
rows, BatchNorm's change). The chief then evaluates the final parameters.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.* from anywhere


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ps", default="127.0.0.1:50051")
    p.add_argument("--worker-index", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=256)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import keras
    import tensorflow as tf

    from examples import recommender
    from worker import api
    from worker.task import shard_bounds

    keras.utils.set_random_seed(0)  # every worker builds the same initial model; the chief's goes to the server
    model = recommender.build_model()
    loss_fn = keras.losses.BinaryCrossentropy()
    train, test = recommender.make_dataset()

    with api.Session(model, ps=args.ps, worker_index=args.worker_index, num_workers=args.num_workers,
                     optimizer="adam", learning_rate=0.01, global_batch_size=args.global_batch_size) as session:
        for epoch in range(args.epochs):
            for x, y in train:  # the same global batches in every worker (a seeded shuffle)
                lo, hi = shard_bounds(len(y), session.worker_index, args.num_workers)
                x, y = {k: v[lo:hi] for k, v in x.items()}, y[lo:hi]
                session.pull()
                with tf.GradientTape() as tape:
                    loss = loss_fn(y[:, None], model(x, training=True))
                tape = session.wrap(tape, batch_size=hi - lo)
                tape.gradient(loss, model.trainable_variables)
            logging.info("epoch %d done: loss %.4f, server version %d", epoch + 1, float(loss), tape.reply.version)
        if session.worker_index == 0:
            session.pull()
            accuracy = keras.metrics.BinaryAccuracy()
            for x, y in test:
                accuracy.update_state(y[:, None], model(x, training=False))
            print(f"test_accuracy={float(accuracy.result()):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
