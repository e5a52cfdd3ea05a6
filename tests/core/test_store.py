"""Tests of ps_server.core.store: initialization, reads, gradient checks, updates.

    python -m pytest tests/core/test_store.py -q

Every refusal is checked twice: the exception and its message, then that the
stored values (byte for byte), the version and the optimizer are unchanged.
"""

import dataclasses
import json
import re

import numpy as np
import pytest

from ps_server.core.errors import InvalidArgument, NonFinite, NotFound, NotInitialized, SpecConflict
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.store import VariableStore

SGD = OptimizerSpec("sgd", learning_rate=0.5)


def initial():
    return {
        "w": np.array([[1, 2, 3], [4, 5, 6]], np.float32),
        "b": np.array([0.5, -0.5], np.float64),
    }


def grads(**over):
    g = {"w": np.ones((2, 3), np.float32), "b": np.array([2.0, 4.0])}
    g.update(over)
    return g


def snapshot(store):
    """Version, optimizer and the stored bytes of every variable."""
    version, values = store.read()
    return version, store.optimizer_spec, {n: (a.dtype.str, a.shape, a.tobytes()) for n, a in values.items()}


@pytest.fixture
def store():
    s = VariableStore()
    assert s.initialize(initial(), SGD) is True
    return s


# -- initialize -----------------------------------------------------------------


def test_initialize_stores_the_values_at_version_zero(store):
    version, values = store.read()
    assert version == 0
    assert store.initialized
    assert store.optimizer_spec == SGD
    for name, value in initial().items():
        np.testing.assert_array_equal(values[name], value)
        assert values[name].dtype == value.dtype
    assert store.specs() == {"w": (np.dtype(np.float32), (2, 3)), "b": (np.dtype(np.float64), (2,))}
    assert store.num_parameters() == 8


def test_initialize_copies_the_callers_arrays(store):
    mine = initial()
    s = VariableStore()
    s.initialize(mine, SGD)
    mine["w"][0, 0] = 99
    assert s.read()[1]["w"][0, 0] == 1


def test_identical_initialize_returns_false_and_keeps_trained_values(store):
    store.apply_all(grads())
    trained = snapshot(store)
    assert store.initialize(initial(), OptimizerSpec("sgd", learning_rate=0.5)) is False
    assert snapshot(store) == trained
    np.testing.assert_array_equal(store.read()[1]["w"], initial()["w"] - 0.5)


def test_identical_initialize_ignores_the_values_and_the_name_order(store):
    other = {"b": np.zeros(2), "w": np.full((2, 3), 7, np.float32)}
    before = snapshot(store)
    assert store.initialize(other, SGD) is False
    assert snapshot(store) == before


@pytest.mark.parametrize(
    "variables, spec, message",
    [
        ({"w": np.zeros((3, 2), np.float32), "b": np.zeros(2)}, SGD,
         "'w' is stored as float32[2, 3], new spec says float32[3, 2]"),
        ({"w": np.zeros((2, 3), np.float64), "b": np.zeros(2)}, SGD,
         "'w' is stored as float32[2, 3], new spec says float64[2, 3]"),
        ({"w": np.zeros((2, 3), np.float32)}, SGD,
         "'b' is stored but not in the new spec"),
        ({"w": np.zeros((2, 3), np.float32), "b": np.zeros(2), "c": np.zeros(1)}, SGD,
         "'c' is new (not stored)"),
        (initial(), OptimizerSpec("sgd", learning_rate=0.25),
         "optimizer is stored as {'name': 'sgd', 'learning_rate': 0.5"),
        (initial(), OptimizerSpec("adam", learning_rate=0.5),
         "new spec says {'name': 'adam'"),
        (initial(), OptimizerSpec("sgd", learning_rate=0.5, momentum=0.9),
         "'momentum': 0.9"),
    ],
    ids=["shape", "dtype", "name_missing", "name_added", "learning_rate", "optimizer_name", "momentum"],
)
def test_conflicting_initialize_raises_spec_conflict_and_changes_nothing(store, variables, spec, message):
    store.apply_all(grads())
    before = snapshot(store)
    with pytest.raises(SpecConflict, match=re.escape(message)):
        store.initialize(variables, spec)
    assert snapshot(store) == before


def test_spec_conflict_names_every_difference_up_to_five():
    s = VariableStore()
    s.initialize({f"v{i}": np.zeros(1, np.float32) for i in range(8)}, SGD)
    with pytest.raises(SpecConflict) as e:
        s.initialize({f"v{i}": np.zeros(2, np.float32) for i in range(8)}, SGD)
    assert str(e.value).count("new spec says float32[2]") == 5
    assert str(e.value).endswith("(and 3 more)")


@pytest.mark.parametrize(
    "variables, spec, message",
    [
        ({}, SGD, "initialize needs at least one variable"),
        ({"": np.zeros(1, np.float32)}, SGD, "variable names must be non-empty"),
        ({"i": np.zeros(2, np.int32)}, SGD, "variable 'i' has dtype int32; only floating variables train"),
        ({"w": np.zeros(2, np.float32)}, OptimizerSpec("sgd", learning_rate=-1.0), "learning_rate must be > 0"),
        ({"w": np.zeros(2, np.float32)}, OptimizerSpec("shampoo"), "optimizer name must be one of"),
    ],
    ids=["empty", "empty_name", "int_dtype", "bad_learning_rate", "unknown_optimizer"],
)
def test_invalid_initialize_raises_invalid_argument_and_stores_nothing(variables, spec, message):
    s = VariableStore()
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        s.initialize(variables, spec)
    assert not s.initialized
    assert s.specs() == {}
    with pytest.raises(NotInitialized):
        s.read()


def test_variables_in_non_native_byte_order_are_stored_in_native_order():
    # The codec decodes little-endian wire data; on a big-endian host that is
    # a non-native array, which must train like any other.
    swapped = np.array([1.0, 2.0], dtype=np.dtype(np.float32).newbyteorder("S"))
    s = VariableStore()
    assert s.initialize({"w": swapped}, SGD) is True
    value = s.read()[1]["w"]
    assert value.dtype == np.float32 and value.dtype.isnative
    np.testing.assert_array_equal(value, [1.0, 2.0])
    assert s.initialize({"w": swapped}, SGD) is False


# -- reads ------------------------------------------------------------------------


def test_read_before_initialize_raises_not_initialized():
    with pytest.raises(NotInitialized, match="variables are not initialized yet"):
        VariableStore().read()
    with pytest.raises(NotInitialized):
        VariableStore().check_gradients({"w": np.zeros(1, np.float32)})


def test_read_returns_read_only_arrays(store):
    _, values = store.read()
    for a in values.values():
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[...] = 0


def test_arrays_handed_to_a_reader_never_change_afterwards(store):
    _, old = store.read()
    old_bytes = {n: a.tobytes() for n, a in old.items()}
    store.apply_all(grads())
    store.apply_one("w", np.ones((2, 3), np.float32))
    assert {n: a.tobytes() for n, a in old.items()} == old_bytes
    _, new = store.read()
    assert new["w"] is not old["w"]
    assert not new["w"].flags.writeable


def test_read_of_some_names_returns_only_those(store):
    version, values = store.read(["b"])
    assert version == 0 and list(values) == ["b"]


def test_read_of_unknown_names_raises_not_found_naming_them(store):
    with pytest.raises(NotFound, match=r"unknown variable\(s\): 'x', 'y'"):
        store.read(["w", "x", "y"])


# -- check_gradients --------------------------------------------------------------

NAN = np.array([1.0, np.nan])
INF = np.array([np.inf, 1.0])
NEG_INF_32 = np.full((2, 3), -np.inf, np.float32)


@pytest.mark.parametrize(
    "gradients, error, message",
    [
        (grads(x=np.zeros(1)), NotFound, "gradient for unknown variable(s): 'x'"),
        ({"w": np.ones((2, 3), np.float32)}, InvalidArgument, "missing gradient(s) for: 'b'"),
        ({}, InvalidArgument, "missing gradient(s) for: 'w', 'b'"),
        (grads(w=np.ones((3, 2), np.float32)), InvalidArgument, "gradient for 'w' has shape [3, 2], variable has [2, 3]"),
        (grads(w=np.ones(6, np.float32)), InvalidArgument, "gradient for 'w' has shape [6], variable has [2, 3]"),
        (grads(w=np.ones((2, 3), np.float64)), InvalidArgument, "gradient for 'w' has dtype float64, variable has float32"),
        (grads(b=np.ones(2, np.float32)), InvalidArgument, "gradient for 'b' has dtype float32, variable has float64"),
        (grads(w=np.ones((2, 3), np.int32)), InvalidArgument, "gradient for 'w' has dtype int32, variable has float32"),
        (grads(b=NAN), NonFinite, "gradient for 'b' contains NaN or Inf; rejected, nothing applied"),
        (grads(b=INF), NonFinite, "gradient for 'b' contains NaN or Inf; rejected, nothing applied"),
        (grads(w=NEG_INF_32), NonFinite, "gradient for 'w' contains NaN or Inf; rejected, nothing applied"),
    ],
    ids=["unknown", "missing", "all_missing", "shape", "shape_flat", "dtype_wider", "dtype_narrower",
         "dtype_int", "nan", "inf", "neg_inf"],
)
def test_check_gradients_rejects_with_a_precise_message_and_changes_nothing(store, gradients, error, message):
    store.apply_all(grads())
    before = snapshot(store)
    with pytest.raises(error, match=re.escape(message)):
        store.check_gradients(gradients)
    assert snapshot(store) == before


def test_check_gradients_accepts_one_finite_array_per_variable(store):
    store.check_gradients(grads())
    store.check_gradients(grads(w=np.float32(-1e38) * np.ones((2, 3), np.float32)))


# -- updates ------------------------------------------------------------------------


def test_apply_all_is_one_sgd_step_on_every_variable_and_bumps_the_version(store):
    assert store.apply_all(grads()) == 1
    version, values = store.read()
    assert version == 1
    np.testing.assert_array_equal(values["w"], initial()["w"] - 0.5)
    np.testing.assert_array_equal(values["b"], [0.5 - 1.0, -0.5 - 2.0])
    assert values["w"].dtype == np.float32 and values["b"].dtype == np.float64
    assert store.apply_all(grads()) == 2


def test_apply_one_updates_one_variable_and_leaves_the_version(store):
    store.apply_one("b", np.array([1.0, 1.0]))
    version, values = store.read()
    assert version == 0
    np.testing.assert_array_equal(values["b"], [0.0, -1.0])
    np.testing.assert_array_equal(values["w"], initial()["w"])
    assert store.bump_version() == 1 and store.version == 1


def test_gradients_in_non_native_byte_order_are_applied_like_native_ones(store):
    swapped = np.dtype(np.float64).newbyteorder("S")
    store.check_gradients(grads(b=np.array([2.0, 4.0], swapped)))
    store.apply_all(grads(b=np.array([2.0, 4.0], swapped)))
    store.apply_one("b", np.array([2.0, 4.0], swapped))
    b = store.read()[1]["b"]
    assert b.dtype.isnative
    np.testing.assert_array_equal(b, [0.5 - 2.0, -0.5 - 4.0])


def test_optimizer_state_is_per_variable_and_survives_reads():
    s = VariableStore()
    s.initialize({"w": np.zeros(2, np.float32)}, OptimizerSpec("sgd", learning_rate=0.5, momentum=0.5))
    g = np.ones(2, np.float32)
    s.apply_all({"w": g})  # m = -0.5, w = -0.5
    s.read()
    s.apply_all({"w": g})  # m = -0.25 - 0.5 = -0.75, w = -1.25
    np.testing.assert_array_equal(s.read()[1]["w"], [-1.25, -1.25])


# -- reads that skip what the reader already has (store.read(since=...)) -------------------------


def test_read_since_the_current_version_returns_nothing_and_since_an_older_one_what_changed(store):
    version, _ = store.read()
    assert store.read(since=version) == (version, {})
    store.check_gradients(grads())
    new = store.apply_all(grads())
    assert store.read(since=version)[1].keys() == {"w", "b"}  # sync: every variable, with the new version
    assert store.read(since=new) == (new, {})
    assert store.read(["w"], since=version)[1].keys() == {"w"}


def test_an_async_update_is_sent_again_to_a_reader_that_caught_it_before_the_version_counted_it(store):
    """A reader at version v that already saw a variable updated half-way through a push
    gets it again (never misses it), and no longer once it read the counted version."""
    store.apply_one("b", np.array([1.0, 1.0]))
    version, values = store.read()  # sees the new b, version not yet bumped
    assert store.read(since=version)[1].keys() == {"b"}
    counted = store.bump_version()
    assert store.read(since=version)[1].keys() == {"b"}
    assert store.read(since=counted) == (counted, {})
    store.apply_one("w", np.ones((2, 3), np.float32))
    assert store.read(since=counted)[1].keys() == {"w"}


def test_a_restored_store_resends_everything_to_a_reader_older_than_the_checkpoint(store):
    store.check_gradients(grads())
    store.apply_all(grads())
    state = store.export_state()
    restored = VariableStore()
    restored.restore_state(state)
    assert restored.read(since=state.version - 1)[1].keys() == {"w", "b"}
    assert restored.read(since=state.version) == (state.version, {})


# -- the learning rate ----------------------------------------------------------------


def test_set_learning_rates_applies_from_the_next_update_on(store):
    store.apply_all(grads())
    store.set_learning_rates([0.0])  # 0: unchanged
    assert store.optimizer_spec == SGD
    store.set_learning_rates([0.25])
    assert store.optimizer_spec == OptimizerSpec("sgd", learning_rate=0.25)
    store.apply_all(grads())
    np.testing.assert_array_equal(store.read()[1]["w"], initial()["w"] - 0.5 - 0.25)
    store.apply_one("b", np.array([4.0, 4.0]))
    np.testing.assert_array_equal(store.read()[1]["b"], [0.5 - 1.0 - 0.5 - 1.0, -0.5 - 2.0 - 1.0 - 1.0])


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), True, "0.1"])
def test_set_learning_rates_refuses_a_value_that_is_not_a_finite_positive_number(store, value):
    before = snapshot(store)
    with pytest.raises(InvalidArgument, match="learning rate must be a finite number > 0"):
        store.set_learning_rates([value])
    with pytest.raises(InvalidArgument, match="group 1; the spec has 1"):
        store.set_learning_rates([0.5, 0.25])
    assert snapshot(store) == before and store.optimizer_spec == SGD


def test_set_learning_rates_before_initialize_raises_not_initialized():
    with pytest.raises(NotInitialized):
        VariableStore().set_learning_rates([0.1])


def test_initialize_again_with_the_first_learning_rate_after_set_learning_rates_is_harmless(store):
    store.set_learning_rates([0.25])
    assert store.initialize(initial(), SGD) is False
    assert store.optimizer_spec.learning_rate == 0.25
    with pytest.raises(SpecConflict, match="optimizer is stored as"):
        store.initialize(initial(), OptimizerSpec("sgd", learning_rate=0.3))


def test_set_learning_rates_is_refused_while_the_learning_rate_is_a_schedule():
    s = VariableStore()
    schedule = {"class_name": "InverseTimeDecay", "config": {"initial_learning_rate": 0.5, "decay_steps": 1,
                                                             "decay_rate": 1.0}}
    s.initialize(initial(), OptimizerSpec("sgd", learning_rate_schedule=schedule))
    with pytest.raises(InvalidArgument, match="the optimizer's learning rate is a schedule"):
        s.set_learning_rates([0.1])
    assert s.current_learning_rate() == 0.5  # 0.5 / (1 + 0)
    s.apply_all(grads())
    assert s.optimizer_iterations() == 1 and s.current_learning_rate() == 0.25  # 0.5 / (1 + 1)
    np.testing.assert_array_equal(s.read()[1]["w"], initial()["w"] - 0.5)  # the first step used 0.5


def test_optimizer_iterations_count_the_updates_every_trainable_variable_had(store):
    assert store.optimizer_iterations() == 0 and store.current_learning_rate() == 0.5
    store.apply_all(grads())
    store.apply_one("w", np.ones((2, 3), np.float32))  # half of an async push
    assert store.optimizer_iterations() == 1
    store.apply_one("b", np.ones(2))
    assert store.optimizer_iterations() == 2


def global_clip_store(non_trainable=()):
    s = VariableStore()
    s.initialize({"a": np.zeros(2, np.float32), "b": np.zeros(1, np.float32), "n": np.zeros(1, np.float32)},
                 OptimizerSpec("sgd", learning_rate=1.0, global_clipnorm=1.0), non_trainable=non_trainable)
    return s


GLOBAL = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([0.0], np.float32), "n": np.array([4.0], np.float32)}


def test_global_clipnorm_takes_one_norm_over_every_gradient_of_the_round():
    s = global_clip_store()
    s.apply_all(GLOBAL)  # norm 5: every gradient times 0.2
    scale = np.float32(1.0) * np.minimum(np.float32(1.0) / np.float32(5.0), np.float32(1.0))
    np.testing.assert_array_equal(s.read()[1]["a"], -(GLOBAL["a"] * scale))
    np.testing.assert_array_equal(s.read()[1]["n"], -(GLOBAL["n"] * scale))


def test_global_clipnorm_leaves_the_non_trainable_changes_out_of_the_norm():
    s = global_clip_store(non_trainable=["n"])
    s.apply_all(GLOBAL)  # norm 3 over a and b: a times 1/3; n's change added as it is
    np.testing.assert_array_equal(s.read()[1]["a"], -(GLOBAL["a"] * (np.float32(1.0) / np.float32(3.0))))
    np.testing.assert_array_equal(s.read()[1]["n"], GLOBAL["n"])


def test_an_async_push_with_global_clipnorm_takes_its_norm_once_through_apply_push():
    s, t = global_clip_store(), global_clip_store()
    s.apply_push(GLOBAL)
    t.apply_all(GLOBAL)
    for name in GLOBAL:
        np.testing.assert_array_equal(s.read()[1][name], t.read()[1][name])
    assert s.version == 0  # the caller counts the push
    with pytest.raises(InvalidArgument, match="global_clipnorm clips by the norm of the whole update"):
        s.apply_one("a", GLOBAL["a"])
    s.apply_one("a", GLOBAL["a"], clip_scale=s.global_clip_scale(GLOBAL))
    np.testing.assert_array_equal(s.read()[1]["a"], 2 * t.read()[1]["a"])


def test_owned_arrays_are_kept_as_they_are_unless_unaligned_and_the_store_never_writes_them():
    buffer = np.zeros(4 * 6 + 1, np.uint8)
    aligned = buffer[:24].view(np.float32)  # a stream's receive buffer, sliced per variable
    unaligned = buffer[1:25].view(np.float32)
    aligned[:] = 1.0
    store = VariableStore()
    store.initialize({"a": aligned}, OptimizerSpec("sgd", 0.5), owned=True)
    _, values = store.read()
    assert np.shares_memory(values["a"], buffer) and not values["a"].flags.writeable
    store.apply_all({"a": np.ones(6, np.float32)})
    np.testing.assert_array_equal(aligned, np.ones(6, np.float32))  # copy-on-write: the given array is left alone
    np.testing.assert_array_equal(store.read()[1]["a"], np.full(6, 0.5, np.float32))
    other = VariableStore()
    other.initialize({"u": unaligned}, OptimizerSpec("sgd", 0.5), owned=True)
    assert not np.shares_memory(other.read()[1]["u"], buffer)
    copied = VariableStore()
    copied.initialize({"a": aligned}, OptimizerSpec("sgd", 0.5))
    assert not np.shares_memory(copied.read()[1]["a"], buffer)


def test_with_optimizer_groups_a_push_steps_the_variables_it_names_each_by_its_group_s_optimizer():
    """``OptimizerSpec.groups``: a GAN's two optimizers, here of different configs, each applied
    to its own variables. A push names one's variables; the others keep their values and counts;
    each variable is stepped, and keeps its state, as its own optimizer alone would. The groups
    survive a checkpoint's JSON and a restore."""
    adam, sgd = OptimizerSpec("adam", learning_rate=0.1), OptimizerSpec("sgd", learning_rate=0.5, momentum=0.9)
    spec = OptimizerSpec("adam", learning_rate=0.1, groups=((("w",), adam), (("b",), sgd)))
    store = VariableStore()
    store.initialize(initial(), spec)
    store.check_gradients({"w": np.ones((2, 3), np.float32)})
    for g in ({"w": np.ones((2, 3), np.float32)}, {"w": np.full((2, 3), 2, np.float32)}, {"b": np.array([2.0, 4.0])}):
        store.apply_all(g)
    state = store.export_state()
    assert [state.states["w"]["iterations"], state.states["b"]["iterations"]] == [2, 1]
    assert store.optimizer_iterations() == 1 and store.version == 3
    for name, own, pushes in (("w", adam, [np.ones((2, 3), np.float32), np.full((2, 3), 2, np.float32)]),
                              ("b", sgd, [np.array([2.0, 4.0])])):
        alone = VariableStore()  # as if stepped alone by its own optimizer
        alone.initialize({name: initial()[name]}, own)
        for g in pushes:
            alone.apply_all({name: g})
        assert store.read()[1][name].tobytes() == alone.read()[1][name].tobytes()
        assert set(state.states[name]) == set(alone.export_state().states[name])
    back = OptimizerSpec.from_dict(json.loads(json.dumps(spec.as_dict())))
    assert back == spec and "sgd learning_rate=0.5 momentum=0.9 (1 variables)" in back.describe()
    restored = VariableStore()
    restored.restore_state(dataclasses.replace(state, optimizer=back))
    restored.apply_all({"b": np.array([2.0, 4.0])})
    store.apply_all({"b": np.array([2.0, 4.0])})
    assert restored.read()[1]["b"].tobytes() == store.read()[1]["b"].tobytes()
    store.check_gradients({})  # a shard that holds none of a group's variables: its push steps nothing
    with pytest.raises(InvalidArgument, match="'w' twice"):
        OptimizerSpec("adam", groups=((("w", "w"), adam), (("b",), sgd))).validate()
    with pytest.raises(InvalidArgument, match="no groups of its own"):
        OptimizerSpec("adam", groups=((("w",), spec),)).validate()


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_variable_two_groups_step_keeps_each_group_s_state_and_one_value(how):
    """A ``train_step`` that applies Adam to ``w``, then SGD with momentum to ``w`` and ``b``
    (``groups`` naming ``w`` twice): SGD's pushes name ``w`` by its second name
    (``shared_name(w, 1)``), whose state is SGD's own, and each update steps the one value
    from the other's last, as one process's two ``apply`` calls do, to the bit, in sync rounds
    (``apply_all``) and async pushes (``apply_push``). Reads give the variables alone; a push
    naming ``w`` twice is refused; a checkpoint keeps both states and the one value."""
    from ps_common.names import shared_name
    from ps_server.core.optim.registry import make_optimizer

    adam, sgd = OptimizerSpec("adam", learning_rate=0.1), OptimizerSpec("sgd", learning_rate=0.5, momentum=0.9)
    spec = OptimizerSpec("adam", learning_rate=0.1, groups=((("w",), adam), (("w", "b"), sgd)))
    second = shared_name("w", 1)
    assert spec.shared() == {second: "w"}
    store = VariableStore()
    store.initialize(initial(), spec)
    rng = np.random.default_rng(0)
    pushes = [{"w": rng.normal(size=(2, 3)).astype(np.float32)} if i % 2 == 0 else
              {second: rng.normal(size=(2, 3)).astype(np.float32), "b": rng.normal(size=2)} for i in range(6)]
    for p in pushes:
        store.check_gradients(p)
        store.apply_all(p) if how == "sync" else (store.apply_push(p), store.bump_version())
    # one process: Adam's and SGD's apply in turn on the same w, each with its own state
    one_adam, one_sgd = make_optimizer(adam), make_optimizer(sgd)
    w, b = initial()["w"], initial()["b"]
    sa, sw, sb = one_adam.init_state(w), one_sgd.init_state(w), one_sgd.init_state(b)
    for p in pushes:
        if "w" in p:
            w, sa = one_adam.apply(w, p["w"], sa)
        else:
            (w, sw), (b, sb) = one_sgd.apply(w, p[second], sw), one_sgd.apply(b, p["b"], sb)
    version, values = store.read()
    assert sorted(values) == ["b", "w"] and version == 6
    assert values["w"].tobytes() == w.tobytes() and values["b"].tobytes() == b.tobytes()
    state = store.export_state()
    assert state.states["w"]["iterations"] == state.states[second]["iterations"] == 3
    assert state.states[second]["momentum"].tobytes() == sw["momentum"].tobytes()
    assert store.num_parameters() == 8 and store.specs()[second] == store.specs()["w"]
    with pytest.raises(InvalidArgument, match="one update steps a variable by one optimizer"):
        store.check_gradients({"w": pushes[0]["w"], second: pushes[0]["w"]})
    assert store.initialize(initial(), spec) is False  # the same initialize again: harmless
    restored = VariableStore()
    restored.restore_state(dataclasses.replace(state, optimizer=OptimizerSpec.from_dict(
        json.loads(json.dumps(spec.as_dict())))))
    for s in (store, restored):
        s.apply_all({second: pushes[1][second], "b": pushes[1]["b"]})
    assert restored.read()[1]["w"].tobytes() == store.read()[1]["w"].tobytes() != w.tobytes()


def test_a_variable_two_groups_step_is_refused_where_it_cannot_be_served():
    """Non-trainable, named with the mark of second names, or by Hogwild's in-place steps: each
    refused in one line."""
    from ps_server.core.optim import hogwild

    adam, sgd = OptimizerSpec("adam", learning_rate=0.1), OptimizerSpec("sgd", learning_rate=0.5)
    shared = OptimizerSpec("adam", learning_rate=0.1, groups=((("w",), adam), (("w", "b"), sgd)))
    with pytest.raises(InvalidArgument, match="'w': two optimizer groups step it, so it must be trainable"):
        VariableStore().initialize(initial(), shared, non_trainable=["w"])
    with pytest.raises(InvalidArgument, match="none with '@group' in its name"):
        OptimizerSpec("adam", groups=((("w@group1",), adam), (("b",), sgd))).validate()
    with pytest.raises(InvalidArgument, match="hogwild does not run a variable two optimizer groups step"):
        hogwild.check_supported(OptimizerSpec("sgd", learning_rate=0.5, groups=((("w",), sgd), (("w",), sgd))))


def test_take_averages_makes_each_named_variable_its_moving_average_and_keeps_the_version():
    """Keras' ``finalize_variable_values`` with ``use_ema`` (the end of fit): the value becomes
    the ``ema`` slot, bit for bit, the version stays, and a second call changes nothing. A name
    without an average, or unknown, is refused before anything is taken."""
    store = VariableStore()
    store.initialize(initial(), OptimizerSpec("adam", learning_rate=0.1, use_ema=True, ema_momentum=0.5))
    store.apply_all(grads())
    store.apply_all(grads(w=np.full((2, 3), -3, np.float32)))
    state = store.export_state()
    averages = {n: np.array(s["ema"]) for n, s in state.states.items()}
    assert all(not np.array_equal(store.read()[1][n], a) for n, a in averages.items())
    with pytest.raises(NotFound, match="'x'"):
        store.take_averages(["w", "x"])
    assert store.read()[1]["w"].tobytes() != averages["w"].tobytes()  # nothing taken
    store.take_averages(["w"])
    assert store.version == 2 and store.read()[1]["w"].tobytes() == averages["w"].tobytes()
    assert store.read()[1]["b"].tobytes() != averages["b"].tobytes()  # not named: as it was
    store.take_averages(["w", "b"])
    store.take_averages(["w", "b"])
    assert {n: a.tobytes() for n, a in store.read()[1].items()} == {n: a.tobytes() for n, a in averages.items()}
    assert store.read(since=1)[1].keys() == {"w", "b"}  # a reader of an older version reads them
    plain = VariableStore()
    plain.initialize(initial(), SGD)
    with pytest.raises(InvalidArgument, match="'b' has no moving average"):
        plain.take_averages(["b"])
