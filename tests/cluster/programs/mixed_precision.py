"""A user's program under ``keras.mixed_precision.set_global_policy("mixed_float16")``, as the
Keras mixed-precision guide writes it: layers compute in float16, the last one's outputs are
float32, and ``compile`` wraps the optimizer in a ``LossScaleOptimizer`` (dynamic loss scaling).

    python mixed_precision.py --out DIR [--alone | --mirrored] [--overflow-batch K] [--accumulate N]

``--overflow-batch K``: the last example of global batch K (of each epoch) is 1e5 in every pixel,
which overflows float16: its gradients are not finite and the step is skipped, the scale halved.
``--accumulate N``: Adam's ``gradient_accumulation_steps`` (an update every N batches; a skipped
batch is not one of them).
Writes ``DIR/worker<i>.json``: History, the final weights, the loss scale, the step counts.
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
p.add_argument("--accumulate", type=int, default=0)
args = p.parse_args()

import tensorflow as tf  # noqa: E402

if args.mirrored:  # before TensorFlow initializes its devices
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(13)
tf.config.experimental.enable_op_determinism()
keras.mixed_precision.set_global_policy("mixed_float16")

if args.alone:
    strategy, index = tf.distribute.get_strategy(), 0
elif args.mirrored:
    strategy, index = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), 0
else:
    import tfps.keras

    strategy = tfps.keras.Strategy()
    index = strategy.worker_index

images, labels = load_digits(return_X_y=True)
x, y = (images[:1024] / 16.0).astype(np.float32), labels[:1024].astype(np.int64)
if args.overflow_batch >= 0:
    x[64 * args.overflow_batch + 63] = 1e5
train = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
if args.mirrored:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    train = train.with_options(options)

with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10),
                              keras.layers.Activation("softmax", dtype="float32")])
    model.compile(optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=args.accumulate or None),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
history = model.fit(train, epochs=2, verbose=0)
optimizer = model.optimizer
record = {"history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
          "weights": [np.asarray(w).tolist() for w in model.get_weights()],
          "scale": float(optimizer.dynamic_scale.numpy()), "step_counter": int(optimizer.step_counter.numpy()),
          "iterations": int(optimizer.iterations.numpy()), "optimizer": type(optimizer).__name__}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"worker{index}.json"), "w") as f:
    json.dump(record, f)
