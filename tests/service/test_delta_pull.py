"""Row-delta pulls (PullRequest.row_deltas) against a real server on port 0.

    a full pull after sparse pushes brings a row-wise table's changed rows only, and
    the client's copy, with them written in, is bit for bit what a fresh full pull gets.

Each transport (one unary message, the stream, shared memory), sync with two
workers, and async with two workers pushing at once.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from protos import tfps_pb2 as pb
from ps_server.config import ServerConfig
from ps_server.core.checkpoint import read_checkpoint
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.sparse import SparseRows
from ps_server.server import build_server
from worker.client import PSClient

from tests.service.conftest import CLIENT_TIMEOUT

VOCAB, DIM = 4000, 16  # 256 KB: unary by default
SGD = OptimizerSpec("sgd", learning_rate=0.1).as_dict()
ADAM = OptimizerSpec("adam", learning_rate=0.01).as_dict()


def values0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"emb": rng.standard_normal((VOCAB, DIM)).astype(np.float32),
            "kernel": rng.standard_normal((DIM, 4)).astype(np.float32)}


def grads(seed: int, k: int = 50) -> dict:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, VOCAB, size=k).astype(np.int64)  # repeats likely: they add up
    return {"emb": SparseRows(rows, rng.standard_normal((k, DIM)).astype(np.float32)),
            "kernel": rng.standard_normal((DIM, 4)).astype(np.float32)}


@pytest.fixture
def cluster():
    """``cluster(mode, workers, optimizer, sparse_updates, **client_kw) -> (address, [PSClient])``:
    a server, initialized by the first client; stopped at teardown."""
    started, clients = [], []

    def start(mode="async", workers=1, optimizer=SGD, sparse_updates="exact", shm=False, **client_kw):
        running = build_server(ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=workers, shm=shm,
                                            sparse_updates=sparse_updates, barrier_timeout=20.0)).start()
        started.append(running)
        mine = []
        for w in range(workers):
            client = PSClient(running.address, timeout=CLIENT_TIMEOUT, shm=shm, **client_kw)
            clients.append(client)
            client.register(w, workers)
            mine.append(client)
        mine[0].initialize(0, values0(), optimizer)
        return running.address, mine

    yield start
    for client in clients:
        client.close()
    for running in started:
        running.stop(grace=0.5)


def fresh_pull(address: str) -> tuple[int, dict[str, bytes]]:
    """What a client that holds nothing gets: every variable whole."""
    with PSClient(address, timeout=CLIENT_TIMEOUT) as other:
        version, values = other.pull()
    return version, {n: a.tobytes() for n, a in values.items()}


def assert_same_as_fresh(address: str, version: int, values: dict[str, np.ndarray]) -> None:
    fresh_version, fresh = fresh_pull(address)
    assert version == fresh_version
    assert {n: a.tobytes() for n, a in values.items()} == fresh


def recording(client: PSClient) -> list[pb.PullHeader]:
    """Every pull header the client receives, whatever the transport."""
    headers = []
    for transport in (client.unary, client.calls, client.streams):
        if transport is None:  # no session: its calls are unary
            continue
        original = transport.pull

        def wrapped(request, *a, _original=original, **kw):
            header, values = _original(request, *a, **kw)
            headers.append(header)
            return header, values

        transport.pull = wrapped
    return headers


@pytest.mark.parametrize("transport", ["session", "unary", "stream", "shm"])
def test_a_delta_pull_brings_only_the_changed_rows_and_keeps_the_copy_bit_equal(cluster, transport):
    kw = {"small_bytes": 0} if transport not in ("unary", "session") else {"session": transport == "session"}
    address, (client,) = cluster(shm=transport == "shm", **kw)
    headers = recording(client)
    version, values = client.pull(0)
    for step in range(4):
        g = grads(step)
        client.push(0, step, version, 8, g)
        version, values = client.pull(0)
        delta = {m.name: m for m in headers[-1].variables if m.sparse}
        assert list(delta) == ["emb"]  # the kernel (dense) comes whole, as before
        assert list(delta["emb"].rows) == sorted(set(g["emb"].rows.tolist()))
        assert list(delta["emb"].shape) == [len(set(g["emb"].rows.tolist())), DIM]
        assert not values["emb"].flags.writeable
        assert_same_as_fresh(address, version, values)
    if transport == "shm":
        assert client.shm_active


def test_the_array_a_pull_returned_is_the_clients_copy_written_in_place_by_the_next(cluster):
    _, (client,) = cluster()
    version, first = client.pull(0)
    client.push(0, 0, version, 8, grads(0))
    version, second = client.pull(0)
    client.push(0, 1, version, 8, grads(1))
    version, third = client.pull(0)
    assert third["emb"] is second["emb"]  # one copy, no table-sized copy per pull
    assert first["emb"] is not second["emb"]  # the first delta copied the received array once


@pytest.mark.parametrize("sparse_updates, optimizer", [("exact", SGD), ("lazy", ADAM)])
def test_two_sync_workers_pulling_deltas_hold_exactly_the_rounds_values(cluster, sparse_updates, optimizer):
    # The table (256 KB) above small_bytes: the sync shortcut (every value with a push's
    # reply) is for small models only, so the pushes go unary and the pulls bring deltas.
    address, clients = cluster(mode="sync", workers=2, optimizer=optimizer, sparse_updates=sparse_updates,
                               small_bytes=100_000)
    pulled = [c.pull(w) for w, c in enumerate(clients)]
    for step in range(5):
        threads = [threading.Thread(target=c.push, args=(w, step, pulled[w][0], 4 + w, grads(10 * step + w)))
                   for w, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        pulled = [c.pull(w) for w, c in enumerate(clients)]
        assert pulled[0][0] == pulled[1][0] == step + 1
        for version, values in pulled:
            assert_same_as_fresh(address, version, values)
    assert clients[0].cache.row_deltas_seen and clients[1].cache.row_deltas_seen


def test_a_sparse_push_pulls_its_changed_rows_and_a_dense_one_keeps_the_sync_shortcut(cluster):
    address, (client,) = cluster(mode="sync", workers=1)
    version, _ = client.pull(0)
    client.push(0, 0, version, 4, grads(0))
    assert not client.cache.fresh  # no values with the reply: the pull brings the changed rows
    version, values = client.pull(0)
    assert client.cache.row_deltas_seen
    assert_same_as_fresh(address, version, values)
    other = cluster(mode="sync", workers=1)[1][0]  # a server that never saw a sparse push
    version, values = other.pull(0)
    dense = {n: (np.zeros_like(values[n])) for n in values}
    other.push(0, 0, version, 4, dense)
    assert other.cache.fresh  # a small model's dense push: every value came with the reply


def test_two_async_workers_pushing_at_once_end_with_copies_equal_to_the_server(cluster):
    address, clients = cluster(mode="async", workers=2)
    errors = []

    def train(w: int, client: PSClient) -> None:
        try:
            version, _ = client.pull(w)
            for step in range(15):
                client.push(w, step, version, 4, grads(100 * w + step))
                version, _ = client.pull(w)  # deltas, while the other worker pushes
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=train, args=(w, c)) for w, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for w, client in enumerate(clients):
        version, values = client.pull(w)  # nothing pushes now: the copy must be the server's
        assert version == 30
        assert_same_as_fresh(address, version, values)


def test_a_dense_stepped_table_comes_whole(cluster):
    """Exact mode with Adam steps the table densely: no row deltas, the whole table."""
    address, (client,) = cluster(optimizer=ADAM)
    headers = recording(client)
    version, _ = client.pull(0)
    client.push(0, 0, version, 8, grads(0))
    version, values = client.pull(0)
    assert not any(m.sparse for m in headers[-1].variables)
    assert not client.cache.row_deltas_seen
    assert_same_as_fresh(address, version, values)


def test_a_pull_without_row_deltas_gets_every_changed_variable_whole(cluster):
    address, (client,) = cluster()
    version, _ = client.pull(0)
    client.push(0, 0, version, 8, grads(0))
    incarnation = client.cache.held[0]
    request = pb.PullRequest(worker_id=0, known_version=version, known_incarnation=incarnation)
    reply = client.unary.call("Pull", request)
    assert {t.name: (t.sparse, list(t.shape)) for t in reply.variables} == {
        "emb": (False, [VOCAB, DIM]), "kernel": (False, [DIM, 4])}
    request.row_deltas = True
    reply = client.unary.call("Pull", request)
    emb = next(t for t in reply.variables if t.name == "emb")
    assert emb.sparse and list(emb.rows) == sorted(set(grads(0)["emb"].rows.tolist()))
    request.known_incarnation = "another-server"  # a copy from elsewhere: whole again
    reply = client.unary.call("Pull", request)
    assert not any(t.sparse for t in reply.variables)


def test_sparse_updates_is_a_validated_server_option_with_an_environment_fallback():
    from ps_server.config import ConfigError
    assert ServerConfig.from_args([], environ={}).sparse_updates == "exact"
    assert ServerConfig.from_args([], environ={"TFPS_SPARSE_UPDATES": "lazy"}).sparse_updates == "lazy"
    assert ServerConfig.from_args(["--sparse-updates", "dense"],
                                  environ={"TFPS_SPARSE_UPDATES": "lazy"}).sparse_updates == "dense"
    with pytest.raises(ConfigError, match="--sparse-updates must be one of exact, lazy, dense, got 'rows'"):
        ServerConfig.from_args([], environ={"TFPS_SPARSE_UPDATES": "rows"})


def test_a_lazy_server_refuses_an_optimizer_that_needs_the_whole_variable_in_one_line(cluster):
    import grpc
    from worker.client import PSClientError
    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="async", num_workers=1,
                                        sparse_updates="lazy")).start()
    try:
        with PSClient(running.address, timeout=CLIENT_TIMEOUT) as client:
            client.register(0, 1)
            with pytest.raises(PSClientError) as e:
                client.initialize(0, values0(), OptimizerSpec("adam", learning_rate=0.01, clipnorm=1.0).as_dict())
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details.startswith("--sparse-updates lazy steps only the rows a push touches, but clipnorm")
        assert "\n" not in e.value.details
    finally:
        running.stop(grace=0.5)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_server_checkpoint_of_a_row_wise_table_holds_its_values_and_ends_its_snapshot(tmp_path, mode):
    # core.store "Checkpoints": the table is read through a snapshot, released once written.
    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=1, sparse_updates="lazy",
                                        checkpoint_dir=str(tmp_path), checkpoint_interval=3600,
                                        barrier_timeout=20.0)).start()
    client = PSClient(running.address, timeout=CLIENT_TIMEOUT)
    try:
        client.register(0, 1)
        client.initialize(0, values0(), ADAM)
        for step in range(3):
            version, _ = client.pull(0)
            client.push(0, step, version, 1, grads(step))
        assert "emb" in running.core.store.row_wise()
        path = running.write_checkpoint()
        assert running.core.store._vars["emb"].undo_logs == []  # nothing saved for it any more
        back = read_checkpoint(path)
        version, values = client.pull(0)
        assert back.version == version == 3
        for name in values:
            assert back.values[name].tobytes() == values[name].tobytes(), name
    finally:
        client.close()
        running.stop(grace=0.5)


def test_a_pull_with_the_optimizer_state_gives_every_slot_of_one_version_as_a_replay_of_the_pushes(cluster):
    """``PSClient.optimizer_state``: what a Keras model file written by a worker holds. Adam over
    a row-wise table (stepped row by row) and a dense kernel, after three pushes: the values,
    each slot and the step count are those of the same three steps taken here."""
    from ps_server.core.optim.registry import make_optimizer
    from ps_server.core.store import VariableStore

    address, (client,) = cluster(optimizer=ADAM, sparse_updates="lazy")
    store = VariableStore(sparse_updates="lazy")
    store.initialize(values0(), OptimizerSpec.from_dict(ADAM))
    version, _ = client.pull(0)
    for step in range(3):
        version = client.push(0, step, version, 8, grads(step)).version
        store.apply_push(store.prepare(grads(step)))
    got_version, values, states = client.optimizer_state(0)
    want = store.export_state()
    assert got_version == version == 3
    assert {n: v.tobytes() for n, v in values.items()} == {n: np.asarray(v).tobytes() for n, v in want.values.items()}
    for name, slots in want.states.items():
        assert states[name]["iterations"] == slots["iterations"]
        assert {k: np.asarray(a).tobytes() for k, a in slots.items() if k != "iterations"} == \
            {k: a.tobytes() for k, a in states[name].items() if k != "iterations"}, name
    want.release()
    assert make_optimizer(OptimizerSpec.from_dict(ADAM)).init_state(values["kernel"]).keys() == states["kernel"].keys()
    import grpc

    from protos import tfps_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError, match="by Pull, not PullStream"):
        list(pb_grpc.ParameterServerStub(channel).PullStream(pb.PullRequest(worker_id=0, optimizer_state=True)))
