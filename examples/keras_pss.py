"""TensorFlow's ParameterServerStrategy ``model.fit`` program, on tfps: the strategy line changed (``# tfps``).

    ps-launch --mode async --workers 2 -- python examples/keras_pss.py
    ps-launch --elastic 2:3 --workers 2 -- python examples/keras_pss.py   # workers may come and go

With ParameterServerStrategy the chief coordinates and TensorFlow servers run the
workers and parameter servers; Keras 3's ``model.fit`` does not support it
(keras-team/keras#20585). On tfps every worker runs this program, and the tfps
server applies each worker's gradients as they arrive (``--mode async``); the
loss and metrics each worker logs are its own. ParameterServerStrategy needs an
endless dataset (``repeat()``) and ``steps_per_epoch``; on tfps an epoch is one
pass over a finite one (the two lines marked ``# tfps: ... dropped``), which the
server can also deal example by example to workers that come and go (``--elastic``,
docs/elastic.md). The chief prints ``val_accuracy=...`` of the last epoch.
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
    return (train.shuffle(cut, seed=1).batch(global_batch_size),  # tfps: .repeat() dropped
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
history = model.fit(train_dataset, epochs=10, validation_data=test_dataset)  # tfps: steps_per_epoch=23 dropped
if strategy.cluster_resolver.task_id == 0:
    print(f"val_accuracy={history.history['val_accuracy'][-1]:.4f}")
