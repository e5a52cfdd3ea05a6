"""A sync round beyond ``aggregation.HELD_BYTES`` holds one accumulator, not every push:
streamed pushes give their receive buffers back as soon as the round has folded them;
within it, a round holds its pushes whole until it ends, and the receive budget admits
them all. The bytes received at once stay within the server's receive budget.

    python -m pytest tests/service/test_round_memory.py -q
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from ps_server.aio import AsyncBudget
from ps_server.buffers import BufferPool

SGD = {"name": "sgd", "learning_rate": 1.0}


def _wait_until(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("held", [False, True], ids=["folded", "held"])
def test_waiting_streamed_pushes_hold_no_receive_buffer_until_their_round_ends(ps, connect, bg, monkeypatch, held):
    from ps_server.core.modes import aggregation

    if not held:
        monkeypatch.setattr(aggregation, "HELD_BYTES", 0)  # the server runs in this process
    n = 4
    running, client = ps(mode="sync", num_workers=n)
    clients = [client] + [connect(running) for _ in range(n - 1)]
    for w, c in enumerate(clients):
        c.register(w, n)
        c.overlap = False  # plain PushStream: the path that folds on arrival
    values = {"w": np.zeros(400_000, np.float32)}  # 1.6 MB: streamed, not one message
    clients[0].initialize(0, values, SGD)
    grads = [{"w": np.full(400_000, float(w + 1), np.float32)} for w in range(n)]
    calls = [bg(clients[w].push, w, 0, 0, 1, grads[w]) for w in range(1, n)]
    core = running.core
    _wait_until(lambda: core.mode.status().waiting_for == (0,))
    # Three pushes wait at the barrier. Folded, none of them holds its bytes any more (the
    # budget is given back on the event loop, a moment after the fold); held, all three do.
    _wait_until(lambda: running.servicer.receiving.in_use == (3 * 1_600_000 if held else 0), timeout=5)
    clients[0].push(0, 0, 0, 1, grads[0])
    for call in calls:
        call.result(timeout=30)
    _, got = clients[0].pull(0)
    np.testing.assert_array_equal(got["w"], np.full(400_000, -2.5, np.float32))  # mean of 1..4
    _wait_until(lambda: running.servicer.receiving.in_use == 0, timeout=5)


def test_the_receive_budget_lets_one_push_in_however_large_and_bounds_the_rest():
    async def scenario():
        budget = AsyncBudget(100)
        assert await budget.acquire(500, timeout=0)  # alone: let in
        assert not await budget.acquire(1, timeout=0.05)  # full
        budget.release(500)
        assert await budget.acquire(60, timeout=0) and await budget.acquire(40, timeout=0)
        waiter = asyncio.ensure_future(budget.acquire(50, timeout=10))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # 60 + 40 + 50 > 100: waits, holding no thread
        await asyncio.get_running_loop().run_in_executor(None, budget.release, 60)  # from another thread
        assert await asyncio.wait_for(waiter, 5)
        assert budget.in_use == 90 and budget.peak == 500

    asyncio.run(scenario())


def test_the_buffer_pool_keeps_at_most_keep_bytes_of_free_buffers_of_a_size():
    pool = BufferPool(keep=100, keep_bytes=3000)
    buffers = [pool.acquire(1000) for _ in range(10)]
    for b in buffers:
        pool.release(b)
    assert len(pool._free[1000]) == 3


def test_a_push_that_finds_no_room_in_time_is_refused_as_unavailable_and_changes_nothing(ps):
    running, client = ps(mode="async", num_workers=1)
    client.register(0, 1)
    values = {"w": np.zeros(400_000, np.float32)}
    client.initialize(0, values, SGD)
    assert running.server.call(running.servicer.receiving.acquire(1 << 40, timeout=0))  # huge: no room left
    client_timeout = 2.0
    from worker.client import PSClient
    short = PSClient(running.address, timeout=client_timeout)
    try:
        with pytest.raises(Exception) as info:
            short.push(0, 0, 0, 1, {"w": np.ones(400_000, np.float32)})
        code = info.value.code
        code = code() if callable(code) else code
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), info.value
    finally:
        short.close()
    running.servicer.receiving.release(1 << 40)
    version, got = client.pull(0)
    assert version == 0 and not got["w"].any()
