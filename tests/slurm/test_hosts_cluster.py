"""deploy/slurm/hosts_cluster.py: a real four-node Slurm cluster on emulated hosts (issue 30, part 1).

    sudo python -m pytest -q tests/slurm/test_hosts_cluster.py

``slurmctld`` on one emulated host and one ``slurmd`` on each of four others, every
daemon real and started here: a job step runs on each node's own host (its name, its
address); a node set down, or whose host lost every process, is down for Slurm, and a
node whose ``slurmd`` comes back is idle again; stopping leaves no daemon, namespace
or file behind.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT, local_cluster

pytestmark = pytest.mark.slurm


def _hosts_cluster_module():
    spec = importlib.util.spec_from_file_location("tfps_hosts_cluster", ROOT / "deploy" / "slurm" / "hosts_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _why_not() -> str | None:
    from ps_tools.hosts import unavailable

    return local_cluster.why_not() or unavailable()


def _namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def _running(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def test_four_nodes_run_steps_on_their_own_hosts_lose_a_node_get_it_back_and_leave_nothing(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(f"slurm tier: {why}")
    hosts_cluster = _hosts_cluster_module()
    root = tmp_path / "cluster"
    cluster = hosts_cluster.HostsCluster(4, root=root, rate="1gbit", log=lambda line: None)
    with cluster:
        assert cluster.states() == {f"node-{i}": "idle" for i in range(4)}
        step = cluster.run(["srun", "-N4", "-n4", "-l", "sh", "-c",
                            "echo $(hostname) $SLURM_NODEID $(ip -4 -o addr show eth0 | awk '{print $4}')"])
        assert step.returncode == 0, step.stderr
        seen = sorted(line.split(": ", 1)[1].split() for line in step.stdout.splitlines())
        assert seen == [[f"node-{i}", str(i), f"{cluster.hosts.address(f'node-{i}')}/24"] for i in range(4)]

        # An operator takes node-3 out: Slurm stops placing work there, and it stays out.
        cluster.down("node-3", "tfps-test")
        assert cluster.states()["node-3"] == "down"
        refused = cluster.run(["srun", "--immediate=5", "-N4", "true"])
        assert refused.returncode != 0 and refused.stderr.strip()
        three = cluster.run(["srun", "-N3", "-n3", "hostname"])
        assert three.returncode == 0 and sorted(three.stdout.split()) == ["node-0", "node-1", "node-2"], three.stderr

        # node-2's host loses every process (its slurmd): down for not responding, then back.
        pids = [cluster.slurmd["node-2"].pid]
        cluster.kill_node("node-2")
        cluster.wait_states({"node-2": "down*"}, timeout=90)
        cluster.start_node("node-2")
        cluster.wait_states({"node-2": "idle", "node-3": "down"}, timeout=60)
        pids += [p.pid for p in cluster.slurmd.values()] + [cluster._ctld.pid, cluster._munged.pid]
        namespaces = {cluster.hosts.namespace(n) for n in cluster.hosts.names}
        assert namespaces <= _namespaces()
    assert _running(pids) == [] and not (namespaces & _namespaces()) and not root.exists()
