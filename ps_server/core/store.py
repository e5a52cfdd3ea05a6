"""The variable store: named arrays, their optimizer state, and the version.

    store = VariableStore()
    store.initialize({"w": np.zeros(3, np.float32)}, OptimizerSpec("sgd", 0.1))
    version, values = store.read()               # consistent snapshot
    version, changed = store.read(since=version) # only what changed after it
    store.apply_all({"w": g})                    # sync: one step on every variable
    store.apply_push({"w": g})                   # async: variable by variable, each under its own lock
    store.apply_one("w", g)                      # async: one variable, its own lock
    store.apply_push({"emb": SparseRows(rows, g)})    # a sparse gradient: only its rows, where exact
    version, values, rows = store.read_rows(since=version)  # row-wise tables: only their changed rows
    store.set_learning_rates([0.05])             # the chief's LearningRateScheduler / ReduceLROnPlateau
    store.current_learning_rate(names), store.optimizer_iterations()  # names: a push's (its group's rate)

One update is one Keras ``optimizer.apply``: ``global_clipnorm`` takes its norm over
the gradients of all trainable variables of the update, once (``apply_all``: the
round's mean gradients; ``apply_push``: one push) and hands the factor to each
variable's step. ``optimizer_iterations`` is Keras' ``optimizer.iterations``, the
count a learning-rate schedule is evaluated at; it is kept per variable (each
variable's optimizer state) and so survives a checkpoint, as does a learning rate
changed by ``set_learning_rates`` (it is in the optimizer spec: with ``groups``, each
group's own).

Values are copy-on-write: an optimizer step builds a new array and swaps the
reference, so an array handed to a reader is never modified afterwards (arrays
are marked read-only to enforce it). That is what lets pulls serialize outside
any lock.

Row-wise variables (embedding tables). A variable becomes row-wise the first time
a sparse gradient (``SparseRows``) arrives for it that ``core.optim.sparse.row_wise``
says may be stepped on its rows alone (``VariableStore(sparse_updates=...)``,
``--sparse-updates``). From then on it is *not* copy-on-write: a step gathers the
touched rows and their slots, computes (``Optimizer.apply_rows``) and writes them
back in place, under the variable's ``lock``, so a step costs in proportion to the
rows it touches, not the table. Each row-wise variable keeps ``rows_changed``, an
int64 per row: the version by which that row was last written (as ``changed`` is
for a whole variable), plus a short log of the rows each recent step wrote, so that
``read_rows(since=v)`` finds the rows changed after ``v`` in time proportional to
them (and scans ``rows_changed`` when ``v`` is older than the log). A pull copies
what it needs of a row-wise variable while holding the variable's lock; no reference
to its arrays ever leaves the store. A checkpoint does not copy it: it reads it
through a snapshot (below, "Checkpoints"). Dense variables stay copy-on-write,
zero-copy to read, as described above. A dense gradient for a row-wise variable
steps it whole (all its rows marked).

Consistency of reads (``read``, ``read_rows``, ``export_state``). A reader takes the
locks of the row-wise variables it reads (in name order), then ``_publish`` for the
version and the dense references, and copies the row-wise rows (``export_state``:
begins their snapshots) before letting go.
A sync round (``apply_all``) holds the locks of the row-wise variables it writes
from before its first write until after it has published the new version, and
computes every step before writing any (so a refused step writes nothing). So:

- sync: a read sees one version exactly, every variable, dense or row-wise, as
  that round left it; ``read_rows(since=v)`` returns, for each row-wise variable,
  exactly the rows some round after ``v`` wrote (a round writes only the rows its
  pushes touched), and for a dense one the whole value when it changed after ``v``.
- async: as for dense variables, each variable is whole (its rows and slots from
  one push's step, never half a step), the version read is a lower bound, and a
  read holds every push its version counts. Rows are marked with the version being
  built (the current version + 1) when written, and the version is read before the
  rows are copied, so a row written after a read returned version ``v`` is marked
  above ``v``: ``read_rows(since=v)`` never misses a change, and may send a row
  again that the reader already had. A client that scatters the rows it gets into
  its copy therefore holds the server's values exactly, as of its pull.

Non-trainable variables (``initialize(..., non_trainable=[...])``: a BatchNorm
layer's moving mean and variance) are stored, pulled and checkpointed like the
others, but the optimizer never touches them: a push carries the change the
worker's forward pass made to each (its new value minus the one it pulled), and
applying adds that change. In sync mode the round's change is the batch-weighted
mean of the workers' changes, so the stored moving mean becomes the mean of the
workers' updated ones: for the moving mean, exactly what one process would
compute on the global batch. In async mode each push adds its own change.

A variable two optimizer groups step (``OptimizerSpec.shared``: a ``train_step`` that
applies two optimizers to one variable) is stored once more under its second name
(``ps_common.names.shared_name``), with the later group's own optimizer state. Both
names hold one value: every write of either is spread to the other under ``_publish``
(``_spread``), and they share one ``lock``, so an async step of one reads the other's
last. A push of the later group's gradients names the second; reads give the
variables alone (a pull names the second only if it asks for it by name); a checkpoint
holds both, with both states. Such a variable is never row-wise.

Arrays may arrive in either byte order (the codec decodes little-endian wire
data, which is not native on a big-endian host); the store keeps native ones
and converts gradients before the optimizer sees them, so a check that
accepts a gradient is never contradicted by the optimizer after some
variables were already updated.

Locks, in the order they may be taken: a variable's ``lock`` (held for its
read-modify-write; several row-wise variables' locks in name order), then ``_publish`` (held only to swap references and read or
bump the version). No lock here is held across network I/O.

Checkpoints: ``export_state`` takes a zero-copy snapshot under ``_publish``. A dense
variable is its arrays (copy-on-write: they never change). A row-wise variable is a
``RowSnapshot`` begun under its lock, in the same critical section a pull would copy
it in, so it is exactly the table a pull then would have copied: from then on, a step
about to write rows in place (``_write_rows``, the only in-place write of a row-wise
table) first saves, in the snapshot's undo log, the original contents of those rows
(value and every slot shaped like it) that it has not saved yet. The checkpoint
reads the table in slices of rows (``core.checkpoint`` writes 64 MiB at a time),
each under the variable's lock, held for that slice only, and patches in the saved
rows of the slice: every byte is the table's as of the snapshot. A whole step (a
dense gradient) replaces the table's arrays rather than writing them; the snapshot
keeps the old ones, which nothing writes any more, and stops saving. So a snapshot
costs the rows written while it is open, once each (whatever the number of steps
that touch them), plus one flag byte per row once any is: nothing when no row is
written, and at most one copy of the table when every row is (today's cost of a
copy). Several snapshots may be open at once (two checkpoints being written): each
keeps its own log, and a step saves into each. ``StoreState.release`` ends the
snapshots (the checkpoint is written, or abandoned); so does the garbage collector
once nothing refers to a snapshot, lazily: its rows are freed at the table's next
step. Reading a released snapshot raises.
Why an undo log rather than copy-on-write by blocks of rows, or a forked process: it
keeps the step's in-place write (a step costs in proportion to its rows), the cost
falls on the first write of a row only and only while a checkpoint is being written,
and it needs no second address space.
Every swap of a value and its optimizer state happens under ``_publish``, so
each variable in a snapshot is whole (its value and slots from the same step).
With ``apply_all`` (sync) the snapshot is one version exactly, row-wise variables
included (their snapshots begin under the locks a round holds until it publishes). With
``apply_one`` (async) a push updates variable after variable and counts in the
version only once all are done: a snapshot holds every push its version
counts, and may also hold part of a push still in flight (some of its
variables updated, not yet counted). Its version is a lower bound.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

import numpy as np

from ps_server.core.errors import InvalidArgument, NonFinite, NotFound, NotInitialized, SpecConflict
from ps_server.core.optim import schedules, sparse
from ps_server.core.optim.optimizers import Occurrences, Optimizer, OptimizerSpec, slices_refusal, squares
from ps_server.core.optim.registry import make_optimizer
from ps_common.sparse import SparseRows

log = logging.getLogger("ps_server.core")


class _Variable:
    __slots__ = ("name", "value", "state", "lock", "changed", "non_trainable", "rows_changed", "row_log",
                 "row_log_floor", "row_log_size", "undo_logs")

    def __init__(self, name: str, value: np.ndarray, state: dict, changed: int = 0, non_trainable: bool = False):
        self.name = name
        self.value = value
        self.state = state
        self.lock = threading.Lock()
        # Not trained by the optimizer (BatchNorm moving statistics): its "gradient" is
        # the change a worker's forward pass made, added as it is (module docstring).
        self.non_trainable = non_trainable
        # A version by which this value was published: a reader that saw version
        # v < changed may hold an older value; one that saw v >= changed holds this one.
        self.changed = changed
        # Row-wise (module docstring): None while copy-on-write. Else the version by which
        # each row was last written; row_log holds (version, rows) of recent steps, oldest
        # first, complete for every version above row_log_floor; row_log_size its rows.
        self.rows_changed: np.ndarray | None = None
        self.row_log: collections.deque = collections.deque()
        self.row_log_floor = 0
        self.row_log_size = 0
        # Row-wise: one per snapshot being read (``RowSnapshot``), each saving the original
        # contents of a row before its first in-place write since that snapshot began.
        self.undo_logs: list[_UndoLog] = []

    @property
    def row_wise(self) -> bool:
        return self.rows_changed is not None

    def mark_rows(self, rows: np.ndarray | None, version: int) -> None:
        """Rows ``rows`` (None: all) written as of ``version``. Lock held."""
        self.changed = version
        if rows is None:
            self.rows_changed[:] = version
            self.row_log.clear()
            self.row_log_floor, self.row_log_size = version, 0
            return
        self.rows_changed[rows] = version
        self.row_log.append((version, np.array(rows, np.intp)))  # a copy: the caller's may change
        self.row_log_size += len(rows)
        # Beyond a table's worth of rows, a scan of rows_changed costs no more than the log.
        while self.row_log_size > len(self.rows_changed) and self.row_log:
            old_version, old_rows = self.row_log.popleft()
            self.row_log_size -= len(old_rows)
            self.row_log_floor = max(self.row_log_floor, old_version)

    def before_write(self, rows: np.ndarray) -> None:
        """Rows ``rows`` of the value and slots are about to be written in place: each open
        snapshot saves their contents first (module docstring: checkpoints). Lock held."""
        if self.undo_logs:
            self.undo_logs = [u for u in self.undo_logs if not u.released]  # released by the GC
            for undo in self.undo_logs:
                undo.save(rows)

    def rows_since(self, since: int) -> np.ndarray:
        """The rows written after version ``since``, increasing. Lock held."""
        if since < self.row_log_floor:
            return np.flatnonzero(self.rows_changed > since)
        recent = []
        for version, rows in reversed(self.row_log):
            if version <= since:
                break
            recent.append(rows)
        if not recent:
            return np.empty(0, np.intp)
        return recent[0] if len(recent) == 1 else np.unique(np.concatenate(recent))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _native(a: np.ndarray, copy: bool = False) -> np.ndarray:
    """``a`` in native byte order; without ``copy``, ``a`` itself when it already is."""
    return a.astype(a.dtype.newbyteorder("="), copy=copy)


def _native_gradient(g):
    """A gradient (array or ``SparseRows``) in native byte order."""
    if isinstance(g, SparseRows):
        return g if g.values.dtype.isnative else SparseRows(g.rows, _native(g.values))
    return _native(g)


def _write_rows(var: _Variable, rows: np.ndarray, value: np.ndarray, state: dict) -> None:
    """Write one row-wise step (``Optimizer.apply_rows``' result) into ``var`` in place, its
    open snapshots saving those rows first (``_Variable.before_write``). Lock held."""
    var.before_write(rows)
    var.value[rows] = value
    for k, v in state.items():
        current = var.state.get(k)
        if isinstance(current, np.ndarray) and current.shape == var.value.shape:
            current[rows] = v
        else:  # iterations, a 0-d slot (Nadam's u_product)
            var.state[k] = v


def _replace_whole(var: _Variable, value: np.ndarray, state: dict, version: int) -> None:
    """A whole step of a row-wise variable (a dense gradient): its new arrays, owned by the
    store from now on (never handed out), every row marked. Lock and ``_publish`` held.
    An open snapshot keeps the arrays replaced here, which nothing writes any more: it
    stops saving rows (what it saved so far it still needs)."""
    var.undo_logs = []
    var.value = value if value.flags.writeable else value.copy()
    var.state = {k: (v.copy() if isinstance(v, np.ndarray) and not v.flags.writeable else v)
                 for k, v in state.items()}
    var.mark_rows(None, version)


class _UndoLog:
    """What one snapshot of a row-wise variable needs that the table no longer holds: the
    original contents (value and every slot shaped like it) of each row written in place
    since the snapshot began, saved before the row's first such write. Every method runs
    under the variable's lock but ``released``' setter, which is one attribute store (the
    garbage collector may set it in any thread, holding any lock)."""

    __slots__ = ("arrays", "saved", "blocks", "released")

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays  # "value" and each slot name -> the array as of the snapshot
        self.saved: np.ndarray | None = None  # one bool per row, once a row is saved
        self.blocks: list[tuple[np.ndarray, dict[str, np.ndarray]]] = []  # (rows increasing, their contents)
        self.released = False

    def save(self, rows: np.ndarray) -> None:
        """Save the rows of ``rows`` not saved yet, as the arrays hold them now."""
        rows = np.asarray(rows, np.intp)
        if self.saved is None:
            self.saved = np.zeros(len(self.arrays["value"]), bool)
        new = rows[~self.saved[rows]]
        if not len(new):
            return
        if len(new) > 1 and not np.all(new[1:] > new[:-1]):
            new = np.unique(new)
        self.saved[new] = True
        self.blocks.append((new, {k: np.take(a, new, axis=0) for k, a in self.arrays.items()}))

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of array ``key`` as of the snapshot: a fresh array."""
        out = self.arrays[key][start:stop].copy()
        for rows, contents in self.blocks:
            lo, hi = np.searchsorted(rows, (start, stop))
            if lo < hi:
                out[rows[lo:hi] - start] = contents[key][lo:hi]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes saved (the rows' contents and the per-row flags): what the snapshot costs."""
        return sum(r.nbytes + sum(c.nbytes for c in cs.values()) for r, cs in self.blocks) \
            + (self.saved.nbytes if self.saved is not None else 0)


def _released_by_gc(undo: _UndoLog) -> None:
    undo.released = True  # dropped from the variable, and its rows freed, at its next write


class RowSnapshot:
    """A row-wise variable as of one ``export_state``, read row range by row range, without a
    copy of the table (module docstring: checkpoints), through one ``SnapshotArray`` for the
    value and one per slot shaped like it (``arrays``). ``release`` ends it, as does the
    garbage collector once nothing refers to its arrays (they refer to it, it not to them:
    no cycle, so in CPython at once)."""

    def __init__(self, var: _Variable, undo: _UndoLog):
        self._var, self._undo = var, undo
        self._finalizer = weakref.finalize(self, _released_by_gc, undo)

    def arrays(self) -> dict[str, "SnapshotArray"]:
        """"value" and each slot shaped like it -> its ``SnapshotArray``."""
        return {k: SnapshotArray(self, k, a.shape, a.dtype) for k, a in self._undo.arrays.items()}

    def read(self, key: str, start: int, stop: int) -> np.ndarray:
        with self._var.lock:  # held for one slice: a step on this variable waits that long at most
            if self._undo.released:
                raise InvalidArgument(f"the snapshot of {self._var.name!r} was released (its checkpoint is "
                                      f"done): take another one (export_state)")
            return self._undo.read(key, start, stop)

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds beyond the table (rows saved since it began)."""
        with self._var.lock:
            return self._undo.nbytes

    def release(self) -> None:
        """Stop saving rows and free those saved; reading it afterwards raises. Idempotent."""
        if self._finalizer.detach() is None:
            return
        with self._var.lock:
            self._undo.released = True
            self._var.undo_logs = [u for u in self._var.undo_logs if u is not self._undo]
            self._undo.blocks, self._undo.saved = [], None


class SnapshotArray:
    """One array of a ``RowSnapshot``: what ``core.checkpoint`` writes slice by slice (its
    ``ArraySource``): ``shape``, ``dtype``, ``nbytes`` and ``read(start, stop)``, rows
    ``start:stop`` in a fresh native array. ``np.asarray`` of it reads it whole (a copy
    of the array: for tests and small tables, not for checkpoints)."""

    def __init__(self, snapshot: RowSnapshot, key: str, shape: tuple[int, ...], dtype: np.dtype):
        self.snapshot, self.key = snapshot, key
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size = len(self.shape), math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.snapshot.read(self.key, start, stop)

    def __array__(self, dtype=None, copy=None):
        whole = self.read(0, self.shape[0])
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def release(self) -> None:
        self.snapshot.release()

    def __repr__(self) -> str:
        return f"SnapshotArray({self.snapshot._var.name!r}, {self.key!r}, {self.dtype}{list(self.shape)})"


@dataclass(frozen=True)
class StoreState:
    """A snapshot of the store: what a checkpoint holds of it.

    ``states[name]`` is the optimizer state of variable ``name``: its slots
    (e.g. ``m`` and ``v`` for Adam) and ``iterations``. Arrays are shared with
    the store, never copied, and never modified (copy-on-write): do not write
    into them. A row-wise variable's value and slots are each a ``SnapshotArray``
    instead (``RowSnapshot``): read row range by row range, as of the snapshot,
    until ``release``; ``np.asarray`` of one copies it whole.
    """

    version: int
    optimizer: OptimizerSpec
    values: dict[str, np.ndarray]
    states: dict[str, dict]
    non_trainable: frozenset[str] = frozenset()
    # The optimizer initialize was given, when set_learning_rates has changed a rate of it
    # since (``optimizer`` holds the changed one); None otherwise.
    initial_optimizer: OptimizerSpec | None = None

    def release(self) -> None:
        """End the snapshots of its row-wise variables (``RowSnapshot.release``): call it
        once the checkpoint is written, or abandoned. Dense arrays need nothing."""
        release_snapshots(self.values, self.states)


def release_snapshots(values: Mapping[str, object], states: Mapping[str, Mapping]) -> None:
    """``RowSnapshot.release`` for every ``SnapshotArray`` among ``values`` and ``states``."""
    for name, value in values.items():
        for a in (value, *states.get(name, {}).values()):
            if isinstance(a, SnapshotArray):
                a.release()


class VariableStore:
    def __init__(self, sparse_updates: str = "exact", sparse_rule: str = "") -> None:
        """``sparse_updates`` (``core.optim.sparse.SPARSE_UPDATES``, ``--sparse-updates``): how a
        sparse gradient is applied: only its rows where that is exact (default), only its
        rows always (``lazy``), or made dense. ``sparse_rule`` (``SPARSE_RULES``,
        ``--sparse-rule``): a repeated row's occurrences summed first ("sum"), or each
        applied as Keras 3 applies an ``IndexedSlices`` ("keras"; ``core.optim.sparse``);
        "": the initialized optimizer's (``OptimizerSpec.sparse_rule``), else "sum"."""
        if sparse_updates not in sparse.SPARSE_UPDATES:
            raise InvalidArgument(f"sparse_updates must be one of {', '.join(sparse.SPARSE_UPDATES)}; "
                                  f"got {sparse_updates!r}")
        if sparse_rule not in ("", *sparse.SPARSE_RULES):
            raise InvalidArgument(f"sparse_rule must be one of {', '.join(sparse.SPARSE_RULES)}; got {sparse_rule!r}")
        self.sparse_updates = sparse_updates
        self.rule_given = sparse_rule
        self._publish = threading.Lock()
        self._vars: dict[str, _Variable] = {}
        # A variable two optimizer groups step (``OptimizerSpec.shared``): its second name -> its
        # name, and each name -> the others of the same value (module docstring).
        self._shared: dict[str, str] = {}
        self._linked: dict[str, tuple[str, ...]] = {}
        self._optimizer: Optimizer | None = None
        self._version = 0
        # The optimizer ``initialize`` was given, once ``set_learning_rates`` changed a rate of
        # it: a worker that initializes again (a restarted chief) still names the first one.
        self._initial_spec: OptimizerSpec | None = None
        # With global_clipnorm over several shards (``core.clip_group``): ``clip_across(key,
        # {name: squares})`` gives the factor of update ``key`` from every shard's squares.
        self.clip_across = None

    # -- state ---------------------------------------------------------------
    @property
    def sparse_rule(self) -> str:
        """The rule a repeated row follows: ``--sparse-rule`` where given, else the initialized
        optimizer's, else "sum"; "" until initialized where no flag was given."""
        return self._rule_of(self.optimizer_spec)

    def _rule_of(self, spec: OptimizerSpec | None) -> str:
        return self.rule_given or ("" if spec is None else spec.sparse_rule or "sum")

    @property
    def initialized(self) -> bool:
        return self._optimizer is not None

    @property
    def version(self) -> int:
        return self._version

    @property
    def optimizer_spec(self) -> OptimizerSpec | None:
        return self._optimizer.spec if self._optimizer else None

    @property
    def initialized_spec(self) -> OptimizerSpec | None:
        """The optimizer as ``initialize`` gave it: what a worker joining later must match,
        whatever learning rates ``set_learning_rates`` gave it since (``current_learning_rate``)."""
        return self._initial_spec if self._initial_spec is not None else self.optimizer_spec

    @property
    def shared(self) -> dict[str, str]:
        """Each second name of a variable two optimizer groups step: its variable's (module docstring)."""
        return dict(self._shared)

    def specs(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """Every name a gradient may come by: the variables' and their second names' (``_shared``)."""
        return {n: (v.value.dtype, v.value.shape) for n, v in self._vars.items()}

    def non_trainable(self) -> frozenset[str]:
        return frozenset(n for n, v in self._vars.items() if v.non_trainable)

    def num_parameters(self) -> int:
        return sum(int(v.value.size) for n, v in self._vars.items() if n not in self._shared)

    def nbytes(self) -> int:
        """The bytes of the values (not their optimizer state)."""
        return sum(int(v.value.nbytes) for n, v in self._vars.items() if n not in self._shared)

    # -- initialization ----------------------------------------------------------
    def initialize(self, variables: Mapping[str, np.ndarray], spec: OptimizerSpec,
                   non_trainable: Collection[str] = (), owned: bool = False) -> bool:
        """Store the variables and optimizer; True if created, False if identical state exists.

        The values are copied, unless ``owned``: the caller gives the arrays up (nothing else
        writes them again), and each aligned one in native byte order is stored as it is
        (a streamed Initialize's receive buffer: the model is then in memory once).

        ``non_trainable`` names variables the optimizer leaves alone: their pushed
        "gradient" is a change to add (see the module docstring). A second call with
        the same names, shapes, dtypes, non-trainable set and optimizer is harmless
        (it does not overwrite trained values); any difference raises SpecConflict.
        """
        spec.validate()
        non_trainable = frozenset(non_trainable)
        if not variables:
            raise InvalidArgument("initialize needs at least one variable")
        unknown = sorted(non_trainable - set(variables))
        if unknown:
            raise InvalidArgument(f"non-trainable variable(s) {', '.join(map(repr, unknown[:5]))} are not among "
                                  f"the variables")
        self._check_sparse_updates(spec)
        for name, value in variables.items():
            if not name:
                raise InvalidArgument("variable names must be non-empty")
            if value.dtype.kind != "f":
                raise InvalidArgument(f"variable {name!r} has dtype {value.dtype}; only floating variables train")
        with self._publish:
            if self._optimizer is not None:
                self._check_same(variables, spec, non_trainable)
                return False
            optimizer = make_optimizer(spec)
            values = {name: _frozen(_native(value, copy=not (owned and value.flags.aligned)))
                      for name, value in variables.items()}
            shared = self._shared_of(spec, variables, non_trainable)
            values.update((second, values[name]) for second, name in shared.items())
            self._vars = {
                name: _Variable(name, value, optimizer.of(name).init_state(value), non_trainable=name in non_trainable)
                for name, value in values.items()
            }
            self._link(shared)
            self._optimizer = optimizer
            return True

    @staticmethod
    def _shared_of(spec: OptimizerSpec, variables: Collection[str], non_trainable: Collection[str]) -> dict[str, str]:
        """``spec.shared()`` of the variables held here (a shard holds some); refuses a second name
        among the variables, or a non-trainable variable two groups name."""
        shared = {second: name for second, name in spec.shared().items() if name in variables}
        clash = sorted(set(shared) & set(variables)) or sorted(set(shared.values()) & set(non_trainable))
        if clash:
            raise InvalidArgument(f"variable {clash[0]!r}: two optimizer groups step it, so it must be trainable "
                                  "and its second name no variable's")
        return shared

    def _link(self, shared: Mapping[str, str]) -> None:
        """Each second name's variable holds its variable's value, under its lock (module docstring)."""
        self._shared, linked = dict(shared), {}
        for second, name in shared.items():
            linked.setdefault(name, [name]).append(second)
            self._vars[second].lock = self._vars[name].lock
            self._vars[second].value, self._vars[second].changed = self._vars[name].value, self._vars[name].changed
        self._linked = {n: tuple(m for m in names if m != n) for names in linked.values() for n in names}

    def _spread(self, names: Iterable[str]) -> None:
        """After a write of ``names`` (under ``_publish``): the other names of each hold its value."""
        for name in names if self._linked else ():  # every update passes here: nothing to look up without
            var = self._vars[name]
            for other in self._linked.get(name, ()):
                self._vars[other].value, self._vars[other].changed = var.value, var.changed

    def _check_sparse_updates(self, spec: OptimizerSpec) -> None:
        for s in spec.every():
            refusal = sparse.lazy_refusal(s) if self.sparse_updates == "lazy" else None
            # The rule a flag gave refuses an optimizer at once; the one an optimizer asks for (the
            # Keras front door's, for every model) at its first sparse gradient (``prepare``).
            refusal = refusal or (slices_refusal(s) if self.rule_given == "keras" else None)
            if refusal:
                raise InvalidArgument(refusal)

    def _row_wise_reason(self, var: _Variable) -> str | None:
        """None when a sparse gradient of ``var`` is stepped on its rows alone; else why not."""
        if var.non_trainable:
            return "it is not trainable"
        if var.name in self._linked:
            return "two optimizers step it"
        return sparse.row_wise(self._optimizer.of(var.name).spec, self.sparse_updates)

    def _rows_alone(self, name: str, g) -> bool:
        """Whether gradient ``g`` of ``name`` steps the variable's rows alone, in place. With
        ``--sparse-rule keras`` a ``SparseRows`` stays sparse (``prepare``) even where the
        whole variable is stepped: its occurrences are what that step needs."""
        if not isinstance(g, SparseRows):
            return False
        return self.sparse_rule == "sum" or self._row_wise_reason(self._vars[name]) is None

    def row_wise(self) -> frozenset[str]:
        """The variables that are row-wise now (module docstring)."""
        return frozenset(n for n, v in self._vars.items() if v.row_wise)

    def _check_same(self, variables: Mapping[str, np.ndarray], spec: OptimizerSpec,
                    non_trainable: frozenset[str] = frozenset()) -> None:
        mine = {n: s for n, s in self.specs().items() if n not in self._shared}
        theirs = {n: (np.dtype(a.dtype).newbyteorder("="), tuple(a.shape)) for n, a in variables.items()}
        problems = []
        for name in sorted(set(mine) | set(theirs)):
            if name not in theirs:
                problems.append(f"{name!r} is stored but not in the new spec")
            elif name not in mine:
                problems.append(f"{name!r} is new (not stored)")
            elif mine[name] != theirs[name]:
                problems.append(
                    f"{name!r} is stored as {mine[name][0]}{list(mine[name][1])}, "
                    f"new spec says {theirs[name][0]}{list(theirs[name][1])}"
                )
        mine_nt = self.non_trainable()
        if non_trainable != mine_nt:
            problems.append(f"non-trainable variables are stored as {sorted(mine_nt)}, new spec says "
                            f"{sorted(non_trainable)}")
        stored = self.initialized_spec
        if spec != stored:
            problems.append(f"optimizer is stored as {stored.as_dict()}, new spec says {spec.as_dict()}")
        if problems:
            raise SpecConflict("initialization conflicts with the stored state: " + "; ".join(problems[:5])
                               + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))

    # -- reads -----------------------------------------------------------------
    def read(self, names: Iterable[str] | None = None, since: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """(version, values). Arrays are read-only and never change afterwards.

        With ``since``: only the variables that may have changed after a read
        that returned version ``since`` (the caller keeps its copies of the
        rest). Sync updates publish every variable with the new version; an
        async update publishes a variable as of the version being built, so a
        reader that caught it half-way through a push gets it again, never misses it.
        A row-wise variable comes whole, copied (module docstring).
        """
        version, values, _ = self._read(names, since, rows=False)
        return version, values

    def read_rows(self, names: Iterable[str] | None = None,
                  since: int | None = None) -> tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(version, values, rows): ``read``, except that with ``since`` a row-wise variable
        changed after it comes as the rows written after ``since`` only: ``values[name]``
        holds them, ``rows[name]`` (int64, increasing) says which they are. A caller that
        writes them into its copy from the read that returned ``since`` holds the values
        as of ``version`` (module docstring: consistency)."""
        return self._read(names, since, rows=True)

    def _read(self, names, since, rows: bool):
        self._require_initialized()
        names = list(names) if names else None
        if names:
            unknown = [n for n in names if n not in self._vars]
            if unknown:
                raise NotFound(f"unknown variable(s): {', '.join(map(repr, unknown[:5]))}")
        chosen = names or [n for n in self._vars if n not in self._shared]
        while True:
            row_wise = sorted(n for n in chosen if self._vars[n].row_wise)
            with contextlib.ExitStack() as held:
                for n in row_wise:  # name order (the lock order)
                    held.enter_context(self._vars[n].lock)
                with self._publish:
                    if sorted(n for n in chosen if self._vars[n].row_wise) != row_wise:
                        continue  # a variable turned row-wise meanwhile: take its lock too
                    version = self._version
                    if since is not None:
                        chosen = [n for n in chosen if self._vars[n].changed > since]
                    values = {n: self._vars[n].value for n in chosen if n not in row_wise}
                indices = {}
                for n in row_wise:
                    if n not in chosen:
                        continue
                    var = self._vars[n]
                    if rows and since is not None:
                        indices[n] = var.rows_since(since).astype(np.int64, copy=False)
                        values[n] = _frozen(np.take(var.value, indices[n], axis=0))
                    else:
                        values[n] = _frozen(var.value.copy())
                return version, {n: values[n] for n in chosen}, indices

    # -- gradients ---------------------------------------------------------------
    def check_gradients(self, grads: Mapping[str, "np.ndarray | SparseRows"], allow_nonfinite: bool = False) -> None:
        """Raise unless grads has exactly one finite array per variable, of its shape and dtype
        (a ``SparseRows``: rows of the variable, ``core.optim.sparse.check``).

        ``allow_nonfinite`` lets NaN and Inf through (they are rejected by default).
        """
        self.check_gradient_specs({n: (g.dtype, g.values.shape if isinstance(g, SparseRows) else g.shape)
                                   for n, g in grads.items()},
                                  sparse=frozenset(n for n, g in grads.items() if isinstance(g, SparseRows)))
        for name, g in grads.items():
            if isinstance(g, SparseRows):
                var = self._vars[name]
                sparse.check(name, g, var.value.shape, var.value.dtype)
            if not allow_nonfinite and not np.isfinite(g.values if isinstance(g, SparseRows) else g).all():
                raise NonFinite(f"gradient for {name!r} contains NaN or Inf; rejected, nothing applied")

    def check_gradient_specs(self, specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                             sparse: Collection[str] = ()) -> None:
        """Raise unless ``specs`` (name -> (dtype, shape)) names every variable once with
        its shape and dtype: what a streamed push checks before any data arrives. A name
        in ``sparse`` is a sparse gradient (``core.optim.sparse``): its shape is (rows, *the
        variable's shape[1:]), its rows are checked with the values."""
        self._require_initialized()
        unknown = [n for n in specs if n not in self._vars]
        if unknown:
            raise NotFound(f"gradient for unknown variable(s): {', '.join(map(repr, unknown[:5]))}")
        twice = sorted(n for n in specs if n in self._shared and self._shared[n] in specs)
        if twice:
            raise InvalidArgument(f"a push of {twice[0]!r} and {self._shared[twice[0]]!r}: one update steps a "
                                  "variable by one optimizer")
        missing = [n for n in self._vars if n not in specs]
        if missing and self._optimizer.groups:  # each optimizer pushes its own variables (a shard: maybe none)
            missing = [] if not specs or any(n in specs for n, v in self._vars.items() if not v.non_trainable) \
                else missing
        if missing:
            raise InvalidArgument(f"missing gradient(s) for: {', '.join(map(repr, missing[:5]))}")
        for name, (dtype, shape) in specs.items():
            value = self._vars[name].value
            if name in sparse:
                if value.ndim < 1 or tuple(shape)[1:] != value.shape[1:] or len(shape) != value.ndim:
                    raise InvalidArgument(f"sparse gradient for {name!r} has shape {list(shape)}; the variable is "
                                          f"{list(value.shape)}, so it must be [rows, {', '.join(map(str, value.shape[1:]))}]")
            elif tuple(shape) != value.shape:
                raise InvalidArgument(
                    f"gradient for {name!r} has shape {list(shape)}, variable has {list(value.shape)}"
                )
            if np.dtype(dtype).newbyteorder("=") != value.dtype:
                raise InvalidArgument(f"gradient for {name!r} has dtype {np.dtype(dtype)}, variable has {value.dtype}")

    def prepare(self, grads: Mapping[str, "np.ndarray | SparseRows"], keep_sparse: bool = True) -> dict:
        """Gradients that passed ``check_gradients`` as the modes take them: every ``SparseRows``
        kept as it is where its rows alone are stepped (``core.optim.sparse.row_wise``, and
        ``keep_sparse``), else made dense. Raises before anything is applied."""
        out = {}
        for name, g in grads.items():
            if isinstance(g, SparseRows):
                var = self._vars[name]
                keras = self.sparse_rule == "keras" and not var.non_trainable
                refusal = slices_refusal(self._optimizer.of(name).spec) if keras else None
                if refusal:  # the optimizer asked for the rule (``_check_sparse_updates``)
                    raise InvalidArgument(f"a sparse gradient for {name!r}: {refusal}")
                if not (keep_sparse and (keras or self._row_wise_reason(var) is None)):
                    g = sparse.densify(g, var.value.shape, var.value.dtype)
            out[name] = g
        return out

    # -- updates -----------------------------------------------------------------
    def apply_all(self, grads: Mapping[str, "np.ndarray | SparseRows"], key: str | None = None) -> int:
        """One optimizer step on every variable, published at once; returns the new version.

        Callers check the gradients first (``check_gradients``) and serialize
        apply_all (the sync barrier does); readers see either all of the old
        values or all of the new ones. A ``SparseRows`` gradient (``prepare`` kept it)
        steps that variable's rows alone, in place (module docstring).
        """
        new = {}
        optimizer = self._optimizer  # one learning rate for the whole step (set_learning_rates)
        grads = {name: _native_gradient(g) for name, g in grads.items()}
        clip_scale = self._global_clip_scale(optimizer, grads, key)
        for name, g in grads.items():
            if not self._rows_alone(name, g):
                new[name] = self._step(self._vars[name], g, optimizer=optimizer, clip_scale=clip_scale)
        return self.publish(new, {n: g for n, g in grads.items() if self._rows_alone(n, g)},
                            optimizer=optimizer, clip_scale=clip_scale)

    def accumulate_all(self, grads: Mapping[str, "np.ndarray | SparseRows"], key: str | None = None) -> int:
        """``apply_all`` of one batch where the server holds the ``gradient_accumulation_steps``
        window (elastic sync: a round is a batch, any worker may compute any of them): before the
        window's last batch each trainable gradient goes into its variable's accumulator
        (``Optimizer.accumulate``; sparse ones dense, as Keras' accumulators are), each
        non-trainable change is added as every batch adds it; at the last, ``apply_all`` of
        the window's mean. Returns the new version (every batch counts one)."""
        self._require_initialized()
        optimizer, dense = self._optimizer, {}
        for name, g in grads.items():
            var = self._vars[name]
            g = _native_gradient(g)
            dense[name] = sparse.densify(g, var.value.shape, var.value.dtype) if isinstance(g, SparseRows) else g
        trainable = {n: self._vars[n] for n in dense if not self._vars[n].non_trainable}
        if all(optimizer.of(n).window_ends(var.state) for n, var in trainable.items()):
            return self.apply_all({n: optimizer.of(n).window_mean(g, trainable[n].state) if n in trainable else g
                                   for n, g in dense.items()}, key)
        return self.publish({n: optimizer.of(n).accumulate(trainable[n].value, g, trainable[n].state)
                             if n in trainable else self._step(self._vars[n], g) for n, g in dense.items()})

    def step_rows(self, name: str, rows: tuple[int, int] | None, grad: np.ndarray) -> tuple[np.ndarray, dict]:
        """(new value, new optimizer state) of rows ``r0:r1`` of one variable (None: all of
        it) for their ``grad``, changing nothing: those rows' bits of what ``apply_all``
        computes in a step without ``global_clipnorm`` (every optimizer here is elementwise
        but for ``clipnorm``, whose callers pass None). The sync overlap (``core.modes.overlap``)
        computes a round block by block this way, then ``publish`` makes it the step."""
        self._require_initialized()
        if any(o.spec.global_clipnorm is not None for o in self._optimizer.every()):
            raise InvalidArgument("global_clipnorm needs every gradient of the step: no step of one variable")
        var, grad = self._vars[name], _native(grad)
        if rows is None:
            return self._step(var, grad)
        r0, r1 = rows
        value = var.value[r0:r1]
        if var.non_trainable:  # its state is not the optimizer's to slice: one block, the whole
            raise InvalidArgument(f"{name!r} is not trainable: step it whole")
        state = {k: (v[r0:r1] if isinstance(v, np.ndarray) and v.shape == var.value.shape and v.ndim else v)
                 for k, v in var.state.items()}
        return self._optimizer.of(name).apply(value, grad, state)

    def publish(self, new: Mapping[str, tuple[np.ndarray, dict]], rows: Mapping[str, SparseRows] | None = None,
                optimizer: Optimizer | None = None, clip_scale=None) -> int:
        """Make ``new`` ({name: (value, state)}, each from ``_step`` on the current values)
        the variables' values at once, with the steps of ``rows`` ({name: sparse gradient},
        on those rows alone) written in place; returns the new version. Every row step is
        computed before anything is written: one that raises leaves the store as it was."""
        rows = rows or {}
        for name in rows:
            self._make_row_wise(self._vars[name])
        writes = sorted(n for n in set(new) | set(rows) if self._vars[n].row_wise)
        with contextlib.ExitStack() as held:
            for name in writes:  # name order (the lock order); readers wait until published
                held.enter_context(self._vars[name].lock)
            stepped = {name: self._step_rows(self._vars[name], g, optimizer=optimizer, clip_scale=clip_scale)
                       for name, g in rows.items()}
            for name, (indices, value, state) in stepped.items():
                _write_rows(self._vars[name], indices, value, state)
            with self._publish:
                self._version += 1
                for name, (value, state) in new.items():
                    var = self._vars[name]
                    if var.row_wise:
                        _replace_whole(var, value, state, self._version)
                    else:
                        var.value, var.state, var.changed = _frozen(value), state, self._version
                self._spread(new)
                for name, (indices, _, _) in stepped.items():
                    self._vars[name].mark_rows(indices, self._version)
                return self._version

    def apply_push(self, grads: Mapping[str, np.ndarray], lr_scale: float = 1.0, key: str | None = None) -> None:
        """One push of async/SSP mode: ``apply_one`` on each variable in name order, with
        ``global_clipnorm``'s factor taken once over the whole push (as Keras takes it over
        one update). The caller counts it in the version (``bump_version``) afterwards."""
        optimizer = self._optimizer
        grads = {name: _native_gradient(g) for name, g in grads.items()}
        clip_scale = self._global_clip_scale(optimizer, grads, key)
        for name in sorted(grads):
            self.apply_one(name, grads[name], lr_scale, clip_scale=clip_scale, optimizer=optimizer)

    def clip_scale_of(self, squared) -> np.floating | None:
        """``Optimizer.clip_scale_of``: the factor from each gradient's squares, in order."""
        self._require_initialized()
        return self._optimizer.clip_scale_of(squared)

    def global_clip_scale(self, grads: Mapping[str, np.ndarray], key: str | None = None) -> float | None:
        """With ``global_clipnorm``: the factor every gradient of the update ``grads`` (a
        whole push or round, named ``key`` for ``clip_across``) is clipped by, to hand to
        ``apply_one``; else None."""
        self._require_initialized()
        return self._global_clip_scale(self._optimizer, {n: _native_gradient(g) for n, g in grads.items()}, key)

    def _global_clip_scale(self, optimizer: Optimizer, grads: Mapping[str, np.ndarray], key: str | None = None):
        # Keras takes the norm over the gradients of the trainable variables only, in the
        # model's order (the order the variables were initialized in).
        if all(o.spec.global_clipnorm is None for o in optimizer.every()):
            return None
        trainable = {name: self._clipped_as(name, grads[name]) for name in self._vars
                     if name in grads and not self._vars[name].non_trainable}
        if optimizer.groups:  # each optimizer clips its own update: a push of its own variables
            owners = {id(o): o for o in map(optimizer.of, trainable)}
            if len(owners) > 1 or self.clip_across is not None:
                raise InvalidArgument("global_clipnorm with several optimizers: each optimizer's update is one push "
                                      "of its own variables, on one server")
            optimizer = next(iter(owners.values()), optimizer)
            if optimizer.spec.global_clipnorm is None:
                return None
        if self.clip_across is None:
            return optimizer.global_clip_scale(trainable.values())
        if key is None:
            raise InvalidArgument("global_clipnorm over several shards names each update (its round or push)")
        return self.clip_across(key, {name: squares(g) for name, g in trainable.items()})

    def _clipped_as(self, name: str, g):
        """The gradient as global clipping reads it: a sparse one (``--sparse-rule keras``
        keeps its occurrences) as Keras reads an ``IndexedSlices``, ``Occurrences``."""
        if not isinstance(g, SparseRows):
            return g
        occurrences = Occurrences(np.asarray(g.rows, dtype=np.intp), g.values)
        occurrences.check(self._vars[name].value)
        return occurrences

    def apply_one(self, name: str, grad: "np.ndarray | SparseRows", lr_scale: float = 1.0, clip_scale=None,
                  optimizer: Optimizer | None = None) -> None:
        """One optimizer step on one variable under its own lock (async and SSP modes);
        ``lr_scale`` scales this step's learning rate (stale-gradient policy "scale").
        With ``global_clipnorm`` the push's ``clip_scale`` is needed (``apply_push``
        passes it; InvalidArgument without it). A ``SparseRows`` gradient steps its rows
        alone, in place (module docstring)."""
        var = self._vars[name]
        grad = _native_gradient(grad)
        rows_alone = self._rows_alone(name, grad)
        if rows_alone:
            self._make_row_wise(var)
        with var.lock:
            if rows_alone:
                indices, value, state = self._step_rows(var, grad, lr_scale, optimizer, clip_scale)
                _write_rows(var, indices, value, state)
                with self._publish:
                    var.mark_rows(indices, self._version + 1)
                return
            value, state = self._step(var, grad, lr_scale, optimizer=optimizer, clip_scale=clip_scale)
            with self._publish:  # a snapshot sees value and state of the same step
                if var.row_wise:
                    _replace_whole(var, value, state, self._version + 1)
                else:
                    var.value, var.state, var.changed = _frozen(value), state, self._version + 1
                self._spread((name,))

    def _make_row_wise(self, var: _Variable) -> None:
        """From now on ``var`` is written in place, its rows tracked (module docstring): its
        value and slots copied once (readers may hold the frozen ones), every row marked
        with the version its value was published by."""
        if var.row_wise:
            return
        with var.lock:
            value = var.value.copy()
            state = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in var.state.items()}
            with self._publish:
                var.value, var.state = value, state
                var.rows_changed = np.full(value.shape[0], var.changed, np.int64)
                var.row_log_floor = var.changed
        log.info("variable %r (%s rows) is stepped row by row from now on (--sparse-updates %s)", var.name,
                 f"{value.shape[0]:,}", self.sparse_updates)

    def _step_rows(self, var: _Variable, grad: SparseRows, lr_scale: float = 1.0,
                   optimizer: Optimizer | None = None, clip_scale=None) -> tuple[np.ndarray, np.ndarray, dict]:
        """(rows, their new values, the new state with those rows of each slot) of one
        row-wise step, changing nothing. Lock held."""
        if self.sparse_rule == "keras":  # the touched rows, each occurrence kept (Optimizer.apply_rows)
            indices, positions = np.unique(np.asarray(grad.rows, dtype=np.intp), return_inverse=True)
            values = Occurrences(positions.reshape(-1), grad.values)
        else:
            indices, values = sparse.combine(grad)
        value, state = (optimizer or self._optimizer).of(var.name).apply_rows(var.value, indices, values, var.state,
                                                                              lr_scale, clip_scale)
        return indices, value, state

    def _step(self, var: _Variable, grad: np.ndarray, lr_scale: float = 1.0,
              optimizer: Optimizer | None = None, clip_scale=None) -> tuple[np.ndarray, dict]:
        """(new value, new optimizer state) of one variable: an optimizer step, or for a
        non-trainable variable its pushed change added (no learning rate, no state)."""
        if var.non_trainable:
            return (var.value + grad).astype(var.value.dtype, copy=False), var.state
        if isinstance(grad, SparseRows):  # --sparse-rule keras, the whole variable stepped
            grad = Occurrences(grad.rows, grad.values)
        return (optimizer or self._optimizer).of(var.name).apply(var.value, grad, var.state, lr_scale, clip_scale)

    # -- checkpoints -------------------------------------------------------------
    def export_state(self) -> StoreState:
        """A snapshot for a checkpoint, zero-copy: dense variables by reference, each row-wise
        one as a ``RowSnapshot`` begun here, under its lock (module docstring: checkpoints,
        and consistency). Release it (``StoreState.release``) once written."""
        self._require_initialized()
        while True:
            row_wise = sorted(n for n, v in self._vars.items() if v.row_wise)
            with contextlib.ExitStack() as held:
                for n in row_wise:
                    held.enter_context(self._vars[n].lock)
                with self._publish:
                    if sorted(n for n, v in self._vars.items() if v.row_wise) != row_wise:
                        continue
                    values = {n: v.value for n, v in self._vars.items()}
                    states = {n: dict(v.state) for n, v in self._vars.items()}
                    snapshot = dict(version=self._version, optimizer=self._optimizer.spec,
                                    non_trainable=self.non_trainable(),
                                    initial_optimizer=self._initial_spec)
                for n in row_wise:
                    var = self._vars[n]
                    shaped = {k for k, a in states[n].items()
                              if isinstance(a, np.ndarray) and a.shape == var.value.shape}
                    undo = _UndoLog({"value": values[n], **{k: states[n][k] for k in sorted(shaped)}})
                    var.undo_logs = [u for u in var.undo_logs if not u.released] + [undo]
                    arrays = RowSnapshot(var, undo).arrays()
                    values[n] = arrays["value"]
                    states[n] = {k: (arrays[k] if k in shaped else a) for k, a in states[n].items()}
                return StoreState(values=values, states=states, **snapshot)

    def restore_state(self, state: StoreState) -> None:
        """Load a snapshot into an empty store: values, optimizer state and version.

        Checks everything first (float values, every slot the optimizer needs,
        shaped like its variable, a non-negative ``iterations``), so a refused
        state leaves the store empty. A store that already holds state refuses.
        """
        optimizer = make_optimizer(state.optimizer)
        self._check_sparse_updates(state.optimizer)
        if not state.values:
            raise InvalidArgument("the state to restore has no variables")
        if set(state.states) != set(state.values):
            raise InvalidArgument("the state to restore has optimizer state for other variables than its values")
        if state.version < 0:
            raise InvalidArgument(f"the state to restore has version {state.version}")
        if not set(state.non_trainable) <= set(state.values):
            raise InvalidArgument("the state to restore names non-trainable variables it does not hold")
        variables = {}
        for name, value in state.values.items():
            if not name or value.dtype.kind != "f":
                raise InvalidArgument(f"cannot restore variable {name!r} of dtype {value.dtype}")
            # A SnapshotArray (a live store's row-wise table) is read whole: that read is the copy.
            value = _frozen(_native(np.asarray(value), copy=not isinstance(value, SnapshotArray)))
            wanted = optimizer.of(name).init_state(value)
            given = state.states[name]
            if set(given) != set(wanted):
                raise InvalidArgument(f"variable {name!r} has optimizer state {sorted(given)}; "
                                      f"optimizer {state.optimizer.name} keeps {sorted(wanted)}")
            iterations = given["iterations"]
            if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 0:
                raise InvalidArgument(f"variable {name!r} has iterations {iterations!r}")
            slots = {}
            for slot, array in given.items():
                if slot == "iterations":
                    continue
                array = _native(np.asarray(array), copy=not isinstance(array, SnapshotArray))
                like = wanted[slot]  # shaped like the variable, or 0-d (Nadam's u_product)
                if array.shape != like.shape or array.dtype != like.dtype:
                    raise InvalidArgument(f"slot {slot!r} of {name!r} is {array.dtype}{list(array.shape)}, "
                                          f"the optimizer keeps it as {like.dtype}{list(like.shape)} "
                                          f"(the variable is {value.dtype}{list(value.shape)})")
                slots[slot] = array
            variables[name] = _Variable(name, value, {**slots, "iterations": int(iterations)}, state.version,
                                        non_trainable=name in state.non_trainable)
        shared = state.optimizer.shared()
        if sorted(n for n in variables if n in shared) != sorted(s for s, n in shared.items() if n in variables):
            raise InvalidArgument("the state to restore holds other second names of shared variables than its "
                                  "optimizer groups give")
        with self._publish:
            if self._optimizer is not None:
                raise SpecConflict("cannot restore a checkpoint into a store that already holds variables")
            self._vars, self._optimizer, self._version = variables, optimizer, state.version
            self._link(self._shared_of(state.optimizer, [n for n in variables if n not in shared], state.non_trainable))
            self._initial_spec = state.initial_optimizer

    # -- the learning rate ------------------------------------------------------
    def set_learning_rates(self, rates: Sequence[float]) -> None:
        """From the next update on, the constant learning rate of the spec's group i (without
        groups, i = 0: the optimizer) is ``rates[i]`` where that is not 0.

        What a Keras ``LearningRateScheduler`` or ``ReduceLROnPlateau`` on the chief asks
        for (it sets ``optimizer.learning_rate``: a GAN's ``d_optimizer``'s is its group's, a
        ``MultiOptimizer``'s sets each it holds). The optimizer is rebuilt with the rates
        replaced under ``_publish``; an update already computing keeps the rates it started
        with. Refused (InvalidArgument), nothing changed: a rate not a finite number > 0 (or
        0), an entry past the groups, or a rate that is a schedule (``check_learning_rates``).
        """
        changes = self.check_learning_rates(rates)  # the groups and their schedules: fixed at initialize
        if not changes:  # most pushes: no lock taken
            return
        with self._publish:
            spec = self._optimizer.spec
            if spec.groups:  # each group's rate; the spec's own fields are the first group's
                groups = tuple((held, dataclasses.replace(group, learning_rate=changes[i]) if i in changes else group)
                               for i, (held, group) in enumerate(spec.groups))
                changed = dataclasses.replace(spec, groups=groups, **({"learning_rate": changes[0]}
                                                                      if 0 in changes else {}))
            else:
                changed = dataclasses.replace(spec, learning_rate=changes[0])
            optimizer = make_optimizer(changed)
            if self._initial_spec is None:
                self._initial_spec = spec
            self._optimizer = optimizer

    def check_learning_rates(self, rates: Sequence[float]) -> dict[int, float]:
        """{group: rate} of ``rates`` where not 0 (``set_learning_rates``); InvalidArgument
        where it cannot be set."""
        if not rates:
            return {}
        self._require_initialized()
        spec = self._optimizer.spec
        specs = [group for _, group in spec.groups] if spec.groups else [spec]
        changes = {}
        for i, value in enumerate(rates):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
                    or not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"a learning rate must be a finite number > 0; got {value!r}")
            if not value:
                continue
            if i >= len(specs):
                raise InvalidArgument(f"a learning rate for optimizer group {i}; the spec has {len(specs)} "
                                      "(OptimizerSpec.groups)")
            if specs[i].learning_rate_schedule is not None:
                raise InvalidArgument("the optimizer's learning rate is a schedule; the server evaluates it at "
                                      "its update count and cannot also set a constant one")
            changes[i] = float(value)
        return changes

    @contextlib.contextmanager
    def learning_rates(self, rates: Sequence[float]):
        """``set_learning_rates`` for the update run inside (a sync round's), taken back where
        that raises: a round that leaves no trace leaves no rate either."""
        if not rates:  # most rounds
            yield
            return
        with self._publish:
            before = self._optimizer, self._initial_spec
        self.set_learning_rates(rates)
        try:
            yield
        except BaseException:
            with self._publish:
                self._optimizer, self._initial_spec = before
            raise

    def rate_owner(self, names: Iterable[str] = ()) -> Optimizer:
        """The optimizer whose learning rate an update of ``names`` (a push's variables) uses:
        with ``groups``, the first group of its trainable variables (none of them: the first
        group), else the only one."""
        optimizer = self._optimizer
        if not optimizer.groups:  # the only one: no look at each name of every round's push
            return optimizer
        held = {id(o) for o in map(optimizer.groups.get, names) if o is not None}
        first = next((o for o in {id(o): o for o in optimizer.groups.values()}.values() if id(o) in held), None)
        return first or optimizer.of(optimizer.spec.groups[0][0][0])

    def take_averages(self, names: Collection[str], batches: int = 0) -> None:
        """Keras' ``finalize_variable_values`` with ``use_ema`` (the end of ``fit``): each of
        ``names`` takes its moving average (its ``ema`` slot) as its value, first moved for the
        ``batches`` of a ``gradient_accumulation_steps`` window under way (``Optimizer.averaged``).
        The version stays (a reader that holds it reads the values again whole:
        ``PullRequest.averages``), and a second call changes nothing. Checks every name first:
        InvalidArgument, nothing taken."""
        self._require_initialized()
        unknown = sorted(n for n in names if n not in self._vars)
        if unknown:
            raise NotFound(f"no variable {unknown[0]!r} to take the average of")
        without = sorted(n for n in names if "ema" not in self._vars[n].state)
        if without:
            raise InvalidArgument(f"variable {without[0]!r} has no moving average: its optimizer's use_ema is off")
        for name in sorted(set(names)):  # name order: the lock order
            var = self._vars[name]
            with var.lock, self._publish:
                average, state = self._optimizer.of(name).averaged(var.value, var.state, batches)
                average = np.array(average, dtype=var.value.dtype)
                if var.row_wise:
                    _replace_whole(var, average, state, self._version)
                else:
                    var.value, var.state, var.changed = _frozen(average), state, self._version
                self._spread((name,))

    def optimizer_iterations(self, names: Iterable[str] | None = None) -> int:
        """The optimizer steps every trainable variable (of ``names``) has had: Keras'
        ``optimizer.iterations`` (each variable counts its own; they differ only while an
        async push is half applied, or between groups: each optimizer counts its own)."""
        self._require_initialized()
        chosen = self._vars.values() if names is None else [self._vars[n] for n in names if n in self._vars]
        with self._publish:
            counts = [int(v.state["iterations"]) for v in chosen if not v.non_trainable]
        return min(counts, default=0)

    def current_learning_rate(self, names: Iterable[str] = ()) -> float:
        """The learning rate of the next update of ``names`` (a push's variables: with ``groups``,
        its group's; ``rate_owner``): the schedule's at their ``optimizer_iterations``
        (as Keras reads ``optimizer.learning_rate``), else the constant one."""
        self._require_initialized()
        spec = self.rate_owner(names).spec
        if spec.learning_rate_schedule is not None:
            counted = [n for n in names if n in self._optimizer.groups] or None
            return float(schedules.learning_rate(spec.learning_rate_schedule, self.optimizer_iterations(counted)))
        return float(spec.learning_rate)

    def bump_version(self) -> int:
        with self._publish:
            self._version += 1
            return self._version

    def _require_initialized(self) -> None:
        if self._optimizer is None:
            raise NotInitialized("variables are not initialized yet: the chief (worker 0) initializes them")

    def apply_in_place(self, grads: Mapping[str, np.ndarray], lr_scale: float = 1.0, key: str | None = None) -> None:
        """One push of ``--async-apply hogwild`` (``core.optim.hogwild``, ``core.modes.async_mode``): as
        ``apply_push``, variable by variable in name order, but each step is written into the
        stored arrays themselves and no lock is held while any array is read or written.

        Unlike the module docstring's copy-on-write: the array ``read`` hands out for such
        a variable is a read-only view of the one the steps write, so it changes under its
        reader (a pull may see a variable half-updated); it is never freed or resized. On
        its first in-place step a variable's value and slots are copied once into private
        writable arrays (under ``_publish``); arrays handed out before keep their values.
        ``_publish`` is otherwise taken only to count the step (``iterations``) and mark the
        variable changed, after its arrays are written, so ``read(since=...)`` never misses
        it. The caller checked the gradients and counts the push (``bump_version``)."""
        from ps_server.core.optim import hogwild  # the in-place arithmetic lives there

        self._require_initialized()
        optimizer = self._optimizer
        for o in optimizer.every():  # before any variable is touched
            hogwild.check_supported(o.spec)
        grads = {name: _native(g) for name, g in grads.items()}
        clip_scale = self._global_clip_scale(optimizer, grads, key)
        writable = self.__dict__.setdefault("_writable", {})  # name -> (published view, writable value, state)
        for name in sorted(grads):
            var = self._vars[name]
            owned = writable.get(name)
            if owned is None or owned[0] is not var.value:
                with self._publish:
                    owned = writable.get(name)
                    if owned is None or owned[0] is not var.value:  # first step, or a restored store
                        owned = writable[name] = hogwild.adopt(var.value, var.state)
                        var.value, var.state = owned[0], owned[2]
            hogwild.step_in_place(optimizer.of(name), owned[1], grads[name], owned[2], lr_scale, clip_scale,
                                  non_trainable=var.non_trainable)
            with self._publish:
                if not var.non_trainable:
                    owned[2]["iterations"] = int(owned[2]["iterations"]) + 1
                var.changed = self._version + 1
