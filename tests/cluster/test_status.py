"""ps-status against real processes: it names the worker a sync barrier waits for, and
shows several shards combined.

    python -m pytest -q tests/cluster/test_status.py
"""

import subprocess
import sys
import time

import numpy as np
import pytest

from tests.cluster.conftest import read_log
from worker.client import PSClient
from worker.sharded_client import ShardedClient

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


def test_ps_status_on_two_ssp_shards_shows_the_cluster_with_the_bound_policy_and_worker_times(procs):
    """Two ps-server processes; pushes through ShardedClient from here (no TensorFlow):
    worker 1 pushes step 0, worker 0 step 0 from an older version (scaled) and step 1.
    The issue: combine_statuses dropped these fields, "so ps-status and ps-advise on
    several shards show less than on one"."""
    flags = ("--staleness", "3", "--stale-gradient-policy", "scale", "--max-staleness", "5")
    addresses = [procs.server("ssp", num_workers=2, extra=flags)[1] for _ in range(2)]
    values = {"a": np.zeros(1000, np.float32), "b": np.ones(1000, np.float32)}
    grads = {n: np.full(1000, 0.5, np.float32) for n in values}
    with ShardedClient(addresses) as w0, ShardedClient(addresses) as w1:
        w0.register(0, 2, "w0")
        w1.register(1, 2, "w1")
        w0.initialize(0, values, {"name": "sgd", "learning_rate": 0.1})
        base0, _ = w0.pull(0)
        base1, _ = w1.pull(1)
        w1.push(1, 0, base1, 8, grads)
        w0.push(0, 0, base0, 8, grads)
        version, _ = w0.pull(0)
        time.sleep(0.05)  # worker 0's "compute": its work_s between the pushes
        w0.push(0, 1, version, 8, grads)
        combined = w0.status()
    run = status(",".join(addresses))
    assert run.returncode == 0, run.stderr
    blocks = run.stdout.split("\n\n")
    assert len(blocks) == 3 and blocks[0].startswith("cluster of 2 shards  mode ssp  version 3"), run.stdout
    cluster = blocks[0]
    assert "scaled 1" in cluster and "stale policy scale" in cluster, cluster
    assert f"max ahead {combined.max_ahead} of bound 3" in cluster, cluster
    rows = {line.split()[0]: line.split() for line in cluster.splitlines()[4:]}
    w0_status = next(w for w in combined.workers if w.worker_id == 0)
    assert rows["0"][1] == "training" and rows["0"][4] == "2", cluster  # pushes on every shard
    assert w0_status.work_s >= 0.05 and w0_status.wait_s > 0
    assert rows["0"][5:7] == [f"{w0_status.work_s:.3f}", f"{w0_status.wait_s:.3f}"], cluster  # as combined
    for address, block in zip(addresses, blocks[1:]):
        assert block.startswith(f"{address}  mode ssp  version 3"), block
