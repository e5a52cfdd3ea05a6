"""``ps-server --metrics-port`` as a real process: scraped while it serves, closed when it stops.

    python -m pytest -q tests/cluster/test_metrics_scrape.py

Rule checked (ps_server/metrics.py, ps_server/server.py): "ps-server --metrics-port P"
serves http://HOST:P/metrics from start to SIGTERM, with the status the workers made.
"""

import signal
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ps_common.ports import free_port
from tests.cluster.conftest import read_log, wait_exit
from worker.client import PSClient

pytestmark = pytest.mark.cluster


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_a_ps_server_process_serves_its_metrics_until_sigterm(procs):
    port = free_port()
    server, address = procs.server("async", num_workers=1, extra=("--metrics-port", str(port)))
    with PSClient(address) as c:
        c.register(0, 1)
        c.initialize(0, {"w": np.zeros(4, np.float32)}, {"name": "sgd", "learning_rate": 0.1})
        for step in range(3):
            c.push(0, step, step, 8, {"w": np.ones(4, np.float32)})
    m = scrape(port)
    assert m["tfps_pushes_applied_total"] == 3, read_log(server)[-2000:]
    assert m["tfps_live_workers"] == 1 and m["tfps_version"] == 3
    assert m["process_resident_memory_bytes"] > 0  # the standard process series too
    server.send_signal(signal.SIGTERM)
    assert wait_exit(server, 30) == 0, read_log(server)[-2000:]
    assert f"metrics: http://127.0.0.1:{port}/metrics" in read_log(server)
    with pytest.raises(urllib.error.URLError):
        scrape(port)
