"""Exactly-once data across a server restart, with real processes.

    pytest -q -p no:cacheprovider tests/chaos/test_data_plan_restart.py

Exactly-once data (issue 17) across a restart: checkpoints carry the data plan and its
progress (``tests/core/test_checkpoint_data.py``), here with real processes. A ps-server with --checkpoint-dir writes a checkpoint every 0.5 s; ps-workers
with --elastic train digits/cnn. Once a checkpoint holds some of the job's progress the
server is SIGKILLed and started again on the same port with the same directory; the
workers reconnect, rejoin the new incarnation and finish. What the kill lost (updates
after the last checkpoint) is done again: in async and ssp the tasks not recorded done in
the file are handed out again; in elastic sync the rounds after the file's round come
again, dealt from its ledger. Either way every example is counted exactly once per epoch,
the counters restored with the file plus the redone work end at one applied push per task
(micro-batch), and elastic sync's final weights are those of an undisturbed run, bit for bit.
The kill comes only once the server has shown progress past its newest file (checked with
the server SIGSTOPped), so some work is always lost and done again.
"""

from __future__ import annotations

import re
import signal
import sys
import time

import numpy as np
import pytest

from ps_server.core.checkpoint import latest_valid
from tests.cluster.conftest import Procs, read_log, wait_exit
from worker.client import PSClient

from .test_server_restart import free_port

pytestmark = [pytest.mark.chaos, pytest.mark.cluster, pytest.mark.recovery]

EXAMPLES = 1437  # digits' training examples
INTERVAL = "0.5"  # --checkpoint-interval
WORKER_FLAGS = ("--elastic", "--dataset", "digits", "--model", "cnn", "--reconnect-timeout", "60",
                "--log-level", "WARNING")


def start_server(procs: Procs, port: int, ckpt, log_name: str, *flags: str):
    proc = procs.start(
        [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", str(port), "--checkpoint-dir",
         str(ckpt), "--checkpoint-interval", INTERVAL, "--lease-timeout", "2", *flags],
        log_name,
    )
    with PSClient(f"127.0.0.1:{port}") as client:
        try:
            client.wait_ready(60)
        except Exception:
            pytest.fail(f"ps-server {log_name} not serving; log:\n{read_log(proc)[-3000:]}")
    return proc


def status(address: str):
    with PSClient(address) as client:
        return client.status()


def wait_until(address: str, what: str, ok, workers, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        s = status(address)
        if ok(s):
            return s
        for w in workers:
            assert w.poll() is None, f"a worker ended before {what}; log:\n{read_log(w)[-3000:]}"
        assert time.monotonic() < deadline, f"the server never showed {what}"
        time.sleep(0.02)


def kill_past_the_checkpoint(ps1, address: str, ckpt, ok, workers):
    """SIGKILL ``ps1`` once Status satisfies ``ok`` and shows a version past the newest file:
    the kill then surely loses updates. The server is SIGSTOPped to compare (a file written
    after Status answered would hold all it showed), continued and asked again if need be.
    Returns the Status last seen and the version in the newest file."""
    while True:
        seen = wait_until(address, "progress past a checkpoint", ok, workers)
        ps1.send_signal(signal.SIGSTOP)
        newest = latest_valid(str(ckpt), lazy=True)
        if newest is not None and 0 < newest[0].version < seen.version:
            ps1.kill()
            ps1.wait(timeout=30)
            return seen, newest[0].version
        ps1.send_signal(signal.SIGCONT)


def restored_version(ps2) -> int:
    return int(re.search(r"restored version (\d+)", read_log(ps2)).group(1))


# The default run has async's case in tests/chaos/test_nemesis.py (seeded faults, a server
# restart among them, every task once); ssp's stays here.
@pytest.mark.parametrize("mode", [pytest.param("async", marks=pytest.mark.slow), "ssp"])
def test_a_task_job_killed_mid_epoch_and_restarted_applies_every_task_and_example_once(procs, tmp_path, mode):
    epochs, workers = 2, 3
    tasks = epochs * -(-EXAMPLES // 16)  # --global-batch-size 48 / 3 workers: 16 examples a task
    port, ckpt = free_port(), tmp_path / "ckpt"
    address = f"127.0.0.1:{port}"
    server_flags = ("--mode", mode, "--num-workers", str(workers), *(("--staleness", "3") if mode == "ssp" else ()))
    ps1 = start_server(procs, port, ckpt, "ps1", *server_flags)
    flags = (*WORKER_FLAGS, "--epochs", str(epochs), "--global-batch-size", "48", "--added-latency-ms", "20")
    ws = [procs.worker(address, i, workers, *flags) for i in range(workers)]

    before, on_disk = kill_past_the_checkpoint(
        ps1, address, ckpt, lambda s: s.last_checkpoint_version >= 20, ws)
    ps2 = start_server(procs, port, ckpt, "ps2", *server_flags)
    # The file's progress, not the killed server's: the tasks done after it were lost with it.
    assert restored_version(ps2) == on_disk
    assert f": {on_disk} task(s) done" in read_log(ps2)
    restored = status(address)  # the workers may already have pushed to it again
    assert restored.incarnation != before.incarnation and restored.tasks_total == tasks

    for w in ws:
        assert wait_exit(w, 150) == 0, read_log(w)[-3000:]
    s = status(address)
    assert s.incarnation == restored.incarnation
    assert s.tasks_total == tasks and s.tasks_done == tasks
    assert s.tasks_held == 0 and s.tasks_queued == 0
    assert list(s.epoch_examples) == [EXAMPLES] * epochs and s.num_examples == EXAMPLES
    # The restored counters plus the redone tasks: one applied push per task, each example once.
    assert s.pushes_applied == tasks, read_log(ps2)[-3000:]
    assert s.examples_applied == epochs * EXAMPLES


def elastic_run(tmp_path, restart: bool):
    """Two epochs of elastic sync with three workers; with ``restart``, the server is killed
    past a checkpoint of round 8 or later and started again. Returns the chief's final
    weights, the last Status and, with ``restart``, the version the successor restored."""
    tmp = tmp_path / ("restarted" if restart else "undisturbed")
    tmp.mkdir()
    procs = Procs(tmp)
    try:
        port, ckpt = free_port(), tmp / "ckpt"
        address = f"127.0.0.1:{port}"
        server_flags = ("--mode", "sync", "--num-workers", "3", "--elastic-min-workers", "2",
                        "--micro-batches", "3")
        ps = start_server(procs, port, ckpt, "ps1", *server_flags)
        flags = (*WORKER_FLAGS, "--epochs", "2")
        ws = [procs.worker(address, 0, 3, *flags, "--save-weights", str(tmp / "final.npz"))]
        ws += [procs.worker(address, i, 3, *flags) for i in (1, 2)]
        restored = None
        if restart:
            before, on_disk = kill_past_the_checkpoint(ps, address, ckpt, lambda s: s.last_checkpoint_version >= 8,
                                                       ws)
            ps = start_server(procs, port, ckpt, "ps2", *server_flags)
            restored = restored_version(ps)
            assert restored == on_disk < before.version  # the rounds after the file come again
            assert status(address).incarnation != before.incarnation
        for w in ws:
            assert wait_exit(w, 150) == 0, read_log(w)[-3000:]
        return dict(np.load(tmp / "final.npz")), status(address), restored
    finally:
        procs.stop_all()


@pytest.mark.slow  # the default run's: tests/chaos/test_nemesis.py (server restarts among seeded faults, the bits)
def test_an_elastic_sync_job_killed_mid_epoch_and_restarted_ends_with_the_undisturbed_bits(tmp_path):
    undisturbed, quiet, _ = elastic_run(tmp_path, restart=False)
    disturbed, restarted, restored = elastic_run(tmp_path, restart=True)
    assert list(quiet.epoch_examples) == list(restarted.epoch_examples) == [EXAMPLES, EXAMPLES]
    assert restarted.version == restarted.round == quiet.version
    # The restored counters plus the rounds done again: each micro-batch counted once.
    assert restarted.pushes_applied == quiet.pushes_applied
    assert restarted.examples_applied == quiet.examples_applied == 2 * EXAMPLES
    assert undisturbed.keys() == disturbed.keys()
    for name in undisturbed:
        np.testing.assert_array_equal(disturbed[name], undisturbed[name], err_msg=name)
