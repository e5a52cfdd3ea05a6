"""PushPull against a real server: a sync round's new values stream back while it still arrives.

    python -m pytest -q tests/service/test_push_pull.py

``ps_server.core.modes.overlap``: each variable is speculated once every participant's
gradient for it is in; the round keeps the speculation only if it was computed from
exactly the round's pushes, and then the values are those an apply of the whole round
gives, bit for bit. Otherwise the round is applied whole and the worker pulls.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from worker.client import SMALL_BYTES, PSClient
from worker.transports import PSClientError

# Three variables of 1.2 MB each: every push and pull is streamed (above SMALL_BYTES).
SHAPES = {"a/kernel": (300, 1000), "b/kernel": (1000, 300), "c/bias": (7,)}
ADAM = {"name": "adam", "learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}


# 12 KB: one unary message each way, unless the push asks for fine blocks.
SMALL = {"a/kernel": (60, 50), "b/bias": (50,)}


def _values(seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def _grads(worker, step, shapes=SHAPES):
    rng = np.random.default_rng(1000 * step + worker)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


assert sum(int(np.prod(s)) * 4 for s in SHAPES.values()) > SMALL_BYTES


def _recording(client):
    calls = []
    for transport, names in ((client.unary, ("call",)), (client.calls, ("call",)),
                             (client.streams, ("pull", "push", "push_pull"))):
        for name in names:
            real = getattr(transport, name)

            def wrapped(*a, _real=real, _name=name, **k):
                calls.append(a[0] if _name == "call" else _name)
                return _real(*a, **k)

            setattr(transport, name, wrapped)
    return calls


def _train(ps, bg, connect, overlap, steps=3, optimizer=ADAM, sizes=(32, 48), bad=None, non_trainable=(),
           shapes=SHAPES, block_bytes=0, layouts=None):
    """Two workers, ``steps`` sync rounds; returns (final values as bytes, worker 0's calls).
    ``layouts``: a list to which each speculated push's blocks are added."""
    running, _ = ps(mode="sync", num_workers=2)
    if layouts is not None:
        speculate = running.core.mode.overlap

        def recording(*a, **k):
            spec = speculate(*a, **k)
            if spec is not None:
                layouts.append(spec.layout)
            return spec
        running.core.mode.overlap = recording
    clients = [PSClient(running.address, timeout=30, overlap=o, overlap_block_bytes=block_bytes) for o in overlap]
    try:
        for i, c in enumerate(clients):
            c.register(i, 2)
        clients[0].initialize(0, _values(shapes=shapes), optimizer, non_trainable=non_trainable)
        calls = _recording(clients[0])

        def work(i):
            c = clients[i]
            for step in range(steps):
                version, _ = c.pull(i)
                if bad is not None and bad == (i, step):
                    poisoned = _grads(i, step, shapes)
                    poisoned["b/kernel"][0, 0] = np.nan
                    with pytest.raises(PSClientError, match="NaN or Inf"):
                        c.push(i, step, version, sizes[i], poisoned)
                c.push(i, step, version, sizes[i], _grads(i, step, shapes))
            return c.pull(i)

        results = [bg(work, i) for i in range(2)]
        finals = [r.result(timeout=60) for r in results]
        assert finals[0][0] == finals[1][0] == steps
        server = running.core.pull()[1]
        for version, values in finals:
            for n in shapes:
                assert np.array_equal(values[n], server[n]), n

        # The optimizer's state too (what a checkpoint holds): slots and update counts.
        states = running.core.store.export_state().states
        return {n: server[n].tobytes() for n in shapes} | {
            f"{n}:{k}": (v.tobytes() if isinstance(v, np.ndarray) else v) for n in shapes
            for k, v in sorted(states[n].items())}, calls
    finally:
        for c in clients:
            c.close()


def test_a_round_pulled_while_it_is_pushed_is_bit_identical_to_push_then_pull(ps, bg, connect):
    reference, calls = _train(ps, bg, connect, overlap=(False, False))
    assert "push_pull" not in calls and calls.count("pull") == 4  # the first pull, one per round
    overlapped, calls = _train(ps, bg, connect, overlap=(True, True))
    assert overlapped == reference
    # Every round confirmed: the pushes went as PushPull and no pull after them called the server.
    assert calls.count("push_pull") == 3 and calls.count("pull") == 1, calls


def test_a_round_with_one_plain_push_is_applied_whole_and_the_overlapping_worker_pulls(ps, bg, connect):
    reference, _ = _train(ps, bg, connect, overlap=(False, False))
    mixed, calls = _train(ps, bg, connect, overlap=(True, False))
    assert mixed == reference
    assert calls.count("push_pull") == 3 and calls.count("pull") == 4, calls  # nothing confirmed


def test_a_refused_push_leaves_no_speculation_in_the_round(ps, bg, connect):
    """Worker 1's first push of round 1 has a NaN and is refused after some of its variables
    were offered (and speculated from); it pushes again. The round applies what it holds."""
    reference, _ = _train(ps, bg, connect, overlap=(False, False))
    again, calls = _train(ps, bg, connect, overlap=(True, True), bad=(1, 1))
    assert again == reference
    assert calls.count("pull") == 2, calls  # round 1 was not confirmed; rounds 0 and 2 were


def test_an_optimizer_with_global_clipnorm_is_not_speculated_and_trains_the_same(ps, bg, connect):
    clipped = dict(ADAM, global_clipnorm=1.0)
    reference, _ = _train(ps, bg, connect, overlap=(False, False), optimizer=clipped)
    overlapped, calls = _train(ps, bg, connect, overlap=(True, True), optimizer=clipped)
    assert overlapped == reference and calls.count("pull") == 4, calls


# Each a different path of the optimizer: momentum slots, a centered RMSprop with EMA,
# decoupled weight decay, and clipnorm (a norm per variable: each variable one block).
OPTIMIZERS = {
    "sgd-nesterov": {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9, "nesterov": True},
    "rmsprop-centered-ema": {"name": "rmsprop", "learning_rate": 0.001, "rho": 0.9, "momentum": 0.5,
                             "epsilon": 1e-7, "centered": True, "use_ema": True, "ema_momentum": 0.99,
                             "ema_overwrite_frequency": 2},
    "adamw": dict(ADAM, name="adamw", weight_decay=0.004),
    "adam-clipnorm": dict(ADAM, clipnorm=0.5),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_optimizer_path_gives_the_same_bits_block_by_block(ps, bg, connect, optimizer):
    reference, _ = _train(ps, bg, connect, overlap=(False, False), optimizer=OPTIMIZERS[optimizer])
    overlapped, calls = _train(ps, bg, connect, overlap=(True, True), optimizer=OPTIMIZERS[optimizer])
    assert overlapped == reference and calls.count("pull") == 1, calls


def test_a_non_trainable_variable_is_speculated_whole_and_keeps_its_state(ps, bg, connect):
    reference, _ = _train(ps, bg, connect, overlap=(False, False), non_trainable=("b/kernel",))
    overlapped, calls = _train(ps, bg, connect, overlap=(True, True), non_trainable=("b/kernel",))
    assert overlapped == reference and calls.count("pull") == 1, calls


@pytest.mark.parametrize("shapes", [SMALL, SHAPES], ids=["small", "streamed"])
def test_fine_blocks_make_every_push_a_push_pull_with_the_same_bits(ps, bg, connect, shapes):
    """``overlap_block_bytes`` (the worker's --overlap-block-kib, for slow links): a push small
    enough for one message goes as PushPull too, and the server speculates in the blocks the
    push asks for (here 4 KiB, the least: 20 rows of ``a/kernel``'s 50 floats)."""
    reference, calls = _train(ps, bg, connect, overlap=(False, False), shapes=shapes)
    assert "push_pull" not in calls
    layouts = []
    fine, calls = _train(ps, bg, connect, overlap=(True, True), shapes=shapes, block_bytes=4096, layouts=layouts)
    assert fine == reference
    assert calls.count("push_pull") == 3 and calls.count("pull") == 1, calls  # every round confirmed
    rows = 4096 // (shapes["a/kernel"][1] * 4)
    assert len(layouts) == 6 and all(layout["a/kernel"][:2] == [(0, rows), (rows, 2 * rows)] for layout in layouts)


def test_a_block_size_out_of_range_is_refused_and_nothing_is_applied(ps):
    running, _ = ps(mode="sync", num_workers=1)
    with PSClient(running.address, timeout=30, overlap_block_bytes=1024) as client:
        client.register(0, 1)
        client.initialize(0, _values(shapes=SMALL), ADAM)
        version, before = client.pull(0)
        with pytest.raises(PSClientError, match="overlap_block_bytes is 1024") as refused:
            client.push(0, 0, version, 32, _grads(0, 0, SMALL))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        after_version, after = running.core.pull()
        assert after_version == version and all(np.array_equal(before[n], after[n]) for n in SMALL)


def test_blocks_cover_every_row_once_and_a_norm_or_a_scalar_keeps_a_variable_whole():
    from ps_server.core.modes.overlap import BLOCK_BYTES, blocks

    cut = blocks((1000, 300), 4)
    assert cut[0][0] == 0 and cut[-1][1] == 1000 and all(a[1] == b[0] for a, b in zip(cut, cut[1:]))
    assert len(cut) == -(-1000 * 300 * 4 // (BLOCK_BYTES // (300 * 4) * 300 * 4))
    assert blocks((1000, 300), 4, whole=True) == [None] and blocks((), 4) == [None] and blocks((1, 9), 4) == [None]
    assert blocks((7,), 4) == [(0, 7)]
    assert blocks((1000, 300), 4, block_bytes=4096) == [(r, min(r + 3, 1000)) for r in range(0, 1000, 3)]
