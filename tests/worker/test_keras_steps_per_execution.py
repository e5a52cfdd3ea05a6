"""``steps_per_execution`` under ``tfps.keras``: an epoch that is not a multiple of it.

    python -m pytest tests/worker/test_keras_steps_per_execution.py -q

One worker's fit in this process against a real in-process server. The rule (Keras'
``TFEpochIterator`` and train function): each call runs up to ``steps_per_execution``
steps, the epoch's last call those left, and the batch-end callbacks come once per call.
So 22 batches at 4 per call are 6 calls an epoch, and the steps are those of
``steps_per_execution=1``, the same batches in the same order: the same weights, bit for bit.
"""

import keras
import numpy as np
import tensorflow as tf

from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.keras import Strategy

BATCHES, BATCH, EPOCHS = 22, 8, 2


class Calls(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def fit(steps_per_execution: int, server: bool) -> tuple[list, list, list]:
    """(weights, batch-end callbacks' batch numbers, the loss History logged)."""
    keras.utils.set_random_seed(0)  # the shuffle's order each epoch: its seed and the global one
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCHES * BATCH, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1))).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=3).batch(BATCH)
    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=1)).start() \
        if server else None
    try:
        strategy = Strategy(ps=running.address, num_workers=1) if server else tf.distribute.get_strategy()
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse",
                          steps_per_execution=steps_per_execution)
        calls = Calls()
        history = model.fit(data, epochs=EPOCHS, callbacks=[calls], verbose=0)
        if server:
            strategy.close()
        return [v.numpy() for v in model.trainable_variables], calls.ends, history.history["loss"]
    finally:
        if running is not None:
            running.stop(grace=0.5)


def test_an_epoch_that_is_not_a_multiple_of_steps_per_execution_runs_every_batch_as_one_process():
    weights, ends, losses = fit(4, server=True)
    assert ends == [3, 7, 11, 15, 19, 23] * EPOCHS  # Keras' end_step of each call: 6 calls an epoch
    single, _, single_losses = fit(1, server=True)
    assert [w.tobytes() for w in weights] == [w.tobytes() for w in single] and losses == single_losses
    alone, alone_ends, alone_losses = fit(4, server=False)
    assert ends == alone_ends
    np.testing.assert_allclose(np.concatenate([w.ravel() for w in weights]),
                               np.concatenate([w.ravel() for w in alone]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(losses, alone_losses, rtol=1e-6)
