"""Your own model on tfps: a click predictor with two embedding tables, three inputs and BatchNorm.

    # from the repository root, after the README's install:
    ps-launch --mode sync --workers 2 --model examples.recommender:build_model \\
        --dataset examples.recommender:make_dataset --epochs 6 --global-batch-size 256 \\
        --save-model recommender.keras --metrics-json m.json

    # or from Python, one process per worker (a ps-server must be running):
    python examples/recommender.py --ps 127.0.0.1:50051 --worker-index 0 --num-workers 2

The data is made here, offline and the same in every process: users and items
with hidden taste vectors, a click when they agree. ``build_model`` is a Keras
functional model with three inputs (a user id, an item id, four dense
features): the ids go through ``Embedding`` layers, whose gradients TensorFlow
gives as ``tf.IndexedSlices`` and tfps pushes as the rows a batch touched (a
batch of 128 touches about 120 of the 2000 user rows); the dense features go
through ``BatchNormalization``, whose moving mean and variance the server keeps
(``worker.task``). The model is compiled with its loss and metrics: tfps reads
them, and the server's optimizer (``--optimizer``) replaces the compiled one.
"""

from __future__ import annotations

import numpy as np

NUM_USERS, NUM_ITEMS, DIM = 1000, 400, 8
NUM_TRAIN, NUM_TEST = 32_000, 4_000


def _clicks(seed: int = 7):
    """(inputs dict, labels) of every example: a click when the user's and the item's hidden
    tastes agree, nudged by the dense features."""
    rng = np.random.default_rng(seed)
    users = rng.standard_normal((NUM_USERS, 3)).astype(np.float32)
    items = rng.standard_normal((NUM_ITEMS, 3)).astype(np.float32)
    n = NUM_TRAIN + NUM_TEST
    u = rng.integers(0, NUM_USERS, n)
    i = rng.integers(0, NUM_ITEMS, n)
    # dense features on very different scales (BatchNorm's job): price, age, hour, a flag
    feats = np.stack([rng.lognormal(3, 1, n), rng.normal(40, 12, n), rng.uniform(0, 24, n),
                      rng.integers(0, 2, n)], axis=1).astype(np.float32)
    score = np.sum(users[u] * items[i], axis=1) - 0.02 * (feats[:, 1] - 40) + 0.5 * feats[:, 3] - 0.25
    labels = (score > 0).astype(np.float32)
    inputs = {"user": u.astype(np.int64), "item": i.astype(np.int64), "features": feats}
    return inputs, labels


def make_dataset(ctx=None):
    """(train, eval) ``tf.data`` datasets of global batches of ``ctx.global_batch_size`` (default
    256), shuffled with a fixed seed so every worker sees the same batches; tfps gives each
    worker its part of each batch."""
    import tensorflow as tf

    batch = ctx.global_batch_size if ctx is not None else 256
    seed = ctx.seed if ctx is not None else 0
    inputs, labels = _clicks()
    train = {k: v[:NUM_TRAIN] for k, v in inputs.items()}, labels[:NUM_TRAIN]
    test = {k: v[NUM_TRAIN:] for k, v in inputs.items()}, labels[NUM_TRAIN:]
    train_ds = (tf.data.Dataset.from_tensor_slices(train)
                .shuffle(NUM_TRAIN, seed=seed, reshuffle_each_iteration=True)
                .batch(batch))
    test_ds = tf.data.Dataset.from_tensor_slices(test).batch(1024)
    return train_ds, test_ds


def build_model():
    import keras

    user = keras.Input(shape=(), dtype="int64", name="user")
    item = keras.Input(shape=(), dtype="int64", name="item")
    features = keras.Input(shape=(4,), name="features")
    u = keras.layers.Embedding(NUM_USERS, DIM, name="user_embedding")(user)
    i = keras.layers.Embedding(NUM_ITEMS, DIM, name="item_embedding")(item)
    f = keras.layers.BatchNormalization(name="feature_norm")(features)
    x = keras.layers.Concatenate()([u, i, keras.layers.Multiply()([u, i]), f])
    x = keras.layers.Dense(64, activation="relu")(x)
    out = keras.layers.Dense(1, activation="sigmoid", name="click")(x)
    model = keras.Model({"user": user, "item": item, "features": features}, out, name="recommender")
    model.compile(loss="binary_crossentropy", metrics=["accuracy"])
    return model


def main(argv=None) -> int:
    """Train through the Python API (``worker.api.train``); flags as ps-worker's."""
    import argparse
    import logging

    from worker import api

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ps", default="127.0.0.1:50051")
    p.add_argument("--worker-index", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--save-model", default="")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = api.train(build_model, make_dataset, ps=args.ps, worker_index=args.worker_index,
                       num_workers=args.num_workers, epochs=args.epochs, global_batch_size=args.global_batch_size,
                       optimizer="adam", learning_rate=0.01, save_model=args.save_model)
    print(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
