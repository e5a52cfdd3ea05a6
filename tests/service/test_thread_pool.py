"""Workers blocked in a sync barrier do not starve other calls.

    python -m pytest tests/service/test_thread_pool.py -q

Rule (STYLE.md 6): "the server's thread pool is sized so that N workers blocked
in a barrier cannot starve pulls, health checks and control calls"
(ServerConfig.pool_threads: max(16, 2N + 8) by default; an explicit --threads
must exceed N). With N - 1 workers waiting for the last one, Pull, Status and
Health from other threads each answer within a short deadline. The last test
shows what the rule prevents: a pool no larger than the waiters answers nothing.
"""

import time

import grpc
import numpy as np
import pytest

from ps_server.config import ConfigError, ServerConfig
from worker.client import PSClient, PSClientError

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
    [(4, 0), (4, 5), (16, 0)],
    ids=["4_workers_default_pool", "4_workers_smallest_allowed_pool", "16_workers_default_pool"],
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


def test_default_pool_leaves_room_beside_every_worker():
    for n in (1, 4, 16, 100):
        assert ServerConfig(num_workers=n).pool_threads >= n + 8


def test_explicit_pool_no_larger_than_the_workers_is_refused():
    with pytest.raises(ConfigError, match="starve"):
        ServerConfig(num_workers=4, threads=4).validate()


def test_a_pool_no_larger_than_the_waiters_would_starve_status(ps, connect, bg, wait_until, monkeypatch):
    # The control experiment for the rule above: skip validation, give the pool
    # exactly as many threads as there are waiters, and Status cannot answer.
    monkeypatch.setattr(ServerConfig, "validate", lambda self: self)
    running, _ = ps(mode="sync", num_workers=4, threads=3, barrier_timeout=2.0)
    _, waiters = _block_all_but_last(running, connect, bg, wait_until, 4)
    probe = PSClient(running.address, timeout=0.5)
    try:
        with pytest.raises(PSClientError) as info:
            probe.status()
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        probe.close()
    for w in waiters:  # the barrier timeout frees the pool
        with pytest.raises(PSClientError) as info:
            w.result(timeout=10)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
