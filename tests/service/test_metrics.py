"""Prometheus metrics of a real server on port 0, scraped over HTTP like Prometheus does.

    python -m pytest tests/service/test_metrics.py -q

Rules checked (ps_server/metrics.py, ps_server/config.py):
- "Most series are read from ParameterServer.status() at scrape time": after K sync
  rounds of N workers, rounds == K, pushes == K*N, the version is K, every worker is live;
- staleness is observed "per applied push": its histogram counts the applied pushes, and in
  async mode its buckets and sum are the staleness values computed by hand;
- dropped and replayed pushes are counted, not applied;
- bytes are "request and response message bytes ... by method": more than the gradients sent;
- checkpoint age and version are "absent while there is none";
- "--metrics-port ... 0: off" is the default; a port in use is a one-line ConfigError at start;
- the endpoint binds only the configured host, and closes when the server stops.
"""

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ps_server.config import ServerConfig
from ps_server.server import build_server
from ps_common.settings import ConfigError
from worker.client import PSClient

W0 = {"w": np.zeros((4, 8), np.float32), "b": np.zeros(8, np.float32)}
GRADIENT_BYTES = sum(a.nbytes for a in W0.values())
SGD = {"name": "sgd", "learning_rate": 0.5}
BATCH = 4


class Scrape:
    """One scrape: ``value(name, **labels)`` of a sample, ``None`` when absent."""

    def __init__(self, port: int):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert reply.status == 200
            self.text = reply.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def value(self, name: str, **labels) -> float | None:
        return self.samples.get((name, frozenset((k, str(v)) for k, v in labels.items())))

    def buckets(self, name: str) -> dict[str, float]:
        return {dict(labels)["le"]: v for (n, labels), v in self.samples.items() if n == name + "_bucket"}


@pytest.fixture
def served(bg):
    """``served(**config) -> (RunningServer, [PSClient per worker])``, metrics on a free port.

    Stopped at teardown before ``bg`` joins its calls (as the ``ps`` fixture)."""
    started = []

    def start(num_workers: int = 2, clients: int | None = None, **config):
        config = ServerConfig(host="127.0.0.1", port=0, num_workers=num_workers, barrier_timeout=20.0, **config)
        running = build_server(config, metrics_port=0).start()
        made = [PSClient(running.address, timeout=30.0) for _ in range(num_workers if clients is None else clients)]
        started.append((running, made))
        return running, made

    yield start
    for running, made in started:
        for c in made:
            c.close()
        running.stop(grace=0.5)


def grads(value: float) -> dict[str, np.ndarray]:
    return {name: np.full_like(a, value) for name, a in W0.items()}


def sync_rounds(clients, rounds: int, bg) -> None:
    for step in range(rounds):
        calls = [bg(c.push, i, step, step, BATCH, grads(i + 1)) for i, c in enumerate(clients)]
        for call in calls:
            call.result(timeout=30)


def setup_workers(clients) -> None:
    for i, c in enumerate(clients):
        c.register(i, len(clients))
    clients[0].initialize(0, W0, SGD)


def test_sync_rounds_and_pushes_equal_the_pushes_done_and_every_worker_is_live(served, bg):
    running, clients = served(mode="sync", num_workers=2)
    setup_workers(clients)
    sync_rounds(clients, 3, bg)
    m = Scrape(running.metrics_port)
    assert m.value("tfps_rounds_completed_total") == 3
    assert m.value("tfps_pushes_applied_total") == 6
    assert m.value("tfps_examples_applied_total") == 6 * BATCH
    assert m.value("tfps_version") == 3 and m.value("tfps_round") == 3
    assert m.value("tfps_num_workers") == 2
    assert m.value("tfps_live_workers") == 2 and m.value("tfps_dead_workers") == 0
    assert m.value("tfps_initialized") == 1
    assert m.value("tfps_info", mode="sync", stale_gradient_policy="none", dead_worker_policy="abort",
                   incarnation=running.core.incarnation) == 1
    for counter in ("dropped", "replayed", "scaled"):
        assert m.value(f"tfps_pushes_{counter}_total") == 0
    assert m.value("tfps_rounds_timed_out_total") == 0 and m.value("tfps_rounds_aborted_total") == 0
    assert m.value("tfps_parameters") == sum(a.size for a in W0.values())
    for w in ("0", "1"):
        assert m.value("tfps_worker_pushes_total", worker=w) == 3
        assert m.value("tfps_worker_last_step", worker=w) == 2
        assert m.value("tfps_worker_alive", worker=w) == 1
        assert m.value("tfps_worker_wait_seconds", worker=w) >= 0
        assert m.value("tfps_worker_work_seconds", worker=w) >= 0
    assert m.value("tfps_max_ahead_steps") is None  # ssp only


def test_sync_staleness_wait_and_apply_histograms_observe_each_push_and_round(served, bg):
    running, clients = served(mode="sync", num_workers=2)
    setup_workers(clients)
    sync_rounds(clients, 3, bg)
    m = Scrape(running.metrics_port)
    assert m.families["tfps_push_staleness_versions"].type == "histogram"
    assert m.value("tfps_push_staleness_versions_count") == 6  # one per applied push
    assert m.buckets("tfps_push_staleness_versions")["0.0"] == 6  # sync: always 0
    assert m.value("tfps_push_staleness_versions_sum") == 0
    assert list(m.buckets("tfps_push_staleness_versions")) == \
        ["0.0", "1.0", "2.0", "3.0", "4.0", "6.0", "8.0", "12.0", "16.0", "32.0", "64.0", "+Inf"]
    assert m.value("tfps_push_wait_seconds_count") == 6  # every answered push
    assert m.value("tfps_apply_seconds_count") == 3  # one update per round
    assert 0 < m.value("tfps_apply_seconds_sum") <= m.value("tfps_push_wait_seconds_sum")


def test_bytes_received_exceed_the_gradient_bytes_sent_by_method(served, bg):
    running, clients = served(mode="sync", num_workers=2)
    clients[1].close()
    # Every push and pull streamed, as PushStream (not PushPull: overlap off) then PullStream.
    clients[1] = PSClient(running.address, timeout=30.0, small_bytes=0, overlap=False)
    setup_workers(clients)
    sync_rounds(clients, 2, bg)
    _, values = clients[1].pull(1)
    m = Scrape(running.metrics_port)
    # Client 0's pushes fit one message: on its session stream.
    assert m.value("tfps_received_bytes_total", method="Session") > 2 * GRADIENT_BYTES
    assert m.value("tfps_received_bytes_total", method="Push") == 0
    assert m.value("tfps_received_bytes_total", method="PushStream") > 2 * GRADIENT_BYTES
    assert m.value("tfps_received_bytes_total", method="Initialize") > GRADIENT_BYTES
    assert m.value("tfps_sent_bytes_total", method="PullStream") >= sum(a.nbytes for a in values.values())
    assert m.value("tfps_sent_bytes_total", method="Register") > 0
    assert m.value("tfps_received_bytes_total", method="Leave") == 0  # every method, from the start


def test_async_staleness_histogram_holds_each_applied_push_staleness(served):
    running, clients = served(mode="async", num_workers=2)
    setup_workers(clients)
    # Every push computed on version 0: staleness 0, 1, 2, 3, 4 as the version grows.
    for step in range(5):
        clients[step % 2].push(step % 2, step, 0, BATCH, grads(1.0))
    m = Scrape(running.metrics_port)
    assert m.value("tfps_rounds_completed_total") == 5  # async: each push is its own update
    assert m.value("tfps_pushes_applied_total") == 5
    assert m.value("tfps_push_staleness_versions_count") == 5
    assert m.value("tfps_push_staleness_versions_sum") == 0 + 1 + 2 + 3 + 4
    b = m.buckets("tfps_push_staleness_versions")
    assert (b["0.0"], b["1.0"], b["2.0"], b["3.0"], b["4.0"], b["6.0"], b["+Inf"]) == (1, 2, 3, 4, 5, 5, 5)
    assert m.value("tfps_apply_seconds_count") == 5
    assert m.value("tfps_push_wait_seconds_count") == 5


def test_dropped_and_replayed_pushes_are_counted_and_not_applied(served):
    running, clients = served(mode="async", num_workers=1, stale_gradient_policy="drop", max_staleness=1)
    setup_workers(clients)
    c = clients[0]
    for step in range(2):  # staleness 0, 1: applied
        assert not c.push(0, step, 0, BATCH, grads(1.0)).dropped
    assert c.push(0, 1, 0, BATCH, grads(1.0)).replayed  # a retry of the last step
    assert c.push(0, 2, 0, BATCH, grads(1.0)).dropped  # staleness 2 > 1
    m = Scrape(running.metrics_port)
    assert m.value("tfps_pushes_dropped_total") == 1
    assert m.value("tfps_pushes_replayed_total") == 1
    assert m.value("tfps_pushes_applied_total") == 2 and m.value("tfps_version") == 2
    assert m.value("tfps_push_staleness_versions_count") == 2  # applied pushes only
    assert m.value("tfps_worker_dropped_total", worker=0) == 1


def test_ssp_reports_how_far_ahead_a_push_ran(served):
    running, clients = served(mode="ssp", num_workers=1, staleness=2)
    setup_workers(clients)
    for step in range(3):
        clients[0].push(0, step, step, BATCH, grads(1.0))
    m = Scrape(running.metrics_port)
    assert m.value("tfps_max_ahead_steps") == 0  # alone, a worker is never ahead of itself
    assert m.value("tfps_round") == 3  # the slowest clock
    assert m.value("tfps_info", mode="ssp", stale_gradient_policy="none", dead_worker_policy="",
                   incarnation=running.core.incarnation) == 1


def test_a_worker_declared_dead_counts_as_dead_not_live(served, wait_until):
    running, clients = served(mode="async", num_workers=2, lease_timeout=0.5)
    setup_workers(clients)

    def dead_seen():
        clients[0].heartbeat(0)  # worker 0 stays alive; worker 1 goes silent
        return Scrape(running.metrics_port).value("tfps_dead_workers") == 1

    wait_until(dead_seen, timeout=15, what="worker 1 declared dead")
    m = Scrape(running.metrics_port)
    assert m.value("tfps_live_workers") == 1
    assert m.value("tfps_worker_alive", worker=1) == 0 and m.value("tfps_worker_alive", worker=0) == 1
    assert m.value("tfps_worker_last_seen_age_seconds", worker=1) > 0.5


def test_checkpoint_age_and_version_are_absent_until_a_checkpoint_is_written(served, tmp_path, bg):
    running, clients = served(mode="sync", num_workers=2, checkpoint_dir=str(tmp_path), checkpoint_interval=3600)
    setup_workers(clients)
    sync_rounds(clients, 2, bg)
    m = Scrape(running.metrics_port)
    assert m.value("tfps_checkpoint_age_seconds") is None and m.value("tfps_last_checkpoint_version") is None
    assert running.write_checkpoint() is not None
    m = Scrape(running.metrics_port)
    assert 0 <= m.value("tfps_checkpoint_age_seconds") < 60
    assert m.value("tfps_last_checkpoint_version") == 2


def test_metrics_are_off_by_default_and_the_port_falls_back_to_the_environment(ps):
    assert ServerConfig.from_args([], environ={}).metrics_port == 0
    running, _ = ps(mode="sync")
    assert running.metrics is None and running.metrics_port == 0
    config = ServerConfig.from_args(["--host", "127.0.0.2"], environ={"TFPS_METRICS_PORT": "9464"})
    assert (config.metrics_port, config.metrics_address) == (9464, "127.0.0.2")  # the gRPC host by default
    config = ServerConfig.from_args(["--metrics-port", "9465", "--metrics-host", "0.0.0.0"],
                                    environ={"TFPS_METRICS_PORT": "9464"})
    assert (config.metrics_port, config.metrics_address) == (9465, "0.0.0.0")


@pytest.mark.parametrize("argv, message", [
    (["--metrics-port", "70000"], "--metrics-port must be in 1..65535"),
    (["--port", "9000", "--metrics-port", "9000"], "is the gRPC --port"),
])
def test_an_impossible_metrics_port_is_a_config_error(argv, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig.from_args(argv, environ={})


def test_the_endpoint_binds_only_the_configured_host_and_closes_when_the_server_stops():
    config = ServerConfig(host="127.0.0.1", port=0, mode="sync", metrics_host="127.0.0.1")
    running = build_server(config, metrics_port=0).start()
    try:
        assert running.metrics.host == "127.0.0.1"
        assert "tfps_version 0.0" in Scrape(running.metrics_port).text
    finally:
        running.stop(grace=0.5)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=5)


def test_a_metrics_port_in_use_is_a_one_line_error_at_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            build_server(ServerConfig(host="127.0.0.1", port=0, metrics_port=port))
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                              "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ps-server: error: cannot serve metrics on 127.0.0.1:{port}"), run.stderr
    assert "Traceback" not in run.stderr
    assert time.monotonic() - started < 60


def test_a_server_with_metrics_imports_no_tensorflow():
    code = ("import sys, ps_server.cli, ps_server.server, ps_server.metrics; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow loaded'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
