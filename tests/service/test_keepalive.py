"""Client and server keepalive settings agree: a worker waiting in one call is never cut off.

    python -m pytest tests/service/test_keepalive.py -q

A worker pings a connection that carried no data every ``protos.wire.KEEPALIVE_MS``; the
server permits pings that often. Issue 40 saw a worker waiting ~40 s in ``Work`` cut by the
server with GOAWAY ENHANCE_YOUR_CALM "too_many_pings" after three pings: the server's
permission was set under a key gRPC does not read. Here both ends use a keepalive of
``KEEPALIVE_MS`` = 200 ms, and a ``Work`` call waits a whole barrier timeout (many pings).
"""

import numpy as np
import pytest

from protos import wire
from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.client import PSClient, PSClientError

import grpc


def test_a_call_waiting_through_many_keepalive_pings_ends_as_the_server_says(monkeypatch):
    monkeypatch.setattr(wire, "KEEPALIVE_MS", 200)
    config = ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=2, barrier_timeout=3.0,
                          elastic_min_workers=2, micro_batches=2)
    running = build_server(config).start()
    try:
        with PSClient(running.address, timeout=30) as client:
            client.register(0, 2)
            client.initialize(0, {"w": np.zeros(3, np.float32)}, {"name": "sgd", "learning_rate": 0.1},
                              data_plan={"num_examples": 100, "global_batch_size": 10, "seed": 0})
            with pytest.raises(PSClientError) as refused:
                client.work(0)  # the second worker never comes: no work within the barrier timeout
            assert refused.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, refused.value  # not GOAWAY's UNAVAILABLE
            assert "given no work within 3 s" in refused.value.details
    finally:
        running.stop(grace=0.5)
