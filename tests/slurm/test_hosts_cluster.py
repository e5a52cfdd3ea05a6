"""deploy/slurm/hosts_cluster.py: a real four-node Slurm cluster on emulated hosts (issue 30, part 1).

    sudo python -m pytest -q tests/slurm/test_hosts_cluster.py

``slurmctld`` on one emulated host and one ``slurmd`` on each of four others, every
daemon real and started here (``hosts_slurm``, one cluster for the module): a job
step runs on each node's own host (its name, its address); ``tfps.sbatch`` trains
elastic sync across the four nodes, and again while node-3's host loses every
process (issue 30, part 2: the same bits, every example once per epoch); the node
comes back with its ``slurmd``; a fixed job that loses it fails fast, and its
requeued run resumes from the server's checkpoint (the same bits); a node set down
stays out; an elastic job goes on when a node is set down under it, and grows onto
it when it is back (part 3: a second job's step joins it). Stopping leaves no daemon, namespace or file behind (checked when
the module's cluster stops).
"""

from __future__ import annotations

import json
import os
import re
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


def _submit(cluster, workdir: Path, name: str, args: list[str],
            options: tuple[str, ...] = ("--no-kill", "--nodes=4", "--ntasks=5")) -> subprocess.Popen:
    """``sbatch --wait`` of the job script with ``options`` (default: over the four nodes, five
    tasks: the server and worker 0 on node-0, worker i on node-i; Slurm keeps the job when a
    node fails), its output in ``workdir/name.out``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TFPS_", "SLURM_")) and k != "TF_CONFIG"}
    env.update(TFPS_PYTHON=sys.executable, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    argv = ["sbatch", "--wait", "--parsable", *options, f"--output={workdir / name}.out", str(SBATCH), *args]
    return subprocess.Popen(dying_with_parent(cluster.hosts.command("slurm-ctl", argv)), env=cluster.env(env),
                            cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _chief(workdir: Path, name: str) -> list[str]:
    """The chief's flags that write its result and weights (``_finished`` reads them)."""
    return ["--result-json", f"{workdir / name}.json", "--save-weights", f"{workdir / name}.npz"]


def _output(workdir: Path, name: str) -> str:
    out = workdir / f"{name}.out"
    return out.read_text() if out.exists() else ""


def _wait_for(job: subprocess.Popen, workdir: Path, name: str, *texts: str, timeout: float = 240) -> None:
    """Until the job's output holds one of ``texts`` (the job must not end first)."""
    deadline = time.monotonic() + timeout
    while not any(text in _output(workdir, name) for text in texts):
        assert job.poll() is None and time.monotonic() < deadline, f"none of {texts}: {_output(workdir, name)[-3000:]}"
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def every_node_idle(hosts_slurm):
    """Each test starts with no job and every node idle with its slurmd, whatever a test before
    it left (so that one failure does not fail the tests after it)."""
    hosts_slurm.run(["scancel", "--user", "root"])
    for node in hosts_slurm.nodes:
        if node not in hosts_slurm.slurmd:
            hosts_slurm.start_node(node)
        if hosts_slurm.states().get(node, "").startswith(("down", "drain")):
            try:
                hosts_slurm.resume(node)
            except RuntimeError:  # ClusterError
                pass  # not responding yet: ReturnToService=1 brings it back with its new slurmd
    hosts_slurm.wait_states({n: "idle" for n in hosts_slurm.nodes}, timeout=90)


def _finished(job: subprocess.Popen, workdir: Path, name: str) -> tuple[str, dict, dict]:
    """(the job's output, the chief's result, its weights) once the job ended with status 0."""
    _, err = job.communicate(timeout=300)
    text = _output(workdir, name)
    assert job.returncode == 0, err + text[-3000:]
    with np.load(workdir / f"{name}.npz") as weights:
        return text, json.loads((workdir / f"{name}.json").read_text()), {k: weights[k] for k in weights.files}


@pytest.fixture(scope="module")
def undisturbed(hosts_slurm, tmp_path_factory):
    """The elastic job on four nodes, nothing lost: (output, result, weights)."""
    workdir = tmp_path_factory.mktemp("undisturbed")
    os.chmod(workdir, 0o755)
    return _finished(_submit(hosts_slurm, workdir, "job", ELASTIC + _chief(workdir, "job")), workdir, "job")


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
    job = _submit(hosts_slurm, tmp_path, "lost", ELASTIC + _chief(tmp_path, "lost"))
    _wait_for(job, tmp_path, "lost", "step 10/")
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


# Fixed sync (no --elastic): every worker's shard in every round. Four workers fold the same
# four 16-example gradients as elastic sync's four micro-batches: the same bits.
FIXED = ["--dataset", "digits", "--model", "cnn", "--epochs", "3", "--progress", "lines"]


# ~110 s (two runs of the job): slow. A fixed job's abort on a lost worker is test_slurm_job's
# killed worker under abort; a server restored from its checkpoint, the chaos and docker tiers'.
@pytest.mark.slow
def test_a_fixed_job_that_loses_a_node_fails_fast_and_its_requeued_run_resumes_from_the_checkpoint(
        hosts_slurm, undisturbed, tmp_path):
    """SIGKILL of node-3's host in a fixed sync job (``sbatch --requeue``): the server aborts the
    round once worker 3's lease (3 s) ran out, the chief fails with one line, and the run ends
    while the node is still gone (no wait for it); the server's checkpoint holds the rounds
    done. Slurm requeues the job; once node-3's slurmd is back it runs again,
    resumes at the checkpoint's round and ends with status 0, 3 x 1437 examples and the
    undisturbed job's weights, bit for bit."""
    os.chmod(tmp_path, 0o755)
    args = [*FIXED, *_chief(tmp_path, "fixed"), "--server-args",
            f"--mode sync --lease-timeout 3 --checkpoint-dir {tmp_path / 'ckpt'}"]
    job = _submit(hosts_slurm, tmp_path, "fixed", args, options=("--requeue", "--nodes=4", "--ntasks=5"))
    _wait_for(job, tmp_path, "fixed", "step 10/")
    hosts_slurm.kill_node("node-3")
    # The first run ends while node-3 is gone: the script's last line, or Slurm's cancel for the
    # node failure if that comes first (srun waits for node-3's task until then).
    _wait_for(job, tmp_path, "fixed", "ends with status 1", "DUE TO NODE FAILURE", timeout=150)
    first = _output(tmp_path, "fixed")
    errors = [line for line in first.splitlines() if line.startswith("1: ps-worker: error:")]  # the chief's
    assert len(errors) == 1 and "ABORTED (worker-dead)" in errors[0] and "worker(s) 3" in errors[0], first[-3000:]
    assert "dead-worker policy abort" in errors[0] and list((tmp_path / "ckpt").glob("ckpt-*.tfps")), first[-3000:]
    hosts_slurm.start_node("node-3")
    text, result, weights = _finished(job, tmp_path, "fixed")
    assert "requeued (restart 1)" in text and "INFO ps_server: restored version" in text, text[-3000:]
    assert text.rstrip().endswith("ends with status 0"), text[-3000:]
    assert (result["mode"], result["workers"], result["version"]) == ("sync", 4, 69), result
    assert result["examples"] == 3 * EXAMPLES, result
    _, _, reference = undisturbed
    assert sorted(weights) == sorted(reference) and all(np.array_equal(weights[k], reference[k]) for k in reference)
    hosts_slurm.wait_states({"node-3": "idle"}, timeout=60)


def test_a_node_set_down_stays_out_and_its_work_goes_to_the_others(hosts_slurm):
    """An operator takes node-3 out: Slurm places no work there, and it stays out."""
    hosts_slurm.down("node-3", "tfps-test")
    assert hosts_slurm.states()["node-3"] == "down"
    refused = hosts_slurm.run(["srun", "--immediate=5", "-N4", "true"])
    assert refused.returncode != 0 and refused.stderr.strip()
    three = hosts_slurm.run(["srun", "-N3", "-n3", "hostname"])
    assert three.returncode == 0 and sorted(three.stdout.split()) == ["node-0", "node-1", "node-2"], three.stderr
    hosts_slurm.resume("node-3")  # and back
    hosts_slurm.wait_states({"node-3": "idle"}, timeout=30)


# ~50 s: slow. An elastic job that loses a node (above) and a node set down (its test) stay in
# the default run.
@pytest.mark.slow
def test_an_elastic_job_goes_on_when_a_node_is_set_down_and_grows_onto_it_when_it_is_back(hosts_slurm, undisturbed,
                                                                                         tmp_path):
    """The elastic job, taking up to five workers (``--max-workers 5``), on four nodes. Once it
    trains, an operator sets node-3 down: Slurm kills worker 3's task and the step goes on
    (``srun --no-kill``); the server declares worker 3 dead. While the workers pause in round
    12, node-3 is resumed and a second job's step there runs ``ps-slurm --join node-0:8888``:
    its worker gets index 4 from the server and computes micro-batches from the next round on.
    Both jobs end with status 0 (the first's is its server's and chief's, not the killed
    task's), the first with every example once per epoch and the undisturbed weights."""
    os.chmod(tmp_path, 0o755)
    job = _submit(hosts_slurm, tmp_path, "job", [*ELASTIC, "--max-workers", "5", "--pause-at-step", "12",
                                                 "--pause-for", "20", *_chief(tmp_path, "job")])
    _wait_for(job, tmp_path, "job", "step 10/")
    hosts_slurm.down("node-3", "tfps-test")
    _wait_for(job, tmp_path, "job", "declared dead", timeout=60)
    hosts_slurm.resume("node-3")
    hosts_slurm.wait_states({"node-3": "idle"}, timeout=30)
    workers = ELASTIC[:ELASTIC.index("--server-args")]
    join = _submit(hosts_slurm, tmp_path, "join", [*workers, "--join", "node-0:8888", "--max-workers", "5"],
                   options=("--nodes=1", "--ntasks=1", "--nodelist=node-3"))
    text, result, weights = _finished(job, tmp_path, "job")
    _, err = join.communicate(timeout=120)
    joined = _output(tmp_path, "join")
    assert join.returncode == 0, err + joined[-3000:]
    assert "a worker on node-3 joining the job at node-0:8888" in joined, joined[-3000:]
    assert "registered as worker 4 of 5 (index assigned by the server)" in joined, joined[-3000:]
    assert re.search(r"worker4: step 69/69 loss \S+ examples/s [1-9]", joined), joined[-3000:]  # it computed
    assert "node-3: task 4: Killed" in text, text[-3000:]
    assert re.search(r"worker\(s\) 3 \(node-3:\d+\) declared dead", text), text[-3000:]
    assert "worker 4 registered (node-3:" in text and text.rstrip().endswith("ends with status 0"), text[-3000:]
    assert result["examples"] == 3 * EXAMPLES and result["epoch_examples"] == [EXAMPLES] * 3, result
    _, _, reference = undisturbed
    assert sorted(weights) == sorted(reference) and all(np.array_equal(weights[k], reference[k]) for k in reference)
    assert not list(tmp_path.glob(".tfps-*"))  # the job script's status files are gone
