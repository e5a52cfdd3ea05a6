"""Tests of ``AsyncMode(apply="hogwild")``: the guarantees the async module's docstring gives it.

    python -m pytest tests/core/test_hogwild.py -q

Hogwild lets pushes race element by element, so updates may be lost and a pull
may see a variable half-updated. What it still promises, and what is checked
here: every accepted push counted once in the version and ``pushes_applied``,
each step counted once in ``iterations``, no push applied twice, refused pushes
writing nothing, every element always the result of whole updates (so, with
SGD, all-ones gradients and learning rate 1 from zeros, an integer between -A
and 0 where A is the number of pushes applied, and exactly -A with one push at a
time), arrays whole-shaped and finite, checkpoints whole, and one push at a time
bit-identical to the locked apply.
"""

import threading

import numpy as np
import pytest

from ps_server.core import checkpoint
from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.errors import InvalidArgument, StaleRound
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.modes.ssp_mode import SSPMode
from ps_server.core.store import VariableStore
from tests.core.threads import JOIN, finish, start

# Large enough that NumPy drops the GIL inside each ufunc (it does above ~500 elements),
# so two pushes really write the same array at the same time on a multi-core machine.
SHAPES = {"big": (256, 256), "bias": (300,), "scale": ()}
SGD_LR1 = OptimizerSpec("sgd", learning_rate=1.0)


def zeros():
    return {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}


def ones():
    return {n: np.ones(s, np.float32) for n, s in SHAPES.items()}


def make(apply="hogwild", spec=SGD_LR1, variables=None, workers=8, non_trainable=(), **kwargs):
    store = VariableStore()
    store.initialize(variables or zeros(), spec, non_trainable=non_trainable)
    return AsyncMode(store, Membership(workers), apply=apply, **kwargs), store


def push(worker, step, grads, base_version=0):
    return Push(worker_id=worker, step=step, base_version=base_version, batch_size=1, gradients=grads)


def counts_are_integers_in(a: np.ndarray, low: float, high: float) -> bool:
    a = np.array(a, copy=True)  # a pulled array may change under us: judge one copy of it
    return bool(np.all(np.isfinite(a)) and np.all(a == np.round(a)) and np.all((a >= low) & (a <= high)))


# -- one push at a time: the locked apply's bits ----------------------------------------

SPECS = {
    "sgd": OptimizerSpec("sgd", learning_rate=0.1),
    "sgd-momentum": OptimizerSpec("sgd", learning_rate=0.05, momentum=0.9),
    "sgd-nesterov": OptimizerSpec("sgd", learning_rate=0.05, momentum=0.8, nesterov=True),
    "sgd-weight-decay-clipvalue": OptimizerSpec("sgd", learning_rate=0.1, weight_decay=0.01, clipvalue=0.3),
    "adam": OptimizerSpec("adam", learning_rate=0.01),
    "adam-amsgrad-clipnorm": OptimizerSpec("adam", learning_rate=0.01, amsgrad=True, clipnorm=0.5),
    "adam-global-clipnorm": OptimizerSpec("adam", learning_rate=0.01, global_clipnorm=1.0),
    "adamw": OptimizerSpec("adamw", learning_rate=0.01, weight_decay=0.004),
    "adagrad": OptimizerSpec("adagrad", learning_rate=0.05),
    "rmsprop": OptimizerSpec("rmsprop", learning_rate=0.01),
    "rmsprop-momentum-clipnorm": OptimizerSpec("rmsprop", learning_rate=0.01, momentum=0.5, clipnorm=0.8),
    "adam-schedule": OptimizerSpec("adam", learning_rate_schedule={
        "class_name": "ExponentialDecay",
        "config": {"initial_learning_rate": 0.1, "decay_steps": 7, "decay_rate": 0.93}}),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_one_push_at_a_time_is_bit_identical_to_the_locked_apply(name, dtype):
    rng = np.random.default_rng(7)
    shapes = {"w": (40, 30), "b": (30,), "s": (), "moving": (30,)}
    start = {n: rng.normal(size=s).astype(dtype) for n, s in shapes.items()}
    modes = {apply: make(apply, SPECS[name], variables=start, workers=2, non_trainable=["moving"],
                         stale_policy="scale")[0] for apply in ("locked", "hogwild")}
    for step in range(12):
        grads = {n: rng.normal(size=s).astype(dtype) for n, s in shapes.items()}
        base = max(0, step - step % 3)  # some pushes stale: the "scale" policy's lr_scale < 1
        for mode in modes.values():
            mode.submit(Push(worker_id=step % 2, step=step // 2, base_version=base, batch_size=1,
                             gradients=grads)).result(JOIN)
    locked, hogwild = (m.export_state()[0] for m in (modes["locked"], modes["hogwild"]))
    assert hogwild.version == locked.version == 12
    for n in shapes:
        assert hogwild.values[n].tobytes() == locked.values[n].tobytes(), n
        assert hogwild.values[n].shape == locked.values[n].shape and hogwild.values[n].dtype == dtype
        assert set(hogwild.states[n]) == set(locked.states[n])
        for slot, a in locked.states[n].items():
            b = hogwild.states[n][slot]
            assert (b.tobytes() == a.tobytes()) if isinstance(a, np.ndarray) else b == a, (n, slot)
    assert modes["hogwild"].stats.scaled == modes["locked"].stats.scaled > 0


def test_ssp_mode_takes_the_hogwild_apply_too():
    store = VariableStore()
    store.initialize(zeros(), SGD_LR1)
    mode = SSPMode(store, Membership(1), staleness_bound=2, apply="hogwild")
    for step in range(5):
        mode.submit(push(0, step, ones(), base_version=step)).result(JOIN)
    assert all(np.all(v == -5) for v in store.read()[1].values())


# -- many pushes at once ---------------------------------------------------------------

THREADS, PUSHES = 8, 60
TOTAL = THREADS * PUSHES


def test_concurrent_pushes_count_every_push_once_and_keep_every_element_a_whole_count(tight_switching):
    """SGD, lr 1, all-ones gradients from zeros: each landed element update subtracts exactly
    1, so every element is -(updates that landed): an integer in [-A, 0]. Readers and
    checkpoints during the run see whole-shaped arrays of such integers."""
    mode, store = make()
    go = threading.Barrier(THREADS + 2)
    done = threading.Event()
    problems: list[str] = []

    def push_many(worker):
        grads = ones()
        go.wait(JOIN)
        replies = [mode.submit(push(worker, step, grads, base_version=store.version)).result(JOIN)
                   for step in range(PUSHES)]
        return replies

    def read_and_snapshot():
        go.wait(JOIN)
        reads = 0
        while not done.is_set() or reads < 3:
            version, values = store.read()
            for n, a in values.items():
                if a.shape != SHAPES[n] or a.flags.writeable or not counts_are_integers_in(a, -TOTAL, 0):
                    problems.append(f"pull of {n!r} at version {version}: shape {a.shape}")
            state, _ = mode.export_state()
            for n, a in state.values.items():
                if a.shape != SHAPES[n] or not counts_are_integers_in(a, -TOTAL, 0):
                    problems.append(f"snapshot of {n!r}: shape {a.shape}")
                if not 0 <= state.states[n]["iterations"] <= TOTAL:
                    problems.append(f"snapshot iterations of {n!r}: {state.states[n]['iterations']}")
            reads += 1
        return reads

    pushers = [start(lambda w=w: push_many(w)) for w in range(THREADS)]
    reader = start(read_and_snapshot)
    go.wait(JOIN)
    finish(*pushers)
    done.set()
    finish(reader)
    for t in (*pushers, reader):
        assert t.error is None, repr(t.error)
    assert problems == []

    # Every accepted push counted once: in the version, the stats, each variable's iterations.
    assert store.version == mode.stats.pushes_applied == TOTAL
    assert sorted(r.version for t in pushers for r in t.result) == list(range(1, TOTAL + 1))
    assert not any(r.replayed or r.dropped for t in pushers for r in t.result)
    state = store.export_state()
    assert all(state.states[n]["iterations"] == TOTAL for n in SHAPES)
    assert store.optimizer_iterations() == TOTAL
    version, values = store.read()
    lost = 0
    for n, a in values.items():
        assert a.shape == SHAPES[n] and a.dtype == np.float32
        assert counts_are_integers_in(a, -TOTAL, 0), (n, a.min(), a.max())
        lost += int((a + TOTAL).sum())
    # Not asserted: how many were lost (0 on one core, some on several). Reported for the log.
    print(f"hogwild: {TOTAL} pushes, {lost} element updates lost of {TOTAL * sum(a.size for a in values.values())}")


def test_one_worker_pushing_alone_loses_nothing_every_element_is_exactly_minus_the_pushes():
    mode, store = make()
    for step in range(50):
        mode.submit(push(0, step, ones(), base_version=store.version)).result(JOIN)
    version, values = store.read()
    assert version == mode.stats.pushes_applied == 50
    assert all(np.all(a == -50) for a in values.values())


RACING = {  # a small beta_2 / rho: the second moment swings fast, the worst case for a torn update
    "adam": (OptimizerSpec("adam", learning_rate=0.01, beta_2=0.5), "v"),
    "rmsprop-momentum": (OptimizerSpec("rmsprop", learning_rate=0.01, rho=0.5, momentum=0.9), "velocity"),
    "adagrad": (OptimizerSpec("adagrad", learning_rate=0.01), "accumulator"),
}


@pytest.mark.parametrize("name", sorted(RACING))
def test_concurrent_pushes_keep_every_value_and_slot_finite_and_the_second_moment_non_negative(name, tight_switching):
    """Also RMSprop's velocity and Adagrad's accumulator: a second moment never negative, so no NaN."""
    spec, second_moment = RACING[name]
    mode, store = make(spec=spec)

    def push_many(worker):
        rng = np.random.default_rng(worker)
        for step in range(40):
            grads = {n: (rng.normal(size=s) * 10.0 ** rng.integers(-3, 3)).astype(np.float32) for n, s in SHAPES.items()}
            mode.submit(push(worker, step, grads, base_version=store.version)).result(JOIN)

    pushers = [start(lambda w=w: push_many(w)) for w in range(THREADS)]
    finish(*pushers)
    assert all(t.error is None for t in pushers), [repr(t.error) for t in pushers]
    state = mode.export_state()[0]
    assert state.version == mode.stats.pushes_applied == THREADS * 40
    for n in SHAPES:
        assert np.all(np.isfinite(state.values[n])) and state.values[n].shape == SHAPES[n]
        assert all(np.all(np.isfinite(a)) for k, a in state.states[n].items() if k != "iterations")
        assert np.all(state.states[n][second_moment] >= 0)
        assert state.states[n]["iterations"] == THREADS * 40


# -- what is refused writes nothing -------------------------------------------------------

def snapshot(mode, store):
    version, values = store.read()
    return version, {n: a.tobytes() for n, a in values.items()}, mode.stats.pushes_applied


def test_a_replayed_push_is_answered_from_the_record_and_an_older_one_refused():
    mode, store = make()
    first = mode.submit(push(0, 0, ones())).result(JOIN)
    again = mode.submit(push(0, 0, ones())).result(JOIN)
    assert again.replayed and again.version == first.version == 1
    mode.submit(push(0, 1, ones(), base_version=1)).result(JOIN)
    with pytest.raises(StaleRound):
        mode.submit(push(0, 0, ones())).result(JOIN)
    assert store.version == mode.stats.pushes_applied == 2 and mode.stats.replayed == 1
    assert all(np.all(a == -2) for a in store.read()[1].values())


@pytest.mark.parametrize("spec, named", [
    (OptimizerSpec("nadam", learning_rate=0.01), "the optimizer is nadam"),
    (OptimizerSpec("ftrl", learning_rate=0.01), "the optimizer is ftrl"),
    (OptimizerSpec("lion", learning_rate=0.01), "the optimizer is lion"),
    (OptimizerSpec("rmsprop", learning_rate=0.01, centered=True), "rmsprop with centered=True"),
    (OptimizerSpec("sgd", learning_rate=0.01, use_ema=True, ema_overwrite_frequency=5), "use_ema"),
])
def test_an_optimizer_hogwild_cannot_run_is_refused_at_initialize_in_one_line_naming_it(spec, named):
    ps = ParameterServer(mode="async", num_workers=1, async_apply="hogwild")
    ps.register(0, 1)
    with pytest.raises(InvalidArgument, match=named) as e:
        ps.initialize(0, zeros(), spec)
    assert "\n" not in str(e.value) and "--async-apply locked" in str(e.value)
    assert not ps.store.initialized
    # A store initialized some other way: the push is refused before any variable is written.
    mode, store = make(spec=spec)
    with pytest.raises(InvalidArgument, match=named):
        mode.submit(push(0, 0, ones())).result(JOIN)
    assert store.version == 0 and all(np.all(a == 0) for a in store.read()[1].values())


def test_hogwild_is_refused_in_sync_mode_and_an_unknown_apply_everywhere():
    with pytest.raises(InvalidArgument, match="async and ssp"):
        ParameterServer(mode="sync", num_workers=1, async_apply="hogwild")
    with pytest.raises(InvalidArgument, match="apply must be one of"):
        make(apply="wild")


# -- readers -------------------------------------------------------------------------

def test_pulls_get_read_only_views_and_arrays_pulled_before_the_first_step_keep_their_values():
    mode, store = make()
    _, before = store.read()
    mode.submit(push(0, 0, ones())).result(JOIN)
    _, after = store.read()
    assert all(np.all(a == 0) for a in before.values())  # copied once into writable arrays, not written
    assert all(not a.flags.writeable and np.all(a == -1) for a in after.values())
    mode.submit(push(0, 1, ones(), base_version=1)).result(JOIN)
    assert all(np.all(a == -2) for a in after.values())  # in place: the same arrays, changed under the reader


def test_read_since_a_version_returns_every_variable_written_after_it():
    mode, store = make()
    mode.submit(push(0, 0, ones())).result(JOIN)
    version, _ = store.read()
    assert store.read(since=version)[1] == {}
    mode.submit(push(0, 1, ones(), base_version=version)).result(JOIN)
    assert sorted(store.read(since=version)[1]) == sorted(SHAPES)


def test_a_checkpoint_written_while_pushes_race_is_whole_and_restores_into_a_hogwild_server(tmp_path):
    ps = ParameterServer(mode="async", num_workers=THREADS, async_apply="hogwild")
    for w in range(THREADS):
        ps.register(w, THREADS)
    ps.initialize(0, zeros(), SGD_LR1)

    def push_many(worker):
        for step in range(PUSHES):
            ps.submit(push(worker, step, ones(), base_version=ps.store.version)).result(JOIN)

    pushers = [start(lambda w=w: push_many(w)) for w in range(THREADS)]
    paths = [checkpoint.write_checkpoint(str(tmp_path), ps.checkpoint_state(), keep=10) for _ in range(3)]
    finish(*pushers)
    assert all(t.error is None for t in pushers)
    for path in paths:
        state = checkpoint.read_checkpoint(path)
        for n, a in state.values.items():
            assert a.shape == SHAPES[n] and counts_are_integers_in(a, -TOTAL, 0)
            assert 0 <= state.states[n]["iterations"] <= TOTAL
        assert 0 <= state.version <= TOTAL
    final = ps.checkpoint_state()
    restored = ParameterServer(mode="async", num_workers=THREADS, async_apply="hogwild")
    restored.restore(final)
    restored.register(0, THREADS)
    restored.submit(push(0, PUSHES, ones(), base_version=restored.store.version)).result(JOIN)
    _, values = restored.store.read()
    for n, a in values.items():
        assert np.array_equal(a, final.values[n] - 1)
    assert restored.store.version == TOTAL + 1


@pytest.mark.parametrize("spec", [SGD_LR1, OptimizerSpec("adam", learning_rate=0.01)])
def test_a_sparse_push_is_stepped_dense_in_place_as_the_locked_apply_steps_it(spec):
    from ps_common.sparse import SparseRows

    rows = np.array([3, 0, 3], np.int64)
    grad = SparseRows(rows, np.arange(3 * 256, dtype=np.float32).reshape(3, 256))
    results = {}
    for apply in ("hogwild", "locked"):
        ps = ParameterServer(mode="async", num_workers=1, async_apply=apply)
        ps.register(0, 1)
        ps.initialize(0, ones(), spec)
        grads = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
        grads["big"] = grad
        ps.submit(push(0, 0, grads)).result()
        version, values = ps.pull(0)
        assert version == 1
        results[apply] = {n: np.array(v) for n, v in values.items()}
    for name in SHAPES:
        np.testing.assert_array_equal(results["hogwild"][name], results["locked"][name])
    assert not np.array_equal(results["hogwild"]["big"][3], np.ones(256, np.float32))
    np.testing.assert_array_equal(results["hogwild"]["big"][1], np.ones(256, np.float32))
