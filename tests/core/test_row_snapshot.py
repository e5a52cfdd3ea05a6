"""Checkpoints of row-wise tables through snapshots (``store.RowSnapshot``): no second copy.

    python -m pytest tests/core/test_row_snapshot.py -q

The rules checked, from ``ps_server.core.store`` (module docstring, "Checkpoints"):
- a row-wise variable in a checkpoint is read in slices, each under its lock, and
  every byte written is the table's as of the snapshot, however many steps write
  its rows (in place, or whole) while the file is being written;
- a snapshot costs the rows written while it is open, once each, plus one flag
  byte per row: nothing when no row is written;
- several snapshots may be open at once, each correct;
- ``release`` (or the garbage collector) ends a snapshot; reading it then raises.
"""

import dataclasses
import io
import tracemalloc

import numpy as np
import pytest

from ps_server.core import checkpoint, store as store_module
from ps_server.core.checkpoint import decode, encode
from ps_server.core.errors import InvalidArgument
from ps_server.core.modes.base import Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.optim.sparse import SparseRows, densify
from ps_server.core.store import SnapshotArray, VariableStore
from tests.core.threads import JOIN, finish, start

ROWS, DIM = 64, 4
# (sparse_updates, optimizer): "exact" steps rows alone for Adagrad; "lazy" for Adam (two slots).
CASES = {"exact-adagrad": ("exact", OptimizerSpec("adagrad", learning_rate=0.1)),
         "lazy-adam": ("lazy", OptimizerSpec("adam", learning_rate=0.01))}


def table() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"emb": rng.standard_normal((ROWS, DIM)).astype(np.float32),
            "kernel": rng.standard_normal((DIM, 2)).astype(np.float32)}


def push_of(rng, k: int = 6, dense: bool = False) -> dict:
    g = SparseRows(rng.integers(0, ROWS, size=k).astype(np.int64), rng.standard_normal((k, DIM)).astype(np.float32))
    return {"emb": densify(g, (ROWS, DIM), np.float32) if dense else g,
            "kernel": rng.standard_normal((DIM, 2)).astype(np.float32)}


def server(mode: str, case: str, workers: int = 1) -> ParameterServer:
    sparse_updates, spec = CASES[case]
    ps = ParameterServer(mode=mode, num_workers=workers, barrier_timeout=10.0, sparse_updates=sparse_updates)
    for w in range(workers):
        ps.register(w, workers)
    ps.initialize(0, table(), spec)
    return ps


class Pushing(io.BytesIO):
    """A file that pushes once every ``every`` writes: steps land between the slices."""

    def __init__(self, push, every: int = 1):
        super().__init__()
        self.push, self.every, self.writes = push, every, 0

    def write(self, data):
        self.writes += 1
        if self.writes % self.every == 0:
            self.push()
        return super().write(data)


def snapshot_and_copy(ps: ParameterServer) -> tuple[checkpoint.ServerState, checkpoint.ServerState]:
    """(``checkpoint_state()``, the same state with the store's arrays as they are right then,
    copied straight from the store). Single-threaded callers: no step runs in between."""
    state = ps.checkpoint_state()
    copy = lambda a: np.array(a, copy=True) if isinstance(a, np.ndarray) else a  # noqa: E731
    variables = ps.store._vars
    return state, dataclasses.replace(state, values={n: copy(variables[n].value) for n in state.values},
                                      states={n: {k: copy(a) for k, a in variables[n].state.items()}
                                              for n in state.states})


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_checkpoint_written_while_pushes_write_its_rows_is_the_table_as_of_its_version(monkeypatch, mode, case):
    monkeypatch.setattr(checkpoint, "_CHUNK", 3 * DIM * 4)  # three rows a slice: many slices
    ps = server(mode, case)
    rng = np.random.default_rng(1)
    for step in range(3):
        ps.submit(Push(0, step, ps.store.version, 1, push_of(rng))).result(JOIN)
    assert "emb" in ps.store.row_wise()
    state, expected = snapshot_and_copy(ps)
    steps = iter(range(3, 10_000))

    def one_push():
        step = next(steps)
        ps.submit(Push(0, step, ps.store.version, 1, push_of(rng, dense=step % 7 == 0))).result(JOIN)

    f = Pushing(one_push)
    checkpoint.write_to(f, state)
    assert ps.store.version > state.version + 20  # pushes did land while it was written
    assert f.getvalue() == encode(expected)  # byte for byte: the file of the state at its version
    state.release()
    assert ps.store._vars["emb"].undo_logs == []


def test_a_checkpoint_written_while_threads_push_is_the_table_as_of_its_version(monkeypatch, tight_switching):
    monkeypatch.setattr(checkpoint, "_CHUNK", 2 * DIM * 4)
    ps = server("async", "lazy-adam", workers=2)
    ps.submit(Push(0, 0, 0, 1, push_of(np.random.default_rng(2)))).result(JOIN)
    at_snapshot = []
    begin = store_module.RowSnapshot.__init__

    def recording(self, var, undo):  # runs inside export_state, every lock held: the moment itself
        at_snapshot.append({k: a.copy() for k, a in undo.arrays.items()})
        begin(self, var, undo)

    monkeypatch.setattr(store_module.RowSnapshot, "__init__", recording)

    def pusher(worker: int) -> None:
        rng = np.random.default_rng(10 + worker)
        for step in range(1, 150):
            ps.submit(Push(worker, step, ps.store.version, 1, push_of(rng))).result(JOIN)

    threads = [start(lambda w=w: pusher(w)) for w in range(2)]
    written = 0
    while any(t.is_alive() for t in threads) or not written:
        state = ps.checkpoint_state()
        back = decode(encode(state))
        state.release()
        got = {"value": back.values["emb"], **{k: back.states["emb"][k] for k in ("m", "v")}}
        assert {k: a.tobytes() for k, a in got.items()} == {k: a.tobytes() for k, a in at_snapshot[-1].items()}
        assert back.values["kernel"].tobytes() == state.values["kernel"].tobytes()
        written += 1
    finish(*threads)
    for t in threads:
        assert t.error is None, repr(t.error)
    assert ps.store._vars["emb"].undo_logs == []


def test_two_snapshots_open_at_once_each_hold_their_own_version():
    ps = server("async", "lazy-adam")
    rng = np.random.default_rng(3)
    ps.submit(Push(0, 0, 0, 1, push_of(rng))).result(JOIN)
    first, first_expected = snapshot_and_copy(ps)
    for step in range(1, 4):
        ps.submit(Push(0, step, ps.store.version, 1, push_of(rng))).result(JOIN)
    second, second_expected = snapshot_and_copy(ps)
    for step in range(4, 8):
        ps.submit(Push(0, step, ps.store.version, 1, push_of(rng))).result(JOIN)
    assert len(ps.store._vars["emb"].undo_logs) == 2
    assert encode(second) == encode(second_expected)
    second.release()
    ps.submit(Push(0, 8, ps.store.version, 1, push_of(rng))).result(JOIN)  # the first one still saves
    assert encode(first) == encode(first_expected)
    first.release()
    assert ps.store._vars["emb"].undo_logs == []


def test_a_released_snapshot_refuses_to_be_read_and_an_abandoned_one_is_dropped():
    ps = server("async", "exact-adagrad")
    rng = np.random.default_rng(4)
    ps.submit(Push(0, 0, 0, 1, push_of(rng))).result(JOIN)
    state = ps.checkpoint_state()
    state.release()
    state.release()  # idempotent
    with pytest.raises(InvalidArgument, match="released"):
        encode(state)
    abandoned = ps.checkpoint_state()
    ps.submit(Push(0, 1, 1, 1, push_of(rng))).result(JOIN)
    var = ps.store._vars["emb"]
    assert len(var.undo_logs) == 1 and var.undo_logs[0].blocks
    del abandoned  # its last reference: released at once (no cycle to wait for the collector)
    ps.submit(Push(0, 2, 2, 1, push_of(rng))).result(JOIN)  # its next step lets the abandoned log go
    assert var.undo_logs == []


def test_a_live_snapshot_restores_into_a_new_store():
    ps = server("sync", "lazy-adam")
    rng = np.random.default_rng(5)
    for step in range(3):
        ps.submit(Push(0, step, ps.store.version, 1, push_of(rng))).result(JOIN)
    state, expected = snapshot_and_copy(ps)
    restored = VariableStore(sparse_updates="lazy")
    restored.restore_state(store_module.StoreState(**{f.name: getattr(state, f.name)
                                                      for f in dataclasses.fields(store_module.StoreState)}))
    state.release()
    version, values = restored.read()
    assert version == expected.version
    assert {n: a.tobytes() for n, a in values.items()} == {n: a.tobytes() for n, a in expected.values.items()}


# -- memory ---------------------------------------------------------------------------------
BIG_ROWS, BIG_DIM = 1 << 15, 64  # 8 MiB of float32 values, 24 MiB with Adam's m and v
CHUNK = 1 << 20


def big_server() -> ParameterServer:
    ps = ParameterServer(mode="async", num_workers=1, sparse_updates="lazy")
    ps.register(0, 1)
    ps.initialize(0, {"emb": np.ones((BIG_ROWS, BIG_DIM), np.float32)}, OptimizerSpec("adam", learning_rate=0.01))
    rows = np.arange(0, BIG_ROWS, 97, dtype=np.int64)
    ps.submit(Push(0, 0, 0, 1, {"emb": SparseRows(rows, np.ones((len(rows), BIG_DIM), np.float32))})).result(JOIN)
    return ps


class PushingFile:
    """A real file that pushes once before each write: steps land between the slices."""

    def __init__(self, f, push):
        self.f, self.push = f, push

    def write(self, data):
        self.push()
        return self.f.write(data)


def checkpoint_peak(ps: ParameterServer, path, during=None) -> tuple[int, checkpoint.ServerState]:
    """Peak bytes traced while a checkpoint is taken and written to ``path / "ckpt"``
    (``during`` runs before each write: between the slices)."""
    tracemalloc.start()
    try:
        state = ps.checkpoint_state()
        with open(path / "ckpt", "wb") as f:
            checkpoint.write_to(PushingFile(f, during or (lambda: None)), state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, state


def test_a_checkpoint_of_a_row_wise_table_peaks_at_a_slice_when_no_row_is_written(tmp_path, monkeypatch):
    # Issue: "Checkpoints of a multi-GiB table stream without a second full copy in memory".
    monkeypatch.setattr(checkpoint, "_CHUNK", CHUNK)
    ps = big_server()
    table_bytes = 3 * BIG_ROWS * BIG_DIM * 4
    peak, state = checkpoint_peak(ps, tmp_path)
    assert peak < CHUNK + (256 << 10), peak  # one slice read at a time, never the 24 MiB table
    assert peak < table_bytes // 4
    back = checkpoint.read_checkpoint(str(tmp_path / "ckpt"))
    assert back.values["emb"].tobytes() == np.asarray(state.values["emb"]).tobytes()
    state.release()


def test_a_checkpoint_of_a_row_wise_table_costs_the_rows_written_meanwhile_once_each(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "_CHUNK", CHUNK)
    ps = big_server()
    rng = np.random.default_rng(6)
    touched = set()
    steps = iter(range(1, 10_000))

    def one_push():  # 512 rows a push, the same ones again now and then
        rows = rng.choice(BIG_ROWS // 4, size=512, replace=False).astype(np.int64)
        touched.update(rows.tolist())
        ps.submit(Push(0, next(steps), ps.store.version, 1,
                       {"emb": SparseRows(rows, rng.standard_normal((512, BIG_DIM)).astype(np.float32))})).result(JOIN)

    peak, state = checkpoint_peak(ps, tmp_path, during=one_push)
    snapshot = state.values["emb"].snapshot
    row_bytes = BIG_DIM * 4
    # Each row touched saved once (value, m, v and its index), plus one flag byte per row.
    assert snapshot.nbytes == len(touched) * (3 * row_bytes + 8) + BIG_ROWS
    assert len(touched) * 3 * row_bytes > 4 * CHUNK  # enough rows written for the bound to mean something
    # the rows saved, a slice, and what a push and this test allocate themselves (about 2 MiB here)
    assert peak < snapshot.nbytes + 3 * CHUNK, (peak, snapshot.nbytes)
    with open(tmp_path / "ckpt", "rb") as f:
        blob = f.read()
    assert blob == encode(state)  # re-read now: the same bytes, the rows still saved
    state.release()


def test_a_whole_step_of_a_row_wise_table_ends_the_saving_and_the_snapshot_keeps_the_replaced_arrays():
    ps = server("async", "exact-adagrad")
    rng = np.random.default_rng(7)
    ps.submit(Push(0, 0, 0, 1, push_of(rng))).result(JOIN)
    state, expected = snapshot_and_copy(ps)
    var = ps.store._vars["emb"]
    ps.submit(Push(0, 1, 1, 1, push_of(rng))).result(JOIN)
    ps.submit(Push(0, 2, 2, 1, push_of(rng, dense=True))).result(JOIN)  # new arrays: nothing writes the old ones
    assert var.undo_logs == []
    ps.submit(Push(0, 3, 3, 1, push_of(rng))).result(JOIN)
    assert encode(state) == encode(expected)
    state.release()
