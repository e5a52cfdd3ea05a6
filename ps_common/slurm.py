"""Read the Slurm environment of a job step as the cluster description ``TF_CONFIG`` gives.

    cluster = from_environ(os.environ)      # inside `srun`: every task of the step
    cluster.role, cluster.task_index, cluster.ps_addresses, cluster.num_workers, cluster.port

What is read is what TensorFlow's ``SlurmClusterResolver`` reads:

* ``SLURM_PROCID``: this task's rank in the step, 0 .. N-1;
* ``SLURM_STEP_NUM_TASKS`` (else the job's ``SLURM_NTASKS``): N;
* ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, ``SLURM_NODELIST``): the nodes, in
  Slurm's compressed form (``n[01-03],gpu7``), expanded with ``scontrol show hostnames``
  where ``scontrol`` runs, else by ``expand_hostlist`` (the same syntax);
* ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``): how many tasks each node
  runs, ``2(x3),1`` meaning 2, 2, 2, 1; may be absent when there is one node.

The tasks are laid out as the resolver lays them: node by node, the first
``tasks_per_node[0]`` ranks on the first node, and so on (Slurm's default block
distribution), and task r's address is its node name and port ``port_base`` plus
its position on that node (``TFPS_SLURM_PORT_BASE``, default 8888, the resolver's).
One difference: the resolver sorts the node names as strings, which puts ``n10``
before ``n9``; here the nodes keep Slurm's order, the one its ranks follow. Where
Slurm says on which node and at which local position this task runs
(``SLURMD_NODENAME``, ``SLURM_LOCALID``), they are checked against that layout, so
that a step with another ``--distribution`` fails with a clear error instead of
serving on a wrong address.

The roles: the first ``TFPS_SLURM_NUM_PS`` tasks (default 1) are parameter
servers, ps task i being rank i, each one shard; the others train, worker
``rank - num_ps``, the first of them (worker 0) the chief. Every process's
``--num-workers`` is the step's workers, or ``TFPS_SLURM_MAX_WORKERS`` when set (no
fewer): an elastic job that takes workers joining later from another job
(``ps-slurm --join``). ``ps_common.settings`` turns this into fields when
``TFPS_CLUSTER=slurm``. A variable that is missing or cannot be read raises
``SlurmError``, a ``ConfigError`` like any other bad setting, in one line. Plain
Python: no gRPC, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from typing import Callable, Mapping

from ps_common.errors import ConfigError

DEFAULT_PORT_BASE = 8888  # SlurmClusterResolver's port_base
NUM_PS_ENV = "TFPS_SLURM_NUM_PS"
PORT_BASE_ENV = "TFPS_SLURM_PORT_BASE"
MAX_WORKERS_ENV = "TFPS_SLURM_MAX_WORKERS"


class SlurmError(ConfigError):
    """The Slurm environment is not one tfps can lay a cluster out from; the message says why."""


@dataclasses.dataclass(frozen=True)
class SlurmCluster:
    """Every task of one Slurm step, in rank order, and which one this process is."""

    rank: int
    hosts: tuple[str, ...]  # the node of each rank
    ports: tuple[int, ...]  # port_base + the rank's position on its node
    num_ps: int
    max_workers: int = 0  # TFPS_SLURM_MAX_WORKERS: the job's most workers (0: this step's)

    @property
    def num_tasks(self) -> int:
        return len(self.hosts)

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(f"{h}:{p}" for h, p in zip(self.hosts, self.ports))

    @property
    def ps_addresses(self) -> tuple[str, ...]:
        """The server shards, ps task 0 first: the first ``num_ps`` ranks' addresses."""
        return self.addresses[: self.num_ps]

    @property
    def num_workers(self) -> int:
        """The workers of this step."""
        return self.num_tasks - self.num_ps

    @property
    def job_workers(self) -> int:
        """The most workers the job takes (every ``--num-workers``): ``TFPS_SLURM_MAX_WORKERS``,
        above this step's when an elastic job takes workers that join later (``ps-slurm --join``)."""
        return self.max_workers or self.num_workers

    @property
    def role(self) -> str:
        """``ps`` for the first ``num_ps`` ranks, ``worker`` for the others."""
        return "ps" if self.rank < self.num_ps else "worker"

    @property
    def task_index(self) -> int:
        """The ps task's index, or the worker's (0: the chief)."""
        return self.rank if self.role == "ps" else self.rank - self.num_ps

    @property
    def is_chief(self) -> bool:
        return self.role == "worker" and self.task_index == 0

    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    @property
    def port(self) -> int:
        return self.ports[self.rank]

    def describe(self) -> str:
        """One line: what this task is, e.g. ``task 1 of 3: worker 0 (the chief) on n01``."""
        what = f"ps {self.task_index}, serving on {self.addresses[self.rank]}" if self.role == "ps" else \
            f"worker {self.task_index}{' (the chief)' if self.is_chief else ''} on {self.host}"
        return f"Slurm task {self.rank} of {self.num_tasks}: {what}"


def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm's compressed node list as names, in order, repeats kept:
    ``n[1-2],m5,o[08-10,12]`` -> n1 n2 m5 o08 o09 o10 o12 (a range keeps its zero padding).
    Several bracket groups in one name (``r[1-2]n[1-2]``) expand left to right."""
    if not nodelist or not nodelist.strip():
        raise SlurmError("the Slurm node list is empty")
    hosts: list[str] = []
    for part in _split_outside_brackets(nodelist.strip(), nodelist):
        hosts.extend(_expand_name(part, nodelist))
    return hosts


def _split_outside_brackets(text: str, whole: str) -> list[str]:
    parts, current, depth = [], "", 0
    for c in text:
        if c == "[":
            if depth:
                raise SlurmError(f"node list {whole!r}: nested '['")
            depth = 1
        elif c == "]":
            if not depth:
                raise SlurmError(f"node list {whole!r}: ']' without '['")
            depth = 0
        elif c == "," and not depth:
            if not current:
                raise SlurmError(f"node list {whole!r}: an empty name")
            parts.append(current)
            current = ""
            continue
        current += c
    if depth:
        raise SlurmError(f"node list {whole!r}: '[' without ']'")
    if not current:
        raise SlurmError(f"node list {whole!r}: an empty name")
    parts.append(current)
    return parts


def _expand_name(part: str, whole: str) -> list[str]:
    m = re.match(r"([^\[\]]*)\[([^\[\]]*)\](.*)$", part)
    if m is None:
        return [part]
    prefix, ranges, rest = m.groups()
    tails = _expand_name(rest, whole) if rest else [""]
    out = []
    for number in _expand_ranges(ranges, whole):
        out.extend(prefix + number + tail for tail in tails)
    return out


def _expand_ranges(ranges: str, whole: str) -> list[str]:
    out = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None:
            raise SlurmError(f"node list {whole!r}: {item!r} is not a number or a range N-M")
        low, high = m.group(1), m.group(2) or m.group(1)
        if int(high) < int(low):
            raise SlurmError(f"node list {whole!r}: the range {item!r} runs backwards")
        out.extend(str(i).zfill(len(low)) for i in range(int(low), int(high) + 1))
    return out


def scontrol_hostnames(nodelist: str) -> list[str]:
    """The node names of ``nodelist``: ``scontrol show hostnames NODELIST`` (Slurm's own
    expansion of every syntax it has) where scontrol is on PATH and runs, else, and for a list
    without brackets, ``expand_hostlist`` (scontrol needs the cluster's configuration, which a
    task has but a process outside Slurm may not)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None or "[" not in nodelist:
        return expand_hostlist(nodelist)
    try:
        run = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return expand_hostlist(nodelist)
    hosts = run.stdout.split()
    return hosts if run.returncode == 0 and hosts else expand_hostlist(nodelist)


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node, one count per node: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise SlurmError(f"tasks per node {text!r}: {part!r} is not N or N(xR)")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | tuple[None, None]:
    for name in names:
        raw = environ.get(name)
        if raw not in (None, ""):
            return name, raw
    return None, None


def _int(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise SlurmError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise SlurmError(f"{name}={raw!r} must be >= {minimum}")
    return value


def from_environ(environ: Mapping[str, str],
                 hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> SlurmCluster:
    """This task's ``SlurmCluster`` from a Slurm step's environment (module docstring);
    ``hostnames`` expands the node list. ``SlurmError`` in one line if it cannot be read."""
    raw_rank = environ.get("SLURM_PROCID")
    if raw_rank in (None, ""):
        raise SlurmError("SLURM_PROCID is not set: this is not a task of a Slurm step (start it with srun)")
    rank = _int("SLURM_PROCID", raw_rank, 0)
    name, raw = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if name is None:
        raise SlurmError("neither SLURM_STEP_NUM_TASKS nor SLURM_NTASKS is set: how many tasks the step has is unknown")
    num_tasks = _int(name, raw, 1)
    if rank >= num_tasks:
        raise SlurmError(f"SLURM_PROCID={rank} is not a task of a step of {num_tasks} ({name}={raw})")
    list_name, nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if list_name is None:
        raise SlurmError("neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set: the step's nodes are unknown")
    nodes = hostnames(nodelist)
    tpn_name, tpn = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tpn_name is None:
        if len(nodes) != 1:
            raise SlurmError(f"SLURM_STEP_TASKS_PER_NODE is not set and {list_name}={nodelist!r} has "
                             f"{len(nodes)} nodes: which task runs where is unknown")
        counts = [num_tasks]
    else:
        counts = expand_tasks_per_node(tpn)
        if len(counts) != len(nodes):
            raise SlurmError(f"{tpn_name}={tpn!r} counts {len(counts)} nodes but {list_name}={nodelist!r} "
                             f"has {len(nodes)}")
        if sum(counts) != num_tasks:
            raise SlurmError(f"{tpn_name}={tpn!r} places {sum(counts)} tasks but the step has {num_tasks} ({name})")
    hosts: list[str] = []
    ports: list[int] = []
    port_base = _int(PORT_BASE_ENV, environ.get(PORT_BASE_ENV) or str(DEFAULT_PORT_BASE), 1)
    for node, count in zip(nodes, counts):
        hosts += [node] * count
        ports += [port_base + i for i in range(count)]
    if max(ports) > 65535:
        raise SlurmError(f"{PORT_BASE_ENV}={port_base} with {max(counts)} tasks on a node goes past port 65535")
    num_ps = _int(NUM_PS_ENV, environ.get(NUM_PS_ENV) or "1", 1)
    if num_ps >= num_tasks:
        raise SlurmError(f"{NUM_PS_ENV}={num_ps} leaves no task of the {num_tasks} to train: "
                         f"run at least {num_ps + 1} tasks (srun -n / #SBATCH --ntasks)")
    max_workers = _int(MAX_WORKERS_ENV, environ.get(MAX_WORKERS_ENV) or "0", 0)
    if 0 < max_workers < num_tasks - num_ps:
        raise SlurmError(f"{MAX_WORKERS_ENV}={max_workers} is fewer than the step's {num_tasks - num_ps} workers")
    cluster = SlurmCluster(rank, tuple(hosts), tuple(ports), num_ps, max_workers)
    _check_placement(cluster, environ, port_base)
    return cluster


def _check_placement(cluster: SlurmCluster, environ: Mapping[str, str], port_base: int) -> None:
    """Where Slurm says where this task runs, it must be where the block layout puts it."""
    node = environ.get("SLURMD_NODENAME")
    local = environ.get("SLURM_LOCALID")
    if node and node != cluster.host:
        raise SlurmError(f"Slurm runs task {cluster.rank} on {node}, but a block layout of the node list puts it "
                         f"on {cluster.host}: start the step with --distribution=block")
    if local not in (None, "") and local.isdigit():
        position = cluster.port - port_base
        if int(local) != position:
            raise SlurmError(f"Slurm runs task {cluster.rank} as local task {local} on {cluster.host}, but a block "
                             f"layout makes it local task {position}: start the step with --distribution=block")


def cluster_values(role: str, environ: Mapping[str, str],
                   hostnames: Callable[[str], list[str]] = scontrol_hostnames) -> dict:
    """The configuration fields the Slurm environment sets for a process of ``role`` ("ps" or
    "worker"), as ``ps_common.settings`` reads ``TF_CONFIG``: a server its port, all
    interfaces and the worker count; a worker every server's address (comma-joined, one shard
    each), its index and the worker count. A task of the other role is a ``SlurmError``."""
    cluster = from_environ(environ, hostnames)
    if cluster.role != role:
        command = "ps-server" if cluster.role == "ps" else "ps-worker"
        raise SlurmError(f"Slurm task {cluster.rank} is {cluster.role} {cluster.task_index} ({NUM_PS_ENV}="
                         f"{cluster.num_ps}), not a {role}: run {command} there, or ps-slurm on every task")
    if role == "ps":
        return {"port": cluster.port, "host": "0.0.0.0", "num_workers": cluster.job_workers}
    return {"ps": ",".join(cluster.ps_addresses), "worker_index": cluster.task_index,
            "num_workers": cluster.job_workers}
