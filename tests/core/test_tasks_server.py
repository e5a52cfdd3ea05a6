"""ParameterServer in async and ssp with a data plan: batches handed out as tasks
(``core.data.tasks``), each applied exactly once whoever dies, leaves, retries or joins."""

import random

import numpy as np
import pytest

from ps_common.batches import global_batch
from ps_server.core.data.cursor import DataPlan
from ps_server.core.errors import BarrierTimeout, InvalidArgument, SpecConflict, UnknownWorker
from ps_server.core.modes.base import Push
from ps_server.core.parameter_server import ParameterServer
from tests.core.test_cursor import EXAMPLES, gradient
from tests.core.test_elastic_mode import Clock
from tests.core.test_elastic_server import ADAM, zeros
from tests.core.threads import JOIN

PLAN = DataPlan(num_examples=EXAMPLES, global_batch_size=16, seed=5, epochs=3)


def server(clock, mode="async", **kwargs):
    options = dict(num_workers=4, lease_timeout=5.0, clock=clock)  # ssp: S ahead of workers not yet joined too
    if mode == "ssp":
        options["staleness"] = 3
    ps = ParameterServer(mode, **{**options, **kwargs})
    return ps


def started(clock, mode="async", workers=(0, 1, 2), num_workers=4):
    ps = server(clock, mode, num_workers=num_workers)
    for w in workers:
        ps.register(w, num_workers)
    ps.initialize(0, zeros(), ADAM, data_plan=PLAN)
    return ps


def take(ps, worker):
    offer = ps.work(worker).result()
    return offer.task


def push_of(ps, worker, task, step=0, batch_size=None):
    version, params = ps.pull(worker)
    indices = global_batch(PLAN.num_examples, PLAN.global_batch_size, PLAN.seed, task.task_id)
    assert np.array_equal(indices, task.indices)  # a task is the plan's batch of that step
    return Push(worker_id=worker, step=step, base_version=version,
                batch_size=task.size if batch_size is None else batch_size,
                gradients=gradient(params, indices), task=task.task_id)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_each_task_is_applied_once_and_counted_per_epoch_in_status(mode):
    clock = Clock()
    ps = started(clock, mode, workers=(0,), num_workers=1)
    status = ps.status()
    assert status.tasks_total == 3 * -(-EXAMPLES // 16) and status.tasks_done == 0
    assert status.num_examples == EXAMPLES and status.epoch_examples == (0,)
    step = 0
    while (task := take(ps, 0)) is not None:
        result = ps.submit(push_of(ps, 0, task, step)).result(JOIN)
        assert not result.replayed
        step += 1
    status = ps.status()
    assert step == status.tasks_total == status.tasks_done == status.pushes_applied
    assert status.epoch_examples == (EXAMPLES,) * 3
    assert status.examples_applied == 3 * EXAMPLES
    assert ps.work(0).result().finished


def test_a_retried_push_of_a_done_task_is_answered_from_the_record_and_applied_once():
    clock = Clock()
    ps = started(clock)
    task = take(ps, 1)
    p = push_of(ps, 1, task)
    first = ps.submit(p).result(JOIN)
    again = ps.submit(p).result(JOIN)
    assert again.replayed and again.version == first.version
    ticket = ps.submit(p)  # the same through the non-blocking path
    assert ticket.result().replayed
    status = ps.status()
    assert status.pushes_applied == 1 and status.tasks_done == 1 and status.epoch_examples == (task.size,)
    with pytest.raises(InvalidArgument, match="already done by worker 1"):
        ps.submit(push_of(ps, 2, task)).result(JOIN)  # another worker's push of it: refused, nothing applied
    assert ps.status().pushes_applied == 1


def test_pushes_that_do_not_fit_the_tasks_are_refused_and_lose_nothing():
    clock = Clock()
    ps = started(clock)
    task = take(ps, 1)
    with pytest.raises(InvalidArgument, match="does not hold task"):
        ps.submit(push_of(ps, 2, task)).result(JOIN)  # not the holder
    no_task = push_of(ps, 1, task)
    with pytest.raises(InvalidArgument, match="dealt as tasks"):
        ps.submit(Push(no_task.worker_id, 0, no_task.base_version, no_task.batch_size, no_task.gradients)).result(JOIN)
    with pytest.raises(InvalidArgument, match=f"task {task.task_id} holds {task.size} examples"):
        ps.submit(push_of(ps, 1, task, batch_size=task.size - 1)).result(JOIN)
    assert ps.status().tasks_queued == 1  # the refused push's task went back ...
    again = take(ps, 2)
    assert again.task_id == task.task_id  # ... and is handed out first
    ps.submit(push_of(ps, 2, again)).result(JOIN)
    assert ps.status().pushes_applied == 1 and ps.status().epoch_examples == (task.size,)


def test_a_dead_or_leaving_workers_tasks_go_back_and_its_late_push_is_refused():
    clock = Clock()
    ps = started(clock)
    held = take(ps, 1)
    late = push_of(ps, 1, held)
    left = take(ps, 2)
    ps.leave(2)
    clock.now += 3.0
    ps.heartbeat(0)
    clock.now += 3.0  # worker 1 silent for 6 s > its 5 s lease: declared dead
    assert ps.tick() == [1]
    status = ps.status()
    assert status.tasks_queued == 2 and status.tasks_held == 0
    assert [take(ps, 0).task_id, take(ps, 0).task_id] == sorted([held.task_id, left.task_id])
    with pytest.raises(UnknownWorker, match="declared dead"):  # it must register again
        ps.submit(late).result(JOIN)
    ps.register(1, 4)
    with pytest.raises(InvalidArgument, match="held by worker 0"):
        ps.submit(late).result(JOIN)
    assert ps.status().pushes_applied == 0


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_later_plan_of_more_epochs_extends_a_finished_job_by_their_tasks_each_applied_once(mode):
    """A second ``fit`` of the same data: the chief initializes again with the epochs the job goes
    on to; a worker that found the job finished is handed the new epochs' tasks, in order."""
    clock = Clock()
    ps = started(clock, mode, workers=(0,), num_workers=1)
    per_epoch = -(-EXAMPLES // 16)
    step = 0
    while (task := take(ps, 0)) is not None:
        ps.submit(push_of(ps, 0, task, step)).result(JOIN)
        step += 1
    assert ps.work(0).result().finished
    assert ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5, epochs=5)) == (False, step)
    ids = []
    while (task := take(ps, 0)) is not None:
        ps.submit(push_of(ps, 0, task, step)).result(JOIN)
        ids.append(task.task_id)
        step += 1
    assert ids == list(range(3 * per_epoch, 5 * per_epoch))
    status = ps.status()
    assert status.tasks_total == status.tasks_done == 5 * per_epoch and status.epoch_examples == (EXAMPLES,) * 5
    assert ps.work(0).result().finished


def test_tasks_that_stop_within_a_pass_are_the_job_through_a_later_plan_and_a_checkpoint(tmp_path):
    """Keras' ``steps_per_epoch`` on tasks: a plan of ``tasks`` ends within its last pass (the
    ledger counts that pass short), a later one goes on within it and past it, and a
    checkpoint keeps the count: the restarted server hands out only what is left."""
    from ps_server.core.checkpoint import read_checkpoint, write_checkpoint

    clock = Clock()
    per_pass = -(-EXAMPLES // 16)
    ps = server(clock, num_workers=1)
    ps.register(0, 1)
    with pytest.raises(InvalidArgument, match="do not reach exactly 3 pass"):
        ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5, epochs=3, tasks=per_pass))
    ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5, epochs=2, tasks=per_pass + 3))
    step = 0
    while (task := take(ps, 0)) is not None:
        ps.submit(push_of(ps, 0, task, step)).result(JOIN)
        step += 1
    assert step == per_pass + 3 and ps.work(0).result().finished
    assert ps.status().epoch_examples == (EXAMPLES, 3 * 16)
    ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5, epochs=3, tasks=2 * per_pass + 1))
    for _ in range(per_pass - 3):
        task = take(ps, 0)
        ps.submit(push_of(ps, 0, task, step)).result(JOIN)
        step += 1
    restarted = ParameterServer("async", num_workers=1, lease_timeout=5.0, clock=clock)
    restarted.restore(read_checkpoint(write_checkpoint(str(tmp_path), ps.checkpoint_state())))
    restarted.register(0, 1)
    task = take(restarted, 0)
    assert task.task_id == 2 * per_pass and take(restarted, 0) is None  # the one left: pass 2's first
    restarted.submit(push_of(restarted, 0, task, step)).result(JOIN)
    assert restarted.status().epoch_examples == (EXAMPLES, EXAMPLES, 16) and restarted.work(0).result().finished


def test_the_data_plan_must_fit_the_job():
    clock = Clock()
    ps = server(clock)
    ps.register(0, 4)
    with pytest.raises(InvalidArgument, match="needs the job's epochs"):
        ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5))
    assert not ps.store.initialized
    ps.initialize(0, zeros(), ADAM, data_plan=PLAN)
    assert ps.initialize(0, zeros(), ADAM, data_plan=PLAN) == (False, 0)
    with pytest.raises(SpecConflict, match="data plan"):
        ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 6, epochs=3))  # another seed
    with pytest.raises(SpecConflict, match="data plan"):
        ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 8, 5, epochs=3))  # other batches
    assert ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5, epochs=2)) == (False, 0)  # fewer
    assert ps.status().tasks_total == 3 * -(-EXAMPLES // 16)  # a restarted chief's first fit changes nothing
    with pytest.raises(SpecConflict, match="dealt as tasks"):
        ps.initialize(0, zeros(), ADAM)
    plain = server(clock)
    plain.register(0, 4)
    plain.initialize(0, zeros(), ADAM)
    with pytest.raises(SpecConflict, match="without a data plan"):
        plain.initialize(0, zeros(), ADAM, data_plan=PLAN)
    with pytest.raises(InvalidArgument, match="without a data plan"):
        plain.work(0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_deaths_joins_and_retries_at_random_apply_every_example_exactly_once_per_epoch(mode, seed):
    """Workers take tasks, push them, retry pushes, die (lease) and leave at random; new
    ones join. At the end every task is done once and each epoch counted every example once."""
    rng = random.Random(seed)
    clock = Clock()
    ps = started(clock, mode, workers=(0, 1))
    live, holding, waiting, applied = {0, 1}, {}, {}, []
    steps = {0: 0, 1: 0}
    rounds = 0

    def settled():
        for w, (ticket, p) in list(waiting.items()):
            if ticket.done():
                del waiting[w]
                try:
                    if not ticket.result().replayed:
                        applied.append(p.task)
                except BarrierTimeout:  # ssp: applied, then the wait for the bound timed out
                    assert ps.tasks.record(p.task).worker_id == w
                    applied.append(p.task)

    while not ps.tasks.finished:
        rounds += 1
        assert rounds < 20_000
        settled()
        event = rng.random()
        if event < 0.05 and len(live) > 1:  # a worker dies silently: its lease runs out later
            w = rng.choice(sorted(live))
            live.discard(w)
            holding.pop(w, None)
            continue
        if event < 0.08 and len(live) > 1 and not waiting:
            w = rng.choice(sorted(live))
            ps.leave(w)
            live.discard(w)
            holding.pop(w, None)
            continue
        if event < 0.12:
            free = [w for w in range(4) if w not in live and w not in waiting]
            if free:
                w = free[0]
                ps.register(w, 4)
                live.add(w)
                steps[w] = ps.status().version  # where an ssp worker starts: anywhere at or after the slowest
            continue
        clock.now += 0.5
        for w in live:
            ps.heartbeat(w)
        ps.tick()
        w = rng.choice(sorted(live))
        if w in waiting:
            continue
        if w not in holding:
            task = take(ps, w)
            if task is not None:
                holding[w] = push_of(ps, w, task, step=steps[w])
            continue
        p = holding.pop(w)
        steps[w] += 1
        waiting[w] = (ps.submit(p), p)
        settled()
        if w not in waiting and rng.random() < 0.2:
            assert ps.submit(p).result(JOIN).replayed  # a retry after a lost reply
    settled()
    for w, (ticket, p) in waiting.items():  # ssp: applied, waiting for the bound still
        assert ps.tasks.record(p.task).worker_id == w
        applied.append(p.task)
    status = ps.status()
    assert sorted(applied) == list(range(status.tasks_total))  # each once
    assert status.epoch_examples == (EXAMPLES,) * PLAN.epochs
    assert status.pushes_applied == status.tasks_total


def test_ssp_with_tasks_bounds_only_the_live_workers_and_a_joiner_starts_at_the_slowest():
    clock = Clock()
    ps = started(clock, "ssp", workers=(0,))  # indices 1..3 never started: they hold nobody back
    for step in range(6):
        ticket = ps.submit(push_of(ps, 0, take(ps, 0), step))
        assert ticket.done() and not ticket.result().replayed
    reg = ps.register(1, 4)
    assert reg.round == 6  # worker 1 starts where worker 0 is, not at 0
    ticket = ps.submit(push_of(ps, 0, take(ps, 0), 6))
    assert ticket.done()  # worker 0 is not 3 ahead of worker 1's clock
    ticket = ps.submit(push_of(ps, 1, take(ps, 1), 6))
    assert ticket.done()
    assert ps.status().tasks_done == 8



@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_new_process_on_an_index_gets_its_held_task_back_in_the_queue_and_is_not_answered_from_the_old_ones(mode):
    # Issue 40: the chief restarted on its own index hung the job. The old process's held task
    # went back only when its lease ran out, which the new process kept renewing, and a push
    # whose step equalled the old process's last was answered from the old process's record.
    clock = Clock()
    ps = server(clock, mode)
    for w in (0, 1):
        ps.register(w, 4, process=f"first-{w}")
    ps.initialize(0, zeros(), ADAM, data_plan=PLAN)
    for step in range(3):
        ps.submit(push_of(ps, 0, take(ps, 0), step)).result(JOIN)
    held = take(ps, 0)  # held by the old process when it dies
    ps.register(0, 4, process="second-0")  # started again at once: its lease never ran out
    assert ps.status().tasks_queued == 1 and ps.status().tasks_held == 0
    again = take(ps, 0)
    assert again.task_id == held.task_id  # handed out first
    result = ps.submit(push_of(ps, 0, again, step=2)).result(JOIN)  # the new process's steps are its own
    assert not result.replayed
    assert ps.status().tasks_done == 4 and ps.status().pushes_applied == 4


def test_the_old_process_of_an_index_is_refused_when_it_registers_again():
    from ps_server.core.errors import Superseded
    ps = server(Clock())
    ps.register(1, 4, process="old")
    ps.register(1, 4, process="new")
    with pytest.raises(Superseded):
        ps.register(1, 4, process="old")


def test_epoch_examples_show_a_later_epoch_complete_before_an_earlier_one():
    clock = Clock()
    ps = started(clock, workers=(0, 1))
    first = take(ps, 1)  # epoch 0's first task, held while the rest is done
    step = 0
    while (task := take(ps, 0)) is not None and task.epoch < 2:
        ps.submit(push_of(ps, 0, task, step)).result(JOIN)
        step += 1
    assert task.epoch == 2  # taken, not pushed
    assert ps.status().epoch_examples == (EXAMPLES - first.size, EXAMPLES)  # epoch 1 shown, though 0 is not done


def test_a_step_of_two_applies_is_two_tasks_a_batch_through_a_checkpoint_between_them(tmp_path):
    """A data plan of ``applies`` 2 (``tfps.keras``: a GAN's step): each batch is two tasks, each
    one push applied once; the batch counts in its epoch at its second. A checkpoint between a
    batch's two tasks keeps the first done, and the restarted server hands out the second; a
    plan of one apply a batch belongs to another job."""
    from ps_server.core.checkpoint import read_checkpoint, write_checkpoint

    clock = Clock()
    per_pass = -(-EXAMPLES // 16)
    ps = server(clock, num_workers=1)
    ps.register(0, 1)
    ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5, epochs=1, applies=2))
    assert ps.status().tasks_total == 2 * per_pass
    for step in range(3):  # batch 0's two tasks, then batch 1's first
        task = take(ps, 0)
        assert task.task_id == step and np.array_equal(task.indices, global_batch(EXAMPLES, 16, 5, step // 2))
        version, params = ps.pull(0)
        ps.submit(Push(worker_id=0, step=step, base_version=version, batch_size=task.size,
                       gradients=gradient(params, task.indices), task=task.task_id)).result(JOIN)
    assert ps.status().epoch_examples == (16,) and ps.status().tasks_done == 3
    with pytest.raises(SpecConflict, match="2 tasks a batch"):
        ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 16, 5, epochs=1))
    restarted = ParameterServer("async", num_workers=1, lease_timeout=5.0, clock=clock)
    restarted.restore(read_checkpoint(write_checkpoint(str(tmp_path), ps.checkpoint_state())))
    restarted.register(0, 1)
    assert restarted.tasks.applies == 2 and take(restarted, 0).task_id == 3  # batch 1's second apply
    assert restarted.status().epoch_examples == (16,) and restarted.status().tasks_done == 3
