"""Sparse gradients on the wire (PushRequest/PushHeader tensors with ``sparse`` set),
through each transport: one unary message, the stream, shared memory.

    a push of SparseRows(rows, values) == the same push made dense, bit for bit,
    and only the rows travel.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos import tfps_pb2 as pb
from ps_server.config import ServerConfig
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.sparse import SparseRows, densify
from ps_server.server import build_server
from worker.client import PSClient, PSClientError

from tests.service.conftest import CLIENT_TIMEOUT

ADAM = OptimizerSpec("adam", learning_rate=0.01).as_dict()
VOCAB, DIM = 5000, 32  # a 640 KB table: unary when sparse, and also when dense


def values0() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"emb": rng.standard_normal((VOCAB, DIM)).astype(np.float32),
            "dense/kernel": rng.standard_normal((DIM, 4)).astype(np.float32)}


def grads(step: int) -> dict:
    rng = np.random.default_rng(step)
    rows = rng.integers(0, VOCAB, size=64)  # repeats likely: they add up
    return {"emb": SparseRows(rows.astype(np.int64), rng.standard_normal((64, DIM)).astype(np.float32)),
            "dense/kernel": rng.standard_normal((DIM, 4)).astype(np.float32)}


def dense(g: dict) -> dict:
    return {n: densify(v, (VOCAB, DIM), np.float32) if isinstance(v, SparseRows) else v for n, v in g.items()}


@pytest.fixture
def servers():
    started, clients = [], []

    def start(shm: bool = False, **client_kw) -> PSClient:
        running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="async", num_workers=1, shm=shm)).start()
        client = PSClient(running.address, timeout=CLIENT_TIMEOUT, shm=shm, **client_kw)
        started.append(running)
        clients.append(client)
        client.register(0, 1)
        client.initialize(0, values0(), ADAM)
        return client

    yield start
    for running in started:
        running.stop(grace=0.5)
    for client in clients:
        client.close()


def _train(client: PSClient, make_dense: bool) -> dict[str, np.ndarray]:
    for step in range(3):
        version, _ = client.pull(0)
        g = grads(step)
        client.push(0, step, version, 16, dense(g) if make_dense else g)
    return {n: np.array(a) for n, a in client.pull(0)[1].items()}


@pytest.mark.parametrize("transport", ["unary", "stream", "shm"])
def test_a_sparse_push_applies_bit_for_bit_what_the_same_push_made_dense_applies(servers, transport):
    kw = {"small_bytes": 0} if transport != "unary" else {}
    sparse = _train(servers(shm=transport == "shm", **kw), make_dense=False)
    reference = _train(servers(), make_dense=True)
    for name in reference:
        np.testing.assert_array_equal(sparse[name], reference[name])


def test_only_the_rows_travel(servers, monkeypatch):
    client = servers()
    sizes: list[int] = []
    for transport in (client.unary, client.calls):  # one message: on the session, or unary
        def measuring(name, request, *a, _original=transport.call, **kw):
            if name == "Push":
                sizes.append(request.ByteSize())
            return _original(name, request, *a, **kw)

        monkeypatch.setattr(transport, "call", measuring)
    g = grads(0)
    client.push(0, 0, 0, 16, g)
    client.push(0, 1, 1, 16, dense(g))
    sparse_bytes, dense_bytes = sizes
    # 64 rows of 32 float32 + 64 row numbers + the kernel, against the whole 5000-row table
    assert sparse_bytes < 64 * DIM * 4 + 64 * 10 + DIM * 4 * 4 + 200
    assert dense_bytes > VOCAB * DIM * 4
    assert dense_bytes / sparse_bytes > 50


@pytest.mark.parametrize("rows, message", [([VOCAB], f"names row {VOCAB}"), ([-3], "names row -3")])
def test_a_sparse_push_naming_rows_the_table_lacks_is_refused_and_changes_nothing(servers, rows, message):
    client = servers()
    before = {n: np.array(a) for n, a in client.pull(0)[1].items()}
    bad = {"emb": SparseRows(np.array(rows, np.int64), np.ones((1, DIM), np.float32)),
           "dense/kernel": np.zeros((DIM, 4), np.float32)}
    with pytest.raises(PSClientError) as e:
        client.push(0, 0, 0, 1, bad)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details
    version, after = client.pull(0)
    assert version == 0
    for n in before:
        np.testing.assert_array_equal(before[n], after[n])


def test_rows_on_a_tensor_not_marked_sparse_are_refused(servers):
    client = servers()
    request = pb.PushRequest(worker_id=0, step=0, base_version=0, batch_size=1, gradients=[
        pb.Tensor(name="emb", dtype=pb.FLOAT32, shape=[1, DIM], data=np.ones(DIM, np.float32).tobytes(), rows=[0]),
        pb.Tensor(name="dense/kernel", dtype=pb.FLOAT32, shape=[DIM, 4], data=np.zeros(DIM * 4, np.float32).tobytes()),
    ])
    with pytest.raises(PSClientError) as e:
        client.unary.call("Push", request)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "sparse is not set" in e.value.details
