"""Elastic sync with real processes: workers killed and added mid-run change no bit of the result.

A ps-server with --elastic-min-workers and ps-workers with --elastic, two epochs of
digits: once undisturbed (three workers), once with worker 2 SIGKILLed at a seeded random
round (its undelivered micro-batch moves to a live worker when its lease runs out) and a
fourth worker started then, which joins while the chief pauses at a later round (the
pause only makes sure the job is still running when the new worker is ready). The chief's
final weights are the same bits, and the server counted every example of both epochs
exactly once.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time

import numpy as np
import pytest

from worker.client import PSClient

from .conftest import wait_exit

pytestmark = [pytest.mark.cluster, pytest.mark.recovery]

EXAMPLES = 1437  # digits' training examples
STEPS = 46  # two epochs of global batches of 64 (22 full ones and one of 29 each)
PAUSE_AT = 14


def wait_for_version(address: str, version: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with PSClient(address) as client:
        while client.status().version < version:
            assert time.monotonic() < deadline, f"the server did not reach version {version}"
            time.sleep(0.05)


def run(procs, tmp_path, disturb: random.Random | None):
    _, address = procs.server("sync", 4, extra=("--elastic-min-workers", "3", "--micro-batches", "3",
                                                 "--lease-timeout", "2"))
    flags = ("--elastic", "--dataset", "digits", "--model", "cnn", "--steps", str(STEPS), "--log-level", "WARNING")
    weights = tmp_path / f"final-{'disturbed' if disturb else 'undisturbed'}.npz"
    pause = ("--pause-at-step", str(PAUSE_AT), "--pause-for", "30") if disturb else ()
    chief = procs.worker(address, 0, 4, *flags, *pause, "--save-weights", str(weights),
                         "--history-json", str(tmp_path / f"h0-{bool(disturb)}.json"))
    others = [procs.worker(address, i, 4, *flags, "--history-json", str(tmp_path / f"h{i}-{bool(disturb)}.json"))
              for i in (1, 2)]
    if disturb:
        kill_at = disturb.randint(2, PAUSE_AT - 4)
        wait_for_version(address, kill_at)
        others[1].send_signal(signal.SIGKILL)
        others.append(procs.worker(address, 3, 4, *flags, "--history-json", str(tmp_path / "h3.json")))
    assert wait_exit(chief, 300) == 0
    for p in others:
        code = wait_exit(p, 60)
        assert code == (-signal.SIGKILL if p is others[1] and disturb else 0)
    with PSClient(address) as client:
        status = client.status()
    return dict(np.load(weights)), status


@pytest.mark.slow  # the default run's: tests/chaos/test_nemesis.py (kills and auto indexes among seeded faults, the bits)
def test_a_worker_killed_and_one_added_mid_run_end_with_the_undisturbed_weights(procs, tmp_path):
    undisturbed, quiet = run(procs, tmp_path, None)
    disturbed, churned = run(procs, tmp_path, random.Random(17))
    assert undisturbed.keys() == disturbed.keys()
    for name in undisturbed:
        np.testing.assert_array_equal(disturbed[name], undisturbed[name], err_msg=name)
    # Every example of both epochs was counted once, whoever computed it.
    assert quiet.examples_applied == churned.examples_applied == 2 * EXAMPLES
    assert list(quiet.epoch_examples) == list(churned.epoch_examples) == [EXAMPLES, EXAMPLES]
    assert quiet.version == churned.version == STEPS
    joined = json.loads((tmp_path / "h3.json").read_text())["steps"]
    assert joined, "the worker added mid-run computed nothing"
    # While two workers were left, one of them computed two of a round's three micro-batches
    # (one mean of both would have rounded differently: tests/core/test_cursor.py).
    doubled = [r for i in (0, 1) for r in json.loads((tmp_path / f"h{i}-True.json").read_text())["steps"]
               if r["micro_batches"] > 1]
    assert doubled, "no round was computed by fewer workers than micro-batches"
