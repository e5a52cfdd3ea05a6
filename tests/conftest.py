"""A whole-run limit: no test session outlives CI's budget silently.

pytest-timeout (pyproject.toml) stops one test that hangs. This stops a run
whose tests each stay under that limit but add up to far more than the suite's
usual 40 minutes (say, every worker process failing slowly on a broken
machine): after ``TFPS_TEST_SESSION_LIMIT_S`` seconds (default 80 minutes,
under CI's 90 with the install's ~4; a slow day's clean run of 2026-12-07 took 63) it prints every thread's stack and exits with
status 1, so the log shows where the time went. Like pytest-timeout's thread
method, it suspends pytest's output capture first so the stacks reach the terminal.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

import pytest

from tests.withheld import messages_withheld

# oneDNN changes TensorFlow's bits, and eager and traced steps differently (its fused kernels are
# a graph's): the tests' bit-for-bit comparisons need it off before any test module imports
# TensorFlow, whichever runs first (``tests/worker`` alone once imported it first from a module
# that did not set this). Processes the tests start inherit it.
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"

_watchdog: threading.Timer | None = None


def _expire(config, limit: float) -> None:
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n+++ the test session ran past TFPS_TEST_SESSION_LIMIT_S={limit:g} s: "
                     "every thread's stack follows, then the run stops +++\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(1)


def pytest_sessionstart(session):
    global _watchdog
    limit = float(os.environ.get("TFPS_TEST_SESSION_LIMIT_S", 80 * 60))
    if limit > 0:
        _watchdog = threading.Timer(limit, _expire, args=(session.config, limit))
        _watchdog.daemon = True
        _watchdog.start()


def pytest_sessionfinish(session, exitstatus):
    if _watchdog is not None:
        _watchdog.cancel()



# A test marked ``recovery`` runs with every refusal's text withheld, in its own process
# and in every process it starts (tests/withheld): what a worker does after a refusal
# follows its reason, and rewording a message changes nothing.
@pytest.fixture(autouse=True)
def _withheld_messages(request):
    if request.node.get_closest_marker("recovery") is None:
        yield
        return
    with messages_withheld():
        yield
