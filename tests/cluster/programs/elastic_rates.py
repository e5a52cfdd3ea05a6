"""Learning rates that callbacks change, in an elastic job: a ``LearningRateScheduler`` that
halves the rate at every epoch's start (it reads the rate it last set, so a worker that joins
late cannot compute it alone) and a ``ReduceLROnPlateau`` on the validation loss (the server's
parameters on the validation data: the same on every worker). A small dense model on the
digits, Adam; 1,024 training examples in global batches of 64 (16 rounds an epoch), in two
fits of two epochs each (the second goes on from the first's last round).

    ps-launch --elastic 2:3 --workers 2 -- python elastic_rates.py

The chief prints ``rates=[...]``: its optimizer's rate at each epoch's end.
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

strategy = tfps.keras.Strategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
rates = []
callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr / 2),
             keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=0.05),
             keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: rates.append(
                 float(model.optimizer.learning_rate.numpy())))]
for _ in range(2):
    model.fit(x[:1024], y[:1024], batch_size=64, epochs=2, validation_data=(x[1024:], y[1024:]),
              callbacks=callbacks, verbose=0)
if strategy.is_chief:
    print(f"rates={rates}")
