"""A user's program as the keras.io guide "Customizing what happens in fit()" writes it: a
subclassed model whose own ``train_step`` runs the tape, ``self.optimizer.apply`` and its own
loss tracker and metric. BatchNormalization (unless ``--no-norm``) gives it non-trainable state.
``--twice``: the step then applies a second optimizer (SGD with momentum) to every variable,
on the gradients of a second forward pass: two optimizers applied to one variable.

    python custom_step.py --out DIR [--alone | --mirrored] [--twice]

``--alone``: one plain process; ``--mirrored``: TensorFlow's MirroredStrategy over two logical
CPUs; neither: tfps (``TF_CONFIG`` set, as ``ps-launch -- ...`` sets it). Writes
``DIR/worker<i>.json``: History, the final weights, the optimizer's iterations.
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
p.add_argument("--mirrored", action="store_true")
p.add_argument("--no-norm", action="store_true", help="without BatchNormalization, whose batch statistics are "
               "each worker's part's, as each replica's are under MirroredStrategy")
p.add_argument("--twice", action="store_true", help="a second optimizer applied to every variable after the first")
args = p.parse_args()

import tensorflow as tf  # noqa: E402

if args.mirrored:  # before TensorFlow initializes its devices
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(7)
tf.config.experimental.enable_op_determinism()


class CustomModel(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.norm = keras.layers.Identity() if args.no_norm else keras.layers.BatchNormalization()
        self.logits = keras.layers.Dense(10)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        self.second = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9) if args.twice else None

    def call(self, x, training=False):
        return self.logits(self.norm(self.hidden(x), training=training))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        trainable_vars = self.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply(gradients, trainable_vars)
        if self.second is not None:  # on the first's update: a second forward pass
            with tf.GradientTape() as tape:
                loss = self.loss_fn(y, self(x, training=True))
            self.second.apply(tape.gradient(loss, trainable_vars), trainable_vars)
        self.loss_tracker.update_state(loss)
        self.accuracy.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "accuracy": self.accuracy.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy]


if args.alone:
    strategy = tf.distribute.get_strategy()
    index = 0
elif args.mirrored:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    index = 0
else:
    import tfps.keras

    strategy = tfps.keras.Strategy()
    index = strategy.worker_index

images, labels = load_digits(return_X_y=True)
images = (images / 16.0).astype(np.float32)
order = np.random.default_rng(0).permutation(len(labels))
x, y = images[order][:1024], labels[order][:1024].astype(np.int64)
train = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
if args.mirrored:  # the same global batches, not re-sharded by file or data
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    train = train.with_options(options)

with strategy.scope():
    model = CustomModel()
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01))
history = model.fit(train, epochs=args.epochs, verbose=0)
record = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "weights": [np.asarray(w).tolist() for w in model.get_weights()],
          "iterations": int(model.optimizer.iterations.numpy())}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
