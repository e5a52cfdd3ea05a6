"""ps-launch scales an async job on the server's tasks while it runs: every example once.

    python -m pytest -q -m '' tests/cluster/test_launch_elastic_async.py

``ps-launch --mode async --elastic 2:3``: two workers on two epochs of digits, handed out
as tasks by the server (``ps_server/core/data/tasks.py``); ``--scale-at 15:3`` adds a third at
version 15 (both first workers pause at their step 10 for 25 s, so the job is surely
running when it is ready), then SIGUSR2 stops it again once it registered (SIGTERM: it
leaves the job, a task it held goes back). The run exits 0 and the server counted every example of each epoch
exactly once, one applied push per task.
"""

from __future__ import annotations

import json
import signal
import sys

import pytest

from .conftest import read_log, wait_exit
from .test_launch_elastic import wait_for_line

pytestmark = [pytest.mark.cluster, pytest.mark.recovery]

EXAMPLES = 1437
EPOCHS = 2
TASKS = EPOCHS * -(-EXAMPLES // 32)  # --global-batch-size 96 / 3 workers at most


# ~35 s: slow. ps-launch --elastic on async tasks with a worker added and stopped is
# test_launch_elastic_keras' on two shards, and the seeded async fault schedules add and kill more.
@pytest.mark.slow
def test_an_async_job_scaled_2_3_2_applies_every_example_once_per_epoch(procs, tmp_path):
    pause = "--pause-at-step 10 --pause-for 25"
    argv = [sys.executable, "-m", "ps_tools.launch", "--mode", "async", "--elastic", "2:3", "--workers", "2",
            "--scale-at", "15:3", "--dataset", "digits", "--model", "cnn", "--epochs", str(EPOCHS),
            "--global-batch-size", "96", "--added-latency-ms", "20", "--log-level", "WARNING",
            "--worker-args", "0", pause, "--worker-args", "1", pause,
            "--metrics-json", str(tmp_path / "m.json")]
    launch = procs.start(argv, "launch-async")
    wait_for_line(launch, "2 -> 3 workers: started worker(s)")
    launch.send_signal(signal.SIGUSR2)  # the newest but the chief, worker 2, once it registered
    wait_for_line(launch, "3 -> 2 workers: stopping worker 2")
    assert wait_exit(launch, 600) == 0, read_log(launch)[-3000:]
    assert read_log(launch).count("stopped by SIGTERM: left the job") == 1, read_log(launch)[-3000:]

    metrics = json.loads((tmp_path / "m.json").read_text())
    (shard,) = metrics["shards"]
    assert shard["epoch_examples"] == [EXAMPLES] * EPOCHS and shard["num_examples"] == EXAMPLES
    assert shard["tasks_total"] == shard["tasks_done"] == shard["pushes_applied"] == TASKS
    assert shard["examples_applied"] == EPOCHS * EXAMPLES
    events = [(e["event"], e["worker_id"]) for e in metrics["membership"]]
    assert ("joined", 2) in events and ("left", 2) in events and not [e for e in events if e[0] == "dead"], events
