"""Async exactly-once data with real processes: workers killed, stopped and added mid-run,
and still every example applied exactly once per epoch, no batch twice.

A ps-server in async mode and ps-workers with --elastic, three epochs of digits: the chief
sends a data plan with the epochs and the server hands out the batches as tasks
(``ps_server/core/data/tasks.py``). At a seeded random point worker 2 is SIGKILLed (its held
task goes back when its lease runs out), workers 0 and 1 are SIGSTOPped (their leases run
out too: declared dead, their tasks go back) and a new worker 3 starts; once worker 3 has
pushed, 0 and 1 are continued: they find themselves declared dead, rejoin, and the pushes
they had in flight for tasks since handed to worker 3 are refused. Later, at another
seeded point, worker 3 is SIGKILLed. The server's Status then says: every task applied
once (pushes applied == tasks), each epoch counted every example exactly once.
"""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

from worker.client import PSClient

from .conftest import wait_exit

pytestmark = [pytest.mark.cluster, pytest.mark.recovery]

EXAMPLES = 1437  # digits' training examples
EPOCHS = 3
BATCH = 16  # --global-batch-size 64 / --num-workers 4: one task's examples
TASKS = EPOCHS * -(-EXAMPLES // BATCH)


def status(address: str):
    with PSClient(address) as client:
        return client.status()


def wait_until(address: str, what: str, ok, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while True:
        s = status(address)
        if ok(s):
            return s
        assert time.monotonic() < deadline, f"the server never showed {what}: {s.tasks_done} tasks done"
        time.sleep(0.05)


def pushes_of(s, worker: int) -> int:
    return next((w.pushes for w in s.workers if w.worker_id == worker), 0)


# The default run has async's case in tests/chaos/test_nemesis.py (seeded faults, a kill, a pause past
# the lease and an auto index among them, every task once); ssp's stays here.
@pytest.mark.parametrize("mode", [pytest.param("async", marks=pytest.mark.slow), "ssp"])
def test_workers_killed_stopped_and_added_apply_every_example_once_per_epoch(procs, tmp_path, mode):
    rng = random.Random(23)
    bound = ("--staleness", "3") if mode == "ssp" else ()
    _, address = procs.server(mode, 4, extra=("--lease-timeout", "2", *bound))
    flags = ("--elastic", "--dataset", "digits", "--model", "cnn", "--epochs", str(EPOCHS),
             "--global-batch-size", "64", "--added-latency-ms", "20", "--log-level", "WARNING")
    history = lambda i: ("--history-json", str(tmp_path / f"h{i}.json"))  # noqa: E731
    chief = procs.worker(address, 0, 4, *flags, *history(0))
    one = procs.worker(address, 1, 4, *flags, *history(1))
    two = procs.worker(address, 2, 4, *flags)

    kill_at = rng.randint(10, 60)
    wait_until(address, f"{kill_at} tasks done", lambda s: s.tasks_done >= kill_at)
    two.send_signal(signal.SIGKILL)
    for p in (chief, one):
        p.send_signal(signal.SIGSTOP)  # their leases run out: declared dead, their tasks go back
    try:
        wait_until(address, "workers 0, 1 and 2 declared dead",
                   lambda s: {0, 1, 2} <= {w.worker_id for w in s.workers if w.dead})
        s = status(address)
        assert s.tasks_held == 0 and s.tasks_queued >= 1  # what they held went back
        three = procs.worker(address, 3, 4, *flags)
        wait_until(address, "worker 3's pushes", lambda s: pushes_of(s, 3) >= 5)
    finally:
        for p in (chief, one):
            p.send_signal(signal.SIGCONT)
    s = status(address)

    second_kill = rng.randint(s.tasks_done + 10, s.tasks_done + 60)
    s = wait_until(address, f"{second_kill} tasks done or the end",
                   lambda s: s.tasks_done >= min(second_kill, TASKS))
    if s.tasks_done < TASKS:
        three.send_signal(signal.SIGKILL)
    assert wait_exit(chief, 300) == 0
    assert wait_exit(one, 120) == 0

    s = status(address)
    assert s.tasks_total == TASKS and s.tasks_done == TASKS
    assert s.tasks_held == 0 and s.tasks_queued == 0
    assert list(s.epoch_examples) == [EXAMPLES] * EPOCHS and s.num_examples == EXAMPLES
    # No batch applied twice: one applied push per task, each of its examples once.
    assert s.pushes_applied == TASKS
    assert s.examples_applied == EPOCHS * EXAMPLES
    # The survivors' records: the tasks each had applied are disjoint (replays aside).
    applied = [r["task"] for i in (0, 1) for r in json.loads((tmp_path / f"h{i}.json").read_text())["steps"]]
    assert len(applied) == len(set(applied)) and applied
