"""The emulated-hosts tier: tfps on machines of their own, joined by real shaped links.

Each test builds its hosts with ``ps_tools.hosts.Hosts`` (a network namespace, a
name, a hosts file and a /dev/shm per host, on a bridge), starts ps-server and
ps-worker in them as users start them on separate machines (``TF_CONFIG`` or
``--ps`` naming hosts), and tears everything down at its end, pass or fail: the
hosts' processes are killed with them. Leftovers of a killed run are removed when
the next set starts. On a machine that cannot (not root, no ``ip``/``tc``), the tier
is skipped, saying why in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ps_tools.hosts import Hosts, unavailable
from tests.cluster.conftest import read_log, wait_exit  # noqa: F401 (the tier's tests import them from here)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PORT = 2222


class HostCluster:
    """Hosts plus the tfps processes started in them, each logging to a file of its own."""

    def __init__(self, tmp_path, names, **kwargs):
        self.tmp_path = tmp_path
        self.hosts = Hosts(names, **kwargs).start()
        self.procs: list[subprocess.Popen] = []

    def start(self, host: str, argv: list[str], label: str, env: dict | None = None) -> subprocess.Popen:
        log_path = self.tmp_path / f"{label}.log"
        environment = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
        environment.pop("TF_CONFIG", None)
        environment.update(env or {})
        with open(log_path, "w") as log:
            proc = self.hosts.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.tmp_path, env=environment)
        proc.log_path, proc.label = log_path, label
        self.procs.append(proc)
        return proc

    def server(self, host: str, *flags: str, env: dict | None = None, label: str | None = None) -> subprocess.Popen:
        return self.start(host, [sys.executable, "-m", "ps_server", *flags], label or f"server-{host}", env)

    def worker(self, host: str, *flags: str, env: dict | None = None, label: str | None = None) -> subprocess.Popen:
        return self.start(host, [sys.executable, "-m", "worker", *flags], label or f"worker-{host}", env)

    def status(self, host: str, address: str, timeout: float = 10) -> dict:
        """The Status of the server at ``address``, asked from inside ``host``."""
        script = (
            "import json, sys\n"
            "from worker.client import PSClient\n"
            f"with PSClient({address!r}, timeout={timeout}) as c:\n"
            "    s = c.status()\n"
            "print(json.dumps({'version': s.version, 'round': s.round, 'pushes_applied': s.pushes_applied,\n"
            "    'initialized': s.initialized, 'incarnation': s.incarnation,\n"
            "    'workers': [{'id': w.worker_id, 'dead': w.dead, 'left': w.left, 'name': w.worker_name}\n"
            "                for w in s.workers]}))\n"
        )
        done = self.hosts.run(host, [sys.executable, "-c", script], timeout=timeout + 30, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
        if done.returncode != 0:
            raise AssertionError(f"Status of {address} from {host} failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)

    def wait_serving(self, host: str, address: str, proc: subprocess.Popen, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.status(host, address, timeout=3)
                return
            except AssertionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{proc.label} did not serve at {address}; log:\n{read_log(proc)[-3000:]}")
                time.sleep(0.3)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.hosts.stop()


def tf_config(cluster: dict, task_type: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


@pytest.fixture
def host_cluster(tmp_path):
    """``host_cluster(names, rate=..., loss=...)`` -> HostCluster, stopped at the test's end."""
    why = unavailable()
    if why:
        pytest.skip(why)
    made: list[HostCluster] = []

    def make(names, **kwargs) -> HostCluster:
        cluster = HostCluster(tmp_path, names, **kwargs)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()
