"""deploy/slurm/hosts_cluster.py: a real four-node Slurm cluster on emulated hosts (issue 30, part 1).

    sudo python -m pytest -q tests/slurm/test_hosts_cluster.py

``slurmctld`` on one emulated host and one ``slurmd`` on each of four others, every
daemon real and started here (``hosts_slurm``, one cluster for the module): a job
step runs on each node's own host (its name, its address); ``tfps.sbatch`` trains
elastic sync across the four nodes, and again while node-3's host loses every
process (issue 30, part 2: the same bits, every example once per epoch); the node
comes back with its ``slurmd``; a node set down stays out. Stopping leaves no daemon,
namespace or file behind (checked when the module's cluster stops).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ps_common.procs import dying_with_parent

from tests.slurm.conftest import ROOT, SBATCH, deploy_module, local_cluster

pytestmark = pytest.mark.slurm


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


@pytest.fixture(scope="module")
def hosts_slurm(tmp_path_factory):
    from ps_tools.hosts import unavailable

    why = local_cluster.why_not() or unavailable()
    if why:
        pytest.skip(f"slurm tier: {why}")
    root = tmp_path_factory.mktemp("hosts-slurm") / "cluster"
    cluster = deploy_module("hosts_cluster").HostsCluster(4, root=root, rate="1gbit",
                                                   log=lambda line: print(line, file=sys.stderr))
    with cluster:
        yield cluster
        pids = [p.pid for p in cluster.slurmd.values()] + [cluster._ctld.pid, cluster._munged.pid]
        namespaces = {cluster.hosts.namespace(n) for n in cluster.hosts.names}
        assert namespaces <= _namespaces()
    assert _running(pids) == [] and not (namespaces & _namespaces()) and not root.exists()


def test_a_step_runs_on_each_node_s_own_host(hosts_slurm):
    assert hosts_slurm.states() == {f"node-{i}": "idle" for i in range(4)}
    step = hosts_slurm.run(["srun", "-N4", "-n4", "-l", "sh", "-c",
                            "echo $(hostname) $SLURM_NODEID $(ip -4 -o addr show eth0 | awk '{print $4}')"])
    assert step.returncode == 0, step.stderr
    seen = sorted(line.split(": ", 1)[1].split() for line in step.stdout.splitlines())
    assert seen == [[f"node-{i}", str(i), f"{hosts_slurm.hosts.address(f'node-{i}')}/24"] for i in range(4)]


EXAMPLES = 1437  # digits' training examples
# Elastic sync: the server deals each round's micro-batches to the live workers, so a lost
# node's work goes to the others. sbatch --no-kill: Slurm keeps the job when a node fails.
ELASTIC = ["--elastic", "--dataset", "digits", "--model", "cnn", "--epochs", "3", "--progress", "lines",
           "--server-args", "--mode sync --elastic-min-workers 3 --micro-batches 4 --lease-timeout 3"]


def _submit(cluster, workdir: Path, name: str, args: list[str]) -> subprocess.Popen:
    """``sbatch --wait --no-kill`` of the job script over the four nodes (five tasks: the
    server and worker 0 on node-0, worker i on node-i), its output in ``workdir/name.out``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TFPS_", "SLURM_")) and k != "TF_CONFIG"}
    env.update(TFPS_PYTHON=sys.executable, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    argv = ["sbatch", "--wait", "--parsable", "--no-kill", "--nodes=4", "--ntasks=5",
            f"--output={workdir / name}.out", str(SBATCH), *args, "--result-json", f"{workdir / name}.json",
            "--save-weights", f"{workdir / name}.npz"]
    return subprocess.Popen(dying_with_parent(cluster.hosts.command("slurm-ctl", argv)), env=cluster.env(env),
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(job: subprocess.Popen, workdir: Path, name: str) -> tuple[str, dict, dict]:
    """(the job's output, the chief's result, its weights) once the job ended with status 0."""
    _, err = job.communicate(timeout=300)
    out = workdir / f"{name}.out"
    text = out.read_text() if out.exists() else ""
    assert job.returncode == 0, err + text[-3000:]
    with np.load(workdir / f"{name}.npz") as weights:
        return text, json.loads((workdir / f"{name}.json").read_text()), {k: weights[k] for k in weights.files}


@pytest.fixture(scope="module")
def undisturbed(hosts_slurm, tmp_path_factory):
    """The elastic job on four nodes, nothing lost: (output, result, weights)."""
    workdir = tmp_path_factory.mktemp("undisturbed")
    os.chmod(workdir, 0o755)
    return _finished(_submit(hosts_slurm, workdir, "job", ELASTIC), workdir, "job")


def test_the_job_script_trains_across_four_nodes(undisturbed):
    text, result, _ = undisturbed
    assert "on node-[0-3], 5 tasks, 1 serving" in text
    for task, role in enumerate(["ps 0, serving on node-0:", "worker 0 (the chief) on node-0,", "worker 1 on node-1,",
                                 "worker 2 on node-2,", "worker 3 on node-3,"]):
        assert f"Slurm task {task} of 5: {role}" in text, text[-3000:]
    assert (result["mode"], result["workers"]) == ("sync", 4) and result["test_accuracy"] >= 0.90, result
    assert result["examples"] == 3 * EXAMPLES and result["epoch_examples"] == [EXAMPLES] * 3, result


def test_an_elastic_job_that_loses_a_node_goes_on_with_the_others_to_the_same_bits(hosts_slurm, undisturbed,
                                                                                   tmp_path):
    """SIGKILL of every process on node-3's host (its slurmd and worker 3) once the job trains:
    Slurm reports the node failure and keeps the job; the server declares worker 3 dead after
    its lease and deals its micro-batches to the others. The job ends with status 0, every
    example trained on once per epoch, and the undisturbed job's weights, bit for bit."""
    os.chmod(tmp_path, 0o755)
    job = _submit(hosts_slurm, tmp_path, "lost", ELASTIC)
    out = tmp_path / "lost.out"
    deadline = time.monotonic() + 240
    while "step 10/" not in (out.read_text() if out.exists() else ""):
        assert job.poll() is None and time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.1)
    hosts_slurm.kill_node("node-3")
    text, result, weights = _finished(job, tmp_path, "lost")
    assert "Node failure on node-3" in text and "declared dead: [3]" in text, text[-3000:]
    assert result["examples"] == 3 * EXAMPLES and result["epoch_examples"] == [EXAMPLES] * 3, result
    _, _, reference = undisturbed
    assert sorted(weights) == sorted(reference) and all(np.array_equal(weights[k], reference[k]) for k in reference)
    # The node comes back with its slurmd.
    hosts_slurm.wait_states({"node-3": "down*"}, timeout=90)
    hosts_slurm.start_node("node-3")
    hosts_slurm.wait_states({"node-3": "idle"}, timeout=60)


def test_a_node_set_down_stays_out_and_its_work_goes_to_the_others(hosts_slurm):
    """An operator takes node-3 out: Slurm places no work there, and it stays out."""
    hosts_slurm.down("node-3", "tfps-test")
    assert hosts_slurm.states()["node-3"] == "down"
    refused = hosts_slurm.run(["srun", "--immediate=5", "-N4", "true"])
    assert refused.returncode != 0 and refused.stderr.strip()
    three = hosts_slurm.run(["srun", "-N3", "-n3", "hostname"])
    assert three.returncode == 0 and sorted(three.stdout.split()) == ["node-0", "node-1", "node-2"], three.stderr
