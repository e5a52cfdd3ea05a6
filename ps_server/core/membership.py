"""Who is in the cluster: registered workers, their leases, and what each last did.

    members = Membership(num_workers=2, lease_timeout=10.0)
    members.register(worker_index=0, claimed_num_workers=2, name="host:1234")
    members.register(AUTO_INDEX).worker_id   # the server picks: lowest free index
    members.require(0)            # renews the lease; UnknownWorker if never registered or dead
    newly_dead = members.expire() # workers silent for longer than the lease timeout
    members.register(1, at=(7, 7))  # ``at``: the (round, version) the server is at, for the history
    members.register(1, process="4f1c...")  # a process token: the same process again, or a new incarnation
    members.history()             # [MembershipEvent(wall_time, round, version, "joined", 1, name), ...]

A worker holds a lease, renewed by every call it makes (``require``) and by
heartbeats. ``expire`` declares dead every registered, not-yet-left worker whose
lease ran out; from then on its calls are refused (UnknownWorker, "declared
dead") until it registers again. Registering an index again (a restarted or
replacement worker) replaces its record and revives it.

A worker that does not know its index (identical containers scaled by
``docker compose --scale``) registers with ``AUTO_INDEX`` and gets the lowest
index nobody registered yet, else the lowest one whose worker was declared dead
(it replaces that worker); never one whose worker finished (left) or is alive.

Incarnations: a worker process sends a token of its own (``process``, random per
process). A registration of an index by another process than the one holding it (a
restarted worker on its old index, ``AUTO_INDEX`` handed a dead worker's) is a new
incarnation of the index: the record's ``incarnation`` goes up by one, and the server
forgets what it remembered of the old one (``ParameterServer.register``: its last step
and replay record, its held tasks). The same process registering again (a rejoin after
a lease it missed, or after the server restarted) keeps its incarnation. A process whose
index another process has since taken is refused when it registers again
(``Superseded``): it must not act for an index that is not its own any more. A
registration without a token is a new incarnation every time.

Membership over time: every change is recorded as a ``MembershipEvent`` (wall
time, the round and version the caller says the server is at, what happened, the
worker): ``joined`` (a first registration of the index, or a new worker on an
index whose worker left), ``rejoined`` (registered again while its record was
alive or declared dead: a restart, a replacement, a worker that missed its
lease), ``left`` and ``dead``. The newest ``HISTORY_LIMIT`` are kept; ``dropped``
counts the older ones let go. A checkpoint's restore records nothing; its
workers get a longer first lease (``restore``'s ``grace``) and count for
``finished`` only once they called again or that lease ran out.

Thread-safe: one small lock guards the table and the history and is never held
while calling out. Both clocks are injected, so tests drive time by hand.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

from ps_common.defaults import LEASE_TIMEOUT
from ps_common.reasons import Reason
from ps_server.core.errors import ConfigMismatch, InvalidArgument, NoFreeIndex, Superseded, UnknownWorker

AUTO_INDEX = -1  # register(AUTO_INDEX): the server assigns the index


@dataclasses.dataclass
class WorkerRecord:
    worker_id: int
    name: str
    registered_at: float
    last_seen: float
    last_step: int = -1
    pushes: int = 0
    dropped: int = 0
    left: bool = False
    dead: bool = False
    dead_since: float = 0.0
    # Where a worker's time goes, as moving averages over its recent pushes (see record_push):
    # work_s: between the end of its previous push and the arrival of this one (its pull,
    # compute and upload); wait_s: inside the server's push (applying, and in sync or ssp
    # the wait for the others). A straggler has a large work_s; the workers it holds up a large wait_s.
    work_s: float = 0.0
    wait_s: float = 0.0
    last_push_done: float = 0.0
    process: str = ""  # the registered process's own token ("" when it sent none)
    incarnation: int = 0  # how many processes held this index: 1 for the first, +1 for each new one
    replaced: bool = False  # this process took the index from another, which had not left


SUPERSEDED_KEPT = 64  # per index: the tokens of the processes that held it before, refused if they come back
HISTORY_LIMIT = 1000  # membership events kept (the newest); a job's churn, not its pushes

JOINED, REJOINED, LEFT, DEAD = "joined", "rejoined", "left", "dead"
NOWHERE = (-1, -1)  # (round, version) when the caller does not say


@dataclasses.dataclass(frozen=True)
class MembershipEvent:
    """One change of membership: at ``wall_time`` (seconds since the epoch), with the
    server at ``round`` (sync: the round collecting pushes) and ``version``, ``event``
    (JOINED, REJOINED, LEFT or DEAD) happened to worker ``worker_id``."""

    wall_time: float
    round: int
    version: int
    event: str
    worker_id: int
    name: str = ""


AVERAGE_WEIGHT = 0.2  # weight of the newest sample in work_s and wait_s (after the first few)


def _average(mean: float, sample: float, n: int) -> float:
    """A running mean over the first 1/AVERAGE_WEIGHT samples, then an exponential average."""
    if n <= 1:
        return sample
    return mean + (sample - mean) * max(AVERAGE_WEIGHT, 1.0 / n)


def _superseded(worker_id: int, holder: "WorkerRecord | None") -> Superseded:
    """The refusal of a process whose index ``holder``'s process took since."""
    name = f" ({holder.name})" if holder is not None and holder.name else ""
    return Superseded(f"worker index {worker_id} is held by another process{name} now; this process must stop: "
                      f"it no longer trains as worker {worker_id}")


class Membership:
    def __init__(self, num_workers: int, lease_timeout: float = LEASE_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 history_limit: int = HISTORY_LIMIT):
        if num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {num_workers}")
        if not lease_timeout > 0:
            raise InvalidArgument(f"lease_timeout must be > 0, got {lease_timeout}")
        self.num_workers = num_workers
        self.lease_timeout = lease_timeout
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()  # guards _workers and the history; leaf lock, nothing is called under it
        self._workers: dict[int, WorkerRecord] = {}
        self._history: collections.deque[MembershipEvent] = collections.deque(maxlen=history_limit)
        self._events = 0  # ever recorded: len(_history) + dropped
        self._restored: set[int] = set()  # a checkpoint's workers not heard from since (``restore``)
        self._restore_grace = 0.0
        self._superseded: dict[int, collections.deque[str]] = {}  # index -> tokens of its earlier processes

    def _record(self, event: str, worker_id: int, name: str, at: tuple[int, int]) -> None:
        """Under the lock: one event into the bounded history."""
        self._history.append(MembershipEvent(self._wall_clock(), at[0], at[1], event, worker_id, name))
        self._events += 1

    def history(self) -> list[MembershipEvent]:
        """The membership events kept, oldest first."""
        with self._lock:
            return list(self._history)

    @property
    def dropped(self) -> int:
        """Events recorded but no longer kept (older than the newest ``history_limit``)."""
        with self._lock:
            return self._events - len(self._history)

    def register(self, worker_index: int, claimed_num_workers: int = 0, name: str = "",
                 at: tuple[int, int] = NOWHERE, process: str = "") -> WorkerRecord:
        """The index's new record (a copy). ``process``: the registering process's token; its
        ``incarnation`` is the old record's when the same process registers again, one more
        otherwise (module docstring). Superseded when another process took the index since
        this one held it."""
        who = "a worker" if worker_index == AUTO_INDEX else f"worker {worker_index}"
        if claimed_num_workers and claimed_num_workers != self.num_workers:
            raise ConfigMismatch(
                f"{who} was started with --num-workers {claimed_num_workers} "
                f"but the server runs with {self.num_workers}"
            )
        if worker_index != AUTO_INDEX and not 0 <= worker_index < self.num_workers:
            raise InvalidArgument(
                f"worker index {worker_index} is outside 0..{self.num_workers - 1} "
                f"(the server runs with {self.num_workers} workers)"
            )
        now = self._clock()
        with self._lock:
            if worker_index == AUTO_INDEX:
                worker_index = self._free_index()
            old = self._workers.get(worker_index)
            if process and process in self._superseded.get(worker_index, ()):
                raise _superseded(worker_index, old)
            same = old is not None and bool(process) and old.process == process  # a rejoin, not a new process
            incarnation = (old.incarnation if old is not None else 0) + (0 if same else 1)
            record = WorkerRecord(worker_id=worker_index, name=name, registered_at=now, last_seen=now,
                                  process=process, incarnation=incarnation,
                                  replaced=old is not None and not old.left and not same)
            if old is not None:  # keep the counters of the index across restarts
                record.last_step, record.pushes, record.dropped = old.last_step, old.pushes, old.dropped
                if old.process and not same:
                    self._superseded.setdefault(worker_index, collections.deque(maxlen=SUPERSEDED_KEPT)).append(
                        old.process)
            self._workers[worker_index] = record
            self._restored.discard(worker_index)
            self._record(JOINED if old is None or old.left else REJOINED, worker_index, name, at)
        return dataclasses.replace(record)

    def _free_index(self) -> int:
        """Under the lock: the index an AUTO_INDEX registration gets, or NoFreeIndex."""
        for i in range(self.num_workers):
            if i not in self._workers:
                return i
        for i in range(self.num_workers):
            rec = self._workers[i]
            if rec.dead and not rec.left:
                return i
        left = sorted(i for i, r in self._workers.items() if r.left)
        raise NoFreeIndex(
            f"all {self.num_workers} worker indexes are taken (alive: "
            f"{sorted(i for i, r in self._workers.items() if not r.left)}, finished: {left}); "
            f"a worker declared dead (silent for {self.lease_timeout:g} s) frees its index for a replacement"
        )

    def restore(self, records: list[WorkerRecord], grace: float = 0.0) -> None:
        """Load records from a checkpoint: known indexes, leases starting now. Until it calls
        (registers again, or any call of a worker that kept its registration), a restored
        worker's lease is at least ``grace`` seconds (the time to start again: a requeued job's
        workers start anew, not only the server), and until then it counts as not registered
        for ``finished``."""
        now = self._clock()
        with self._lock:
            self._restore_grace = grace
            for r in records:
                if 0 <= r.worker_id < self.num_workers:
                    self._restored.add(r.worker_id)
                    self._workers[r.worker_id] = dataclasses.replace(r, last_seen=now, registered_at=now,
                                                                     dead=False, dead_since=0.0,
                                                                     last_push_done=0.0)  # another clock

    def require(self, worker_id: int, process: str = "") -> None:
        """Raise unless the worker is registered and alive; renews its lease. With ``process``
        (a heartbeat's), Superseded when another process holds the index now; UnknownWorker
        when the index's record is a checkpoint's of another process, not heard from since
        (a newer process may have taken the index after that checkpoint: it registers again)."""
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is None:
                raise UnknownWorker(f"worker {worker_id} is not registered; call Register first")
            if process and rec.process and process != rec.process:
                if worker_id in self._restored:  # a checkpoint's record: the process may have been replaced since
                    raise UnknownWorker(f"worker {worker_id} of this server's checkpoint was another process; "
                                        "register again")
                raise _superseded(worker_id, rec)
            if rec.dead:
                raise UnknownWorker(
                    f"worker {worker_id} was declared dead (no call or heartbeat for more than "
                    f"{self.lease_timeout:g} s); register again to rejoin", reason=Reason.DECLARED_DEAD
                )
            rec.last_seen = self._clock()
            self._restored.discard(worker_id)  # heard from since the restore

    heartbeat = require

    def record_push(self, worker_id: int, step: int, dropped: bool = False, arrived: float | None = None,
                    done: float | None = None) -> None:
        """Count a push; with its ``arrived`` and ``done`` times (this membership's clock),
        update the worker's work_s and wait_s averages."""
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is not None:
                rec.last_step = max(rec.last_step, step)
                rec.pushes += 1
                rec.dropped += int(dropped)
                rec.last_seen = self._clock()
                if arrived is not None and done is not None:
                    rec.wait_s = _average(rec.wait_s, done - arrived, rec.pushes)
                    if rec.last_push_done and arrived >= rec.last_push_done:
                        rec.work_s = _average(rec.work_s, arrived - rec.last_push_done, rec.pushes - 1)
                    rec.last_push_done = done

    def leave(self, worker_id: int, at: tuple[int, int] = NOWHERE) -> None:
        self.require(worker_id)
        with self._lock:
            rec = self._workers[worker_id]
            if not rec.left:  # a repeated Leave is no second event
                rec.left = True
                self._record(LEFT, worker_id, rec.name, at)

    def expire(self, at: tuple[int, int] = NOWHERE) -> list[int]:
        """Declare dead every live, registered, not-left worker whose lease ran out; returns them."""
        now = self._clock()
        newly = []
        with self._lock:
            for w, rec in sorted(self._workers.items()):
                lease = max(self.lease_timeout, self._restore_grace) if w in self._restored else self.lease_timeout
                if not rec.dead and not rec.left and now - rec.last_seen > lease:
                    rec.dead, rec.dead_since = True, now
                    newly.append(w)
                    self._record(DEAD, w, rec.name, at)
        return newly

    def is_dead(self, worker_id: int) -> bool:
        with self._lock:
            rec = self._workers.get(worker_id)
            return rec is not None and rec.dead

    def name_of(self, worker_id: int) -> str:
        with self._lock:
            rec = self._workers.get(worker_id)
        return rec.name if rec is not None and rec.name else ""

    def describe(self, worker_ids) -> str:
        """'1 (host:77)' style names for error messages."""
        parts = []
        for w in worker_ids:
            name = self.name_of(w)
            parts.append(f"{w} ({name})" if name else str(w))
        return ", ".join(parts)

    def finished(self, every_index: bool = True) -> tuple[bool, list[int], list[int]]:
        """(done, left, dead): done once every index registered and each worker
        since either left (finished) or was declared dead, so nobody trains.
        ``every_index=False`` (elastic jobs, which may never fill every index): done once
        some worker finished and every registered one left or was declared dead.
        A worker restored from a checkpoint counts once it called again, or was declared dead
        after ``restore``'s grace (``every_index``: or if it had finished): a restarted server,
        or a requeued job's, waits for its workers to start again rather than take their old
        records as the end; an elastic one, for a worker of its own to finish."""
        with self._lock:
            workers = {i: r for i, r in self._workers.items()
                       if i not in self._restored or r.dead or (every_index and r.left)}
            left = sorted(i for i, r in workers.items() if r.left)
            dead = sorted(i for i, r in workers.items() if r.dead and not r.left)
            registered = len(workers)
            if every_index:
                done = registered == self.num_workers and len(left) + len(dead) == self.num_workers
            else:
                done = bool(left) and len(left) + len(dead) == registered
        return done, left, dead

    def snapshot(self) -> list[WorkerRecord]:
        with self._lock:
            return [dataclasses.replace(r) for _, r in sorted(self._workers.items())]
