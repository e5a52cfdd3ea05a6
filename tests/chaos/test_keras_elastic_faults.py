"""A ``tfps.keras`` program on elastic async tasks loses a worker: every task is still applied once.

    pytest -q tests/chaos/test_keras_elastic_faults.py

The keras.io GAN (``tests/cluster/programs/gan.py``: two optimizers a step) under
``elastic=True`` against an async server: each batch is two tasks, the discriminator's apply
and the generator's (``TaskQueue.applies``), each one push. Worker 1 is SIGKILLed while it
holds tasks; once their leases run out they go back to the queue and the chief does them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ps_common.procs import dying_with_parent
from tests.cluster.test_keras_fit import tf_config
from tests.cluster.test_keras_programs import GAN
from worker.client import PSClient

pytestmark = [pytest.mark.chaos, pytest.mark.cluster]


def test_a_gan_on_elastic_async_tasks_with_a_worker_killed_applies_every_task_and_example_once(procs, tmp_path):
    """Worker 1 is killed once it has pushed three tasks (one batch's two applies and the next
    batch's first, or the like: whatever it holds then goes back at its lease's end). The chief
    ends the fit alone: the server counts 64 tasks done, one push each, and the epoch's 1024
    examples once, each counted once its batch's two tasks are done."""
    _, address = procs.server("async", 2, extra=("--lease-timeout", "2"))
    out = tmp_path / "out"
    workers = []
    for i in range(2):
        env = {**os.environ, "TF_CONFIG": tf_config(address, i, 2), "TFPS_ELASTIC": "1", "PYTHONUNBUFFERED": "1",
               "MPLCONFIGDIR": str(tmp_path / "mpl")}
        log = open(tmp_path / f"keras-worker{i}.log", "w")
        workers.append(subprocess.Popen(dying_with_parent([sys.executable, GAN, "--out", str(out), "--epochs", "1"]),
                                        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env))
    chief, one = workers
    try:
        deadline = time.monotonic() + 240
        with PSClient(address) as client:
            while True:
                assert time.monotonic() < deadline and one.poll() is None, \
                    (tmp_path / "keras-worker1.log").read_text()[-3000:]
                try:
                    pushes = {w.worker_id: w.pushes for w in client.status().workers}
                except Exception:  # not initialized yet
                    pushes = {}
                if pushes.get(1, 0) >= 3:
                    break
                time.sleep(0.01)
            one.send_signal(signal.SIGKILL)
            assert chief.wait(240) == 0, (tmp_path / "keras-worker0.log").read_text()[-3000:]
            status = client.status()
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()
    assert (status.tasks_total, status.tasks_done, status.pushes_applied) == (64, 64, 64)
    assert list(status.epoch_examples) == [1024] and status.examples_applied == 2 * 1024
    assert json.loads((out / "worker0.json").read_text())["weights"]
