"""Tests of ps_server.core.modes.async_mode: the guarantees its docstring gives, stress-tested.

    python -m pytest tests/core/test_async_mode.py -q

"Lock-free" in that docstring allows pushes to interleave and a pull to see
some variables before a push and others after it. It still guarantees: no lost
update, no half-written array, a version that counts fully applied pushes and
never goes back, a pull at version v that includes every push counted in v,
recorded staleness, and rejected pushes that change nothing. The stress test
checks each of these with numbers that stay exact in floating point: SGD with
learning rate 1/2 and small integer gradients.
"""

import re
import threading

import numpy as np
import pytest

from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.errors import InvalidArgument, UnknownWorker
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.store import VariableStore
from tests.core.threads import JOIN, finish, start

LR = 0.5

# Every element of a variable starts equal and every gradient is a constant
# array, so each variable must stay uniform: a torn read would show two values.
SHAPES = {"a": ((64,), np.float32), "b": ((3, 5), np.float32), "c": ((17,), np.float64)}
SCALE = {"a": 1, "b": 2, "c": 3}  # gradient for variable n: SCALE[n], or (k + 1) * SCALE[n] from worker k
START = 1000.0


def uniform_variables():
    return {n: np.full(shape, START, dtype) for n, (shape, dtype) in SHAPES.items()}


def constant_gradients(worker, units=None):
    """Every element SCALE[n] * units; units defaults to worker + 1."""
    units = worker + 1 if units is None else units
    return {n: np.full(shape, units * SCALE[n], dtype) for n, (shape, dtype) in SHAPES.items()}


def make(variables=None, spec=None):
    store = VariableStore()
    store.initialize(variables or uniform_variables(), spec or OptimizerSpec("sgd", learning_rate=LR))
    return AsyncMode(store, Membership(4)), store


def snapshot(mode):
    version, values = mode.store.read()
    return version, {n: a.tobytes() for n, a in values.items()}, mode.stats.pushes_applied



# -- the stress test -----------------------------------------------------------------

THREADS, PUSHES = 4, 200
TOTAL = THREADS * PUSHES


def test_concurrent_pushes_lose_no_update_tear_no_array_and_count_every_version(tight_switching):
    mode, store = make()
    go = threading.Barrier(THREADS + 1)  # every thread starts pushing at once
    done = threading.Event()
    problems: list[str] = []  # the reader's first findings, checked at the end

    def note(problem):
        if len(problems) < 20:
            problems.append(problem)

    def push_many(worker):
        # One unit per push: a variable's distance from START, in units, is then
        # exactly the number of pushes applied to it.
        grads = constant_gradients(worker, units=1)
        results = []
        go.wait(JOIN)
        for step in range(PUSHES):
            base = store.version
            ticket = mode.submit(Push(worker, step, base, batch_size=worker + 1, gradients=grads))
            results.append((base, ticket.result(JOIN)))
        return results

    def read_until_done():
        reads, last = 0, 0
        go.wait(JOIN)
        while not done.is_set() and reads < 1_000_000:
            version, values = store.read()
            reads += 1
            if version < last:
                note(f"version went back from {last} to {version}")
            last = version
            for name, value in values.items():
                first = value.flat[0]
                if not (value == first).all():
                    note(f"torn read of {name!r}: {np.unique(value)}")
                applied = (START - float(first)) / (LR * SCALE[name])
                # Every push counted in `version` has been applied to every variable.
                if not version <= applied <= TOTAL:
                    note(f"{name!r} at version {version} has {applied} pushes applied")
        return reads

    reader = start(read_until_done)
    writers = [start(lambda k=k: push_many(k)) for k in range(THREADS)]
    finish(*writers)
    done.set()
    finish(reader)
    assert [w.error for w in writers] == [None] * THREADS
    assert reader.error is None
    assert problems == []
    assert reader.result > 10, "the reader did not run alongside the writers"

    # No lost update: every gradient was applied exactly once to every variable.
    version, values = store.read()
    for name, (shape, dtype) in SHAPES.items():
        expected = np.full(shape, START - LR * SCALE[name] * TOTAL, dtype)
        np.testing.assert_array_equal(values[name], expected, err_msg=name)
    # The version counts the pushes, and each push got its own version.
    assert version == TOTAL
    results = [r for w in writers for r in w.result]
    assert sorted(r.version for _, r in results) == list(range(1, TOTAL + 1))
    for base, r in results:
        # The version at apply start is at least base and at most the new version - 1.
        assert 0 <= r.staleness <= r.version - 1 - base
    assert mode.stats.pushes_applied == TOTAL
    assert mode.stats.examples_applied == PUSHES * sum(k + 1 for k in range(THREADS))
    assert sum(mode.stats.staleness_counts.values()) == TOTAL


def test_each_push_of_one_worker_sees_its_own_previous_push(tight_switching):
    # A worker's next push always starts after its last one returned, so the
    # version it returned is a lower bound of what that worker pulls next.
    mode, store = make()

    def push_and_pull(worker):
        last = 0
        for step in range(100):
            result = mode.submit(Push(worker, step, store.version, 1, constant_gradients(worker))).result(JOIN)
            version, _ = store.read()
            assert version >= result.version > last
            last = result.version

    workers = [start(lambda k=k: push_and_pull(k)) for k in range(THREADS)]
    finish(*workers)
    assert [w.error for w in workers] == [None] * THREADS


# -- one push at a time ---------------------------------------------------------------


def test_a_push_is_one_sgd_step_applied_before_it_returns():
    mode, store = make()
    result = mode.submit(Push(0, 0, 0, 1, constant_gradients(1))).result(JOIN)  # gradients 2, 4, 6
    assert (result.version, result.staleness, result.contributors) == (1, 0, 1)
    version, values = store.read()
    assert version == 1
    for name, (shape, dtype) in SHAPES.items():
        np.testing.assert_array_equal(values[name], np.full(shape, START - LR * 2 * SCALE[name], dtype))


def test_staleness_is_the_version_at_apply_minus_the_base_version():
    mode, _ = make()
    g = constant_gradients(0)
    got = [mode.submit(Push(0, s, base, 1, g)).result(JOIN) for s, base in enumerate([0, 0, 0, 3, 1])]
    assert [(r.version, r.staleness) for r in got] == [(1, 0), (2, 1), (3, 2), (4, 0), (5, 3)]
    assert mode.stats.staleness_counts == {0: 2, 1: 1, 2: 1, 3: 1}
    assert mode.stats.staleness_summary() == (6 / 5, 3)


def test_base_version_from_the_future_is_rejected_and_changes_nothing():
    mode, _ = make()
    mode.submit(Push(0, 0, 0, 1, constant_gradients(0))).result(JOIN)
    before = snapshot(mode)
    with pytest.raises(InvalidArgument, match="worker 2 claims base_version 2, but the server is only at version 1"):
        mode.submit(Push(2, 0, 2, 1, constant_gradients(2))).result(JOIN)
    assert snapshot(mode) == before


def bad(**over):
    g = constant_gradients(0)
    g.update(over)
    return {n: v for n, v in g.items() if v is not None}


def test_an_async_push_without_examples_changes_nothing():
    """The rest of a push's checks are ``ParameterServer.submit``'s, for every mode (test_push_checks)."""
    mode, _ = make()
    mode.submit(Push(1, 0, 0, 1, constant_gradients(1))).result(JOIN)
    before = snapshot(mode)
    with pytest.raises(InvalidArgument, match=re.escape("async push from worker 0 has no examples (batch_size 0)")):
        mode.submit(Push(0, 0, 0, 0, bad())).result(JOIN)
    assert snapshot(mode) == before


def test_push_of_an_unregistered_worker_is_rejected_and_changes_nothing():
    ps = ParameterServer(mode="async", num_workers=2)
    ps.register(0, 2)
    ps.initialize(0, uniform_variables(), OptimizerSpec("sgd", learning_rate=LR))
    before = ps.pull()
    with pytest.raises(UnknownWorker, match="worker 1 is not registered"):
        ps.submit(Push(1, 0, 0, 1, constant_gradients(1))).result(JOIN)
    after = ps.pull()
    assert after[0] == before[0] == 0
    assert all(after[1][n].tobytes() == before[1][n].tobytes() for n in SHAPES)
    assert ps.status().pushes_applied == 0


def test_gradient_in_non_native_byte_order_is_applied_whole_not_half():
    # Regression: the store's check accepted it, the optimizer refused it after
    # the variables sorted before it had already been updated.
    mode, store = make()
    g = constant_gradients(0)
    g["c"] = g["c"].astype(g["c"].dtype.newbyteorder("S"))
    assert mode.submit(Push(0, 0, 0, 1, g)).result(JOIN).version == 1
    _, values = store.read()
    for name, (shape, dtype) in SHAPES.items():
        np.testing.assert_array_equal(values[name], np.full(shape, START - LR * SCALE[name], dtype))


def test_async_mode_has_no_rounds():
    mode, _ = make()
    mode.submit(Push(3, 41, 0, 1, constant_gradients(3))).result(JOIN)  # any step is accepted: there is no barrier
    status = mode.status()
    assert (status.round, status.waiting_for, status.rounds_timed_out, status.rounds_aborted) == (0, (), 0, 0)


def test_push_returns_without_waiting_for_other_workers():
    mode, _ = make()
    t = start(lambda: mode.submit(Push(0, 0, 0, 1, constant_gradients(0))).result(JOIN))  # worker 1 never pushes
    finish(t, timeout=5.0)
    assert t.error is None and t.result.version == 1


def test_global_clipnorm_clips_a_push_by_the_norm_of_all_its_gradients():
    # Keras takes global_clipnorm over one update's gradients: [3] and [4] have norm 5,
    # so with global_clipnorm 1 they become [0.6] and [0.8]; SGD with learning rate 1.
    store = VariableStore()
    store.initialize({"a": np.array([1.0], np.float32), "b": np.array([2.0], np.float32)},
                     OptimizerSpec("sgd", learning_rate=1.0, global_clipnorm=1.0))
    mode = AsyncMode(store, Membership(1))
    mode.submit(Push(0, 0, 0, 1, {"a": np.array([3.0], np.float32), "b": np.array([4.0], np.float32)})).result(JOIN)
    _, values = store.read()
    np.testing.assert_allclose(values["a"], [1.0 - 0.6], rtol=1e-6)
    np.testing.assert_allclose(values["b"], [2.0 - 0.8], rtol=1e-6)
