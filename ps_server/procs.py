"""Helpers for the programs that start a ps-server (or workers) as child processes.

    proc = subprocess.Popen([sys.executable, "-m", "ps_server", "--port", "0",
                             "--port-file", pf, ...], preexec_fn=die_with_parent)
    port = wait_for_port_file(pf, proc, timeout=60)

``ps-server --port-file`` writes the bound port atomically once it serves; the
launcher, the parity runner, the benchmarks and the tests all wait for it the
same way. Plain Python: no gRPC, no TensorFlow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable

_PR_SET_PDEATHSIG = 1


class ServerStartError(RuntimeError):
    """The child exited, or wrote no port in time."""


def on_parent_death(sig: int) -> Callable[[], None]:
    """A ``preexec_fn`` asking Linux to send ``sig`` to the child when its parent dies."""

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
