"""``gradient_accumulation_steps`` under ``tfps.keras``: one server update per k batches.

    python -m pytest tests/worker/test_keras_accumulation.py -q

One worker's fit in this process against a real in-process server, against one-process
Keras ``model.fit`` run eagerly with the same optimizer. The rule (Keras 3's
``BaseOptimizer``): each batch's gradients are added to zeros in turn; every k-th batch the
update is ``(g + accumulated) / k``, with Adam's step count the updates (``iterations``,
``_iterations // k``) and the schedule at the batches (``_iterations``); the other batches
change no weight. So the weights end where ``model.fit``'s end, bit for bit (one worker,
as the one-worker sparse-rule test), and the local ``optimizer.iterations`` is Keras'.
With ``use_ema`` Keras moves the averages at every batch, and the server's update moves them
for each of its window's batches (``ps_server.core.optim.optimizers``).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.keras import Strategy

BATCHES, BATCH, K = 12, 8, 3


def optimizer(kind: str):
    if kind == "adam-schedule":
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        return keras.optimizers.Adam(schedule, gradient_accumulation_steps=K)
    if kind.startswith("adamw-ema"):  # adamw-ema-overwrite: the windows of updates 1, 3, 5... overwrite
        return keras.optimizers.AdamW(0.05, use_ema=True, ema_momentum=0.8, gradient_accumulation_steps=K,
                                      ema_overwrite_frequency=2 if kind.endswith("overwrite") else None)
    return keras.optimizers.SGD(0.05, momentum=0.5, gradient_accumulation_steps=K)


def fit(kind: str, server: int, batches: int = BATCHES, fits: int = 1, path=None, mode: str = "sync") -> list:
    """[the trainable weights after each of ``fits`` fits of 2 epochs of ``batches`` batches, the
    optimizer's ``iterations`` at the end; with ``path``, then the averages ``model.save_weights``
    writes there, under ``tfps.keras`` the server's]. ``server``: its shards (0: plain Keras) in ``mode``."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * BATCH, 5)).astype(np.float32)
    y = (x @ rng.normal(size=(5, 1))).astype(np.float32)
    running = [build_server(ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=1)).start()
               for _ in range(server)]
    try:
        strategy = Strategy(ps=",".join(r.address for r in running), num_workers=1) if server \
            else tf.distribute.get_strategy()
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=optimizer(kind), loss="mse", run_eagerly=not server)
        weights = []
        for _ in range(fits):
            model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
            weights.append([v.numpy() for v in model.trainable_variables])
        out = [weights, int(model.optimizer.iterations)]
        if path is not None:
            model.save_weights(path)
            out.append([a.numpy() for a in model.optimizer._model_variables_moving_average])
        if server:
            strategy.close()
        return out
    finally:
        for r in running:
            r.stop(grace=0.5)


@pytest.mark.parametrize("kind", ["sgd-momentum", "adam-schedule"])
def test_one_server_update_per_k_batches_ends_where_model_fit_ends(kind):
    (weights,), iterations = fit(kind, server=1)
    (alone,), alone_iterations = fit(kind, server=0)
    assert iterations == alone_iterations == 2 * BATCHES // K
    assert [w.tobytes() for w in weights] == [w.tobytes() for w in alone], \
        f"max difference {max(float(np.max(np.abs(a - b))) for a, b in zip(weights, alone))}"


@pytest.mark.parametrize("kind, mode", [("adamw-ema", "sync"), ("adamw-ema-overwrite", "sync"),
                                        ("adamw-ema-overwrite", "async")])
@pytest.mark.parametrize("shards", [1, 2])
def test_use_ema_moves_the_averages_at_every_batch_and_a_fit_ending_inside_a_window_as_model_fit(tmp_path, shards,
                                                                                               kind, mode):
    """``use_ema``: Keras moves the averages at each batch, the window's accumulating ones too,
    and ``fit`` ends by swapping them in (``finalize_variable_values``). Two fits of 2 epochs of
    5 batches with K = 3: the first ends 1 batch into a window, whose averages the server moves
    for it at the end (``Window.batches``), the second completes that window and ends 2 batches
    into another. Each fit's weights, the iterations and the averages ``model.save_weights``
    writes are the plain ``model.fit``'s, to the bit, on one server shard and on two. With
    ``ema_overwrite_frequency=2`` the windows of ``iterations`` 1, 3 and 5 overwrite the
    variables with the averages at each of their batches, and the window's later gradients are
    taken there (the worker moves the server's averages for them): the first fit ends 1 batch
    into the window of 3, the second fit completes it. One worker in async (its window's push
    applied on arrival) ends at the same bits."""
    served = fit(kind, server=shards, batches=5, fits=2, path=tmp_path / "served.weights.h5", mode=mode)
    alone = fit(kind, server=0, batches=5, fits=2, path=tmp_path / "alone.weights.h5")
    assert served[1] == alone[1] == 20 // K
    assert [[w.tobytes() for w in ws] for ws in served[0]] == [[w.tobytes() for w in ws] for ws in alone[0]]
    assert [a.tobytes() for a in served[2]] == [a.tobytes() for a in alone[2]]


def test_ema_overwrites_inside_windows_run_on_elastic_async_tasks_each_one_update():
    """Elastic async: a task is a window's batches (K x batch_size / workers examples), one
    update, as every async step taken at the parameters the worker pulled; the server moves the
    averages K times an update and overwrites every second one (the averages change, the
    variables finite). Elastic sync, a round a batch, ends at ``model.fit``'s bits:
    tests/worker/test_keras_loss_scale.py."""
    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="async", num_workers=1)).start()
    try:
        strategy = Strategy(ps=running.address, num_workers=1, elastic=True, deterministic=False)
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
            model.compile(optimizer=optimizer("adamw-ema-overwrite"), loss="mse")
        rng = np.random.default_rng(0)
        x = rng.normal(size=(48, 5)).astype(np.float32)
        model.fit(x, x[:, :1] * 2, batch_size=4, epochs=2, verbose=0)
        status = strategy.connection.client.status()
        assert (status.tasks_done, list(status.epoch_examples)) == (8, [48, 48])
        _, _, states = strategy.connection.client.optimizer_state(strategy.connection.worker_id)
        assert all(int(s["iterations"]) == 8 and np.abs(s["ema"]).max() > 0 for s in states.values())
        assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
        strategy.close()
    finally:
        running.stop(grace=0.5)


def test_a_model_file_saved_inside_a_window_the_elastic_server_holds_resumes_there_in_one_process(tmp_path):
    """Elastic sync: after 5 batches of windows of 2 the server holds one batch in its
    accumulators; ``model.save`` writes them as Keras' ``_accumulated_gradients`` with
    ``iterations`` 5, so ``load_model`` and ``fit`` on in one process complete that window and
    end at the bits of one process that ran all 10 batches (in the order the server dealt them)."""
    from ps_common.batches import global_batch

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = x @ rng.normal(size=(5, 1)).astype(np.float32)

    def model_of(scope):
        with scope:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5, gradient_accumulation_steps=2), loss="mse")
        return model

    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=1, elastic_min_workers=1,
                                        micro_batches=1)).start()
    try:
        strategy = Strategy(ps=running.address, num_workers=1, elastic=True, deterministic=False)
        served = model_of(strategy.scope())
        served.fit(x, y, batch_size=8, epochs=1, verbose=0)
        served.save(tmp_path / "served.keras")
        strategy.close()
    finally:
        running.stop(grace=0.5)
    order = np.concatenate([global_batch(40, 8, strategy.config.seed, r) for r in range(10)])
    resumed = keras.models.load_model(tmp_path / "served.keras")
    assert int(resumed.optimizer._iterations.numpy()) == 5
    assert resumed.optimizer._accumulated_gradients[0].numpy().any()
    resumed.fit(x[order[40:]], y[order[40:]], batch_size=8, epochs=1, shuffle=False, verbose=0)
    plain = model_of(tf.distribute.get_strategy().scope())
    plain.fit(x[order], y[order], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert [v.numpy().tobytes() for v in resumed.trainable_variables] == \
        [v.numpy().tobytes() for v in plain.trainable_variables]
