"""Fixtures of the worker tier: real servers in this process, on port 0."""

import urllib.request

import pytest

from ps_server.config import ServerConfig
from ps_server.server import build_server


def _starter(running: list, defaults: dict):
    def start(*, metrics: bool = False, **fields):
        config = ServerConfig(host="127.0.0.1", port=0, **{**defaults, **fields})
        r = build_server(config, metrics_port=0 if metrics else None).start()
        running.append(r)
        return r

    return start


@pytest.fixture
def server():
    """``server(mode="async", num_workers=1, **ServerConfig fields)`` starts a real ps-server on
    loopback (``metrics=True``: with its Prometheus endpoint, for ``received_bytes``); all stop at the end."""
    running = []
    start = _starter(running, {})

    def server(mode="async", num_workers=1, **fields):
        return start(mode=mode, num_workers=num_workers, **fields)

    yield server
    for r in running:
        r.stop(grace=0.5)


@pytest.fixture
def server_config():
    """``server_config(**ServerConfig fields)`` starts a real ps-server on loopback with them; all stop at the end."""
    running = []
    yield _starter(running, {})
    for r in running:
        r.stop(grace=0.5)


def received_bytes(running, method_prefix: str | tuple[str, ...] = ("Push", "Session")) -> float:
    """The request bytes a server started with ``metrics=True`` received for the gRPC methods
    whose names start with ``method_prefix`` (its ``tfps_received_bytes_total``, scraped). The
    default, the pushes: a push that fits one message rides the worker's Session stream (with
    its pulls' and Work's requests, a few bytes each)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tfps_received_bytes_total" and s.labels["method"].startswith(method_prefix))
