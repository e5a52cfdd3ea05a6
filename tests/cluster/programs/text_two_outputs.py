"""A user's text model as the keras.io text guides write it: ``TextVectorization`` adapted on
the training texts and mapped over a ``tf.data`` pipeline, an ``Embedding`` (its gradient a
``tf.IndexedSlices`` of repeated rows), a ``GRU``, and two outputs each with its own loss (the
class, and the text's length as a regression); Adam; ``steps_per_execution=4`` over 22 batches
an epoch, the last one partial and odd.

    python text_two_outputs.py --out DIR [--alone]

``--alone``: one plain process; else tfps (``TF_CONFIG`` set, as ``ps-launch -- ...`` sets it).
Writes ``DIR/worker<i>.json``: History, the final weights, the batch-end callbacks of each epoch.
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

keras.utils.set_random_seed(11)
tf.config.experimental.enable_op_determinism()
WORDS = ["good", "bad", "fine", "poor", "great", "awful", "the", "a", "movie", "plot", "was", "and"]
EXAMPLES, BATCH, LENGTH = 21 * 32 + 21, 32, 12  # 22 batches an epoch, the last of 21 (two workers: 11 and 10)

rng = np.random.default_rng(3)
sizes = rng.integers(3, LENGTH + 1, EXAMPLES)
texts = [" ".join(rng.choice(WORDS, n)) for n in sizes]
labels = np.array([int(t.count("good") + t.count("great") > t.count("bad") + t.count("awful")) for t in texts])
lengths = (sizes / LENGTH).astype(np.float32)

strategy = tf.distribute.get_strategy() if args.alone else __import__("tfps.keras").keras.Strategy()
index = 0 if args.alone else strategy.worker_index

vectorize = keras.layers.TextVectorization(max_tokens=16, output_sequence_length=LENGTH)
vectorize.adapt(texts)
train = tf.data.Dataset.from_tensor_slices((texts, {"cls": labels, "length": lengths})).batch(BATCH)
train = train.map(lambda x, y: (vectorize(x), y))

with strategy.scope():
    inputs = keras.Input((LENGTH,), dtype="int64")
    hidden = keras.layers.GRU(8)(keras.layers.Embedding(16, 8)(inputs))
    model = keras.Model(inputs, {"cls": keras.layers.Dense(2, name="cls")(hidden),
                                 "length": keras.layers.Dense(1, name="length")(hidden)})
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "length": "mse"},
                  steps_per_execution=4)

batch_ends: list[int] = []
counter = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: batch_ends.append(0),
                                         on_train_batch_end=lambda batch, logs: batch_ends.__setitem__(
                                             -1, batch_ends[-1] + 1))
history = model.fit(train, epochs=args.epochs, verbose=0, callbacks=[counter])
record = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "weights": [np.asarray(w).tolist() for w in model.get_weights()], "batch_ends": batch_ends,
          "iterations": int(model.optimizer.iterations.numpy())}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
