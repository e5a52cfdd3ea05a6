"""Your dataset function under ``--elastic``: read once into arrays, dealt by index, or refused in one line.

    python -m pytest -q tests/worker/test_user_elastic_data.py
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import batches
from ps_common.settings import ConfigError
from worker.config import WorkerConfig
from worker.task import TaskError, UserTask

tf = pytest.importorskip("tensorflow")

X = np.arange(20, dtype="float32").reshape(10, 2)
Y = np.arange(10, dtype="int64") % 3
W = np.linspace(0.5, 1.5, 10).astype("float32")


def build():
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def elastic_task(dataset_fn, **kwargs) -> UserTask:
    return UserTask(build, dataset_fn, global_batch_size=4, epochs=2, elastic=True, **kwargs)


def test_an_endless_dataset_is_refused_in_one_line():
    endless = lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()
    with pytest.raises(TaskError, match=r"^an infinite dataset \(repeat\(\)\) has no epoch of examples to deal; "
                                        r"give a finite one \(no repeat\(\)\)$"):
        elastic_task(endless)


@pytest.mark.parametrize("element, why", [
    (lambda: (X,), "they have no labels"),
    (lambda: {"x": X, "y": Y}, "they have no labels"),
    (lambda: (X, Y, W, W), "must be x, (x, y) or (x, y, sample_weight)"),
])
def test_elements_that_are_not_features_labels_and_weights_are_refused(element, why):
    data = lambda: tf.data.Dataset.from_tensor_slices(element()).batch(4)
    with pytest.raises(TaskError) as e:
        elastic_task(data)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_the_examples_are_one_pass_of_the_dataset_in_its_order_dealt_as_the_server_deals():
    order = np.array([3, 1, 4, 0, 5, 9, 2, 6, 8, 7])
    data = lambda: tf.data.Dataset.from_tensor_slices(({"a": X[order]}, Y[order], W[order])).batch(3)
    task = elastic_task(data)
    assert (task.num_examples, task.total_steps) == (10, 2 * 3)  # two epochs of batches of 4: 4, 4, 2
    for step in range(task.total_steps):
        np.testing.assert_array_equal(task.global_batch(step), batches.global_batch(10, 4, 0, step))
    x, y, w = task.examples(np.array([2, 0]))
    np.testing.assert_array_equal(x["a"], X[[4, 3]])
    np.testing.assert_array_equal(y, Y[[4, 3]])
    np.testing.assert_array_equal(w, W[[4, 3]])


def test_a_context_taking_dataset_function_reads_the_whole_data_as_worker_0_of_1():
    seen = []

    def data(ctx):
        seen.append((ctx.worker_index, ctx.num_workers))
        return tf.data.Dataset.from_tensor_slices((X, Y)).shard(ctx.num_workers, ctx.worker_index).batch(4)

    task = elastic_task(data, worker_index=2, num_workers=3)
    task.rebind(1, 3)  # --worker-index auto: the examples stay every worker's
    assert seen == [(0, 1)] and task.num_examples == 10


def test_dataset_sharding_none_is_refused_with_elastic():
    with pytest.raises(ConfigError, match=r"^--dataset-sharding none with --elastic: the server deals"):
        WorkerConfig.from_args(["--elastic", "--model", "m:build", "--dataset", "m:data",
                                "--dataset-sharding", "none"], environ={})


def test_a_sample_weight_scales_each_example_s_loss_as_keras_sums_over_the_batch_size():
    from worker.gradients import Gradients

    task = elastic_task(lambda: tf.data.Dataset.from_tensor_slices((X, Y, W)).batch(4))
    model = task.build_model()
    grads = Gradients(model, task.loss)
    x, y, w = task.examples(np.arange(10))
    plain, _ = grads(x, y, {})
    weighted, _ = grads(x, y, {}, sample_weight=w)
    per = task.loss(y, model(x)).numpy()
    assert plain == pytest.approx(per.mean(), rel=1e-6)
    assert weighted == pytest.approx((per * w).sum() / 10, rel=1e-6)
