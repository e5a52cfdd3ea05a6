"""worker.connection.Connection against a real server on port 0, with a model of plain arrays.

    python -m pytest -q tests/worker/test_connection.py

Claims of Connection's docstrings: ``optimizer_spec`` "replaces config.optimizer_spec():
the chief initializes the server with it, and the others check the server's
optimizer against it"; ``push`` passes ``metrics`` and ``set_learning_rates`` on;
``broadcast``: "the chief posts value ... and gets it back at once; every other
worker waits for the chief's". No TensorFlow: the model is a stand-in with the
attributes ``worker.gradients`` reads.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from ps_common.settings import ConfigError
from worker.config import WorkerConfig
from worker.connection import Connection, Work
from tests.core.threads import finish, start


class Variable:
    def __init__(self, path, value):
        self.path, self.value = path, np.array(value, np.float32)
        self.dtype = self.value.dtype

    def numpy(self):
        return self.value

    def assign(self, value):
        self.value = np.array(value, np.float32)


class Model:
    def __init__(self):
        self.trainable_variables = [Variable("dense/kernel", [1.0, 2.0])]
        self.non_trainable_variables = []


KERAS_SGD = {"name": "sgd", "learning_rate": 0.125, "momentum": 0.0, "nesterov": False}


@pytest.fixture
def connections(server):
    """``connections(mode, n, **kw) -> [Connection, ...]`` registered and joined; closed at the end."""
    made = []

    def make(mode="sync", n=2, specs=None):
        running = server(mode, n)
        conns = []
        for w in range(n):
            config = WorkerConfig(ps=running.address, worker_index=w, num_workers=n, connect_timeout=10.0,
                                  init_timeout=10.0)
            conn = Connection(config, Model(), optimizer_spec=(specs or [KERAS_SGD] * n)[w])
            made.append(conn)
            conn.register()
            conns.append(conn)
        return conns

    yield make
    for c in made:
        c.close()


def test_the_chief_initializes_with_the_given_optimizer_and_the_others_check_against_it(connections):
    chief, other = connections("async", 2)
    chief.join()
    optimizer = chief.client.status().optimizer
    assert (optimizer.name, optimizer.learning_rate) == ("sgd", 0.125)
    other.join()  # the same spec: no complaint


def test_a_worker_whose_given_optimizer_differs_from_the_server_s_is_refused(connections):
    chief, other = connections("async", 2, specs=[KERAS_SGD, {**KERAS_SGD, "learning_rate": 0.5}])
    chief.join()
    with pytest.raises(ConfigError, match="the server trains with optimizer"):
        other.join()


def test_a_worker_joining_after_the_chief_set_a_learning_rate_checks_against_the_initial_one(connections):
    """tfps.keras: ReduceLROnPlateau on the chief sets the server's rate; a worker that joins
    later (async: nobody waits for it) was compiled with the initial rate and must not be refused."""
    chief, other = connections("async", 2)
    chief.join()
    chief.pull()
    chief.push({"dense/kernel": np.array([2.0, 4.0], np.float32)}, Work(chief.step, 8), 0.5, set_learning_rates=(0.0625,))
    other.join()  # no complaint: the optimizer is the one the chief initialized
    status = other.client.status()
    assert (status.optimizer.learning_rate, status.learning_rate_now) == (0.125, 0.0625)


def test_push_carries_metrics_and_a_learning_rate_to_the_server(connections):
    (conn,) = connections("sync", 1)
    conn.join()
    conn.pull()
    reply = conn.push({"dense/kernel": np.array([2.0, 4.0], np.float32)}, Work(conn.step, 8), 0.5,
                      metrics={"acc/total": np.array([3.0], np.float32)}, set_learning_rates=(0.25,))
    assert reply.learning_rate == 0.25 and reply.metrics["acc/total"].tolist() == [3.0]
    conn.pull()
    assert conn.pulled["dense/kernel"].tolist() == [0.5, 1.0]  # [1, 2] - 0.25 * [2, 4]
    assert conn.step == 1


def test_the_chief_broadcasts_and_another_worker_waits_for_its_value(connections):
    chief, other = connections("sync", 2)
    chief.join()
    other.join()
    waiting = start(lambda: other.broadcast("epoch-0", b"ignored", 10.0))
    time.sleep(0.1)
    assert waiting.is_alive()
    assert chief.broadcast("epoch-0", b"stop", 10.0) == b"stop"
    finish(waiting, timeout=10.0)
    assert waiting.error is None and waiting.result == b"stop"
    with pytest.raises(ValueError, match="the poster must give a value"):
        chief.broadcast("epoch-1", None, 1.0)


def test_a_chief_rejoining_a_restarted_server_posts_its_last_broadcasts_again(server):
    """A Keras fit's workers agree at each epoch's end (``broadcast``). A server that restarts
    after the chief posted has lost the value; a worker that asks the new server must still
    get it: the chief posts its last ones again when it finds the new incarnation."""
    from ps_server.config import ServerConfig
    from ps_server.server import build_server
    import grpc

    from worker.client import PSClientError

    first = server("sync", 2)
    chief, other = (Connection(WorkerConfig(ps=first.address, worker_index=w, num_workers=2, connect_timeout=10.0,
                                            init_timeout=10.0, reconnect_timeout=10.0), Model(),
                               optimizer_spec=KERAS_SGD) for w in range(2))
    again = None
    try:
        for conn in (chief, other):
            conn.register()
        chief.join(), other.join()
        assert chief.broadcast("fit/epoch0", b"go on", 10.0) == b"go on"
        first.stop(grace=0.1)
        again = build_server(ServerConfig(host="127.0.0.1", port=first.port, mode="sync", num_workers=2)).start()
        lost = PSClientError("Push", first.address, grpc.StatusCode.UNAVAILABLE, "the server went away")
        chief.rejoin(lost)  # the new server has no state: the chief initializes it again, and posts
        other.rejoin(lost)
        assert other.broadcast("fit/epoch0", None, 5.0) == b"go on"
    finally:
        for conn in (chief, other):
            conn.close()
        if again is not None:
            again.stop(grace=0.1)


def test_overlap_block_kib_reaches_every_shard_s_client_and_one_out_of_range_is_refused():
    from worker.connection import connect

    args = ["--ps", "127.0.0.1:1,127.0.0.1:2", "--overlap-block-kib"]
    client = connect(WorkerConfig.from_args(args + ["32"], environ={}))  # channels dial at the first call
    try:
        assert [c.overlap_block_bytes for c in client._clients] == [32 << 10] * 2
    finally:
        client.close()
    with pytest.raises(ConfigError, match=r"--overlap-block-kib must be 0 \(off\) or 4 to 65536, got 2$"):
        WorkerConfig.from_args(args + ["2"], environ={})


def test_a_worker_whose_index_another_process_took_stops_at_its_next_call_after_a_heartbeat(server):
    # Issue 40: a worker paused past its lease and replaced (an auto index handed its index) must
    # not go on acting for the index: its heartbeat is refused as superseded, and its next call raises.
    from ps_common.reasons import Reason
    from worker.client import PSClientError
    running = server("async", 2)
    config = WorkerConfig(ps=running.address, worker_index=1, num_workers=2, connect_timeout=10.0,
                          init_timeout=10.0, heartbeat_interval=0.05)
    old, new = (Connection(config, Model(), optimizer_spec=KERAS_SGD) for _ in range(2))
    try:
        old.register()
        chief = Connection(dataclasses.replace(config, worker_index=0), Model(), optimizer_spec=KERAS_SGD)
        chief.register(), chief.join()
        old.join()
        new.register()  # another process on index 1
        deadline = time.monotonic() + 10
        while old.superseded is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(PSClientError) as stopped:
            old.pull()
        assert stopped.value.reason is Reason.SUPERSEDED
        new.join()
        assert new.pull() == 0  # the new process trains as worker 1
        chief.close()
    finally:
        old.close(), new.close()
