"""global_clipnorm over several shards (ps_server/core/clip_group.py): the shards' squares
make one server's factor, to the bit; a shard that never brings its squares fails the
update and changes nothing; a restarted shard clips with its group again."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_server.core import checkpoint
from ps_server.core.clip_group import ClipGroup, ClipTimeout, NormBoard
from ps_server.core.errors import InvalidArgument
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.registry import make_optimizer
from ps_server.core.parameter_server import ParameterServer

SPEC = OptimizerSpec("adamw", learning_rate=0.01, global_clipnorm=0.5)
RNG = np.random.default_rng(0)
MODEL = {"a": RNG.normal(size=(30, 7)).astype(np.float32), "b": RNG.normal(size=(7,)).astype(np.float32),
         "c": RNG.normal(size=(7, 3)).astype(np.float32)}
ON = ({"a", "c"}, {"b"})  # what each of two shards holds


def group(shard: int) -> ClipGroup:
    return ClipGroup(("shard0", "shard1"), shard, tuple(MODEL))


def servers(mode: str, barrier_timeout: float = 20.0) -> tuple[ParameterServer, list[ParameterServer]]:
    """One server with the whole model, and two shards of it clipping together in-process
    (shard 1 asks shard 0's board as the ClipNorm call does)."""
    one = ParameterServer(mode, 1, barrier_timeout=barrier_timeout)
    one.register(0)
    one.initialize(0, MODEL, SPEC)
    shards = [ParameterServer(mode, 1, barrier_timeout=barrier_timeout) for _ in ON]
    shards[1].clip_peer = lambda address: (
        lambda key, shard, squares, timeout: shards[0].clip_norm(key, shard, squares).result(timeout))
    for i, (shard, names) in enumerate(zip(shards, ON)):
        shard.register(0)
        shard.initialize(0, {n: MODEL[n] for n in names}, SPEC, clip_group=group(i))
    return one, shards


def push(server: ParameterServer, step: int, grads: dict, names) -> None:
    p = Push(worker_id=0, step=step, base_version=server.store.version, batch_size=8,
             gradients={n: grads[n] for n in names}, loss=1.0)
    server.submit(p).result(30)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_shards_clipping_together_step_as_one_server_to_the_bit(mode):
    one, shards = servers(mode)
    for step in range(4):
        grads = {n: RNG.normal(size=v.shape).astype(np.float32) * (step + 1) for n, v in MODEL.items()}
        push(one, step, grads, MODEL)
        threads = [threading.Thread(target=push, args=(s, step, grads, names)) for s, names in zip(shards, ON)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
    whole = one.pull(0, [])[1]
    parts = {**shards[0].pull(0, [])[1], **shards[1].pull(0, [])[1]}
    assert all(whole[n].tobytes() == parts[n].tobytes() for n in MODEL)
    assert one.store.global_clip_scale({n: MODEL[n] for n in MODEL}) < 0.5  # the factor did clip


def test_a_shard_whose_partner_never_brings_its_squares_applies_nothing():
    _, shards = servers("sync", barrier_timeout=0.5)
    before = shards[0].pull(0, [])[1]
    grads = {n: np.ones_like(v) for n, v in MODEL.items()}
    with pytest.raises(ClipTimeout, match="not every shard brought"):
        push(shards[0], 0, grads, ON[0])
    after = shards[0].pull(0, [])
    assert after[0] == 0 and all(after[1][n].tobytes() == before[n].tobytes() for n in ON[0])


def test_the_board_answers_a_key_once_and_the_same_to_a_shard_asking_again():
    optimizer = make_optimizer(SPEC)
    board = NormBoard(group(0), optimizer.clip_scale_of)
    squares = {n: np.float32(4.0) for n in MODEL}
    first = board.contribute("round 0", 0, {"a": squares["a"], "c": squares["c"]})
    assert not first.done()
    second = board.contribute("round 0", 1, {"b": squares["b"]})
    assert first.result() == second.result() == optimizer.clip_scale_of([np.float32(4.0)] * 3)
    assert board.contribute("round 0", 1, {"b": np.float32(99.0)}).result() == first.result()  # recorded
    with pytest.raises(InvalidArgument, match="'z', which the model does not have"):
        board.contribute("round 1", 1, {"z": np.float32(1.0)})
    with pytest.raises(InvalidArgument, match="shard 2 is not one of"):
        board.contribute("round 1", 2, {"b": np.float32(1.0)})


def test_a_restarted_shard_clips_with_its_group_again():
    _, shards = servers("sync")
    state = checkpoint.decode(checkpoint.encode(shards[1].checkpoint_state()))
    restored = ParameterServer("sync", 1)
    restored.clip_peer = shards[1].clip_peer
    restored.restore(state)
    assert restored.clip_group == group(1) and restored.store.clip_across is not None


def test_a_clip_group_without_global_clipnorm_or_with_a_bad_shard_is_refused():
    server = ParameterServer("sync", 1)
    server.register(0)
    with pytest.raises(InvalidArgument, match="does not clip globally"):
        server.initialize(0, MODEL, OptimizerSpec("adam"), clip_group=group(0))
    with pytest.raises(InvalidArgument, match="cannot reach shard 0"):
        server.initialize(0, MODEL, SPEC, clip_group=group(1))
    assert not server.store.initialized
    with pytest.raises(InvalidArgument, match="shard 2 is not one of"):
        ClipGroup(("x", "y"), 2, ())
