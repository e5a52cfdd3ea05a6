"""A user's program that saves a ``.keras`` file each epoch with ``ModelCheckpoint`` and, run
again with ``--resume``, loads it in one plain process and trains on, as the Keras guides do.

    python checkpoint_resume.py --out DIR [--alone]      # train, saving DIR/model.keras
    python checkpoint_resume.py --out DIR --resume FILE  # one process: load FILE, one more epoch

Digits, an MLP, Adam; global batches of 64. Writes ``DIR/worker<i>.json``: the final
weights, the optimizer's iterations and its variables (all of them, as saved or loaded).
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--alone", action="store_true")
p.add_argument("--resume", default="")
args = p.parse_args()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(3)
tf.config.experimental.enable_op_determinism()

images, labels = load_digits(return_X_y=True)
images = (images / 16.0).astype(np.float32)
order = np.random.default_rng(0).permutation(len(labels))
train = tf.data.Dataset.from_tensor_slices((images[order][:1437], labels[order][:1437].astype(np.int64))).batch(64)

index = 0
if args.resume:
    model = keras.models.load_model(args.resume)
    model.fit(train, epochs=1, verbose=0)
else:
    if args.alone:
        strategy = tf.distribute.get_strategy()
    else:
        import tfps.keras

        strategy = tfps.keras.Strategy()
        index = strategy.worker_index
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    model.fit(train, epochs=1, verbose=0,
              callbacks=[keras.callbacks.ModelCheckpoint(os.path.join(args.out, "model.keras"))])
record = {"weights": [np.asarray(w).tolist() for w in model.get_weights()],
          "iterations": int(model.optimizer.iterations.numpy()),
          "optimizer": [np.asarray(v).tolist() for v in model.optimizer.variables]}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
