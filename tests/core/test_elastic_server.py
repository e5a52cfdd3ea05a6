"""ParameterServer with elastic sync: registration, leases, leaving and the data plan drive
``core.modes.elastic_mode`` (the service and the worker come next)."""

import numpy as np
import pytest

from ps_server.core.data.cursor import DataPlan
from ps_server.core.errors import InvalidArgument, SpecConflict
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from tests.core.test_cursor import CLASSES, EXAMPLES, FEATURES, gradient
from tests.core.test_elastic_mode import Clock
from tests.core.threads import JOIN

PLAN = DataPlan(num_examples=EXAMPLES, global_batch_size=16, seed=5)
ADAM = OptimizerSpec("adam", learning_rate=0.05)


def zeros():
    return {"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)}


def server(clock, **kwargs):
    options = dict(num_workers=4, elastic_min_workers=2, micro_batches=4, lease_timeout=5.0, clock=clock)
    return ParameterServer("sync", **{**options, **kwargs})


def push(ps, worker, work, i=0):
    _, params = ps.pull(worker)
    m = work.micro_batches[i]
    indices = ps.mode.cursor.round(work.round, [worker]).indices(m)
    return Push(worker_id=worker, step=work.round, base_version=work.round, batch_size=work.sizes[i],
                gradients=gradient(params, indices), micro_batch=m)


def test_elastic_settings_that_cannot_work_are_refused_in_one_line():
    for kwargs, match in [
        (dict(mode="async"), "a sync mode's"),
        (dict(replicas_to_aggregate=1), "no backup workers"),
        (dict(elastic_min_workers=5), "above --num-workers 4"),
        (dict(elastic_min_workers=0, micro_batches=4), "elastic sync only"),
    ]:
        options = {"mode": "sync", "num_workers": 4, "elastic_min_workers": 2, **kwargs}
        with pytest.raises(InvalidArgument, match=match):
            ParameterServer(**options)


def test_the_data_plan_comes_with_initialize_and_nothing_is_stored_without_it():
    ps = server(Clock())
    ps.register(0, 4)
    with pytest.raises(InvalidArgument, match="needs the job's data plan"):
        ps.initialize(0, zeros(), ADAM)
    assert not ps.store.initialized
    assert ps.initialize(0, zeros(), ADAM, data_plan=PLAN) == (True, 0)
    assert ps.initialize(0, zeros(), ADAM, data_plan=PLAN) == (False, 0)  # the same again: harmless
    with pytest.raises(SpecConflict, match="data plan"):
        ps.initialize(0, zeros(), ADAM, data_plan=DataPlan(EXAMPLES, 32, 5))
    plain = ParameterServer("sync", 2)
    plain.register(0, 2)
    with pytest.raises(InvalidArgument, match="for elastic sync"):
        plain.initialize(0, zeros(), ADAM, data_plan=PLAN)
    with pytest.raises(InvalidArgument, match="work is dealt by elastic sync, or by async and ssp with a data plan"):
        plain.work(0)


def test_a_worker_whose_lease_runs_out_hands_its_part_to_the_waiting_one_and_a_new_one_joins():
    clock = Clock()
    ps = server(clock)
    for w in (0, 1):
        ps.register(w, 4)
    ps.initialize(0, zeros(), ADAM, data_plan=PLAN)
    w0, w1 = ps.work(0).result(), ps.work(1).result()
    assert (w0.micro_batches, w1.micro_batches) == ((0, 1), (2, 3))
    ps.submit(push(ps, 0, w0, 0))
    waiting = ps.submit(push(ps, 0, w0, 1))
    ps.submit(push(ps, 1, w1, 0))  # then worker 1 goes silent
    clock.now = 4.0
    ps.heartbeat(0)
    clock.now = 6.0
    assert ps.tick() == [1]
    moved = waiting.result().work
    assert moved.micro_batches == (3,)
    done = ps.submit(push(ps, 0, moved)).result().result
    assert done.version == 1 and ps.status().round == 1 and ps.status().active_workers == (0,)
    ps.register(2, 4)  # round 1 started with worker 0 alone: 2 takes part from round 2
    pending = ps.work(2)
    assert ps.work(0).result().micro_batches == (0, 1, 2, 3) and not pending.done()
    ps.leave(0)  # leaving mid-round gives its part back too: to 2, which was waiting
    assert pending.result().micro_batches == (0, 1, 2, 3)
    assert ps.members.snapshot()[0].pushes == 3  # every micro-batch push was counted


def test_the_same_rounds_with_and_without_a_death_end_with_the_same_bits():
    def rounds(kill):
        clock = Clock()
        ps = server(clock)
        for w in (0, 1, 2):
            ps.register(w, 4)
        ps.initialize(0, zeros(), ADAM, data_plan=PLAN)
        for r in range(6):
            works = {w: ps.work(w).result() for w in ps.status().active_workers if ps.work(w).done()}
            waiting = {}
            if kill and r == 2:  # worker 0 (micro-batches 0 and 1) delivers one, then falls silent
                assert works[0].micro_batches == (0, 1)
                ps.submit(push(ps, 0, works.pop(0)))
                clock.now += 6.0
                for w in (1, 2):
                    ps.heartbeat(w)
            while ps.store.version == r:
                if kill and r == 2 and ps.status().active_workers == (0, 1, 2) and not works:
                    assert ps.tick() == [0]
                for w, ticket in list(waiting.items()):
                    if ticket.done():
                        del waiting[w]
                        if ticket.result().work is not None:
                            works[w] = ticket.result().work
                w, work = works.popitem()
                ticket = ps.submit(push(ps, w, work))
                if ticket.done() and ticket.result().work is not None:
                    works[w] = ticket.result().work
                elif not ticket.done():
                    waiting[w] = ticket
        return ps.pull(1)[1], ps.mode.ledger.count(0)

    (undisturbed, count), (disturbed, counted) = rounds(False), rounds(True)
    for name in undisturbed:
        np.testing.assert_array_equal(disturbed[name], undisturbed[name])
    assert count == counted == EXAMPLES


def test_the_status_shows_who_joined_left_and_died_at_which_round():
    clock = Clock()
    ps = server(clock)
    for w in (0, 1):
        ps.register(w, 4)
    ps.initialize(0, zeros(), ADAM, data_plan=PLAN)
    for r in range(2):  # two rounds with workers 0 and 1
        for w in (0, 1):
            work = ps.work(w).result()
            tickets = [ps.submit(push(ps, w, work, i)) for i in range(len(work.micro_batches))]
        for t in tickets:
            t.result(JOIN)
    ps.register(2, 4)  # joins during round 2
    ps.leave(1)
    clock.now += 6  # worker 2 and 0 silent past the lease
    ps.heartbeat(0)
    ps.tick()
    s = ps.status()
    assert [(e.event, e.worker_id, e.round, e.version) for e in s.membership] == [
        ("joined", 0, 0, 0), ("joined", 1, 0, 0), ("joined", 2, 2, 2), ("left", 1, 2, 2), ("dead", 2, 2, 2)]
    assert s.membership_dropped == 0
