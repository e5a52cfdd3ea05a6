"""Shard groups, in-process: the model on two server shards where shard 0 decides what
each update holds, and shard 1 follows (``ps_server.core.modes.base.ShardGroup``).

- Elastic sync (``core.modes.elastic_mode``): shard 0 deals and commits, shard 1 folds
  whatever any worker pushes and applies a round when shard 0 commits it. The shards end
  with one server's bits, through a worker that dies between its two pushes, a round
  discarded by shard 0's barrier timeout, and with ``global_clipnorm`` taken over both.
- Async tasks (``core.data.tasks``): each shard applies each task once.
- Sync with backup workers (``core.modes.sync_mode``): shard 0 picks each round's
  contributors and shard 1 steps with the same ones: one server's bits.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ps_server.core import checkpoint
from ps_server.core.clip_group import ClipGroup
from ps_server.core.data.cursor import DataPlan
from ps_server.core.errors import ConfigMismatch, InvalidArgument, SpecConflict
from ps_server.core.modes.base import Push, ShardGroup
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from tests.core.test_cursor import CLASSES, EXAMPLES, FEATURES, gradient
from tests.core.test_elastic_mode import Clock

ADDRESSES = ("shard0:1", "shard1:1")
ON = ({"w"}, {"b"})  # what each shard holds
ADAM = OptimizerSpec("adam", learning_rate=0.05)
CLIPPED = OptimizerSpec("adamw", learning_rate=0.05, global_clipnorm=0.05)


def start():
    rng = np.random.default_rng(3)
    return {"w": rng.normal(size=(FEATURES, CLASSES)).astype(np.float32),
            "b": rng.normal(size=CLASSES).astype(np.float32)}


PLAN = DataPlan(EXAMPLES, 16, 5)


def group(shard):
    return ShardGroup(ADDRESSES, shard)


def server(clock, **kwargs):
    options = dict(num_workers=3, elastic_min_workers=2, micro_batches=4, lease_timeout=5.0, clock=clock,
                   barrier_timeout=30.0)
    return ParameterServer("sync", **{**options, **kwargs})


def one_server(clock, spec, workers=(0, 1)):
    ps = server(clock)
    for w in workers:
        ps.register(w, 3)
    ps.initialize(0, start(), spec, data_plan=PLAN)
    return ps


def two_shards(clock, spec, workers=(0, 1)):
    """Shard 1 follows shard 0: shard 0 commits rounds there (as the CommitRound call does);
    with ``global_clipnorm`` shard 1 asks shard 0's board (as the ClipNorm call does)."""
    shards = [server(clock), server(clock)]
    shards[0].round_peer = lambda address: (lambda r, contributors, timeout: shards[1].commit_round(r, contributors))
    shards[1].clip_peer = lambda address: (
        lambda key, shard, squares, timeout: shards[0].clip_norm(key, shard, squares).result(timeout))
    for i, (ps, names) in enumerate(zip(shards, ON)):
        for w in workers:
            ps.register(w, 3)
        clip = ClipGroup(ADDRESSES, i, ("w", "b")) if spec.global_clipnorm else None
        ps.initialize(0, {n: v for n, v in start().items() if n in names}, spec, data_plan=PLAN,
                      clip_group=clip, shard_group=group(i))
    return shards


def params(servers):
    out = {}
    for ps in servers:
        out.update(ps.pull()[1])
    return out


def micro_push(servers, worker, work, m, only=None):
    """Worker ``worker`` computes micro-batch ``m`` of ``work`` on the shards' parameters and
    pushes it, shard 1 first (``only``: to those shards alone); shard 0's answer."""
    values = params(servers)
    indices = servers[0].mode.cursor.round(work.round, [worker]).indices(m)
    grads = gradient(values, indices)
    size = work.sizes[work.micro_batches.index(m)]
    order = list(reversed(range(len(servers)))) if only is None else only
    answer = None
    for i in order:
        names = ON[i] if len(servers) > 1 else {"w", "b"}
        p = Push(worker_id=worker, step=work.round, base_version=work.round, batch_size=size,
                 gradients={n: g for n, g in grads.items() if n in names}, micro_batch=m)
        ticket = servers[i].submit(p)
        answer = ticket if i == 0 else ticket.result(5)
    return answer


def run_rounds(servers, rounds, die_at=None):
    """Workers 0 and 1 take their micro-batches each round; at round ``die_at`` worker 1
    pushes its first micro-batch to shard 1 alone, then dies (its lease ends): shard 0 deals
    it to worker 0."""
    dead = False
    for r in range(rounds):
        live = [0] if dead else [0, 1]
        works = {w: servers[0].work(w).result(5) for w in live}
        waiting = []
        for w in live:
            work = works[w]
            todo = list(work.micro_batches)
            if w == 1 and r == die_at:
                micro_push(servers, 1, work, todo[0], only=[1] if len(servers) > 1 else [])
                for ps in servers:
                    ps.leave(1)
                dead = True
                continue
            while todo:
                m = todo.pop(0)
                ticket = micro_push(servers, w, work, m)
                if not todo:
                    waiting.append((w, work, ticket))
        for w, work, ticket in waiting:
            reply = ticket.result(5)
            while reply.work is not None:  # a dead worker's part came to it
                for m in reply.work.micro_batches:
                    reply = micro_push(servers, w, reply.work, m).result(5)
        assert all(ps.store.version == r + 1 for ps in servers)


@pytest.mark.parametrize("spec", [ADAM, CLIPPED], ids=["adam", "global_clipnorm"])
def test_two_shards_end_with_one_server_s_bits_through_a_worker_dying_between_its_pushes(spec):
    one, shards = one_server(Clock(), spec), two_shards(Clock(), spec)
    run_rounds([one], 6, die_at=3)
    run_rounds(shards, 6, die_at=3)
    mine, theirs = params([one]), params(shards)
    for n in mine:
        np.testing.assert_array_equal(mine[n], theirs[n])
    assert [s.mode.ledger.count(0) for s in shards] == [one.mode.ledger.count(0)] * 2
    # Something really was clipped: the same run without global_clipnorm ends elsewhere.
    if spec is CLIPPED:
        plain = one_server(Clock(), OptimizerSpec("adamw", learning_rate=0.05))
        run_rounds([plain], 6, die_at=3)
        assert not np.array_equal(params([plain])["w"], mine["w"])


def test_a_round_shard_0_discards_is_collected_again_and_the_follower_folds_each_micro_batch_once():
    clock = Clock()
    shards = two_shards(clock, ADAM)
    one = one_server(Clock(), ADAM)
    works = {w: shards[0].work(w).result(5) for w in (0, 1)}
    for m in works[0].micro_batches:
        micro_push(shards, 0, works[0], m)
    clock.now = 31.0
    for ps in shards:
        ps.heartbeat(0), ps.heartbeat(1)
    shards[0].tick()  # worker 1 never pushed: shard 0 discards round 0
    shards[1].tick()  # a follower never times a round out
    assert [ps.store.version for ps in shards] == [0, 0]
    assert shards[1].mode._work.outstanding == (2, 3)
    run_rounds(shards, 3)  # round 0 dealt again: its repeats reach shard 1 as repeats
    run_rounds([one], 3)
    mine, theirs = params([one]), params(shards)
    for n in mine:
        np.testing.assert_array_equal(mine[n], theirs[n])


def test_a_follower_refuses_to_commit_a_round_it_lacks_and_to_deal():
    shards = two_shards(Clock(), ADAM)
    work = shards[0].work(0).result(5)
    micro_push(shards, 0, work, work.micro_batches[0], only=[1])
    with pytest.raises(ConfigMismatch, match=r"lacks micro-batch\(es\) \[1, 2, 3\] of round 0"):
        shards[1].commit_round(0)
    assert shards[1].store.version == 0
    with pytest.raises(InvalidArgument, match="shard 0 deals the work"):
        shards[1].work(0).result(5)
    with pytest.raises(InvalidArgument, match="follows no shard 0"):
        shards[0].commit_round(0)
    with pytest.raises(SpecConflict, match="shard 1 of"):
        shards[1].initialize(0, {"b": start()["b"]}, ADAM, data_plan=PLAN, shard_group=group(0))
    lonely = server(Clock())
    lonely.register(0, 3)
    with pytest.raises(InvalidArgument, match="no peer connector"):
        lonely.initialize(0, start(), ADAM, data_plan=PLAN, shard_group=group(0))
    with pytest.raises(InvalidArgument, match="at least 2"):
        ShardGroup(("a:1",), 1)


def test_a_shard_s_checkpoint_keeps_its_place_among_the_shards(tmp_path):
    shards = two_shards(Clock(), ADAM)
    run_rounds(shards, 2)
    for i, ps in enumerate(shards):
        path = checkpoint.write_checkpoint(str(tmp_path / f"s{i}"), ps.checkpoint_state())
        state = checkpoint.read_checkpoint(path)
        assert state.shard_group == group(i)
        again = server(Clock())
        again.round_peer = shards[0].round_peer
        again.restore(state)
        assert again.shard_group == group(i) and again.mode.shard == i
        assert (again.mode.commit is not None) == (i == 0)


# -- async tasks over two shards (core.data.tasks, "Over several shards") ---------------------

TASKS = DataPlan(EXAMPLES, 16, 5, epochs=2)


def task_shards(clock):
    shards = [ParameterServer("async", 3, lease_timeout=5.0, clock=clock) for _ in ON]
    for i, (ps, names) in enumerate(zip(shards, ON)):
        for w in (0, 1):
            ps.register(w, 3)
        ps.initialize(0, {n: v for n, v in start().items() if n in names}, ADAM, data_plan=TASKS,
                      shard_group=group(i))
    return shards


def task_push(ps, worker, task, names):
    indices = ps.tasks.task(task).indices
    grads = gradient({**start(), **ps.pull()[1]}, indices)
    return ps.submit(Push(worker_id=worker, step=task, base_version=ps.store.version, batch_size=len(indices),
                          gradients={n: grads[n] for n in names}, task=task)).result(5)


def test_each_shard_applies_each_task_once_when_a_lease_runs_out_between_a_worker_s_two_pushes():
    clock = Clock()
    shards = task_shards(clock)
    leader, follower = shards
    with pytest.raises(InvalidArgument, match="shard 0 hands out the tasks"):
        follower.work(0)
    first = leader.work(0).result(5).task
    task_push(follower, 0, first.task_id, ON[1])  # worker 0 took it to shard 1, then stalled
    clock.now = 6.0
    leader.heartbeat(1)
    leader.tick()  # its lease ran out: the task goes back, to worker 1
    again = leader.work(1).result(5).task
    assert again.task_id == first.task_id
    replay = task_push(follower, 1, again.task_id, ON[1])  # done here already: answered, not applied
    assert replay.replayed and follower.store.version == 1
    assert not task_push(leader, 1, again.task_id, ON[0]).replayed
    leader.register(0, 3)  # worker 0 comes back (it was declared dead): its push is refused by shard 0
    with pytest.raises(InvalidArgument, match="already done by worker 1"):
        task_push(leader, 0, first.task_id, ON[0])
    while True:  # the rest, worker 0 alone, each to shard 1 then shard 0
        offer = leader.work(0).result(5)
        if offer.task is None:
            assert offer.finished, (leader.tasks.status(), leader.tasks._holder)
            break
        task_push(follower, 0, offer.task.task_id, ON[1])
        task_push(leader, 0, offer.task.task_id, ON[0])
    total = 2 * -(-EXAMPLES // 16)
    for ps in shards:
        assert ps.tasks.finished and ps.store.version == total
        assert [ps.tasks.examples_done(e) for e in (0, 1)] == [EXAMPLES, EXAMPLES]
    assert follower.checkpoint_state().shard_group == group(1)


def test_a_follower_that_lost_rounds_or_a_shard_0_that_did_stops_the_job_in_one_line():
    """One shard restarted from an older checkpoint: the follower behind shard 0 (a push of a
    round it never applied), or shard 0 behind the follower (a commit of a round it applied)."""
    shards = two_shards(Clock(), ADAM)
    run_rounds(shards, 2)
    follower = shards[1]
    follower.mode.restore(dataclasses.replace(follower.mode.status(), round=1))  # as if restored at round 1
    work = shards[0].work(0).result(5)
    with pytest.raises(ConfigMismatch, match=r"worker 0 pushes round 2, which shard 0 deals.*Start the job again"):
        micro_push(shards, 0, work, work.micro_batches[0], only=[1])
    with pytest.raises(ConfigMismatch, match="shard 0 commits round 0"):
        follower.commit_round(0)  # shard 0 restarted at round 0: it commits a round applied here



# -- sync with backup workers over two shards (core.modes.sync_mode) -------------------------

def backup_servers(spec, shards: int):
    """Three workers, two contributions a round (``replicas_to_aggregate`` 2)."""
    options = dict(num_workers=3, replicas_to_aggregate=2, barrier_timeout=30.0)
    if shards == 1:
        one = ParameterServer("sync", **options)
        for w in range(3):
            one.register(w, 3)
        one.initialize(0, start(), spec)
        return [one]
    servers = [ParameterServer("sync", **options) for _ in ON]
    servers[0].round_peer = lambda address: (lambda r, contributors, timeout: servers[1].commit_round(r, contributors))
    servers[1].clip_peer = lambda address: (
        lambda key, shard, squares, timeout: servers[0].clip_norm(key, shard, squares).result(timeout))
    for i, (ps, names) in enumerate(zip(servers, ON)):
        for w in range(3):
            ps.register(w, 3)
        clip = ClipGroup(ADDRESSES, i, ("w", "b")) if spec.global_clipnorm else None
        ps.initialize(0, {n: v for n, v in start().items() if n in names}, spec, clip_group=clip,
                      shard_group=group(i))
    return servers


def backup_push(servers, worker, step):
    """``worker``'s gradient of its shard of round ``step``, to shard 1 first; shard 0's ticket."""
    values = params(servers)
    indices = np.arange(worker * 10, worker * 10 + 10) + step % 3
    grads = gradient(values, indices)
    ticket = None
    for i in reversed(range(len(servers))):
        names = ON[i] if len(servers) > 1 else {"w", "b"}
        ticket = servers[i].submit(Push(worker_id=worker, step=step, base_version=servers[i].store.version,
                                        batch_size=10, gradients={n: grads[n] for n in names}))
        if i:
            assert ticket.result(5).contributors == 0  # a follower takes it and answers at once
    return ticket


@pytest.mark.parametrize("spec", [ADAM, CLIPPED], ids=["adam", "global_clipnorm"])
def test_backup_workers_over_two_shards_step_with_shard_0_s_contributors_as_one_server(spec):
    one, shards = backup_servers(spec, 1), backup_servers(spec, 2)
    for servers in (one, shards):
        for step in range(5):
            order = [(step + k) % 3 for k in range(3)]  # who comes last (and is dropped) changes
            first = [backup_push(servers, w, step) for w in order[:2]]
            assert [t.result(5).contributors for t in first] == [2, 2]
            late = backup_push(servers, order[2], step).result(5)
            assert late.dropped
    mine, theirs = params(one), params(shards)
    for n in mine:
        np.testing.assert_array_equal(mine[n], theirs[n])
    assert [s.store.version for s in shards] == [5, 5]


def test_a_follower_lacking_a_contributor_s_push_refuses_the_commit_and_the_round_fails_loudly():
    leader, follower = backup_servers(ADAM, 2)
    tickets = [leader.submit(Push(worker_id=w, step=0, base_version=0, batch_size=10,
                                  gradients={"w": np.ones((FEATURES, CLASSES), np.float32)})) for w in (0, 1)]
    for t in tickets:  # they never went to shard 1 first
        with pytest.raises(ConfigMismatch, match=r"lacks the push\(es\) of worker\(s\) \[0, 1\]"):
            t.result(5)
    assert follower.store.version == 0


def test_a_follower_steps_with_shard_0_s_contributors_whatever_order_pushes_reached_it():
    """Every push reaches shard 1 first, in worker order; shard 0 sees them in another order
    and drops another worker each round: shard 1 drops the same one."""
    one, (leader, follower) = backup_servers(ADAM, 1)[0], backup_servers(ADAM, 2)
    for step in range(4):
        values = params([leader, follower])
        grads = {w: gradient(values, np.arange(w * 10, w * 10 + 10) + step) for w in range(3)}
        for w in range(3):
            follower.submit(Push(worker_id=w, step=step, base_version=step, batch_size=10,
                                 gradients={"b": grads[w]["b"]})).result(5)
        order = [(step + 2 - k) % 3 for k in range(3)]
        for ps, names in ((leader, {"w"}), (one, {"w", "b"})):
            tickets = [ps.submit(Push(worker_id=w, step=step, base_version=step, batch_size=10,
                                      gradients={n: grads[w][n] for n in names})) for w in order]
            assert [t.result(5).dropped for t in tickets] == [False, False, True]
        assert follower.store.version == step + 1
    mine, theirs = params([one]), params([leader, follower])
    for n in mine:
        np.testing.assert_array_equal(mine[n], theirs[n])
