"""Checkpoints carry the data plan and its progress (issue 17, exactly-once data across a
restart): async and ssp's done tasks, elastic sync's ledger, both of the same moment as the
saved values.

The task jobs train ``w`` (float64, one element per example) with SGD at learning rate 1
on a push's gradient of one count per example of its task (``np.bincount``): the values
are integers, exact whatever the order, so ``w == -(how often each example was applied)``
and a checkpoint's values can be checked against replaying exactly its recorded tasks.
"""

import dataclasses
import threading
import time

import numpy as np
import pytest

from ps_server.core import checkpoint
from ps_server.core.checkpoint import read_checkpoint, write_checkpoint
from ps_server.core.data.cursor import DataPlan, EpochLedger
from ps_server.core.errors import ConfigMismatch, InvalidArgument, SpecConflict
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.data.tasks import TaskGate, TaskQueue
from tests.core import test_elastic_server as elastic
from tests.core.test_checkpoint import _rewrite_header
from tests.core.test_elastic_mode import Clock
from tests.core.threads import JOIN

SGD = OptimizerSpec("sgd", learning_rate=1.0)
PLAN = DataPlan(num_examples=90, global_batch_size=16, seed=5, epochs=2)  # 6 tasks an epoch, 12 in all


def counts(indices, n) -> dict[str, np.ndarray]:
    return {"w": np.bincount(indices, minlength=n).astype(np.float64)}


def task_server(mode="async", plan=PLAN, num_workers=3, **kwargs) -> ParameterServer:
    if mode == "ssp":
        kwargs.setdefault("staleness", 1000)
    return ParameterServer(mode, num_workers=num_workers, lease_timeout=5.0, clock=Clock(), **kwargs)


def task_job(mode="async", plan=PLAN, num_workers=3, **kwargs) -> ParameterServer:
    ps = task_server(mode, plan, num_workers, **kwargs)
    for w in range(num_workers):
        ps.register(w, num_workers)
    ps.initialize(0, {"w": np.zeros(plan.num_examples)}, SGD, data_plan=plan)
    return ps


def task_push(ps, worker, task, step) -> Push:
    return Push(worker_id=worker, step=step, base_version=ps.store.version, batch_size=task.size,
                gradients=counts(task.indices, ps.tasks.num_examples), task=task.task_id)


def through_a_file(tmp_path, ps) -> checkpoint.ServerState:
    state = ps.checkpoint_state()
    path = write_checkpoint(str(tmp_path), state)
    state.release()
    return read_checkpoint(path)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_task_job_restored_mid_epoch_hands_out_only_the_tasks_not_done_and_applies_each_once(tmp_path, mode):
    ps = task_job(mode)
    for step in range(4):  # worker 0 does tasks 0..3
        ps.submit(task_push(ps, 0, ps.work(0).result().task, step)).result(JOIN)
    held = ps.work(1).result().task  # task 4: handed out, never pushed
    late = task_push(ps, 1, held, 0)
    done = ps.work(2).result().task  # task 5 (the epoch's last, 10 examples): done; its reply is lost, the push comes again after the restart
    retry = task_push(ps, 2, done, 0)
    first = ps.submit(retry).result(JOIN)

    back = through_a_file(tmp_path, ps)
    assert back.data.kind == "tasks" and back.data.describe() == "90 examples, batches of 16, seed 5, 2 epoch(s) of tasks"
    assert back.data.done_task_ids.tolist() == [0, 1, 2, 3, 5]
    assert back.data.done_workers.tolist() == [0, 0, 0, 0, 2] and back.version == 5

    fresh = task_server(mode)
    fresh.restore(back)
    for w in range(3):
        fresh.register(w, 3)
    assert fresh.initialize(0, {"w": np.zeros(90)}, SGD, data_plan=PLAN) == (False, 5)  # the same plan: harmless
    with pytest.raises(SpecConflict, match="data plan"):
        fresh.initialize(0, {"w": np.zeros(90)}, SGD, data_plan=DataPlan(90, 16, 6, 2))
    assert fresh.status().epoch_examples == (4 * 16 + 10,) and fresh.status().tasks_done == 5

    again = fresh.submit(retry).result(JOIN)  # answered from the restored record, not applied
    assert again.replayed and again.version == first.version and fresh.store.version == 5

    taken, steps = [], {0: 10, 1: 10, 2: 10}
    while (task := fresh.work(0).result().task) is not None:
        taken.append(task.task_id)
        if task.task_id == held.task_id:
            with pytest.raises(InvalidArgument, match="held by worker 0"):
                fresh.submit(late).result(JOIN)  # worker 1 held it before the restart; it holds nothing now
        fresh.submit(task_push(fresh, 0, task, steps[0])).result(JOIN)
        steps[0] += 1
    assert taken == [4, 6, 7, 8, 9, 10, 11]  # the held one again, then the rest; no done one
    status = fresh.status()
    assert fresh.work(1).result().finished
    assert status.epoch_examples == (90, 90) and status.tasks_done == status.tasks_total == 12
    assert status.pushes_applied == status.version == 12  # one update per task, across the restart
    np.testing.assert_array_equal(fresh.pull()[1]["w"], np.full(90, -2.0))  # each example once per epoch


def elastic_rounds(ps, workers, until) -> None:
    """Drive elastic sync rounds until version ``until``: each worker computes what it is dealt."""
    while ps.store.version < until:
        version = ps.store.version
        for w in workers:
            ticket = ps.work(w)
            if not ticket.done():
                continue
            work = ticket.result()
            for i in range(len(work.micro_batches)):
                ps.submit(elastic.push(ps, w, work, i))
        assert ps.store.version == version + 1


def elastic_job() -> ParameterServer:
    ps = elastic.server(Clock())
    for w in (0, 1):
        ps.register(w, 4)
    ps.initialize(0, elastic.zeros(), elastic.ADAM, data_plan=elastic.PLAN)
    return ps


def test_an_elastic_job_restored_mid_epoch_goes_on_counting_and_ends_with_the_unrestarted_run_s_bits(tmp_path):
    steps = elastic.EXAMPLES // 16 + 1  # 6 rounds an epoch, the last one of 10 examples
    undisturbed = elastic_job()
    elastic_rounds(undisturbed, (0, 1), 2 * steps + 3)

    ps = elastic_job()
    elastic_rounds(ps, (0, 1), steps + 2)  # epoch 1 two rounds in
    back = through_a_file(tmp_path, ps)
    assert back.data.kind == "elastic" and back.data.micro_batches == 4 and back.round == steps + 2
    assert back.data.epochs_complete == (0,) and list(back.data.epochs_seen) == [1]
    assert back.data.epochs_seen[1].dtype == np.uint8 and back.data.epochs_seen[1].size == -(-90 // 8)
    assert back.mode_status.skipped_rounds == ()

    fresh = elastic.server(Clock())
    fresh.restore(back)
    assert fresh.status().epoch_examples == (90, 32)
    for w in (0, 1):
        fresh.register(w, 4)
    assert fresh.initialize(0, elastic.zeros(), elastic.ADAM, data_plan=elastic.PLAN)[0] is False  # harmless
    with pytest.raises(SpecConflict, match="data plan"):
        fresh.initialize(0, elastic.zeros(), elastic.ADAM, data_plan=DataPlan(90, 32, 5))
    elastic_rounds(fresh, (0, 1), 2 * steps + 3)

    assert fresh.status().epoch_examples == undisturbed.status().epoch_examples == (90, 90, 48)
    ours, theirs = fresh.pull()[1], undisturbed.pull()[1]
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_an_elastic_job_of_two_rounds_a_batch_restored_between_them_deals_the_batch_s_second_round(tmp_path):
    """A step of two updates (``DataPlan.applies`` 2): the checkpoint keeps the plan's rounds a
    batch; restored after round 2b, the server deals batch b again for round 2b + 1, counts
    its examples once, and ends at the unrestarted run's bits. Another ``applies`` is another plan."""
    plan = dataclasses.replace(elastic.PLAN, applies=2)

    def job():
        ps = elastic.server(Clock())
        for w in (0, 1):
            ps.register(w, 4)
        ps.initialize(0, elastic.zeros(), elastic.ADAM, data_plan=plan)
        return ps

    undisturbed = job()
    elastic_rounds(undisturbed, (0, 1), 15)
    ps = job()
    elastic_rounds(ps, (0, 1), 3)  # batch 1's first round done, its second not
    assert ps.status().epoch_examples == (16,)
    back = through_a_file(tmp_path, ps)
    assert back.data.applies == 2 and back.round == 3
    fresh = elastic.server(Clock())
    fresh.restore(back)
    for w in (0, 1):
        fresh.register(w, 4)
    assert fresh.initialize(0, elastic.zeros(), elastic.ADAM, data_plan=plan)[0] is False
    with pytest.raises(SpecConflict, match="data plan"):
        fresh.initialize(0, elastic.zeros(), elastic.ADAM, data_plan=elastic.PLAN)
    elastic_rounds(fresh, (0, 1), 15)
    assert fresh.status().epoch_examples == undisturbed.status().epoch_examples == (90, 16)
    ours, theirs = fresh.pull()[1], undisturbed.pull()[1]
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])


def test_the_elastic_snapshot_and_its_ledger_are_of_the_same_round():
    ps = elastic_job()
    elastic_rounds(ps, (0, 1), 2)
    work = ps.work(0).result()
    ps.submit(elastic.push(ps, 0, work, 0))  # round 2 in progress: in neither the values nor the ledger
    state = ps.checkpoint_state()
    assert state.version == state.round == 2
    assert EpochLedger.restore(90, state.data.epochs_complete, state.data.epochs_seen).count(0) == 32


@pytest.mark.parametrize("apply", ["locked", "hogwild"])
def test_checkpoints_taken_between_concurrent_pushes_hold_exactly_the_updates_of_their_done_tasks(apply):
    """Four workers push tasks from their own threads while the main thread takes checkpoints.
    Each checkpoint's version is its number of done tasks (nothing but task pushes, from
    version 0), its counts are its recorded tasks' examples, and (locked) its values are
    those of replaying exactly its recorded tasks."""
    plan = DataPlan(num_examples=2000, global_batch_size=8, seed=1, epochs=2)  # 500 tasks
    ps = task_job(plan=plan, num_workers=4, async_apply=apply)
    reference = TaskQueue(plan.num_examples, plan.global_batch_size, plan.seed, plan.epochs, 5.0)
    errors = []

    def worker(w):
        try:
            step = 0
            while (task := ps.work(w).result().task) is not None:
                ps.submit(task_push(ps, w, task, step)).result(JOIN)
                step += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    states = []
    while any(t.is_alive() for t in threads):
        states.append(checkpoint.decode(checkpoint.encode(ps.checkpoint_state())))
    for t in threads:
        t.join()
    assert not errors
    states.append(checkpoint.decode(checkpoint.encode(ps.checkpoint_state())))
    assert sum(0 < len(s.data.done_task_ids) < 500 for s in states) >= 3  # taken in the middle, several

    for state in states:
        ids = state.data.done_task_ids.tolist()
        assert state.version == len(ids) == state.stats["pushes_applied"]
        applied = np.zeros(plan.num_examples)
        per_epoch = [0, 0]
        for t in ids:
            task = reference.task(t)
            applied += counts(task.indices, plan.num_examples)["w"]
            per_epoch[task.epoch] += task.size
        if apply == "locked":  # hogwild's racing pushes may lose element updates, restart or not
            np.testing.assert_array_equal(state.values["w"], -applied)
        fresh = task_server(num_workers=4, async_apply=apply)
        fresh.restore(state)
        assert [fresh.tasks.examples_done(e) for e in (0, 1)] == per_epoch
    assert states[-1].data.done_task_ids.tolist() == list(range(500))


def test_a_checkpoint_s_counters_hold_exactly_its_done_tasks_though_a_push_comes_as_it_is_taken(monkeypatch):
    """Counters read after the gate opened could hold a push whose task the file lacks: that
    task is done again after a restart, and pushes_applied ends one over the tasks."""
    ps = task_job()
    for step in range(2):
        ps.submit(task_push(ps, 0, ps.work(0).result().task, step)).result(JOIN)
    coming = task_push(ps, 1, ps.work(1).result().task, 0)
    export, pushers = ps.stats.export, []

    def export_as_a_push_comes():
        pusher = threading.Thread(target=ps.submit, args=(coming,))
        pushers.append(pusher)
        pusher.start()
        pusher.join(0.5)  # under the gate the push waits for the checkpoint; after it, it is applied now
        return export()

    monkeypatch.setattr(ps.stats, "export", export_as_a_push_comes)
    state = ps.checkpoint_state()
    state.release()
    pushers[0].join(5)
    assert state.version == len(state.data.done_task_ids) == 2
    assert state.stats["pushes_applied"] == 2 and state.stats["examples_applied"] == 32
    assert ps.status().pushes_applied == 3  # the push came in once the checkpoint was taken


def test_the_elastic_snapshot_s_counters_are_of_its_round_though_a_round_completes_as_it_is_taken(monkeypatch):
    ps = elastic_job()
    elastic_rounds(ps, (0, 1), 2)
    counted = ps.status().pushes_applied
    export, rounds = ps.stats.export, []

    def export_as_a_round_completes():
        one_more = threading.Thread(target=elastic_rounds, args=(ps, (0, 1), 3))
        rounds.append(one_more)
        one_more.start()
        one_more.join(0.5)  # under the round's lock the round waits for the checkpoint
        return export()

    monkeypatch.setattr(ps.stats, "export", export_as_a_round_completes)
    state = ps.checkpoint_state()
    rounds[0].join(5)
    assert state.version == state.round == 2 and state.stats["pushes_applied"] == counted
    assert ps.store.version == 3 and ps.status().pushes_applied > counted


def test_a_checkpoint_is_taken_only_between_a_push_s_apply_and_its_task_s_record():
    """The gate: a checkpoint waits for pushes in flight and goes before pushes arriving after it."""
    gate, order = TaskGate(), []
    inside, leave = threading.Event(), threading.Event()

    def push():
        with gate.applying():
            inside.set()
            leave.wait(5)
            order.append("push")

    def snapshot():
        with gate.still():
            order.append("checkpoint")

    p = threading.Thread(target=push)
    p.start()
    inside.wait(5)
    s = threading.Thread(target=snapshot)
    s.start()
    deadline = time.monotonic() + 5
    while not gate._snapshots_waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    later = threading.Thread(target=lambda: (gate.applying().__enter__(), order.append("later")))
    later.start()
    leave.set()
    for t in (p, s, later):
        t.join(5)
    assert order == ["push", "checkpoint", "later"]


def test_a_checkpoint_whose_plan_does_not_fit_this_server_is_refused_and_changes_nothing():
    state = elastic_job().checkpoint_state()
    for ps, match in [
        (ParameterServer("sync", 4), "written by an elastic sync server .* not elastic"),
        (elastic.server(Clock(), micro_batches=2), "cut into 4 micro-batches; this server cuts them into 2"),
    ]:
        with pytest.raises(ConfigMismatch, match=match):
            ps.restore(state)
        assert not ps.store.initialized and ps.status().epoch_examples == () and ps.tasks is None
    tasks = task_job().checkpoint_state()
    sync = ParameterServer("sync", 3)
    with pytest.raises(ConfigMismatch, match="tasks .* this server runs sync"):
        sync.restore(dataclasses.replace(tasks, mode="sync"))
    assert not sync.store.initialized


def test_a_checkpoint_written_before_the_data_plan_reads_as_no_plan():
    ps = task_job()
    ps.submit(task_push(ps, 0, ps.work(0).result().task, 0)).result(JOIN)

    def as_before(header):
        header.pop("data")

    back = checkpoint.decode(_rewrite_header(checkpoint.encode(ps.checkpoint_state()), as_before))
    assert back.data is None
    fresh = task_server()
    fresh.restore(back)  # as before: the chief's initialize brings the plan, counting from 0
    assert fresh.tasks is None and fresh.store.version == 1


def test_the_ledger_s_state_keeps_complete_epochs_as_a_mark_and_refuses_a_bitmap_that_does_not_fit():
    ledger = EpochLedger(10)
    ledger.fold(0, np.arange(10))
    ledger.fold(1, np.array([0, 9]))
    complete, seen = ledger.state()
    assert complete == (0,) and list(seen) == [1] and seen[1].tolist() == [0b10000000, 0b01000000]
    back = EpochLedger.restore(10, complete, seen)
    assert [back.count(e) for e in (0, 1, 2)] == [10, 2, 0] and back.epochs() == [0, 1]
    with pytest.raises(InvalidArgument, match="twice"):
        back.fold(0, np.array([3]))  # a complete epoch refuses any example again
    with pytest.raises(InvalidArgument, match="twice"):
        back.fold(1, np.array([9]))
    with pytest.raises(InvalidArgument, match="holds 1 bytes; 10 examples take 2"):
        EpochLedger.restore(10, (), {1: np.zeros(1, np.uint8)})
    with pytest.raises(InvalidArgument, match="past example 9"):
        EpochLedger.restore(10, (), {1: np.array([0, 0b00100000], np.uint8)})
