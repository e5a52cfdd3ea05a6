"""Each optimizer group's own learning rate (``OptimizerSpec.groups``: a GAN's two optimizers,
a ``MultiOptimizer``'s), set by a push's ``set_learning_rates``, in the core's modes and
through a checkpoint.

    python -m pytest tests/core/test_group_learning_rates.py -q

store.py's ``set_learning_rates``: "the constant learning rate of the spec's group i ... is
``rates[i]`` where that is not 0"; refused, nothing changed, for "an entry past the groups, or
a rate that is a schedule". Expected values by hand: plain SGD, w - lr * mean(g).
"""

import numpy as np
import pytest

from ps_server.core.checkpoint import read_checkpoint, write_checkpoint
from ps_server.core.errors import InvalidArgument, SpecConflict
from ps_server.core.membership import Membership
from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.modes.base import Push
from ps_server.core.modes.ssp_mode import SSPMode
from ps_server.core.modes.sync_mode import SyncMode
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.store import VariableStore
from tests.core.threads import JOIN, finish, start, wait_until


def f32(*xs):
    return np.array(xs, dtype=np.float32)


W0 = {"a": f32(1, 2), "b": f32(4)}  # a: group A's (the discriminator's), b: group B's
SCHEDULE = {"class_name": "InverseTimeDecay", "config": {"initial_learning_rate": 0.5, "decay_steps": 1,
                                                         "decay_rate": 1.0}}


def spec(b=OptimizerSpec("sgd", learning_rate=0.125)):
    a = OptimizerSpec("sgd", learning_rate=0.5)
    return OptimizerSpec("sgd", learning_rate=0.5, groups=((("a",), a), (("b",), b)))


def group_rates(store):
    return [g.learning_rate for _, g in store.optimizer_spec.groups]


def make(mode="sync", num_workers=2, b=OptimizerSpec("sgd", learning_rate=0.125)):
    store = VariableStore()
    store.initialize(W0, spec(b))
    members = Membership(num_workers)
    if mode == "sync":
        return SyncMode(store, members, num_workers, JOIN), store
    if mode == "ssp":
        return SSPMode(store, members, staleness_bound=2, barrier_timeout=JOIN), store
    return AsyncMode(store, members), store


def push(mode, worker, step, gradients, rates=(), base=None):
    return mode.submit(Push(worker_id=worker, step=step, base_version=step if base is None else base, batch_size=1,
                            gradients=gradients, set_learning_rates=rates)).result(JOIN)


def sync_round(mode, step, gradients, rates):
    """Both workers push ``gradients`` for ``step`` (worker 1 first), with ``rates`` by worker."""
    first = start(lambda: push(mode, 1, step, gradients, rates.get(1, ())))
    wait_until(lambda: mode.status().waiting_for == (0,))
    last = push(mode, 0, step, gradients, rates.get(0, ()))
    finish(first)
    assert first.error is None, first.error
    return [last, first.result]


def test_a_sync_round_of_one_group_s_variables_sets_that_group_s_rate_alone():
    mode, store = make()
    replies = sync_round(mode, 0, {"a": f32(2, 4)}, rates={0: (0.25,)})
    assert [r.learning_rate for r in replies] == [0.25, 0.25]
    np.testing.assert_array_equal(store.read()[1]["a"], f32(1 - 0.25 * 2, 2 - 0.25 * 4))
    assert group_rates(store) == [0.25, 0.125] and store.optimizer_spec.learning_rate == 0.25  # the first group's
    replies = sync_round(mode, 1, {"b": f32(8)}, rates={})  # B's round: B's rate, unchanged
    assert [r.learning_rate for r in replies] == [0.125, 0.125]
    np.testing.assert_array_equal(store.read()[1]["b"], f32(4 - 0.125 * 8))
    assert store.current_learning_rate(["a"]) == 0.25 and store.current_learning_rate(["b"]) == 0.125
    assert store.initialized_spec == spec()  # what a worker that joins later still compiles


@pytest.mark.parametrize("mode_name", ["async", "ssp"])
def test_an_async_push_of_one_group_s_variables_sets_that_group_s_rate_from_its_own_update_on(mode_name):
    mode, store = make(mode_name, num_workers=1)
    first = push(mode, 0, 0, {"b": f32(8)}, rates=(0, 0.0625), base=0)
    assert first.learning_rate == 0.0625
    np.testing.assert_array_equal(store.read()[1]["b"], f32(4 - 0.0625 * 8))
    assert group_rates(store) == [0.5, 0.0625] and store.optimizer_spec.learning_rate == 0.5  # A's unchanged
    second = push(mode, 0, 1, {"a": f32(2, 4)}, base=1)
    assert second.learning_rate == 0.5
    np.testing.assert_array_equal(store.read()[1]["a"], f32(1 - 0.5 * 2, 2 - 0.5 * 4))


@pytest.mark.parametrize("mode_name", ["sync", "async"])
def test_one_push_of_several_groups_variables_sets_each_group_s_rate_for_its_update(mode_name):
    """A ``MultiOptimizer``'s ``apply``: one push of both groups, each stepped at its new rate."""
    mode, store = make(mode_name, num_workers=1)
    with pytest.raises(InvalidArgument, match="group 2; the spec has 2"):
        push(mode, 0, 0, {"a": f32(2, 4), "b": f32(8)}, rates=(0.25, 0.0625, 0.5))
    assert store.version == 0 and group_rates(store) == [0.5, 0.125]  # refused whole
    assert store.read()[1]["a"].tobytes() == W0["a"].tobytes()
    assert push(mode, 0, 0, {"a": f32(2, 4), "b": f32(8)}, rates=(0.25, 0.0625)).learning_rate == 0.25  # A's
    np.testing.assert_array_equal(store.read()[1]["a"], f32(1 - 0.25 * 2, 2 - 0.25 * 4))
    np.testing.assert_array_equal(store.read()[1]["b"], f32(4 - 0.0625 * 8))
    assert group_rates(store) == [0.25, 0.0625]
    assert push(mode, 0, 1, {"a": f32(2, 4), "b": f32(8)}, rates=(0, 0.125)).learning_rate == 0.25  # B's alone
    assert group_rates(store) == [0.25, 0.125]


@pytest.mark.parametrize("mode_name", ["sync", "async"])
def test_a_group_whose_rate_is_a_schedule_refuses_a_set_rate_while_the_other_group_takes_one(mode_name):
    mode, store = make(mode_name, num_workers=1, b=OptimizerSpec("sgd", learning_rate_schedule=SCHEDULE))
    with pytest.raises(InvalidArgument, match="schedule"):
        push(mode, 0, 0, {"b": f32(8)}, rates=(0, 0.25))
    assert store.version == 0
    assert push(mode, 0, 0, {"b": f32(8)}).learning_rate == 0.5  # 0.5 / (1 + 0), B's count
    assert push(mode, 0, 1, {"a": f32(2, 4)}, rates=(0.25,)).learning_rate == 0.25
    assert store.current_learning_rate(["b"]) == 0.25  # 0.5 / (1 + 1): B stepped once


def test_a_checkpoint_keeps_each_group_s_rate_and_the_initial_spec(tmp_path):
    ps = ParameterServer("async", 1, barrier_timeout=30.0)
    ps.register(0, 1)
    ps.initialize(0, W0, spec())
    ps.submit(Push(0, 0, 0, 1, {"a": f32(2, 4)}, set_learning_rates=(0.25,))).result(JOIN)
    ps.submit(Push(0, 1, 1, 1, {"b": f32(8)}, set_learning_rates=(0, 0.0625))).result(JOIN)
    restarted = ParameterServer("async", 1, barrier_timeout=30.0)
    restarted.restore(read_checkpoint(write_checkpoint(str(tmp_path), ps.checkpoint_state())))
    store = restarted.store
    assert group_rates(store) == [0.25, 0.0625] and store.initialized_spec == spec()
    restarted.register(0, 1)  # the restarted chief initializes with its compiled spec: harmless
    assert restarted.initialize(0, W0, spec())[0] is False
    with pytest.raises(SpecConflict, match="optimizer is stored as"):
        restarted.initialize(0, W0, spec(OptimizerSpec("sgd", learning_rate=0.0625)))
    assert restarted.submit(Push(0, 2, 2, 1, {"b": f32(8)})).result(JOIN).learning_rate == 0.0625
    np.testing.assert_array_equal(store.read()[1]["b"], f32(4 - 0.0625 * 8 - 0.0625 * 8))

