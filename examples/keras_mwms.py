"""TensorFlow's MultiWorkerMirroredStrategy tutorial program, on tfps: one line changed (``# tfps``).

    ps-launch --mode sync --workers 2 -- python examples/keras_mwms.py
    ps-launch --elastic 2:3 --workers 2 -- python examples/keras_mwms.py   # workers may come and go

Keras 3's ``model.fit`` fails under ``tf.distribute.MultiWorkerMirroredStrategy``
(keras-team/keras#20585); with the strategy line below it trains on a tfps server,
the global batch split between the workers, the loss and metrics logged those of
the global batch. Every other line is the tutorial's, on the digits data (8x8
images) instead of MNIST so that it runs in seconds. With ``--elastic`` the server
deals the examples of ``train_dataset`` (read once) to the workers live at each
round (docs/elastic.md). The chief prints ``val_accuracy=...`` of the last epoch.
"""

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tfps.keras  # tfps


def digits_datasets(global_batch_size):
    images, labels = load_digits(return_X_y=True)
    images = (images.reshape(-1, 8, 8, 1) / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(labels))
    images, labels = images[order], labels[order].astype(np.int64)
    cut = int(0.8 * len(labels))
    train = tf.data.Dataset.from_tensor_slices((images[:cut], labels[:cut]))
    test = tf.data.Dataset.from_tensor_slices((images[cut:], labels[cut:]))
    return (train.shuffle(cut, seed=0).batch(global_batch_size),
            test.batch(global_batch_size))


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(shape=(8, 8, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


strategy = tfps.keras.Strategy()  # tfps: was tf.distribute.MultiWorkerMirroredStrategy()
global_batch_size = 64
train_dataset, test_dataset = digits_datasets(global_batch_size)
with strategy.scope():
    model = build_and_compile_cnn_model()
history = model.fit(train_dataset, epochs=5, validation_data=test_dataset)
if strategy.cluster_resolver.task_id == 0:
    print(f"val_accuracy={history.history['val_accuracy'][-1]:.4f}")
