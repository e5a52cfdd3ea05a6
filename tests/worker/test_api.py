"""The Python API (worker.api) and the task layer (worker.task) in this process, against a
real server on 127.0.0.1 port 0."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.sparse import SparseRows
from worker import api, gradients, task as tasks
from worker.config import ConfigError


def two_inputs_model():
    import keras

    words = keras.Input(shape=(3,), dtype="int64", name="words")
    extra = keras.Input(shape=(2,), name="extra")
    e = keras.layers.Flatten()(keras.layers.Embedding(1000, 4, name="emb")(words))
    x = keras.layers.Concatenate()([e, keras.layers.BatchNormalization(name="bn")(extra)])
    out = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.Model({"words": words, "extra": extra}, out)
    model.compile(loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def two_inputs_data(ctx):
    import tensorflow as tf

    rng = np.random.default_rng(3)
    words = rng.integers(0, 1000, (256, 3))
    extra = rng.normal(5.0, 2.0, (256, 2)).astype(np.float32)
    labels = (extra[:, 0] > 5.0).astype(np.int64)  # learnable through the BatchNorm path
    ds = tf.data.Dataset.from_tensor_slices(({"words": words, "extra": extra}, labels))
    return ds.batch(ctx.global_batch_size), ds.batch(64)


def test_train_runs_a_two_input_embedding_model_and_pushes_the_embedding_as_rows(server, tmp_path):
    running = server()
    result = api.train(two_inputs_model, two_inputs_data, ps=running.address, epochs=8, global_batch_size=16,
                       optimizer="adam", learning_rate=0.05, history_json=str(tmp_path / "h.json"),
                       progress="off")
    assert result["steps"] == 8 * 16 and running.core.status().pushes_applied == 128
    assert result["test_accuracy"] >= 0.8 and "test_loss" in result
    import json

    steps = json.loads((tmp_path / "h.json").read_text())["steps"]
    table = 1000 * 4 * 4
    rest = (14 * 2 + 2) * 4 + 4 * 2 * 4  # the dense layer, and BatchNorm's four vectors of 2
    # 16 examples x 3 words touch at most 48 rows of 1000: 4 floats and a row number each
    assert max(s["push_bytes"] for s in steps) <= 48 * (4 * 4 + 8) + rest < table
    assert {n.rsplit("/", 1)[1] for n in running.core.store.non_trainable()} == {"moving_mean", "moving_variance"}
    _, values = running.core.pull()
    mean = next(v for n, v in values.items() if n.endswith("moving_mean"))
    assert np.all(np.abs(mean - 5.0) < 1.5)  # the server kept the statistics the workers' batches made


def test_unknown_options_and_a_model_without_a_loss_are_refused(server):
    with pytest.raises(TypeError, match="unknown option"):
        api.make_config(learning_rat=0.1)
    import keras

    def bare():
        return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])

    def data():
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((np.zeros((4, 2), np.float32), np.zeros(4))).batch(2)

    with pytest.raises(ConfigError, match="no loss"):
        api.train(bare, data, ps=server().address, steps=1, global_batch_size=2)


def test_a_dataset_of_unknown_length_needs_steps():
    import tensorflow as tf

    def data():
        return tf.data.Dataset.range(10).filter(lambda x: x > 2).map(lambda x: (x, x)).batch(2)

    with pytest.raises(tasks.TaskError, match="give --steps"):
        tasks.UserTask(two_inputs_model, data, global_batch_size=2)


def test_with_sharding_none_the_function_gets_its_index_and_its_batches_are_used_whole():
    import tensorflow as tf

    seen = []

    def data(ctx):
        seen.append((ctx.worker_index, ctx.num_workers, ctx.per_worker_batch_size))
        return tf.data.Dataset.range(12).shard(ctx.num_workers, ctx.worker_index).map(
            lambda x: (x, x)).batch(ctx.per_worker_batch_size)

    task = tasks.UserTask(two_inputs_model, data, global_batch_size=5, sharding="none", worker_index=1,
                          num_workers=2)
    x, y, n = task.batches(1, 2).get(0)
    assert seen == [(1, 2, 2)] and list(np.asarray(x)) == [1, 3] and n == 2
    split = tasks.UserTask(two_inputs_model, lambda: tf.data.Dataset.range(10).map(lambda x: (x, x)).batch(5),
                           global_batch_size=5)
    assert [list(np.asarray(split.batches(i, 2).get(1)[0])) for i in range(2)] == [[5, 6, 7], [8, 9]]


def test_indexed_slices_become_rows_summed_once_each_and_dense_when_half_the_table_is_touched():
    import tensorflow as tf

    g = tf.IndexedSlices(tf.constant([[1.0], [2.0], [4.0]]), tf.constant([7, 2, 7]), tf.constant([10, 1]))
    rows = gradients.to_pushable(g, (10, 1))
    assert isinstance(rows, SparseRows)
    assert list(rows.rows) == [2, 7] and rows.values[:, 0].tolist() == [2.0, 5.0]
    wide = tf.IndexedSlices(tf.ones((5, 1)), tf.constant([0, 1, 2, 3, 4]), tf.constant([10, 1]))
    dense = gradients.to_pushable(wide, (10, 1))
    assert isinstance(dense, np.ndarray) and dense.shape == (10, 1) and dense.sum() == 5


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("shards", [1, 2])
def test_a_session_step_is_the_same_in_every_mode_and_over_shards(server, mode, shards):
    """One worker, one SGD step of a hand-written tape: w - lr * g, whatever the mode and
    however many servers hold the variables (docs/combinations.md, Session's column)."""
    import keras
    import tensorflow as tf

    address = ",".join(server(mode, 1).address for _ in range(shards))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    before = [np.array(v.numpy()) for v in model.trainable_variables]
    x, y = np.array([[1.0, 2.0]], np.float32), np.zeros((1, 3), np.float32)
    with api.Session(model, ps=address, optimizer="sgd", learning_rate=0.5) as session:
        session.pull()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        assert session.push(grads, float(loss), batch_size=1).version == 1
        session.pull()
        for v, w, g in zip(model.trainable_variables, before, grads):
            assert v.numpy().tobytes() == (w - np.float32(0.5) * g.numpy()).tobytes()


def test_a_session_with_a_wrapped_tape_pushes_what_the_tape_computes(server):
    import keras
    import tensorflow as tf

    running = server("sync", 1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
    w0 = np.array(model.trainable_variables[0].numpy())
    x, y = np.array([[1.0, 2.0]], np.float32), np.array([[1.0]], np.float32)
    with api.Session(model, ps=running.address, optimizer="sgd", learning_rate=0.1) as session:
        session.pull()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = session.wrap(tape, batch_size=1)
        (grad,) = tape.gradient(loss, model.trainable_variables)
        assert tape.reply.version == 1
        session.pull()
        np.testing.assert_allclose(model.trainable_variables[0].numpy(), w0 - 0.1 * grad.numpy(), rtol=1e-6)
    assert running.core.status().workers[0].left


def test_train_with_elastic_trains_on_the_examples_the_server_deals(server):
    """``api.train(..., elastic=True)`` builds the task ``ps-worker --elastic`` builds (one
    builder, ``worker.task.from_config``): its data read once and dealt by the server, every
    example once per epoch (256 examples, global batches of 16: 16 rounds an epoch)."""
    running = server("sync", elastic_min_workers=1, micro_batches=2)
    result = api.train(two_inputs_model, two_inputs_data, ps=running.address, elastic=True, epochs=2,
                       global_batch_size=16, optimizer="adam", learning_rate=0.05, progress="off")
    status = running.core.status()
    assert result["steps"] == 32 and status.epoch_examples == (256, 256), (result, status)
