"""deploy/slurm/tfps.sbatch submitted for real to a one-node Slurm cluster on this machine.

    pytest -q tests/slurm           # as root; installs slurm-wlm and munge where absent

``sbatch --wait`` runs the job script: srun starts ps-slurm on 3 tasks, task 0
serves, tasks 1 and 2 train digits (worker 0, task 1, the chief) to >= 0.90 test
accuracy, the server exits once they are done and the job ends with the chief's
status, 0. A second job, whose worker 1 is killed (SIGKILL to its ps-worker
process) under ``--dead-worker-policy abort``, fails: the server declares it dead,
aborts the sync round, the chief fails, the job's status is 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ps_common import slurm as slurm_env
from ps_common.ports import free_port  # "": the server listens on all interfaces
from tests.slurm.conftest import wait_no_job_processes

pytestmark = pytest.mark.slurm

JOB_TIMEOUT = 150.0  # a job takes ~10-20 s here; TensorFlow's import is most of it


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def finish(slurm, proc: subprocess.Popen, output: Path) -> int:
    """The exit status of ``sbatch --wait`` (the job's); the job is cancelled if it runs too long."""
    try:
        return proc.wait(JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        slurm.run(["scancel", proc.job_id])
        proc.wait(30)
        pytest.fail(f"job {proc.job_id} still running after {JOB_TIMEOUT:g} s; cancelled\n{read(output)[-4000:]}")


def task_lines(text: str) -> dict[int, str]:
    """{rank: what ps-slurm said it is} from the job's output (srun --label)."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^(\d+): ps-slurm: Slurm task \d+ of \d+: (.*)$",
                                                             text, re.M)}


def test_scontrol_and_our_expansion_agree_on_node_lists(local_slurm):
    for nodelist in ("n[1-2],m5,o[3-4,6,7-9]", "gpu[08-11]", "n[9-10]", "r[1-2]n[1-2]"):
        run = local_slurm.run(["scontrol", "show", "hostnames", nodelist])
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == slurm_env.expand_hostlist(nodelist), nodelist


def test_job_script_trains_digits_with_one_server_and_two_workers(local_slurm, tmp_path):
    output, result = tmp_path / "job.out", tmp_path / "result.json"
    port = free_port("")
    proc = local_slurm.submit(output, ["--port-base", str(port), "--server-args", "--mode sync", "--dataset", "digits",
                                       "--epochs", "3", "--result-json", str(result), "--progress", "lines"],
                              cwd=tmp_path)
    status = finish(local_slurm, proc, output)
    text = read(output)
    assert status == 0, f"sbatch --wait: {status} {proc.stderr.read()}\n{text[-4000:]}"
    node, tasks = local_slurm.cluster.node, task_lines(text)
    assert sorted(tasks) == [0, 1, 2], text[-3000:]
    assert tasks[0].startswith(f"ps 0, serving on {node}:{port}, pid ")
    assert tasks[1].startswith(f"worker 0 (the chief) on {node}, pid ")
    assert tasks[2].startswith(f"worker 1 on {node}, pid ")
    metrics = json.loads(result.read_text())
    assert (metrics["mode"], metrics["workers"]) == ("sync", 2) and metrics["test_accuracy"] >= 0.90, metrics
    assert "exiting (--exit-when-done)" in text  # the server ended by itself, so the job did
    assert f"tfps: job {proc.job_id} ends with status 0" in text
    assert wait_no_job_processes(proc.job_id) == []  # every process of the job is gone


def test_job_whose_worker_is_killed_under_abort_fails(local_slurm, tmp_path):
    output = tmp_path / "job.out"
    # Long enough that worker 1 is still training when it is killed; the lease is short.
    proc = local_slurm.submit(output, ["--port-base", str(free_port("")),
                                       "--server-args", "--mode sync --dead-worker-policy abort --lease-timeout 2",
                                       "--dataset", "digits", "--epochs", "200", "--heartbeat-interval", "0.3",
                                       "--progress", "lines", "--log-every", "5"], cwd=tmp_path)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not re.search(r"^2: .*worker1: step \d+/", read(output), re.M):
        assert proc.poll() is None, f"the job ended before worker 1 trained ({proc.returncode})\n{read(output)[-4000:]}"
        assert time.monotonic() < deadline, f"worker 1 did not train within {JOB_TIMEOUT:g} s\n{read(output)[-4000:]}"
        time.sleep(0.2)
    pid = int(task_lines(read(output))[2].rsplit(" ", 1)[1])
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"worker" in cmdline and b"-m" in cmdline, cmdline  # worker 1's ps-worker, nothing else
    os.kill(pid, signal.SIGKILL)
    status = finish(local_slurm, proc, output)
    text = read(output)
    assert status == 1, f"sbatch --wait: {status}\n{text[-4000:]}"
    assert "worker 1 exited with status 137; this task exits 0, the job's status is the chief's" in text
    assert "declared dead" in text and "(dead-worker policy abort)" in text, text[-4000:]
    assert re.search(r"^1: ps-worker: error: worker 0: .*aborted", text, re.M), text[-4000:]
    assert f"tfps: job {proc.job_id} ends with status 1" in text
    assert wait_no_job_processes(proc.job_id) == []


def test_a_flag_slurm_decides_fails_every_task_in_one_line(local_slurm, tmp_path):
    run = local_slurm.run(["srun", "-n", "2", "--label", local_slurm.env()["TFPS_PYTHON"], "-m", "ps_tools.slurm",
                           "--ps", "h:1"], cwd=tmp_path, timeout=120)
    assert run.returncode == 2, run.stderr
    errors = sorted(line for line in run.stderr.splitlines() if "ps-slurm: error:" in line)
    assert errors == [f"{rank}: ps-slurm: error: ps-worker flags: --ps is set from the Slurm environment; leave it out"
                      for rank in (0, 1)], run.stderr
