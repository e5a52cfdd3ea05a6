"""The service tier: a real gRPC server in this process, on 127.0.0.1 port 0.

    def test_x(ps, bg):
        server, client = ps(mode="sync", num_workers=2)   # started, stopped at teardown
        call = bg(client.push, 0, 0, 0, 1, grads)         # a call in a thread
        reply = call.result(timeout=5)

Every server started here is stopped when its test ends; every background call
is joined with a timeout. No TensorFlow in this tier.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from protos import tfps_pb2_grpc as pb_grpc
from protos import wire
from ps_server.config import ServerConfig
from ps_server.server import RunningServer, build_server
from worker.client import PSClient

# Long enough never to fire by accident on a slow machine, short enough that a
# test that fails while a worker waits in a barrier does not hang for minutes.
DEFAULT_BARRIER_TIMEOUT = 20.0
CLIENT_TIMEOUT = 30.0


class Call:
    """One function running in a daemon thread; ``result`` re-raises its exception."""

    def __init__(self, fn, *args, **kwargs):
        self._value = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True)
        self.thread.start()

    def _run(self, fn, args, kwargs):
        try:
            self._value = fn(*args, **kwargs)
        except BaseException as e:  # handed to the test thread by result()
            self._error = e

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"background call still running after {timeout} s"
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture
def bg():
    """Start a call in a thread: ``bg(fn, *args) -> Call``. Joined (bounded) at teardown."""
    calls: list[Call] = []

    def start(fn, *args, **kwargs) -> Call:
        call = Call(fn, *args, **kwargs)
        calls.append(call)
        return call

    yield start
    for call in calls:
        call.thread.join(timeout=5.0)


@pytest.fixture
def ps(bg):
    """Start a real server: ``ps(mode=..., num_workers=..., ...) -> (RunningServer, PSClient)``.
    ``max_message_mb``: the server's and the client's message limit (default: ``protos.wire``'s).

    Depends on ``bg`` so that at teardown the server stops first, cancelling any
    call still blocked in a barrier, and only then are the background threads joined.
    """
    started: list[tuple[RunningServer, PSClient]] = []

    def start(mode: str = "sync", num_workers: int = 1, barrier_timeout: float = DEFAULT_BARRIER_TIMEOUT,
              threads: int = 0, max_message_mb: float | None = None) -> tuple[RunningServer, PSClient]:
        limit = {} if max_message_mb is None else {"max_message_mb": max_message_mb}  # both ends alike
        config = ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=num_workers,
                              barrier_timeout=barrier_timeout, threads=threads, **limit)
        running = build_server(config).start()
        client = PSClient(running.address, timeout=CLIENT_TIMEOUT,
                          max_message_bytes=config.max_message_bytes if limit else None)
        started.append((running, client))
        return running, client

    yield start
    for running, client in started:
        client.close()
        running.stop(grace=0.5)


@pytest.fixture
def connect():
    """More clients to a running server: ``connect(running) -> PSClient`` (one per worker thread)."""
    clients: list[PSClient] = []

    def make(running: RunningServer) -> PSClient:
        client = PSClient(running.address, timeout=CLIENT_TIMEOUT)
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def raw_stub():
    """The generated stub on a channel with the wire limits, for messages PSClient would never send."""
    channels: list[grpc.Channel] = []

    def make(running: RunningServer) -> pb_grpc.ParameterServerStub:
        channel = grpc.insecure_channel(running.address, options=wire.channel_options())
        channels.append(channel)
        return pb_grpc.ParameterServerStub(channel)

    yield make
    for ch in channels:
        ch.close()


def _wait_until(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.01)


def _snapshot(client: PSClient) -> tuple[int, dict[str, bytes]]:
    version, values = client.pull()
    return version, {name: np.ascontiguousarray(a).tobytes() for name, a in values.items()}


@pytest.fixture
def wait_until():
    """``wait_until(predicate, timeout, what)``: poll until truthy (returned); fail after timeout."""
    return _wait_until


@pytest.fixture
def snapshot():
    """``snapshot(client) -> (version, {name: bytes})``: what "stored state unchanged" compares."""
    return _snapshot
