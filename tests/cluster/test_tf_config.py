"""A Kubeflow TFJob's layout, with real processes: two ``ps`` tasks, a chief and a worker.

    python -m pytest tests/cluster/test_tf_config.py -q

Issue (configuration): "Every ``cluster.ps`` entry must be a shard, in that
order" - a TFJob with two PS replicas trained on one and left the other idle.
Each ps-server gets the TF_CONFIG of its own ps task and reads its port from
it; each ps-worker gets that of its chief or worker task and nothing else (no
--ps, no index, no count). After a few synchronous steps both servers hold
pieces of the model and were pushed to, once per step each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from protos import wire
from ps_common.ports import free_ports
from ps_common.procs import dying_with_parent
from tests.cluster.conftest import port_of, read_log, wait_exit
from worker.client import PSClient

pytestmark = pytest.mark.cluster

STEPS = 4


def start(procs, argv: list[str], name: str, tf_config: dict) -> subprocess.Popen:
    """Like ``procs.start``, which clears TF_CONFIG, but with this task's TF_CONFIG."""
    log = open(procs.tmp_path / f"{name}.log", "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CONFIG": json.dumps(tf_config)}
    proc = subprocess.Popen(dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            cwd=procs.tmp_path, env=env)
    proc.log_path = procs.tmp_path / f"{name}.log"
    procs.procs.append(proc)
    return proc


def test_every_ps_task_of_tf_config_is_a_shard_and_is_trained_on(procs, tmp_path):
    ps_ports = free_ports(4)
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ps_ports[:2]], "chief": [f"127.0.0.1:{ps_ports[2]}"],
               "worker": [f"127.0.0.1:{ps_ports[3]}"]}
    servers = []
    for i in range(2):
        port_file = tmp_path / f"port-{i}"
        server = start(procs, [sys.executable, "-m", "ps_server", "--mode", "sync", "--port-file", str(port_file)],
                       f"ps{i}", {"cluster": cluster, "task": {"type": "ps", "index": i}})
        servers.append((server, port_file))
    for i, (server, port_file) in enumerate(servers):
        assert port_of(server, port_file) == ps_ports[i]  # the port of its own cluster.ps entry
    for address in cluster["ps"]:
        with PSClient(address) as c:
            c.wait_ready(30)

    result = tmp_path / "result.json"
    common = [sys.executable, "-m", "worker", "--dataset", "digits", "--steps", str(STEPS)]
    chief = start(procs, [*common, "--result-json", str(result)], "chief",
                  {"cluster": cluster, "task": {"type": "chief", "index": 0}})
    worker = start(procs, common, "worker", {"cluster": cluster, "task": {"type": "worker", "index": 0}})
    assert wait_exit(chief, 600) == 0, read_log(chief)[-3000:]
    assert wait_exit(worker, 600) == 0, read_log(worker)[-3000:]
    assert json.loads(result.read_text())["steps"] == STEPS

    statuses = []
    for address in cluster["ps"]:
        with PSClient(address, timeout=10) as c:
            statuses.append(c.status())
    for i, s in enumerate(statuses):
        assert s.num_variables > 0 and s.pushes_applied > 0, (i, s)
        assert (wire.mode_from_wire(s.mode), s.num_workers, s.version) == ("sync", 2, STEPS), (i, s)  # one round per step, each shard
    # Between them the two shards hold the whole model (the CNN: 216,650 parameters), neither all of it.
    assert sum(s.num_parameters for s in statuses) == 216_650
    assert all(0 < s.num_parameters < 216_650 for s in statuses)
    for server, _ in servers:
        server.send_signal(15)
        assert wait_exit(server, 30) == 0, read_log(server)[-3000:]
