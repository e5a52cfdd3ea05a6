"""``ps-server --mode async --async-apply hogwild`` with real processes: it trains, and it counts.

    python -m pytest -q tests/cluster/test_hogwild.py

The rule (``ps_server/core/modes/async_mode.py``, hogwild): pushes are written in place
under no lock and may overwrite each other's element updates, yet every push is
counted once in the version and ``pushes_applied``; training still converges. Two
ps-workers train the tutorial CNN on digits with Adam (the workers' default) and
reach test accuracy >= 0.85; an optimizer hogwild cannot run is refused at
initialize in one line naming it.
"""

import json
import subprocess
import sys

import pytest

from tests.cluster.conftest import read_log, wait_exit
from worker.client import PSClient

pytestmark = pytest.mark.cluster


def test_two_workers_train_digits_under_hogwild_and_every_push_is_counted_once(procs, tmp_path):
    server, address = procs.server("async", num_workers=2, extra=("--async-apply", "hogwild"))
    result = tmp_path / "r.json"
    common = ["--dataset", "digits", "--epochs", "3", "--seed", "1"]
    workers = [procs.worker(address, 0, 2, *common, "--result-json", str(result)),
               procs.worker(address, 1, 2, *common)]
    for w in workers:
        assert wait_exit(w, 300) == 0, read_log(w)[-3000:]
    metrics = json.loads(result.read_text())
    assert metrics["mode"] == "async" and metrics["test_accuracy"] >= 0.85, metrics
    with PSClient(address) as c:
        s = c.status()
    steps = 3 * 23  # 1437 training images, global batch 64, three epochs: each worker pushes every step
    assert (s.pushes_applied, s.version, s.optimizer_iterations) == (2 * steps, 2 * steps, 2 * steps)
    assert "async (hogwild apply), 2 workers, listening on" in read_log(server)


def test_an_optimizer_hogwild_cannot_run_stops_the_chief_with_one_line_naming_it(procs):
    server, address = procs.server("async", num_workers=1, extra=("--async-apply", "hogwild"))
    run = subprocess.run([sys.executable, "-m", "worker", "--ps", address, "--num-workers", "1", "--worker-index",
                          "0", "--dataset", "synthetic", "--steps", "2", "--optimizer", "lion"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "the optimizer is lion" in line]
    assert errors and "--async-apply locked" in errors[0], run.stderr[-3000:]
