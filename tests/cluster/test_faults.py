"""Faults with real processes: a worker killed in the middle of sync training.

The rule: "a killed worker in sync mode makes the others fail within the barrier
timeout with a message naming it, while the server keeps serving."
"""

import os
import signal
import time

import pytest

from tests.cluster.conftest import read_log, wait_exit
from worker.client import PSClient

pytestmark = pytest.mark.cluster

# Long enough that round 0 survives one worker importing TensorFlow much later than the
# other on a loaded machine; the lease is longer still, so this checks the barrier's own
# timeout (the lease-based policies have their own tests in tests/chaos).
BARRIER_TIMEOUT = 15.0
LEASE_TIMEOUT = 120.0


def test_killed_worker_makes_sync_peers_fail_within_barrier_timeout_naming_it(procs):
    server, address = procs.server("sync", 2, barrier_timeout=BARRIER_TIMEOUT,
                                   extra=("--lease-timeout", str(LEASE_TIMEOUT)))
    flags = ["--dataset", "synthetic", "--steps", "100000", "--log-every", "5"]
    w0 = procs.worker(address, 0, 2, *flags)
    w1 = procs.worker(address, 1, 2, *flags)
    with PSClient(address) as client:
        deadline = time.monotonic() + 180
        while client.status().version < 5:
            assert w0.poll() is None and w1.poll() is None, read_log(w0)[-2000:] + read_log(w1)[-2000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)

        os.kill(w1.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        code = wait_exit(w0, BARRIER_TIMEOUT + 60)
        waited = time.monotonic() - killed_at
        log = read_log(w0)
        assert code == 1, log[-3000:]
        assert waited < BARRIER_TIMEOUT + 30, waited
        error = [line for line in log.splitlines() if line.startswith("ps-worker: error")]
        assert error, log[-3000:]
        assert "DEADLINE_EXCEEDED" in error[-1] and "worker(s) 1 (" in error[-1], error
        assert "Traceback" not in log

        # The server keeps serving: health, status, pulls all answer, state intact.
        assert server.poll() is None
        assert client.health() == "SERVING"
        status = client.status()
        assert status.rounds_timed_out >= 1
        version, values = client.pull()
        assert version == status.version >= 5
        assert all(v.size for v in values.values())
