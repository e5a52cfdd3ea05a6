"""A user's Keras program, for tests/cluster/test_keras_fit.py: ``model.fit`` on tfps with the callbacks asked for.

    python tests/cluster/keras_program.py --out DIR --callbacks checkpoint,csv [...]

Run once per worker with ``TF_CONFIG`` set (the tests start each process, as
``ps-launch -- ...`` does). A small MLP on the digits data, SGD with momentum, global batches of
64 (1437 training examples: 22 full batches and one of 29). Each worker writes
``DIR/worker<i>.json``: its History, the learning rate the server used for each of
its updates, what ``evaluate`` and ``predict`` gave after ``fit``, and what a
callback of its own saw; the chief also saves the model.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import tfps.keras  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--callbacks", default="")
p.add_argument("--learning-rate", type=float, default=0.1)
p.add_argument("--nan-in-batch", type=int, default=-1, help="a NaN in the first example of this global batch")
p.add_argument("--exit-after-epoch", type=int, default=-1, help="the chief exits 3 at this epoch's end")
p.add_argument("--weights", choices=("", "class", "sample"), default="", help="class_weight or sample_weight")
p.add_argument("--steps-per-epoch", type=int, default=0)
p.add_argument("--initial-epoch", type=int, default=0)
p.add_argument("--validation-freq", type=int, default=1)
p.add_argument("--per-worker", action="store_true", help="each worker's own batches of 32 (its shard of the data)")
p.add_argument("--count-metrics", action="store_true",
               help="four metrics counting the examples of each step, one per variable aggregation")
p.add_argument("--accumulate", type=int, default=0, help="the optimizer's gradient_accumulation_steps")
p.add_argument("--ema-overwrite", type=int, default=0, help="use_ema with this ema_overwrite_frequency")
p.add_argument("--alone", action="store_true", help="one plain process, no tfps: the reference")
p.add_argument("--arrays", action="store_true",
               help="fit on the NumPy arrays (batch_size=64, Keras' default shuffle=True, unseeded)")
p.add_argument("--shuffle", choices=("", "unseeded", "by-worker"), default="",
               help="shuffle the training examples each epoch: unseeded, or seeded by the worker's index")
args = p.parse_args()


class Alone:
    """What the program reads of a strategy, for one plain process (``--alone``)."""

    worker_index, num_replicas_in_sync, is_chief, mode, server_learning_rates = 0, 1, True, "alone", []
    connection = type("Connection", (), {"version": None})

    def scope(self):
        return tf.distribute.get_strategy().scope()


strategy = Alone() if args.alone else tfps.keras.Strategy(batches="per_worker" if args.per_worker else "global")
images, labels = load_digits(return_X_y=True)
images = (images / 16.0).astype(np.float32)
order = np.random.default_rng(0).permutation(len(labels))
images, labels = images[order], labels[order].astype(np.int64)
train_x, train_y, test_x, test_y = images[:1437], labels[:1437], images[1437:], labels[1437:]
if args.nan_in_batch >= 0:
    train_x = train_x.copy()
    train_x[64 * args.nan_in_batch, 0] = np.nan
if args.weights == "sample":
    sample_weight = np.where(train_y % 2 == 0, 2.0, 0.5).astype(np.float32)
    train = tf.data.Dataset.from_tensor_slices((train_x, train_y, sample_weight)).batch(64)
else:
    train = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    if args.shuffle:
        train = train.shuffle(len(train_y), seed=strategy.worker_index if args.shuffle == "by-worker" else None)
    train = train.batch(64)
if args.per_worker:  # as a ParameterServerStrategy dataset_fn shards by its input context
    train = train.unbatch().shard(strategy.num_replicas_in_sync, strategy.worker_index).batch(32)
if args.steps_per_epoch:
    train = train.repeat()
test = tf.data.Dataset.from_tensor_slices((test_x, test_y)).batch(64)


class Seen(keras.callbacks.Callback):
    """The user's own callback: what it was called with."""

    def __init__(self):
        super().__init__()
        self.epochs, self.batches, self.lrs = [], 0, []

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(epoch)
        self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))
        if epoch == args.exit_after_epoch and strategy.is_chief:
            os._exit(3)  # the job dies here; BackupAndRestore wrote this epoch


class Examples(keras.metrics.Metric):
    """The examples this worker's steps computed, in a variable of the given aggregation."""

    def __init__(self, aggregation, **kwargs):
        super().__init__(name=f"examples_{aggregation}", **kwargs)
        self.count = self.add_variable(shape=(), initializer="zeros", aggregation=aggregation, name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], self.count.dtype))

    def result(self):
        return self.count * 1.0  # a value, not the variable (validation updates it after)


def schedule(epoch, lr):
    return 0.1 if epoch < 1 else 0.02


with strategy.scope():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=args.learning_rate, momentum=0.9,
                                                 gradient_accumulation_steps=args.accumulate or None,
                                                 use_ema=bool(args.ema_overwrite), ema_momentum=0.5,
                                                 ema_overwrite_frequency=args.ema_overwrite or None),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"] + ([Examples(a) for a in ("sum", "mean", "only_first_replica", "none")]
                                          if args.count_metrics else []))

seen = Seen()
made = {
    "checkpoint": lambda: keras.callbacks.ModelCheckpoint(os.path.join(args.out, "ckpt-{epoch}.keras")),
    "csv": lambda: keras.callbacks.CSVLogger(os.path.join(args.out, "log.csv")),
    "tensorboard": lambda: keras.callbacks.TensorBoard(os.path.join(args.out, "tb")),
    "early": lambda: keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=2),
    "scheduler": lambda: keras.callbacks.LearningRateScheduler(schedule),
    "plateau": lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0,
                                                         min_lr=1e-4),
    "nan": lambda: keras.callbacks.TerminateOnNaN(),
    "backup": lambda: keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup")),
}
callbacks = [made[name]() for name in args.callbacks.split(",") if name] + [seen]
fit_kwargs = {}
if args.weights == "class":
    fit_kwargs["class_weight"] = {c: (3.0 if c == 1 else 1.0) for c in range(10)}
if args.steps_per_epoch:
    fit_kwargs["steps_per_epoch"] = args.steps_per_epoch
data = {"x": train_x, "y": train_y, "batch_size": 64} if args.arrays else {"x": train}
history = model.fit(**data, epochs=args.epochs, validation_data=test, callbacks=callbacks,
                    initial_epoch=args.initial_epoch, validation_freq=args.validation_freq, **fit_kwargs)
evaluated = model.evaluate(test, return_dict=True, verbose=0)
predicted = model.predict(test_x[:5], verbose=0)
if strategy.is_chief:
    model.save(os.path.join(args.out, "model.keras"))
record = {
    "worker": strategy.worker_index, "mode": strategy.mode, "history": history.history, "epochs": history.epoch,
    "server_learning_rates": strategy.server_learning_rates, "evaluate": evaluated,
    "predict": predicted.tolist(), "seen_epochs": seen.epochs, "seen_batches": seen.batches, "seen_lrs": seen.lrs,
    "version": strategy.connection.version,
    "next_pass_labels": next(iter(train))[1].numpy().tolist(),  # the first batch of the pass after fit's
    "weights": [v.numpy().tolist() for v in model.trainable_variables], "iterations": int(model.optimizer.iterations),
}
with open(os.path.join(args.out, f"worker{strategy.worker_index}.json"), "w") as f:
    json.dump(record, f)
