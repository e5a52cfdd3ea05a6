"""Liveness and exactly-once: leases, dead-worker policies, backup workers, replays.

    python -m pytest tests/core/test_liveness.py -q

Each test quotes (or paraphrases) the guarantee it checks from the module
docstrings of ``membership``, ``parameter_server``, ``sync_mode`` and
``async_mode``. Time is a fake clock the test moves by hand; the lease check is
``ParameterServer.tick()`` called by the test, as the server's ticker thread
would. Every expected parameter is computed by hand: SGD with learning rate 1/2
and batch shares that are exact in binary. Every wait is bounded: threads are
joined with a timeout and then asserted dead; polls give up after a few seconds.
"""

import logging
import re
import threading
import time

import numpy as np
import pytest

from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.errors import StaleRound, UnknownWorker, WorkerDead
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.store import VariableStore
from tests.core.threads import FakeClock, JOIN, finish, start, wait_until

PROMPT = 5.0  # a waiter woken by the lease check returns well within this (the barrier timeout is JOIN)
LEASE = 10.0



def f32(*xs):
    return np.array(xs, dtype=np.float32)


LR = 0.5
W0 = {"w": f32(8, 8, 8, 8)}
G = [f32(4, 0, 0, 8), f32(0, 4, 0, -8), f32(0, 0, 4, 4)]  # worker k's gradient


def server(num_workers=3, policy="abort", clock=None, barrier_timeout=JOIN, lease_timeout=LEASE,
           replacement_timeout=60.0, replicas=0, mode="sync"):
    """A ParameterServer with every worker registered (as "host:k") and W0 initialized."""
    ps = ParameterServer(mode, num_workers, barrier_timeout=barrier_timeout, lease_timeout=lease_timeout,
                         dead_worker_policy=policy, replacement_timeout=replacement_timeout,
                         replicas_to_aggregate=replicas, clock=clock or FakeClock())
    for k in range(num_workers):
        ps.register(k, num_workers, name=f"host:{k}")
    ps.initialize(0, W0, OptimizerSpec("sgd", learning_rate=LR))
    return ps


def push(ps, worker, size, step=0, base=None, grad=None):
    return ps.submit(Push(worker_id=worker, step=step, base_version=step if base is None else base,
                          batch_size=size, gradients={"w": G[worker] if grad is None else grad})).result(JOIN)


def in_thread(ps, worker, size, step=0, **kwargs):
    return start(lambda: push(ps, worker, size, step, **kwargs))


def snapshot(ps):
    version, values = ps.store.read()
    return version, {n: a.tobytes() for n, a in values.items()}


def assert_w(ps, *expected):
    np.testing.assert_array_equal(ps.store.read()[1]["w"], f32(*expected))


def declare_dead(ps, clock, dead, alive, at):
    """Move the clock to ``at``; the live workers heartbeat (as their heartbeat threads do); tick."""
    clock.now = at
    for w in alive:
        ps.heartbeat(w)
    assert ps.tick() == list(dead)



# -- leases (membership) ---------------------------------------------------------------
# "expire declares dead every registered, not-yet-left worker whose lease ran out;
#  from then on its calls are refused (UnknownWorker, "declared dead") until it
#  registers again."


def test_lease_runs_out_strictly_after_lease_timeout_of_silence_not_at_it():
    clock = FakeClock()
    members = Membership(3, lease_timeout=LEASE, clock=clock)
    members.register(1, 3)
    clock.now = LEASE  # exactly the lease timeout of silence: still alive
    assert members.expire() == []
    assert not members.is_dead(1)
    clock.now = LEASE + 2**-10
    assert members.expire() == [1]
    assert members.is_dead(1)
    record = members.snapshot()[0]
    assert (record.dead, record.dead_since) == (True, LEASE + 2**-10)
    assert members.expire() == []  # only newly dead workers are returned


def test_every_call_and_heartbeat_renews_the_lease():
    clock = FakeClock()
    members = Membership(2, lease_timeout=LEASE, clock=clock)
    members.register(0, 2)
    members.register(1, 2)
    clock.now = 8.0
    members.heartbeat(0)
    members.require(1)
    clock.now = 16.0
    members.record_push(1, step=3)  # a push renews it too
    clock.now = 18.0
    assert members.expire() == []
    clock.now = 18.5
    assert members.expire() == [0]
    clock.now = 26.5
    assert members.expire() == [1]


def test_calls_of_a_dead_worker_are_refused_as_declared_dead_until_it_registers_again():
    clock = FakeClock()
    members = Membership(3, lease_timeout=LEASE, clock=clock)
    members.register(2, 3)
    clock.now = 11.0
    assert members.expire() == [2]
    message = re.escape("worker 2 was declared dead (no call or heartbeat for more than 10 s); "
                        "register again to rejoin")
    for call in (members.require, members.heartbeat, members.leave):
        with pytest.raises(UnknownWorker, match=message):
            call(2)
    members.register(2, 3)  # a restarted or replacement worker revives the index
    assert not members.is_dead(2)
    members.require(2)
    clock.now = 21.0  # the new lease counts from the registration at 11
    assert members.expire() == []
    clock.now = 21.5
    assert members.expire() == [2]


def test_a_worker_that_left_never_expires():
    clock = FakeClock()
    members = Membership(2, lease_timeout=LEASE, clock=clock)
    members.register(0, 2)
    members.register(1, 2)
    members.leave(1)
    clock.now = 1e6
    assert members.expire() == [0]
    assert not members.is_dead(1)
    members.require(1)  # it is not dead, so its calls still work


def test_an_index_that_never_registered_is_never_declared_dead():
    clock = FakeClock()
    members = Membership(3, lease_timeout=LEASE, clock=clock)
    members.register(0, 3)
    clock.now = 100.0
    assert members.expire() == [0]
    assert not members.is_dead(1) and not members.is_dead(2)


# -- ParameterServer.tick --------------------------------------------------------------


def test_tick_declares_silent_workers_dead_once_logs_them_and_the_server_refuses_their_calls(caplog):
    clock = FakeClock()
    ps = server(num_workers=3, clock=clock)
    clock.now = 5.0
    ps.heartbeat(0)
    clock.now = 10.5
    assert ps.tick() == [1, 2]  # silent since 0; worker 0 only since 5
    clock.now = 15.5
    with caplog.at_level(logging.WARNING, logger="ps_server.core"):
        assert ps.tick() == [0]
    assert "worker(s) 0 (host:0) declared dead: no call or heartbeat for more than 10 s" in caplog.text
    assert ps.tick() == []
    assert [r.dead for r in ps.status().workers] == [True, True, True]
    with pytest.raises(UnknownWorker, match="worker 0 was declared dead"):
        ps.pull(0)
    with pytest.raises(UnknownWorker, match="worker 0 was declared dead"):
        push(ps, 0, 1)
    ps.pull()  # a pull without a worker id (tools, the chief's status page) needs no lease


def test_tick_applies_the_dead_worker_policy_of_the_mode():
    clock = FakeClock()
    ps = server(num_workers=2, policy="shrink", clock=clock)
    declare_dead(ps, clock, dead=[1], alive=[0], at=11.0)
    assert ps.status().active_workers == (0,)
    assert push(ps, 0, 1).contributors == 1  # the shrunk cluster needs only worker 0


def test_async_worker_declared_dead_registers_again_and_carries_on_with_its_steps():
    clock = FakeClock()
    ps = server(num_workers=2, mode="async", clock=clock)
    push(ps, 1, 1, step=0)
    declare_dead(ps, clock, dead=[1], alive=[0], at=11.0)
    assert push(ps, 0, 1, step=0, base=1).version == 2  # nothing waits for the dead worker
    with pytest.raises(UnknownWorker, match="worker 1 was declared dead"):
        push(ps, 1, 1, step=1, base=2)
    assert ps.store.version == 2
    ps.register(1, 2)
    assert push(ps, 1, 1, step=1, base=2).version == 3
    assert_w(ps, 8 - 2, 8 - 4, 8, 8 + 4)  # (G0 + 2 G1) / 2 = [2, 4, 0, -4]


# -- policy abort -----------------------------------------------------------------------
# "abort ends the round at once with WorkerDead for every waiter (and for new
#  pushes while it stays dead)"


def test_abort_policy_fails_the_waiters_as_soon_as_the_lease_check_declares_a_needed_worker_dead():
    clock = FakeClock()
    ps = server(num_workers=3, policy="abort", clock=clock)  # barrier timeout JOIN: never reached
    before = snapshot(ps)
    t0, t1 = in_thread(ps, 0, 1), in_thread(ps, 1, 1)
    wait_until(lambda: ps.status().waiting_for == (2,))
    began = time.monotonic()
    declare_dead(ps, clock, dead=[2], alive=[0, 1], at=11.0)
    finish(t0, t1, timeout=PROMPT)
    assert time.monotonic() - began < PROMPT < JOIN
    for t in (t0, t1):
        assert isinstance(t.error, WorkerDead), t.error
        assert t.error.dead == (2,)
        message = str(t.error)
        assert "sync round 0 cannot complete: worker(s) 2 (host:2) died (no heartbeat for more than 10 s)" in message
        assert "dead-worker policy abort" in message
        assert "parameters unchanged at version 0" in message
    assert snapshot(ps) == before
    status = ps.status()
    assert (status.round, status.waiting_for, status.rounds_aborted, status.pushes_applied) == (0, (), 1, 0)


def test_abort_policy_refuses_new_pushes_at_once_while_the_needed_worker_stays_dead():
    clock = FakeClock()
    ps = server(num_workers=3, policy="abort", clock=clock)
    before = snapshot(ps)
    declare_dead(ps, clock, dead=[2], alive=[0, 1], at=11.0)
    assert ps.status().rounds_aborted == 0  # nobody had pushed: no round to abort
    attempt = in_thread(ps, 0, 1)
    finish(attempt, timeout=PROMPT)  # refused at once, not after a barrier wait
    assert isinstance(attempt.error, WorkerDead) and attempt.error.dead == (2,)
    assert "worker(s) 2 (host:2) died" in str(attempt.error)
    with pytest.raises(UnknownWorker, match="worker 2 was declared dead .* register again to rejoin"):
        push(ps, 2, 2)  # the dead worker's own push, from a process that was only slow
    assert snapshot(ps) == before
    assert ps.status().waiting_for == ()


def test_abort_policy_rounds_work_again_once_the_dead_worker_registers_again():
    clock = FakeClock()
    ps = server(num_workers=3, policy="abort", clock=clock)
    t0, t1 = in_thread(ps, 0, 1), in_thread(ps, 1, 1)
    wait_until(lambda: ps.status().waiting_for == (2,))
    declare_dead(ps, clock, dead=[2], alive=[0, 1], at=11.0)
    finish(t0, t1, timeout=PROMPT)
    assert isinstance(t0.error, WorkerDead) and isinstance(t1.error, WorkerDead)
    assert ps.register(2, 3, name="host:2b").round == 0  # the restarted worker starts at round 0
    t0, t1 = in_thread(ps, 0, 1), in_thread(ps, 1, 1)
    wait_until(lambda: ps.status().waiting_for == (2,))
    result = push(ps, 2, 2)
    finish(t0, t1)
    assert (t0.error, t1.error) == (None, None)
    assert (result.version, result.contributors) == (1, 3)
    # Shares 1/4, 1/4, 1/2: mean [1, 0, 0, 2] + [0, 1, 0, -2] + [0, 0, 2, 2] = [1, 1, 2, 2].
    assert_w(ps, 7.5, 7.5, 7, 7)  # only the full round was applied, once


def test_abort_policy_with_backup_workers_goes_on_while_enough_live_workers_remain():
    clock = FakeClock()
    ps = server(num_workers=3, policy="abort", replicas=2, clock=clock)
    declare_dead(ps, clock, dead=[2], alive=[0, 1], at=11.0)
    t0 = in_thread(ps, 0, 1)  # 0 and 1 are still two: the round does not need 2
    wait_until(lambda: ps.status().waiting_for == (1, 2))
    result = push(ps, 1, 3)
    finish(t0)
    assert t0.error is None and t0.result.version == result.version == 1
    # Shares 1/4, 3/4: mean [1, 0, 0, 2] + [0, 3, 0, -6] = [1, 3, 0, -4].
    assert_w(ps, 7.5, 6.5, 8, 10)


# -- policy wait --------------------------------------------------------------------------
# "wait keeps the round open until a replacement registers with that index, up to
#  replacement_timeout after the death, then aborts (a replacement that registers
#  in time has a whole barrier_timeout to push)"
#
# Small times: the waiter re-reads the fake clock whenever its (real) wait of
# "what is left" runs out, so these tests last a few tenths of a second.
BARRIER, SHORT_LEASE, REPLACEMENT = 0.2, 0.1, 0.5


def wait_server(clock):
    return server(num_workers=2, policy="wait", clock=clock, barrier_timeout=BARRIER,
                  lease_timeout=SHORT_LEASE, replacement_timeout=REPLACEMENT)


def test_wait_policy_keeps_the_round_open_past_the_barrier_timeout_and_a_replacement_completes_it():
    clock = FakeClock()
    ps = wait_server(clock)
    t0 = in_thread(ps, 0, 1)  # round 0 starts at 0: its barrier deadline is 0.2
    wait_until(lambda: ps.status().waiting_for == (1,))
    declare_dead(ps, clock, dead=[1], alive=[0], at=0.15)  # replacement due by 0.65
    clock.now = 0.3  # past the barrier timeout
    t0.join(0.4)  # longer than the waiter's real wait of what is left
    assert t0.is_alive(), t0.error
    assert ps.status().waiting_for == (1,)
    reg = ps.register(1, 2, name="replacement")
    assert reg.round == 0
    t0.join(0.3)  # the round's deadline is now 0.3 + 0.2, not the passed 0.2
    assert t0.is_alive(), t0.error
    result = push(ps, 1, 3, grad=f32(0, 4, 0, -8))
    finish(t0)
    assert t0.error is None and t0.result == result
    assert (result.version, result.contributors) == (1, 2)
    # Shares 1/4, 3/4: mean [1, 0, 0, 2] + [0, 3, 0, -6] = [1, 3, 0, -4].
    assert_w(ps, 7.5, 6.5, 8, 10)
    assert ps.status().rounds_aborted == 0


def test_wait_policy_without_a_replacement_aborts_replacement_timeout_after_the_death():
    clock = FakeClock()
    ps = wait_server(clock)
    before = snapshot(ps)
    t0 = in_thread(ps, 0, 1)
    wait_until(lambda: ps.status().waiting_for == (1,))
    declare_dead(ps, clock, dead=[1], alive=[0], at=0.15)
    declare_dead(ps, clock, dead=[], alive=[0], at=0.6)  # past the barrier timeout, before 0.15 + 0.5
    t0.join(0.4)
    assert t0.is_alive(), t0.error
    declare_dead(ps, clock, dead=[], alive=[0], at=0.66)
    finish(t0, timeout=PROMPT)
    assert isinstance(t0.error, WorkerDead), t0.error
    assert t0.error.dead == (1,)
    message = str(t0.error)
    assert "worker(s) 1 (host:1) died" in message
    assert "no replacement registered within 0.5 s (dead-worker policy wait)" in message
    assert snapshot(ps) == before
    status = ps.status()
    assert (status.round, status.waiting_for, status.rounds_aborted, status.rounds_timed_out) == (0, (), 1, 0)


# -- policy shrink ----------------------------------------------------------------------------
# "shrink stops expecting the dead worker and finishes rounds with the live ones,
#  weighted by their batch shares (a worker that registers again is expected again)"
SHRINK_SIZES = [1, 4, 3]  # all three: shares 1/8, 4/8, 3/8; without worker 1: 1/4, 3/4


def test_shrink_policy_completes_the_round_with_the_live_workers_weighted_by_their_batch_shares():
    clock = FakeClock()
    ps = server(num_workers=3, policy="shrink", clock=clock)
    t0, t2 = in_thread(ps, 0, SHRINK_SIZES[0]), in_thread(ps, 2, SHRINK_SIZES[2])
    wait_until(lambda: ps.status().waiting_for == (1,))
    declare_dead(ps, clock, dead=[1], alive=[0, 2], at=11.0)
    finish(t0, t2, timeout=PROMPT)
    assert (t0.error, t2.error) == (None, None)
    assert t0.result == t2.result
    assert (t0.result.version, t0.result.contributors, t0.result.next_step) == (1, 2, 1)
    # Shares 1/4, 3/4: mean [1, 0, 0, 2] + [0, 0, 3, 3] = [1, 0, 3, 5] (a plain mean: [2, 0, 2, 6]).
    assert_w(ps, 7.5, 8, 6.5, 5.5)
    status = ps.status()
    assert (status.active_workers, status.rounds_aborted, status.examples_applied) == ((0, 2), 0, 4)


def test_shrink_policy_later_rounds_need_only_the_live_workers_until_the_dead_one_registers_again():
    clock = FakeClock()
    ps = server(num_workers=3, policy="shrink", clock=clock)
    declare_dead(ps, clock, dead=[1], alive=[0, 2], at=11.0)
    for step in range(2):  # rounds 0 and 1 without worker 1
        t0 = in_thread(ps, 0, SHRINK_SIZES[0], step=step)
        wait_until(lambda: ps.status().waiting_for == (2,))
        assert push(ps, 2, SHRINK_SIZES[2], step=step).contributors == 2
        finish(t0)
        assert t0.error is None
    assert_w(ps, 7, 8, 5, 3)  # [1, 0, 3, 5] / 2, twice
    # Round 2: worker 0 pushes, then worker 1 registers: from then on round 2 expects it.
    t0 = in_thread(ps, 0, SHRINK_SIZES[0], step=2)
    wait_until(lambda: ps.status().waiting_for == (2,))
    assert ps.register(1, 3).round == 2
    assert ps.status().waiting_for == (1, 2)
    assert ps.status().active_workers == (0, 1, 2)
    t2 = in_thread(ps, 2, SHRINK_SIZES[2], step=2)
    wait_until(lambda: ps.status().waiting_for == (1,))
    result = push(ps, 1, SHRINK_SIZES[1], step=2)
    finish(t0, t2)
    assert (t0.error, t2.error) == (None, None)
    assert (result.version, result.contributors) == (3, 3)
    # Shares 1/8, 4/8, 3/8: mean [0.5, 0, 0, 1] + [0, 2, 0, -4] + [0, 0, 1.5, 1.5] = [0.5, 2, 1.5, -1.5].
    assert_w(ps, 6.75, 7, 4.25, 3.75)


def test_shrink_policy_keeps_a_push_the_dead_worker_made_before_it_died():
    # rounds: "A push made by a worker that was deactivated afterwards still counts:
    # it was computed on this round's parameters."
    clock = FakeClock()
    ps = server(num_workers=3, policy="shrink", clock=clock)
    t1 = in_thread(ps, 1, SHRINK_SIZES[1])
    t0 = in_thread(ps, 0, SHRINK_SIZES[0])
    wait_until(lambda: ps.status().waiting_for == (2,))
    declare_dead(ps, clock, dead=[1], alive=[0, 2], at=11.0)
    assert ps.status().waiting_for == (2,)  # 2 is alive and still expected
    result = push(ps, 2, SHRINK_SIZES[2])
    finish(t0, t1)
    assert result.contributors == 3
    assert_w(ps, 8 - 0.25, 8 - 1, 8 - 0.75, 8 + 0.75)  # the full mean [0.5, 2, 1.5, -1.5] times 1/2


# -- backup workers ---------------------------------------------------------------------------
# "Round r waits until ... with backup workers, until the first replicas_to_aggregate
#  pushes arrived"; "a push for a completed round it was not part of ... with backup
#  workers it is answered dropped and counted instead"


def test_backup_workers_round_completes_with_the_first_k_pushes():
    ps = server(num_workers=3, replicas=2)
    t0 = in_thread(ps, 0, 1)
    wait_until(lambda: ps.status().waiting_for == (1, 2))
    result = push(ps, 1, 3)
    finish(t0)
    assert t0.error is None and t0.result == result
    assert (result.version, result.contributors, result.next_step, result.dropped) == (1, 2, 1, False)
    # Shares 1/4, 3/4: mean [1, 0, 0, 2] + [0, 3, 0, -6] = [1, 3, 0, -4].
    assert_w(ps, 7.5, 6.5, 8, 10)


def round_0_completed_without_worker_2():
    """Three workers, backup workers 2 of 3: round 0 completes with workers 0 and 1."""
    ps = server(num_workers=3, replicas=2)
    t0 = in_thread(ps, 0, 1)
    wait_until(lambda: ps.status().waiting_for == (1, 2))
    push(ps, 1, 3)
    finish(t0)
    return ps


def test_late_push_of_a_backup_worker_is_answered_dropped_counted_and_changes_nothing():
    ps = round_0_completed_without_worker_2()
    before, applied = snapshot(ps), ps.status().pushes_applied
    late = push(ps, 2, 2, step=0, base=0, grad=f32(1000, 1000, 1000, 1000))
    assert late.dropped and not late.replayed
    assert (late.next_step, late.version, late.contributors) == (1, 1, 0)  # next_step: the current round
    assert snapshot(ps) == before
    status = ps.status()
    assert (status.pushes_dropped, status.pushes_applied, status.round) == (1, applied, 1)
    assert ps.stats.dropped == 1
    assert [(r.worker_id, r.dropped) for r in status.workers] == [(0, 0), (1, 0), (2, 1)]
    # The dropped worker goes on with round 1 like the others.
    t2 = in_thread(ps, 2, 2, step=1)
    wait_until(lambda: ps.status().waiting_for == (0, 1))
    assert push(ps, 0, 2, step=1).contributors == 2
    finish(t2)
    assert t2.error is None
    # Shares 1/2, 1/2: mean [2, 0, 0, 4] + [0, 0, 2, 2] = [2, 0, 2, 6].
    assert_w(ps, 6.5, 6.5, 7, 7)


def test_a_retried_dropped_push_is_counted_dropped_once_for_its_worker_as_for_the_server():
    ps = round_0_completed_without_worker_2()
    first = push(ps, 2, 2, step=0, base=0)
    again = push(ps, 2, 2, step=0, base=0)  # the reply was lost: the worker sends it again
    assert first.dropped and not first.replayed and again.dropped and again.replayed
    status = ps.status()
    assert (status.pushes_dropped, status.pushes_replayed) == (1, 1)
    assert [(r.worker_id, r.dropped) for r in status.workers] == [(0, 0), (1, 0), (2, 1)]


# -- exactly once ---------------------------------------------------------------------------


def test_sync_replay_of_a_completed_round_returns_the_recorded_answer_and_applies_nothing():
    ps = server(num_workers=2)
    t0 = in_thread(ps, 0, 1)
    wait_until(lambda: ps.status().waiting_for == (1,))
    first = push(ps, 1, 3)
    finish(t0)
    t0 = in_thread(ps, 0, 1, step=1)  # round 1 is collecting when the retry of round 0 arrives
    wait_until(lambda: ps.status().waiting_for == (1,))
    before = snapshot(ps)
    again = push(ps, 1, 3, step=0, base=0, grad=f32(1000, 1000, 1000, 1000))
    assert again.replayed and not again.dropped
    assert (again.version, again.contributors, again.next_step) == (first.version, first.contributors, 1)
    assert snapshot(ps) == before
    status = ps.status()
    assert (status.pushes_replayed, status.pushes_applied, status.waiting_for) == (1, 2, (1,))
    push(ps, 1, 3, step=1)  # the replay did not disturb round 1
    finish(t0)
    assert t0.error is None and t0.result.version == 2
    assert_w(ps, 7, 5, 8, 12)  # [1, 3, 0, -4] / 2, twice


def async_mode():
    store = VariableStore()
    store.initialize(W0, OptimizerSpec("sgd", learning_rate=LR))
    return AsyncMode(store, Membership(2))


def async_push(mode, step, worker=0, base=0, grad=G[0]):
    return mode.submit(Push(worker_id=worker, step=step, base_version=base, batch_size=1,
                            gradients={"w": grad})).result(JOIN)


def test_async_same_worker_and_step_twice_is_applied_once_and_the_second_is_replayed():
    mode = async_mode()
    first = async_push(mode, step=5)
    again = async_push(mode, step=5, base=1, grad=f32(1000, 1000, 1000, 1000))
    assert not first.replayed and again.replayed
    assert (again.version, again.staleness, again.next_step) == (first.version, first.staleness, 6) == (1, 0, 6)
    assert mode.store.version == 1
    np.testing.assert_array_equal(mode.store.read()[1]["w"], f32(6, 8, 8, 4))
    assert (mode.stats.pushes_applied, mode.stats.replayed) == (1, 1)


def test_async_push_of_an_older_step_is_stale_and_changes_nothing():
    mode = async_mode()
    async_push(mode, step=5)
    before = mode.store.version, mode.store.read()[1]["w"].tobytes()
    with pytest.raises(StaleRound, match="worker 0 already pushed step 5; step 4 is older"):
        async_push(mode, step=4, base=1)
    assert (mode.store.version, mode.store.read()[1]["w"].tobytes()) == before
    assert async_push(mode, step=6, worker=0, base=1).version == 2  # later steps go on


def test_async_steps_are_per_worker():
    mode = async_mode()
    async_push(mode, step=5, worker=0)
    assert not async_push(mode, step=0, worker=1, grad=G[1]).replayed  # worker 1 has its own steps
    assert mode.store.version == 2


DUPLICATE_RUNS = 300


def test_concurrent_duplicate_async_pushes_of_the_same_worker_and_step_apply_exactly_once(tight_switching):
    for run in range(DUPLICATE_RUNS):
        mode = async_mode()
        together = threading.Barrier(2, timeout=JOIN)

        def duplicate():
            together.wait()
            return async_push(mode, step=0)

        a, b = start(duplicate), start(duplicate)
        finish(a, b)
        assert (a.error, b.error) == (None, None), run
        assert sorted([a.result.replayed, b.result.replayed]) == [False, True], run
        assert a.result.version == b.result.version == 1, run
        assert mode.store.version == 1, run
        np.testing.assert_array_equal(mode.store.read()[1]["w"], f32(6, 8, 8, 4), err_msg=f"run {run}")
        assert (mode.stats.pushes_applied, mode.stats.replayed) == (1, 1), run
