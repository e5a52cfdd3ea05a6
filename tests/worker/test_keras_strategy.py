"""tfps.keras.Strategy in one process, before any server: what it attaches, and what it refuses at compile.

The training itself, with real servers and workers, is tests/cluster/test_keras_fit.py.
"""

import keras
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
    (keras.optimizers.Muon(), "Muon"),
    (keras.optimizers.SGD(loss_scale_factor=128.0), "loss_scale_factor"),
    (keras.optimizers.Adam(gradient_accumulation_steps=2), "gradient_accumulation_steps"),
    (keras.optimizers.Adam(use_ema=True), "ema_overwrite_frequency"),
])
def test_an_optimizer_or_option_the_server_cannot_run_is_refused_at_compile_naming_it(optimizer, named):
    strategy = Strategy(ps="127.0.0.1:1")
    with pytest.raises(ValueError, match=named), strategy.scope():
        small_model().compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    assert strategy.models == []


def test_a_model_with_its_own_train_step_is_refused():
    class Custom(keras.Model):
        def train_step(self, data):
            return {}

    inputs = keras.Input((4,))
    model = Custom(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="overrides train_step"):
        Strategy(ps="127.0.0.1:1").attach(model)


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


def test_elastic_is_refused_in_one_line_before_any_server():
    with pytest.raises(ValueError, match="tfps.keras does not train on data the server deals"):
        Strategy(ps="127.0.0.1:1", worker_index=0, num_workers=2, elastic=True)


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
