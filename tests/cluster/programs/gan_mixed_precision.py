"""A user's GAN in half precision: the keras.io GAN step ("Customizing what happens in fit()")
under ``keras.mixed_precision.set_global_policy("mixed_float16")``, each optimizer wrapped in
its own ``LossScaleOptimizer`` and each loss scaled before its gradients are taken, as the
keras.io mixed-precision guide tells custom training loops to do.

    python gan_mixed_precision.py --out DIR [--alone | --mirrored] [--overflow-batch K]

The data are gan.py's (digits as 64 pixels, the latent vectors with them). ``--overflow-batch
K``: the last image of global batch K (of each epoch) is 1e4 in every pixel: its forward pass
and loss stay finite, and its scaled gradients overflow float16 in the discriminator's step
alone (the generator's step sees generated images only): the discriminator's update is
skipped and its scale halved, the generator's goes on. Writes
``DIR/worker<i>.json``: History, the final weights, each optimizer's iterations, scale and
step counter.
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
p.add_argument("--overflow-batch", type=int, default=-1)
args = p.parse_args()

import tensorflow as tf  # noqa: E402

if args.mirrored:  # before TensorFlow initializes its devices
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(11)
tf.config.experimental.enable_op_determinism()
keras.mixed_precision.set_global_policy("mixed_float16")
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
        combined = tf.concat([self.generator(z1), real], axis=0)
        labels = tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
            scaled = self.d_optimizer.scale_loss(d_loss)
        grads = tape.gradient(scaled, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((n, 1)), self.discriminator(self.generator(z2)))
            scaled = self.g_optimizer.scale_loss(g_loss)
        grads = tape.gradient(scaled, self.generator.trainable_weights)
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
if args.overflow_batch >= 0:
    images[64 * args.overflow_batch + 63] = 1e4
noise = np.random.default_rng(5).standard_normal((2, len(images), LATENT)).astype(np.float32)
train = tf.data.Dataset.from_tensor_slices({"images": images, "z1": noise[0], "z2": noise[1]}).batch(64)
if args.mirrored:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    train = train.with_options(options)

with strategy.scope():
    # the outputs in float32, as the guide advises: the real images join the generated ones unchanged
    discriminator = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.LeakyReLU(0.2),
                                      keras.layers.Dense(1, dtype="float32")])
    generator = keras.Sequential([keras.Input((LATENT,)), keras.layers.Dense(32), keras.layers.LeakyReLU(0.2),
                                  keras.layers.Dense(64, activation="sigmoid", dtype="float32")])
    gan = GAN(discriminator, generator)
    gan.compile(d_optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(3e-4)),
                g_optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
                loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    if args.mirrored:  # MirroredStrategy needs them built in its scope (a placeholder error otherwise)
        gan.d_optimizer.build(discriminator.trainable_variables)
        gan.g_optimizer.build(generator.trainable_variables)

history = gan.fit(train, epochs=2, verbose=0)
optimizers = (gan.d_optimizer, gan.g_optimizer)
record = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "weights": [np.asarray(w).tolist() for w in gan.get_weights()],
          "iterations": [int(o.iterations.numpy()) for o in optimizers],
          "scales": [float(o.dynamic_scale.numpy()) for o in optimizers],
          "step_counters": [int(o.step_counter.numpy()) for o in optimizers]}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
