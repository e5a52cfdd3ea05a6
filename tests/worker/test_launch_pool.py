"""ps-launch's elastic pool says how a worker it stopped ended when that was no clean leave.

    python -m pytest -q tests/worker/test_launch_pool.py

Real child processes (plain Python, no server): one exits 143 as ``ps-worker --elastic``
does once it left the job, one exits 0 (it had finished), one is killed by SIGKILL
before it could leave.
"""

import signal
import sys
import threading
import time

from ps_tools import launch


def child(label: str, code: str) -> launch.Child:
    return launch.Child(label, [sys.executable, "-c", code], threading.Lock(), env={})


def test_a_stopped_worker_that_did_not_leave_is_named_with_how_it_ended(capsys):
    pool = launch.ElasticPool(args=None, scaler=None, addresses=[], make=None, out_lock=threading.Lock(),
                              children=[])
    workers = [child("worker 1", "raise SystemExit(143)"), child("worker 2", "pass"),
               child("worker 3", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")]
    for w in workers:
        pool.started.append(w)
        pool.stopping[w] = time.monotonic()
    deadline = time.monotonic() + 60
    while (failed := pool._check([])) is None:
        assert time.monotonic() < deadline, "the children did not exit"
        time.sleep(0.05)
    assert failed == []  # stopped on purpose: no failure of the job, whatever the status
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ps-launch:")]
    assert said == ["ps-launch: worker 3 was stopped but exited killed by SIGKILL, not with 143 (left the job): "
                    "unless it had finished, the server declares it dead when its lease runs out"]
    assert pool._check([]) == [] and len(capsys.readouterr().out.splitlines()) == 0  # said once


def test_an_exit_status_in_words():
    assert launch._how_it_exited(1) == "with status 1"
    assert launch._how_it_exited(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert launch._how_it_exited(-200) == "killed by signal 200"
