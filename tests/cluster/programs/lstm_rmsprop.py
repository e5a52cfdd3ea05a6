"""A user's recurrent text classifier as the keras.io text-classification guides write it:
``TextVectorization`` adapted on the training texts and mapped over a ``tf.data`` pipeline, an
``Embedding`` (its gradient a ``tf.IndexedSlices`` of repeated rows), an ``LSTM`` and a ``Dense``
output, under ``RMSprop``; 8 batches of 32 an epoch.

    python lstm_rmsprop.py --out DIR [--alone]

``--alone``: one plain process; else tfps (``TF_CONFIG`` set, as ``ps-launch -- ...`` sets it).
Writes ``DIR/worker<i>.json``: History, the final weights, the optimizer's iterations.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--alone", action="store_true")
args = p.parse_args()

import tensorflow as tf  # noqa: E402
import keras  # noqa: E402

keras.utils.set_random_seed(13)
tf.config.experimental.enable_op_determinism()
WORDS = ["good", "bad", "fine", "poor", "great", "awful", "the", "a", "movie", "plot", "was", "and"]
EXAMPLES, BATCH, LENGTH = 8 * 32, 32, 8

rng = np.random.default_rng(4)
texts = [" ".join(rng.choice(WORDS, n)) for n in rng.integers(2, LENGTH + 1, EXAMPLES)]
labels = np.array([int(t.count("good") + t.count("great") > t.count("bad") + t.count("awful")) for t in texts])

strategy = tf.distribute.get_strategy() if args.alone else __import__("tfps.keras").keras.Strategy()
index = 0 if args.alone else strategy.worker_index

vectorize = keras.layers.TextVectorization(max_tokens=16, output_sequence_length=LENGTH)
vectorize.adapt(texts)
train = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(BATCH).map(lambda x, y: (vectorize(x), y))

with strategy.scope():
    inputs = keras.Input((LENGTH,), dtype="int64")
    hidden = keras.layers.LSTM(8)(keras.layers.Embedding(16, 8)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(optimizer=keras.optimizers.RMSprop(0.01), loss="binary_crossentropy", metrics=["accuracy"])

history = model.fit(train, epochs=args.epochs, verbose=0)
record = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "weights": [np.asarray(w).tolist() for w in model.get_weights()],
          "iterations": int(model.optimizer.iterations.numpy())}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
