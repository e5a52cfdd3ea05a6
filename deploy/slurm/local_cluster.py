"""A one-machine Slurm cluster for trying and testing ``deploy/slurm/tfps.sbatch``.

    sudo python3 deploy/slurm/local_cluster.py start   # prints: export SLURM_CONF=/tmp/tfps-slurm/slurm.conf
    SLURM_CONF=/tmp/tfps-slurm/slurm.conf sbatch --wait deploy/slurm/tfps.sbatch
    sudo python3 deploy/slurm/local_cluster.py stop

As root, it installs Debian's ``slurm-wlm`` and ``munge`` with ``apt-get`` where
``slurmctld``, ``slurmd``, ``sbatch`` or ``munged`` are missing (``apt-get update``
first), writes a ``slurm.conf`` for one node (this machine's short host name,
``CPUs=8`` whatever the real count, allowed by ``SlurmdParameters=config_overrides``,
so that a job of 4 tasks fits on 2 real cores), and starts its own ``munged`` (its
own key and socket), ``slurmctld`` and ``slurmd`` on ports of their own, every
state, spool, log and pid file under one directory (default ``/tmp/tfps-slurm``).
It returns once ``sinfo`` shows the node idle. Nothing system-wide is configured:
a client finds this cluster by ``SLURM_CONF``.

``stop`` ends exactly the daemons ``start`` started (the pids in its pid files,
each checked to be that daemon running on this directory's configuration):
SIGTERM, SIGKILL after a few seconds. ``start`` first does the same to the
leftovers of an earlier run that was killed before it could stop them, then
starts from an empty directory. Plain Python, standard library only: the test
tier ``tests/slurm`` imports it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_DIR = Path("/tmp/tfps-slurm")
CPUS = 8  # what slurm.conf declares: 4 single-CPU tasks fit even on a 2-core machine
CTLD_PORT = 6917  # not Slurm's 6817/6818, so a real Slurm on this machine is left alone
SLURMD_PORT = 6918
PACKAGES = ("slurm-wlm", "munge")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "munged")
DAEMONS = ("munged", "slurmctld", "slurmd")  # started in this order, stopped in the reverse


class ClusterError(RuntimeError):
    """The local cluster cannot start here; the message says why, in one line."""


def missing_commands() -> list[str]:
    """The Slurm and munge commands not found on PATH (nor in /usr/sbin)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [c for c in COMMANDS if shutil.which(c, path=path) is None]


def why_not() -> str | None:
    """None if this machine can run the cluster (installing what is missing), else the reason."""
    if not missing_commands():
        return None if os.geteuid() == 0 else "the local Slurm cluster must run as root (its daemons run as root)"
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(missing_commands())} missing) and installing it needs root"
    if shutil.which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(missing_commands())} missing) and there is no apt-get"
    return None


def install(log=print) -> float:
    """``apt-get install slurm-wlm munge`` where a command is missing; the seconds it took (0: nothing to do)."""
    if not missing_commands():
        return 0.0
    reason = why_not()
    if reason:
        raise ClusterError(reason)
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    log(f"local_cluster: installing {' '.join(PACKAGES)} with apt-get ({', '.join(missing_commands())} missing)")
    for argv in (["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        run = subprocess.run(argv, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ClusterError(f"{' '.join(argv)} failed ({run.returncode}): {tail[0]}")
    if missing_commands():
        raise ClusterError(f"after installing {' '.join(PACKAGES)}, still missing: {', '.join(missing_commands())}")
    return time.monotonic() - started


def shared_conf(root: Path, munge_socket: Path) -> list[str]:
    """The slurm.conf lines of every cluster here (this one, ``hosts_cluster.py``'s): root runs
    the daemons on ports of their own with their own munged, the controller's files under
    ``root``, and nothing that needs cgroups or accounting."""
    return [
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={CTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire: also how long a requeued job waits before it may start again (default 120 s)
        f"AuthInfo=socket={munge_socket},cred_expire=20",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        "ProctrackType=proctrack/linuxproc",  # no cgroups needed
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SlurmdParameters=config_overrides",  # a node's CPUs may exceed the real count
        "MpiDefault=none",
        "MailProg=/bin/true",
        "KillWait=5",
        "InactiveLimit=0",
        "MinJobAge=10",
    ]


def _sbin(name: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return shutil.which(name, path=path) or name


class LocalCluster:
    """munged, slurmctld and slurmd of one node, everything under ``root``.

        with LocalCluster() as cluster:        # install if needed, start, wait for the node
            subprocess.run(["sbatch", "--wait", "job.sbatch"], env=cluster.env())
    """

    def __init__(self, root: Path | str = DEFAULT_DIR, cpus: int = CPUS, log=print):
        self.root = Path(root)
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.log = log
        self.install_s = 0.0

    # -- paths --------------------------------------------------------------------------
    def pid_file(self, daemon: str) -> Path:
        return self.root / f"{daemon}.pid"

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"

    def env(self, base: dict | None = None) -> dict:
        """The environment a Slurm client needs to use this cluster: ``base`` (default: this
        process's) with ``SLURM_CONF``."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    # -- start and stop -----------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "LocalCluster":
        """Install where needed, remove an earlier run's leftovers, start the three daemons and
        wait until ``sinfo`` shows the node idle; ``ClusterError`` (everything stopped) if not."""
        self.install_s = install(self.log)
        self.stop(quiet=True)  # leftovers of an earlier run killed before its stop
        shutil.rmtree(self.root, ignore_errors=True)
        for sub in ("munge", "state", "spool"):
            (self.root / sub).mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)
        try:
            self._write_munge_key()
            self._write_conf()
            self._start_munged()
            self._daemon("slurmctld", [_sbin("slurmctld"), "-f", str(self.conf), "-i"])
            self._daemon("slurmd", [_sbin("slurmd"), "-f", str(self.conf)])
            self._wait_idle(timeout)
        except BaseException:
            self.stop(quiet=True)
            raise
        return self

    def stop(self, quiet: bool = False) -> list[str]:
        """SIGTERM (SIGKILL 5 s later) to each daemon this directory's pid files name that is still that
        daemon; the names of those stopped."""
        stopped = []
        for daemon in reversed(DAEMONS):
            pid = self._our_pid(daemon)
            if pid is None:
                continue
            _terminate(pid)
            stopped.append(daemon)
            self.pid_file(daemon).unlink(missing_ok=True)
        if stopped and not quiet:
            self.log(f"local_cluster: stopped {', '.join(stopped)}")
        elif stopped:
            self.log(f"local_cluster: stopped leftovers of an earlier run: {', '.join(stopped)}")
        return stopped

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers ------------------------------------------------------------------------
    def _write_munge_key(self) -> None:
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

    def _write_conf(self) -> None:
        r = self.root
        self.conf.write_text("\n".join([
            "# Written by deploy/slurm/local_cluster.py: one node, this machine, everything under " + str(r),
            "ClusterName=tfps-local",
            f"SlurmctldHost={self.node}",
            *shared_conf(r, self.munge_socket),
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmdPidFile={self.pid_file('slurmd')}",
            f"SlurmdLogFile={r / 'slurmd.log'}",
            "ReturnToService=2",
            f"NodeName={self.node} CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=local Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _start_munged(self) -> None:
        m = self.root / "munge"
        argv = [_sbin("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={m / 'munge.key'}",
                f"--pid-file={self.pid_file('munged')}", f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}"]
        self._daemon("munged", argv)

    def _daemon(self, name: str, argv: list[str]) -> None:
        """Run a daemon that forks into the background and writes its pid file; wait for that file."""
        run = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=self.env())
        if run.returncode != 0:
            raise ClusterError(f"{name} did not start ({run.returncode}): "
                               f"{(run.stderr or run.stdout).strip()[-300:] or self._log_tail(name)}")
        deadline = time.monotonic() + 15
        while self._our_pid(name) is None:
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} wrote no pid file {self.pid_file(name)}: {self._log_tail(name)}")
            time.sleep(0.1)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            run = subprocess.run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%t"], capture_output=True,
                                 text=True, env=self.env(), timeout=30)
            state = (run.stdout or run.stderr).strip()
            if state == "idle":
                return
            for daemon in ("slurmctld", "slurmd"):
                if self._our_pid(daemon) is None:
                    raise ClusterError(f"{daemon} exited: {self._log_tail(daemon)}")
            time.sleep(0.5)
        raise ClusterError(f"node {self.node} not idle within {timeout:g} s (sinfo: {state!r})")

    def _log_tail(self, daemon: str) -> str:
        path = self.root / "munge" / "munged.log" if daemon == "munged" else self.root / f"{daemon}.log"
        try:
            lines = path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return f"no log at {path}"
        return lines[-1] if lines else f"{path} is empty"

    def _our_pid(self, daemon: str) -> int | None:
        """The pid in ``daemon``'s pid file if that process runs ``daemon`` on this directory's files."""
        try:
            pid = int(self.pid_file(daemon).read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            return None
        ours = str(self.root) in cmdline and daemon in cmdline
        return pid if ours else None


def _terminate(pid: int, grace: float = 5.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="local_cluster.py", description="a one-machine Slurm cluster (as root)")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("--dir", default=str(DEFAULT_DIR), help=f"state, logs, pid files (default {DEFAULT_DIR})")
    p.add_argument("--cpus", type=int, default=CPUS, help=f"CPUs the node declares (default {CPUS})")
    args = p.parse_args(argv)
    cluster = LocalCluster(args.dir, args.cpus)
    try:
        if args.action == "start":
            cluster.start()
            print(f"local_cluster: node {cluster.node} idle ({args.cpus} CPUs); use it with:\n"
                  f"export SLURM_CONF={cluster.conf}")
        elif args.action == "stop":
            if not cluster.stop():
                print("local_cluster: nothing of ours was running")
        else:
            running = [d for d in DAEMONS if cluster._our_pid(d) is not None]
            print(f"local_cluster: running: {', '.join(running) or 'none'}")
    except ClusterError as e:
        print(f"local_cluster: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
