"""A real one-node Slurm cluster on this machine, from the project's own setup.

``local_slurm`` (module scope) runs ``deploy/slurm/local_cluster.py``: as root it
installs Debian's ``slurm-wlm`` and ``munge`` where absent, starts ``munged``,
``slurmctld`` and ``slurmd`` under a directory of their own and waits for the node
to be idle; at the end it cancels every job the tests submitted that is still
known to Slurm, then stops exactly those daemons. Where the machine cannot (not
root, no Slurm and no apt-get) the tests that need it skip with one line saying why.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "tfps.sbatch"


def deploy_module(name: str):
    """``deploy/slurm/<name>.py``, a script, as a module."""
    spec = importlib.util.spec_from_file_location(f"tfps_{name}", ROOT / "deploy" / "slurm" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


local_cluster = deploy_module("local_cluster")


class Slurm:
    """The running cluster: ``run`` a Slurm command, ``sbatch`` the job script, and the jobs submitted."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.jobs: list[str] = []

    def env(self, **extra) -> dict:
        """This environment for Slurm clients and the job: SLURM_CONF, the tests' Python as
        TFPS_PYTHON, unbuffered output, and no TF_CONFIG or TFPS_* setting of the caller's."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TFPS_", "SLURM_")) and k != "TF_CONFIG"}
        return self.cluster.env({**base, "TFPS_PYTHON": sys.executable, "PYTHONUNBUFFERED": "1", **extra})

    def run(self, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env(), **kwargs)

    def submit(self, output: Path, args: list[str], cwd: Path) -> subprocess.Popen:
        """``sbatch --wait --parsable`` of the job script, its output to ``output``; the job's id is
        recorded once sbatch prints it (``job_id``)."""
        proc = subprocess.Popen(["sbatch", "--wait", "--parsable", f"--output={output}", str(SBATCH), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=self.env())
        proc.job_id = proc.stdout.readline().strip().split(";")[0]  # printed at submission, before the wait
        if proc.job_id:
            self.jobs.append(proc.job_id)
        return proc

    def cancel_all(self) -> None:
        """scancel every job submitted here that Slurm still knows of, and wait for them to leave."""
        if not self.jobs:
            return
        self.run(["scancel", *self.jobs])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            run = self.run(["squeue", "-h", "-j", ",".join(self.jobs), "-o", "%i"])
            if run.returncode != 0 or not run.stdout.strip():
                return
            time.sleep(0.5)


def job_processes(job_id: str) -> list[int]:
    """The pids of this machine's processes that belong to Slurm job ``job_id`` (by their environment)."""
    mark = f"SLURM_JOB_ID={job_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_no_job_processes(job_id: str, timeout: float = 15.0) -> list[int]:
    """``job_processes`` once it is empty, or what is left after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def local_slurm():
    reason = local_cluster.why_not()
    if reason:
        pytest.skip(f"slurm tier: {reason}")
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        install_s = local_cluster.install(log)
    except local_cluster.ClusterError as e:  # no Slurm here and no way to install it
        pytest.skip(f"slurm tier: {e}")
    if install_s:
        log(f"slurm tier: slurm-wlm and munge installed in {install_s:.1f} s")
    cluster = local_cluster.LocalCluster(log=log)
    cluster.start()  # a daemon that does not start is a failure of the setup, not a skip
    slurm = Slurm(cluster)
    try:
        yield slurm
    finally:
        slurm.cancel_all()
        cluster.stop()
