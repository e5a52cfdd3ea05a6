"""A user's Keras program with every feature at once, for tests/cluster/test_keras_every_feature.py.

Two inputs (8 numbers and a token id), an Embedding, BatchNormalization, AdamW with a
warm-up cosine schedule, weight decay and ``global_clipnorm``, EarlyStopping. Run as

    python keras_every_feature.py --out DIR [--strategy tfps|none] [--tokens repeated|unique]

``tfps``: under ``tfps.keras.Strategy()`` (TF_CONFIG names the servers and this worker);
``none``: plain one-process ``model.fit``. Either writes DIR/weights-W.npz (the final
trainable and non-trainable weights) and DIR/history-W.json (the epochs run, the loss).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

GLOBAL_BATCH = 32
EXAMPLES = 320  # 10 global batches an epoch
TOKENS = 40  # ids repeat within a batch (as in any text or recommender model), or not


def data(tokens: str):
    """``repeated``: ids repeat within every batch; ``unique``: every id of a global batch
    differs (then the two rules for a sparse gradient's repeated rows agree: docs/sparse.md)."""
    rng = np.random.default_rng(7)
    numbers = rng.normal(size=(EXAMPLES, 8)).astype(np.float32)
    ids = rng.integers(0, TOKENS, EXAMPLES) if tokens == "repeated" else np.arange(EXAMPLES) % TOKENS
    tokens = ids.astype(np.int32)
    labels = ((numbers[:, 0] > 0).astype(np.int64) + (tokens % 2)) % 3
    return numbers, tokens, labels


def build(keras):
    numbers, tokens = keras.Input(shape=(8,), name="numbers"), keras.Input(shape=(), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(TOKENS, 4, name="embedding")(tokens)
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(numbers)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    joined = keras.layers.Concatenate()([hidden, embedded])
    out = keras.layers.Dense(3, activation="softmax", name="out")(joined)
    model = keras.Model([numbers, tokens], out)
    schedule = keras.optimizers.schedules.CosineDecay(0.0, decay_steps=40, warmup_target=0.02, warmup_steps=5)
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.004, global_clipnorm=0.5),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", choices=("tfps", "none"), default="tfps")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--tokens", choices=("repeated", "unique"), default="repeated")
    args = parser.parse_args()
    import keras

    if args.strategy == "tfps":
        from tfps.keras import Strategy

        strategy = Strategy()
        index = strategy.worker_index
    else:
        import contextlib

        strategy, index = None, 0
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        keras.utils.set_random_seed(0)
        model = build(keras)
    numbers, tokens, labels = data(args.tokens)
    # EarlyStopping on the training loss: patience 1 with a min_delta no epoch after the
    # second reaches, so every run stops at the same epoch, before the last.
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1, min_delta=0.05)
    history = model.fit({"numbers": numbers, "tokens": tokens}, labels, batch_size=GLOBAL_BATCH,
                        epochs=args.epochs, shuffle=False, callbacks=[stop], verbose=0)
    np.savez(os.path.join(args.out, f"weights-{index}.npz"),
             **{f"{i:02d}-{v.path}": np.asarray(v.numpy()) for i, v in enumerate(model.weights)})
    with open(os.path.join(args.out, f"history-{index}.json"), "w") as f:
        json.dump({"epochs": history.epoch, "loss": history.history["loss"]}, f)
    if strategy is not None:
        strategy.close()


if __name__ == "__main__":
    main()
