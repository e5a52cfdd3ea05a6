"""Tests of ps_server.core.modes.sync_mode: the barrier, with real threads.

    python -m pytest tests/core/test_sync_mode.py -q

Each test checks one guarantee of the module docstring. Expected parameters are
computed by hand (numbers exact in binary) or, for many rounds, by a plain
sequential loop. Every wait is bounded: threads are joined with a timeout and
then asserted dead; polls give up after a few seconds.
"""

import itertools
from fractions import Fraction
import re
import threading
import time

import numpy as np
import pytest

from ps_server.core.modes import aggregation
from ps_server.core.modes.aggregation import _round_exact
from ps_server.core.errors import (
    BarrierTimeout,
    FutureRound,
    InvalidArgument,
    StaleRound,
    UnknownWorker,
)
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.store import VariableStore
from tests.core.threads import FakeClock, JOIN, finish, start, ticking, wait_until
from ps_server.core.modes.sync_mode import SyncMode




def f32(*xs):
    return np.array(xs, dtype=np.float32)


W0 = {"w": f32(1, 2, 3, 4), "b": np.array([10.0])}
LR = 0.5
# Round of three workers, batch sizes 1, 1, 2 (weights 1/4, 1/4, 1/2):
# mean w = [1+0+1, 0+1+1, 2+2-1, -1+1+0] = [2, 2, 3, 0], mean b = 1 + 2 - 1 = 2.
SIZES = [1, 1, 2]
GRADS = [
    {"w": f32(4, 0, 8, -4), "b": np.array([4.0])},
    {"w": f32(0, 4, 8, 4), "b": np.array([8.0])},
    {"w": f32(2, 2, -2, 0), "b": np.array([-2.0])},
]
AFTER_ONE_ROUND = {"w": f32(1 - 1, 2 - 1, 3 - 1.5, 4 - 0), "b": np.array([10.0 - 1.0])}


def make(num_workers=3, barrier_timeout=JOIN, clock=time.monotonic, variables=W0, lr=LR):
    store = VariableStore()
    store.initialize(variables, OptimizerSpec("sgd", learning_rate=lr))
    members = Membership(num_workers)
    return SyncMode(store, members, num_workers, barrier_timeout, clock=clock), store


def push_of(worker, step=0, grads=None, size=None, base=None):
    return Push(
        worker_id=worker,
        step=step,
        base_version=step if base is None else base,
        batch_size=SIZES[worker] if size is None else size,
        gradients=GRADS[worker] if grads is None else grads,
    )


def push(mode, worker, step=0, grads=None, size=None, base=None):
    return mode.submit(push_of(worker, step, grads, size, base)).result(JOIN)


def snapshot(store):
    version, values = store.read()
    return version, {n: a.tobytes() for n, a in values.items()}


def assert_values(store, expected):
    _, values = store.read()
    assert set(values) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(values[name], value, err_msg=name)



# -- a complete round ----------------------------------------------------------------


def test_round_applies_w_minus_lr_times_batch_weighted_mean_and_all_get_the_new_version():
    ps = ParameterServer(mode="sync", num_workers=3, barrier_timeout=JOIN)
    for w in range(3):
        ps.register(w, 3)
    ps.initialize(0, W0, OptimizerSpec("sgd", learning_rate=LR))
    workers = [
        start(lambda w=w: ps.submit(Push(w, 0, 0, SIZES[w], GRADS[w], loss=float(w))).result(JOIN))
        for w in range(3)
    ]
    finish(*workers)
    assert [w.error for w in workers] == [None] * 3
    assert {(w.result.version, w.result.staleness, w.result.contributors) for w in workers} == {(1, 0, 3)}
    assert_values(ps.store, AFTER_ONE_ROUND)
    status = ps.status()
    assert (status.version, status.round, status.waiting_for) == (1, 1, ())
    assert (status.pushes_applied, status.examples_applied) == (3, 4)
    assert status.last_loss == 0.25 * 0 + 0.25 * 1 + 0.5 * 2
    assert [r.pushes for r in status.workers] == [1, 1, 1]


def test_round_waits_until_every_worker_has_pushed():
    mode, store = make()
    t0, t1 = start(lambda: push(mode, 0)), start(lambda: push(mode, 1))
    wait_until(lambda: mode.status().waiting_for == (2,))
    t0.join(0.1)
    assert t0.is_alive() and t1.is_alive()
    assert store.version == 0
    assert_values(store, W0)
    assert push(mode, 2).version == 1
    finish(t0, t1)
    assert t0.result.version == t1.result.version == 1


def test_no_push_of_a_round_is_answered_before_the_round_is_applied():
    mode, store = make()
    applied = threading.Event()
    apply_all = store.apply_all

    def slow_apply_all(grads, key=None):
        time.sleep(0.05)  # widen the window in which an early answer would show
        version = apply_all(grads, key)
        applied.set()
        return version

    store.apply_all = slow_apply_all

    def push_and_look(w):
        result = push(mode, w)
        return result, applied.is_set(), snapshot(store)

    workers = [start(lambda w=w: push_and_look(w)) for w in range(3)]
    finish(*workers)
    expected = (1, {n: a.tobytes() for n, a in AFTER_ONE_ROUND.items()})
    for w in workers:
        assert w.error is None
        result, was_applied, seen = w.result
        assert was_applied and result.version == 1
        assert seen == expected  # the new version and its values are visible on return


def test_a_round_gives_the_same_bits_whatever_the_order_of_arrival(rule):
    # Products 2**22, 1/4 and -2**22 (weights 1/4, 1/4, 1/2): a float32 fold in arrival order
    # keeps the 1/4 in one order and loses it in another. A held round sums in worker-id order
    # (2**22 + 1/4 rounds to 2**22: a mean of 0); the exact mean is 1/4 in every order.
    grads = [{"w": f32(2**24)}, {"w": f32(1)}, {"w": f32(-(2**23))}]
    for order in itertools.permutations(range(3)):
        mode, store = make(variables={"w": f32(0)}, lr=1.0)
        first, second, last = order
        threads = [start(lambda w=first: push(mode, w, grads=grads[w]))]
        wait_until(lambda: mode.status().waiting_for == tuple(w for w in range(3) if w != first))
        threads.append(start(lambda w=second: push(mode, w, grads=grads[w])))
        wait_until(lambda: mode.status().waiting_for == (last,))
        push(mode, last, grads=grads[last])
        finish(*threads)
        assert_values(store, {"w": f32(0.0 if rule == "held" else -0.25)})


def test_a_waiting_push_holds_no_gradient_once_folded(monkeypatch):
    # Beyond HELD_BYTES, memory that does not grow with the workers: the round keeps its sum,
    # not the pushes.
    monkeypatch.setattr(aggregation, "HELD_BYTES", 0)
    mode, _ = make()
    folded = []
    t = start(lambda: mode.submit(Push(worker_id=1, step=0, base_version=0, batch_size=1, gradients=GRADS[1]),
                                consumed=lambda: folded.append(1)).result(JOIN))
    wait_until(lambda: mode.status().waiting_for == (0, 2))
    assert folded == [1]
    assert all(not p.gradients for p in mode._book.peek())
    complete_round_rest = [start(lambda: push(mode, 2, grads=GRADS[2]))]
    wait_until(lambda: mode.status().waiting_for == (0,))
    push(mode, 0, grads=GRADS[0])
    finish(t, *complete_round_rest)


# -- refused pushes ------------------------------------------------------------------


def complete_round(mode, step=0, grads=GRADS):
    workers = [start(lambda w=w: push(mode, w, step=step, grads=grads[w])) for w in range(1, 3)]
    wait_until(lambda: mode.status().waiting_for == (0,))
    result = push(mode, 0, step=step, grads=grads[0])
    finish(*workers)
    assert all(w.error is None for w in workers)
    return result


def test_retried_push_for_a_completed_round_is_replayed_not_applied_again():
    mode, store = make()
    first = complete_round(mode)
    before, status = snapshot(store), mode.status()
    again = push(mode, 0, step=0, base=0)  # the reply was lost; the worker retries
    assert again.replayed and (again.version, again.next_step) == (first.version, 1)
    assert snapshot(store) == before
    assert mode.status() == status
    assert mode.stats.replayed == 1


def test_late_push_for_a_round_it_was_not_part_of_is_rejected_and_changes_nothing():
    mode, store = make()
    for step in range(17):  # older than the rounds remembered for replays
        complete_round(mode, step=step)
    before, status = snapshot(store), mode.status()
    with pytest.raises(StaleRound, match="worker 0 for step 0 is late: round 0 already completed"):
        push(mode, 0, step=0, base=0)
    assert snapshot(store) == before
    assert mode.status() == status


def test_push_for_a_future_round_is_rejected_and_changes_nothing():
    mode, store = make()
    before = snapshot(store)
    with pytest.raises(FutureRound, match="worker 1 for step 1 is early: round 0 has not completed"):
        push(mode, 1, step=1, base=0)
    assert snapshot(store) == before
    assert mode.status().waiting_for == ()
    assert complete_round(mode).version == 1
    assert_values(store, AFTER_ONE_ROUND)


def test_retried_push_while_the_first_waits_gets_the_same_answer_and_applies_once():
    mode, store = make()
    t0 = start(lambda: push(mode, 0))
    wait_until(lambda: mode.status().waiting_for == (1, 2))
    # A retry (its content is ignored: the key is worker and step) joins the first push's wait.
    retry = start(lambda: push(mode, 0, grads={"w": f32(1000, 1000, 1000, 1000), "b": np.array([1000.0])}))
    t1 = start(lambda: push(mode, 1))
    wait_until(lambda: mode.status().waiting_for == (2,))
    push(mode, 2)
    finish(t0, retry, t1)
    assert t0.error is None and retry.error is None
    assert t0.result == retry.result and t0.result.version == 1
    assert_values(store, AFTER_ONE_ROUND)


@pytest.mark.parametrize("base", [1, 7])
def test_push_computed_on_another_version_is_rejected_and_changes_nothing(base):
    mode, store = make()
    before = snapshot(store)
    with pytest.raises(InvalidArgument, match=re.escape(
        f"worker 2 computed its gradient for round 0 on version {base}, but sync round 0 is on version 0; pull first"
    )):
        push(mode, 2, base=base)
    assert snapshot(store) == before
    assert mode.status().waiting_for == ()
    complete_round(mode)
    with pytest.raises(InvalidArgument, match="pull first"):
        push(mode, 0, step=1, base=0)  # the right round, but the old parameters


def test_worker_id_outside_the_cluster_is_rejected():
    mode, _ = make()
    with pytest.raises(InvalidArgument, match=r"worker id 3 is outside 0\.\.2"):
        mode.submit(Push(3, 0, 0, 1, GRADS[0])).result(JOIN)
    assert mode.status().waiting_for == ()


def test_push_of_an_unregistered_worker_is_rejected_by_the_server():
    ps = ParameterServer(mode="sync", num_workers=3, barrier_timeout=JOIN)
    ps.register(0, 3)
    ps.initialize(0, W0, OptimizerSpec("sgd", learning_rate=LR))
    with pytest.raises(UnknownWorker, match="worker 1 is not registered"):
        ps.submit(Push(1, 0, 0, 1, GRADS[1])).result(JOIN)
    assert ps.status().waiting_for == ()


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_barrier_timeout_must_be_positive(timeout):
    with pytest.raises(InvalidArgument, match="barrier_timeout must be > 0"):
        make(barrier_timeout=timeout)


def test_round_without_examples_fails_for_every_worker_and_changes_nothing():
    mode, store = make()
    before = snapshot(store)
    workers = [start(lambda w=w: push(mode, w, size=0)) for w in range(1, 3)]
    wait_until(lambda: mode.status().waiting_for == (0,))
    with pytest.raises(InvalidArgument, match="at least one example"):
        push(mode, 0, size=0)
    finish(*workers)
    assert all(isinstance(w.error, InvalidArgument) for w in workers)
    assert snapshot(store) == before
    assert mode.status().round == 0
    assert complete_round(mode).version == 1
    assert_values(store, AFTER_ONE_ROUND)


# -- the barrier timeout -------------------------------------------------------------


def test_barrier_timeout_names_the_missing_worker_and_changes_nothing():
    clock = FakeClock()  # both pushes surely join the round before it times out
    mode, store = make(barrier_timeout=0.3, clock=clock)
    mode.members.register(1, 3, name="host:77")
    before = snapshot(store)
    t0 = start(lambda: push(mode, 0))
    t2 = start(lambda: push(mode, 2))
    wait_until(lambda: mode.status().waiting_for == (1,))
    clock.now = 0.3
    mode.expire_overdue()  # the server's ticker
    finish(t0, t2)
    for t in (t0, t2):
        assert isinstance(t.error, BarrierTimeout)
        assert t.error.missing == (1,)
        message = str(t.error)
        assert "sync round 0 timed out after 0.3 s waiting for worker(s) 1 (host:77)" in message
        assert "pushed: 0, 2" in message
        assert "round discarded, parameters unchanged at version 0" in message
    assert snapshot(store) == before
    status = mode.status()
    assert (status.round, status.waiting_for, status.rounds_timed_out) == (0, (), 1)


def test_barrier_timeout_lists_every_missing_worker_on_the_real_clock():
    mode, _ = make(barrier_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeout, match=r"waiting for worker\(s\) 0, 2; pushed: 1;") as e:
        ticking(mode.submit(Push(worker_id=1, step=0, base_version=0, batch_size=1, gradients=GRADS[1])),
                mode.expire_overdue)
    assert time.monotonic() - t0 >= 0.3
    assert e.value.missing == (0, 2)


def test_after_a_barrier_timeout_every_worker_may_push_the_same_step_again():
    clock = FakeClock()
    mode, store = make(barrier_timeout=0.3, clock=clock)
    huge = {"w": f32(1000, 1000, 1000, 1000), "b": np.array([1000.0])}
    t0 = start(lambda: push(mode, 0, grads=huge))
    t1 = start(lambda: push(mode, 1, grads=huge))
    wait_until(lambda: mode.status().waiting_for == (2,))
    clock.now = 0.3
    mode.expire_overdue()
    finish(t0, t1)
    assert isinstance(t0.error, BarrierTimeout) and isinstance(t1.error, BarrierTimeout)
    assert complete_round(mode).version == 1  # the clock stands still: no second timeout
    assert_values(store, AFTER_ONE_ROUND)  # the timed-out gradient was thrown away


def test_round_times_out_barrier_timeout_after_its_first_push_not_its_last():
    clock = FakeClock()
    mode, store = make(barrier_timeout=0.3, clock=clock)
    t0 = start(lambda: push(mode, 0))  # deadline 0.3
    wait_until(lambda: mode.status().waiting_for == (1, 2))
    clock.now = 0.2
    t1 = start(lambda: push(mode, 1))  # its own deadline would be 0.5
    wait_until(lambda: mode.status().waiting_for == (2,))
    clock.now = 0.31  # past the first push's deadline, before the second's
    mode.expire_overdue()
    finish(t0, t1)
    assert isinstance(t0.error, BarrierTimeout) and isinstance(t1.error, BarrierTimeout)
    assert t0.error.missing == t1.error.missing == (2,)
    assert store.version == 0


# -- generations ----------------------------------------------------------------------


def test_fast_worker_pushing_the_next_round_does_not_disturb_the_waiters_of_the_last():
    mode, store = make()
    t0, t1 = mode.submit(push_of(0)), mode.submit(push_of(1))
    assert push(mode, 2).version == 1
    fast = mode.submit(push_of(2, step=1))  # the fast worker is already in round 1, as
    assert (mode.status().round, mode.status().waiting_for) == (1, (0, 1))  # 0 and 1 are answered
    assert t0.result(JOIN).version == t1.result(JOIN).version == 1  # round 0's answer, not round 1's
    assert not fast.done()  # round 0's end did not release round 1
    t0b = mode.submit(push_of(0, step=1))
    assert mode.status().waiting_for == (1,)
    assert push(mode, 1, step=1).version == 2
    assert fast.result(JOIN).version == t0b.result(JOIN).version == 2
    # Two identical rounds: the mean step is applied twice.
    assert_values(store, {"w": f32(1 - 2, 2 - 2, 3 - 3, 4 - 0), "b": np.array([10.0 - 2.0])})


def test_waiter_of_a_timed_out_round_fails_even_when_the_same_round_has_restarted():
    clock = FakeClock()
    mode, store = make(barrier_timeout=0.3, clock=clock)
    t0 = mode.submit(push_of(0))
    t1 = mode.submit(push_of(1))
    clock.now = 1.0  # worker 0's deadline has passed: the ticker aborts generation 0
    mode.expire_overdue()
    with pytest.raises(BarrierTimeout):
        t0.result()
    # Round 0 starts over (same number, new generation) before worker 1 looks at its ticket.
    t2 = mode.submit(push_of(2))
    assert mode.status().waiting_for == (0, 1)
    with pytest.raises(BarrierTimeout) as e:
        t1.result()
    assert e.value.missing == (2,)
    assert not t2.done()  # worker 2 waits for the new generation of round 0
    t0b = mode.submit(push_of(0))
    assert mode.status().waiting_for == (1,)
    assert push(mode, 1).version == 1
    assert t2.result(JOIN).version == t0b.result(JOIN).version == 1
    assert_values(store, AFTER_ONE_ROUND)


# -- many rounds ---------------------------------------------------------------------

N, ROUNDS = 4, 50
SHAPES = {"k": (5, 3), "b": (3,)}


def batch_size(worker, step):
    return 1 + (7 * worker + 3 * step) % 5  # uneven, and changing from round to round


def gradient(worker, step, values):
    """A gradient that depends on the pulled parameters, so a wrong pull shows."""
    rng = np.random.default_rng([worker, step])
    return {
        name: (values[name] * np.float32(0.1) + rng.standard_normal(shape).astype(np.float32))
        for name, shape in SHAPES.items()
    }


def sequential(w0, lr, held):
    """The same training, one round after another, in plain NumPy."""
    w = dict(w0)
    for step in range(ROUNDS):
        grads = [gradient(k, step, w) for k in range(N)]
        sizes = [batch_size(k, step) for k in range(N)]
        total = sum(sizes)
        for name in w:
            if held:  # the weighted sum in worker-id order, each product and sum rounded
                weights = [np.float32(b / total) for b in sizes]
                mean = grads[0][name] * weights[0]
                for g, weight in zip(grads[1:], weights[1:]):
                    mean = mean + g[name] * weight
            else:  # the exact weighted mean, in rationals, rounded once (core.modes.aggregation)
                mean = np.array([_round_exact(sum(Fraction(b) * Fraction(float(g[name].flat[i]))
                                                  for g, b in zip(grads, sizes)) / total, np.dtype(np.float32))
                                 for i in range(w[name].size)], np.float32).reshape(w[name].shape)
            w[name] = w[name] - mean * np.float32(lr)
    return w


@pytest.fixture(params=["held", "folded"])
def rule(request, monkeypatch):
    """A round within ``aggregation.HELD_BYTES`` (held whole), or beyond it (folded exactly)."""
    if request.param == "folded":
        monkeypatch.setattr(aggregation, "HELD_BYTES", 0)
    return request.param


def test_many_rounds_with_threads_equal_the_sequential_computation_bit_for_bit(tight_switching, rule):
    rng = np.random.default_rng(0)
    w0 = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    lr = 0.05
    store = VariableStore()
    store.initialize(w0, OptimizerSpec("sgd", learning_rate=lr))
    mode = SyncMode(store, Membership(N), N, barrier_timeout=JOIN)

    def train(worker):
        pulled = []
        for step in range(ROUNDS):
            version, values = store.read()
            pulled.append((version, {n: a.tobytes() for n, a in values.items()}))
            push = Push(worker, step, version, batch_size(worker, step), gradient(worker, step, values))
            result = mode.submit(push).result(JOIN)
            assert result.version == step + 1
        return pulled

    workers = [start(lambda k=k: train(k)) for k in range(N)]
    finish(*workers, timeout=60)
    assert [w.error for w in workers] == [None] * N
    # Every worker pulled the same parameters at the same version in every round.
    assert all(w.result == workers[0].result for w in workers)
    assert [v for v, _ in workers[0].result] == list(range(ROUNDS))
    expected = sequential(w0, lr, held=rule == "held")
    version, values = store.read()
    assert version == ROUNDS
    for name in SHAPES:
        np.testing.assert_array_equal(values[name].view(np.uint32), expected[name].view(np.uint32))
    assert mode.stats.pushes_applied == N * ROUNDS
    assert mode.stats.examples_applied == sum(batch_size(k, s) for k in range(N) for s in range(ROUNDS))


def test_a_round_any_push_of_which_asks_to_skip_changes_nothing_and_every_reply_says_so():
    """``SKIP_UPDATE``: a Keras loss scale's non-finite gradients on one worker skip the round
    for all, as an all-reduced gradient would; the version counts the round."""
    from ps_common.names import SKIP_UPDATE

    store = VariableStore()
    store.initialize({"w": np.ones(3, np.float32)}, OptimizerSpec("sgd", learning_rate=0.5))
    mode = SyncMode(store, Membership(2), num_workers=2, barrier_timeout=10.0)
    pushes = [Push(w, 0, 0, 2, {"w": np.full(3, 1.0 + w, np.float32)}, metrics={SKIP_UPDATE: np.array([float(w)])})
              for w in range(2)]
    tickets = [mode.submit(p) for p in pushes]
    results = [t.result(5) for t in tickets]
    assert [r.version for r in results] == [1, 1] and store.version == 1
    assert all(float(r.metrics[SKIP_UPDATE][0]) == 1.0 for r in results)
    assert store.read()[1]["w"].tolist() == [1.0, 1.0, 1.0]
    assert store.optimizer_iterations() == 0


def test_a_group_s_round_every_push_of_which_weighs_nothing_and_asks_to_skip_is_skipped_and_the_next_applies():
    """A GAN under ``mixed_float16`` whose discriminator's gradients overflow on every worker:
    each push of that round weighs 0 and asks to skip. The round completes (the version counts
    it, no variable changes), and the next round, the generator's group, applies as usual,
    its optimizer counting its own step alone."""
    from ps_common.names import SKIP_UPDATE

    store = VariableStore()
    sgd = OptimizerSpec("sgd", learning_rate=0.5)
    store.initialize({"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)},
                     OptimizerSpec("sgd", learning_rate=0.5, groups=((("a",), sgd), (("b",), sgd))))
    mode = SyncMode(store, Membership(2), num_workers=2, barrier_timeout=10.0)
    skipped = [mode.submit(Push(w, 0, 0, 0, {"a": np.zeros(2, np.float32)}, metrics={SKIP_UPDATE: np.array([1.0])}))
               for w in range(2)]
    assert [t.result(5).version for t in skipped] == [1, 1]
    applied = [mode.submit(Push(w, 1, 1, 2, {"b": np.full(2, 1.0 + w, np.float32)},
                                metrics={SKIP_UPDATE: np.array([0.0])})) for w in range(2)]
    assert [t.result(5).version for t in applied] == [2, 2]
    values = store.read()[1]
    assert values["a"].tolist() == [1.0, 1.0] and values["b"].tolist() == [0.25, 0.25]  # 1 - 0.5 * 1.5
    assert (store.optimizer_iterations(["a"]), store.optimizer_iterations(["b"])) == (0, 1)


def test_a_round_within_held_bytes_holds_each_push_whole_until_it_completes():
    mode, store = make()
    t = start(lambda: push(mode, 1, grads=GRADS[1]))
    wait_until(lambda: mode.status().waiting_for == (0, 2))
    assert [p.gradients is not None and set(p.gradients) for p in mode._book.peek()] == [set(GRADS[1])]
    assert not mode._sum.count  # nothing folded: summed in worker-id order at the end
    complete_rest = [start(lambda: push(mode, 2, grads=GRADS[2]))]
    wait_until(lambda: mode.status().waiting_for == (0,))
    push(mode, 0, grads=GRADS[0])
    finish(t, *complete_rest)
    assert_values(store, AFTER_ONE_ROUND)


def test_a_held_push_survives_its_caller_emptying_the_dict_it_passed():
    # The unary service handler clears its request's gradients once submit returns.
    mode, store = make()
    passed = [dict(GRADS[w]) for w in range(3)]
    tickets = []
    for w in (1, 2, 0):
        tickets.append(mode.submit(Push(worker_id=w, step=0, base_version=0, batch_size=SIZES[w],
                                        gradients=passed[w])))
        passed[w].clear()
    assert [t.result(JOIN).version for t in tickets] == [1, 1, 1]
    assert_values(store, AFTER_ONE_ROUND)
