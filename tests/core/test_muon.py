"""Tests of ps_server.core.optim.muon: Keras 3's Muon on the server.

    python -m pytest tests/core/test_muon.py -q

Against Keras itself in one process (eager ``optimizer.apply``, oneDNN off), on the variables of
a small model named by their Keras paths, as the server names them. The bound, from the module's
guarantee: NumPy's matrix products add their terms in another order than TensorFlow's CPU
kernels, each product a few units in the last place apart, so a variable the Muon rule steps ends
within ``MUON_BOUND`` of Keras' (relative to its largest element; measured: at most 2e-7 after 20
updates, learning rates to 0.1). Everything else is bit-identical: the AdamW rule's variables,
every slot (the momentum does not depend on the variable), which rule each variable takes.
"""

import os

import numpy as np
import pytest

from ps_common.sparse import SparseRows
from ps_server.core.checkpoint import read_checkpoint, write_checkpoint
from ps_server.core.errors import InvalidArgument
from ps_server.core.modes.base import Push
from ps_server.core.optim.muon import Muon, MuonAdamW
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.registry import make_optimizer
from ps_server.core.optim.sparse import lazy_refusal
from ps_server.core.parameter_server import ParameterServer
from tests.core.threads import JOIN

MUON_BOUND = 1e-6
STEPS = 20


@pytest.fixture(scope="module")
def keras():
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"  # oneDNN changes TensorFlow's bits; off before it loads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras as keras_module

    return keras_module


def small_model(keras):
    """An embedding (9, 4), a tall kernel (12, 5), a wide one (5, 10), biases, an output layer;
    variable paths ``net/<layer>/<variable>``."""
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(9, 4, name="embedding"),
                             keras.layers.Flatten(), keras.layers.Dense(5, name="dense"),
                             keras.layers.Dense(10, name="wide"), keras.layers.Dense(3, name="head")], name="net")


def steps(variables, n=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return [[np.asarray(0.1 * rng.standard_normal(v.shape), np.float32) for v in variables] for _ in range(n)]


def assert_close_to_keras(ours: np.ndarray, theirs: np.ndarray, muon_rule: bool, what: str) -> None:
    if muon_rule:
        error = np.abs(ours - theirs).max() / np.abs(theirs).max()
        assert error <= MUON_BOUND, f"{what}: {error:.2g} of its largest element from Keras'"
    else:
        np.testing.assert_array_equal(ours, theirs, err_msg=what)


CONFIGS = {
    "default": dict(),
    "excluded_plain_momentum_no_rms": dict(learning_rate=0.02, exclude_layers=["/head/"], exclude_embeddings=False,
                                           nesterov=False, rms_rate=None, adam_lr_ratio=0.3, weight_decay=0.01,
                                           adam_weight_decay=None, muon_b=-4.5, ns_steps=3),
    "schedule_clipnorm_ema": dict(clipnorm=0.5, use_ema=True, ema_overwrite_frequency=3, momentum=0.8,
                                  adam_beta_1=0.8, adam_beta_2=0.99, epsilon=1e-6),
    "global_clipnorm": dict(learning_rate=0.1, global_clipnorm=0.5, weight_decay=None),
}
KERNELS = {"net/dense/kernel", "net/wide/kernel", "net/head/kernel"}
# The variables each config steps by the Muon rule (Keras chooses them too: checked below).
MUON_RULE = {"default": KERNELS, "schedule_clipnorm_ema": KERNELS, "global_clipnorm": KERNELS,
             "excluded_plain_momentum_no_rms": {"net/embedding/embeddings", "net/dense/kernel", "net/wide/kernel"}}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_server_s_muon_is_keras_muon_after_20_updates_within_the_bound_of_its_matrix_products(keras, config):
    model = small_model(keras)
    kwargs = dict(CONFIGS[config])
    if config == "schedule_clipnorm_ema":
        kwargs["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(0.05, 5, 0.5)
    theirs = keras.optimizers.Muon(**kwargs)
    variables = model.trainable_variables
    init = [v.numpy() for v in variables]
    grads = steps(variables)
    for step in grads:
        theirs.apply([keras.ops.convert_to_tensor(g) for g in step], variables)

    server = make_optimizer(OptimizerSpec.from_keras("Muon", theirs.get_config()))
    stepper = [server.of(v.path) for v in variables]
    values, states = list(init), [s.init_state(x) for s, x in zip(stepper, init)]
    for step in grads:
        scale = server.global_clip_scale(step)
        for i, g in enumerate(step):
            values[i], states[i] = stepper[i].apply(values[i], g, states[i], clip_scale=scale)

    for i, v in enumerate(variables):
        index = theirs._get_variable_index(v)
        adamw = theirs.adam_velocities[index] is not None
        assert ("velocity" in states[i]) == adamw == theirs._should_use_adamw(v), v.path
        assert_close_to_keras(values[i], v.numpy(), not adamw, v.path)
        np.testing.assert_array_equal(states[i]["momentum"], theirs.momentums[index].numpy(), err_msg=v.path)
        if adamw:
            np.testing.assert_array_equal(states[i]["velocity"], theirs.adam_velocities[index].numpy(), v.path)
        assert states[i]["iterations"] == STEPS
    assert {v.path for v, state in zip(variables, states) if "velocity" not in state} == MUON_RULE[config]


def test_a_variable_takes_the_adamw_rule_by_its_rank_an_embedding_name_or_an_excluded_layer():
    server = make_optimizer(OptimizerSpec("muon", exclude_layers=("^head/", "gate")))
    matrix, vector = np.zeros((3, 4), np.float32), np.zeros(4, np.float32)

    def rule(name, value):
        state = server.of(name).init_state(value)
        return "adamw" if set(state) == {"momentum", "velocity", "iterations"} else "muon"

    assert rule("dense/kernel", matrix) == "muon"
    assert rule("dense/bias", vector) == rule("conv/kernel", np.zeros((3, 3, 2, 4), np.float32)) == "adamw"
    assert rule("token_Embedding/embeddings", matrix) == "adamw"  # "embedding" in any case
    assert rule("head/kernel", matrix) == rule("mlp/gate_proj/kernel", matrix) == "adamw"  # re.search
    assert rule("lm/head/kernel", matrix) == "muon"  # "^head/" is not found there
    keep = make_optimizer(OptimizerSpec("muon", exclude_embeddings=False))
    assert set(keep.of("embedding/embeddings").init_state(matrix)) == {"momentum", "iterations"}


def test_a_muon_group_chooses_per_variable_as_a_muon_alone_does():
    spec = OptimizerSpec("sgd", groups=((("embedding/embeddings", "dense/kernel"), OptimizerSpec("muon")),
                                        (("head/kernel",), OptimizerSpec("sgd", learning_rate=0.1))))
    server = make_optimizer(spec)
    assert type(server.of("dense/kernel")) is Muon and type(server.of("embedding/embeddings")) is MuonAdamW
    assert server.of("head/kernel").spec.name == "sgd"


def test_an_embedding_s_repeated_rows_step_as_keras_steps_its_indexed_slices_by_either_rule(keras):
    import tensorflow as tf

    rng = np.random.default_rng(2)
    init = rng.standard_normal((9, 4)).astype(np.float32)
    batches = [(np.array(rows), (0.1 * rng.standard_normal((len(rows), 4))).astype(np.float32))
               for rows in ([1, 1, 4], [0, 5, 5, 5], [2], [8, 1, 8])]
    for exclude_embeddings in (True, False):  # the AdamW rule, then the Muon rule
        model = keras.Sequential([keras.Input((1,), dtype="int32"), keras.layers.Embedding(9, 4, name="embedding")])
        (table,) = model.trainable_variables
        table.assign(init)
        theirs = keras.optimizers.Muon(learning_rate=0.1, exclude_embeddings=exclude_embeddings)
        for rows, values in batches:
            theirs.apply([tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant([9, 4], tf.int64))],
                         [table])
        ps = ParameterServer("async", 1, sparse_rule="keras")
        ps.register(0, 1)
        ps.initialize(0, {table.path: init}, OptimizerSpec.from_keras("Muon", theirs.get_config()))
        for step, (rows, values) in enumerate(batches):
            ps.submit(Push(0, step, ps.store.version, 1, {table.path: SparseRows(rows, values)})).result(JOIN)
        state = ps.checkpoint_state()
        assert ("velocity" in state.states[table.path]) == exclude_embeddings
        assert_close_to_keras(np.asarray(state.values[table.path]), table.numpy(), not exclude_embeddings, table.path)
        np.testing.assert_array_equal(state.states[table.path]["momentum"], theirs.momentums[0].numpy())


def test_a_checkpoint_keeps_each_rule_s_slots_and_training_resumes_as_if_never_stopped(tmp_path):
    spec = OptimizerSpec("muon", learning_rate=0.01, exclude_layers=("head",), use_ema=True)
    rng = np.random.default_rng(5)
    shapes = {"embedding/embeddings": (6, 3), "dense/kernel": (3, 4), "dense/bias": (4,), "head/kernel": (4, 2)}
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    grads = [{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()} for _ in range(6)]

    def train(ps, first, last):
        for step in range(first, last):
            ps.submit(Push(0, step, ps.store.version, 4, grads[step])).result(JOIN)

    def started():
        ps = ParameterServer("async", 1)
        ps.register(0, 1)
        ps.initialize(0, init, spec)
        return ps

    uninterrupted, first = started(), started()
    train(uninterrupted, 0, 6)
    train(first, 0, 3)
    back = read_checkpoint(write_checkpoint(str(tmp_path), first.checkpoint_state()))
    assert back.optimizer == spec
    assert {n: set(s) - {"iterations"} for n, s in back.states.items()} == {
        "embedding/embeddings": {"momentum", "velocity", "ema"}, "dense/kernel": {"momentum", "ema"},
        "dense/bias": {"momentum", "velocity", "ema"}, "head/kernel": {"momentum", "velocity", "ema"}}
    restarted = ParameterServer("async", 1)
    restarted.restore(back)
    train(restarted, 3, 6)
    want, got = uninterrupted.checkpoint_state(), restarted.checkpoint_state()
    for name in shapes:
        assert np.asarray(got.values[name]).tobytes() == np.asarray(want.values[name]).tobytes(), name
        for slot, x in want.states[name].items():
            assert np.asarray(got.states[name][slot]).tobytes() == np.asarray(x).tobytes(), (name, slot)


@pytest.mark.parametrize("fields,message", [
    (dict(ns_steps=2.5), "ns_steps must be an integer >= 0; got 2.5"),
    (dict(adam_beta_2=1.0), r"adam_beta_2 must be in \[0, 1\); got 1.0"),
    (dict(adam_weight_decay=-0.1), "adam_weight_decay must be >= 0; got -0.1"),
    (dict(exclude_layers=("dense(",)), "exclude_layers holds a pattern that is not a regular expression"),
    (dict(exclude_layers="dense"), "exclude_layers must be a list of strings; got 'dense'"),
])
def test_a_muon_spec_the_server_cannot_run_is_refused_in_one_line_naming_the_field(fields, message):
    with pytest.raises(InvalidArgument, match=message):
        make_optimizer(OptimizerSpec("muon", **fields))


def test_lazy_sparse_updates_refuse_muon_which_orthogonalizes_whole_matrices():
    assert "muon orthogonalizes a matrix's whole update: choose another optimizer" in lazy_refusal(
        OptimizerSpec("muon"))
