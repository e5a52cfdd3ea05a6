"""A user's own metric that keeps a running maximum: the largest absolute error of any example
the epoch has seen so far, a subclass of ``keras.metrics.Metric`` as the keras.io guide writes
one (``add_variable``, ``update_state``, ``result``). A maximum does not add up, so its
variable declares ``aggregation="none"``. A small dense model regressing the digit's value from
its 64 pixels (mean squared error, SGD with momentum); 16 batches of 64 an epoch.

    python running_max.py --out DIR [--alone]

``--alone``: one plain process; else tfps (``TF_CONFIG`` set, as ``ps-launch -- ...`` sets it).
Writes ``DIR/worker<i>.json``: History, the final weights, the optimizer's iterations, the
metric's final value.
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
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(17)
tf.config.experimental.enable_op_determinism()


class MaxError(keras.metrics.Metric):
    """The largest absolute error of any example seen since the last reset."""

    def __init__(self, name="max_error", **kwargs):
        super().__init__(name=name, **kwargs)
        self.max = self.add_variable(shape=(), initializer="zeros", aggregation="none", name="max")

    def update_state(self, y_true, y_pred, sample_weight=None):
        error = keras.ops.abs(keras.ops.reshape(keras.ops.cast(y_true, y_pred.dtype), (-1,))
                              - keras.ops.reshape(y_pred, (-1,)))
        self.max.assign(keras.ops.maximum(self.max, keras.ops.max(error)))

    def result(self):
        return self.max * 1.0  # a value, not the variable


strategy = tf.distribute.get_strategy() if args.alone else __import__("tfps.keras").keras.Strategy()
index = 0 if args.alone else strategy.worker_index

images, digits = load_digits(return_X_y=True)
order = np.random.default_rng(0).permutation(len(digits))[:1024]
train = tf.data.Dataset.from_tensor_slices(((images[order] / 16.0).astype(np.float32),
                                            digits[order].astype(np.float32))).batch(64)

with strategy.scope():
    max_error = MaxError()
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse", metrics=[max_error])

history = model.fit(train, epochs=args.epochs, verbose=0)
record = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "weights": [np.asarray(w).tolist() for w in model.get_weights()],
          "iterations": int(model.optimizer.iterations.numpy()), "max_error": float(max_error.result())}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
