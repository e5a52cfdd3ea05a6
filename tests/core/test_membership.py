"""Tests of ps_server.core.membership: who is in the cluster.

    python -m pytest tests/core/test_membership.py -q

A fake clock makes ``registered_at`` and ``last_seen`` exact.
"""

import pytest

from ps_server.core.errors import ConfigMismatch, InvalidArgument, NoFreeIndex, UnknownWorker
from ps_server.core.membership import AUTO_INDEX, Membership, WorkerRecord
from tests.core.threads import FakeClock


@pytest.fixture
def clock():
    return FakeClock(now=100.0)


@pytest.fixture
def members(clock):
    return Membership(num_workers=3, clock=clock)


def test_register_records_the_worker_with_the_time(members, clock):
    rec = members.register(worker_index=1, claimed_num_workers=3, name="host:77")
    assert (rec.worker_id, rec.name, rec.registered_at, rec.last_seen) == (1, "host:77", 100.0, 100.0)
    assert (rec.last_step, rec.pushes, rec.left) == (-1, 0, False)
    assert [r.worker_id for r in members.snapshot()] == [1]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_every_index_from_zero_to_num_workers_minus_one_may_register(members, index):
    assert members.register(index, 3).worker_id == index


@pytest.mark.parametrize("index", [-2, 3, 10])
def test_index_outside_the_cluster_is_refused_and_not_recorded(members, index):
    with pytest.raises(InvalidArgument, match=rf"worker index {index} is outside 0\.\.2 \(the server runs with 3 workers\)"):
        members.register(index, 3)
    assert members.snapshot() == []


def test_num_workers_mismatch_raises_config_mismatch_naming_both_numbers(members):
    with pytest.raises(ConfigMismatch) as e:
        members.register(worker_index=1, claimed_num_workers=4)
    assert str(e.value) == "worker 1 was started with --num-workers 4 but the server runs with 3"
    assert members.snapshot() == []


def test_a_worker_that_does_not_say_its_num_workers_is_accepted(members):
    assert members.register(worker_index=2, claimed_num_workers=0).worker_id == 2


def test_registering_again_replaces_the_record_but_keeps_the_index_counters(members, clock):
    members.register(0, 3, name="old:1")
    members.record_push(0, step=5)
    clock.now = 200.0
    rec = members.register(0, 3, name="new:2")
    # A restarted worker is a new process (name, lease) doing the same index's work (counters).
    assert (rec.name, rec.registered_at, rec.last_step, rec.pushes) == ("new:2", 200.0, 5, 1)
    [only] = members.snapshot()
    assert (only.worker_id, only.name, only.pushes, only.dead) == (0, "new:2", 1, False)


def test_require_of_an_unregistered_worker_raises_unknown_worker(members):
    members.register(0, 3)
    with pytest.raises(UnknownWorker, match="worker 2 is not registered; call Register first"):
        members.require(2)


def test_require_of_a_registered_worker_updates_last_seen(members, clock):
    members.register(0, 3)
    clock.now = 150.0
    members.require(0)
    assert members.snapshot()[0].last_seen == 150.0


def test_record_push_counts_pushes_and_keeps_the_highest_step(members, clock):
    members.register(1, 3)
    clock.now = 120.0
    members.record_push(1, 4)
    members.record_push(1, 2)
    rec = members.snapshot()[0]
    assert (rec.pushes, rec.last_step, rec.last_seen) == (2, 4, 120.0)


def test_record_push_of_an_unregistered_worker_is_ignored(members):
    members.record_push(2, 0)
    assert members.snapshot() == []


def test_leave_marks_the_worker_and_requires_registration(members):
    members.register(1, 3)
    members.leave(1)
    assert members.snapshot()[0].left is True
    with pytest.raises(UnknownWorker):
        members.leave(2)


def test_describe_names_workers_with_their_address_when_known(members):
    members.register(1, 3, name="host:77")
    members.register(2, 3)
    assert members.describe([0, 1, 2]) == "0, 1 (host:77), 2"
    assert members.describe(w for w in (1,)) == "1 (host:77)"
    assert members.describe([]) == ""
    assert members.name_of(1) == "host:77" and members.name_of(0) == ""


def test_snapshot_is_sorted_by_worker_id_and_is_a_copy(members):
    for w in (2, 0, 1):
        members.register(w, 3)
    snap = members.snapshot()
    assert [r.worker_id for r in snap] == [0, 1, 2]
    snap[0].pushes = 99
    assert members.snapshot()[0].pushes == 0


def test_returned_registration_is_a_copy(members):
    rec = members.register(0, 3)
    rec.pushes = 99
    assert members.snapshot()[0].pushes == 0


@pytest.mark.parametrize("n", [0, -2])
def test_a_cluster_needs_at_least_one_worker(n):
    with pytest.raises(InvalidArgument, match=f"num_workers must be >= 1, got {n}"):
        Membership(num_workers=n)


# -- auto-assigned indexes (docker compose --scale: identical workers) ---------------

def test_auto_index_hands_out_the_lowest_unregistered_index(members):
    members.register(1, 3)
    assert [members.register(AUTO_INDEX, 3, name=f"w{i}").worker_id for i in range(2)] == [0, 2]
    assert {r.worker_id: r.name for r in members.snapshot()} == {0: "w0", 1: "", 2: "w1"}


def test_auto_index_replaces_a_dead_worker_but_never_a_live_or_finished_one(members, clock):
    for i in range(3):
        members.register(i, 3)
    members.leave(0)
    with pytest.raises(NoFreeIndex, match=r"all 3 worker indexes are taken \(alive: \[1, 2\], finished: \[0\]\)"):
        members.register(AUTO_INDEX, 3)
    clock.now += 5.0
    members.heartbeat(1)
    clock.now += 6.0  # worker 2 silent for 11 s > lease 10 s; 0 left, so never expires
    assert members.expire() == [2]
    rec = members.register(AUTO_INDEX, 3, name="replacement")
    assert (rec.worker_id, rec.name) == (2, "replacement")
    assert not members.is_dead(2)


def test_auto_index_checks_the_worker_count_first(members):
    with pytest.raises(ConfigMismatch, match="a worker was started with --num-workers 4 but the server runs with 3"):
        members.register(AUTO_INDEX, 4)
    assert members.snapshot() == []


def test_finished_once_every_index_registered_and_each_left_or_died(members, clock):
    assert members.finished() == (False, [], [])
    members.register(0, 3)
    members.register(1, 3)
    members.leave(0)
    assert members.finished() == (False, [0], [])  # 2 never registered
    members.register(2, 3)
    members.leave(2)
    assert members.finished() == (False, [0, 2], [])  # 1 still trains
    clock.now += 11.0
    assert members.expire() == [1]
    assert members.finished() == (True, [0, 2], [1])
    members.register(1, 3)  # a replacement revives the index: not done any more
    assert members.finished() == (False, [0, 2], [])


def test_a_restored_worker_counts_for_finished_once_it_called_or_its_grace_ran_out(members, clock):
    """A requeued job's server restores its checkpoint before the workers have started again:
    they get ``grace`` (the barrier timeout) before they are declared dead, and the server
    does not take their old records as the job's end."""
    members.restore([WorkerRecord(worker_id=i, name="old", registered_at=0.0, last_seen=0.0, left=i == 2)
                     for i in range(3)], grace=60.0)
    clock.now += 59.0  # past the lease (10 s), within the grace to start again
    assert members.expire() == []
    assert members.finished() == (False, [2], [])  # 0 and 1 may be starting again
    assert members.finished(every_index=False) == (False, [], [])  # elastic: only workers of its own
    members.register(0, 3)  # 0 is back; 1 never comes
    clock.now += 2.0
    assert members.expire() == [1]  # past the grace
    assert members.finished() == (False, [2], [1])  # 2 had finished: it counts; 0 trains
    members.leave(0)
    assert members.finished() == (True, [0, 2], [1])
    assert members.finished(every_index=False) == (True, [0], [1])
    members.restore([WorkerRecord(worker_id=0, name="old", registered_at=0.0, last_seen=0.0)], grace=60.0)
    members.heartbeat(0)  # a worker that kept its registration across a server restart: heard from
    clock.now += 11.0
    assert members.expire() == [0]


def test_work_and_wait_times_average_what_happens_between_and_inside_pushes(members, clock):
    members.register(0, 3)
    # Push 1 arrives at 100, done at 100.5 (0.5 s in the server); the worker then works 2 s.
    members.record_push(0, 0, arrived=100.0, done=100.5)
    rec = members.snapshot()[0]
    assert (rec.wait_s, rec.work_s) == (0.5, 0.0)  # no work interval yet
    members.record_push(0, 1, arrived=102.5, done=102.6)
    rec = members.snapshot()[0]
    assert rec.work_s == pytest.approx(2.0) and rec.wait_s == pytest.approx(0.3)  # mean of 0.5 and 0.1
    for step in range(2, 40):  # long after: the exponential average follows the new level
        members.record_push(0, step, arrived=102.6 + (step - 1) * 1.1, done=102.6 + (step - 1) * 1.1 + 0.1)
    rec = members.snapshot()[0]
    assert rec.work_s == pytest.approx(1.0, abs=0.01) and rec.wait_s == pytest.approx(0.1, abs=0.01)
    members.register(0, 3)  # a new registration starts the averages again
    assert members.snapshot()[0].last_push_done == 0.0


def test_an_elastic_job_is_finished_when_nobody_trains_however_many_indices_it_used(members, clock):
    assert members.finished(every_index=False) == (False, [], [])
    members.register(0, 3)
    members.register(1, 3)
    assert members.finished(every_index=False) == (False, [], [])  # both train
    clock.now += 11.0
    assert members.expire() == [0, 1]
    assert members.finished(every_index=False) == (False, [], [0, 1])  # nobody finished: a crash, not an end
    members.register(1, 3)
    members.leave(1)
    assert members.finished(every_index=False) == (True, [1], [0])  # index 2 never used
    assert members.finished() == (False, [1], [0])


# -- membership over time ------------------------------------------------------------------


def events(members):
    return [(e.wall_time, e.round, e.version, e.event, e.worker_id, e.name) for e in members.history()]


def test_joins_leaves_deaths_and_rejoins_are_recorded_in_order_with_round_version_and_wall_time(clock):
    wall = FakeClock(now=1_700_000_000.0)
    members = Membership(num_workers=3, lease_timeout=10.0, clock=clock, wall_clock=wall)
    members.register(0, 3, "a", at=(0, 0))
    members.register(AUTO_INDEX, 3, "b", at=(0, 0))  # the event names the index it was given
    wall.now += 5
    members.leave(1, at=(4, 4))
    members.leave(1, at=(5, 5))  # a repeated Leave is answered, and is no second event
    members.register(1, 3, "c", at=(6, 6))  # a new worker on an index whose worker left: joined
    clock.now += 11
    wall.now += 11
    members.require(1)
    assert members.expire(at=(9, 9)) == [0]
    members.register(0, 3, "a2", at=(9, 9))  # registered again after being declared dead
    members.register(0, 3, "a3", at=(9, 9))  # ... and again while alive (a restart)
    t = 1_700_000_000.0
    assert events(members) == [(t, 0, 0, "joined", 0, "a"), (t, 0, 0, "joined", 1, "b"),
                               (t + 5, 4, 4, "left", 1, "b"), (t + 5, 6, 6, "joined", 1, "c"),
                               (t + 16, 9, 9, "dead", 0, "a"), (t + 16, 9, 9, "rejoined", 0, "a2"),
                               (t + 16, 9, 9, "rejoined", 0, "a3")]
    assert members.dropped == 0


def test_the_history_keeps_the_newest_events_and_counts_those_let_go(clock):
    members = Membership(num_workers=2, clock=clock, history_limit=3)
    for i in range(5):
        members.register(i % 2, 2, f"w{i}", at=(i, i))
    assert [e.round for e in members.history()] == [2, 3, 4]
    assert members.dropped == 2


def test_a_refused_registration_and_a_restore_record_no_event(members):
    with pytest.raises(InvalidArgument):
        members.register(7, 3)
    with pytest.raises(ConfigMismatch):
        members.register(0, 5)
    members.restore([WorkerRecord(worker_id=2, name="old", registered_at=0.0, last_seen=0.0)])
    assert members.history() == [] and members.dropped == 0


def test_a_caller_that_does_not_say_where_the_server_is_records_round_and_version_minus_one(members):
    members.register(0, 3)
    (e,) = members.history()
    assert (e.round, e.version, e.event) == (-1, -1, "joined")


# -- incarnations: one process per index at a time -----------------------------------------------

def test_the_same_process_registering_again_keeps_its_incarnation(members):
    assert members.register(1, process="a").incarnation == 1
    again = members.register(1, process="a")  # a rejoin: a lease it missed, a server restart
    assert (again.incarnation, again.replaced) == (1, False)


def test_another_process_on_an_index_is_its_next_incarnation_and_replaces_a_live_one(members):
    members.register(1, process="a")
    new = members.register(1, process="b")  # a worker restarted on its old index
    assert (new.incarnation, new.replaced, new.process) == (2, True, "b")


def test_a_process_whose_index_another_took_is_refused_when_it_registers_again(members):
    from ps_server.core.errors import Superseded
    members.register(1, name="host:1", process="a")
    members.register(1, name="host:2", process="b")
    with pytest.raises(Superseded, match=r"worker index 1 is held by another process \(host:2\)"):
        members.register(1, name="host:1", process="a")
    assert members.snapshot()[0].process == "b"  # the refusal changed nothing


def test_an_auto_index_handed_a_dead_workers_index_is_a_new_incarnation(members, clock):
    for i in range(3):
        members.register(i, process=f"p{i}")
    clock.now += members.lease_timeout + 1
    members.expire()
    new = members.register(AUTO_INDEX, process="q")
    assert (new.worker_id, new.incarnation, new.replaced) == (0, 2, True)


def test_a_new_process_on_an_index_whose_worker_left_replaces_nothing(members):
    members.register(1, process="a")
    members.leave(1)
    assert members.register(1, process="b").replaced is False


def test_a_heartbeat_of_a_replaced_process_is_refused_and_renews_nothing(members, clock):
    from ps_server.core.errors import Superseded
    members.register(1, process="a")
    clock.now += 1.0
    members.register(1, process="b")
    clock.now += 1.0
    with pytest.raises(Superseded, match="held by another process"):
        members.heartbeat(1, "a")
    assert members.snapshot()[0].last_seen == 101.0  # b's registration; a renewed nothing
    members.heartbeat(1, "b")
    members.heartbeat(1)  # a call that names no process (a push, a pull) still renews
