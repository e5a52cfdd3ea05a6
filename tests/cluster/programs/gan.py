"""A user's GAN as the keras.io guide writes it ("Customizing what happens in fit()", the GAN
part): ``compile(d_optimizer=..., g_optimizer=...)`` and a ``train_step`` that applies the
discriminator's optimizer, then the generator's through the updated discriminator.

    python gan.py --out DIR [--alone | --mirrored] [--eagerly] [--d-learning-rate-at-1 RATE]

The latent vectors come with the data (two per image, drawn once from a seeded generator), so
that every example's noise is the same however the batch is split: a worker's part of a global
batch has the noise one process gives those examples. Digits as 64 pixels; both optimizers Adam, of
two learning rates (3e-4 and 1e-3); ``--d-learning-rate-at-1``: a callback of the user's sets the
discriminator's rate at epoch 1's start (``self.model.d_optimizer.learning_rate = RATE``).
Writes ``DIR/worker<i>.json``: History, the final weights, each optimizer's iterations (under
tfps, the rate the server used for each of this worker's updates too).
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
p.add_argument("--mirrored", action="store_true")
p.add_argument("--eagerly", action="store_true", help="run_eagerly=True")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--g-learning-rate", type=float, default=1e-3)
p.add_argument("--d-learning-rate-at-1", type=float, default=0.0)
args = p.parse_args()

import tensorflow as tf  # noqa: E402

if args.mirrored:  # before TensorFlow initializes its devices
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(11)
tf.config.experimental.enable_op_determinism()
LATENT = 8


class GAN(keras.Model):
    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def call(self, data):  # MirroredStrategy builds the model by calling it on a batch
        return self.generator(data["z1"] if isinstance(data, dict) else data)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real, z1, z2 = data["images"], data["z1"], data["z2"]
        n = tf.shape(real)[0]
        generated = self.generator(z1)
        combined = tf.concat([generated, real], axis=0)
        labels = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((n, 1)), self.discriminator(self.generator(z2)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


if args.alone:
    strategy, index = tf.distribute.get_strategy(), 0
elif args.mirrored:
    strategy, index = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), 0
else:
    import tfps.keras

    strategy = tfps.keras.Strategy()
    index = strategy.worker_index

images = (load_digits(return_X_y=True)[0][:1024] / 16.0).astype(np.float32)
noise = np.random.default_rng(5).standard_normal((2, len(images), LATENT)).astype(np.float32)
train = tf.data.Dataset.from_tensor_slices({"images": images, "z1": noise[0], "z2": noise[1]}).batch(64)
if args.mirrored:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    train = train.with_options(options)

with strategy.scope():
    discriminator = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.LeakyReLU(0.2),
                                      keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(32), keras.layers.LeakyReLU(0.2),
                                  keras.layers.Dense(64, activation="sigmoid")])
    gan = GAN(discriminator, generator)
    gan.compile(d_optimizer=keras.optimizers.Adam(3e-4), g_optimizer=keras.optimizers.Adam(args.g_learning_rate),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    if args.mirrored:  # MirroredStrategy needs them built in its scope (a placeholder error otherwise)
        gan.d_optimizer.build(discriminator.trainable_variables)
        gan.g_optimizer.build(generator.trainable_variables)


class DiscriminatorRate(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.model.d_optimizer.learning_rate = args.d_learning_rate_at_1


gan.run_eagerly = args.eagerly
history = gan.fit(train, epochs=args.epochs, verbose=0,
                  callbacks=[DiscriminatorRate()] if args.d_learning_rate_at_1 else [])
record = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "weights": [np.asarray(w).tolist() for w in gan.get_weights()],
          "iterations": [int(gan.d_optimizer.iterations.numpy()), int(gan.g_optimizer.iterations.numpy())]}
if hasattr(strategy, "server_learning_rates"):
    record["server_learning_rates"] = strategy.server_learning_rates
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
