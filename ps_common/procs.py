"""Helpers for the programs that start a ps-server (or workers) as child processes.

    proc = subprocess.Popen(dying_with_parent([sys.executable, "-m", "ps_server", "--port", "0",
                                               "--port-file", pf, ...]))
    port = wait_for_port_file(pf, proc, timeout=60)

Children die with their parent (Linux's PR_SET_PDEATHSIG), set by a small shim
that the child runs before it execs the real command, never by a
``preexec_fn``: a ``preexec_fn`` makes Python fork() the whole process and run
every library's atfork handlers, and gRPC's can hang a process that has used
gRPC (seen here: a benchmark stuck in fork(), inside gRPC's handler). Without
one, Python starts the child with vfork/posix_spawn, which run no handlers.

``ps-server --port-file`` writes the bound port atomically once it serves; the
launcher, the parity runner, the benchmarks and the tests all wait for it the
same way. Plain Python: no gRPC, no TensorFlow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Sequence

_PR_SET_PDEATHSIG = 1

# ps-worker --elastic's exit status once SIGTERM made it leave the job (worker.elastic):
# 128 + SIGTERM, as a shell reports a process SIGTERM ended; ps-launch tells it from a
# worker that ended without leaving.
LEFT_JOB_STATUS = 128 + signal.SIGTERM


class ServerStartError(RuntimeError):
    """The child exited, or wrote no port in time."""


def on_parent_death(sig: int) -> Callable[[], None]:
    """A function that asks Linux to send ``sig`` to the calling process when its parent
    dies; for a process to call on itself (children started through
    ``dying_with_parent`` have it done for them)."""

    def arm() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
        except OSError:
            pass

    return arm


# SIGKILL, not SIGTERM: a TensorFlow task that joined a cluster treats SIGTERM as a
# preemption notice and keeps running. ps-launch uses SIGTERM for its own children,
# so a ps-server still writes its final checkpoint.
die_with_parent = on_parent_death(signal.SIGKILL)

# argv: [parent pid, signal, command...]. The setting survives exec; if the parent
# died before it was made, the child is already an orphan and stops here.
_SHIM = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, int(sys.argv[2]))\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def dying_with_parent(argv: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """``argv`` wrapped so that the child receives ``sig`` when this process dies.

    Pass the result to ``subprocess.Popen``/``run`` without a ``preexec_fn`` (module
    docstring). The child keeps its pid: the shim execs the command in place.
    """
    return [sys.executable, "-S", "-c", _SHIM, str(os.getpid()), str(int(sig)), *argv]


def write_atomically(path: str, text: str) -> None:
    """``text`` into ``path`` by way of ``path.tmp``: a reader never sees a half-written file."""
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def wait_for_port_file(path: str, proc: subprocess.Popen, timeout: float) -> int:
    """The port ``proc`` wrote to ``path``; ServerStartError if it dies or takes longer than timeout."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise ServerStartError(f"ps-server exited with status {proc.returncode} before serving")
        if time.monotonic() > deadline:
            raise ServerStartError(f"ps-server did not start within {timeout:g} s")
        time.sleep(0.05)
    with open(path) as f:
        return int(f.read())
