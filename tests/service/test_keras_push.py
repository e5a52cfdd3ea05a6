"""Round-summed metrics, set_learning_rates and Broadcast through a real server on port 0.

    python -m pytest tests/service/test_keras_push.py -q

The wire contract (protos/tfps.proto): PushRequest.metrics "the server sums over
the round's pushes, element by element in worker order, and returns to every
participant in PushResponse.metrics"; set_learning_rates "from the update this
push belongs to on (sync: its round), the constant learning rate of
OptimizerConfig.groups[i] (without groups, entry 0: of the optimizer) is this";
PushResponse.learning_rate "the learning rate the optimizer used for this
update". The same through each of the three transports (unary, PushStream, shared
memory), which carry both in PushRequest or PushHeader. Broadcast: "the chief
posts a value under a key (returns at once); every other worker asks for the key
and waits until the chief has posted it, or timeout_s passes (DEADLINE_EXCEEDED)".
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.client import PSClient, PSClientError

from tests.service.conftest import CLIENT_TIMEOUT, DEFAULT_BARRIER_TIMEOUT

Code = grpc.StatusCode
SGD = {"name": "sgd", "learning_rate": 0.5}
W0 = {"w": np.array([1.0, 2.0], np.float32)}


def f32(*xs):
    return np.array(xs, np.float32)


@pytest.fixture
def cluster():
    """``cluster.server(mode, num_workers, barrier_timeout)``, ``cluster.client(running, transport)``:
    stopped and closed at teardown, servers first (a waiting call is cancelled)."""

    class Cluster:
        def __init__(self):
            self.servers, self.clients = [], []

        def server(self, mode="sync", num_workers=2, barrier_timeout=DEFAULT_BARRIER_TIMEOUT):
            running = build_server(ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=num_workers,
                                                barrier_timeout=barrier_timeout)).start()
            self.servers.append(running)
            return running

        def client(self, running, transport="unary"):
            # small_bytes=0 sends even these tiny pushes streamed, or through shared memory.
            kw = {"session": transport == "session"} if transport in ("unary", "session") \
                else {"small_bytes": 0, "shm": transport == "shm"}
            c = PSClient(running.address, timeout=CLIENT_TIMEOUT, **kw)
            self.clients.append(c)
            return c

    c = Cluster()
    yield c
    for running in c.servers:
        running.stop(grace=0.5)
    for client in c.clients:
        client.close()


def used(client, transport):
    """Count the calls of ``transport`` this client makes: a list that grows by one per call."""
    calls = []
    target = {"unary": client.unary, "session": client.calls, "stream": client.streams,
              "shm": client.shared_memory}[transport]
    inner = target.push

    def push(outgoing, timeout, **kw):
        reply = inner(outgoing, timeout, **kw)
        if reply is not None:
            calls.append(outgoing.step)
        return reply

    target.push = push
    if transport == "stream":  # a sync push streamed as PushPull is a streamed push too
        inner_push_pull = target.push_pull

        def push_pull(outgoing, timeout, *more):
            answer = inner_push_pull(outgoing, timeout, *more)
            calls.append(outgoing.step)
            return answer

        target.push_pull = push_pull
    return calls


def workers(cluster, running, n, transport):
    clients = [cluster.client(running, transport) for _ in range(n)]
    for w, c in enumerate(clients):
        c.register(w, n)
    assert clients[0].initialize(0, W0, SGD) is True
    if transport == "shm":
        assert all(c.shm_active for c in clients)
    return clients


# Worker order: (2**24 + 1) - 2**24 = 0 in float32; worker 1 arrives first, and its
# value first would give (1 - 2**24) + 2**24 = 1 (float64 would too).
METRICS = [{"acc/total": f32(2**24, 0.5), "acc/count": np.array(3.0)},
           {"acc/total": f32(1, 0.25), "acc/count": np.array(4.0)},
           {"acc/total": f32(-(2**24), 0.25), "acc/count": np.array(5.0)}]


@pytest.mark.parametrize("transport", ["session", "unary", "stream", "shm"])
def test_a_sync_round_s_metrics_are_summed_in_worker_order_and_its_set_rate_applied(cluster, bg, wait_until,
                                                                                   transport):
    running = cluster.server("sync", 3)
    clients = workers(cluster, running, 3, transport)
    calls = [used(c, transport) for c in clients]
    pending = []
    for w in (2, 1):  # worker 0 last
        pending.append(bg(clients[w].push, w, 0, 0, 1, {"w": f32(2, 4)}, metrics=METRICS[w],
                          set_learning_rates=(0.25,) if w == 1 else ()))
        wait_until(lambda w=w: w not in clients[0].status().waiting_for and clients[0].status().waiting_for,
                   what=f"worker {w} waiting")
    last = clients[0].push(0, 0, 0, 1, {"w": f32(2, 4)}, metrics=METRICS[0])
    replies = [last] + [p.result(timeout=30) for p in reversed(pending)]
    for r in replies:
        assert (r.version, r.contributors, r.learning_rate) == (1, 3, 0.25)
        assert set(r.metrics) == {"acc/total", "acc/count"}
        assert r.metrics["acc/total"].tobytes() == f32(0, 1).tobytes()
        assert r.metrics["acc/count"].dtype == np.float64 and r.metrics["acc/count"].shape == ()
        assert float(r.metrics["acc/count"]) == 12.0
    _, values = clients[0].pull()
    np.testing.assert_array_equal(values["w"], f32(1 - 0.25 * 2, 2 - 0.25 * 4))
    assert [len(c) for c in calls] == [1, 1, 1]  # every push went by the transport named


@pytest.mark.parametrize("transport", ["session", "unary", "stream", "shm"])
def test_async_ignores_metrics_and_names_the_rate_it_applied(cluster, transport):
    running = cluster.server("async", 1)
    (client,) = workers(cluster, running, 1, transport)
    calls = used(client, transport)
    first = client.push(0, 0, 0, 1, {"w": f32(2, 4)}, metrics=METRICS[0])
    assert (first.metrics, first.learning_rate) == ({}, 0.5)
    second = client.push(0, 1, 1, 1, {"w": f32(2, 4)}, set_learning_rates=[0.125])
    assert second.learning_rate == 0.125
    _, values = client.pull()
    np.testing.assert_array_equal(values["w"], f32(1 - 1 - 0.25, 2 - 2 - 0.5))
    assert len(calls) == 2


@pytest.mark.parametrize("transport", ["session", "unary", "stream"])
def test_a_push_whose_metrics_differ_from_its_round_s_is_invalid_argument_and_changes_nothing(
        cluster, bg, wait_until, snapshot, transport):
    running = cluster.server("sync", 2)
    c0, c1 = workers(cluster, running, 2, transport)
    before = snapshot(c0)
    first = bg(c0.push, 0, 0, 0, 1, {"w": f32(2, 4)}, metrics={"acc/total": f32(1, 2)})
    wait_until(lambda: list(c0.status().waiting_for) == [1], what="worker 0 waiting")
    with pytest.raises(PSClientError) as e:
        c1.push(1, 0, 0, 1, {"w": f32(2, 4)}, metrics={"acc/total": np.array([1.0, 2.0])})
    assert e.value.code == Code.INVALID_ARGUMENT
    assert "has metric 'acc/total' as float64[2], not float32[2]" in e.value.details
    assert snapshot(c0) == before and list(c0.status().waiting_for) == [1]
    reply = c1.push(1, 0, 0, 1, {"w": f32(2, 4)}, metrics={"acc/total": f32(10, 20)})
    assert reply.metrics["acc/total"].tobytes() == f32(11, 22).tobytes()
    assert first.result(timeout=30).metrics["acc/total"].tobytes() == f32(11, 22).tobytes()


def test_too_many_metrics_are_invalid_argument(cluster):
    running = cluster.server("async", 1)
    (client,) = workers(cluster, running, 1, "unary")
    with pytest.raises(PSClientError) as e:
        client.push(0, 0, 0, 1, {"w": f32(2, 4)}, metrics={f"m{i}": f32(1) for i in range(65)})
    assert e.value.code == Code.INVALID_ARGUMENT and "at most 64 metric tensors" in e.value.details
    with pytest.raises(PSClientError) as e:
        client.push(0, 0, 0, 1, {"w": f32(2, 4)}, set_learning_rates=[-1.0])
    assert e.value.code == Code.INVALID_ARGUMENT and "a learning rate must be a finite number > 0; got -1.0" in e.value.details
    assert client.pull()[0] == 0


# -- Broadcast ---------------------------------------------------------------------------------


def test_the_chief_posts_and_a_waiting_worker_gets_its_value(cluster, bg):
    running = cluster.server("sync", 2)
    c0, c1 = workers(cluster, running, 2, "unary")
    waiting = bg(c1.broadcast, 1, "epoch-3/stop", None, 20.0)
    time.sleep(0.2)
    assert not waiting.done()
    assert c0.broadcast(0, "epoch-3/stop", b"\x01", 20.0) == b"\x01"
    assert waiting.result(timeout=10) == b"\x01"
    assert c0.broadcast(0, "epoch-3/stop", b"\x01", 20.0) == b"\x01"  # posting again: harmless
    with pytest.raises(PSClientError) as e:
        c0.broadcast(0, "epoch-3/stop", b"\x00", 20.0)
    assert e.value.code == Code.FAILED_PRECONDITION and "already posted with another value" in e.value.details
    assert c1.broadcast(1, "epoch-3/stop", None, 0.0) == b"\x01"


def test_a_broadcast_wait_ends_in_deadline_exceeded_bounded_by_the_barrier_timeout(cluster):
    running = cluster.server("sync", 2, barrier_timeout=1.0)
    _, c1 = workers(cluster, running, 2, "unary")
    started = time.monotonic()
    with pytest.raises(PSClientError) as e:
        c1.broadcast(1, "never", None, 0.3)
    assert e.value.code == Code.DEADLINE_EXCEEDED and "'never' was not posted by the chief" in e.value.details
    assert 0.3 <= time.monotonic() - started < 5.0
    started = time.monotonic()
    with pytest.raises(PSClientError) as e:
        c1.broadcast(1, "never", None, 600.0)  # the server waits at most its barrier timeout
    assert e.value.code == Code.DEADLINE_EXCEEDED and "barrier timeout, 1 s" in e.value.details
    assert time.monotonic() - started < 10.0


def test_an_unregistered_worker_s_broadcast_is_refused(cluster):
    running = cluster.server("sync", 2)
    client = cluster.client(running)
    client.register(0, 2)
    for worker, value in ((1, None), (0 + 7, b"v")):
        with pytest.raises(PSClientError) as e:
            client.broadcast(worker, "k", value, 1.0)
        assert e.value.code == Code.FAILED_PRECONDITION and "not registered" in e.value.details


# -- several shards ------------------------------------------------------------------------------


def test_sharded_set_learning_rates_reach_every_shard_and_the_metrics_come_from_shard_0(cluster, bg):
    from worker.sharded_client import ShardedClient

    servers = [cluster.server("sync", 2), cluster.server("sync", 2)]
    addresses = [s.address for s in servers]
    clients = [ShardedClient(addresses, timeout=CLIENT_TIMEOUT) for _ in range(2)]
    try:
        for w, c in enumerate(clients):
            c.register(w, 2)
        variables = {"a": f32(1, 2), "b": f32(3, 4)}  # one a shard
        clients[0].initialize(0, variables, SGD)
        assert sorted(p.shard for p in clients[0].placement.pieces) == [0, 1]
        sent = []  # the metrics each shard was sent, by shard
        for i, shard in enumerate(clients[1]._clients):
            inner = shard.push
            shard.push = lambda *a, i=i, inner=inner, **kw: sent.append((i, kw.get("metrics"))) or inner(*a, **kw)
        version, _ = clients[1].pull(1)
        grads = {"a": f32(2, 4), "b": f32(4, 8)}
        first = bg(clients[0].push, 0, 0, version, 1, grads, metrics={"m": f32(1.5)})
        reply = clients[1].push(1, 0, version, 1, grads, metrics={"m": f32(2.25)}, set_learning_rates=(0.25,))
        other = first.result(timeout=30)
        for r in (reply, other):
            assert r.learning_rate == 0.25 and r.metrics["m"].tobytes() == f32(3.75).tobytes()
        by_shard = dict(sent)
        assert len(sent) == 2 and by_shard[1] is None and list(by_shard[0]) == ["m"]
        assert by_shard[0]["m"].tobytes() == f32(2.25).tobytes()
        _, values = clients[0].pull(0)
        np.testing.assert_array_equal(values["a"], f32(1 - 0.5, 2 - 1))  # lr 0.25 on both shards
        np.testing.assert_array_equal(values["b"], f32(3 - 1, 4 - 2))
    finally:
        for c in clients:
            c.close()
