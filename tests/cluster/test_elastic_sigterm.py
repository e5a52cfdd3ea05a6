"""SIGTERM wherever it lands in an elastic worker's step makes it leave the job cleanly.

    python -m pytest -q tests/cluster/test_elastic_sigterm.py

A ps-server in elastic sync (up to 2 workers, rounds cut in 2 micro-batches), and one
process (``sigterm_worker.py``) that runs ps-worker's ``main`` as worker 1 once per point,
each run sent SIGTERM at its point: while it waits for the chief's Initialize (before the
chief exists), while it waits for its first micro-batch, inside Keras loading the pulled
values, deep in the tracing of the GradientTape's ``tf.function``, inside its call (the
issue's worker exited 1 from a gradient step, through TensorFlow's ``traceback_utils``),
inside TensorFlow turning a gradient into NumPy, as a push starts, while a push waits for
its round's answer, and during a 600 s ``--pause-for``. The chief (worker 0) trains on
meanwhile; a SIGSTOP holds it while the worker waits for work or for its push's answer,
so that the wait lasts. The rule (``worker.elastic``): every run returns
``LEFT_JOB_STATUS`` within seconds of the signal, says it left the job, prints no
traceback, and the server's membership shows a ``left`` for each run and no worker
dead. The trap says where the main thread was: the three sure waits in
``SigtermFlag.wait_for`` or ``sleep``, the four others in TensorFlow or Keras.
"""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from ps_common.procs import LEFT_JOB_STATUS
from worker.client import PSClient

from .conftest import ROOT, read_log, wait_exit

pytestmark = pytest.mark.cluster

PROGRAM = os.path.join(ROOT, "tests", "cluster", "sigterm_worker.py")
POINTS = ("join-wait", "work-wait", "pull-load", "trace", "tape", "to-numpy", "before-push", "push-wait", "pause")
IN_TENSORFLOW = ("pull-load", "trace", "tape", "to-numpy")
# Where the main thread was, for sure: push-wait's chief is held as a rule, not always, before
# it delivered (sigterm_worker.py), so its signal may come after the push.
WAITING = {"join-wait": "wait_for", "work-wait": "wait_for", "pause": "sleep"}
FLAGS = ("--elastic", "--dataset", "digits", "--model", "tiny", "--steps", "1000000", "--log-level", "WARNING")
LEFT_WITHIN_S = 30.0  # from the signal to main's return, on a loaded machine; the pause alone is 600 s


def wait_for_line(proc, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in read_log(proc):
        assert proc.poll() is None, f"exited before {text!r}:\n{read_log(proc)[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout:g} s:\n{read_log(proc)[-4000:]}"
        time.sleep(0.1)


def runs(log: str) -> dict[str, tuple[str, int, float, str]]:
    """Each point's output, status, seconds from the signal to the end, and where a tf trap fired."""
    out = {}
    for m in re.finditer(r"@@ start (\S+)\n(.*?)@@ \1 status (-?\d+) after_s (\S+) where (\S+)\n", log, re.S):
        out[m[1]] = (m[2], int(m[3]), float(m[4]), m[5])
    return out


def test_sigterm_at_any_point_of_a_step_makes_the_worker_leave_the_job(procs):
    # A lease far longer than the chief is ever held by SIGSTOP (sigterm_worker.py's "hold").
    _, address = procs.server("sync", 2, extra=("--elastic-min-workers", "1", "--micro-batches", "2",
                                                 "--lease-timeout", "60"))
    chief_pid = procs.tmp_path / "chief.pid"
    victim = procs.start([sys.executable, PROGRAM, ",".join(POINTS), str(chief_pid), "--", "--ps", address,
                          "--worker-index", "1", "--num-workers", "2", "--init-timeout", "300", *FLAGS], "victim")
    wait_for_line(victim, "@@ join-wait status", 300)  # it waited for an Initialize nobody sent
    chief = procs.worker(address, 0, 2, *FLAGS)
    chief_pid.write_text(str(chief.pid))
    assert wait_exit(victim, 600) == 0, read_log(victim)[-4000:]

    log = read_log(victim)
    done = runs(log)
    assert list(done) == list(POINTS), log[-4000:]
    for point, (output, status, after_s, where) in done.items():
        assert status == LEFT_JOB_STATUS, f"{point}: status {status}\n{output[-3000:]}"
        assert "stopped by SIGTERM: left the job" in output, f"{point}:\n{output[-3000:]}"
        assert "Traceback" not in output and "ps-worker: error" not in output, f"{point}:\n{output[-3000:]}"
        assert 0 <= after_s < LEFT_WITHIN_S, f"{point}: left {after_s} s after the signal\n{output[-3000:]}"
        if point in IN_TENSORFLOW:  # the signal came while TensorFlow or Keras code ran
            assert "/tensorflow/" in where or "/keras/" in where, f"{point}: sent from {where}"
        if point in WAITING:  # the signal came while the main thread waited
            assert WAITING[point] in where.split("<")[:3], f"{point}: sent in {where}"

    with PSClient(address) as client:
        events = [(e.event, e.worker_id) for e in client.status().membership]
    assert events.count(("left", 1)) == len(POINTS), events
    assert not [e for e in events if e[0] in ("dead", "rejoined")], events
