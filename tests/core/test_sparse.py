"""Sparse gradients (core.optim.sparse) and non-trainable variables (store): plain NumPy, no sockets.

Expected values are computed by hand: an SGD step with learning rate lr on a
gradient g gives w - lr * g, and a sync round weights each push by its batch share.
"""

import threading

import numpy as np
import pytest

from ps_server.core.checkpoint import decode, encode
from ps_server.core.errors import InvalidArgument, NotFound, SpecConflict
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.optim.sparse import SparseRows, check, densify
from tests.core.threads import JOIN

SGD = OptimizerSpec("sgd", learning_rate=0.5)
ADAM = OptimizerSpec("adam", learning_rate=0.1)


def table() -> dict[str, np.ndarray]:
    return {"emb": np.arange(12, dtype=np.float32).reshape(6, 2), "bias": np.zeros(2, np.float32)}


def test_repeated_rows_add_up_and_untouched_rows_are_zero():
    g = SparseRows(np.array([3, 1, 3]), np.array([[1, 2], [10, 20], [100, 200]], np.float32))
    dense = densify(g, (5, 2), np.float32)
    np.testing.assert_array_equal(dense, [[0, 0], [10, 20], [0, 0], [101, 202], [0, 0]])


@pytest.mark.parametrize("rows, values, message", [
    ([6], np.ones((1, 2), np.float32), "names row 6; the variable has rows 0..5"),
    ([-1], np.ones((1, 2), np.float32), "names row -1"),
    ([0, 1], np.ones((1, 2), np.float32), "must be [2, 2]"),
    ([0], np.ones((1, 3), np.float32), "must be [1, 2]"),
    ([0], np.ones((1, 2), np.float64), "dtype float64"),
])
def test_a_sparse_gradient_that_does_not_fit_its_variable_is_refused(rows, values, message):
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        check("emb", SparseRows(np.array(rows, np.int64), values), (6, 2), np.float32)


def _ps(mode="sync", workers=2, spec=SGD, **kw) -> ParameterServer:
    ps = ParameterServer(mode=mode, num_workers=workers, barrier_timeout=5.0)
    for i in range(workers):
        ps.register(i, workers)
    ps.initialize(0, table(), spec, **kw)
    return ps


def test_a_sparse_push_applies_exactly_what_the_same_dense_push_applies():
    rows, vals = np.array([4, 0, 4]), np.array([[1, 1], [2, 2], [3, 3]], np.float32)
    sparse_ps, dense_ps = _ps("async", 1, ADAM), _ps("async", 1, ADAM)
    bias = np.ones(2, np.float32)
    for _ in range(3):
        sparse_ps.submit(Push(0, 0, sparse_ps.store.version, 8,
                              {"emb": SparseRows(rows, vals), "bias": bias})).result(JOIN)
        dense = densify(SparseRows(rows, vals), (6, 2), np.float32)
        dense_ps.submit(Push(0, 0, dense_ps.store.version, 8, {"emb": dense, "bias": bias})).result(JOIN)
    _, a = sparse_ps.pull()
    _, b = dense_ps.pull()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    # Rows no push touched keep zero moments, so Adam leaves them where they were.
    np.testing.assert_array_equal(a["emb"][[1, 2, 3, 5]], table()["emb"][[1, 2, 3, 5]])


def test_a_sync_round_weights_sparse_and_dense_pushes_by_batch_share():
    ps = _ps("sync", 2)
    g0 = SparseRows(np.array([1]), np.array([[4.0, 8.0]], np.float32))  # batch 3
    g1 = np.zeros((6, 2), np.float32)
    g1[2] = [1.0, 1.0]  # batch 1
    t = threading.Thread(target=ps.submit, args=(Push(0, 0, 0, 3, {"emb": g0, "bias": np.zeros(2, np.float32)}),))
    t.start()
    ps.submit(Push(1, 0, 0, 1, {"emb": g1, "bias": np.zeros(2, np.float32)})).result(JOIN)
    t.join(5)
    _, values = ps.pull()
    expected = table()["emb"].copy()
    expected[1] -= 0.5 * 0.75 * np.array([4.0, 8.0], np.float32)
    expected[2] -= 0.5 * 0.25 * np.array([1.0, 1.0], np.float32)
    np.testing.assert_allclose(values["emb"], expected, rtol=0, atol=1e-6)


def test_a_refused_sparse_push_changes_nothing():
    ps = _ps("async", 1)
    _, before = ps.pull()
    with pytest.raises(InvalidArgument, match="names row 9"):
        ps.submit(Push(0, 0, 0, 1, {"emb": SparseRows(np.array([9]), np.ones((1, 2), np.float32)),
                                    "bias": np.zeros(2, np.float32)})).result(JOIN)
    with pytest.raises(NotFound):
        ps.submit(Push(0, 0, 0, 1, {"nope": SparseRows(np.array([0]), np.ones((1, 2), np.float32)),
                                    "bias": np.zeros(2, np.float32)})).result(JOIN)
    version, after = ps.pull()
    assert version == 0
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])


def test_sparse_specs_are_checked_from_a_stream_header():
    ps = _ps("async", 1)
    specs = {"emb": (np.dtype(np.float32), (3, 2)), "bias": (np.dtype(np.float32), (2,))}
    ps.check_push(0, 0, 0, 1, specs, sparse=["emb"])  # any row count
    with pytest.raises(InvalidArgument, match="has shape"):
        ps.check_push(0, 0, 0, 1, specs)  # (3, 2) is not the dense shape
    with pytest.raises(InvalidArgument, match="must be \\[rows, 2\\]"):
        ps.check_push(0, 0, 0, 1, {**specs, "emb": (np.dtype(np.float32), (3, 5))}, sparse=["emb"])


# -- non-trainable variables ---------------------------------------------------------
def test_a_sync_round_sets_a_non_trainable_variable_to_the_batch_weighted_mean_of_the_workers_values():
    """Each worker pushes new - pulled; the round adds the batch-weighted mean of those
    changes, without the optimizer (Adam would move it by about lr whatever the change)."""
    ps = _ps("sync", 2, ADAM, non_trainable=["bias"])
    pulled = table()["bias"]
    new0, new1 = np.array([1.0, 2.0], np.float32), np.array([3.0, 6.0], np.float32)
    zero = np.zeros((6, 2), np.float32)
    t = threading.Thread(target=ps.submit, args=(Push(0, 0, 0, 1, {"emb": zero, "bias": new0 - pulled}),))
    t.start()
    ps.submit(Push(1, 0, 0, 3, {"emb": zero, "bias": new1 - pulled})).result(JOIN)
    t.join(5)
    _, values = ps.pull()
    np.testing.assert_allclose(values["bias"], 0.25 * new0 + 0.75 * new1, rtol=0, atol=1e-7)
    assert ps.store.non_trainable() == {"bias"}


def test_an_async_push_adds_its_change_to_a_non_trainable_variable():
    ps = _ps("async", 1, SGD, non_trainable=["bias"])
    for step in range(2):
        ps.submit(Push(0, step, step, 1, {"emb": np.zeros((6, 2), np.float32),
                                          "bias": np.array([0.5, -1], np.float32)})).result(JOIN)
    _, values = ps.pull()
    np.testing.assert_array_equal(values["bias"], [1.0, -2.0])


def test_initializing_again_with_another_non_trainable_set_is_a_conflict():
    ps = _ps("async", 1, SGD, non_trainable=["bias"])
    assert ps.initialize(0, table(), SGD, non_trainable=["bias"]) == (False, 0)
    with pytest.raises(SpecConflict, match="non-trainable"):
        ps.initialize(0, table(), SGD)
    with pytest.raises(InvalidArgument, match="not among the variables"):
        ParameterServer(mode="async", num_workers=1).store.initialize(table(), SGD, non_trainable=["x"])


def test_a_checkpoint_keeps_which_variables_are_non_trainable():
    ps = _ps("async", 1, ADAM, non_trainable=["bias"])
    state = decode(encode(ps.checkpoint_state()))
    assert state.non_trainable == {"bias"}
    fresh = ParameterServer(mode="async", num_workers=1)
    fresh.restore(state)
    assert fresh.store.non_trainable() == {"bias"}
    fresh.register(0, 1)
    fresh.submit(Push(0, 0, 0, 1, {"emb": np.zeros((6, 2), np.float32),
                                   "bias": np.array([2, 3], np.float32)})).result(JOIN)
    np.testing.assert_array_equal(fresh.pull()[1]["bias"], [2, 3])


def test_unique_increasing_rows_take_the_copy_path_and_give_what_adding_gives():
    rng = np.random.default_rng(5)
    values = rng.standard_normal((4, 3)).astype(np.float32)
    increasing = densify(SparseRows(np.array([1, 4, 5, 9]), values), (10, 3), np.float32)
    shuffled = densify(SparseRows(np.array([9, 1, 5, 4]), values[[3, 0, 2, 1]]), (10, 3), np.float32)
    np.testing.assert_array_equal(increasing, shuffled)
    assert np.count_nonzero(increasing.any(axis=1)) == 4
