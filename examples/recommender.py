"""Your own model on tfps: a click predictor with two embedding tables, three inputs and BatchNorm.

    # from the repository root, after the README's install:
    ps-launch --mode sync --workers 2 --model examples.recommender:build_model \\
        --dataset examples.recommender:make_dataset --epochs 6 --global-batch-size 256 \\
        --save-model recommender.keras --metrics-json m.json

    # or from Python, one process per worker (a ps-server must be running):
    python examples/recommender.py --ps 127.0.0.1:50051 --worker-index 0 --num-workers 2

    # the embeddings stepped and pulled by the rows a batch touches, for Adam too (docs/sparse.md):
    TFPS_SPARSE_UPDATES=lazy ps-launch --mode sync --workers 2 --model examples.recommender:build_model \
        --dataset examples.recommender:make_dataset --epochs 6 --optimizer adam

    # a larger click-through task: 100,000 users and 20,000 items, 16-wide embeddings
    ps-launch --mode async --workers 2 --model examples.recommender:build_large_model \
        --dataset examples.recommender:make_large_dataset --epochs 2 --global-batch-size 512

The data is made here, offline and the same in every process: users and items
with hidden taste vectors, a click when they agree. ``build_model`` is a Keras
functional model with three inputs (a user id, an item id, four dense
features): the ids go through ``Embedding`` layers, whose gradients TensorFlow
gives as ``tf.IndexedSlices`` and tfps pushes as the rows a batch touched (a
batch of 128 touches about 120 of the 2000 user rows); the dense features go
through ``BatchNormalization``, whose moving mean and variance the server keeps
(``worker.task``). The model is compiled with its loss and metrics: tfps reads
them, and the server's optimizer (``--optimizer``) replaces the compiled one.

Where the server steps a table row by row (SGD or Adagrad by default, every
optimizer with ``--sparse-updates lazy``), a worker's pull brings only the rows
changed since its last one and writes them into its copy (``docs/sparse.md``);
with Adam in the default mode the tables change everywhere and come whole.
"""

from __future__ import annotations

import numpy as np

NUM_USERS, NUM_ITEMS, DIM = 1000, 400, 8
NUM_TRAIN, NUM_TEST = 32_000, 4_000
# The larger task (build_large_model, make_large_dataset): a batch of 512 touches about
# 0.5 % of the user table. Ids follow a power law, as real traffic does.
LARGE = dict(users=100_000, items=20_000, dim=16, train=400_000, test=40_000)


def _clicks(seed: int = 7, num_users: int = NUM_USERS, num_items: int = NUM_ITEMS, num_train: int = NUM_TRAIN,
            num_test: int = NUM_TEST, zipf: float = 0.0):
    """(inputs dict, labels) of every example: a click when the user's and the item's hidden
    tastes agree, nudged by the dense features. ``zipf`` > 0: ids drawn with probability
    proportional to 1 / rank^zipf (a few popular users and items, a long tail)."""
    rng = np.random.default_rng(seed)
    users = rng.standard_normal((num_users, 3)).astype(np.float32)
    items = rng.standard_normal((num_items, 3)).astype(np.float32)
    n = num_train + num_test
    if zipf:
        def draw(count):
            p = 1.0 / np.arange(1, count + 1) ** zipf
            return rng.choice(count, size=n, p=p / p.sum())
        u, i = draw(num_users), draw(num_items)
    else:
        u = rng.integers(0, num_users, n)
        i = rng.integers(0, num_items, n)
    # dense features on very different scales (BatchNorm's job): price, age, hour, a flag
    feats = np.stack([rng.lognormal(3, 1, n), rng.normal(40, 12, n), rng.uniform(0, 24, n),
                      rng.integers(0, 2, n)], axis=1).astype(np.float32)
    score = np.sum(users[u] * items[i], axis=1) - 0.02 * (feats[:, 1] - 40) + 0.5 * feats[:, 3] - 0.25
    labels = (score > 0).astype(np.float32)
    inputs = {"user": u.astype(np.int64), "item": i.astype(np.int64), "features": feats}
    return inputs, labels


def make_dataset(ctx=None, default_batch: int = 256, **task):
    """(train, eval) ``tf.data`` datasets of global batches of ``ctx.global_batch_size`` (default
    256), shuffled with a fixed seed so every worker sees the same batches; tfps gives each
    worker its part of each batch. ``task``: ``_clicks``' sizes (``make_large_dataset``)."""
    import tensorflow as tf

    batch = ctx.global_batch_size if ctx is not None else default_batch
    seed = ctx.seed if ctx is not None else 0
    num_train = task.get("num_train", NUM_TRAIN)
    inputs, labels = _clicks(**task)
    train = {k: v[:num_train] for k, v in inputs.items()}, labels[:num_train]
    test = {k: v[num_train:] for k, v in inputs.items()}, labels[num_train:]
    train_ds = (tf.data.Dataset.from_tensor_slices(train)
                .shuffle(num_train, seed=seed, reshuffle_each_iteration=True)
                .batch(batch))
    test_ds = tf.data.Dataset.from_tensor_slices(test).batch(1024)
    return train_ds, test_ds


def make_large_dataset(ctx=None):
    """``make_dataset`` of the larger task (``LARGE``), ids drawn by a power law."""
    return make_dataset(ctx, default_batch=512, num_users=LARGE["users"], num_items=LARGE["items"],
                        num_train=LARGE["train"], num_test=LARGE["test"], zipf=0.8)


def build_large_model():
    """``build_model`` with the larger task's tables (``LARGE``)."""
    return build_model(LARGE["users"], LARGE["items"], LARGE["dim"])


def build_model(num_users: int = NUM_USERS, num_items: int = NUM_ITEMS, dim: int = DIM):
    import keras

    user = keras.Input(shape=(), dtype="int64", name="user")
    item = keras.Input(shape=(), dtype="int64", name="item")
    features = keras.Input(shape=(4,), name="features")
    u = keras.layers.Embedding(num_users, dim, name="user_embedding")(user)
    i = keras.layers.Embedding(num_items, dim, name="item_embedding")(item)
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
