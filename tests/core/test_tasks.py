"""core.data.tasks: exactly-once data for async and ssp training (issue 17, item 3).

"A batch is done when its push is applied; a batch whose worker dies (lease) or whose
push is refused goes back to the queue; a retried push of a done batch is answered from
the record. Per epoch, the examples applied equal the dataset's size."

Time is an injected clock the tests move by hand; the chaos run is seeded.
"""

import random

import numpy as np
import pytest

from ps_common import batches
from ps_server.core.errors import InvalidArgument
from ps_server.core.data.tasks import TaskQueue

from tests.core import threads


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def queue(num_examples=23, batch_size=5, seed=7, epochs=2, lease_timeout=10.0, clock=None, applies=1):
    return TaskQueue(num_examples, batch_size, seed, epochs, lease_timeout, clock=clock or Clock(), applies=applies)


def finish(q, worker, version=0):
    """``worker`` pushes its task; returns the task, or None when nothing is left to take."""
    task = q.take(worker)
    if task is not None:
        assert q.begin(worker, task.task_id) is None
        assert q.done(worker, task.task_id, version) is True
    return task


def test_one_worker_trains_every_epoch_on_the_dataset_in_the_seeded_order_last_batch_smaller():
    q = queue(num_examples=23, batch_size=5, seed=7, epochs=3)
    assert q.steps_per_epoch == 5 and q.total_tasks == 15
    taken = []
    while (task := finish(q, worker=0, version=len(taken) + 1)) is not None:
        taken.append(task)
    assert [t.task_id for t in taken] == list(range(15))
    assert [(t.epoch, t.index) for t in taken] == [(e, i) for e in range(3) for i in range(5)]
    assert [t.size for t in taken[:5]] == [5, 5, 5, 5, 3]
    for e in range(3):
        epoch = np.concatenate([t.indices for t in taken if t.epoch == e])
        np.testing.assert_array_equal(epoch, batches.epoch_order(23, 7, e))  # the seeded order, whole
        assert q.examples_done(e) == 23 and q.epoch_complete(e)
    for t in taken:  # the same batches as the sync modes' global steps
        np.testing.assert_array_equal(t.indices, batches.global_batch(23, 5, 7, t.task_id))
    assert q.finished and q.take(0) is None
    assert q.status().epoch == 3 and q.status().outstanding == 0
    assert not np.asarray(taken[0].indices).flags.writeable


def test_task_ids_are_deterministic_across_queues_and_workers():
    a, b = queue(), queue()
    first = [a.take(w) for w in (0, 1, 0, 2)]
    second = [b.take(9) for _ in range(4)]
    assert [t.task_id for t in first] == [t.task_id for t in second] == [0, 1, 2, 3]
    for x, y in zip(first, second):
        np.testing.assert_array_equal(x.indices, y.indices)
        np.testing.assert_array_equal(a.task(x.task_id).indices, x.indices)


def test_an_epoch_is_handed_out_whole_before_the_next_but_not_waited_for():
    q = queue(num_examples=10, batch_size=5, epochs=2)  # two tasks an epoch
    t0, t1 = q.take(0), q.take(1)
    assert (t0.epoch, t1.epoch) == (0, 0)
    t2 = q.take(2)  # epoch 0 is all handed out (none done): epoch 1 starts
    assert (t2.task_id, t2.epoch) == (2, 1)
    q.lost(0)  # a given-back task of epoch 0 comes before any fresh one of epoch 1
    assert q.take(2).task_id == 0
    assert q.take(2).task_id == 3


def test_several_workers_interleaved_finish_each_epoch_exactly_once():
    q = queue(num_examples=31, batch_size=4, epochs=2)
    applied = []
    workers = [0, 1, 2]
    held = {w: q.take(w) for w in workers}
    version = 0
    while any(held.values()):
        for w in workers:  # round robin, each pushing then taking
            task = held[w]
            if task is None:
                continue
            assert q.begin(w, task.task_id) is None
            version += 1
            applied.append(task.task_id)
            assert q.done(w, task.task_id, version)
            held[w] = q.take(w)
    assert sorted(applied) == list(range(q.total_tasks))
    assert q.finished and [q.examples_done(e) for e in (0, 1)] == [31, 31]


def test_a_lost_worker_s_tasks_come_back_first_and_are_done_by_another():
    q = queue(num_examples=40, batch_size=5, epochs=1)
    a, b = q.take(0), q.take(0)  # worker 0 prefetches two
    c = q.take(1)
    assert [t.task_id for t in (a, b, c)] == [0, 1, 2]
    assert [t.task_id for t in q.lost(0)] == [0, 1]
    assert q.held(0) == [] and q.status().queued == 2
    assert [q.take(1).task_id, q.take(1).task_id, q.take(1).task_id] == [0, 1, 3]
    for t in (0, 1, 2, 3):
        assert q.begin(1, t) is None and q.done(1, t, 10 + t)
    assert q.examples_done(0) == 20 and q.record(0).worker_id == 1


def test_a_lease_runs_out_on_the_injected_clock_and_renewing_keeps_it():
    clock = Clock()
    q = queue(lease_timeout=10.0, clock=clock)
    kept, dropped = q.take(0), q.take(1)
    clock.now += 6
    assert q.renew(0) == 1  # worker 0 heartbeats; worker 1 is silent
    clock.now += 5  # worker 1's lease ended 1 s ago; worker 0's ends in 5
    assert [t.task_id for t in q.expire()] == [dropped.task_id]
    assert q.held(0) == [kept.task_id] and q.held(1) == []
    assert q.expire(now=clock.now + 5) == []  # exactly at the deadline: still held
    assert [t.task_id for t in q.expire(now=clock.now + 5.01)] == [kept.task_id]
    assert [q.take(2).task_id, q.take(2).task_id] == [kept.task_id, dropped.task_id]  # lowest first


def test_a_retried_push_of_a_done_task_is_answered_from_the_record_and_counts_nothing():
    q = queue()
    task = q.take(3)
    assert q.begin(3, task.task_id) is None
    assert q.done(3, task.task_id, 41) is True
    record = q.begin(3, task.task_id)  # the reply was lost; the worker sends the push again
    assert (record.task_id, record.worker_id, record.version) == (task.task_id, 3, 41)
    assert q.done(3, task.task_id, 99) is False  # a caller without begin: nothing counted
    assert q.record(task.task_id).version == 41 and q.examples_done(0) == task.size
    assert q.status().done == 1


def test_a_refused_push_goes_back_to_the_queue_and_is_done_once_later():
    q = queue()
    task = q.take(0)
    assert q.begin(0, task.task_id) is None
    q.given_back(0, task.task_id)  # dropped as too stale
    assert q.held(0) == [] and q.record(task.task_id) is None and q.examples_done(0) == 0
    again = q.take(1)
    assert again.task_id == task.task_id
    with pytest.raises(InvalidArgument, match="held by worker 1"):
        q.begin(0, task.task_id)
    assert q.begin(1, again.task_id) is None and q.done(1, again.task_id, 5)
    assert q.examples_done(0) == task.size


def test_a_late_push_from_a_worker_whose_task_was_reassigned_is_refused_and_applied_once():
    clock = Clock()
    q = queue(clock=clock)
    task = q.take(0)
    clock.now += 11
    assert [t.task_id for t in q.expire()] == [task.task_id]
    with pytest.raises(InvalidArgument, match="given back and waits"):
        q.begin(0, task.task_id)  # late, and nobody holds it yet: still not worker 0's
    assert q.take(1).task_id == task.task_id
    with pytest.raises(InvalidArgument, match=f"does not hold task {task.task_id}: it is held by worker 1"):
        q.begin(0, task.task_id)
    with pytest.raises(InvalidArgument, match="held by worker 1"):
        q.done(0, task.task_id, 3)
    assert q.begin(1, task.task_id) is None and q.done(1, task.task_id, 4)
    with pytest.raises(InvalidArgument, match="already done by worker 1's push"):
        q.begin(0, task.task_id)  # later still: not answered as if worker 0's push were applied
    assert q.examples_done(0) == task.size and q.record(task.task_id).worker_id == 1


def test_a_task_being_applied_is_not_handed_to_another_when_its_worker_is_lost_or_late():
    clock = Clock()
    q = queue(clock=clock)
    task = q.take(0)
    assert q.begin(0, task.task_id) is None  # its push is being applied (no lock held)
    clock.now += 60
    assert q.expire() == [] and q.lost(0) == []
    assert q.take(1).task_id != task.task_id
    assert q.done(0, task.task_id, 8)  # the apply finishes: done, once
    other = q.take(2)
    assert q.begin(2, other.task_id) is None and q.lost(2) == []
    q.given_back(2, other.task_id)  # that apply was refused: now it goes back
    assert q.take(1).task_id == other.task_id


def test_a_checkpoint_listing_a_done_task_twice_trips_the_guard():
    q = queue()
    finish(q, 0)
    state = q.state()
    state["done_task_ids"] = np.array([0, 0])
    state["done_workers"] = np.array([0, 0])
    state["done_versions"] = np.array([0, 0])
    with pytest.raises(InvalidArgument, match="would be trained on twice"):
        TaskQueue.restore(state, lease_timeout=10.0, clock=Clock())


@pytest.mark.parametrize("applies", [1, 2])
def test_state_and_restore_mid_run_repeat_no_done_batch_and_lose_none(applies):
    """With ``applies`` 2 (a GAN's step: two tasks a batch) the checkpoint falls between a batch's
    two tasks, and one of the tasks held then is a first apply, another a second."""
    q = queue(num_examples=29, batch_size=4, epochs=3, applies=applies)
    applied = {}
    for version in range(1, 12):  # eleven done, then three held when the server stops
        t = finish(q, version % 2, version)
        applied[t.task_id] = 1
    held = [q.take(2).task_id for _ in range(3)]
    q.given_back(2, held[1])  # one of them is even queued
    state = q.state()
    assert set(state) >= {"done_task_ids", "done_workers", "done_versions"}
    assert all(isinstance(v, (int, np.ndarray)) for v in state.values())
    r = TaskQueue.restore(state, lease_timeout=10.0, clock=Clock())
    assert r.applies == applies and r.total_tasks == 3 * 8 * applies
    assert [r.examples_done(e) for e in range(3)] == ([29, 12, 0] if applies == 1 else [20, 0, 0])  # whole batches
    assert r.record(10).version == 11 and r.begin(1, 10).version == 11  # a retry across the restart
    with pytest.raises(InvalidArgument, match="does not hold"):
        r.begin(2, held[0])  # it held that before the restart; now nobody does
    version = 100
    while (t := r.take(5)) is not None:
        assert t.task_id not in applied
        assert r.begin(5, t.task_id) is None
        applied[t.task_id] = applied.get(t.task_id, 0) + 1
        version += 1
        r.done(5, t.task_id, version)
    assert sorted(applied) == list(range(r.total_tasks)) and set(applied.values()) == {1}
    assert r.finished and [r.examples_done(e) for e in range(3)] == [29, 29, 29]


@pytest.mark.parametrize("applies", [1, 2])
def test_a_chaos_run_of_joins_deaths_retries_refusals_and_expiries_is_exactly_once(applies):
    """``applies`` 2: each batch is two tasks (a step of two optimizer applies), each exactly once."""
    rng = random.Random(17)
    clock = Clock()
    q = queue(num_examples=100, batch_size=7, seed=3, epochs=3, lease_timeout=5.0, clock=clock, applies=applies)
    applies: dict[int, int] = {}
    version = 0
    live = [0, 1]
    next_id = 2
    history: dict[int, list[int]] = {}  # worker -> every task it was ever given
    seen = {"restored": 0, "refused": 0, "answered": 0, "given back": 0, "lost": 0, "expired": 0, "joined": 0}

    def push(w, task_id):
        nonlocal version
        try:
            record = q.begin(w, task_id)
        except InvalidArgument:
            seen["refused"] += 1
            return
        if record is not None:
            seen["answered"] += 1
            return  # answered from the record, nothing applied
        if rng.random() < 0.15:
            q.given_back(w, task_id)  # the mode refused it (too stale)
            seen["given back"] += 1
            return
        version += 1
        applies[task_id] = applies.get(task_id, 0) + 1  # the apply
        assert q.done(w, task_id, version)

    events = 0
    while events < 400 or not q.finished:  # 400 events of chaos, then the live workers drain it
        events += 1
        assert events < 5000, "the run does not end"
        draining = events > 400
        kind = rng.choice(["take", "take", "push", "push", "push", "retry", "late", "lost", "join",
                           "tick", "renew"]) if not draining else rng.choice(["take", "push", "tick"])
        if not live:
            live.append(next_id)
            next_id += 1
        w = rng.choice(live)
        if kind == "take":
            t = q.take(w)
            if t is not None:
                history.setdefault(w, []).append(t.task_id)
        elif kind == "push" and q.held(w):
            push(w, rng.choice(q.held(w)))
        elif kind in ("retry", "late") and history.get(w):
            push(w, rng.choice(history[w]))  # a done one: from the record; a reassigned one: refused
        elif kind == "lost":
            seen["lost"] += len(q.lost(w))
            live.remove(w)
        elif kind == "join":
            live.append(next_id)
            next_id += 1
            seen["joined"] += 1
        elif kind == "tick":
            clock.now += rng.choice([0.5, 1.0, 3.0])
            seen["expired"] += len(q.expire())
        elif kind == "renew":
            q.renew(w)
        if events == 200:  # the server restarts from a checkpoint: held tasks go back
            q = TaskQueue.restore(q.state(), lease_timeout=5.0, clock=clock)
            seen["restored"] = 1
    # the chaos did happen: every kind of event moved something
    assert min(seen.values()) > 0, seen
    assert sorted(applies) == list(range(q.total_tasks))  # none lost
    assert set(applies.values()) == {1}  # none applied twice
    assert [q.examples_done(e) for e in range(3)] == [100, 100, 100]
    assert all(q.record(t).version >= 1 for t in applies)


def test_workers_on_threads_apply_every_task_once():
    q = queue(num_examples=300, batch_size=3, epochs=2)
    applied: list[int] = []

    def work(w):
        while (t := q.take(w)) is not None:
            assert q.begin(w, t.task_id) is None
            applied.append(t.task_id)
            assert q.done(w, t.task_id, 1)
            assert q.begin(w, t.task_id) is not None  # the retry

    threads.finish(*[threads.start(lambda w=w: work(w)) for w in range(4)])
    assert sorted(applied) == list(range(q.total_tasks))
    assert q.examples_done(0) == q.examples_done(1) == 300


def test_status_counts_what_is_held_queued_and_done():
    q = queue(num_examples=20, batch_size=5, epochs=2)
    finish(q, 0)
    q.take(1), q.take(2)
    q.lost(2)
    s = q.status()
    assert (s.epoch, s.total, s.done, s.held, s.queued, s.outstanding, s.examples_done) == (0, 8, 1, 1, 1, 7, 5)


@pytest.mark.parametrize("args, message", [
    ((0, 5, 0, 1, 1.0), "num_examples must be an integer >= 1, got 0"),
    ((10, 0, 0, 1, 1.0), "batch_size must be an integer >= 1, got 0"),
    ((10, -3, 0, 1, 1.0), "batch_size must be an integer >= 1, got -3"),
    ((10, 5, 0, 0, 1.0), "epochs must be an integer >= 1, got 0"),
    ((10, 5, 0, 1, 0.0), "lease_timeout must be > 0"),
    ((10, True, 0, 1, 1.0), "batch_size must be an integer >= 1, got True"),
    ((10.0, 5, 0, 1, 1.0), "num_examples must be an integer >= 1, got 10.0"),
])
def test_a_queue_of_no_size_is_refused(args, message):
    with pytest.raises(InvalidArgument, match=message):
        TaskQueue(*args)


def test_unknown_tasks_and_tasks_a_worker_does_not_hold_are_refused_with_what_is_wrong():
    q = queue(num_examples=10, batch_size=5, epochs=1)
    with pytest.raises(InvalidArgument, match=r"unknown task 2: this job's tasks are 0..1"):
        q.begin(0, 2)
    with pytest.raises(InvalidArgument, match="unknown task -1"):
        q.done(0, -1, 0)
    with pytest.raises(InvalidArgument, match="worker 0 does not hold task 1: it was not handed out yet"):
        q.begin(0, 1)
    t = q.take(0)
    with pytest.raises(InvalidArgument, match="worker 1 does not hold task 0: it is held by worker 0"):
        q.given_back(1, t.task_id)
    with pytest.raises(InvalidArgument, match="applied_version must be an integer >= 0"):
        q.done(0, t.task_id, -1)
    with pytest.raises(InvalidArgument, match="unknown epoch 1"):
        q.examples_done(1)
    with pytest.raises(InvalidArgument, match="worker id must be an integer >= 0"):
        q.take(-1)
    assert q.done(0, t.task_id, 0)
    with pytest.raises(InvalidArgument, match="already done"):
        q.given_back(0, t.task_id)


def test_a_step_of_two_applies_is_two_tasks_a_batch_whose_examples_count_once_both_are_done():
    """``applies`` 2: batch b is tasks 2b and 2b + 1, each with the batch's examples, handed out,
    given back and done on its own; the batch counts in its epoch once both are done, in either
    order; a retry of either is answered from its own record. Epochs of tasks, and Keras'
    ``steps_per_epoch`` (``tasks``: the batches) too."""
    q = queue(num_examples=23, batch_size=5, epochs=2, applies=2)
    assert (q.batches, q.total_tasks, q.steps_per_epoch) == (10, 20, 5)
    first, second = q.take(0), q.take(1)
    assert (first.task_id, second.task_id) == (0, 1) and first.index == second.index == 0
    assert np.array_equal(first.indices, batches.global_batch(23, 5, 7, 0))
    assert np.array_equal(second.indices, first.indices) and q.task(19).epoch == 1 and q.task(19).index == 4
    assert q.begin(1, 1) is None and q.done(1, 1, 1)  # the second apply first: nothing counts yet
    assert q.examples_done(0) == 0
    assert q.lost(0)[0].task_id == 0  # the first apply's worker dies: the task comes back first
    assert q.take(2).task_id == 0 and q.begin(2, 0) is None and q.done(2, 0, 2)
    assert q.examples_done(0) == 5 and q.begin(1, 1).version == 1 and q.begin(2, 0).version == 2
    with pytest.raises(InvalidArgument, match=r"tasks are 0..19 \(2 epochs of 5 batches, 2 tasks each\)"):
        q.task(20)
    while finish(q, 3) is not None:
        pass
    assert q.finished and [q.examples_done(e) for e in range(2)] == [23, 23]
    cut = TaskQueue(23, 5, 7, 2, 10.0, clock=Clock(), tasks=7, applies=2)  # steps_per_epoch: 7 batches
    assert cut.total_tasks == 14 and cut.task(13).epoch == 1 and cut.task(13).index == 1
    cut.extend(3)
    assert (cut.batches, cut.total_tasks, cut.state()["applies"]) == (15, 30, 2)
