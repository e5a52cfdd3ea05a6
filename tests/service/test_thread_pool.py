"""Workers waiting in a sync barrier hold no thread and do not starve other calls.

    python -m pytest tests/service/test_thread_pool.py -q

Rule (STYLE.md 6, and issue 16): "N workers blocked in a barrier cannot starve pulls,
health checks and control calls", and the thread count does not grow with N: a
waiting push awaits its round on the event loop (``ps_server.aio``), so a pool of
``--threads`` (default max(8, 4 x CPUs)) serves any number of waiters. With N - 1
workers waiting for the last one, Pull, Status and Health from other threads each
answer within a short deadline, also with a pool smaller than the waiters, and the
server's threads are as many with 64 waiters as with 4.
"""

import threading

import time

import numpy as np
import pytest

from ps_server.config import ConfigError, ServerConfig
from worker.client import PSClient

W0 = {"w": np.zeros(4, np.float32)}
ONES = {"w": np.ones(4, np.float32)}
SGD = {"name": "sgd", "learning_rate": 0.5}
PROMPT = 3.0  # seconds: a call that is not starved answers in milliseconds


def _block_all_but_last(running, connect, bg, wait_until, num_workers):
    """Register and initialize; workers 0..N-2 push round 0 and wait for worker N-1."""
    chief = connect(running)
    for i in range(num_workers):
        chief.register(i, num_workers)
    chief.initialize(0, W0, SGD)
    waiters = [bg(connect(running).push, i, 0, 0, 1, ONES) for i in range(num_workers - 1)]
    # Ask the core directly: in the starved case no RPC would answer.
    wait_until(lambda: running.core.status().waiting_for == (num_workers - 1,), timeout=10,
               what=f"{num_workers - 1} workers waiting in the barrier")
    return chief, waiters


def _answers_promptly(name, call):
    start = time.monotonic()
    result = call()
    elapsed = time.monotonic() - start
    assert elapsed < PROMPT, f"{name} took {elapsed:.2f} s while workers waited in the barrier"
    return result


@pytest.mark.parametrize(
    "num_workers, threads",
    [(4, 0), (4, 2), (16, 0)],
    ids=["4_workers_default_pool", "4_workers_smallest_pool", "16_workers_default_pool"],
)
def test_workers_blocked_in_a_barrier_do_not_starve_pull_status_and_health(ps, connect, bg, wait_until,
                                                                           num_workers, threads):
    running, _ = ps(mode="sync", num_workers=num_workers, threads=threads)
    chief, waiters = _block_all_but_last(running, connect, bg, wait_until, num_workers)
    probe = PSClient(running.address, timeout=PROMPT)
    try:
        status = _answers_promptly("Status", probe.status)
        assert list(status.waiting_for) == [num_workers - 1]
        version, values = _answers_promptly("Pull", lambda: probe.pull(0))
        assert version == 0 and values["w"].tobytes() == W0["w"].tobytes()
        assert _answers_promptly("Health", lambda: probe.health(timeout=PROMPT)) == "SERVING"
        # Several at once from other threads, as a status page and a health checker would.
        calls = [bg(probe.status) for _ in range(4)] + [bg(probe.health, PROMPT) for _ in range(4)]
        for c in calls:
            c.result(timeout=PROMPT + 1)
    finally:
        probe.close()
    assert all(not w.done() for w in waiters)  # still waiting: the probes did not release them
    last = chief.push(num_workers - 1, 0, 0, 1, ONES)
    assert [w.result(timeout=10) for w in waiters] == [last] * (num_workers - 1)
    assert last.version == 1 and last.contributors == num_workers


def test_the_default_pool_does_not_grow_with_the_workers():
    assert {ServerConfig(num_workers=n).pool_threads for n in (1, 4, 16, 1024)} == {ServerConfig().pool_threads}


def test_a_pool_of_fewer_than_two_threads_is_refused():
    with pytest.raises(ConfigError, match="--threads must be >= 2"):
        ServerConfig(num_workers=4, threads=1).validate()


def test_a_pool_smaller_than_the_waiters_still_answers_status_and_releases_them(ps, connect, bg, wait_until):
    running, _ = ps(mode="sync", num_workers=8, threads=2)
    chief, waiters = _block_all_but_last(running, connect, bg, wait_until, 8)
    probe = PSClient(running.address, timeout=PROMPT)
    try:
        assert list(_answers_promptly("Status", probe.status).waiting_for) == [7]
    finally:
        probe.close()
    last = chief.push(7, 0, 0, 1, ONES)
    assert [w.result(timeout=10) for w in waiters] == [last] * 7


def _server_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(("ps-rpc", "ps-aio")))


def test_the_servers_threads_do_not_grow_with_the_workers_waiting(ps, connect, bg, wait_until):
    counts = {}
    for n in (4, 64):
        # Only this server's threads: those of servers stopped before have ended.
        wait_until(lambda: _server_threads() == 0, timeout=20, what="no server threads left over")
        running, _ = ps(mode="sync", num_workers=n)
        chief, waiters = _block_all_but_last(running, connect, bg, wait_until, n)
        counts[n] = _server_threads()
        last = chief.push(n - 1, 0, 0, 1, ONES)
        assert [w.result(timeout=30) for w in waiters] == [last] * (n - 1)
        running.stop(grace=0.5)
    # Threads of the two servers' pools (this process runs both, one after the other): at
    # most the pool and the loop, however many workers wait.
    assert counts[64] <= ServerConfig().pool_threads + 1, counts


def test_status_and_health_answer_while_every_pool_thread_is_busy(ps, wait_until):
    """The pool is where the pushes' and pulls' work queues (at the end of a sync round of
    1,024 workers: their pulls' encodes, issue 27). Status runs on a thread of its own and
    Health on the event loop, so both answer while every pool thread is taken and more
    work waits behind them."""
    running, chief = ps(mode="sync", num_workers=2, threads=2)
    chief.register(0, 2)
    chief.initialize(0, W0, SGD)
    release = threading.Event()
    busy = [running.server.pool.submit(release.wait, 60) for _ in range(2 + 4)]  # both threads, and a queue
    probe = PSClient(running.address, timeout=PROMPT)
    try:
        wait_until(lambda: sum(f.running() for f in busy) == 2, timeout=10, what="both pool threads taken")
        status = probe.status()
        assert status.initialized and status.num_workers == 2 and status.num_variables == 1
        assert probe.health(timeout=PROMPT) == "SERVING"
        assert not any(f.done() for f in busy)  # the pool stayed full while they answered
    finally:
        release.set()
        probe.close()
