"""The built-in models' sizes, ``--train-examples`` subsets and the digits-large dataset.

    python -m pytest -q tests/worker/test_models_and_data.py

Parameter counts are computed by hand from the layer shapes (a Dense(m -> k) has
m*k + k, a Conv2D(c_in -> c_out, 3x3) 9*c_in*c_out + c_out); no training here.
"""

import numpy as np
import pytest

from ps_common.settings import ConfigError
from worker.config import WorkerConfig
from worker.data import DATASETS, load_dataset, train_subset
from worker.model import MODELS, build_model, tf_setup
from worker.task import BuiltinTask, TaskError

BY_HAND = {
    "tiny": 784 * 10 + 10,
    # 28 -conv-> 26 -conv-> 24 -pool-> 12 -conv-> 10 -pool-> 5: 5*5*32 = 800 features
    "deepcnn": (9 * 16 + 16) + (9 * 16 * 16 + 16) + (9 * 16 * 32 + 32) + (800 * 64 + 64) + (64 * 10 + 10),
    "cnn": (9 * 32 + 32) + (26 * 26 * 32 * 10 + 10),
    "mlp": (784 * 1024 + 1024) + (1024 * 128 + 128) + (128 * 10 + 10),
    "mlp25m": (784 * 8192 + 8192) + (8192 * 2304 + 2304) + (2304 * 10 + 10),
}


def test_every_built_in_model_has_the_parameter_count_its_layers_give():
    tf_setup(deterministic=True)
    assert set(MODELS) == set(BY_HAND)
    for name in MODELS:
        model = build_model(name, seed=0)
        assert model.count_params() == BY_HAND[name], name
        assert tuple(model.output_shape) == (None, 10), name
    assert BY_HAND["tiny"] == 7850 and BY_HAND["deepcnn"] < 100_000
    assert BY_HAND["mlp"] / BY_HAND["tiny"] > 100  # tiny..mlp span two orders of magnitude


def test_a_subset_keeps_each_labels_share_and_is_the_same_every_time():
    digits = load_dataset("digits")
    sub = train_subset(digits, 200)
    assert sub.x_train.shape == (200, 28, 28, 1) and len(sub.y_train) == 200
    assert np.bincount(sub.y_train, minlength=10).tolist() == [20] * 10  # digits is nearly balanced
    again = train_subset(load_dataset("digits"), 200)
    assert np.array_equal(sub.x_train, again.x_train) and np.array_equal(sub.y_train, again.y_train)
    assert sub.x_test is digits.x_test and sub.y_test is digits.y_test  # the test set unchanged
    # Every kept example is one of the training set's, none twice.
    flat = digits.x_train.reshape(len(digits.y_train), -1)
    rows = {row.tobytes(): i for i, row in enumerate(flat)}
    picked = [rows[r.tobytes()] for r in sub.x_train.reshape(200, -1)]
    assert len(set(picked)) == 200 and all(digits.y_train[i] == y for i, y in zip(picked, sub.y_train))
    # Largest remainders: 13 examples over 10 labels give each 1, and 3 of them 2.
    counts = np.bincount(train_subset(digits, 13).y_train, minlength=10)
    assert counts.sum() == 13 and sorted(counts.tolist()) == [1] * 7 + [2] * 3


def test_the_subset_does_not_depend_on_the_run_seed():
    one = BuiltinTask(WorkerConfig(train_examples=100, seed=1, steps=1))
    two = BuiltinTask(WorkerConfig(train_examples=100, seed=7, steps=1))
    assert np.array_equal(one.data.y_train, two.data.y_train) and np.array_equal(one.data.x_train, two.data.x_train)
    assert one.num_examples == 100


def test_an_epoch_follows_the_number_of_training_examples():
    task = BuiltinTask(WorkerConfig(train_examples=130, epochs=2, global_batch_size=64))
    assert task.total_steps == 2 * 3  # 130 examples: batches of 64, 64, 2
    assert max(int(task.global_batch(step).max()) for step in range(task.total_steps)) < 130
    assert BuiltinTask(WorkerConfig(epochs=1, global_batch_size=64)).total_steps == 23  # 1437, all of digits


def test_more_training_examples_than_the_set_holds_or_fewer_than_zero_are_refused():
    with pytest.raises(TaskError, match="--train-examples 5000 is more than the 1437 training examples of digits"):
        BuiltinTask(WorkerConfig(train_examples=5000, steps=1))
    with pytest.raises(ConfigError, match=r"--train-examples must be >= 0 \(0: all\), got -1"):
        WorkerConfig.from_args(["--train-examples", "-1"], environ={})
    with pytest.raises(ValueError, match="must be >= 0"):
        train_subset(load_dataset("digits"), -3)
    assert WorkerConfig.from_args(["--train-examples", "200"], environ={}).train_examples == 200
    assert WorkerConfig.from_args([], environ={"TFPS_TRAIN_EXAMPLES": "50"}).train_examples == 50


def test_digits_large_is_ten_shifted_noised_copies_of_digits_training_set_and_the_same_each_time():
    assert "digits-large" in DATASETS
    digits, large = load_dataset("digits"), load_dataset("digits-large")
    n = len(digits.y_train)
    assert large.x_train.shape == (10 * n, 28, 28, 1) and large.x_train.dtype == np.float32
    assert large.y_train.dtype == np.int64 and np.array_equal(large.y_train, np.tile(digits.y_train, 10))
    assert 0.0 <= large.x_train.min() and large.x_train.max() <= 1.0
    assert np.array_equal(large.x_test, digits.x_test) and np.array_equal(large.y_test, digits.y_test)
    again = load_dataset("digits-large")
    assert np.array_equal(large.x_train, again.x_train)
    # Each copy is its original moved by at most 2 pixels, plus small noise: some shift brings
    # it within the noise of the original, and the copies differ from each other.
    for i in (0, 5, n + 17, 9 * n + 3):
        src, copy = digits.x_train[i % n, ..., 0], large.x_train[i, ..., 0]
        pad = np.pad(src, 2)
        best = min(np.abs(pad[2 - dy: 30 - dy, 2 - dx: 30 - dx] - copy).mean()
                   for dy in range(-2, 3) for dx in range(-2, 3))
        assert best < 0.06, (i, best)
    assert not np.array_equal(large.x_train[:n], large.x_train[n: 2 * n])
