"""Checkpoint files: the whole state of a parameter server, written atomically.

    state = core.checkpoint_state()
    path = write_checkpoint("/ckpt", state, keep=3)
    state.release()                        # ends the row-wise tables' snapshots (core.store)
    found = latest_valid("/ckpt")          # (ServerState, path) or None
    if found:
        core.restore(found[0])
    lazy = read_checkpoint(path, lazy=True)   # arrays read from the file when asked (ps-export)

One file per checkpoint, named ``ckpt-<version:012d>.tfps``. Layout (all
integers little-endian)::

    offset 0   magic          8 bytes  b"TFPSCKPT"
           8   format         u32      1
          12   flags          u32      0 (reserved)
          16   header_len     u64      bytes of the JSON header
          24   data_len       u64      bytes of array data
          32   header         JSON, UTF-8, padded with spaces so data starts at a multiple of 64
               data           raw little-endian arrays, at offsets the header gives (from data start)
       end-32  sha256         32 bytes over everything before it

The header describes everything else: ``mode``, ``num_workers``, ``version``,
``round``, ``optimizer`` (the ``OptimizerSpec`` fields, the learning rate as
``set_learning_rates`` last set it; a file written before the Keras fields holds
only sgd's and adam's, and reads with Keras' defaults for the rest),
``initial_optimizer`` (the spec the variables were initialized with, when a
learning rate of it, a group's too, was changed since; absent or null otherwise: a
file from before it may hold ``initial_learning_rate``, that spec's one rate), ``variables`` (for each: ``name``,
``dtype`` such as ``"<f4"``, ``shape``, ``iterations`` (the optimizer steps it
had: with a schedule, where it carries on), the offset of its ``value`` and of
each optimizer slot in ``slots``, and in ``slot_shapes`` the shape of a slot
that is not the variable's, such as a 0-d one), ``members``
(the membership records), ``mode_status`` (the round, counters, and elastic sync's
``skipped_rounds``: absent in a file from before them, none) and ``stats`` (counters),
``incarnation`` of the server that wrote it and ``wall_time`` (Unix seconds),
and ``data``: the data plan and how far the job got through it (``DataState``),
null or absent without one (a file written before it reads as "no plan"). Its
arrays lie in the data section too, after the variables', each as ``{"dtype",
"shape", "at"}``: for tasks (async and ssp) the done task ids, their workers and
versions (int64); for elastic sync one packed bitmap (uint8) per epoch in
progress, complete epochs only listed. The format stays 1: the field is
optional, and a tfps from before it reads such a file as one without a plan.
``clip_group`` (optional too): the shards a sharded ``global_clipnorm`` takes its
norm over (``core.clip_group``), so a restarted shard clips as before. ``shard_group``
(optional): its place among shards that follow shard 0 (``modes.base.ShardGroup``), so
a restarted shard follows shard 0, or commits on the others, as before.
Not saved, on purpose: pushes waiting in an unfinished sync round (workers
push that round again), the answers kept for replaying lost replies (a retry
from before the restart is judged against the restored round, or with tasks
against the done task's record), leases and held tasks (they start again at
restore).

Guarantees:
- a reader never sees a half-written file: the file is written under a
  temporary name in the same directory, flushed and fsynced, renamed over its
  final name (``os.replace``, atomic on POSIX) and the directory is fsynced;
  a failed write removes its temporary file and leaves older checkpoints alone;
- a damaged file is never restored: the size must match the header's lengths
  and the SHA-256 must match; ``latest_valid`` skips a damaged file with a
  warning naming it and the reason, and falls back to the next newest;
- a round trip is bit-exact: values and slots keep dtype, shape and every bit
  (NaN payloads and signed zeros included);
- no second copy of the state in memory: a file is written and verified in
  slices of 64 MiB; an array the state holds as an ``ArraySource`` (a live
  store's row-wise table, ``store.SnapshotArray``) is read one slice of rows at
  a time; ``read_checkpoint`` reads each array straight into its own, or with
  ``lazy`` not until asked.

Plain Python and NumPy, like the rest of the core.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import struct
import tempfile
import threading
import time
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ps_common.defaults import CHECKPOINT_KEEP
from ps_server.core.errors import PSError
from ps_server.core.membership import WorkerRecord
from ps_server.core.modes.base import ModeStatus, ShardGroup
from ps_server.core.clip_group import ClipGroup
from ps_server.core.optim.optimizers import OptimizerSpec

log = logging.getLogger("ps_server.checkpoint")

MAGIC = b"TFPSCKPT"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sIIQQ")  # magic, format, flags, header_len, data_len
_DIGEST_BYTES = 32
_ALIGN = 64
_NAME = re.compile(r"^ckpt-(\d{12,})\.tfps$")
_TEMP_PREFIX = ".ckpt-"
_TEMP_SUFFIX = ".tmp"


class CheckpointError(PSError):
    """A checkpoint file is unreadable, damaged, or not a checkpoint at all."""


def _no_ids() -> np.ndarray:
    return np.zeros(0, np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class DataState:
    """A data plan and how far the job got through it (``ServerState.data``).

    ``kind`` "tasks" (async and ssp, ``core.data.tasks``): ``epochs`` is the job's, and the
    done tasks are ``done_task_ids`` with the worker whose push did each and the version
    it was applied at (``TaskQueue.state``); tasks not done, held ones included, are
    handed out again after a restore. "elastic" (elastic sync, ``core.data.cursor``): the
    cursor's ``micro_batches``; ``epochs_complete`` are the epochs whose every example
    a completed round trained on, and ``epochs_seen[e]`` the examples epoch ``e`` in
    progress has trained on, one bit per example in index order (``np.packbits``).
    """

    kind: str
    num_examples: int
    global_batch_size: int
    seed: int
    epochs: int = 0
    micro_batches: int = 0
    tasks: int = 0  # "tasks": the job's, where they do not fill its last pass (``TaskQueue``)
    done_task_ids: np.ndarray = dataclasses.field(default_factory=_no_ids)
    done_workers: np.ndarray = dataclasses.field(default_factory=_no_ids)
    done_versions: np.ndarray = dataclasses.field(default_factory=_no_ids)
    epochs_complete: tuple[int, ...] = ()
    epochs_seen: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    applies: int = 1  # the rounds ("elastic", ``Cursor.applies``) or tasks (``TaskQueue.applies``) each batch is

    KINDS = ("tasks", "elastic")

    def describe(self) -> str:
        """One line: the plan, for messages."""
        what = (f"{self.epochs} epoch(s) of tasks" if self.kind == "tasks"
                else f"elastic, {self.micro_batches} micro-batches")
        if self.applies > 1:
            what += f", {self.applies} {'tasks' if self.kind == 'tasks' else 'rounds'} a batch"
        return (f"{self.num_examples} examples, batches of {self.global_batch_size}, seed {self.seed}, {what}")


_TASK_ARRAYS = ("done_task_ids", "done_workers", "done_versions")


@dataclasses.dataclass(frozen=True)
class ServerState:
    """Everything a parameter server needs to carry on after a restart.

    ``states[name]`` is variable ``name``'s optimizer state: its slot arrays and
    ``iterations`` (the store's format). ``mode_status`` carries the sync round
    and the counters of timed-out and aborted rounds; ``stats`` the counters of
    ``modes.Stats.export``.
    """

    mode: str
    num_workers: int
    version: int
    optimizer: OptimizerSpec
    values: dict[str, np.ndarray]
    states: dict[str, dict]
    non_trainable: frozenset[str] = frozenset()  # updated by pushed changes, not the optimizer
    initial_optimizer: OptimizerSpec | None = None  # the store's (StoreState), when set_learning_rates changed it
    mode_status: ModeStatus = ModeStatus()
    members: tuple[WorkerRecord, ...] = ()
    stats: dict = dataclasses.field(default_factory=dict)
    incarnation: str = ""
    wall_time: float = 0.0
    data: DataState | None = None  # the data plan and its progress; None: no plan (or an older file)
    clip_group: ClipGroup | None = None  # global_clipnorm over several shards (core.clip_group)
    shard_group: ShardGroup | None = None  # shards that follow shard 0 (core.modes.base)

    @property
    def round(self) -> int:
        return self.mode_status.round

    def release(self) -> None:
        """Release every ``ArraySource`` it holds that can be (a live store's row-wise
        snapshot, ``store.RowSnapshot``): once the file is written, or abandoned."""
        for name, value in self.values.items():
            for a in (value, *self.states.get(name, {}).values()):
                if isinstance(a, ArraySource) and hasattr(a, "release"):
                    a.release()


@runtime_checkable
class ArraySource(Protocol):
    """An array written slice by slice rather than held: ``ServerState`` may hold one in
    place of any array of at least one dimension (a live store's row-wise table,
    ``store.SnapshotArray``). ``read(start, stop)`` returns rows ``start:stop`` (along the
    first axis) as an array of ``dtype``; ``write_to`` reads each row range once, in order."""

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    size: int

    def read(self, start: int, stop: int) -> np.ndarray: ...


def checkpoint_name(version: int) -> str:
    return f"ckpt-{version:012d}.tfps"


# -- encoding ----------------------------------------------------------------------
def _little(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))


_CHUNK = 64 << 20  # bytes written or hashed at a time: a checkpoint never holds a second copy of the state


def _array(a) -> "np.ndarray | ArraySource":
    source = isinstance(a, ArraySource) and not isinstance(a, np.ndarray) and len(a.shape) > 0
    return a if source else np.asarray(a)


def _write_array(array: "np.ndarray | ArraySource", out) -> None:
    """Hand ``array``'s bytes, little-endian, in order, to ``out`` in slices of about ``_CHUNK``
    bytes; each slice an ``ArraySource`` reads is let go before the next is read."""
    if isinstance(array, np.ndarray):
        flat = array.reshape(-1)
        step = max(1, _CHUNK // max(1, flat.dtype.itemsize))
        for start in range(0, flat.size, step):
            out(memoryview(_little(flat[start:start + step])).cast("B"))
        return
    rows = array.shape[0]
    step = max(1, _CHUNK // max(1, array.nbytes // rows)) if rows else 1
    for start in range(0, rows, step):
        out(memoryview(_little(array.read(start, min(rows, start + step))).reshape(-1)).cast("B"))


def _layout(state: ServerState) -> tuple[dict, list[tuple[int, np.ndarray]], int]:
    """(header, [(offset, array)], data bytes) of ``state``: where each array goes, without
    copying any (see the module docstring for the layout)."""
    arrays: list[tuple[int, np.ndarray]] = []
    offset = 0

    def put(array: np.ndarray) -> int:
        nonlocal offset
        at = offset
        arrays.append((at, array))
        offset += array.nbytes
        return at

    if set(state.states) != set(state.values):
        raise CheckpointError("the state has optimizer state for other variables than its values")
    variables = []
    for name, value in state.values.items():
        value = _array(value)
        opt_state = state.states[name]
        slots = {}
        for slot in sorted(k for k in opt_state if k != "iterations"):
            array = _array(opt_state[slot])
            if array.shape not in (value.shape, ()) \
                    or array.dtype.newbyteorder("=") != value.dtype.newbyteorder("="):
                raise CheckpointError(f"slot {slot!r} of {name!r} is {array.dtype}{list(array.shape)}, "
                                      f"the variable is {value.dtype}{list(value.shape)}")
            slots[slot] = array
        record = {}
        shapes = {slot: list(array.shape) for slot, array in slots.items() if array.shape != value.shape}
        if shapes:
            record["slot_shapes"] = shapes
        variables.append({
            "name": name,
            "dtype": value.dtype.newbyteorder("<").str,
            "shape": list(value.shape),
            "iterations": int(opt_state.get("iterations", 0)),
            "value": put(value),
            "slots": {slot: put(array) for slot, array in slots.items()},
            "non_trainable": name in state.non_trainable,
            **record,
        })
    header = {
        "format": FORMAT_VERSION,
        "mode": state.mode,
        "num_workers": state.num_workers,
        "version": state.version,
        "round": state.mode_status.round,
        "mode_status": {"round": state.mode_status.round,
                        "rounds_timed_out": state.mode_status.rounds_timed_out,
                        "rounds_aborted": state.mode_status.rounds_aborted,
                        "skipped_rounds": list(state.mode_status.skipped_rounds)},
        "optimizer": state.optimizer.as_dict(),
        "initial_optimizer": None if state.initial_optimizer is None else state.initial_optimizer.as_dict(),
        "variables": variables,
        "members": [dataclasses.asdict(r) for r in state.members],
        "stats": state.stats,
        "incarnation": state.incarnation,
        "wall_time": state.wall_time,
        "data": None if state.data is None else _data_header(state.data, put),
        "clip_group": None if state.clip_group is None else state.clip_group.as_dict(),
        **({"shard_group": state.shard_group.as_dict()} if state.shard_group is not None else {}),
    }
    return header, arrays, offset


def _data_header(data: DataState, put) -> dict:
    """The header's ``data``: the plan's ints, and each of its arrays placed by ``put``."""
    if data.kind not in DataState.KINDS:
        raise CheckpointError(f"data plan kind {data.kind!r}: not one of {DataState.KINDS}")

    def ref(a: np.ndarray, dtype) -> dict:
        a = np.ascontiguousarray(np.asarray(a, dtype).reshape(-1))
        return {"dtype": a.dtype.newbyteorder("<").str, "shape": list(a.shape), "at": put(a)}

    return {
        "kind": data.kind,
        "num_examples": int(data.num_examples),
        "global_batch_size": int(data.global_batch_size),
        "seed": int(data.seed),
        "epochs": int(data.epochs),
        "micro_batches": int(data.micro_batches),
        "applies": int(data.applies),
        "tasks": int(data.tasks),
        **{k: ref(getattr(data, k), np.int64) for k in _TASK_ARRAYS},
        "epochs_complete": [int(e) for e in data.epochs_complete],
        "epochs_seen": {str(int(e)): ref(bits, np.uint8) for e, bits in sorted(data.epochs_seen.items())},
    }


def write_to(f, state: ServerState) -> None:
    """Write the file to ``f`` (binary, sequential), array by array in slices of ``_CHUNK``
    bytes, hashing as it goes: memory beyond the state is one slice (a little-endian,
    contiguous array is written from its own memory; an ``ArraySource`` is read one slice
    of rows at a time)."""
    header, arrays, data_len = _layout(state)
    text = json.dumps(header, sort_keys=True, allow_nan=False).encode("utf-8")
    text += b" " * (-(_PREFIX.size + len(text)) % _ALIGN)
    digest = hashlib.sha256()

    def out(data) -> None:
        digest.update(data)
        f.write(data)

    out(_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(text), data_len))
    out(text)
    for _, array in arrays:
        _write_array(array, out)
    f.write(digest.digest())


def encode(state: ServerState) -> bytes:
    """The whole file as bytes (``write_to`` into memory; the files are written streaming)."""
    buffer = io.BytesIO()
    write_to(buffer, state)
    return buffer.getvalue()


def decode(blob: bytes, what: str = "checkpoint") -> ServerState:
    """Parse and verify a whole file; CheckpointError says what is wrong with it."""
    return _read(io.BytesIO(blob), len(blob), what)


class FileArray:
    """An array of a checkpoint file read only when asked (``read_checkpoint(..., lazy=True)``):
    an ``ArraySource`` (``read(start, stop)``: those rows, a fresh native array) that
    ``np.asarray`` reads whole. It keeps the file open (the one it was verified in, even
    if that name is replaced or pruned since) until no array of it is left."""

    def __init__(self, f, lock: threading.Lock, at: int, dtype: np.dtype, shape: tuple[int, ...], what: str):
        self._f, self._lock, self._at, self._what, self._file_dtype = f, lock, at, what, dtype
        self.dtype, self.shape = dtype.newbyteorder("="), shape
        self.ndim, self.size = len(shape), int(np.prod(shape, dtype=np.int64))
        self.nbytes = self.size * dtype.itemsize

    def _elements(self, first: int, count: int) -> np.ndarray:
        a = np.empty(count, self._file_dtype)
        with self._lock:  # one file position for every array of the file
            self._f.seek(self._at + first * a.itemsize)
            if self._f.readinto(memoryview(a).cast("B")) != a.nbytes:
                raise CheckpointError(f"{self._what}: an array ends early (the file changed since it was verified?)")
        return a if a.dtype == self.dtype else a.astype(self.dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        row = self.size // self.shape[0] if self.shape[0] else 0
        return self._elements(start * row, (stop - start) * row).reshape((stop - start, *self.shape[1:]))

    def __array__(self, dtype=None, copy=None):
        whole = self._elements(0, self.size).reshape(self.shape)
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"FileArray({self._what!r}, {self.dtype}{list(self.shape)})"


def _read(f, size: int, what: str, lazy: bool = False) -> ServerState:
    """Verify a file of ``size`` bytes read from ``f`` (the SHA-256 in one sequential pass of
    ``_CHUNK`` slices), then read each array straight into its own native array: memory
    beyond the state is one slice. ``lazy``: each array a ``FileArray`` instead, read from
    ``f`` (left open) when asked."""
    header_len, data_len = _verify(f, size, what)
    data_start = _PREFIX.size + header_len
    lock = threading.Lock()
    try:
        f.seek(_PREFIX.size)
        header = json.loads(f.read(header_len).decode("utf-8"))
        values, states = {}, {}
        for v in header["variables"]:
            dtype, shape = np.dtype(v["dtype"]), tuple(int(d) for d in v["shape"])
            if dtype.kind != "f":
                raise ValueError(f"variable {v['name']!r} has dtype {dtype}")

            def array(at: int, shape=shape) -> np.ndarray:
                count = int(np.prod(shape, dtype=np.int64))
                if not 0 <= at <= data_len - count * dtype.itemsize:
                    raise ValueError(f"array of {v['name']!r} lies outside the data")
                if lazy:
                    return FileArray(f, lock, data_start + at, dtype, shape, what)
                a = np.empty(count, dtype)
                f.seek(data_start + at)
                if f.readinto(memoryview(a).cast("B")) != a.nbytes:
                    raise ValueError(f"array of {v['name']!r} ends early")
                if a.dtype != dtype.newbyteorder("="):
                    a = a.astype(dtype.newbyteorder("="))
                return a.reshape(shape)  # native and writable

            slot_shapes = v.get("slot_shapes", {})
            values[v["name"]] = array(v["value"])
            states[v["name"]] = {**{slot: array(at, tuple(int(d) for d in slot_shapes.get(slot, shape)))
                                    for slot, at in v["slots"].items()},
                                 "iterations": int(v["iterations"])}
        status = header["mode_status"]
        data = _data_of(header.get("data"), f, data_start, data_len)
        return ServerState(
            mode=header["mode"],
            num_workers=int(header["num_workers"]),
            version=int(header["version"]),
            optimizer=OptimizerSpec.from_dict(header["optimizer"]),
            values=values,
            states=states,
            non_trainable=frozenset(v["name"] for v in header["variables"] if v.get("non_trainable", False)),
            initial_optimizer=_initial_optimizer(header),
            mode_status=ModeStatus(round=int(status["round"]), rounds_timed_out=int(status["rounds_timed_out"]),
                                   rounds_aborted=int(status["rounds_aborted"]),
                                   skipped_rounds=tuple(int(r) for r in status.get("skipped_rounds", ()))),
            members=tuple(WorkerRecord(**r) for r in header["members"]),
            stats=dict(header["stats"]),
            incarnation=str(header["incarnation"]),
            wall_time=float(header["wall_time"]),
            data=data,
            clip_group=ClipGroup.from_dict(header["clip_group"]) if header.get("clip_group") else None,
            shard_group=ShardGroup.from_dict(header["shard_group"]) if header.get("shard_group") else None,
        )
    except (ValueError, KeyError, TypeError, PSError) as e:  # checksum fine, contents not ours
        raise CheckpointError(f"{what}: malformed header ({type(e).__name__}: {e})") from None


def _verify(f, size: int, what: str) -> tuple[int, int]:
    """Check the prefix and the SHA-256 of a file of ``size`` bytes read from ``f`` in one
    sequential pass of ``_CHUNK`` slices; its header's and data's lengths."""
    prefix = f.read(_PREFIX.size)
    if len(prefix) < len(MAGIC) or prefix[: len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{what}: not a tfps checkpoint (bad magic)")
    if size < _PREFIX.size + _DIGEST_BYTES:
        raise CheckpointError(f"{what}: truncated ({size} bytes, not even a header)")
    _, fmt, _flags, header_len, data_len = _PREFIX.unpack(prefix)
    if fmt != FORMAT_VERSION:
        raise CheckpointError(f"{what}: format version {fmt}, this tfps reads version {FORMAT_VERSION}")
    expected = _PREFIX.size + header_len + data_len + _DIGEST_BYTES
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise CheckpointError(f"{what}: {kind} ({size} bytes, its header says {expected})")
    digest, left = hashlib.sha256(prefix), size - _PREFIX.size - _DIGEST_BYTES
    buffer = memoryview(bytearray(min(_CHUNK, left)))  # one slice, read into again and again
    while left:
        n = f.readinto(buffer[:min(_CHUNK, left)])
        if not n:
            raise CheckpointError(f"{what}: truncated while reading")
        digest.update(buffer[:n])
        left -= n
    del buffer
    if digest.digest() != f.read(_DIGEST_BYTES):
        raise CheckpointError(f"{what}: checksum mismatch (SHA-256 of the contents differs from the one stored)")
    return header_len, data_len


def _data_of(header: dict | None, f, data_start: int, data_len: int) -> DataState | None:
    """The header's ``data`` with its arrays, read at once (even ``lazy``: they are small,
    a few integers per task, one bit per example); None when absent (an older file)."""
    if header is None:
        return None
    if header["kind"] not in DataState.KINDS:
        raise ValueError(f"data plan kind {header['kind']!r}")

    def read(ref: dict, kind: str) -> np.ndarray:
        dtype, shape = np.dtype(ref["dtype"]), tuple(int(d) for d in ref["shape"])
        if dtype.kind != kind or len(shape) != 1:
            raise ValueError(f"a data plan array is {dtype}{list(shape)}")
        at = int(ref["at"])
        if not 0 <= at <= data_len - shape[0] * dtype.itemsize:
            raise ValueError("a data plan array lies outside the data")
        a = np.empty(shape, dtype)
        f.seek(data_start + at)
        if f.readinto(memoryview(a).cast("B")) != a.nbytes:
            raise ValueError("a data plan array ends early")
        return a.astype(dtype.newbyteorder("="), copy=False)

    return DataState(
        kind=header["kind"], num_examples=int(header["num_examples"]),
        global_batch_size=int(header["global_batch_size"]), seed=int(header["seed"]),
        epochs=int(header["epochs"]), micro_batches=int(header["micro_batches"]), tasks=int(header.get("tasks", 0)),
        applies=int(header.get("applies", 1)),
        **{k: read(header[k], "i").astype(np.int64) for k in _TASK_ARRAYS},
        epochs_complete=tuple(int(e) for e in header["epochs_complete"]),
        epochs_seen={int(e): read(ref, "u") for e, ref in header["epochs_seen"].items()},
    )


def _initial_optimizer(header: dict) -> OptimizerSpec | None:
    """The header's ``initial_optimizer``; in a file from before it, its ``optimizer`` with the
    ``initial_learning_rate`` it may hold (one rate: no group's was set then)."""
    if header.get("initial_optimizer") is not None:
        return OptimizerSpec.from_dict(header["initial_optimizer"])
    rate = header.get("initial_learning_rate")
    return None if rate is None else dataclasses.replace(OptimizerSpec.from_dict(header["optimizer"]),
                                                        learning_rate=float(rate))


# -- files -------------------------------------------------------------------------
def read_checkpoint(path: str, lazy: bool = False) -> ServerState:
    """One file, verified; raises CheckpointError (or OSError if it cannot be read).

    ``lazy``: each of its arrays is a ``FileArray``, read from the file (kept open until they
    are all gone) when asked: a caller that reads them one at a time (``ps-export``) holds
    one array at a time, never the whole state."""
    f = open(path, "rb")
    try:
        state = _read(f, os.fstat(f.fileno()).st_size, what=path, lazy=lazy)
    except BaseException:
        f.close()
        raise
    if not lazy:
        f.close()
    return state


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoint files in ``directory``, newest version first (temporary files excluded)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), n) for n in names if (m := _NAME.match(n))]
    return [os.path.join(directory, n) for _, n in sorted(found, reverse=True)]


def latest_valid(directory: str, lazy: bool = False) -> tuple[ServerState, str] | None:
    """The newest checkpoint in ``directory`` that verifies, with its path; None if there is none.

    Each damaged or unreadable newer file is skipped with a warning that names
    it and says why.
    """
    for path in list_checkpoints(directory):
        try:
            return read_checkpoint(path, lazy=lazy), path
        except CheckpointError as e:
            log.warning("skipping checkpoint %s", e)
        except OSError as e:
            log.warning("skipping checkpoint %s: cannot read it (%s)", path, e)
    return None


def write_checkpoint(directory: str, state: ServerState, keep: int = CHECKPOINT_KEEP) -> str:
    """Write ``state`` atomically as ``directory/ckpt-<version>.tfps``; keep the ``keep`` newest.

    Returns the path. A file of the same version is replaced (atomically).
    Pruning keeps the files written most recently (by modification time, then
    version), so a damaged file left by an earlier run does not outlive the
    checkpoints written after it.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, checkpoint_name(state.version))
    fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=_TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write_to(f, state)  # streamed: no second copy of the state in memory
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)
    _prune(directory, keep)
    return path


def remove_temporary_files(directory: str) -> list[str]:
    """Delete temporary files left by a write that was interrupted (a crash); returns them.

    Only for a directory no other process is writing to.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        if name.startswith(_TEMP_PREFIX) and name.endswith(_TEMP_SUFFIX):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _prune(directory: str, keep: int) -> None:
    def written(path: str) -> tuple[float, str]:
        try:
            return os.stat(path).st_mtime_ns, path
        except FileNotFoundError:
            return -1, path

    for path in sorted(list_checkpoints(directory), key=written, reverse=True)[keep:]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _fsync_dir(directory: str) -> None:
    """Make the rename durable: fsync the directory entry (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def describe(state: ServerState, path: str = "") -> dict[str, Any]:
    """A short summary for logs and tools."""
    return {
        "path": path,
        "mode": state.mode,
        "num_workers": state.num_workers,
        "version": state.version,
        "round": state.round,
        "variables": len(state.values),
        "parameters": int(sum(v.size for v in state.values.values())),
        "workers_known": len(state.members),
        "optimizer": state.optimizer.name,
        "written": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.wall_time)) if state.wall_time else "",
        "incarnation": state.incarnation,
        "data_plan": state.data.describe() if state.data is not None else "",
    }
