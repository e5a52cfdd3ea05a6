"""Tests of ps_server.core.modes.ssp_mode (bounded staleness) and the async stale-gradient policies.

    python -m pytest tests/core/test_ssp_mode.py -q

The bound is checked from the server's own records (``SSPMode.records``: how far
ahead of the slowest participating worker each applied push was), with worker
threads that sleep random times, one of them much slower than the others.
"""

import random
import threading
import time

import numpy as np
import pytest

from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.errors import BarrierTimeout, InvalidArgument
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.modes.ssp_mode import SSPMode
from ps_server.core.store import VariableStore
from tests.core.threads import FakeClock, JOIN, ticking

GRAD = {"w": np.ones(4, np.float32)}


def cluster(n, bound, barrier_timeout=30.0, members=None, **kwargs):
    store = VariableStore()
    store.initialize({"w": np.zeros(4, np.float32)}, OptimizerSpec("sgd", learning_rate=0.5))
    members = members or Membership(n, lease_timeout=3600.0)
    for w in range(n):
        members.register(w, n)
    return store, members, SSPMode(store, members, bound, barrier_timeout, **kwargs)


def push(mode, worker, step, base_version=0):
    """A worker's push, answered once it may start its next step: the mode's waits end as in
    the server, at its ticker's ``expire_overdue`` or at another worker's push."""
    return ticking(mode.submit(Push(worker_id=worker, step=step, base_version=base_version, batch_size=1,
                                    gradients=GRAD)), mode.expire_overdue)


def run_workers(store, mode, n, steps, delays, seed=0):
    """n threads, each pulling, 'computing' (a random sleep scaled by delays[w]) and pushing
    `steps` steps. Returns {worker: [version pulled at the start of each step]}."""
    pulled = {w: [] for w in range(n)}
    errors = []

    def work(w):
        rng = random.Random(seed * 100 + w)
        try:
            for step in range(steps):
                version, _ = store.read()
                pulled[w].append(version)
                time.sleep(rng.uniform(0, 0.002) * delays[w])
                push(mode, w, step, version)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return pulled


@pytest.mark.parametrize("bound", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_no_push_is_ever_more_than_the_bound_ahead_of_the_slowest_worker(bound, seed):
    n, steps = 3, 25
    store, _, mode = cluster(n, bound)
    run_workers(store, mode, n, steps, delays=[1, 1, 6], seed=seed)
    assert store.version == n * steps  # every push applied once
    aheads = [r.ahead for r in mode.records]
    assert len(aheads) == n * steps
    assert max(aheads) <= bound, [r for r in mode.records if r.ahead > bound]
    assert mode.status().max_ahead == max(aheads)
    if bound:
        # The fast workers did run ahead (the slow one sleeps 6x longer): the bound was what held them.
        assert max(aheads) == bound


def test_bound_zero_is_lockstep_each_step_reads_every_update_of_the_step_before():
    n, steps = 3, 15
    store, _, mode = cluster(n, 0)
    pulled = run_workers(store, mode, n, steps, delays=[1, 3, 1])
    for w in range(n):
        for step, version in enumerate(pulled[w]):
            assert version >= n * step, (w, step, version)  # all n pushes of steps < step applied


def test_an_unbounded_ssp_never_waits(monkeypatch):
    store, _, mode = cluster(2, 10**9)
    for step in range(50):
        push(mode, 0, step, store.version)  # worker 1 never pushes; nobody waits
    assert store.version == 50 and mode.status().max_ahead == 49


def test_a_worker_too_far_ahead_waits_then_times_out_naming_the_slow_worker_with_its_push_applied():
    store, _, mode = cluster(2, 1, barrier_timeout=0.3)
    push(mode, 0, 0)  # may start step 1: needs worker 1's clock >= 0
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeout, match=r"ssp: worker 0 may not start step 2 before worker\(s\) 1 finish "
                                             r"step 0 \(staleness bound 1\); waited 0.3 s. Its push of step 1 "
                                             r"was applied") as e:
        push(mode, 0, 1)
    assert time.monotonic() - t0 >= 0.3
    assert e.value.missing == (1,)
    assert store.version == 2  # both pushes applied
    # The retry is answered from the record (not applied again) and waits again; worker 1 catching up releases it.
    threading.Timer(0.1, lambda: push(mode, 1, 0)).start()
    assert push(mode, 0, 1).replayed
    assert store.version == 3


def test_a_dead_or_finished_worker_stops_holding_the_others_back():
    clock = FakeClock(now=0.0)
    members = Membership(3, lease_timeout=5.0, clock=clock)
    store, members, mode = cluster(3, 1, members=members)
    members.leave(2)  # finished: never holds anyone back (its clock stays 0)
    released = threading.Event()

    def fast():
        push(mode, 0, 0)  # step 1 needs clocks >= 0: goes on
        push(mode, 0, 1)  # step 2 needs worker 1's clock >= 1: waits
        released.set()

    t = threading.Thread(target=fast)
    t.start()
    assert not released.wait(0.5)
    clock.now = 6.0
    members.heartbeat(0)
    assert members.expire() == [1]
    mode.workers_died([1])
    assert released.wait(5.0)
    t.join(5)
    assert mode.status().active_workers == (0,)


def test_status_reports_the_slowest_clock_and_who_holds_it():
    store, _, mode = cluster(3, 2)
    push(mode, 0, 0)
    push(mode, 0, 1)
    push(mode, 1, 0)
    s = mode.status()
    assert (s.round, s.waiting_for, s.active_workers, s.max_ahead) == (0, (2,), (0, 1, 2), 1)


def test_negative_bound_is_refused():
    with pytest.raises(InvalidArgument, match="the staleness bound must be >= 0, got -1"):
        cluster(2, -1)


def test_parameter_server_runs_ssp_and_reports_the_bound():
    ps = ParameterServer("ssp", 2, staleness=4)
    assert ps.status().staleness == 4 and ps.status().mode == "ssp"
    assert ParameterServer("async", 2).status().staleness == -1


# -- stale-gradient policies (async and ssp) -------------------------------------------------


def async_mode(policy, max_staleness=0):
    store = VariableStore()
    store.initialize({"w": np.zeros(4, np.float32)}, OptimizerSpec("sgd", learning_rate=0.5))
    members = Membership(2, lease_timeout=3600.0)
    for w in range(2):
        members.register(w, 2)
    return store, AsyncMode(store, members, stale_policy=policy, max_staleness=max_staleness)


def test_policy_drop_answers_a_too_stale_push_dropped_counts_it_and_changes_nothing():
    store, mode = async_mode("drop", max_staleness=1)
    for step in range(3):
        push(mode, 0, step, store.version)
    before = store.read()[1]["w"].copy()
    result = push(mode, 1, 0, base_version=1)  # staleness 2 > 1
    assert (result.dropped, result.staleness, result.version, result.next_step) == (True, 2, 3, 1)
    assert store.version == 3 and mode.stats.dropped == 1
    np.testing.assert_array_equal(store.read()[1]["w"], before)
    assert not push(mode, 1, 1, base_version=2).dropped  # staleness 1: applied
    assert push(mode, 1, 1, base_version=2).replayed  # a retry of it is not applied again


def test_policy_scale_divides_the_learning_rate_by_one_plus_staleness():
    store, mode = async_mode("scale")
    push(mode, 0, 0, 0)  # staleness 0: w = 0 - 0.5 * 1
    push(mode, 0, 1, 1)  # staleness 0: w = -1.0
    push(mode, 1, 0, 0)  # staleness 2: lr 0.5 / 3
    expected = np.float32(-1.0) - np.float32(np.float32(0.5) * np.float64(1 / 3)) * np.float32(1)
    np.testing.assert_array_equal(store.read()[1]["w"], np.full(4, expected, np.float32))
    assert mode.stats.scaled == 1


def test_stale_policies_are_checked():
    with pytest.raises(InvalidArgument, match="stale_policy must be one of"):
        async_mode("ignore")
    with pytest.raises(InvalidArgument, match="sync has no stale gradients"):
        ParameterServer("sync", 2, stale_gradient_policy="drop")


def test_after_a_restore_the_clocks_start_from_the_workers_restored_last_steps():
    ps = ParameterServer("ssp", 2, staleness=1)
    for w in range(2):
        ps.register(w, 2)
    ps.initialize(0, {"w": np.zeros(4, np.float32)}, OptimizerSpec("sgd", learning_rate=0.5))
    for step in range(3):
        for w in range(2):
            ps.submit(Push(worker_id=w, step=step, base_version=ps.store.version, batch_size=1,
                           gradients=GRAD)).result(JOIN)
    again = ParameterServer("ssp", 2, staleness=1)
    again.restore(ps.checkpoint_state())
    assert again.status().round == 3  # both clocks at 3, from membership's restored last steps
    for w in range(2):
        again.register(w, 2)
    # Worker 0 resumes at step 3 at once (nobody is behind); no 'ahead' jump from empty clocks.
    again.submit(Push(worker_id=0, step=3, base_version=again.store.version, batch_size=1, gradients=GRAD)).result(JOIN)
    assert again.status().max_ahead == 0
