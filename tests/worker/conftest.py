"""Fixtures of the worker tier: real servers in this process, on port 0."""

import pytest

from ps_server.config import ServerConfig
from ps_server.server import build_server


@pytest.fixture
def server():
    """``server(mode="async", num_workers=1)`` starts a real ps-server on loopback; all stop at the end."""
    running = []

    def start(mode="async", num_workers=1):
        r = build_server(ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=num_workers)).start()
        running.append(r)
        return r

    yield start
    for r in running:
        r.stop(grace=0.5)


@pytest.fixture
def server_config():
    """``server_config(**ServerConfig fields)`` starts a real ps-server on loopback with them; all stop at the end."""
    running = []

    def start(**fields):
        r = build_server(ServerConfig(host="127.0.0.1", port=0, **fields)).start()
        running.append(r)
        return r

    yield start
    for r in running:
        r.stop(grace=0.5)
