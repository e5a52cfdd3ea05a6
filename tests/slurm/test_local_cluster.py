"""deploy/slurm/local_cluster.py: a run killed before its stop leaves daemons; the next start removes them.

The "earlier run" is a ``local_cluster.py start`` whose daemons are left running
(as when the test process that started them was killed); a new ``start`` stops
exactly those (by their pid files, each checked to be that daemon on this
directory), starts fresh ones and ``stop`` ends them all.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.conftest import ROOT, local_cluster

pytestmark = pytest.mark.slurm


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_start_removes_the_leftovers_of_a_killed_run_and_stop_ends_exactly_its_daemons():
    reason = local_cluster.why_not()
    if reason:
        pytest.skip(f"slurm tier: {reason}")
    earlier = subprocess.run([sys.executable, str(ROOT / "deploy" / "slurm" / "local_cluster.py"), "start"],
                             capture_output=True, text=True, timeout=300)
    assert earlier.returncode == 0, earlier.stderr
    lines: list[str] = []
    cluster = local_cluster.LocalCluster(log=lines.append)
    old = {d: cluster._our_pid(d) for d in local_cluster.DAEMONS}
    assert all(old.values()), old  # the earlier run's daemons, left running
    try:
        cluster.start()
        assert lines == ["local_cluster: stopped leftovers of an earlier run: slurmd, slurmctld, munged"]
        assert not any(alive(pid) for pid in old.values()), old
        new = {d: cluster._our_pid(d) for d in local_cluster.DAEMONS}
        assert all(new.values()) and set(new.values()).isdisjoint(old.values()), new
    finally:
        stopped = cluster.stop()
    assert stopped == ["slurmd", "slurmctld", "munged"]
    assert not any(alive(pid) for pid in new.values()), new
    assert cluster.stop() == []  # nothing of ours left to stop


def test_where_the_cluster_cannot_run_the_reason_is_one_line(monkeypatch):
    monkeypatch.setattr(local_cluster.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(local_cluster, "missing_commands", lambda: ["slurmctld", "munged"])
    assert local_cluster.why_not() == "Slurm is not installed (slurmctld, munged missing) and installing it needs root"
    monkeypatch.setattr(local_cluster, "missing_commands", lambda: [])
    assert local_cluster.why_not() == "the local Slurm cluster must run as root (its daemons run as root)"
    monkeypatch.setattr(local_cluster.os, "geteuid", lambda: 0)
    assert local_cluster.why_not() is None
    monkeypatch.setattr(local_cluster, "missing_commands", lambda: ["sbatch"])
    monkeypatch.setattr(local_cluster.shutil, "which", lambda name, path=None: None)
    assert local_cluster.why_not() == "Slurm is not installed (sbatch missing) and there is no apt-get"
