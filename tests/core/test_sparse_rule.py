"""``--sparse-rule``: what a row repeated in one sparse gradient gets, checked against Keras 3.

    python -m pytest tests/core/test_sparse_rule.py -q

The rules (``ps_server.core.optim.sparse``, "--sparse-rule"):
- "sum" (the default): "its occurrences summed first ..., then one step with the sum: the
  dense gradient's step, bit for bit" -- Keras' step for ``tf.convert_to_tensor`` of the slices;
- "keras": "each occurrence as Keras 3's TensorFlow backend applies a ``tf.IndexedSlices``"
  -- Keras' step for the slices themselves, bit for bit (variables and slots, float32);
- sync: "every push's occurrences in worker-id order, each scaled by its batch weight":
  one Keras step on the global batch's slices.
Real ``ParameterServer`` cores, no sockets; Keras eager (``optimizer.apply``).
"""

import threading

import numpy as np
import pytest

from ps_common.sparse import SparseRows
from ps_server.core.data.cursor import DataPlan
from ps_server.core.errors import InvalidArgument
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from tests.core.test_row_sparse import _sync_round
from tests.core.threads import JOIN

ROWS, DIM, STEPS = 9, 3, 4
# Keras class, its arguments: each with rows repeated in every batch.
CASES = {
    "adam": ("Adam", dict(learning_rate=0.1)),
    "adamw": ("AdamW", dict(learning_rate=0.1)),
    "adagrad": ("Adagrad", dict(learning_rate=0.1)),
    "rmsprop": ("RMSprop", dict(learning_rate=0.1)),
    "rmsprop_centered_momentum": ("RMSprop", dict(learning_rate=0.1, momentum=0.5, centered=True)),
    "adamax": ("Adamax", dict(learning_rate=0.1)),
    "nadam": ("Nadam", dict(learning_rate=0.1)),
    "ftrl": ("Ftrl", dict(learning_rate=0.1, l1_regularization_strength=0.001,
                          l2_shrinkage_regularization_strength=0.01)),
    "lion": ("Lion", dict(learning_rate=0.1)),
    "schedule_free_adamw": ("ScheduleFreeAdamW", dict(learning_rate=0.1, warmup_steps=2)),
    "sgd": ("SGD", dict(learning_rate=0.1)),
    "sgd_momentum": ("SGD", dict(learning_rate=0.1, momentum=0.9)),
    "adam_amsgrad_clipvalue": ("Adam", dict(learning_rate=0.1, amsgrad=True, clipvalue=0.5)),
    "adagrad_clipnorm": ("Adagrad", dict(learning_rate=0.1, clipnorm=0.5)),
    "adamw_global_clipnorm": ("AdamW", dict(learning_rate=0.1, global_clipnorm=0.5)),
    "sgd_global_clipnorm": ("SGD", dict(learning_rate=0.1, global_clipnorm=0.5)),
}


@pytest.fixture(scope="module")
def keras():
    import os
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"  # oneDNN changes TensorFlow's bits; off before it loads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras as keras_module

    return keras_module


def batches(seed: int = 3):
    """Per step: rows with repeats (row 1 three times, row 2 twice), and their gradient values."""
    rng = np.random.default_rng(seed)
    for step in range(STEPS):
        rows = np.array([1, 2, 1, 5, 2, 1, 7][: 5 + step % 3], np.int64)
        yield rows, rng.standard_normal((len(rows), DIM)).astype(np.float32)


def initial() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)


def server(spec: OptimizerSpec, rule: str, mode: str = "async", workers: int = 1, **kw) -> ParameterServer:
    ps = ParameterServer(mode=mode, num_workers=workers, barrier_timeout=5.0, sparse_rule=rule, **kw)
    for i in range(workers):
        ps.register(i, workers)
    ps.initialize(0, {"emb": initial()}, spec)
    return ps


def keras_run(keras, case: str, as_slices: bool, steps) -> tuple:
    """Keras' variable and slots after ``optimizer.apply`` of each step's gradient: the slices
    themselves, or made dense (``tf.convert_to_tensor``, the occurrences summed)."""
    import tensorflow as tf
    cls, kwargs = CASES[case]
    opt = getattr(keras.optimizers, cls)(**kwargs)
    variable = keras.Variable(initial())
    for rows, values in steps:
        g = tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant([ROWS, DIM], tf.int64))
        opt.apply([g if as_slices else tf.convert_to_tensor(g)], [variable])
    slots = sorted(v.numpy().tobytes() for v in opt.variables if tuple(v.shape) == (ROWS, DIM))
    return variable.numpy(), slots, OptimizerSpec.from_keras(cls, opt.get_config())


def ours(ps: ParameterServer) -> tuple:
    """The server's value of the table and its slots shaped like it (sorted bytes)."""
    state = ps.store.export_state()
    try:
        value = np.array(state.values["emb"])
        slots = sorted(np.array(a).tobytes() for a in state.states["emb"].values()
                       if hasattr(a, "shape") and tuple(a.shape) == (ROWS, DIM))
    finally:
        state.release()
    return value, slots


def _equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.tobytes() == b.tobytes(), f"{what}: max difference {np.max(np.abs(a - b)):.3g}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rule", ["sum", "keras"])
def test_an_async_run_with_repeated_rows_is_keras_own_step_for_the_rule(keras, case, rule):
    """Rule "keras" equals Keras' step of the IndexedSlices, rule "sum" Keras' step of the
    same gradient made dense, variable and slots bit for bit after a few steps."""
    want, want_slots, spec = keras_run(keras, case, rule == "keras", batches())
    ps = server(spec, rule)
    for step, (rows, values) in enumerate(batches()):
        ps.submit(Push(0, step, ps.store.version, 1, {"emb": SparseRows(rows, values)})).result(JOIN)
    got, got_slots = ours(ps)
    _equal(got, want, f"{case}, rule {rule}")
    assert got_slots == want_slots, f"{case}, rule {rule}: a slot differs"


@pytest.mark.parametrize("case", ["adam", "adagrad", "rmsprop", "nadam", "ftrl", "adamax", "schedule_free_adamw"])
def test_the_two_rules_differ_for_a_repeated_row_so_the_tests_above_tell_them_apart(keras, case):
    """Keras' own two steps differ on the repeated rows (squares of the occurrences summed,
    not the square of their sum), and agree on a row that occurs once."""
    slices, _, _ = keras_run(keras, case, True, batches())
    dense, _, _ = keras_run(keras, case, False, batches())
    assert slices[1].tobytes() != dense[1].tobytes()
    assert slices[3].tobytes() == dense[3].tobytes()  # never touched


@pytest.mark.parametrize("case", ["adam", "adagrad", "rmsprop", "lion"])
@pytest.mark.parametrize("sizes", [(2, 2), (3, 1)], ids=["even", "uneven"])
def test_a_sync_round_under_rule_keras_is_one_keras_step_on_the_global_batch_slices(keras, case, sizes):
    """Two workers each push their mean gradient's occurrences; the round is Keras' step of
    the global batch's IndexedSlices: worker 0's occurrences then worker 1's, each value
    scaled by its worker's share of the batch (b * g / B, rounded once)."""
    total = sum(sizes)
    pushes, global_steps = [], []
    for step, ((rows0, v0), (rows1, v1)) in enumerate(zip(batches(1), batches(2))):
        pushes.append([{"emb": SparseRows(rows0, v0)}, {"emb": SparseRows(rows1, v1)}])
        scaled = [(np.float64(v) * b / total).astype(np.float32) for v, b in ((v0, sizes[0]), (v1, sizes[1]))]
        global_steps.append((np.concatenate([rows0, rows1]), np.concatenate(scaled)))
    want, want_slots, spec = keras_run(keras, case, True, global_steps)
    ps = server(spec, "keras", mode="sync", workers=2)
    for step, round_pushes in enumerate(pushes):
        _sync_round(ps, round_pushes, step, sizes)
    got, got_slots = ours(ps)
    _equal(got, want, f"{case}, sync {sizes}")
    assert got_slots == want_slots


@pytest.mark.parametrize("case", ["adam", "rmsprop"])
@pytest.mark.parametrize("batch, sizes", [(4, (2, 2)), (3, (2, 1))], ids=["even", "uneven"])
def test_an_elastic_round_under_rule_keras_is_one_keras_step_on_the_global_batch_slices(keras, case, batch, sizes):
    """Elastic sync: the round's micro-batches fold by micro-batch, so the occurrences come in
    the global batch's order whoever computed them: micro-batch 0's, then 1's, each value
    scaled by its share of the batch, as the fixed sync round above."""
    total = sum(sizes)
    pushes, global_steps = [], []
    for (rows0, v0), (rows1, v1) in zip(batches(1), batches(2)):
        pushes.append([SparseRows(rows0, v0), SparseRows(rows1, v1)])
        scaled = [(np.float64(v) * b / total).astype(np.float32) for v, b in ((v0, sizes[0]), (v1, sizes[1]))]
        global_steps.append((np.concatenate([rows0, rows1]), np.concatenate(scaled)))
    want, want_slots, spec = keras_run(keras, case, True, global_steps)
    ps = ParameterServer(mode="sync", num_workers=2, barrier_timeout=5.0, sparse_rule="keras",
                         elastic_min_workers=1, micro_batches=2)
    for w in (0, 1):
        ps.register(w, 2)
    ps.initialize(0, {"emb": initial()}, spec, data_plan=DataPlan(300, batch, seed=0))
    for r, micro in enumerate(pushes):
        work = {w: ps.work(w).result(JOIN) for w in (0, 1)}
        assert work[0].sizes + work[1].sizes == sizes
        tickets = [ps.submit(Push(w, r, r, sizes[w], {"emb": micro[w]}, micro_batch=w)) for w in (1, 0)]
        assert all(t.result(JOIN).result is not None for t in tickets)
    got, got_slots = ours(ps)
    _equal(got, want, f"{case}, elastic {sizes}")
    assert got_slots == want_slots


def test_rule_keras_steps_the_touched_rows_alone_where_untouched_rows_stay_as_they_were():
    """SGD without momentum and Adagrad: rows alone, in place (row-wise); Adam: the whole table."""
    for name, row_wise in (("sgd", True), ("adagrad", True), ("adam", False)):
        ps = server(OptimizerSpec(name, learning_rate=0.1), "keras")
        rows, values = next(batches())
        ps.submit(Push(0, 0, 0, 1, {"emb": SparseRows(rows, values)})).result(JOIN)
        assert (ps.store.row_wise() == {"emb"}) == row_wise, name


@pytest.mark.parametrize("spec, words", [
    (OptimizerSpec("adadelta", learning_rate=0.1), "adadelta"),
    (OptimizerSpec("lamb", learning_rate=0.1), "lamb"),
])
def test_rule_keras_refuses_at_initialization_what_it_does_not_compute(spec, words):
    ps = ParameterServer(mode="async", num_workers=1, sparse_rule="keras")
    ps.register(0, 1)
    with pytest.raises(InvalidArgument, match=words):
        ps.initialize(0, {"emb": initial()}, spec)


@pytest.mark.parametrize("settings, words", [
    (dict(mode="async", async_apply="hogwild"), "hogwild"),
    (dict(mode="async", sparse_rule="max"), "sum, keras"),
])
def test_rule_keras_refuses_settings_it_is_not_defined_for(settings, words):
    settings = {"num_workers": 1, "sparse_rule": "keras", **settings}
    with pytest.raises(InvalidArgument, match=words):
        ParameterServer(**settings)


def test_a_worker_learns_the_rule_when_it_registers():
    assert server(OptimizerSpec("adam", learning_rate=0.1), "keras").register(0, 1).sparse_rule == "keras"
    assert server(OptimizerSpec("adam", learning_rate=0.1), "sum").register(0, 1).sparse_rule == "sum"


def test_without_the_flag_the_initializing_optimizer_s_ask_decides_and_a_checkpoint_keeps_it():
    """``--sparse-rule`` unset: "" until initialized; then the optimizer's ``sparse_rule``
    (the Keras front door asks "keras"), else "sum"; a flag given wins over the ask. A
    restored server without the flag steps by the rule its checkpoint's optimizer asked."""

    keras_adam, plain_adam = OptimizerSpec("adam", learning_rate=0.1, sparse_rule="keras"), \
        OptimizerSpec("adam", learning_rate=0.1)
    fresh = ParameterServer(mode="async", num_workers=1)
    assert fresh.register(0, 1).sparse_rule == ""
    for spec, flag, rule in ((keras_adam, "", "keras"), (plain_adam, "", "sum"), (keras_adam, "sum", "sum"),
                             (plain_adam, "keras", "keras")):
        ps = server(spec, flag)
        assert ps.store.sparse_rule == rule and ps.register(0, 1).sparse_rule == rule, (spec, flag)
    asked = server(keras_adam, "")
    rows, values = next(batches())
    asked.submit(Push(0, 0, 0, 1, {"emb": SparseRows(rows, values)})).result(JOIN)
    flagged = server(plain_adam, "keras")
    flagged.submit(Push(0, 0, 0, 1, {"emb": SparseRows(rows, values)})).result(JOIN)
    (a, a_slots), (f, f_slots) = ours(asked), ours(flagged)
    assert a.tobytes() == f.tobytes() and a_slots == f_slots  # the same step: each occurrence as Keras applies it
    restored = ParameterServer(mode="async", num_workers=1)
    restored.restore(asked.checkpoint_state())
    assert restored.store.sparse_rule == "keras" and restored.register(0, 1).sparse_rule == "keras"


def test_an_optimizer_that_asks_for_the_keras_rule_it_has_no_slices_step_for_is_refused_at_a_sparse_push():
    """Adadelta asked "keras" (tfps.keras does for every model): a dense model trains; the first
    sparse gradient is refused in one line naming the fix, and nothing is applied."""
    ps = ParameterServer(mode="async", num_workers=1)
    ps.register(0, 1)
    ps.initialize(0, {"emb": initial(), "dense": np.ones(3, np.float32)},
                  OptimizerSpec("adadelta", learning_rate=0.1, sparse_rule="keras"))
    ps.submit(Push(0, 0, 0, 1, {"emb": np.ones((ROWS, DIM), np.float32), "dense": np.ones(3, np.float32)})) \
        .result(JOIN)
    before = ours(ps)[0].tobytes()
    rows, values = next(batches())
    with pytest.raises(InvalidArgument, match="'emb'.*adadelta.*--sparse-rule sum"):
        ps.submit(Push(0, 1, 1, 1, {"emb": SparseRows(rows, values), "dense": np.ones(3, np.float32)})).result(JOIN)
    assert ours(ps)[0].tobytes() == before
