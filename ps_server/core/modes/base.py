"""The interface every consistency mode implements, and what a push returns.

    mode = SyncMode(store, members, num_workers=2, barrier_timeout=60.0)
    ticket = mode.submit(Push(worker_id=0, step=0, base_version=0, batch_size=32,
                              gradients={...}, loss=0.7))
    ticket.add_done_callback(lambda t: print(t.result()))
    result = ticket.result(timeout=60.0)   # or wait for it (tests, tools)

One module per mode (``sync_mode``, ``async_mode``, ``ssp_mode``, ``elastic_mode``)
behind ``Mode``; all of them share the store and its optimizer.

``submit`` is the one way in, and it never waits: it does the push's work (checks,
fold, apply) in the calling thread and returns a ``Ticket`` that the mode settles
later, from whichever thread ends the wait (the push that fills the round, a death,
``expire_overdue``). A server on an event loop (``ps_server.server``) therefore holds
no thread for a waiting worker; it calls ``expire_overdue`` a few times a second so
that waits still end in time.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Mapping

import numpy as np

from ps_common.records import PushReply
from ps_server.core.errors import InvalidArgument

if TYPE_CHECKING:
    from ps_server.core.data.cursor import Cursor, EpochLedger
    from ps_server.core.store import StoreState


MAX_STEP = 2**63 - 1  # steps are below it, so step + 1 still fits in an int64
MAX_BATCH_SIZE = 2**32  # per push; 2**31 - 1 pushes of it still sum to an int64
MAX_METRICS = 64  # metric tensors per push: a Keras model's metric states are a few each
MAX_METRIC_BYTES = 2**20  # all of a push's metrics together


@dataclasses.dataclass(frozen=True)
class Push:
    worker_id: int
    step: int
    base_version: int
    batch_size: int
    gradients: Mapping[str, np.ndarray]
    loss: float = 0.0
    # Sync: small tensors (a Keras model's metric states: their change during this step)
    # summed over the round in worker order (``aggregation.sum_metrics``); async and ssp
    # ignore them. At most MAX_METRICS of them, MAX_METRIC_BYTES in all.
    metrics: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # Entry i > 0: the constant learning rate of the spec's group i (without groups, entry 0:
    # the optimizer's) from this push's update on (sync: its round's); 0: unchanged.
    set_learning_rates: tuple[float, ...] = ()
    # Elastic sync (``core.modes.elastic_mode``): the micro-batch of the round this gradient is
    # for (``core.data.cursor``); -1 elsewhere.
    micro_batch: int = -1
    # Async and ssp with a data plan (``core.data.tasks``): the task (batch) this gradient is
    # of, which this worker holds; -1 elsewhere.
    task: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "set_learning_rates", tuple(self.set_learning_rates))  # a round compares them

    def validate(self) -> None:
        # The upper bounds keep every answer and counter a signed 64-bit integer:
        # next_step is step + 1, and examples_applied sums batch sizes.
        if self.step < 0:
            raise InvalidArgument(f"step must be >= 0, got {self.step}")
        if self.step >= MAX_STEP:
            raise InvalidArgument(f"step must be < {MAX_STEP}, got {self.step}")
        if self.base_version < 0:
            raise InvalidArgument(f"base_version must be >= 0, got {self.base_version}")
        if self.batch_size < 0:
            raise InvalidArgument(f"batch_size must be >= 0, got {self.batch_size}")
        if self.batch_size > MAX_BATCH_SIZE:
            raise InvalidArgument(f"batch_size must be <= {MAX_BATCH_SIZE}, got {self.batch_size}")
        check_metrics(self.metrics)  # the learning rates: the store's (``check_learning_rates``), as it sets them


def check_metrics(metrics: Mapping[str, np.ndarray]) -> None:
    """Raise InvalidArgument unless ``metrics`` are at most MAX_METRICS named numeric
    arrays of at most MAX_METRIC_BYTES in all."""
    if len(metrics) > MAX_METRICS:
        raise InvalidArgument(f"a push carries at most {MAX_METRICS} metric tensors, got {len(metrics)}")
    total = 0
    for name, a in metrics.items():
        if not name:
            raise InvalidArgument("metric names must be non-empty")
        if not isinstance(a, np.ndarray) or a.dtype.kind not in "fi":
            raise InvalidArgument(f"metric {name!r} must be a float or integer array, got "
                                  f"{getattr(a, 'dtype', type(a).__name__)}")
        total += a.nbytes
    if total > MAX_METRIC_BYTES:
        raise InvalidArgument(f"a push's metrics hold at most {MAX_METRIC_BYTES} bytes, got {total}")


# What a push returns: the record the worker reads back (``ps_common.records``), by the
# name the modes use for it.
PushResult = PushReply


@dataclasses.dataclass(frozen=True)
class ModeStatus:
    round: int = 0
    waiting_for: tuple[int, ...] = ()
    rounds_timed_out: int = 0
    rounds_aborted: int = 0
    active_workers: tuple[int, ...] = ()
    max_ahead: int = 0  # SSP: the most steps any applied push was ahead of the slowest worker
    skipped_rounds: tuple[int, ...] = ()  # elastic sync: the rounds completed without an update (a loss scale's skip)


class Ticket:
    """The outcome of a call that may have to wait, settled once, from any thread.

    ``settle`` takes a result or an exception (the first settle wins); callbacks run in
    the settling thread (or at once, when added to a settled ticket) and must not block.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # leaf lock
        self._settled = threading.Event()
        self._outcome: Any = None
        self._callbacks: list[Callable[["Ticket"], None]] = []

    @classmethod
    def of(cls, call: Callable[[], Any]) -> "Ticket":
        """A ticket settled with what ``call()`` returns or raises (a call that never waits long)."""
        ticket = cls()
        try:
            ticket.settle(call())
        except Exception as e:
            ticket.settle(e)
        return ticket

    def settle(self, outcome: Any) -> bool:
        with self._lock:
            if self._settled.is_set():
                return False
            self._outcome = outcome
            self._settled.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True

    def done(self) -> bool:
        return self._settled.is_set()

    def add_done_callback(self, fn: Callable[["Ticket"], None]) -> None:
        with self._lock:
            if not self._settled.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def result(self, timeout: float | None = 0.0) -> Any:
        """The result, or the exception raised (a copy: each waiter its own traceback),
        waiting up to ``timeout`` seconds for it (None: no limit; 0, the default: not at
        all); TimeoutError when it is not settled by then."""
        if not self._settled.wait(timeout):
            raise TimeoutError(f"the ticket is not settled yet (waited {timeout:g} s)")
        if isinstance(self._outcome, BaseException):
            raise copy.copy(self._outcome)
        return self._outcome


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """The model on several shards where shard 0 decides what each update holds (elastic
    sync's micro-batches, async and ssp's tasks, sync's contributors with backup workers):
    every shard's address in shard order, and this one's index. Shard 0 commits each round
    it completes on the others (``Mode.follow``); they take what workers push them first."""

    shards: tuple[str, ...]
    shard: int

    def __post_init__(self) -> None:
        if len(self.shards) < 2 or not 0 <= self.shard < len(self.shards):
            raise InvalidArgument(f"a shard group names at least 2 shards and this one's index among them; got "
                                  f"shard {self.shard} of {list(self.shards)}")

    def as_dict(self) -> dict:
        return {"shards": list(self.shards), "shard": self.shard}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ShardGroup":
        return cls(tuple(str(a) for a in d["shards"]), int(d["shard"]))


# Shard 0 of a group: ``commit(round, contributors)`` starts the other shards' commits of a
# round it completed and returns a function that waits for them (raising PSError).
Commit = Callable[[int, tuple], Callable[[], None]]


class Mode:
    """What the server (``ParameterServer``) needs from a mode, and gives it.

    A mode is built with the store, the membership and the stats it shares with the
    server; everything else reaches it through these calls. What a mode does not
    support keeps the default here (no speculation, no dealt data, no restored round).
    """

    name: str  # ps_common.names.MODES (elastic sync is "sync")
    stats: Stats
    # Pushes are answered by whole rounds of every worker's (sync, elastic sync): a
    # dead-worker policy applies, and the values after a round stay current until the
    # worker pushes again unless backup workers let a round go on without it.
    rounds: bool = False
    # How the mode deals a data plan (``core.data.cursor.DataPlan``), as ``DataState.kind``:
    # "tasks" (async, ssp: ``deal_tasks``), "elastic" (elastic sync's micro-batches:
    # ``set_cursor``, ``work``) or "" (none: the workers read their own shards).
    data_plan: str = ""
    cursor: "Cursor | None" = None  # elastic sync: the job's data plan, once known
    ledger: "EpochLedger | None" = None  # elastic sync: every example's epoch, once the plan is known

    def submit(self, push: Push, consumed: Callable[[], None] | None = None) -> Ticket:
        """Take ``push``, checked already (``ParameterServer.submit``: its bounds, every
        gradient's name, shape, dtype and finiteness); the ticket its answer settles. Never
        waits. ``consumed`` is called once the mode no longer needs the push's gradient arrays."""
        raise NotImplementedError

    def expire_overdue(self) -> None:
        """End every wait whose time is up (``submit``'s tickets have no thread watching)."""

    def status(self) -> ModeStatus:
        raise NotImplementedError

    def workers_died(self, worker_ids: list[int]) -> None:
        """The lease check declared these workers dead."""

    def worker_joined(self, worker_id: int) -> None:
        """A worker registered (or registered again)."""

    def worker_left(self, worker_id: int) -> None:
        """A worker finished and said so (``ParameterServer.leave``)."""

    def worker_replaced(self, worker_id: int) -> None:
        """Another process took ``worker_id``'s index (a new incarnation, ``core.membership``):
        forget what the old one left behind, before ``worker_joined``."""

    def export_state(self) -> tuple["StoreState", ModeStatus]:
        """The store's snapshot and the mode's status, consistent with each other (checkpoints)."""
        raise NotImplementedError

    def export_round(self) -> tuple["StoreState", ModeStatus, tuple | None, dict]:
        """``export_state``, the ledger's state (None without one) and ``Stats.export``."""
        state, status = self.export_state()
        return state, status, None, self.stats.export()

    def restore(self, status: ModeStatus) -> None:
        """Start again from a checkpoint: at ``status.round``, nothing pending, its counters."""
        raise NotImplementedError

    def round_restored(self) -> bool:
        """Restored from a checkpoint and no push taken since (sync's ``RoundBook``)."""
        return False

    def deal_tasks(self, applying: Callable[[], ContextManager], applied: Callable[[Push, PushResult], None],
                   answered: Callable[[Push], "PushResult | None"] = lambda push: None) -> None:
        """``data_plan`` "tasks" (``core.data.tasks``): hold ``applying()`` around each push's apply,
        and call ``applied(push, result)`` under it once the push was applied or dropped;
        ``answered(push)`` is a done task's recorded answer (None: not done), asked first."""
        raise NotImplementedError(f"{self.name} mode deals no tasks")

    def set_cursor(self, cursor: "Cursor", ledger: "EpochLedger | None" = None) -> None:
        """``data_plan`` "elastic": the job's data plan (and a checkpoint's ledger)."""
        raise NotImplementedError(f"{self.name} mode deals no micro-batches")

    def work(self, worker_id: int) -> Ticket:
        """``data_plan`` "elastic": a ticket for this worker's micro-batches."""
        raise NotImplementedError(f"{self.name} mode deals no micro-batches")

    def overlap(self, worker_id: int, step: int, batch_size: int, gradients, set_learning_rates=(),
                sparse: bool = False, block_bytes: int = 0):
        """The speculation (``core.modes.overlap``) a streamed push joins; None: not speculated."""
        return None

    def offer(self, spec, worker_id: int, arrived) -> None:
        """Blocks of a push's gradients, [(name, block, gradient)], for a speculation ``overlap`` returned."""
        raise NotImplementedError(f"{self.name} mode speculates no rounds")

    def follow(self, shard: int, commit: "Commit | None") -> None:
        """A shard group (``ShardGroup``): this server is shard ``shard``; shard 0 gets
        ``commit`` and commits every round it completes on the others, which follow it. A
        mode whose updates each shard makes alone (async, sync without backup workers)
        ignores it."""

    def commit_round(self, round_: int, contributors: tuple) -> int:
        """A follower: shard 0 completed ``round_`` (of ``contributors``' pushes, with backup
        workers); apply this shard's part. The version after it."""
        raise InvalidArgument(f"CommitRound is shard 0's call to the shards that follow it; this server's "
                              f"{self.name} updates are its own")


class Stats:
    """Counters every mode keeps: pushes, examples, staleness, last loss. Thread-safe.

    Two events are not counted here but handed to optional observers (``ps_server.metrics``
    sets them for ``ps-server --metrics-port``): ``on_push(seconds)`` once a push is answered
    (applied, joined, dropped or replayed), with the seconds it spent in the mode: the
    apply, and in sync or ssp the wait for the others; ``on_apply(seconds)`` after each
    update, with the seconds of the update alone: sync, averaging the round's gradients and
    one optimizer step; async and ssp, one push's optimizer step over every variable.
    Observers are plain callables; they may run under a mode's lock, so they must be quick,
    take no lock of the core, and not raise.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # leaf lock
        self.pushes_applied = 0
        self.examples_applied = 0
        self.staleness_counts: dict[int, int] = {}
        self.last_loss = float("nan")
        self.dropped = 0
        self.replayed = 0
        self.scaled = 0  # async/SSP policy "scale": pushes applied with a reduced learning rate
        self.on_push: Callable[[float], None] | None = None
        self.on_apply: Callable[[float], None] | None = None

    def record(self, pushes: int, examples: int, staleness: list[int], loss: float) -> None:
        with self._lock:
            self.pushes_applied += pushes
            self.examples_applied += examples
            for s in staleness:
                self.staleness_counts[s] = self.staleness_counts.get(s, 0) + 1
            self.last_loss = loss

    def count(self, what: str, n: int = 1) -> None:
        """Bump one of the event counters: "dropped", "replayed" or "scaled"."""
        with self._lock:
            setattr(self, what, getattr(self, what) + n)

    def pushed(self, seconds: float) -> None:
        """A push was answered after ``seconds`` in the mode: tell the observer, if any."""
        if self.on_push is not None:
            self.on_push(seconds)

    def applied(self, seconds: float) -> None:
        """An update took ``seconds``: tell the observer, if any."""
        if self.on_apply is not None:
            self.on_apply(seconds)

    def staleness_histogram(self) -> dict[int, int]:
        """staleness -> how many applied pushes had it (a copy)."""
        with self._lock:
            return dict(self.staleness_counts)

    def export(self) -> dict:
        """The counters as plain JSON-able values (for a checkpoint)."""
        with self._lock:
            return {
                "pushes_applied": self.pushes_applied,
                "examples_applied": self.examples_applied,
                "staleness_counts": {str(s): c for s, c in sorted(self.staleness_counts.items())},
                "last_loss": self.last_loss if math.isfinite(self.last_loss) else None,  # JSON has no NaN/Inf
                "dropped": self.dropped,
                "replayed": self.replayed,
                "scaled": self.scaled,
            }

    def restore(self, counters: Mapping) -> None:
        """Load counters written by ``export``; missing ones keep their value."""
        with self._lock:
            for name in ("pushes_applied", "examples_applied", "dropped", "replayed", "scaled"):
                if name in counters:
                    setattr(self, name, int(counters[name]))
            if "staleness_counts" in counters:
                self.staleness_counts = {int(s): int(c) for s, c in counters["staleness_counts"].items()}
            if "last_loss" in counters:
                loss = counters["last_loss"]
                self.last_loss = float("nan") if loss is None else float(loss)

    def staleness_summary(self) -> tuple[float, int]:
        with self._lock:
            n = sum(self.staleness_counts.values())
            if not n:
                return 0.0, 0
            mean = sum(s * c for s, c in self.staleness_counts.items()) / n
            return mean, max(self.staleness_counts)
