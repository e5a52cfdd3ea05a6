"""A multi-node Slurm cluster on emulated hosts, for running ``tfps.sbatch`` across nodes.

    sudo python3 deploy/slurm/hosts_cluster.py --nodes 4 -- sinfo -N     # start, run one command, stop
    sudo python3 deploy/slurm/hosts_cluster.py --nodes 4 --rate 100mbit -- sbatch --wait deploy/slurm/tfps.sbatch

    with HostsCluster(nodes=4) as cluster:                 # from Python (the slurm test tier)
        cluster.run(["srun", "-N4", "hostname"])          # a client on the controller's host
        cluster.down("node-2", "lost")                    # scontrol update nodename=node-2 state=down
        cluster.resume("node-2")                          # ... state=resume
        cluster.kill_node("node-2")                       # SIGKILL its slurmd and every job step on it

Each node is a host of ``ps_tools.hosts`` (its own network namespace, address, host name
and shaped link on one bridge): ``slurm-ctl`` runs ``slurmctld``, and ``node-0`` ..
``node-{N-1}`` each run one ``slurmd -N node-i`` (``NodeAddr`` its address), so a job step
runs on its node's host and reaches the others over the shaped links. One ``munged`` runs
on this machine; its socket, a file, is reached from every host. As ``local_cluster.py``:
Debian's ``slurm-wlm`` and ``munge`` installed where missing, every state, spool, log and
pid file under one directory (default ``/tmp/tfps-slurm-hosts``), ports of its own, and
nothing configured system-wide (clients find the cluster by ``SLURM_CONF``).

Two things the hosts need that one machine does not: ``ip netns exec`` mounts a sysfs of
the namespace's own, without ``/sys/fs/cgroup``, and ``slurmd`` will not start without
it; so each node mounts this machine's cgroup v1 controllers there, in its own mount
namespace (slurmd 22.05 refuses a cgroup2 alone here: "Hybrid mode is not supported").
And this machine's own namespace cannot reach the bridge: a Slurm client runs on a host
(``run``, default ``slurm-ctl``).

``stop`` (and the end of ``with``) removes the hosts, which kills every process in them
(the daemons and any job step), stops ``munged`` and deletes the directory. Needs root.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: ps_tools from the checkout
    sys.path.insert(0, str(ROOT))

from ps_common.procs import dying_with_parent  # noqa: E402
from ps_tools.hosts import DEFAULT_TCP, Hosts  # noqa: E402


def _local_cluster():
    spec = importlib.util.spec_from_file_location("tfps_local_cluster", Path(__file__).with_name("local_cluster.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


local_cluster = _local_cluster()
ClusterError = local_cluster.ClusterError

DEFAULT_DIR = Path("/tmp/tfps-slurm-hosts")
CONTROLLER = "slurm-ctl"
CPUS = 4  # per node, what slurm.conf declares (config_overrides): tasks share this machine's cores
# The cgroup v1 controllers this machine mounts under /sys/fs/cgroup, mounted again in a node's
# own mount namespace (module docstring).
_CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids")
_MOUNT_CGROUPS = ("mount -t tmpfs tmpfs /sys/fs/cgroup && for c in " + " ".join(_CGROUPS) + "; do "
                  "mkdir /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || exit 1; done && "
                  "mkdir /sys/fs/cgroup/systemd && mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd"
                  ' && exec "$@"')


class HostsCluster:
    """``slurmctld`` on host ``slurm-ctl`` and one ``slurmd`` on each of ``nodes`` hosts (module docstring)."""

    def __init__(self, nodes: int = 4, root: Path | str = DEFAULT_DIR, rate: str | None = None,
                 cpus: int = CPUS, log=print, tcp: str | None = DEFAULT_TCP):
        if not 1 <= nodes <= 64:
            raise ClusterError(f"nodes: 1 to 64, got {nodes}")
        self.nodes = [f"node-{i}" for i in range(nodes)]
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.cpus = cpus
        self.log = log
        self.hosts = Hosts([CONTROLLER, *self.nodes], rate=rate, tcp=tcp)
        self.slurmd: dict[str, subprocess.Popen] = {}
        self._munged: subprocess.Popen | None = None
        self._ctld: subprocess.Popen | None = None

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket.2"

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default: this process's environment) with ``SLURM_CONF``."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    # -- start and stop -----------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> "HostsCluster":
        """Install where needed, start the hosts, ``munged``, ``slurmctld`` and every ``slurmd``,
        and wait until ``sinfo`` shows every node idle; ``ClusterError`` (all stopped) if not."""
        local_cluster.install(self.log)
        shutil.rmtree(self.root, ignore_errors=True)
        for sub in ("munge", "state", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, mode=0o700, exist_ok=True)
        try:
            self.hosts.start()
            self._write_conf()
            key = self.root / "munge" / "munge.key"
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o400)
            m = self.root / "munge"
            self._munged = self._daemon(None, "munged", [
                local_cluster._sbin("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={key}", f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}"])
            self._wait(lambda: self.munge_socket.exists(), timeout, "munged made no socket")
            self._ctld = self._daemon(CONTROLLER, "slurmctld",
                                      [local_cluster._sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                self.start_node(node)
            self.wait_states({n: "idle" for n in self.nodes}, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, node: str) -> None:
        """(Re)start ``slurmd`` on ``node``'s host."""
        self.slurmd[node] = self._daemon(node, f"slurmd-{node}", [
            "sh", "-c", _MOUNT_CGROUPS, "sh", local_cluster._sbin("slurmd"), "-D", "-f", str(self.conf), "-N", node])

    def stop(self) -> None:
        """Remove the hosts (every daemon and job step in them), stop munged, delete the directory."""
        self.hosts.stop()
        if self._munged is not None:
            local_cluster._terminate(self._munged.pid)
            self._munged.wait(timeout=10)
            self._munged = None
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "HostsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- using it -----------------------------------------------------------------------
    def run(self, argv: list[str], host: str = CONTROLLER, timeout: float = 60,
            env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client (or any command) on ``host``, to its end."""
        return self.hosts.run(host, argv, timeout=timeout, env=self.env(env), **kwargs)

    def states(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` gives it (idle, alloc, down*, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_states(self, wanted: dict[str, str], timeout: float) -> None:
        self._wait(lambda: all(self.states().get(n) == s for n, s in wanted.items()), timeout,
                   f"nodes not {wanted}", lambda: f"sinfo: {self.states()}; {self._log_tail('slurmctld')}")

    def down(self, node: str, reason: str = "tfps test") -> None:
        """``scontrol update nodename=... state=down``: Slurm ends the node's job steps."""
        self._update(node, "state=down", f"reason={reason}")

    def resume(self, node: str) -> None:
        """``scontrol update nodename=... state=resume``: a node set down takes work again."""
        self._update(node, "state=resume")

    def _update(self, node: str, *settings: str) -> None:
        done = self.run(["scontrol", "update", f"nodename={node}", *settings])
        if done.returncode != 0:
            raise ClusterError(f"scontrol update nodename={node} {' '.join(settings)}: {done.stderr.strip()}")

    def kill_node(self, node: str) -> None:
        """SIGKILL every process on ``node``'s host: its slurmd and every job step on it."""
        self.hosts.kill_all(node)
        self.slurmd.pop(node, None)

    # -- helpers ------------------------------------------------------------------------
    def _write_conf(self) -> None:
        r = self.root
        self.conf.write_text("\n".join([
            f"# Written by deploy/slurm/hosts_cluster.py: {len(self.nodes)} nodes on emulated hosts, under {r}",
            "ClusterName=tfps-hosts",
            f"SlurmctldHost={CONTROLLER}({self.hosts.address(CONTROLLER)})",
            *local_cluster.shared_conf(r, self.munge_socket),
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmdLogFile={r / 'slurmd-%n.log'}",
            "ReturnToService=1",  # a node down for not responding is usable again once its slurmd is back
            "SlurmdTimeout=10",  # a node whose slurmd is gone is down within ~10 s
            *(f"NodeName={n} NodeAddr={self.hosts.address(n)} CPUs={self.cpus} State=UNKNOWN" for n in self.nodes),
            f"PartitionName=hosts Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _daemon(self, host: str | None, name: str, argv: list[str]) -> subprocess.Popen:
        """A daemon in the foreground, on ``host`` (None: this machine), its output to its log."""
        with open(self.root / f"{name}.out", "w") as out:
            kwargs = dict(stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env())
            if host is None:
                return subprocess.Popen(dying_with_parent(argv), **kwargs)
            return self.hosts.popen(host, argv, **kwargs)

    def _wait(self, ready, timeout: float, what: str, detail=lambda: "") -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in [("munged", self._munged), ("slurmctld", self._ctld), *self.slurmd.items()]:
                if proc is not None and proc.poll() is not None:
                    raise ClusterError(f"{name} exited {proc.returncode}: {self._log_tail(name)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{what} within {timeout:g} s {detail()}".strip())
            time.sleep(0.3)

    def _log_tail(self, name: str) -> str:
        for path in (self.root / f"{name}.log", self.root / f"{name}.out"):
            try:
                lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
            except OSError:
                continue
            if lines:
                return lines[-1]
        return f"no log for {name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4, help="slurmd hosts (default 4)")
    p.add_argument("--rate", help="every host's link, each way, as tc writes it (default: unshaped)")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help=f"state, spool and logs (default {DEFAULT_DIR})")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND: run on the controller's host, then stop")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give -- COMMAND to run on the cluster")
    try:
        with HostsCluster(args.nodes, args.dir, args.rate) as cluster:
            done = cluster.run(command, timeout=24 * 3600, capture_output=False, cwd=os.getcwd())
            return done.returncode
    except ClusterError as e:
        print(f"hosts_cluster: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
