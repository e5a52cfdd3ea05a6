"""Round-summed metrics and set_learning_rates in the core's modes, with real threads.

    python -m pytest tests/core/test_round_metrics.py -q

sync_mode's docstring: "the round's metrics are summed element by element in
worker-id order, in the tensors' own dtype ... over the round's contributors
only"; "every push of a round carries metrics of the same names, shapes and
dtypes, or none"; "a round in which any contributor set the learning rate is
applied with it". async_mode's: a push's set_learning_rates hold from its own
update on; metrics are ignored. Expected values are computed by hand, with
numbers whose float32 sum depends on the order of the additions.
"""

import numpy as np
import pytest

from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.errors import InvalidArgument
from ps_server.core.membership import Membership
from ps_server.core.modes.base import MAX_METRIC_BYTES, MAX_METRICS, Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.modes.ssp_mode import SSPMode
from ps_server.core.store import VariableStore
from ps_server.core.modes.sync_mode import SyncMode
from tests.core.threads import JOIN, finish, start, wait_until


def f32(*xs):
    return np.array(xs, dtype=np.float32)


W0 = {"w": f32(1, 2)}
GRAD = {"w": f32(2, 4)}  # the same from every worker: the mean is [2, 4]


def make(num_workers=3, lr=0.5, quorum=0, mode="sync", **kwargs):
    store = VariableStore()
    store.initialize(W0, OptimizerSpec("sgd", learning_rate=lr))
    members = Membership(num_workers)
    if mode == "sync":
        return SyncMode(store, members, num_workers, JOIN, replicas_to_aggregate=quorum), store
    return AsyncMode(store, members, **kwargs), store


def push(mode, worker, step=0, metrics=None, rate=0.0, base=None):
    return mode.submit(Push(worker_id=worker, step=step, base_version=step if base is None else base, batch_size=1,
                            gradients=GRAD, metrics=metrics or {}, set_learning_rates=(rate,) if rate else ())).result(JOIN)


def values(store):
    return store.read()[1]


def run_round(mode, metrics, order=(2, 1, 0), step=0, rates=None):
    """Push one round, the workers arriving in ``order``; the replies by worker."""
    rates = rates or {}
    threads = {}
    for w in order[:-1]:
        threads[w] = start(lambda w=w: push(mode, w, step, metrics[w], rates.get(w, 0.0)))
        wait_until(lambda w=w: pushed(mode, w))
    last = order[-1]
    replies = {last: push(mode, last, step, metrics[last], rates.get(last, 0.0))}
    finish(*threads.values())
    for w, t in threads.items():
        assert t.error is None, t.error
        replies[w] = t.result
    return replies


def pushed(mode, worker):
    """The round ``worker`` waits in has its push: it is no longer among those waited for."""
    waiting = mode.status().waiting_for
    return bool(waiting) and worker not in waiting


# Worker order: (2**24 + 1) - 2**24 = 0 in float32 (2**24 + 1 rounds to 2**24);
# the arrival order 2, 1, 0 would give (-2**24 + 1) + 2**24 = 1, and float64 too.
ORDER_METRICS = [{"acc/total": f32(2**24, 3), "acc/count": np.array([[1e16], [0.5]])},
                 {"acc/total": f32(1, 4), "acc/count": np.array([[1.0], [0.25]])},
                 {"acc/total": f32(-(2**24), 5), "acc/count": np.array([[-1e16], [0.25]])}]


# -- sync: the sum -----------------------------------------------------------------------


def test_round_metrics_are_summed_in_worker_order_in_their_dtype_whatever_the_arrival_order():
    mode, _ = make()
    replies = run_round(mode, ORDER_METRICS, order=(2, 1, 0))
    for w, r in replies.items():
        assert set(r.metrics) == {"acc/total", "acc/count"}, w
        total, count = r.metrics["acc/total"], r.metrics["acc/count"]
        assert total.dtype == np.float32 and count.dtype == np.float64 and count.shape == (2, 1)
        assert total.tobytes() == f32(0, 12).tobytes()  # not [1, 12]: worker order, float32 additions
        assert count.tobytes() == np.array([[0.0], [1.0]]).tobytes()  # 1e16 + 1 is 1e16 in float64
        assert not total.flags.writeable
    assert len({r.metrics["acc/total"].tobytes() for r in replies.values()}) == 1


def test_a_round_without_metrics_answers_none():
    mode, _ = make()
    replies = run_round(mode, [None, None, None])
    assert [r.metrics for r in replies.values()] == [{}, {}, {}]


@pytest.mark.parametrize("theirs, says", [
    ({"acc/total": np.array([1.0, 2.0])}, "has metric 'acc/total' as float64[2], not float32[2]"),
    ({"acc/total": f32(1, 2, 3)}, "has metric 'acc/total' as float32[3], not float32[2]"),
    ({}, "carries no metrics"),
    ({"acc/total": f32(1, 2), "loss/total": f32(1)}, "has extra metric(s) 'loss/total'"),
    ({"loss/total": f32(1, 2)}, "lacks metric(s) 'acc/total'"),
])
def test_a_push_whose_metrics_differ_from_the_round_s_is_refused_and_changes_nothing(theirs, says):
    mode, store = make()
    first = start(lambda: push(mode, 0, metrics={"acc/total": f32(1, 2)}))
    wait_until(lambda: mode.status().waiting_for == (1, 2))
    with pytest.raises(InvalidArgument) as e:
        push(mode, 1, metrics=theirs)
    assert says in str(e.value) and "worker 0" in str(e.value) and "\n" not in str(e.value)
    assert mode.status().waiting_for == (1, 2) and store.version == 0  # the round goes on without it
    np.testing.assert_array_equal(values(store)["w"], W0["w"])
    # ... and completes with pushes that match.
    t1 = start(lambda: push(mode, 1, metrics={"acc/total": f32(10, 20)}))
    wait_until(lambda: mode.status().waiting_for == (2,))
    last = push(mode, 2, metrics={"acc/total": f32(100, 200)})
    finish(first, t1)
    assert last.metrics["acc/total"].tobytes() == f32(111, 222).tobytes()
    assert first.result.metrics["acc/total"].tobytes() == f32(111, 222).tobytes()


def test_a_push_with_metrics_cannot_join_a_round_begun_without():
    mode, store = make()
    first = start(lambda: push(mode, 0))
    wait_until(lambda: mode.status().waiting_for == (1, 2))
    with pytest.raises(InvalidArgument, match=r"carries metrics \(acc/total\)"):
        push(mode, 1, metrics={"acc/total": f32(1)})
    assert store.version == 0
    run_rest = [start(lambda w=w: push(mode, w)) for w in (1, 2)]
    finish(first, *run_rest)
    assert first.result.version == 1


def test_with_backup_workers_only_the_round_s_contributors_are_summed():
    mode, _ = make(quorum=2)
    t0 = start(lambda: push(mode, 0, metrics={"m": f32(1)}))
    wait_until(lambda: mode.status().waiting_for == (1, 2))
    r1 = push(mode, 1, metrics={"m": f32(2)})
    finish(t0)
    late = push(mode, 2, metrics={"m": f32(4)})
    assert r1.metrics["m"].tobytes() == t0.result.metrics["m"].tobytes() == f32(3).tobytes()
    assert late.dropped and late.metrics == {} and late.learning_rate == 0.0


def test_a_replayed_push_gets_the_recorded_sum_and_learning_rate():
    mode, store = make()
    replies = run_round(mode, ORDER_METRICS)
    again = push(mode, 1, metrics=ORDER_METRICS[1])
    assert again.replayed and store.version == 1
    assert again.metrics["acc/total"].tobytes() == replies[1].metrics["acc/total"].tobytes() == f32(0, 12).tobytes()
    assert again.learning_rate == replies[1].learning_rate == 0.5


def test_exactly_the_limits_are_accepted():
    mode, _ = make(num_workers=1)
    many = {f"m{i:02d}": np.zeros(MAX_METRIC_BYTES // 8 // MAX_METRICS, np.float64) for i in range(MAX_METRICS)}
    assert sum(a.nbytes for a in many.values()) == MAX_METRIC_BYTES
    assert set(push(mode, 0, metrics=many).metrics) == set(many)


# -- sync: the learning rate ----------------------------------------------------------------


def test_a_round_in_which_a_worker_sets_the_learning_rate_is_applied_with_it_and_later_ones_too():
    mode, store = make(lr=0.5)
    replies = run_round(mode, [None] * 3, rates={1: 0.25})
    assert {r.learning_rate for r in replies.values()} == {0.25}
    np.testing.assert_array_equal(values(store)["w"], f32(1 - 0.25 * 2, 2 - 0.25 * 4))  # [0.5, 1]
    assert {r.learning_rate for r in run_round(mode, [None] * 3, step=1).values()} == {0.25}
    np.testing.assert_array_equal(values(store)["w"], f32(0.5 - 0.5, 1 - 1))
    assert store.current_learning_rate() == 0.25


def test_without_set_learning_rates_the_reply_names_the_optimizer_s_rate():
    mode, _ = make(lr=0.5)
    assert {r.learning_rate for r in run_round(mode, [None] * 3).values()} == {0.5}


def test_two_different_learning_rates_in_one_round_refuse_the_second_and_change_nothing():
    mode, store = make(lr=0.5)
    t0 = start(lambda: push(mode, 0, rate=0.25))
    wait_until(lambda: mode.status().waiting_for == (1, 2))
    with pytest.raises(InvalidArgument, match=r"another push of that round set \(0.25,\)"):
        push(mode, 1, rate=0.125)
    assert store.version == 0 and store.current_learning_rate() == 0.5
    t1 = start(lambda: push(mode, 1, rate=0.25))  # the same value again is fine
    wait_until(lambda: mode.status().waiting_for == (2,))
    assert push(mode, 2).learning_rate == 0.25
    finish(t0, t1)


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -0.1])
def test_a_bad_learning_rate_is_refused_and_changes_nothing(rate):
    for mode_name in ("sync", "async"):
        mode, store = make(num_workers=1, mode=mode_name)
        with pytest.raises(InvalidArgument, match="a learning rate must be a finite number > 0"):
            push(mode, 0, rate=rate)
        assert store.version == 0 and store.current_learning_rate() == 0.5


def test_a_learning_rate_is_refused_while_the_optimizer_runs_a_schedule():
    schedule = '{"class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.5, ' \
               '"decay_steps": 10, "decay_rate": 0.5}}'
    for mode_name in ("sync", "async"):
        store = VariableStore()
        store.initialize(W0, OptimizerSpec("sgd", learning_rate=0.5, learning_rate_schedule=schedule))
        members = Membership(1)
        mode = SyncMode(store, members, 1, JOIN) if mode_name == "sync" else AsyncMode(store, members)
        with pytest.raises(InvalidArgument, match="schedule"):
            push(mode, 0, rate=0.1)
        assert store.version == 0
        np.testing.assert_array_equal(values(store)["w"], W0["w"])


# -- async and ssp -------------------------------------------------------------------------


def test_async_applies_set_learning_rates_to_its_own_update_on_and_ignores_metrics():
    mode, store = make(num_workers=2, mode="async")
    first = push(mode, 0, step=0, metrics={"m": f32(1)}, rate=0.25, base=0)
    assert first.learning_rate == 0.25 and first.metrics == {}
    np.testing.assert_array_equal(values(store)["w"], f32(0.5, 1))
    second = push(mode, 1, step=0, base=1)
    assert second.learning_rate == 0.25
    np.testing.assert_array_equal(values(store)["w"], f32(0, 0))


def test_async_reply_names_the_rate_before_the_scale_policy_s_factor_and_zero_when_dropped():
    mode, store = make(num_workers=2, mode="async", stale_policy="scale")
    push(mode, 0, step=0, base=0)
    stale = push(mode, 1, step=0, base=0)  # staleness 1: the step is lr / 2
    assert stale.staleness == 1 and stale.learning_rate == 0.5
    np.testing.assert_array_equal(values(store)["w"], f32(1 - 1 - 0.5, 2 - 2 - 1))
    mode, store = make(num_workers=2, mode="async", stale_policy="drop", max_staleness=0)
    push(mode, 0, step=0, base=0)
    dropped = push(mode, 1, step=0, base=0, rate=0.125)
    assert dropped.dropped and dropped.learning_rate == 0.0
    assert store.current_learning_rate() == 0.5  # a dropped push sets nothing


def test_ssp_applies_set_learning_rates_from_its_own_update_on_like_async():
    store = VariableStore()
    store.initialize(W0, OptimizerSpec("sgd", learning_rate=0.5))
    mode = SSPMode(store, Membership(1), staleness_bound=2, barrier_timeout=JOIN)
    first = push(mode, 0, step=0, metrics={"m": f32(1)}, rate=0.25, base=0)
    assert (first.learning_rate, first.metrics) == (0.25, {})
    np.testing.assert_array_equal(values(store)["w"], f32(0.5, 1))
    assert push(mode, 0, step=1, base=1).learning_rate == 0.25
