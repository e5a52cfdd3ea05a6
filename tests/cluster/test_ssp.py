"""Mode ssp with real processes: ps-server --mode ssp --staleness S and two ps-worker.

    python -m pytest -q tests/cluster/test_ssp.py
"""

import sys

import pytest

from tests.cluster.conftest import read_log, wait_exit
from worker.client import PSClient

pytestmark = pytest.mark.cluster


def test_two_workers_train_under_ssp_and_the_server_reports_the_bound_held(procs, tmp_path):
    server, address = procs.server("ssp", num_workers=2, extra=("--staleness", "1"))
    common = ["--dataset", "synthetic", "--steps", "12", "--result-json", str(tmp_path / "r.json")]
    workers = [procs.worker(address, i, 2, *common) for i in range(2)]
    for w in workers:
        assert wait_exit(w, 300) == 0, read_log(w)[-3000:]
    assert "server mode ssp" in read_log(workers[0])
    with PSClient(address) as c:
        s = c.status()
    assert (s.staleness, s.pushes_applied, s.version) == (1, 24, 24)
    assert 0 <= s.max_ahead <= 1
    assert "test_accuracy=" in read_log(workers[0])


def test_bad_staleness_flags_are_one_line_errors():
    import subprocess

    for argv, message in ((["--mode", "ssp", "--staleness", "-1"], "--staleness must be >= 0"),
                          (["--mode", "sync", "--stale-gradient-policy", "drop"], "sync has no stale gradients")):
        run = subprocess.run([sys.executable, "-m", "ps_server", *argv], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
