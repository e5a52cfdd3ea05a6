"""``gradient_accumulation_steps`` under ``tfps.keras``: one server update per k batches.

    python -m pytest tests/worker/test_keras_accumulation.py -q

One worker's fit in this process against a real in-process server, against one-process
Keras ``model.fit`` run eagerly with the same optimizer. The rule (Keras 3's
``BaseOptimizer``): each batch's gradients are added to zeros in turn; every k-th batch the
update is ``(g + accumulated) / k``, with Adam's step count the updates (``iterations``,
``_iterations // k``) and the schedule at the batches (``_iterations``); the other batches
change no weight. So the weights end where ``model.fit``'s end, bit for bit (one worker,
as the one-worker sparse-rule test), and the local ``optimizer.iterations`` is Keras'.
"""

import os

os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"  # oneDNN changes TensorFlow's bits; off before it loads

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from ps_server.config import ServerConfig  # noqa: E402
from ps_server.server import build_server  # noqa: E402
from worker.keras import Strategy  # noqa: E402

BATCHES, BATCH, K = 12, 8, 3


def optimizer(kind: str):
    if kind == "adam-schedule":
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        return keras.optimizers.Adam(schedule, gradient_accumulation_steps=K)
    return keras.optimizers.SGD(0.05, momentum=0.5, gradient_accumulation_steps=K)


def fit(kind: str, server: bool) -> tuple[list, int]:
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCHES * BATCH, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1))).astype(np.float32)
    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=1)).start() \
        if server else None
    try:
        strategy = Strategy(ps=running.address, num_workers=1) if server else tf.distribute.get_strategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=optimizer(kind), loss="mse", run_eagerly=not server)
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        if server:
            strategy.close()
        return [v.numpy() for v in model.trainable_variables], int(model.optimizer.iterations)
    finally:
        if running is not None:
            running.stop(grace=0.5)


@pytest.mark.parametrize("kind", ["sgd-momentum", "adam-schedule"])
def test_one_server_update_per_k_batches_ends_where_model_fit_ends(kind):
    weights, iterations = fit(kind, server=True)
    alone, alone_iterations = fit(kind, server=False)
    assert iterations == alone_iterations == 2 * BATCHES // K
    assert [w.tobytes() for w in weights] == [w.tobytes() for w in alone], \
        f"max difference {max(float(np.max(np.abs(a - b))) for a, b in zip(weights, alone))}"
