"""Tests of ``submit``: every mode's push without a blocked thread (``core.modes.Ticket``).

    python -m pytest tests/core/test_tickets.py -q

A ticket is settled by whatever ends the wait (the push that fills the round, a
death, ``expire_overdue`` once the time is up), never by a thread of its own: these
tests submit from one thread and settle with a fake clock.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_server.core.broadcast import Broadcasts, BroadcastTimeout
from ps_server.core.errors import BarrierTimeout, WorkerDead
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Push, Ticket
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.modes.ssp_mode import SSPMode
from ps_server.core.store import VariableStore
from ps_server.core.modes.sync_mode import SyncMode
from tests.core.threads import FakeClock


def f32(*xs):
    return np.array(xs, dtype=np.float32)


def sync(num_workers=3, timeout=10.0, clock=None, policy="abort"):
    store = VariableStore()
    store.initialize({"w": f32(0, 0)}, OptimizerSpec("sgd", learning_rate=1.0))
    clock = clock or FakeClock()
    members = Membership(num_workers, clock=clock)
    return SyncMode(store, members, num_workers, timeout, clock=clock, policy=policy), store, clock


def push(worker, step=0, g=None, base=None):
    return Push(worker_id=worker, step=step, base_version=step if base is None else base, batch_size=1,
                gradients={"w": f32(worker + 1, 1) if g is None else g})


def test_a_ticket_is_settled_once_its_callbacks_run_in_the_settling_thread_and_results_are_copies():
    ticket, seen = Ticket(), []
    ticket.add_done_callback(lambda t: seen.append("before"))
    assert not ticket.done()
    assert ticket.settle(ValueError("x")) and not ticket.settle(1)
    ticket.add_done_callback(lambda t: seen.append("after"))
    assert seen == ["before", "after"]
    with pytest.raises(ValueError) as first:
        ticket.result()
    with pytest.raises(ValueError) as second:
        ticket.result()
    assert first.value is not second.value


def test_sync_tickets_wait_without_a_thread_and_all_get_the_rounds_one_version():
    mode, store, _ = sync()
    tickets = [mode.submit(push(w)) for w in (2, 0)]
    assert not any(t.done() for t in tickets) and mode.status().waiting_for == (1,)
    last = mode.submit(push(1))
    assert last.done()
    results = [t.result() for t in tickets + [last]]
    assert {r.version for r in results} == {1} and all(r.next_step == 1 for r in results)
    np.testing.assert_array_equal(store.read()[1]["w"], f32(-2, -1))  # mean of (1,1), (2,1), (3,1)


def test_a_retry_while_waiting_gets_the_same_outcome_and_is_not_applied_twice():
    mode, store, _ = sync(num_workers=2)
    first, again = mode.submit(push(0)), mode.submit(push(0))
    mode.submit(push(1))
    assert first.result() == again.result()
    np.testing.assert_array_equal(store.read()[1]["w"], f32(-1.5, -1))


def test_a_round_out_of_time_ends_at_expire_overdue_with_barrier_timeout_and_changes_nothing():
    mode, store, clock = sync(timeout=10.0)
    waiting = mode.submit(push(0))
    clock.now += 9.9
    mode.expire_overdue()
    assert not waiting.done()
    clock.now += 0.2
    mode.expire_overdue()
    with pytest.raises(BarrierTimeout, match="waiting for worker"):
        waiting.result()
    assert store.read()[0] == 0 and mode.status().rounds_timed_out == 1


def test_a_dead_worker_settles_the_waiting_tickets_under_policy_abort():
    mode, _, _ = sync()
    waiting = [mode.submit(push(w)) for w in (0, 1)]
    mode.workers_died([2])
    for t in waiting:
        with pytest.raises(WorkerDead):
            t.result()


def test_ssp_tickets_are_released_when_the_slowest_worker_catches_up_or_time_runs_out():
    store = VariableStore()
    store.initialize({"w": f32(0, 0)}, OptimizerSpec("sgd", learning_rate=1.0))
    clock = FakeClock()
    mode = SSPMode(store, Membership(2, clock=clock), staleness_bound=0, barrier_timeout=10.0, clock=clock)
    ahead = mode.submit(push(0, step=0, base=0))
    assert not ahead.done()  # worker 1 has not finished step 0
    mode.submit(push(1, step=0, base=1))
    assert ahead.done() and ahead.result().version == 1
    stuck = mode.submit(push(0, step=1, base=2))
    clock.now += 11
    mode.expire_overdue()
    with pytest.raises(BarrierTimeout, match="may not start step 2"):
        stuck.result()
    assert store.read()[0] == 3  # every push was applied; only the wait failed


def test_a_broadcast_ticket_is_settled_by_the_chiefs_post_or_by_its_timeout():
    clock = FakeClock()
    board = Broadcasts(timeout_limit=30.0, clock=clock)
    waiting, late = board.submit_wait("k", 5.0), board.submit_wait("never", 5.0)
    board.post("k", b"v")
    assert waiting.result() == b"v" and not late.done()
    clock.now += 6
    board.expire_overdue()
    with pytest.raises(BroadcastTimeout):
        late.result()


def test_parameter_server_submit_records_the_push_once_its_round_ends():
    core = ParameterServer("sync", 2, barrier_timeout=10.0)
    for w in range(2):
        core.register(w, 2, f"w{w}")
    core.initialize(0, {"w": f32(0, 0)}, OptimizerSpec("sgd", learning_rate=1.0))
    first = core.submit(push(0))
    second = core.submit(push(1))
    assert first.result().version == second.result().version == 1
    assert [r.last_step for r in core.members.snapshot()] == [0, 0]
