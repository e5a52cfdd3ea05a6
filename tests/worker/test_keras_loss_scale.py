"""A loss scale (``mixed_float16``) around each of several optimizers under ``tfps.keras``.

    python -m pytest tests/worker/test_keras_loss_scale.py -q

One worker's fit in this process against a real in-process server, against one-process Keras
``model.fit`` of the same program. The rule (Keras 3's ``LossScaleOptimizer``): each optimizer
checks its own scaled gradients; where they are not finite its update is skipped (the inner
optimizer's ``iterations`` not counted), its scale halves and its counter resets; otherwise
the update is made and its counter counts, the scale doubling every ``dynamic_growth_steps``.
The other optimizers of the step go on. So one worker ends at ``model.fit``'s weights to the
bit, with each optimizer's scale, counter and step count.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from worker.keras import Strategy

BATCHES, BATCH, OVERFLOW = 6, 16, 2  # the batch (of each epoch) with one example's input 1e4


class TwoScaled(keras.Model):
    """Two layers, each trained by its own optimizer under its own loss scale as the keras.io
    mixed-precision guide's custom loops do (``scale_loss``, then ``apply``): the first on
    ``x``, then the second on ``z``. It logs the first's scale as read after both applies."""

    def __init__(self):
        super().__init__()
        self.first, self.second = keras.layers.Dense(2), keras.layers.Dense(2)

    def call(self, data):
        return self.first(data["x"]) + self.second(data["z"])

    def compile(self, first, second):
        super().compile()
        self.first_optimizer, self.second_optimizer = first, second

    def train_step(self, data):
        inputs, y = data
        logs = {}
        for name, layer, optimizer in (("x", self.first, self.first_optimizer), ("z", self.second,
                                                                                  self.second_optimizer)):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((keras.ops.cast(layer(inputs[name]), "float32") - y) ** 2)
                scaled = optimizer.scale_loss(loss)
            optimizer.apply(tape.gradient(scaled, layer.trainable_weights), layer.trainable_weights)
            logs[f"{name}_loss"] = loss
        logs["first_scale"] = keras.ops.convert_to_tensor(self.first_optimizer.dynamic_scale)
        return logs


class BatchLogs(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})


def fit(overflow: str, strategy, order=None) -> dict:
    """``TwoScaled`` under ``mixed_float16``, two epochs; ``order``: the two epochs' examples in
    this order, one epoch of them (as an elastic server deals them)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        data = {"x": rng.normal(size=(BATCHES * BATCH, 4)).astype(np.float32),
                "z": rng.normal(size=(BATCHES * BATCH, 3)).astype(np.float32)}
        y = rng.normal(size=(BATCHES * BATCH, 2)).astype(np.float32)
        data[overflow][OVERFLOW * BATCH + 5] = 1e4  # its float16 gradients overflow at any scale here
        epochs = 2
        if order is not None:
            data, y, epochs = {k: v[order] for k, v in data.items()}, y[order], 1
        with strategy.scope():
            model = TwoScaled()
            model.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0 ** 8,
                                                              dynamic_growth_steps=3),
                          keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 6,
                                                              dynamic_growth_steps=4))
        logs = BatchLogs()
        model.fit(data, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[logs])
        return {"weights": [v.numpy().tobytes() for v in model.trainable_variables], "logs": logs.logs,
                "optimizers": [(float(o.dynamic_scale.numpy()), int(o.step_counter.numpy()), int(o.iterations.numpy()))
                               for o in (model.first_optimizer, model.second_optimizer)]}
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("overflow, mode", [("x", "sync"), ("z", "sync"), ("x", "async")],
                         ids=["first-pushed-in-the-step-sync", "last-pushed-after-the-step-sync",
                              "first-pushed-in-the-step-async"])
def test_an_overflow_skips_only_its_own_optimizer_s_update_and_halves_only_its_scale_as_model_fit_does(
        server, overflow, mode):
    """The overflowing example feeds one optimizer's gradients alone: the first's (pushed at once
    inside the step, its scale stepped in the step's graph: the scale the step reads after it is
    the new one, as in one process) or the last's (pushed after the step). Only that optimizer's
    update is skipped (one an epoch) and only its scale halves; every scale grows on its own
    counter; the weights are ``model.fit``'s to the bit."""
    plain = fit(overflow, tf.distribute.get_strategy())
    strategy = Strategy(ps=server(mode, 1).address, num_workers=1)
    try:
        ours = fit(overflow, strategy)
    finally:
        strategy.close()
    steps = 2 * BATCHES
    skipped = [2, 0] if overflow == "x" else [0, 2]
    assert [iterations for _, _, iterations in plain["optimizers"]] == [steps - s for s in skipped]
    assert ours["optimizers"] == plain["optimizers"]
    assert ours["logs"] == plain["logs"]  # the first's scale read after its apply: halved at the overflow if its own
    halved = plain["logs"][OVERFLOW]["first_scale"] < plain["logs"][OVERFLOW - 1]["first_scale"]
    assert halved == (overflow == "x")
    assert ours["weights"] == plain["weights"]


@pytest.mark.parametrize("overflow", ["x", "z"])
def test_an_elastic_step_of_two_scaled_optimizers_skips_each_one_s_own_rounds_as_model_fit_does(
        server_config, overflow):
    """Elastic sync deals each batch as two rounds, one for each optimizer's apply; a round that
    overflows skips its optimizer's update alone, and each worker derives each optimizer's scale
    from the skipped rounds of its own applies. One worker, a micro-batch a round: ``model.fit``
    on the examples in the order the server deals them, to the bit, with each optimizer's scale,
    counter and iterations."""
    from ps_common.batches import global_batch

    running = server_config(mode="sync", num_workers=1, elastic_min_workers=1, micro_batches=1)
    strategy = Strategy(ps=running.address, num_workers=1, elastic=True, deterministic=False)
    try:
        ours = fit(overflow, strategy)
        assert strategy.connection.version == 2 * 2 * BATCHES
    finally:
        strategy.close()
    order = np.concatenate([global_batch(BATCHES * BATCH, BATCH, strategy.config.seed, r) for r in range(2 * BATCHES)])
    plain = fit(overflow, tf.distribute.get_strategy(), order)
    skipped = [2, 0] if overflow == "x" else [0, 2]
    assert [iterations for _, _, iterations in plain["optimizers"]] == [2 * BATCHES - s for s in skipped]
    assert (ours["optimizers"], ours["weights"]) == (plain["optimizers"], plain["weights"])


def test_a_loss_scale_around_a_multi_optimizer_skips_its_one_push_as_model_fit_does(server):
    """``mixed_float16`` around a ``MultiOptimizer`` (Adam for the hidden layer, SGD with momentum
    for the rest): its ``apply`` is one push of both groups' variables, with one skip flag, as
    Keras' one ``LossScaleOptimizer`` skips both. An overflowing example (one an epoch): one
    worker ends at ``model.fit``'s weights and losses to the bit, with its scale, counter and
    iterations."""
    runs = []
    for strategy in (tf.distribute.get_strategy(), Strategy(ps=server("sync", 1).address, num_workers=1)):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            rng = np.random.default_rng(0)
            x, y = rng.normal(size=(BATCHES * BATCH, 4)).astype(np.float32), rng.integers(0, 3, BATCHES * BATCH)
            x[OVERFLOW * BATCH + 5] = 1e4
            with strategy.scope():
                keras.utils.set_random_seed(0)
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu", name="hidden"),
                                          keras.layers.Dense(3, name="out"),
                                          keras.layers.Activation("softmax", dtype="float32")])
                chosen = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.1, momentum=0.9),
                                                       {"hidden/.*": keras.optimizers.Adam(0.01)})
                model.compile(optimizer=keras.optimizers.MultiOptimizer(chosen), loss="sparse_categorical_crossentropy")
            history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        scale = model.optimizer
        runs.append([[v.numpy().tobytes() for v in model.trainable_variables], history.history["loss"],
                     float(scale.dynamic_scale.numpy()), int(scale.step_counter.numpy()), int(scale.iterations.numpy())])
        if isinstance(strategy, Strategy):
            strategy.close()
    assert type(scale).__name__ == "LossScaleOptimizer" and runs[0][2:] == [2.0 ** 15 / 4, BATCHES - OVERFLOW - 1, 2 * BATCHES - 2]
    assert runs[1] == runs[0]


def accumulated(strategy, k: int = 3, overwrite: int | None = None, order=None) -> dict:
    """A ``mixed_float16`` fit with ``gradient_accumulation_steps=k`` inside the loss scale;
    batches 4 and 8 of each epoch overflow (one in a window's middle, one at a window's end).
    ``overwrite``: ``use_ema`` with that ``ema_overwrite_frequency``. ``order``: the two
    epochs' examples in this order, one epoch of them (as an elastic server deals them)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(12 * 8, 5)).astype(np.float32)
        y = (x @ rng.normal(size=(5, 1))).astype(np.float32)
        x[[4 * 8 + 3, 8 * 8]] *= 1e4
        x, y, epochs = (x, y, 2) if order is None else (x[order], y[order], 1)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"),
                                      keras.layers.Dense(1), keras.layers.Activation("linear", dtype="float32")])
            model.compile(optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.01, momentum=0.5, gradient_accumulation_steps=k, use_ema=bool(overwrite),
                                     ema_momentum=0.5, ema_overwrite_frequency=overwrite), initial_scale=2.0 ** 8,
                dynamic_growth_steps=4), loss="mse", run_eagerly=not isinstance(strategy, Strategy))
            # eagerly: Keras' (g + accumulated) / k in a graph is rewritten to * (1 / k), one ulp off at k = 3
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
        scale = model.optimizer
        return {"weights": [v.numpy().tobytes() for v in model.trainable_variables],
                "scale": (float(scale.dynamic_scale.numpy()), int(scale.step_counter.numpy()),
                          int(scale.iterations.numpy()))}
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("mode, overwrite", [("sync", None), ("async", None), ("ssp", None), ("sync", 2)])
def test_a_loss_scale_with_gradient_accumulation_skips_a_batch_out_of_its_window_as_model_fit_does(server, mode,
                                                                                                  overwrite):
    """A batch whose scaled gradients are not finite is not accumulated (the window waits for
    another), not counted, and halves the scale; every finite batch counts towards the doubling.
    Sync: the workers vote on each batch of a window (``Strategy.vote``: skipped where any part
    overflows; two workers: tests/cluster/test_keras_programs.py); async and ssp: each worker's
    batches are its own. One worker ends at ``model.fit``'s weights to the bit, with its scale,
    counter and iterations; with ``use_ema`` overwriting every second update too (a skipped
    batch moves no average)."""
    plain = accumulated(tf.distribute.get_strategy(), overwrite=overwrite)
    strategy = Strategy(ps=server(mode, 1).address, num_workers=1)
    try:
        ours = accumulated(strategy, overwrite=overwrite)
    finally:
        strategy.close()
    assert plain["scale"][2] == (2 * 12 - 4) // 3  # the updates: of the batches accumulated, all but 4 skipped
    assert ours == plain


@pytest.mark.parametrize("overwrite, shards", [(None, 1), (2, 1), (2, 2)])
def test_a_loss_scale_with_gradient_accumulation_in_elastic_sync_skips_one_batch_as_model_fit_does(
        server_config, overwrite, shards):
    """Elastic sync: a round is one batch and the server holds the window (its accumulators), so a
    batch that overflows is skipped alone, as in one process, and with ``use_ema`` overwriting the
    variables are the averages at each round of such a window. One worker, each round one
    micro-batch: ``model.fit`` on the examples in the order the server deals them, to the bit,
    with the scale, its counter and the iterations; over two shards too (each holding its
    variables' accumulators)."""
    from ps_common.batches import global_batch

    address = ",".join(server_config(mode="sync", num_workers=1, elastic_min_workers=1, micro_batches=1).address
                       for _ in range(shards))
    strategy = Strategy(ps=address, num_workers=1, elastic=True, deterministic=False)
    try:
        ours = accumulated(strategy, overwrite=overwrite)
        assert strategy.connection.client.status().epoch_examples == [96, 96]
    finally:
        strategy.close()
    order = np.concatenate([global_batch(96, 8, strategy.config.seed, r) for r in range(24)])
    plain = accumulated(tf.distribute.get_strategy(), overwrite=overwrite, order=order)
    assert plain["scale"][2] == (2 * 12 - 4) // 3  # the overflowing batches: 4, wherever they fall
    assert ours == plain
