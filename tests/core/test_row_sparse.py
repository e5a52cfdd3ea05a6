"""Row-sparse updates and pulls (store, core.optim.sparse): plain NumPy, no sockets.

    python -m pytest tests/core/test_row_sparse.py -q

The rules checked, from ``ps_server.core.optim.sparse`` and ``ps_server.core.store``:
- "exact": where a zero gradient leaves a row bit for bit unchanged (plain SGD,
  Adagrad), only the touched rows are stepped, and the result is the dense step's
  bit for bit; every other optimizer is stepped densely.
- "lazy": only the touched rows and their slots change (TF Addons' LazyAdam).
- every row-wise variable tracks the version each row was last written by, and
  ``read_rows(since=v)`` returns exactly the rows written after ``v``.
"""

import dataclasses
import threading

import numpy as np
import pytest

from ps_server.core.checkpoint import decode, encode
from ps_server.core.errors import InvalidArgument
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.optim.sparse import SparseRows, combine, densify, row_wise
from ps_server.core.store import VariableStore
from tests.core.threads import JOIN

ROWS, DIM = 50, 4
SGD = OptimizerSpec("sgd", learning_rate=0.1)
ADAGRAD = OptimizerSpec("adagrad", learning_rate=0.1)
ADAM = OptimizerSpec("adam", learning_rate=0.01)


def table(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"emb": rng.standard_normal((ROWS, DIM)).astype(np.float32),
            "kernel": rng.standard_normal((DIM, 2)).astype(np.float32)}


def sparse_grad(rng, k: int = 8, repeats: bool = True) -> SparseRows:
    rows = rng.integers(0, ROWS, size=k) if repeats else np.sort(rng.choice(ROWS, size=k, replace=False))
    return SparseRows(rows.astype(np.int64), rng.standard_normal((k, DIM)).astype(np.float32))


def push_of(rng, dense: bool = False, **kw) -> dict:
    g = sparse_grad(rng, **kw)
    return {"emb": densify(g, (ROWS, DIM), np.float32) if dense else g,
            "kernel": rng.standard_normal((DIM, 2)).astype(np.float32)}


def _ps(mode: str, spec: OptimizerSpec, workers: int = 1, sparse_updates: str = "exact") -> ParameterServer:
    ps = ParameterServer(mode=mode, num_workers=workers, barrier_timeout=5.0, sparse_updates=sparse_updates)
    for i in range(workers):
        ps.register(i, workers)
    ps.initialize(0, table(), spec)
    return ps


def _sync_round(ps: ParameterServer, pushes: list[dict], step: int, sizes=(3, 1)) -> None:
    threads = [threading.Thread(target=ps.submit, args=(Push(w, step, ps.store.version, sizes[w], g),))
               for w, g in enumerate(pushes[1:], 1)]
    for t in threads:
        t.start()
    ps.submit(Push(0, step, ps.store.version, sizes[0], pushes[0])).result(JOIN)
    for t in threads:
        t.join(5)


def whole(state):
    """``state`` with each row-wise table's snapshot (``store.SnapshotArray``) read whole."""
    arrays = lambda d: {k: (np.asarray(a) if hasattr(a, "read") else a) for k, a in d.items()}  # noqa: E731
    return dataclasses.replace(state, values=arrays(state.values),
                               states={n: arrays(s) for n, s in state.states.items()})


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert np.asarray(a[name]).tobytes() == np.asarray(b[name]).tobytes(), f"{name} differs"


# -- exact: the dense step's bits, rows only ------------------------------------------------
@pytest.mark.parametrize("spec", [SGD, ADAGRAD, OptimizerSpec("sgd", learning_rate=0.1, clipvalue=0.5)],
                         ids=["sgd", "adagrad", "sgd_clipvalue"])
@pytest.mark.parametrize("repeats", [True, False], ids=["repeated_rows", "distinct_rows"])
def test_an_exact_row_wise_async_step_is_the_dense_step_bit_for_bit(spec, repeats):
    rows_ps, dense_ps = _ps("async", spec), _ps("async", spec, sparse_updates="dense")
    rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
    for step in range(6):
        rows_ps.submit(Push(0, step, rows_ps.store.version, 4, push_of(rng_a, repeats=repeats))).result(JOIN)
        dense_ps.submit(Push(0, step, dense_ps.store.version, 4, push_of(rng_b, repeats=repeats))).result(JOIN)
    assert rows_ps.store.row_wise() == {"emb"} and dense_ps.store.row_wise() == frozenset()
    _same(rows_ps.pull()[1], dense_ps.pull()[1])
    _same(rows_ps.checkpoint_state().states["emb"], dense_ps.checkpoint_state().states["emb"])


@pytest.mark.parametrize("spec", [SGD, ADAGRAD], ids=["sgd", "adagrad"])
def test_an_exact_row_wise_sync_round_is_the_dense_round_bit_for_bit(spec):
    rows_ps, dense_ps = _ps("sync", spec, 2), _ps("sync", spec, 2, sparse_updates="dense")
    rng = np.random.default_rng(2)
    for step in range(4):
        pushes = [push_of(rng), push_of(rng)]  # overlapping and repeated rows, batch shares 3:1
        _sync_round(rows_ps, pushes, step)
        _sync_round(dense_ps, pushes, step)
    assert rows_ps.store.version == dense_ps.store.version == 4
    assert rows_ps.store.row_wise() == {"emb"}
    _same(rows_ps.pull()[1], dense_ps.pull()[1])


def test_the_sparse_mean_of_a_round_is_the_dense_mean_on_every_row():
    from ps_server.core.modes.aggregation import weighted_mean
    sparse_mean = weighted_mean  # a round of SparseRows stays sparse (aggregation.RoundSum)
    rng = np.random.default_rng(3)
    grads = [sparse_grad(rng, 12) for _ in range(3)]
    mean = sparse_mean([(b, {"emb": g}) for b, g in zip((5, 2, 9), grads)])["emb"]
    dense = weighted_mean([(b, {"emb": densify(g, (ROWS, DIM), np.float32)}) for b, g in zip((5, 2, 9), grads)])
    assert np.array_equal(densify(mean, (ROWS, DIM), np.float32), dense["emb"])
    assert set(mean.rows) == set(np.concatenate([g.rows for g in grads]))


def test_combine_sums_repeated_rows_as_densify_does():
    g = SparseRows(np.array([7, 2, 7, 0]), np.array([[1], [2], [3], [-0.0]], np.float32))
    rows, values = combine(g)
    assert rows.tolist() == [0, 2, 7]
    assert densify(g, (8, 1), np.float32)[rows].tobytes() == values.tobytes()


@pytest.mark.parametrize("spec, reason", [
    (ADAM, "adam moves rows whose gradient is zero"),
    (OptimizerSpec("sgd", learning_rate=0.1, momentum=0.9), "sgd with momentum moves rows"),
    (OptimizerSpec("rmsprop", learning_rate=0.1), "rmsprop moves rows"),
    (OptimizerSpec("sgd", learning_rate=0.1, weight_decay=0.01), "weight_decay shrinks every row"),
    (OptimizerSpec("adagrad", learning_rate=0.1, clipnorm=1.0), "clipnorm takes the norm"),
    (OptimizerSpec("sgd", learning_rate=0.1, global_clipnorm=1.0), "global_clipnorm"),
    (OptimizerSpec("adagrad", learning_rate=0.1, epsilon=0.0, initial_accumulator_value=0.0), "0 by 0"),
])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the 0/0 case: NaN, as Keras
def test_exact_mode_steps_densely_where_a_zero_gradient_moves_a_row(spec, reason):
    assert reason in row_wise(spec, "exact")
    ps, dense_ps = _ps("async", spec), _ps("async", spec, sparse_updates="dense")
    rng_a, rng_b = np.random.default_rng(4), np.random.default_rng(4)
    for step in range(3):
        ps.submit(Push(0, step, ps.store.version, 1, push_of(rng_a))).result(JOIN)
        dense_ps.submit(Push(0, step, dense_ps.store.version, 1, push_of(rng_b))).result(JOIN)
    assert ps.store.row_wise() == frozenset()
    _same(ps.pull()[1], dense_ps.pull()[1])


# -- lazy -------------------------------------------------------------------------------
def lazy_adam_reference(w, m, v, t, rows, g, lr=0.01, beta_1=0.9, beta_2=0.999, eps=1e-7):
    """TF Addons' LazyAdam (tfa.optimizers.LazyAdam._resource_apply_sparse), in NumPy: the
    moments of the touched rows only, the bias correction at the step count t (1-based)."""
    w, m, v = w.copy(), m.copy(), v.copy()
    lr_t = lr * np.sqrt(1 - beta_2 ** t) / (1 - beta_1 ** t)
    m[rows] = beta_1 * m[rows] + (1 - beta_1) * g
    v[rows] = beta_2 * v[rows] + (1 - beta_2) * g * g
    w[rows] = w[rows] - lr_t * m[rows] / (np.sqrt(v[rows]) + eps)
    return w, m, v


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_lazy_adam_is_tf_addons_lazy_adam_and_leaves_untouched_rows_and_slots_alone(mode):
    ps = _ps(mode, ADAM, sparse_updates="lazy")
    rng = np.random.default_rng(5)
    w = table()["emb"].astype(np.float64)
    m, v = np.zeros_like(w), np.zeros_like(w)
    touched = np.zeros(ROWS, bool)
    for step in range(8):
        g = push_of(rng)
        ps.submit(Push(0, step, ps.store.version, 1, g)).result(JOIN)
        rows, values = combine(g["emb"])
        touched[rows] = True
        w, m, v = lazy_adam_reference(w, m, v, step + 1, rows, values.astype(np.float64))
    state = whole(ps.checkpoint_state())
    np.testing.assert_allclose(state.values["emb"], w, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(state.states["emb"]["m"], m, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(state.states["emb"]["v"], v, rtol=2e-5, atol=1e-9)
    assert state.states["emb"]["iterations"] == 8
    untouched = ~touched
    assert untouched.any()
    assert state.values["emb"][untouched].tobytes() == table()["emb"][untouched].tobytes()
    assert not state.states["emb"]["m"][untouched].any() and not state.states["emb"]["v"][untouched].any()


@pytest.mark.parametrize("spec", [OptimizerSpec("sgd", learning_rate=0.1, momentum=0.9),
                                  OptimizerSpec("rmsprop", learning_rate=0.01, centered=True),
                                  OptimizerSpec("nadam", learning_rate=0.01), OptimizerSpec("ftrl", learning_rate=0.1),
                                  OptimizerSpec("adamw", learning_rate=0.01, weight_decay=0.1)],
                         ids=["momentum", "rmsprop", "nadam", "ftrl", "adamw"])
def test_a_lazy_step_is_the_optimizer_on_the_touched_rows_alone(spec):
    """Each optimizer steps the touched rows exactly as it steps a variable made of them
    (AdamW's weight decay included: the touched rows only, as TF Addons' sparse decay)."""
    ps = _ps("async", spec, sparse_updates="lazy")
    from ps_server.core.optim.registry import make_optimizer
    opt = make_optimizer(spec)
    rows = np.array([3, 9, 17], np.int64)
    w = table()["emb"]
    state = opt.init_state(w[rows])
    for step in range(3):
        g = np.random.default_rng(step).standard_normal((3, DIM)).astype(np.float32)
        ps.submit(Push(0, step, ps.store.version, 1, {"emb": SparseRows(rows, g),
                                                      "kernel": np.zeros((DIM, 2), np.float32)})).result(JOIN)
        expected, state = opt.apply(w[rows] if step == 0 else expected, g, state)
    got = ps.pull()[1]["emb"]
    assert got[rows].tobytes() == expected.tobytes()
    others = np.setdiff1d(np.arange(ROWS), rows)
    assert got[others].tobytes() == w[others].tobytes()


@pytest.mark.parametrize("option", [dict(clipnorm=1.0), dict(global_clipnorm=1.0),
                                    dict(use_ema=True, ema_overwrite_frequency=10)])
def test_lazy_mode_refuses_an_optimizer_option_that_needs_the_whole_variable(option):
    store = VariableStore("lazy")
    with pytest.raises(InvalidArgument) as e:
        store.initialize(table(), OptimizerSpec("adam", learning_rate=0.01, **option))
    message = str(e.value)
    assert "\n" not in message and "--sparse-updates lazy steps only the rows a push touches" in message
    assert next(iter(option)) in message and "--sparse-updates exact" in message
    assert not store.initialized


def test_an_unknown_sparse_updates_mode_is_refused():
    with pytest.raises(InvalidArgument, match="sparse_updates must be one of exact, lazy, dense; got 'rows'"):
        VariableStore("rows")


# -- in place, and who sees what -----------------------------------------------------------
def test_a_row_wise_step_writes_in_place_and_never_changes_what_a_reader_holds():
    ps = _ps("async", SGD)
    rng = np.random.default_rng(6)
    ps.submit(Push(0, 0, 0, 1, push_of(rng))).result(JOIN)
    held = ps.pull()[1]["emb"]
    kept = held.copy()
    ps.submit(Push(0, 1, 1, 1, push_of(rng))).result(JOIN)
    assert held.tobytes() == kept.tobytes() and not held.flags.writeable
    var = ps.store._vars["emb"]
    value_before = var.value
    ps.submit(Push(0, 2, 2, 1, push_of(rng))).result(JOIN)
    assert var.value is value_before  # the same array, written in place: no copy of the table


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_read_rows_returns_exactly_the_rows_written_after_a_version(mode):
    ps = _ps(mode, SGD)
    rng = np.random.default_rng(7)
    written = {}
    for step in range(5):
        g = push_of(rng)
        ps.submit(Push(0, step, ps.store.version, 1, g)).result(JOIN)
        written[ps.store.version] = set(g["emb"].rows.tolist())
    version, values = ps.pull()
    for since in range(0, version + 1):
        v, delta, rows = ps.pull_rows(since=since)
        expected = sorted(set().union(*(written[u] for u in range(since + 1, version + 1))))
        if since == version:
            assert delta == {} and rows == {}
            continue
        assert v == version and rows["emb"].tolist() == expected
        assert rows["emb"].dtype == np.int64
        assert delta["emb"].tobytes() == values["emb"][expected].tobytes()
        assert delta["kernel"].tobytes() == values["kernel"].tobytes()  # dense: whole
    # Before any row-wise step, the table is whole: every row "changed" after version 0 is its own.
    assert ps.pull_rows(since=None)[2] == {}


def test_an_old_version_beyond_the_log_is_answered_from_the_per_row_versions():
    ps = _ps("async", SGD)
    rng = np.random.default_rng(8)
    history = []
    for step in range(40):  # 40 pushes of 8 rows: more than the 50-row table's worth of log
        ps.submit(Push(0, step, ps.store.version, 1, push_of(rng, repeats=False))).result(JOIN)
        history.append(ps.pull()[1]["emb"].copy())
    var = ps.store._vars["emb"]
    assert var.row_log_floor > 1  # the oldest entries were dropped
    current = ps.pull()[1]["emb"]
    for since in (1, var.row_log_floor - 1, var.row_log_floor, 39):
        copy = history[since - 1].copy()
        _, delta, rows = ps.pull_rows(since=since)
        copy[rows["emb"]] = delta["emb"]
        assert copy.tobytes() == current.tobytes()
        changed = np.flatnonzero((history[since - 1] != current).any(axis=1))
        assert set(changed) <= set(rows["emb"].tolist())


def test_a_dense_gradient_for_a_row_wise_table_steps_it_whole_and_marks_every_row():
    ps, dense_ps = _ps("async", SGD), _ps("async", SGD, sparse_updates="dense")
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    ps.submit(Push(0, 0, 0, 1, push_of(rng_a))).result(JOIN)
    dense_ps.submit(Push(0, 0, 0, 1, push_of(rng_b))).result(JOIN)
    ps.submit(Push(0, 1, 1, 1, push_of(rng_a, dense=True))).result(JOIN)
    dense_ps.submit(Push(0, 1, 1, 1, push_of(rng_b, dense=True))).result(JOIN)
    assert ps.pull_rows(since=1)[2]["emb"].tolist() == list(range(ROWS))
    ps.submit(Push(0, 2, 2, 1, push_of(rng_a))).result(JOIN)
    dense_ps.submit(Push(0, 2, 2, 1, push_of(rng_b))).result(JOIN)
    _same(ps.pull()[1], dense_ps.pull()[1])


def test_a_checkpoint_of_a_row_wise_table_does_not_move_with_it_and_restores_to_the_same_training():
    ps, twin = _ps("async", ADAGRAD), _ps("async", ADAGRAD)
    rng_a, rng_b = np.random.default_rng(10), np.random.default_rng(10)
    for step in range(3):
        ps.submit(Push(0, step, step, 1, push_of(rng_a))).result(JOIN)
        twin.submit(Push(0, step, step, 1, push_of(rng_b))).result(JOIN)
    state = ps.checkpoint_state()
    saved = np.asarray(state.values["emb"])
    ps.submit(Push(0, 3, 3, 1, push_of(rng_a))).result(JOIN)
    assert np.asarray(state.values["emb"]).tobytes() == saved.tobytes()  # the snapshot did not move with the table
    restored = ParameterServer(mode="async", num_workers=1)
    restored.restore(decode(encode(state)))
    restored.register(0, 1)
    restored.submit(Push(0, 3, 3, 1, push_of(rng_b))).result(JOIN)
    twin.submit(Push(0, 3, 3, 1, push_of(np.random.default_rng(10)))).result(JOIN)  # keep the twin's stream aligned
    _same(restored.pull()[1], ps.pull()[1])


def test_async_delta_pulls_during_concurrent_pushes_keep_a_copy_equal_to_the_server(tight_switching):
    ps = _ps("async", SGD, workers=2)
    version, values = ps.pull()
    copy = {n: a.copy() for n, a in values.items()}
    done = threading.Event()

    def pusher(worker: int) -> None:
        rng = np.random.default_rng(worker)
        for step in range(60):
            ps.submit(Push(worker, step, ps.store.version, 1, push_of(rng))).result(JOIN)

    threads = [threading.Thread(target=pusher, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        new_version, delta, rows = ps.pull_rows(since=version)
        for name, a in delta.items():
            if name in rows:
                copy[name][rows[name]] = a
            else:
                copy[name] = a.copy()
        assert new_version >= version
        version = new_version
    done.set()
    for t in threads:
        t.join()
    new_version, delta, rows = ps.pull_rows(since=version)
    for name, a in delta.items():
        if name in rows:
            copy[name][rows[name]] = a
        else:
            copy[name] = a.copy()
    assert new_version == 120
    _same(copy, ps.pull()[1])


# -- against Keras itself --------------------------------------------------------------------
@pytest.fixture(scope="module")
def keras():
    import os
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"  # oneDNN changes TensorFlow's bits; off before it loads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras as keras_module

    return keras_module


KERAS_CASES = {"sgd": (SGD, "SGD"), "adagrad": (ADAGRAD, "Adagrad"),
               "sgd_clipvalue": (OptimizerSpec("sgd", learning_rate=0.1, clipvalue=0.5), "SGD")}


@pytest.mark.parametrize("case", list(KERAS_CASES))
@pytest.mark.parametrize("as_slices", [False, True], ids=["dense_gradient", "indexed_slices"])
def test_keras_leaves_a_zero_gradient_row_bit_for_bit_unchanged_and_the_row_wise_step_matches_it(
        keras, case, as_slices):
    """The premise of "exact": Keras' SGD (no momentum) and Adagrad, given a gradient whose
    row is zero (dense zeros, or a tf.IndexedSlices without that row, as an Embedding's
    gradient is), leave that row bit for bit as it was; and our row-wise steps give every
    row Keras' bits after 20 updates."""
    import tensorflow as tf
    spec, cls = KERAS_CASES[case]
    kwargs = {k: getattr(spec, k) for k in ("learning_rate", "clipvalue") if getattr(spec, k) is not None}
    if spec.name == "adagrad":
        kwargs.update(epsilon=spec.epsilon, initial_accumulator_value=spec.initial_accumulator_value)
    opt = getattr(keras.optimizers, cls)(**kwargs)
    init = table()["emb"]
    variable = keras.Variable(init)
    ps = _ps("async", spec)
    rng = np.random.default_rng(11)
    for step in range(20):
        # Dense: rows may repeat (the dense gradient sums them). IndexedSlices: distinct rows,
        # since Keras' own sparse path applies a repeated row's parts one by one (SGD:
        # w - lr*g1 - lr*g2; Adagrad: g1^2 + g2^2 into the accumulator), which is not its
        # dense step; tfps computes the dense step (the rows summed), as for a dense push.
        g = sparse_grad(rng, 6, repeats=not as_slices)
        before = variable.numpy()
        if as_slices:
            gradient = tf.IndexedSlices(tf.constant(g.values), tf.constant(g.rows), tf.constant([ROWS, DIM]))
        else:
            gradient = tf.constant(densify(g, (ROWS, DIM), np.float32))
        opt.apply([gradient], [variable])
        after = variable.numpy()
        untouched = np.setdiff1d(np.arange(ROWS), g.rows)
        assert after[untouched].tobytes() == before[untouched].tobytes(), f"step {step}: Keras moved a zero row"
        ps.submit(Push(0, step, ps.store.version, 1, {"emb": g, "kernel": np.zeros((DIM, 2), np.float32)})).result(JOIN)
    assert ps.store.row_wise() == {"emb"}
    ours = ps.pull()[1]["emb"]
    assert ours.tobytes() == variable.numpy().tobytes(), f"max diff {np.max(np.abs(ours - variable.numpy()))}"


@pytest.mark.parametrize("cls, kwargs", [("Adam", {}), ("SGD", {"momentum": 0.9}), ("RMSprop", {}),
                                         ("Adagrad", {})])
def test_keras_changes_a_zero_gradient_row_or_its_slots_for_the_optimizers_exact_mode_steps_densely(
        keras, cls, kwargs):
    """Why exact mode steps all but SGD and Adagrad densely: after a row was touched once,
    a later step whose gradient leaves it out still changes the row (momentum, Adam's
    moments) or its slots (RMSprop's velocity decays), which a row-wise step would not."""
    import tensorflow as tf
    opt = getattr(keras.optimizers, cls)(learning_rate=0.01, **kwargs)
    variable = keras.Variable(table()["emb"])
    touched = np.zeros((ROWS, DIM), np.float32)
    touched[3] = 1.0
    opt.apply([tf.constant(touched)], [variable])

    def row_3():
        slots = [v.numpy()[3].tobytes() for v in opt.variables if tuple(v.shape) == (ROWS, DIM)]
        return variable.numpy()[3].tobytes(), slots

    before = row_3()
    opt.apply([tf.constant(np.zeros((ROWS, DIM), np.float32))], [variable])
    assert (row_3() == before) == (cls == "Adagrad")  # Adagrad: acc + 0, w - 0/sqrt(acc + eps)


def test_a_sync_round_of_dense_pushes_for_a_row_wise_table_steps_it_whole_and_publishes_one_version():
    rows_ps, dense_ps = _ps("sync", ADAGRAD, 2), _ps("sync", ADAGRAD, 2, sparse_updates="dense")
    rng = np.random.default_rng(12)
    rounds = [[push_of(rng), push_of(rng)], [push_of(rng, dense=True), push_of(rng, dense=True)],
              [push_of(rng), push_of(rng, dense=True)], [push_of(rng), push_of(rng)]]
    for step, pushes in enumerate(rounds):
        _sync_round(rows_ps, pushes, step)
        _sync_round(dense_ps, pushes, step)
    assert rows_ps.store.row_wise() == {"emb"}
    _same(rows_ps.pull()[1], dense_ps.pull()[1])
    assert rows_ps.pull_rows(since=1)[2]["emb"].tolist() == list(range(ROWS))  # round 2 wrote every row


@pytest.mark.parametrize("name", ["lamb", "adafactor"])
def test_lazy_mode_refuses_an_optimizer_that_needs_the_whole_variable_naming_it(name):
    store = VariableStore("lazy")
    with pytest.raises(InvalidArgument) as e:
        store.initialize(table(), OptimizerSpec(name, learning_rate=0.01))
    message = str(e.value)
    assert f"but {name}'s" in message or f"but {name} " in message
    assert "choose another optimizer, or run the server with --sparse-updates exact" in message
    assert not store.initialized
