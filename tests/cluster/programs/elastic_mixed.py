"""A dynamic loss scale in an elastic job: ``mixed_float16`` with a ``LossScaleOptimizer``
whose first scale (2**24) overflows the float16 gradients, halved at each round that skips
until the gradients fit, and doubled every 4 finite rounds, which overflows again: rounds
that skip come all through the job, not only at its start. A small dense model on the
digits, SGD with momentum; 1,024 training examples in global batches of 64 (16 rounds an
epoch), three epochs.

    ps-launch --elastic 2:3 --workers 2 -- python elastic_mixed.py

The chief prints ``scale=...``: its loss scale at the end.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfps.keras  # noqa: E402

images, digits = load_digits(return_X_y=True)
order = np.random.default_rng(0).permutation(len(digits))
x, y = (images[order] / 16.0).astype(np.float32), digits[order].astype(np.int64)

keras.mixed_precision.set_global_policy("mixed_float16")
strategy = tfps.keras.Strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax", dtype="float32")])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                                    initial_scale=2.0 ** 24, dynamic_growth_steps=4)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
model.fit(x[:1024], y[:1024], batch_size=64, epochs=3, verbose=0)
if strategy.is_chief:
    print(f"scale={float(model.optimizer.dynamic_scale.numpy())}")
