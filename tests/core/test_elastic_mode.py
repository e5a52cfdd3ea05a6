"""core.modes.elastic_mode: sync rounds whose workers come and go, through the mode's own tickets.

The last test drives simulated workers through ``work``/``submit`` with deaths and joins at
random moments (seeded) and compares the final parameters with the undisturbed run's, bit
for bit, and the ledger's count of every epoch with the dataset's size.
"""

import dataclasses

import numpy as np
import pytest

from ps_common.names import SKIP_UPDATE
from ps_server.core.data.cursor import Cursor
from ps_server.core.modes.elastic_mode import ElasticReply, ElasticSyncMode, Work
from ps_server.core.errors import BarrierTimeout, FutureRound, InvalidArgument, StaleRound, WorkerDead
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.store import VariableStore
from tests.core.test_cursor import EXAMPLES, FEATURES, CLASSES, gradient


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(micro_batches=4, min_workers=2, workers=(0, 1), batch=16, clock=None, spec=None, store=None):
    if store is None:
        store = VariableStore()
        store.initialize({"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)},
                         spec or OptimizerSpec("adam", learning_rate=0.05))
    mode = ElasticSyncMode(store, Membership(16), Cursor(EXAMPLES, batch, seed=5, micro_batches=micro_batches),
                           min_workers=min_workers, barrier_timeout=30.0, clock=clock or Clock())
    for w in workers:
        mode.worker_joined(w)
    return mode, store


def push_of(mode, store, worker, work, i=0):
    """Worker ``worker``'s push of the ``i``-th micro-batch of ``work``, computed on the round's parameters."""
    _, params = store.read()
    m = work.micro_batches[i]
    indices = mode.cursor.round(work.round, [worker]).indices(m)
    return Push(worker_id=worker, step=work.round, base_version=work.round, batch_size=work.sizes[i],
                gradients=gradient(params, indices), micro_batch=m)


def test_a_round_is_dealt_answered_as_it_goes_and_completed_by_its_last_micro_batch():
    mode, store = make()
    w0, w1 = mode.work(0).result(), mode.work(1).result()
    assert (w0.round, w0.micro_batches, w1.micro_batches) == (0, (0, 1), (2, 3)) and w0.sizes == (4, 4)
    first = mode.submit(push_of(mode, store, 0, w0, 0)).result()
    assert first == ElasticReply(work=Work(0, (1,), (4,)))  # go on: one left
    last_of_0 = mode.submit(push_of(mode, store, 0, w0, 1))
    assert not last_of_0.done()  # waits for the round
    mode.submit(push_of(mode, store, 1, w1, 0))
    done = mode.submit(push_of(mode, store, 1, w1, 1)).result()
    assert done.result.version == 1 and done.result.contributors == 2 and done.result.next_step == 1
    assert last_of_0.result() == done and store.version == 1
    assert mode.work(0).result().round == 1 and mode.ledger.count(0) == 16


def test_the_first_round_waits_for_min_workers_and_a_late_joiner_takes_the_next_round():
    mode, store = make(workers=(0,))
    asked = mode.work(0)
    assert not asked.done() and mode.status().round == 0
    mode.worker_joined(1)
    assert asked.result().micro_batches == (0, 1)
    mode.worker_joined(2)  # round 0 has no unowned work: 2 waits for round 1
    later = mode.work(2)
    assert not later.done()
    for w in (0, 1):
        work = mode.work(w).result()
        for i in range(len(work.micro_batches)):
            mode.submit(push_of(mode, store, w, work, i))
    assert later.result() == Work(1, (3,), (4,)) and mode.work(0).result().micro_batches == (0, 1)


def test_after_the_first_round_rounds_go_on_below_min_workers():
    mode, store = make(min_workers=2)
    for w in (0, 1):
        work = mode.work(w).result()
        for i in range(len(work.micro_batches)):
            mode.submit(push_of(mode, store, w, work, i))
    mode.workers_died([1])  # between rounds: round 1 was dealt to both, 1's part moves to 0
    work = mode.work(0).result()
    assert work == Work(1, (0, 1, 2, 3), (4, 4, 4, 4))
    for i in range(4):
        mode.submit(push_of(mode, store, 0, work, i))
    assert store.version == 2 and mode.work(0).result().round == 2  # and round 2 starts with one worker


def test_a_dead_worker_s_undelivered_micro_batch_goes_to_the_waiting_worker():
    mode, store = make()
    w0, w1 = mode.work(0).result(), mode.work(1).result()
    mode.submit(push_of(mode, store, 0, w0, 0))
    waiting = mode.submit(push_of(mode, store, 0, w0, 1))
    mode.submit(push_of(mode, store, 1, w1, 0))  # micro-batch 2 in; 3 never comes
    dead_wait = mode.work(1)
    assert dead_wait.result().micro_batches == (3,)
    mode.workers_died([1])
    moved = waiting.result()
    assert moved == ElasticReply(work=Work(0, (3,), (4,)))
    done = mode.submit(push_of(mode, store, 0, moved.work)).result()
    assert done.result.version == 1 and done.result.contributors == 2
    assert mode.ledger.count(0) == 16 and mode.status().active_workers == (0,)
    with pytest.raises(InvalidArgument, match="has not joined"):
        mode.submit(push_of(mode, store, 1, Work(1, (2,), (4,)))).result()


def test_a_dead_worker_s_own_wait_fails_and_nobody_left_keeps_the_round_for_a_joiner():
    mode, store = make()
    work = mode.work(0).result()
    mode.submit(push_of(mode, store, 0, work, 0))
    wait = mode.submit(push_of(mode, store, 0, work, 1))
    again = mode.submit(push_of(mode, store, 0, work, 1))  # a repeat: not folded again, waits too
    assert not wait.done() and not again.done()
    mode.workers_died([0])
    for ticket in (wait, again):
        with pytest.raises(WorkerDead, match="worker 0 was declared dead"):
            ticket.result()
    mode.workers_died([1])  # before it pushed: micro-batches 2 and 3 have nobody
    assert mode.status().waiting_for == () and mode.status().active_workers == ()
    mode.worker_joined(7)
    rest = mode.work(7).result()
    assert rest == Work(0, (2, 3), (4, 4))
    mode.submit(push_of(mode, store, 7, rest, 0))
    assert mode.submit(push_of(mode, store, 7, rest, 1)).result().result.version == 1
    assert mode.ledger.count(0) == 16  # worker 0's two micro-batches stayed folded


def test_repeats_are_answered_not_folded_and_bad_pushes_change_nothing():
    mode, store = make()
    w0, w1 = mode.work(0).result(), mode.work(1).result()
    good = push_of(mode, store, 0, w0, 0)
    for bad, error, match in [
        (Push(0, 0, 0, 3, good.gradients, micro_batch=0), InvalidArgument, "holds 4 examples; the push says 3"),
        (Push(0, 0, 0, 4, good.gradients, micro_batch=9), InvalidArgument, "micro-batches 0..3, not 9"),
        (Push(0, 0, 0, 4, good.gradients), InvalidArgument, "names its micro-batch"),
        (Push(0, 0, 0, 4, good.gradients, micro_batch=2), InvalidArgument, "dealt to worker 1, not to worker 0"),
        (Push(0, 1, 0, 4, good.gradients, micro_batch=0), FutureRound, "collecting round 0"),
        (Push(5, 0, 0, 4, good.gradients, micro_batch=0), InvalidArgument, "has not joined"),
        (Push(0, 0, 0, 4, good.gradients, micro_batch=0, metrics={"m": np.zeros(1, np.float32)}),
         InvalidArgument, "sums no metrics over a round"),
    ]:
        with pytest.raises(error, match=match):
            mode.submit(bad).result()
    assert mode.work(0).result() == w0 and mode.work(1).result() == w1  # nothing was taken
    for w, work in ((0, w0), (1, w1)):
        for i in range(2):
            mode.submit(push_of(mode, store, w, work, i))
    replay = mode.submit(good).result()
    assert replay.result.replayed and replay.result.version == 1 and store.version == 1
    with pytest.raises(StaleRound, match="completed without it"):
        mode.submit(Push(0, 0, 0, 4, good.gradients, micro_batch=7)).result()
    assert mode.ledger.count(0) == 16


def test_a_worker_given_no_work_within_the_barrier_timeout_is_told_why():
    clock = Clock()
    mode, store = make(workers=(0,), clock=clock)  # one of at least two: no round starts
    asked = mode.work(0)
    clock.now = 29.0
    mode.expire_overdue()
    assert not asked.done()
    clock.now = 30.0
    mode.expire_overdue()
    with pytest.raises(BarrierTimeout, match="no work within 30 s .*1 of at least 2 workers joined"):
        asked.result()
    again = mode.work(0)
    mode.worker_joined(1)
    assert again.result().micro_batches == (0, 1)


def test_a_round_out_of_time_is_discarded_uncounted_and_dealt_again():
    clock = Clock()
    mode, store = make(clock=clock)
    w0 = mode.work(0).result()
    mode.submit(push_of(mode, store, 0, w0, 0))
    waiting = mode.submit(push_of(mode, store, 0, w0, 1))
    clock.now = 31.0
    mode.expire_overdue()
    with pytest.raises(BarrierTimeout, match=r"micro-batch\(es\) \[2, 3\] \(of worker\(s\) \[1\]\)"):
        waiting.result()
    assert store.version == 0 and mode.ledger.count(0) == 0 and mode.status().rounds_timed_out == 1
    assert mode.work(0).result() == w0  # dealt again from the start: 0's pushes are needed again
    for w in (0, 1):
        work = mode.work(w).result()
        for i in range(2):
            mode.submit(push_of(mode, store, w, work, i))
    assert store.version == 1 and mode.ledger.count(0) == 16


def run(rounds, micro_batches, seed=None):
    """Simulated workers through the mode: every live worker asks for work, computes one
    micro-batch at a time (in a random interleaving with ``seed``) and pushes it; a push
    that waits is looked at again on later passes. With ``seed``, workers die at random
    moments (never the last) and new ones join."""
    mode, store = make(micro_batches=micro_batches, min_workers=1, workers=range(micro_batches))
    rng = np.random.default_rng(seed) if seed is not None else None
    next_id = micro_batches
    todo, waiting = {}, {}  # worker -> its Work; worker -> the ticket of its push that waits
    seen = {"deaths": 0, "joins": 0, "moved": 0}
    for _ in range(100 * rounds * micro_batches):  # bounded: a lost micro-batch fails, never hangs
        if store.version >= rounds:
            break
        live = mode.status().active_workers
        for w in live:
            ticket = waiting.get(w)
            if ticket is not None and ticket.done():
                del waiting[w]
                reply = ticket.result()
                if reply.work is not None:  # a dead worker's micro-batch, moved to w
                    todo[w] = reply.work
            if w not in todo and w not in waiting:
                asked = mode.work(w)
                if asked.done():
                    todo[w] = asked.result()
        if rng is not None and rng.random() < 0.12 and len(live) > 1:
            victim = int(rng.choice(live))
            seen["moved"] += victim in mode.status().waiting_for  # it owed micro-batches: they move
            mode.workers_died([victim])
            seen["deaths"] += 1
            todo.pop(victim, None)
            waiting.pop(victim, None)
            continue
        if rng is not None and rng.random() < 0.12:
            mode.worker_joined(next_id)
            seen["joins"] += 1
            next_id += 1
            continue
        ready = sorted(todo)
        w = ready[int(rng.integers(len(ready)))] if rng is not None else ready[0]
        ticket = mode.submit(push_of(mode, store, w, todo.pop(w)))
        if ticket.done() and ticket.result().work is not None:
            todo[w] = ticket.result().work
        elif not ticket.done():
            waiting[w] = ticket
    else:
        raise AssertionError(f"stuck at round {store.version}: {mode.status()}")
    _, final = store.read()
    return final, mode, seen


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_deaths_and_joins_at_random_moments_end_with_the_undisturbed_bits_every_example_once(seed):
    rounds = 3 * Cursor(EXAMPLES, 16, 5, 3).steps_per_epoch
    undisturbed, _, _ = run(rounds, micro_batches=3)
    disturbed, mode, seen = run(rounds, micro_batches=3, seed=seed)
    assert seen["deaths"] >= 3 and seen["joins"] >= 2 and seen["moved"] >= 1  # the churn happened
    for name in undisturbed:
        np.testing.assert_array_equal(disturbed[name], undisturbed[name])
    assert mode.ledger.count(0) == mode.ledger.count(1) == mode.ledger.count(2) == EXAMPLES
    assert np.abs(undisturbed["w"]).max() > 0.05


def test_a_restored_round_goes_on_with_fewer_workers_than_min_workers():
    # docs/elastic.md: the minimum gates the job's first round only, across restores too.
    mode, store = make(min_workers=2, workers=(0, 1))
    for w in (0, 1):
        work = mode.work(w).result()
        for i in range(len(work.micro_batches)):
            mode.submit(push_of(mode, store, w, work, i))
    _, status = mode.export_state()
    restored, _ = make(min_workers=2, workers=())
    restored.restore(status)
    restored.worker_joined(0)  # one live worker of a minimum of two
    assert restored.work(0).result(5.0) == Work(1, (0, 1, 2, 3), (4, 4, 4, 4))


def test_a_rate_the_pushes_set_is_the_round_s_and_two_rates_in_one_round_are_refused():
    """Every worker sends the epoch's agreed learning rate with each push: it is set at the
    round's completion, before its update (Adam's first step moves each weight by about the
    rate); a push naming another rate in the same round is refused and changes nothing."""
    mode, store = make()
    w0, w1 = mode.work(0).result(), mode.work(1).result()
    pushes = [(w, work, i) for w, work in ((0, w0), (1, w1)) for i in range(2)]
    mode.submit(dataclasses.replace(push_of(mode, store, *pushes[0]), set_learning_rates=(0.5,)))
    other = dataclasses.replace(push_of(mode, store, *pushes[1]), set_learning_rates=(0.25,))
    with pytest.raises(InvalidArgument, match=r"sets the learning rates \(0.25,\) for round 0, another push of it \(0.5,\)"):
        mode.submit(other).result()
    for w, work, i in pushes[1:]:
        mode.submit(push_of(mode, store, w, work, i))  # no rate: unchanged, the round's is 0.5
    assert store.version == 1 and store.current_learning_rate() == 0.5
    _, params = store.read()
    assert np.allclose(np.abs(params["b"]), 0.5, rtol=1e-3)  # Adam's first step: lr * sign(g)


def test_a_push_asking_to_skip_completes_its_round_without_an_update_and_later_work_names_the_round():
    """A loss scale's skip (``SKIP_UPDATE`` > 0 on any micro-batch's push, as ``tfps.keras``
    sends it under ``mixed_float16``): the round completes at the next version with no
    variable changed and its examples counted; every later round's work names it, as does the
    mode's status, which a restored mode deals on with. Any other metric is refused."""
    mode, store = make()
    works = {w: mode.work(w).result() for w in (0, 1)}
    replies = []
    for w, work in works.items():
        for i in range(2):
            flag = np.array([1.0 if (w, i) == (1, 0) else 0.0])
            replies.append(mode.submit(dataclasses.replace(push_of(mode, store, w, work, i),
                                                           metrics={SKIP_UPDATE: flag})))
    done = replies[-1].result()
    assert done.result.version == store.version == 1 and float(done.result.metrics[SKIP_UPDATE][0]) == 1.0
    assert all(np.array_equal(v, np.zeros_like(v)) for v in store.read()[1].values())
    assert mode.ledger.count(0) == 16
    later = mode.work(0).result()
    assert later.round == 1 and later.skipped_rounds == (0,)
    for w in (0, 1):
        work = mode.work(w).result()
        for i in range(2):
            reply = mode.submit(dataclasses.replace(push_of(mode, store, w, work, i),
                                                    metrics={SKIP_UPDATE: np.zeros(1)}))
    assert reply.result().result.metrics == {} and store.version == 2
    assert np.abs(store.read()[1]["b"]).max() > 0  # round 1 applied
    assert mode.work(0).result().skipped_rounds == (0,)
    _, status = mode.export_state()
    assert status.skipped_rounds == (0,)
    restored, _ = make(workers=())
    restored.restore(status)
    restored.worker_joined(0)
    assert restored.work(0).result(5.0) == Work(2, (0, 1, 2, 3), (4, 4, 4, 4), (0,))


def test_with_gradient_accumulation_a_round_is_a_batch_held_by_the_server_through_skips_and_a_restore():
    """``gradient_accumulation_steps`` 2: round 0 goes into the accumulators (a new version, the
    variables as they were), round 1 asks to skip (nothing added, as Keras skips the batch), round
    2 ends the window: Adam's first update, from (round 2's mean + round 0's) / 2. A store and mode
    restored from a checkpoint taken inside the window end at the same bits."""
    spec = OptimizerSpec("adam", learning_rate=0.05, use_ema=True, gradient_accumulation_steps=2)
    mode, store = make(spec=spec)

    def round_(mode, store, skip=False):
        for w in (0, 1):
            work = mode.work(w).result(5.0)
            for i in range(len(work.micro_batches)):
                reply = mode.submit(dataclasses.replace(push_of(mode, store, w, work, i),
                                                        metrics={SKIP_UPDATE: np.array([float(skip)])}))
        return reply.result(5.0)

    round_(mode, store)
    state = store.export_state()
    assert store.version == 1 and all(not v.any() for v in store.read()[1].values())
    assert all(int(s["accumulated_batches"]) == 1 and s["accumulated"].any() for s in state.states.values())
    held = state.states["b"]["accumulated"].copy()
    checkpoint = mode.export_state()
    round_(mode, store, skip=True)
    assert store.version == 2 and np.array_equal(store.export_state().states["b"]["accumulated"], held)
    round_(mode, store)
    after = store.export_state()
    assert store.version == 3 and all(int(s["iterations"]) == 1 and not s["accumulated"].any()
                                      and int(s["accumulated_batches"]) == 0 for s in after.states.values())
    assert np.allclose(np.abs(store.read()[1]["b"]), 0.05, rtol=1e-3)  # Adam's first step: lr * sign(g)
    restored_store = VariableStore()
    restored_store.restore_state(checkpoint[0])
    restored, _ = make(spec=spec, store=restored_store, workers=())
    restored.restore(checkpoint[1])
    for w in (0, 1):
        restored.worker_joined(w)
    round_(restored, restored_store, skip=True)
    round_(restored, restored_store)
    for name, value in store.read()[1].items():
        np.testing.assert_array_equal(restored_store.read()[1][name], value)
        np.testing.assert_array_equal(restored_store.export_state().states[name]["ema"], after.states[name]["ema"])
