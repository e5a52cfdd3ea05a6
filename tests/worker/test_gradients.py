"""The one gradient path (worker.gradients): the built-in models, your Keras model and the
Session's wrapped tape all make their push with ``as_pushed``; and the loop's state
(worker.trainer.TrainingLoop, worker.connection.Connection) after a run, in this process
against a real server on 127.0.0.1 port 0."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.sparse import SparseRows
from tests.worker.test_api import two_inputs_data, two_inputs_model
from worker import api, gradients, task as tasks
from worker.config import WorkerConfig


@pytest.fixture
def spy(monkeypatch):
    """Every call of ``worker.gradients.as_pushed``: (trainable paths given, payload made)."""
    calls = []
    real = gradients.as_pushed

    def as_pushed(model, grads, pulled, sparse_rule="sum"):
        out = real(model, grads, pulled, sparse_rule)
        calls.append((sorted(grads), out))
        return out

    monkeypatch.setattr(gradients, "as_pushed", as_pushed)
    return calls


def by_hand(model, loss, x, y, pulled):
    """What a user writes: an eager tape on the mean loss, made into a push by ``as_pushed``."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        mean = tf.reduce_mean(loss(y, model(x, training=True)))
    grads = tape.gradient(mean, model.trainable_variables)
    return float(mean), gradients.as_pushed(model, {v.path: g for v, g in zip(model.trainable_variables, grads)},
                                            pulled)


def assert_same_payload(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert type(a[name]) is type(b[name]), name
        if isinstance(a[name], SparseRows):
            assert np.array_equal(a[name].rows, b[name].rows), name
            np.testing.assert_allclose(a[name].values, b[name].values, rtol=1e-5, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_the_builtin_task_and_a_hand_written_tape_give_the_same_push_through_one_function(spy):
    config = WorkerConfig(dataset="synthetic", model="cnn", steps=2, global_batch_size=32).validate()
    task = tasks.from_config(config)
    model = task.build_model()
    x, y, n = task.batches(0, 2).get(0)
    pulled = gradients.get_values(model)
    loss, payload = gradients.Gradients(model, task.loss)(x, y, pulled)
    hand_loss, hand = by_hand(model, task.loss, x, y, pulled)
    assert n == 16 and len(spy) == 2  # the task's tf.function and the tape: both through as_pushed
    assert loss == pytest.approx(hand_loss, rel=1e-6)
    assert_same_payload(payload, hand)
    assert all(isinstance(g, np.ndarray) and g.any() for g in payload.values())


def test_a_user_model_pushes_its_embedding_as_rows_and_its_batchnorm_change(spy):
    import tensorflow as tf

    task = tasks.UserTask(two_inputs_model, two_inputs_data, global_batch_size=16)
    model = task.build_model()
    x, y, n = task.batches(0, 1).get(0)
    pulled = gradients.get_values(model)
    loss, payload = gradients.Gradients(model, task.loss)(x, y, pulled)
    after = gradients.get_values(model)  # the forward pass moved BatchNorm's statistics

    table = next(name for name in payload if "emb" in name)
    rows = payload[table]
    assert isinstance(rows, SparseRows)
    assert list(rows.rows) == sorted(set(np.asarray(x["words"]).ravel().tolist()))  # each touched row once
    moving = [name for name in payload if name.endswith(("moving_mean", "moving_variance"))]
    assert len(moving) == 2
    for name in moving:
        np.testing.assert_array_equal(payload[name], after[name] - pulled[name])
        assert np.abs(payload[name]).max() > 0

    gradients.set_values(model, pulled)  # the same start for the hand-written tape
    hand_loss, hand = by_hand(model, task.loss, x, y, pulled)
    assert len(spy) == 2 and loss == pytest.approx(hand_loss, rel=1e-6)
    assert_same_payload(payload, hand)
    gradients.set_values(model, pulled)
    _, raw = gradients.Gradients(model, task.loss).tape(x, y)  # what the tape gave: slices, made rows above
    assert isinstance(raw[[v.path for v in model.trainable_variables].index(table)], tf.IndexedSlices)


def test_the_wrapped_tape_pushes_the_embedding_as_rows_and_sgd_moves_only_those_rows(server, spy):
    import tensorflow as tf

    running = server("sync", 1)
    model = two_inputs_model()
    task = tasks.UserTask(two_inputs_model, two_inputs_data, global_batch_size=16)
    task.build_model()  # for its loss
    x, y, _ = task.batches(0, 1).get(0)
    table = next(v for v in model.trainable_variables if "emb" in v.path)
    with api.Session(model, ps=running.address, optimizer="sgd", learning_rate=0.5) as session:
        session.pull()
        before = np.array(table.numpy())
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(task.loss(y, model(x, training=True)))
        tape = session.wrap(tape, batch_size=16)
        grads = tape.gradient(loss, model.trainable_variables)
        assert tape.reply.version == 1 and session.step == 1
        (paths, payload), = spy
        assert paths == sorted(v.path for v in model.trainable_variables)
        rows = payload[table.path]
        assert isinstance(rows, SparseRows)
        session.pull()
    now = np.array(table.numpy())
    touched = np.zeros(len(now), bool)
    touched[rows.rows] = True
    assert np.array_equal(now[~touched], before[~touched])  # untouched rows: not one bit moved
    dense = tf.convert_to_tensor(grads[model.trainable_variables.index(table)]).numpy()
    np.testing.assert_allclose(now[touched], before[touched] - 0.5 * dense[touched], rtol=1e-5, atol=1e-7)


def test_the_loop_keeps_its_state_in_fields_and_runs_pull_compute_push_per_step(server, spy, tmp_path):
    from worker.observe import Observer
    from worker.trainer import TrainingLoop

    running = server("sync", 1)
    config = WorkerConfig(ps=running.address, worker_index=0, num_workers=1, dataset="synthetic", steps=3,
                          global_batch_size=16, optimizer="sgd", learning_rate=0.1, progress="off",
                          eval_every=2).validate()
    task = tasks.from_config(config)
    model = task.build_model()
    observer = Observer(total_steps=task.total_steps, progress="off")
    loop = TrainingLoop(config, task, model, observer)
    try:
        result = loop.run()
    finally:
        loop.conn.close()
        observer.close()
    assert [r["step"] for r in loop.history] == [0, 1, 2] and len(spy) == 3
    assert [(r["base_version"], r["version"]) for r in loop.history] == [(0, 1), (1, 2), (2, 3)]
    assert (loop.conn.step, loop.conn.version, loop.conn.seen) == (3, 3, 3)
    assert [e["step"] for e in loop.evals] == [1]
    assert result["steps"] == 3 and result["version"] == 3
    assert running.core.status().workers[0].left


def test_a_worker_says_one_info_line_at_start_and_the_rest_of_the_start_at_debug(server, caplog):
    import logging

    from worker.trainer import train

    running = server("sync", 1)
    config = WorkerConfig(ps=running.address, worker_index=0, num_workers=1, dataset="synthetic", steps=2,
                          global_batch_size=16, progress="off", log_every=1).validate()
    caplog.set_level(logging.DEBUG, logger="worker")
    train(config)
    info = [r.getMessage() for r in caplog.records if r.name == "worker" and r.levelno == logging.INFO]
    assert info[0].startswith(f"registered as worker 0 of 1; server mode sync, version 0, round 0 at "
                              f"{running.address}; chief; computes on /CPU:0 (TensorFlow 2.")
    assert info[0].endswith("; cnn on synthetic, 2 steps")
    assert len(info) == 3, info  # then only the events: finished, the final scores
    assert info[1].startswith("worker 0 finished 2 steps in ") and info[2].startswith("final: test loss ")
    debug = [r.getMessage() for r in caplog.records if r.name == "worker" and r.levelno == logging.DEBUG]
    assert any(m.startswith("computes on /CPU:0") for m in debug)
    assert any(m.startswith("initialized the server's variables") for m in debug)


def test_under_rule_keras_an_indexed_slices_is_pushed_occurrence_by_occurrence_as_tensorflow_gave_it():
    """--sparse-rule keras: every occurrence in order, none summed, never made dense (here
    8 occurrences of a 4-row table would otherwise go dense); "sum" sums the repeats."""
    import tensorflow as tf

    rows = np.array([3, 1, 3, 0, 1, 3, 2, 2])
    values = np.arange(16, dtype=np.float32).reshape(8, 2)
    g = tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant([4, 2]))
    pushed = gradients.to_pushable(g, (4, 2), occurrences=True)
    assert pushed.rows.tolist() == rows.tolist() and pushed.values.tobytes() == values.tobytes()
    summed = gradients.to_pushable(g, (4, 2))
    assert isinstance(summed, np.ndarray) and summed.tobytes() == tf.convert_to_tensor(g).numpy().tobytes()
