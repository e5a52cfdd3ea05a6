"""``ps-slurm``: the one command ``srun`` runs on every task of a Slurm job step.

    srun python -m ps_tools.slurm --server-args "--mode sync" --dataset digits --epochs 3
    sbatch deploy/slurm/tfps.sbatch --dataset digits --epochs 3     # the same, as a batch job

Each task reads the step from the Slurm environment (``ps_common.slurm``: rank,
task count, node list, tasks per node) and becomes what its rank makes it: the
first ``--num-ps`` tasks (default 1) a ``ps-server`` shard, listening on all
interfaces at port ``--port-base`` (default 8888) plus its position on its node;
the others a ``ps-worker``, worker ``rank - num_ps``, worker 0 the chief, with
every server's ``NODE:PORT`` as ``--ps``. The role's process is a child that gets
this environment with ``TFPS_CLUSTER=slurm`` (``ps_common.settings``), plus
``TFPS_SLURM_NUM_PS``, ``TFPS_SLURM_PORT_BASE`` and ``TFPS_SLURM_MAX_WORKERS`` when
given as flags here, so it resolves the same cluster itself, and ``--print-config``
shows it.

Growing an elastic job (docs/slurm.md): start it with ``--max-workers M`` above its
workers (every process's ``--num-workers``); later a step of another job, on nodes
that became free, runs ``ps-slurm --join HOST:PORT --max-workers M`` with the same
ps-worker flags, and each of its tasks is a worker that registers with
``--worker-index auto`` (the server gives it the lowest free index) and trains from
the next round. Its exit status is its own.

The arguments: ``--server-args "ARGS"`` (one shell-quoted string) are
``ps-server`` flags for every server, after ``--exit-when-done``, which ps-slurm
gives so that the servers end once the training has (a final checkpoint, exit
0) and the job with them; every other argument is a ``ps-worker`` flag for every
worker (what to train, ``--result-json`` for the chief ...). The flags the Slurm
environment decides are refused in one line: ``--port`` and ``--num-workers`` of
the server, ``--ps``, ``--worker-index`` and ``--num-workers`` of the worker. Both
sets are checked on every task before anything starts, so a bad flag fails
every task the same way (exit 2).

The exit status, and so the job's (``srun`` exits with its tasks' highest): a
server's and the chief's are theirs (128 + S for signal S); a worker other than
the chief that fails is said in one line and its task exits 0, so the job's
status is the chief's. Whether the others' failure fails the training is the
server's ``--dead-worker-policy``: ``abort`` (the default) ends the sync round
with an error, the chief fails, the job fails; ``shrink`` or ``wait`` go on. A
server that fails fails the job (its parameters are lost). SIGTERM and SIGINT
(``scancel``, the job's time limit) are passed to the child, a server then
checkpoints; the child is killed if this process dies.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys

from ps_common import slurm
from ps_common.procs import dying_with_parent, write_atomically
from ps_common.settings import CLUSTER_ENV, ConfigError

STATUS_ENV = "TFPS_SLURM_STATUS"  # tfps.sbatch: where the servers and the chief write their status (record_status)
_SERVER_DECIDED = ("port", "num_workers")  # ps-server flags the Slurm environment sets
_WORKER_DECIDED = ("ps", "worker_index", "num_workers")


class SlurmLaunchError(ConfigError):
    """Arguments ps-slurm cannot run with; the message says why, in one line."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-slurm", allow_abbrev=False,
        description="Run on every task of a Slurm step (srun): the first --num-ps tasks serve, the others "
        "train (worker 0, the chief, is the first of them). Arguments not listed here are ps-worker flags.",
    )
    p.add_argument("--num-ps", type=int, help=f"how many tasks serve, each a shard (default 1; environment "
                   f"{slurm.NUM_PS_ENV})")
    p.add_argument("--port-base", type=int, help=f"a server listens on this port plus its position on its node "
                   f"(default {slurm.DEFAULT_PORT_BASE}; environment {slurm.PORT_BASE_ENV})")
    p.add_argument("--server-args", default="", metavar="ARGS",
                   help="ps-server flags for every server, as one shell-quoted string, e.g. "
                   "\"--mode sync --dead-worker-policy abort\" (ps-slurm adds --exit-when-done first)")
    p.add_argument("--max-workers", type=int, help="the most workers the job takes, every process's --num-workers "
                   "(default: this step's workers; environment " + slurm.MAX_WORKERS_ENV + "); more lets an elastic "
                   "job take workers that join later (--join)")
    p.add_argument("--join", metavar="HOST:PORT[,HOST:PORT]",
                   help="every task of this step is a worker joining the running elastic job whose servers these "
                   "are (ps-worker --worker-index auto: the server gives the index); give the job's --max-workers "
                   "and its ps-worker flags")
    return p


def _parse_or_raise(p: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    """``p.parse_args(argv)`` with a usage error raised as one-line ``SlurmLaunchError``."""

    def error(message: str):
        raise SlurmLaunchError(f"{what}: {message}")

    p.error = error
    return p.parse_args(argv)


def role_argvs(server_args: str, worker_argv: list[str],
               by: str = "the Slurm environment") -> tuple[list[str], list[str]]:
    """(ps-server argv, ps-worker argv) after the program, each checked by its command's parser
    and for flags ``by`` decides."""
    from ps_server.config import ServerConfig
    from worker.config import WorkerConfig

    try:
        server_argv = shlex.split(server_args)
    except ValueError as e:
        raise SlurmLaunchError(f"--server-args {server_args!r}: {e}") from None
    server_argv = ["--exit-when-done", *server_argv]
    parsed = _parse_or_raise(ServerConfig.parser(), server_argv, "--server-args")
    for name, decided, args in (("--server-args", _SERVER_DECIDED, parsed),
                                ("ps-worker flags", _WORKER_DECIDED,
                                 _parse_or_raise(WorkerConfig.parser(), list(worker_argv), "ps-worker flags"))):
        taken = [f"--{d.replace('_', '-')}" for d in decided if getattr(args, d, None) is not None]
        if taken:
            one = len(taken) == 1
            raise SlurmLaunchError(f"{name}: {', '.join(taken)} {'is' if one else 'are'} set from {by}; "
                                   f"leave {'it' if one else 'them'} out")
    return server_argv, list(worker_argv)


def child_environment(args: argparse.Namespace, environ: dict) -> dict:
    """This environment with ``TFPS_CLUSTER=slurm`` and the flags given as the variables they stand for."""
    env = {**environ, CLUSTER_ENV: "slurm"}
    if args.num_ps is not None:
        env[slurm.NUM_PS_ENV] = str(args.num_ps)
    if args.port_base is not None:
        env[slurm.PORT_BASE_ENV] = str(args.port_base)
    if args.max_workers is not None:
        env[slurm.MAX_WORKERS_ENV] = str(args.max_workers)
    return env


def join_task(args: argparse.Namespace, worker_argv: list[str], environ: dict) -> tuple[list[str], dict, str]:
    """(command, environment, what it is) of a task of a step that joins a running job (``--join``):
    a ps-worker with ``--worker-index auto`` against the given servers, its cluster in flags, not
    read from this step's Slurm environment."""
    if args.server_args or args.num_ps is not None:
        raise SlurmLaunchError("--join: every task of this step is a worker; leave out --server-args and --num-ps")
    raw = str(args.max_workers) if args.max_workers is not None else environ.get(slurm.MAX_WORKERS_ENV, "")
    if not raw.isdigit() or int(raw) < 1:
        raise SlurmLaunchError(f"--join needs --max-workers N >= 1, the running job's (got {raw or 'none'}): every "
                               "worker states the servers' --num-workers")
    _, worker_argv = role_argvs("", worker_argv, by="--join and --max-workers")
    env = {k: v for k, v in environ.items() if k not in (CLUSTER_ENV, "TF_CONFIG")}
    command = [sys.executable, "-m", "worker", "--ps", args.join, "--worker-index", "auto", "--num-workers", raw,
               *worker_argv]
    where = environ.get("SLURMD_NODENAME", "this node")
    what = (f"Slurm task {environ.get('SLURM_PROCID', '0')} of {environ.get('SLURM_STEP_NUM_TASKS', '1')}: "
            f"a worker on {where} joining the job at {args.join} (its index from the server)")
    return command, env, what


def exit_status(returncode: int) -> int:
    """A child's status as a shell gives it: 128 + S for a child killed by signal S."""
    return 128 - returncode if returncode < 0 else returncode


def record_status(environ: dict, cluster: slurm.SlurmCluster | None, status: int) -> None:
    """With ``TFPS_SLURM_STATUS=PREFIX`` (``tfps.sbatch`` sets it): a server writes its status to
    ``PREFIX.ps-I``, the chief ``STATUS NUM_PS`` to ``PREFIX.chief``. The script takes the job's
    status from them, not from ``srun``, whose status is its tasks' highest: a worker's task
    that Slurm killed (its node set down) would fail a job that trained to its end. A file
    that cannot be written is said and skipped (srun's status then stands)."""
    prefix = environ.get(STATUS_ENV)
    if not prefix or cluster is None or not (cluster.role == "ps" or cluster.is_chief):
        return
    path, text = ((f"{prefix}.ps-{cluster.task_index}", f"{status}\n") if cluster.role == "ps" else
                  (f"{prefix}.chief", f"{status} {cluster.num_ps}\n"))
    try:
        write_atomically(path, text)
    except OSError as e:
        print(f"ps-slurm: cannot record this task's status in {path} ({e}); the job's is srun's", file=sys.stderr,
              flush=True)


def _task(args: argparse.Namespace, worker_argv: list[str]) -> tuple[list[str], dict, str, slurm.SlurmCluster | None]:
    """(command, environment, what it is, the step's cluster; None for ``--join``) of this task."""
    if args.join:
        return (*join_task(args, worker_argv, dict(os.environ)), None)
    env = child_environment(args, dict(os.environ))
    cluster = slurm.from_environ(env)
    server_argv, worker_argv = role_argvs(args.server_args, worker_argv)
    if cluster.role == "ps":
        return [sys.executable, "-m", "ps_server", *server_argv], env, cluster.describe(), cluster
    return [sys.executable, "-m", "worker", *worker_argv], env, cluster.describe(), cluster


def main(argv: list[str] | None = None) -> int:
    args, worker_argv = parser().parse_known_args(argv)
    try:
        command, env, what, cluster = _task(args, worker_argv)
    except ConfigError as e:
        print(f"ps-slurm: error: {e}", file=sys.stderr, flush=True)
        return 2
    # SIGTERM when this task dies: a server still writes its final checkpoint.
    child = subprocess.Popen(dying_with_parent(command, signal.SIGTERM), env=env, stdin=subprocess.DEVNULL)
    print(f"ps-slurm: {what}, pid {child.pid}", file=sys.stderr, flush=True)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    status = exit_status(child.wait())
    record_status(env, cluster, status)
    if status != 0 and cluster is not None and cluster.role == "worker" and not cluster.is_chief:
        print(f"ps-slurm: worker {cluster.task_index} exited with status {status}; this task exits 0, the job's "
              "status is the chief's (the server's --dead-worker-policy decides whether it goes on)",
              file=sys.stderr, flush=True)
        return 0
    return status


if __name__ == "__main__":
    sys.exit(main())
