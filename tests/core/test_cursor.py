"""core.data.cursor: the cluster's data cursor for sync rounds, and why workers coming and going
change no bit of the result.

The last tests train a small model in NumPy round by round, the store's own Adam step on
the round's exact mean (aggregation.RoundSum, one contribution per micro-batch): once with
every worker there, and again with workers killed and added at random steps, micro-batches
arriving in random order. The final weights are the same bits, and every epoch trained on
every example exactly once. The same run with each worker pushing the mean over its own
shard (today's rule) ends elsewhere: the test shows the property is the cursor's doing.
"""

import numpy as np
import pytest

from ps_common import batches
from ps_server.core.modes.aggregation import RoundSum
from ps_server.core.data.cursor import Cursor, EpochLedger, RoundWork
from ps_server.core.errors import InvalidArgument
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.store import VariableStore


def test_a_round_s_micro_batches_are_its_global_batch_and_each_worker_s_group_is_today_s_shard():
    cursor = Cursor(num_examples=100, global_batch_size=12, seed=3, micro_batches=3)
    for r in (0, 5, 8, 9):
        work = cursor.round(r, live=[4, 0, 9])  # ids in any order: dealt by id
        batch = batches.global_batch(100, 12, 3, r)
        np.testing.assert_array_equal(np.concatenate([work.indices(m) for m in range(3)]), batch)
        assert [work.assigned(w) for w in (0, 4, 9)] == [(0,), (1,), (2,)]
        for i, w in enumerate((0, 4, 9)):
            np.testing.assert_array_equal(work.indices(i), batches.shard(batch, i, 3))
    assert cursor.steps_per_epoch == 9 and cursor.epoch_of(8) == 0 and cursor.epoch_of(9) == 1


def test_a_batch_of_several_rounds_deals_the_same_micro_batches_and_counts_at_its_last_round():
    """``applies`` 2 (a step of two updates): rounds 2b and 2b + 1 are global batch b, both of its
    epoch; only the second counts its examples."""
    cursor = Cursor(num_examples=100, global_batch_size=12, seed=3, micro_batches=3, applies=2)
    for b in (0, 4, 8, 9):
        batch = batches.global_batch(100, 12, 3, b)
        for r in (2 * b, 2 * b + 1):
            np.testing.assert_array_equal(np.concatenate(cursor.parts(r)), batch)
            assert cursor.epoch_of(r) == b // 9
        assert not cursor.counts(2 * b) and cursor.counts(2 * b + 1)
    assert Cursor(100, 12, 3, 3).counts(0)
    with pytest.raises(InvalidArgument, match="at least 1 round"):
        Cursor(100, 12, 3, 3, applies=0)


def test_fewer_workers_than_micro_batches_take_contiguous_groups_and_empty_parts_are_done():
    cursor = Cursor(num_examples=10, global_batch_size=8, seed=0, micro_batches=5)
    work = cursor.round(0, live=[1, 2])
    assert work.assigned(1) == (0, 1, 2) and work.assigned(2) == (3, 4)
    last = cursor.round(1, live=[1, 2])  # 2 examples in 5 parts: 3 empty ones, done at once
    assert [last.size(m) for m in range(5)] == [1, 1, 0, 0, 0]
    assert last.outstanding == (0, 1) and last.assigned(1) == (0, 1) and last.assigned(2) == ()
    assert last.receive(1, 0) and last.receive(1, 1) and last.complete


def test_a_delivery_is_taken_once_from_its_owner_and_a_repeat_is_answered_not_folded():
    work = Cursor(20, 8, 0, 2).round(0, live=[0, 1])
    with pytest.raises(InvalidArgument, match="dealt to worker 1, not to worker 0"):
        work.receive(0, 1)
    assert work.receive(0, 0) is True
    assert work.receive(0, 0) is False  # the same push again
    assert work.assigned(0) == () and not work.complete
    with pytest.raises(InvalidArgument, match="micro-batches 0..1, not 2"):
        work.receive(1, 2)
    assert work.receive(1, 1) and work.complete


def test_a_lost_worker_s_undelivered_part_goes_to_the_live_worker_with_the_least_left():
    work = Cursor(100, 8, 0, 8).round(0, live=[0, 1, 2, 3])
    assert work.assigned(1) == (2, 3)
    work.receive(0, 0)
    work.receive(0, 1)  # worker 0 is done; 2 and 3 have two each outstanding
    work.receive(1, 2)  # worker 1 delivered one of its two, then dies
    assert work.lost(1) == {0: (3,)}
    assert work.owner(3) == 0 and work.assigned(0) == (3,)
    assert work.lost(1) == {}  # once
    work.receive(2, 4)  # now 0 and 2 have one each left
    assert work.lost(3) == {0: (6,), 2: (7,)}  # a tie goes to the lower id, then 2 has the least
    assert work.live == (0, 2)


def test_a_round_whose_workers_all_died_waits_for_one_to_join():
    work = Cursor(100, 8, 0, 2).round(0, live=[0, 1])
    work.receive(0, 0)
    assert work.lost(0) == {}  # it had delivered everything
    assert work.lost(1) == {}  # nobody to take micro-batch 1
    assert work.owner(1) is None and work.outstanding == (1,)
    with pytest.raises(InvalidArgument, match="dealt to nobody yet"):
        work.receive(1, 1)
    assert work.join(5) == {5: (1,)}
    assert work.receive(5, 1) and work.complete
    fresh = Cursor(100, 8, 0, 2).round(1, live=[0, 1])
    assert fresh.join(7) == {} and fresh.live == (0, 1, 7)  # nothing unowned: from the next round


def test_bad_cursors_and_rounds_are_refused():
    for kwargs, match in [(dict(num_examples=0), "at least 1 example"), (dict(global_batch_size=0), "batch size"),
                          (dict(micro_batches=0), "at least 1 micro-batch")]:
        with pytest.raises(InvalidArgument, match=match):
            Cursor(**{"num_examples": 10, "global_batch_size": 4, "seed": 0, "micro_batches": 2, **kwargs})
    with pytest.raises(InvalidArgument, match="round must be"):
        RoundWork(Cursor(10, 4, 0, 2), -1, [0])


def test_the_ledger_counts_each_example_once_per_epoch_and_refuses_a_second_time():
    ledger = EpochLedger(6)
    ledger.fold(0, np.array([0, 1, 2]))
    ledger.fold(1, np.array([0]))
    with pytest.raises(InvalidArgument, match=r"example\(s\) \[2\] would be trained on twice"):
        ledger.fold(0, np.array([3, 2]))
    with pytest.raises(InvalidArgument, match=r"\[4\]"):
        ledger.fold(0, np.array([4, 4]))
    assert ledger.count(0) == 3  # nothing of a refused fold was marked
    with pytest.raises(InvalidArgument, match="0..5"):
        ledger.fold(0, np.array([6]))
    ledger.fold(0, np.array([3, 4, 5]))
    assert ledger.complete(0) and not ledger.complete(1) and ledger.epochs() == [0, 1]
    assert 0 not in ledger._seen and ledger.count(1) == 1  # a complete epoch keeps no bitmap...
    with pytest.raises(InvalidArgument, match=r"\[1\] would be trained on twice"):
        ledger.fold(0, np.array([1]))  # ... and still its rule


# -- training through the cursor ---------------------------------------------------------
EXAMPLES, FEATURES, CLASSES = 90, 6, 3
DATA = np.random.default_rng(11)
X = DATA.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
Y = DATA.integers(0, CLASSES, size=EXAMPLES)


def gradient(params, indices):
    """A worker's compute: softmax regression's mean gradient over ``indices``, in float32.
    Deterministic: the same parameters and examples give the same bits, whoever runs it."""
    w, b = params["w"], params["b"]
    logits = X[indices] @ w + b
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(indices)), Y[indices]] -= 1
    n = np.float32(len(indices))
    return {"w": (X[indices].T @ p / n).astype(np.float32), "b": (p.sum(axis=0) / n).astype(np.float32)}


def train(rounds, micro_batches, schedule=None, per_micro=True, seed=0):
    """Sync training through the cursor; ``schedule(r, rng, live)`` -> (killed, added) at round r.

    Every round: the micro-batches are dealt to the live workers; deliveries come in a
    random order; a kill lands after a random number of them (the victim's rest is dealt
    out again); a worker added joins at the next round, or at once if a round has no
    worker left. ``per_micro=False``: each worker pushes one mean over its whole group
    (weighted by its examples), as workers push today."""
    rng = np.random.default_rng(seed)
    store = VariableStore()
    store.initialize({"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)},
                     OptimizerSpec("adam", learning_rate=0.05))
    cursor = Cursor(EXAMPLES, 16, seed=5, micro_batches=micro_batches)
    ledger = EpochLedger(EXAMPLES)
    live, next_id = list(range(micro_batches)), micro_batches
    for r in range(rounds):
        _, params = store.read()
        work = cursor.round(r, live)
        killed, added = schedule(r, rng, list(work.live)) if schedule else ((), 0)
        total = RoundSum()
        kill_after = {w: int(rng.integers(0, 3)) for w in killed}
        delivered = {w: 0 for w in work.live}
        while not work.complete:
            for w in [w for w in killed if w in work.live and delivered[w] >= kill_after[w]]:
                work.lost(w)
                live.remove(w)
            owners = [w for w in work.live if work.assigned(w)]
            if not owners:  # every worker gone: one joins this round
                live.append(next_id)
                delivered[next_id] = 0
                work.join(next_id)
                next_id += 1
                continue
            w = owners[int(rng.integers(len(owners)))]
            mine = work.assigned(w)
            group = mine if not per_micro else (mine[int(rng.integers(len(mine)))],)
            for m in group:
                assert work.receive(w, m)
                ledger.fold(work.epoch, work.indices(m))
            if per_micro:
                total.add(group[0], work.size(group[0]), gradient(params, work.indices(group[0])))
            else:
                indices = np.concatenate([work.indices(m) for m in group])
                total.add(w, len(indices), gradient(params, indices))
            delivered[w] += 1
        for _ in range(added):
            live.append(next_id)
            next_id += 1
        store.apply_all(total.mean())
    _, final = store.read()
    return final, ledger


def churn(r, rng, live):
    """Kill one worker at some rounds and add some at others (never below one)."""
    killed = (int(rng.choice(live)),) if len(live) > 1 and rng.random() < 0.3 else ()
    added = int(rng.integers(1, 3)) if rng.random() < 0.25 else 0
    return killed, added


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_workers_killed_and_added_at_random_steps_end_with_the_undisturbed_run_s_bits(seed):
    rounds = 3 * Cursor(EXAMPLES, 16, 5, 3).steps_per_epoch  # three epochs, uneven last batches
    undisturbed, ledger = train(rounds, micro_batches=3)
    disturbed, churned = train(rounds, micro_batches=3, schedule=churn, seed=seed)
    for name in undisturbed:
        np.testing.assert_array_equal(disturbed[name], undisturbed[name])
    for epoch in range(3):  # every example exactly once per epoch, counted
        assert ledger.count(epoch) == churned.count(epoch) == EXAMPLES
    assert np.abs(undisturbed["w"]).max() > 0.05  # it trained


def test_a_round_left_without_workers_is_finished_by_one_that_joins_with_the_same_bits():
    rounds = Cursor(EXAMPLES, 16, 5, 2).steps_per_epoch
    undisturbed, _ = train(rounds, micro_batches=2)

    def everyone_dies_at_round_2(r, rng, live):
        return (tuple(live) if r == 2 else ()), 0
    disturbed, ledger = train(rounds, micro_batches=2, schedule=everyone_dies_at_round_2)
    for name in undisturbed:
        np.testing.assert_array_equal(disturbed[name], undisturbed[name])
    assert ledger.count(0) == EXAMPLES


def shrink_then_grow(r, rng, live):
    """One of three workers dies in round 1; two join after round 4."""
    return ((live[0],) if r == 1 else ()), (2 if r == 4 else 0)


@pytest.mark.parametrize("per_micro", [True, False])
def test_two_workers_sharing_three_micro_batches_change_no_bit_but_one_mean_per_worker_would(per_micro):
    # From round 2 to 4 two workers compute three micro-batches. Pushing one gradient per
    # micro-batch, the rounds are the undisturbed run's bits; pushing one mean over each
    # worker's group (today's rule), a group of two micro-batches rounds differently: what
    # the cursor's fixed micro-batches buy.
    rounds = 2 * Cursor(EXAMPLES, 16, 5, 3).steps_per_epoch
    undisturbed, _ = train(rounds, micro_batches=3, per_micro=per_micro)
    disturbed, ledger = train(rounds, micro_batches=3, schedule=shrink_then_grow, per_micro=per_micro)
    same = all(np.array_equal(disturbed[n], undisturbed[n]) for n in undisturbed)
    assert same is per_micro
    assert ledger.count(0) == ledger.count(1) == EXAMPLES  # every example once either way
