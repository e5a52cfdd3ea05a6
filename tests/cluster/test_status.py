"""ps-status against real processes: it names the worker a sync barrier waits for.

    python -m pytest -q tests/cluster/test_status.py
"""

import subprocess
import sys
import time

import pytest

from tests.cluster.conftest import read_log
from worker.client import PSClient

pytestmark = pytest.mark.cluster


def status(*argv):
    return subprocess.run([sys.executable, "-m", "ps_tools.status", *argv], capture_output=True, text=True, timeout=60)


def test_ps_status_names_the_stalled_worker_the_barrier_waits_for(procs):
    server, address = procs.server("sync", num_workers=2)
    common = ["--dataset", "synthetic", "--steps", "40"]
    workers = [procs.worker(address, 0, 2, *common),
               procs.worker(address, 1, 2, *common, "--pause-at-step", "3", "--pause-for", "60")]
    with PSClient(address) as c:
        deadline = time.monotonic() + 120
        while True:
            s = c.status()
            if s.version >= 3 and list(s.waiting_for) == [1]:
                break
            assert time.monotonic() < deadline, (s, read_log(workers[1])[-2000:])
            time.sleep(0.2)
    time.sleep(1.0)  # the stalled worker stays silent on pushes but heartbeats
    run = status(address)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert f"{address}  mode sync  version 3  round 3  workers 2" in out, out
    assert "barrier of round 3 waits for: worker 1 (" in out, out
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert rows["1"].split()[1] == "awaited" and rows["1"].split()[2] == "2", out  # last step 2
    assert rows["0"].split()[1] == "waiting", out  # pushed round 3, at the barrier
    for w in workers:
        w.kill()


def test_ps_status_of_an_absent_server_says_so_and_fails():
    run = status("127.0.0.1:1", "--timeout", "1")
    assert run.returncode == 1 and "127.0.0.1:1  not answering: " in run.stdout, run.stdout + run.stderr
