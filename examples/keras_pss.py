"""TensorFlow's ParameterServerStrategy ``model.fit`` program, on tfps: one line changed (``# tfps``).

    ps-launch --mode async --workers 2 -- python examples/keras_pss.py

With ParameterServerStrategy the chief coordinates and TensorFlow servers run the
workers and parameter servers; Keras 3's ``model.fit`` does not support it
(keras-team/keras#20585). On tfps every worker runs this program, and the tfps
server applies each worker's gradients as they arrive (``--mode async``). As
with ParameterServerStrategy, ``steps_per_epoch`` says how long an epoch is; the
loss and metrics each worker logs are its own. The chief prints
``val_accuracy=...`` of the last epoch.
"""

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tfps.keras  # tfps


def dataset_fn(global_batch_size):
    images, labels = load_digits(return_X_y=True)
    images = (images.reshape(-1, 64) / 16.0).astype(np.float32)
    order = np.random.default_rng(1).permutation(len(labels))
    images, labels = images[order], labels[order].astype(np.int64)
    cut = int(0.8 * len(labels))
    train = tf.data.Dataset.from_tensor_slices((images[:cut], labels[:cut]))
    test = tf.data.Dataset.from_tensor_slices((images[cut:], labels[cut:]))
    return (train.shuffle(cut, seed=1).repeat().batch(global_batch_size),
            test.batch(global_batch_size))


# was: cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tfps.keras.Strategy()  # tfps: was tf.distribute.ParameterServerStrategy(cluster_resolver)
train_dataset, test_dataset = dataset_fn(global_batch_size=64)
with strategy.scope():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(shape=(64,)),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(learning_rate=0.003),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
history = model.fit(train_dataset, epochs=10, steps_per_epoch=23, validation_data=test_dataset)
if strategy.cluster_resolver.task_id == 0:
    print(f"val_accuracy={history.history['val_accuracy'][-1]:.4f}")
