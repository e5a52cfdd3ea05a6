"""tfps.keras.Strategy in one process, before any server: what it attaches, and what it refuses at compile.

The training itself, with real servers and workers, is tests/cluster/test_keras_fit.py.
"""

import contextlib

import keras
import numpy as np

import pytest

import tfps.keras
from worker.keras import Strategy, _part


def small_model():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])


def test_scope_attaches_a_model_compiled_inside_and_puts_compile_back():
    strategy = Strategy(ps="127.0.0.1:1", worker_index=1, num_workers=3)
    original = keras.Model.compile
    with strategy.scope():
        model = small_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert keras.Model.compile is original and "compile" not in keras.Model.__dict__
    outside = small_model()
    outside.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    assert [a.model for a in strategy.models] == [model]
    assert strategy.num_replicas_in_sync == 3 and not strategy.is_chief and strategy.mode is None
    assert (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id) == ("worker", 1)
    assert tfps.keras.Strategy is Strategy


@pytest.mark.parametrize("optimizer, named", [
    (keras.optimizers.Muon(rms_rate=0), "Muon with rms_rate=0"),
])
def test_an_optimizer_or_option_the_server_cannot_run_is_refused_at_compile_naming_it(optimizer, named):
    strategy = Strategy(ps="127.0.0.1:1")
    with pytest.raises(ValueError, match=named), strategy.scope():
        small_model().compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    assert strategy.models == []


def test_a_model_with_its_own_train_step_is_wrapped_where_the_server_deals_the_data_or_not():
    class Custom(keras.Model):
        def train_step(self, data):
            return {}

    inputs = keras.Input((4,))
    model = Custom(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    for elastic in (False, True):
        strategy = Strategy(ps="127.0.0.1:1", elastic=elastic)
        strategy.attach(model)
        assert strategy.models[0].wrap is not None and "apply" in vars(model.optimizer)  # taken over


class GuideStep(keras.Sequential):
    """The "customizing what happens in fit()" guide's own train_step."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        for metric in self.metrics:
            metric.update_state(loss) if metric.name == "loss" else metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class TwoParts(keras.Model):
    """A step that applies ``self.optimizer`` to the first layer and ``self.other`` (when set)
    to the second, each through its own tape."""

    def __init__(self, other=None):
        super().__init__()
        self.first, self.second, self.other = keras.layers.Dense(3), keras.layers.Dense(2), other

    def call(self, x):
        return self.second(self.first(x))

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        for layer, optimizer in ((self.first, self.optimizer), (self.second, self.other)):
            if optimizer is None:
                continue
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x) - y) ** 2)
            grads = tape.gradient(loss, layer.trainable_weights)
            optimizer.apply_gradients(zip(grads, layer.trainable_weights))
        return {"loss": loss}


class NormedParts(TwoParts):
    """``TwoParts`` with a ``BatchNormalization`` after the first layer, whose statistics every
    forward pass moves (both of a step's)."""

    def __init__(self, other=None):
        super().__init__(other)
        self.norm = keras.layers.BatchNormalization()

    def call(self, x):
        return self.second(self.norm(self.first(x), training=True))


@pytest.mark.parametrize("other", [lambda: keras.optimizers.SGD(0.05, momentum=0.9), lambda: None])
def test_a_train_step_s_optimizers_of_different_configs_or_one_to_some_variables_end_where_model_fit_ends(
        server, other):
    """Two optimizers of different configs (Adam, SGD with momentum), each to its own layer,
    or one optimizer applied to the first layer alone: the server steps each group of variables
    with its own optimizer (``OptimizerSpec.groups``) and leaves the rest alone. One worker's
    fit ends at the plain ``model.fit``'s weights, to the bit."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 4)).astype(np.float32), rng.normal(size=(48, 2)).astype(np.float32)
    runs = []
    for strategy in (None, Strategy(ps=server("sync", 1).address, num_workers=1)):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = TwoParts(other())
            model.compile(optimizer=keras.optimizers.Adam(0.01))
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        runs.append([v.numpy().tobytes() for v in model.trainable_variables] + [history.history["loss"]])
        if strategy:
            strategy.close()
    assert runs[0] == runs[1]


def plain_and_shards(server):
    """(0, None): the plain process; then (1, a one-worker Strategy over one server shard), (2, over two)."""
    yield 0, None
    for shards in (1, 2):
        yield shards, Strategy(ps=",".join(server("sync", 1).address for _ in range(shards)), num_workers=1)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_multi_optimizer_s_optimizers_each_step_their_variables_as_model_fit_does(server, clip, tmp_path):
    """``MultiOptimizer``: Adam for the hidden layer (chosen by path), SGD with momentum for the
    rest, each a group of the server's spec; with ``clipnorm`` on both (each variable's own
    norm). One worker's fit ends at the plain ``model.fit``'s weights and losses to the bit, on
    one server shard and on two; ``model.save`` writes each optimizer's state, so the file's
    optimizer variables are the plain run's."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64)
    runs = []
    for shards, strategy in plain_and_shards(server):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="relu", name="hidden"),
                                      keras.layers.Dense(3, activation="softmax", name="out")])
            chosen = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=clip),
                                                   {"hidden/.*": keras.optimizers.Adam(0.01, clipnorm=clip)})
            model.compile(optimizer=keras.optimizers.MultiOptimizer(chosen), loss="sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        model.save(str(tmp_path / f"multi-{shards}.keras"))  # under tfps: the server's state first
        state = [np.asarray(v.numpy()).tobytes() for o in model.optimizer.optimizers for v in o.variables]
        runs.append([[v.numpy().tobytes() for v in model.trainable_variables], history.history["loss"], state])
        if strategy:
            strategy.close()
    assert runs[1] == runs[0] and runs[2] == runs[0]


class SetAt(keras.callbacks.Callback):
    """A user's callback: ``optimizer(model).learning_rate = rate`` at the start of epoch ``epoch``."""

    def __init__(self, epoch, optimizer, rate):
        super().__init__()
        self.epoch, self.optimizer, self.rate = epoch, optimizer, rate

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.optimizer(self.model).learning_rate = self.rate


def test_callbacks_changing_each_optimizer_s_rate_reach_its_group_and_fit_ends_where_model_fit_ends(server):
    """Each optimizer's rate is its own group's on the server (``OptimizerSpec.groups``): the
    compiled Adam's halved each epoch by ``LearningRateScheduler``, the second optimizer's set
    by a user's callback at epoch 1, each sent with the next push of its own variables. One
    worker ends at the plain ``model.fit``'s weights and losses to the bit, and the server used
    each push's rate."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 4)).astype(np.float32), rng.normal(size=(48, 2)).astype(np.float32)
    runs = []
    for strategy in (None, Strategy(ps=server("sync", 1).address, num_workers=1)):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = TwoParts(keras.optimizers.SGD(0.05, momentum=0.9))
            model.compile(optimizer=keras.optimizers.Adam(0.01))
        callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 / 2 ** epoch),
                     SetAt(1, lambda m: m.other, 0.0125)]
        history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
        runs.append([v.numpy().tobytes() for v in model.trainable_variables] + [history.history["loss"]])
        if strategy:
            strategy.close()
    assert runs[0] == runs[1]
    each_step = [[0.01, 0.05], [0.005, 0.0125], [0.0025, 0.0125]]  # (Adam's, SGD's) in epochs 0, 1, 2
    assert strategy.server_learning_rates == [float(np.float32(r)) for rates in each_step for _ in range(3)
                                              for r in rates]


def test_callbacks_changing_a_multi_optimizer_s_rates_reach_each_group_and_fit_ends_where_model_fit_ends(server):
    """A ``MultiOptimizer``'s ``apply`` is one push of several groups' variables: it carries each
    group's new rate (``set_learning_rates``). ``ReduceLROnPlateau`` halves every optimizer it
    holds (Keras 3 walks ``.optimizers``) and a user's callback sets the Adam's alone; one worker,
    on one server shard and on two, ends at the plain ``model.fit``'s weights and losses to the bit."""
    import numpy as np

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.normal(size=(32, 2)).astype(np.float32)
    runs = []
    for shards, strategy in plain_and_shards(server):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="hidden"), keras.layers.Dense(2)])
            chosen = keras.optimizers.OptimizerMap(keras.optimizers.SGD(0.1, momentum=0.5),
                                                   {".*/hidden/.*": keras.optimizers.Adam(0.01)})
            model.compile(optimizer=keras.optimizers.MultiOptimizer(chosen), loss="mse")
        callbacks = [keras.callbacks.ReduceLROnPlateau("loss", factor=0.5, patience=0, min_delta=1e9),  # every epoch
                     SetAt(2, lambda m: m.optimizer.optimizers[0], 0.02)]  # the Adam
        history = model.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
        rates = [float(np.asarray(o.learning_rate)) for o in model.optimizer.optimizers]
        runs.append([[v.numpy().tobytes() for v in model.trainable_variables], history.history["loss"], rates])
        if strategy:
            # each reply's rate is the Adam's (the push's first group): halved after epoch 1, set at 2, halved
            assert strategy.server_learning_rates == [float(np.float32(r)) for r in (0.01, 0.01, 0.02, 0.01)
                                                      for _ in range(4)]
            strategy.close()
    assert runs[0][2] == [np.float32(0.005), np.float32(0.0125)]  # Adam's 0.02 halved twice; SGD's 0.1 three times
    assert runs[1] == runs[0] and runs[2] == runs[0]


class Twice(TwoParts):
    """A step that applies ``self.optimizer``, then ``self.other``, to every variable, each
    through its own tape: the second on the first's update."""

    reverse = False  # ``self.other`` first

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        for optimizer in (self.other, self.optimizer) if self.reverse else (self.optimizer, self.other):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x) - y) ** 2)
            optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_weights), self.trainable_weights))
        return {"loss": loss}


@pytest.mark.parametrize("how", ["sync", "two shards", "async", "elastic", "averages", "averages, reversed"])
def test_two_optimizers_applied_to_one_variable_end_where_model_fit_ends(server, server_config, tmp_path, how):
    """Adam, then SGD with momentum, each applied to every variable in turn: the server keeps
    each optimizer's own state of each variable (SGD's by its second name,
    ``ps_common.names.shared_name``) and steps the one value, each update from the other's
    last. One worker's fit ends at the plain ``model.fit``'s weights, to the bit: sync over one
    server and two shards, async (each apply one push), and elastic sync (each batch two
    rounds; the plain fit on the batches as the server deals them); with moving averages over
    two shards (``averages``: Adam's taken at the fit's end, SGD's overwriting the variables at
    every second of its updates, each of its own state; ``reversed``: SGD first, so the
    compiled Adam's are taken by the second names); and a save loads each
    optimizer's own state of each variable (its slots and step count) into the model's
    optimizers: the plain run's, to the bit."""
    import numpy as np

    from ps_common.batches import global_batch

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 4)).astype(np.float32), rng.normal(size=(48, 2)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(0)
        averages = {"use_ema": True, "ema_momentum": 0.5} if how.startswith("averages") else {}
        model = Twice(keras.optimizers.SGD(0.05, momentum=0.9, **averages,
                                           **({"ema_overwrite_frequency": 2} if averages else {})))
        model.reverse = how.endswith("reversed")
        model.compile(optimizer=keras.optimizers.Adam(0.01, **averages))
        return model

    if how == "elastic":
        address = server_config(mode="sync", num_workers=1, elastic_min_workers=1, micro_batches=1).address
        strategy = Strategy(ps=address, num_workers=1, elastic=True, deterministic=False)
    else:
        strategy = Strategy(ps=",".join(server("async" if how == "async" else "sync", 1).address
                                        for _ in range(1 if how in ("sync", "async") else 2)), num_workers=1)
    seed = strategy.config.seed
    ends = []
    for strategy in (None, strategy):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = build()
        if strategy is None and how == "elastic":  # the batches in the order the server deals them
            order = np.concatenate([global_batch(48, 16, seed, r) for r in range(6)])
            model.fit(x[order], y[order], batch_size=16, epochs=1, shuffle=False, verbose=0)
        else:
            model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        model.save_weights(tmp_path / f"{len(ends)}.weights.h5")  # under tfps: the server's state loaded first
        slots = [v.numpy() for o in (model.optimizer, model.other) for v in o.variables]
        ends.append(([v.numpy() for v in model.weights], slots))
        if strategy:
            strategy.close()
    (plain, plain_slots), (ours, our_slots) = ends
    assert len(plain) == 4 and len(plain_slots) == len(our_slots) > 4
    for got, want in zip(ours + our_slots, plain + plain_slots):
        np.testing.assert_array_equal(got, want)


def test_a_second_model_and_an_unknown_batches_choice_are_refused():
    strategy = Strategy(ps="127.0.0.1:1")
    with strategy.scope():
        small_model().compile(optimizer="sgd", loss="mse")
        with pytest.raises(ValueError, match="one model"):
            small_model().compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="batches"):
        Strategy(batches="mine")
    with pytest.raises(TypeError, match="unknown option"):
        Strategy(no_such_flag=1)


def test_each_worker_takes_its_contiguous_part_of_a_global_batch_the_first_ones_one_more():
    import numpy as np

    x = np.arange(10 * 2).reshape(10, 2)
    y = np.arange(10)
    parts = [_part((x, y, None), i, 3) for i in range(3)]
    assert [list(p[1]) for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert all(p[2] is None for p in parts)
    assert np.array_equal(np.concatenate([p[0] for p in parts]), x)


def _elastic(**flags) -> Strategy:
    # deterministic=False: op determinism is process-wide, and this process runs other tests
    return Strategy(ps="127.0.0.1:1", worker_index=0, num_workers=2, elastic=True, deterministic=False, **flags)


@pytest.mark.parametrize("fit, named", [
    (dict(class_weight={0: 1.0, 1: 2.0, 2: 1.0}, sample_weight=np.ones(8)), "class_weight goes with neither"),
    (dict(x=iter([]), y=None), "deals the examples of NumPy arrays or of a finite tf.data.Dataset; got x of type"),
    (dict(y=[0, 1]), "x, y and sample_weight must have the same number of examples"),
])
def test_an_elastic_fit_refuses_what_the_server_cannot_deal_in_one_line_before_connecting(fit, named):
    import numpy as np

    strategy = _elastic()
    with strategy.scope():
        model = small_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    given = {"x": np.zeros((8, 4), np.float32), "y": np.zeros(8, np.int64), **fit}
    if isinstance(given["y"], list):
        given["y"] = np.asarray(given["y"])
    with pytest.raises(ValueError, match=named):
        model.fit(given.pop("x"), given.pop("y"), epochs=1, verbose=0, **given)
    assert strategy.connection is None


def test_an_endless_dataset_and_per_worker_batches_cannot_be_dealt():
    import numpy as np
    import tensorflow as tf

    with pytest.raises(ValueError, match="batches='per_worker'"):
        _elastic(batches="per_worker")
    strategy = _elastic()
    with strategy.scope():
        model = small_model()
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    endless = tf.data.Dataset.from_tensor_slices((np.zeros((8, 4), np.float32), np.zeros(8))).repeat().batch(4)
    with pytest.raises(ValueError, match=r"an infinite dataset \(repeat\(\)\) has no epoch"):
        model.fit(endless, epochs=1, verbose=0)


@pytest.mark.parametrize("step, scale, steps, scheduled, fits, accumulate", [
    ("keras", None, None, False, 1, 1), ("guide", None, None, False, 1, 1), ("keras", 64.0, None, False, 1, 1),
    ("keras", None, 4, False, 1, 1), ("keras", None, None, True, 1, 1), ("keras", None, None, False, 2, 1),
    ("keras", None, None, False, 1, 2)])
def test_an_elastic_fit_steps_by_the_weighted_mean_of_each_round_s_micro_batches_every_example_once(
        server_config, step, scale, steps, scheduled, fits, accumulate):
    """One worker against an in-process elastic sync server that cuts each global batch of 32
    into 3 micro-batches: round r trains on global batch r of the seeded sequence
    (ps_common.batches), SGD on the mean of its micro-batches' gradients weighted by their
    examples (here computed by hand with a tape), and the server's ledger holds every example
    once per epoch. Keras' own step and the guide's overridden one alike: each micro-batch
    runs the model's step, wrapped; with a static loss scale (``loss_scale_factor=64``) the
    step scales the loss and the wrapped ``apply`` unscales the gradients, as Keras' does.
    With ``steps_per_epoch=4`` (a pass is 3 rounds) each epoch is 4 rounds, going on into
    the next pass of the data: 8 rounds, the third pass two batches in. A LearningRateScheduler
    (0.5, then 0.25) gives each epoch's rounds its rate: the chief agrees it at the epoch's
    start and every push of its rounds carries it. Two fits of one epoch each are one fit of
    two: the second fit's rounds go on from the round it began at. With
    ``gradient_accumulation_steps=2`` and batches of 16 a round is a batch (5 an epoch), the
    server holding each window's first in its accumulators: 10 rounds, 5 updates of the mean
    of two rounds' gradients (one window across the epochs' boundary, as in one process), and
    Keras' optimizer counts the batches (its ``iterations``: updates)."""
    import numpy as np
    import tensorflow as tf

    from ps_common import batches

    running = server_config(mode="sync", num_workers=2, elastic_min_workers=1, micro_batches=3)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 4)).astype(np.float32), rng.integers(0, 3, 70)
    strategy = Strategy(ps=running.address, worker_index=0, num_workers=2, elastic=True, deterministic=False)
    with strategy.scope():
        model = small_model() if step == "keras" else GuideStep(small_model().layers)
        model.compile(optimizer=keras.optimizers.SGD(0.5, loss_scale_factor=scale,
                                                     gradient_accumulation_steps=accumulate if accumulate > 1 else None),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    weights = [v.numpy() for v in model.trainable_variables]  # the chief's initial ones, the server's
    callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.5 / (epoch + 1))] if scheduled else []
    for _ in range(fits):
        history = model.fit(x, y, batch_size=32 // accumulate, epochs=2 // fits, verbose=0, steps_per_epoch=steps,
                            callbacks=callbacks)
    status = strategy.connection.client.status()
    rounds, passes = (6, [70, 70]) if steps is None else (8, [70, 70, 64])  # a pass is 3 rounds
    rounds = 10 if accumulate > 1 else rounds  # batches of 16: 5 rounds a pass
    assert (strategy.connection.version, list(status.epoch_examples)) == (rounds, passes)
    assert (int(model.optimizer.iterations), int(model.optimizer._iterations)) == (rounds // accumulate, rounds)
    assert set(history.history) - {"learning_rate"} == {"loss", "accuracy"}
    assert len(history.history["loss"]) == 2 // fits
    if fits == 2:  # a later fit of other batches cannot be dealt from the job's plan
        with pytest.raises(ValueError, match="deals every fit's rounds from the job's data plan, the first fit's"):
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)

    reference, held = keras.models.clone_model(model), []
    for r in range(rounds):
        reference.set_weights(weights)
        parts = batches.micro_batches(batches.global_batch(70, 32 // accumulate, 0, r), 3)
        total = [np.zeros(w.shape, np.float64) for w in weights]
        for part in parts:
            with tf.GradientTape() as tape:
                loss = keras.losses.sparse_categorical_crossentropy(y[part], reference(x[part]))
                loss = tf.reduce_mean(loss)
            for t, g in zip(total, tape.gradient(loss, reference.trainable_variables)):
                t += len(part) * g.numpy().astype(np.float64)
        size = sum(len(p) for p in parts)
        lr = np.float32(0.5 / (r // 3 + 1) if scheduled else 0.5)
        held.append([(t / size).astype(np.float32) for t in total])
        if len(held) == accumulate:  # the window's mean
            weights = [w - lr * sum(gs) / accumulate for w, *gs in zip(weights, *held)]
            held = []
    for got, want in zip(model.trainable_variables, weights):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    strategy.close()


def scaled_and_overflowing(running):
    """Worker 0 of 2, elastic, against ``running``: SGD(0.5) under a ``LossScaleOptimizer`` (scale 64,
    doubled every 2 finite steps); 70 examples, example 11 not finite (a loss and gradients that
    are not finite, whatever the scale)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 4)).astype(np.float32), rng.integers(0, 3, 70)
    x[11] = np.nan
    strategy = Strategy(ps=running.address, worker_index=0, num_workers=2, elastic=True, deterministic=False)
    with strategy.scope():
        model = small_model()
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=64.0,
                                                                    dynamic_growth_steps=2),
                      loss="sparse_categorical_crossentropy")
    return strategy, model, x, y


def test_an_elastic_fit_under_a_dynamic_loss_scale_skips_every_round_a_micro_batch_overflows(server_config):
    """Elastic sync, one worker against an in-process server that cuts each global batch of 32
    into 3 micro-batches, SGD under a ``LossScaleOptimizer`` (doubling every 2 finite rounds).
    One example is huge: each micro-batch holding it has gradients that are not finite, so its
    push asks to skip and the whole round completes without an update (once an epoch); the
    scale halves there and doubles after every 2 finite rounds, as Keras' arithmetic steps it
    from the job's rounds that skipped (``Assignment.skipped_rounds``: a worker joining late
    derives the same). The weights are the hand-computed rounds' without the skipped ones."""
    import numpy as np
    import tensorflow as tf

    from ps_common import batches

    strategy, model, x, y = scaled_and_overflowing(server_config(mode="sync", num_workers=2, elastic_min_workers=1,
                                                                 micro_batches=3))
    weights = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    skipped = [r for r in range(9) if 11 in batches.global_batch(70, 32, 0, r)]
    assert strategy.connection.version == 9 and len(skipped) == 3
    assert strategy.engine.skipped_rounds == tuple(skipped)
    scale, counter = 64.0, 0
    for r in range(9):  # Keras' LossScaleOptimizer, round by round
        scale, counter = (scale / 2, 0) if r in skipped else (scale * 2, 0) if counter == 1 else (scale, counter + 1)
    assert (float(model.optimizer.dynamic_scale.numpy()), int(model.optimizer.step_counter.numpy())) == (scale, counter)
    assert int(model.optimizer.iterations) == 6  # the updates made
    strategy.close()

    reference = keras.models.clone_model(model)
    for r in range(9):
        if r in skipped:
            continue
        reference.set_weights(weights)
        parts = batches.micro_batches(batches.global_batch(70, 32, 0, r), 3)
        total = [np.zeros(w.shape, np.float64) for w in weights]
        for part in parts:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y[part], reference(x[part])))
            for t, g in zip(total, tape.gradient(loss, reference.trainable_variables)):
                t += len(part) * g.numpy().astype(np.float64)
        weights = [w - np.float32(0.5) * (t / sum(map(len, parts))).astype(np.float32) for w, t in zip(weights, total)]
    for got, want in zip(model.trainable_variables, weights):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["multi", "some"])
def test_an_elastic_fit_serves_a_multi_optimizer_s_groups_or_one_optimizer_to_some_variables(server_config, optimizer):
    """Elastic sync, one worker against an in-process server that cuts each global batch of 24
    into 3 micro-batches. ``multi``: a ``MultiOptimizer`` (Adam for the hidden layer, SGD with
    momentum for the rest), whose Adam a user's callback sets to 0.02 at epoch 1: each round
    steps each group by its own optimizer, at the rates the chief agreed at the epoch's start,
    on the weighted mean of the round's micro-batches (computed here by hand and stepped by the
    same Keras optimizers). ``some``: a step that applies Adam to its first layer alone; the
    second stays as built. A step applying two optimizers is refused in one line."""
    import numpy as np
    import tensorflow as tf

    from ps_common import batches

    running = server_config(mode="sync", num_workers=2, elastic_min_workers=1, micro_batches=3)
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(60, 4)).astype(np.float32), rng.normal(size=(60, 2)).astype(np.float32)

    def build():
        keras.utils.set_random_seed(0)
        if optimizer == "some":
            return TwoParts(), keras.optimizers.Adam(0.01)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="hidden"), keras.layers.Dense(2)])
        return model, keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            keras.optimizers.SGD(0.1, momentum=0.5), {".*/hidden/.*": keras.optimizers.Adam(0.01)}))

    strategy = Strategy(ps=running.address, worker_index=0, num_workers=2, elastic=True, deterministic=False)
    with strategy.scope():
        model, chosen = build()
        model.compile(optimizer=chosen, loss="mse")
    model(x[:1])  # built
    weights = [v.numpy() for v in model.trainable_variables]  # the chief's initial ones, the server's
    callbacks = [SetAt(1, lambda m: m.optimizer.optimizers[0], 0.02)] if optimizer == "multi" else []
    model.fit(x, y, batch_size=24, epochs=2, verbose=0, callbacks=callbacks)
    assert strategy.connection.version == 6 and list(strategy.connection.client.status().epoch_examples) == [60, 60]
    strategy.close()

    reference, plain = build()
    reference(x[:1])
    stepped = reference.trainable_variables if optimizer == "multi" else reference.first.trainable_variables
    for v, w in zip(reference.trainable_variables, weights):
        v.assign(w)
    for r in range(6):
        if r == 3 and optimizer == "multi":
            plain.optimizers[0].learning_rate = 0.02
        parts = batches.micro_batches(batches.global_batch(60, 24, 0, r), 3)
        total = [np.zeros(v.shape, np.float64) for v in stepped]
        for part in parts:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((reference(x[part]) - y[part]) ** 2)
            for t, g in zip(total, tape.gradient(loss, stepped)):
                t += len(part) * g.numpy().astype(np.float64)
        size = sum(len(p) for p in parts)
        plain.apply([(t / size).astype(np.float32) for t in total], stepped)
    for got, want in zip(model.trainable_variables, reference.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    if optimizer == "some":
        assert np.array_equal(model.second.kernel.numpy(), weights[2])


@pytest.mark.parametrize("shards", [1, 2])
def test_an_elastic_step_of_two_optimizers_is_two_rounds_of_one_batch_each_update_seen_by_the_next(server_config,
                                                                                                   shards):
    """``NormedParts(SGD)`` compiled with Adam: each step applies Adam to the first layer, then
    SGD to the second on gradients taken after Adam's update. Elastic sync deals each batch as
    two rounds (``Cursor.applies``): the first pushes Adam's gradients of every micro-batch, the
    second SGD's, each micro-batch's step taking the first round's values, and the statistics
    its forward pass left, at its first apply. One worker, one micro-batch a round:
    ``model.fit`` on the batches in the order the server deals them, to the bit (the batch
    normalization's statistics moved twice a step, not three times), over one server or two
    shards. The server counts every example once an epoch. A second fit goes on from the job's
    round. On async tasks each batch is two tasks, one apply each (``TaskQueue.applies``): one
    worker taking them in turn ends at the same bits. (Two workers, and one computing two
    micro-batches a round: tests/cluster/test_keras_programs.py.)"""
    import numpy as np
    import tensorflow as tf

    from ps_common.batches import global_batch

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(60, 4)).astype(np.float32), rng.normal(size=(60, 2)).astype(np.float32)

    def build(scope):
        with scope:
            keras.utils.set_random_seed(0)
            model = NormedParts(keras.optimizers.SGD(0.05, momentum=0.5))
            model.compile(optimizer=keras.optimizers.Adam(0.01))
            model(x[:1])
        return model

    address = ",".join(server_config(mode="sync", num_workers=1, elastic_min_workers=1, micro_batches=1).address
                       for _ in range(shards))
    strategy = Strategy(ps=address, worker_index=0, num_workers=1, elastic=True, deterministic=False)
    model = build(strategy.scope())
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)  # the job's second epoch
    assert strategy.connection.version == 12 and list(strategy.connection.client.status().epoch_examples) == [60, 60]
    served = [v.numpy() for v in model.weights]
    strategy.close()

    plain = build(tf.distribute.get_strategy().scope())
    for epoch in range(2):  # each epoch's last batch is 12 examples
        order = np.concatenate([global_batch(60, 24, strategy.config.seed, r) for r in range(3 * epoch, 3 * epoch + 3)])
        plain.fit(x[order], y[order], batch_size=24, epochs=1, shuffle=False, verbose=0)
    assert len(served) == len(plain.weights) == 8
    for got, want in zip(served, plain.weights):
        np.testing.assert_array_equal(got, want.numpy())
    if shards > 1:
        return
    # Async tasks: each batch two tasks (``TaskQueue.applies``), taken one after the other by the one worker.
    running = server_config(mode="async", num_workers=1)
    strategy = Strategy(ps=running.address, worker_index=0, num_workers=1, elastic=True, deterministic=False)
    model = build(strategy.scope())
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)
    model.fit(x, y, batch_size=24, epochs=1, verbose=0)
    status = strategy.connection.client.status()
    assert (status.tasks_total, status.tasks_done, list(status.epoch_examples)) == (12, 12, [60, 60])
    assert strategy.connection.version == 12
    for got, want in zip(model.weights, plain.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    strategy.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_a_fit_over_two_server_shards_ends_with_one_server_s_weights(server, mode, clip):
    """One worker's model.fit in this process against in-process servers: AdamW (with weight
    decay) over two shards steps each variable as one server does, to the bit; with
    ``global_clipnorm`` too (small enough to clip every step), whose norm the shards take
    together (ps_server/core/clip_group.py)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 4)).astype(np.float32), rng.integers(0, 3, 96)
    weights = []
    for shards in (1, 2):
        strategy = Strategy(ps=",".join(server(mode, 1).address for _ in range(shards)), num_workers=1)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = small_model()
            model.compile(optimizer=keras.optimizers.AdamW(0.01, global_clipnorm=clip),
                          loss="sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert strategy.mode == mode and strategy.connection.version == 6  # 2 epochs of 3 steps, on the server
        weights.append([v.numpy().tobytes() for v in model.trainable_variables] + [history.history["loss"]])
        strategy.close()
    assert weights[0] == weights[1]


def test_a_static_loss_scale_ends_where_model_fit_ends_to_the_bit(server):
    """SGD with ``loss_scale_factor=64``: Keras' step scales the loss, the wrapped ``apply``
    divides the gradients by 64 as Keras' ``apply`` does, and the server steps SGD on them:
    one worker's fit ends at the plain ``model.fit``'s weights and losses, to the bit."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 4)).astype(np.float32), rng.integers(0, 3, 96)
    runs = []
    for strategy in (None, Strategy(ps=server("sync", 1).address, num_workers=1)):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = small_model()
            model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9, loss_scale_factor=64.0),
                          loss="sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        runs.append([v.numpy().tobytes() for v in model.trainable_variables] + [history.history["loss"]])
        if strategy:
            assert strategy.connection.version == 6
            strategy.close()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("frequency", [None, 4])
def test_use_ema_swaps_the_averages_in_at_the_end_of_fit_as_model_fit_does(server, frequency):
    """``AdamW(use_ema=True)``: Keras' fit ends by giving every variable its moving average
    (``finalize_variable_values``), with ``ema_overwrite_frequency`` (every 4 updates) or
    without; the server's do too, when the worker asks at the end of its fit. One worker's
    fit, then evaluate, then a second fit, end at the plain ``model.fit``'s numbers to the
    bit, on one server shard and on two."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(80, 4)).astype(np.float32), rng.integers(0, 3, 80)
    runs = []
    for shards, strategy in plain_and_shards(server):
        with strategy.scope() if strategy else contextlib.nullcontext():
            keras.utils.set_random_seed(0)
            model = small_model()
            model.compile(optimizer=keras.optimizers.AdamW(0.05, use_ema=True, ema_momentum=0.8,
                                                           ema_overwrite_frequency=frequency),
                          loss="sparse_categorical_crossentropy")
        first = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history["loss"]
        after = [v.numpy().tobytes() for v in model.trainable_variables]
        evaluated = model.evaluate(x, y, batch_size=16, verbose=0)
        second = model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0).history["loss"]
        runs.append([after, evaluated, first + second, [v.numpy().tobytes() for v in model.trainable_variables]])
        if strategy:
            strategy.close()
    assert runs[1] == runs[0] and runs[2] == runs[0]


def test_an_elastic_fit_s_class_weight_and_validation_split_are_keras_sample_weights_and_validation_data(
        server_config):
    """Elastic: ``class_weight`` becomes the dealt examples' sample weights and
    ``validation_split`` the last part of the arrays, as Keras' fit makes them: each fit ends
    at the weights and History of the same fit given those sample weights and that
    validation data, to the bit."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 4)).astype(np.float32), rng.integers(0, 3, 70)
    weights = {0: 1.0, 1: 3.0, 2: 0.5}
    given = [dict(class_weight=weights, validation_split=0.2),
             dict(sample_weight=np.array([weights[int(c)] for c in y[:56]], np.float32),
                  validation_data=(x[56:], y[56:]))]
    runs = []
    for fit in given:
        running = server_config(mode="sync", num_workers=1, elastic_min_workers=1, micro_batches=2)
        strategy = Strategy(ps=running.address, worker_index=0, num_workers=1, elastic=True, deterministic=False)
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = small_model()
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
        n = 70 if "validation_split" in fit else 56
        history = model.fit(x[:n], y[:n], batch_size=16, epochs=2, verbose=0, **fit)
        runs.append([[v.numpy().tobytes() for v in model.trainable_variables], history.history])
        assert strategy.connection.client.status().epoch_examples[0] == 56
        strategy.close()
    assert runs[0] == runs[1] and set(runs[0][1]) == {"loss", "val_loss"}


def on_tasks(server_config, mode: str):
    """Worker 0 of 2, elastic, against an async (ssp) server; a small model, 70 examples."""
    import numpy as np

    running = server_config(mode=mode, num_workers=2, **({"staleness": 1} if mode == "ssp" else {}))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 4)).astype(np.float32), rng.integers(0, 3, 70)
    strategy = Strategy(ps=running.address, worker_index=0, num_workers=2, elastic=True, deterministic=False)
    with strategy.scope():
        model = small_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return strategy, model, x, y


def test_an_elastic_fit_on_async_tasks_under_a_dynamic_loss_scale_skips_each_task_that_overflows(server_config):
    """Async tasks of 16 examples under a ``LossScaleOptimizer``: each task holding the one
    example that is not finite is pushed asking to skip, done without an update; the worker's
    scale steps on its own tasks, as without ``elastic=True``."""
    import numpy as np

    from ps_common import batches

    strategy, model, x, y = scaled_and_overflowing(server_config(mode="async", num_workers=2))
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    status = strategy.connection.client.status()
    assert (status.tasks_done, list(status.epoch_examples)) == (10, [70, 70])
    scale, counter = 64.0, 0
    for t in range(10):
        skip = 11 in batches.global_batch(70, 16, 0, t)
        scale, counter = (scale / 2, 0) if skip else (scale * 2, 0) if counter == 1 else (scale, counter + 1)
    assert (float(model.optimizer.dynamic_scale.numpy()), int(model.optimizer.step_counter.numpy())) == (scale, counter)
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
    strategy.close()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_elastic_fit_on_async_or_ssp_tasks_applies_each_task_once(server_config, mode):
    """Against an async (ssp) server the fit's examples are the server's tasks (core.data.tasks):
    batches of batch_size / num_workers = 16 examples, 5 an epoch of 70; one worker does them all.
    A LearningRateScheduler's rate rides each task's push: the server ends at the last epoch's. A
    later fit of the same data goes on to its epochs after the job's (the chief's Initialize
    extends the tasks), as one process's goes on: ``epochs=1``, then ``epochs=4, initial_epoch=3``;
    one of other data is refused in one line. ``steps_per_epoch=2``: epochs of 2 x 2 workers = 4
    tasks, across passes (the job's last pass cut short); 3 (epochs of 6) cannot follow the
    job's 28 tasks, and is refused without counting."""
    strategy, model, x, y = on_tasks(server_config, mode)
    halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 / (epoch + 1))
    history = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[halve])
    status = strategy.connection.client.status()
    assert (status.tasks_total, status.tasks_done, list(status.epoch_examples)) == (10, 10, [70, 70])
    assert status.learning_rate_now == pytest.approx(0.05)
    assert strategy.connection.version == 10 and len(history.history["loss"]) == 2
    with pytest.raises(ValueError, match="from the job's data plan, the first fit's"):
        model.fit(x[:60], y[:60], batch_size=32, epochs=1, verbose=0)
    second = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    third = model.fit(x, y, batch_size=32, epochs=4, initial_epoch=3, verbose=0)
    status = strategy.connection.client.status()
    assert (status.tasks_total, status.tasks_done, list(status.epoch_examples)) == (20, 20, [70] * 4)
    assert strategy.connection.version == 20 and second.epoch == [0] and third.epoch == [3]
    stepped = model.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=2, verbose=0)
    with pytest.raises(ValueError, match="epochs of 6 tasks cannot go on after the job's 28"):
        model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=3, verbose=0)
    status = strategy.connection.client.status()
    assert (status.tasks_total, status.tasks_done, list(status.epoch_examples)) == (28, 28, [70] * 5 + [48])
    assert strategy.connection.version == 28 and len(stepped.history["loss"]) == 2
    strategy.close()


def test_an_elastic_fit_s_steps_per_epoch_on_async_tasks_goes_on_across_passes(server_config):
    """``steps_per_epoch=3`` with two workers' tasks of 16 (5 a pass of 70): each epoch is 3 x 2 = 6
    tasks, as many examples as 3 global batches, going on across passes as one process's iterator
    goes on; two epochs are 12 tasks, the third pass cut short after two (32 examples)."""
    strategy, model, x, y = on_tasks(server_config, "async")
    history = model.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=3, verbose=0)
    status = strategy.connection.client.status()
    assert (status.tasks_total, status.tasks_done, list(status.epoch_examples)) == (12, 12, [70, 70, 32])
    assert strategy.connection.version == 12 and history.epoch == [0, 1]
    strategy.close()


def test_a_learning_rate_a_callback_changes_within_an_elastic_epoch_stops_the_fit_in_one_line(server_config):
    """Elastic: the rate of a round must be the same whoever computes it, so it is the chief's
    at the epoch's start; a callback that changes it at a batch's end stops the fit, naming
    where it may change and what else runs."""
    import numpy as np

    running = server_config(mode="sync", num_workers=1, elastic_min_workers=1, micro_batches=2)
    strategy = Strategy(ps=running.address, worker_index=0, num_workers=1, elastic=True, deterministic=False)
    with strategy.scope():
        model = small_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")

    class EveryBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.optimizer.learning_rate = 0.05

    with pytest.raises(ValueError, match="changed the learning rate within an epoch .* agreed at each epoch's start"):
        model.fit(np.zeros((8, 4), np.float32), np.zeros(8, np.int64), batch_size=4, epochs=1, verbose=0,
                  callbacks=[EveryBatch()])
    strategy.close()


def test_a_round_s_summed_batch_digests_say_whether_every_worker_read_the_same_batch():
    """``BatchDigests``: the server sums the pushes' vectors (as ``sum_metrics`` does, in float64);
    equal digests give ``n * Q == S * S`` for every chunk, one differing batch does not."""
    import numpy as np
    import tensorflow as tf

    from ps_server.core.modes.aggregation import sum_metrics
    from worker.keras import BatchDigests, DataMismatch

    def read(batch):
        digests = BatchDigests()
        digests.add(batch)
        return {BatchDigests.KEY: digests.last}

    x = tf.reshape(tf.range(40000, dtype=tf.float32), (100, 400))  # sampled: 4096 of 40000 elements
    y, words = np.arange(100), tf.constant([b"a", b"bc"])
    same = read((x, y, None))
    BatchDigests().check_round(sum_metrics([same, same, read((x, y, None))]), 0)
    BatchDigests().check_round(sum_metrics([read((words, None, None))] * 2), 0)
    for other in [(x, y[::-1].copy(), None), (x + 1, y, None), (tf.constant([b"a", b"b"]), None, None)]:
        with pytest.raises(DataMismatch, match="the 3 workers of step 4 read different global batches.*seed"):
            BatchDigests().check_round(sum_metrics([same, read(other), same]), 4)
