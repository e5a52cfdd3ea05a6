"""Real processes on loopback: a ps-server and ps-workers, as users start them.

Every process started here is killed when its test ends (and, through
PR_SET_PDEATHSIG, when pytest itself dies: ``procs.dying_with_parent``), so
nothing outlives a test.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ps_common.procs import ServerStartError, dying_with_parent, wait_for_port_file
from worker.client import PSClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Procs:
    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.tmp_path / f"{log_name}.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TF_CONFIG", None)
        proc = subprocess.Popen(
            dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=self.tmp_path, env=env,
        )
        proc.log_path = self.tmp_path / f"{log_name}.log"
        self.procs.append(proc)
        return proc

    def server(self, mode: str = "sync", num_workers: int = 2, barrier_timeout: float = 60.0,
               extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
        port_file = self.tmp_path / f"port-{len(self.procs)}"
        proc = self.start(
            [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
             "--mode", mode, "--num-workers", str(num_workers), "--barrier-timeout", str(barrier_timeout), *extra],
            "ps",
        )
        address = f"127.0.0.1:{port_of(proc, port_file)}"
        with PSClient(address) as c:
            c.wait_ready(30)
        return proc, address

    def worker(self, address: str, index: int, num_workers: int, *flags: str) -> subprocess.Popen:
        return self.start(
            [sys.executable, "-m", "worker", "--ps", address, "--worker-index", str(index),
             "--num-workers", str(num_workers), *flags],
            f"worker{index}",
        )

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def port_of(proc, port_file) -> int:
    """The port a ps-server started with --port-file wrote; fails the test with its log otherwise."""
    try:
        return wait_for_port_file(str(port_file), proc, 60)
    except ServerStartError as e:
        pytest.fail(f"{e}; log:\n{read_log(proc)[-3000:]}")


def read_log(proc) -> str:
    return proc.log_path.read_text()


def wait_exit(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        name = getattr(proc, "label", None) or f"process {proc.args[:4]}"
        pytest.fail(f"{name} still running after {timeout} s; log:\n{read_log(proc)[-3000:]}")


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.stop_all()
