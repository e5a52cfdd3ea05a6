"""Stale synchronous parallel (SSP): async apply, but nobody runs more than S steps ahead.

    mode = SSPMode(store, members, staleness_bound=2, barrier_timeout=60.0)
    ticket = mode.submit(push)   # applied on arrival; settled once the worker may start its next step

Each push is applied the moment it arrives, exactly as in ``async_mode`` (the
same apply, ``"locked"`` or ``"hogwild"``, same exactly-once record, same
stale-gradient policies). What
SSP adds is a bound on how far the workers drift apart. A worker's *clock* is the
number of steps it completed (its last applied step + 1). A worker may start step
t only when every participating worker's clock is at least t - S; the reply to
its push of step t - 1 (its ticket) is held until then, and it pulls only after
that reply. So:

- S = 0 is lockstep (bulk synchronous): step t starts once everyone finished
  step t - 1, and its pull sees all of their updates. Unlike ``sync`` mode the
  N gradients of a step are applied one by one, not averaged into one update.
- S = infinity is ``async``: nobody ever waits.
- In between, a fast worker runs at most S steps ahead of the slowest, and the
  staleness of what it reads is bounded accordingly.

Participating workers: every index 0..N-1 that has not left (finished) and is
not declared dead. An index that never registered counts with clock 0, so no
one races ahead before the cluster is complete; a dead worker stops holding
the others back (its replacement rejoins with its own step, and may then be
behind by more than S until it catches up).

A wait longer than ``barrier_timeout`` ends (at ``expire_overdue``) in
``BarrierTimeout`` naming the workers that hold it; the push itself was applied
(a retry is answered from the record and waits again). A death or a departure
releases the waits it held at the next ``expire_overdue`` or push.

The server's own record of the bound: for every applied push, how many steps
its worker was ahead of the slowest participating clock at that moment
(``ahead``); ``max_ahead`` is reported in the status, and ``records`` keeps the
most recent ones for tests and reports. Without deaths and rejoins, ahead <= S.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

from ps_common.defaults import BARRIER_TIMEOUT, MAX_STALENESS
from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.errors import BarrierTimeout, InvalidArgument, PSError
from ps_server.core.membership import Membership
from ps_server.core.modes.base import ModeStatus, Push, PushResult, Stats, Ticket
from ps_server.core.store import StoreState, VariableStore

RECORDS_KEPT = 100_000
UNBOUNDED = 2**62  # a staleness bound no run reaches: async pacing


@dataclasses.dataclass(frozen=True)
class SSPRecord:
    worker_id: int
    step: int
    slowest_clock: int  # the smallest participating clock when the push was applied
    ahead: int  # step - slowest_clock


class SSPMode(AsyncMode):
    name = "ssp"

    def __init__(self, store: VariableStore, members: Membership, staleness_bound: int,
                 barrier_timeout: float = BARRIER_TIMEOUT, stats: Stats | None = None,
                 stale_policy: str = "none", max_staleness: int = MAX_STALENESS, clock: Callable[[], float] = time.monotonic,
                 apply: str = "locked"):
        if staleness_bound < 0:
            raise InvalidArgument(f"the staleness bound must be >= 0, got {staleness_bound}")
        super().__init__(store, members, stats, stale_policy=stale_policy,
                         max_staleness=max_staleness, apply=apply)
        self.staleness_bound = staleness_bound
        self.barrier_timeout = barrier_timeout
        self._now = clock
        self._lock = threading.Lock()  # guards _clocks, records, max_ahead, _waiting
        self._clocks = [0] * members.num_workers
        # Workers that come and go (the server hands out tasks, ``deal_tasks``): only the
        # workers registered and live take part, and one that joins starts at the slowest
        # of them, not at 0 (it would hold every other back until it caught up).
        self._elastic = False
        self.records: collections.deque[SSPRecord] = collections.deque(maxlen=RECORDS_KEPT)
        self.max_ahead = 0
        # submit()'s pushes waiting for the bound: (ticket, worker, step to start, clock needed,
        # deadline, the push's result)
        self._waiting: list[tuple[Ticket, int, int, int, float, PushResult]] = []

    def deal_tasks(self, applying, applied, answered=lambda push: None) -> None:
        super().deal_tasks(applying, applied, answered)
        self._elastic = True

    def _participants(self) -> list[int]:
        """Indexes not left and not dead. Also raises each clock to what membership
        recorded (after a restart from a checkpoint, the workers' restored last steps)."""
        records = self.members.snapshot()
        with self._lock:
            for r in records:
                self._clocks[r.worker_id] = max(self._clocks[r.worker_id], r.last_step + 1)
        gone = {r.worker_id for r in records if r.left or r.dead}
        if self._elastic:
            return sorted(r.worker_id for r in records if r.worker_id not in gone)
        return [w for w in range(self.members.num_workers) if w not in gone]

    def _slowest(self, participants: list[int]) -> int:
        return min((self._clocks[w] for w in participants), default=UNBOUNDED)

    def _apply(self, push: Push) -> PushResult:
        # Runs under the pushing worker's lock (AsyncMode._push), for a step not applied before.
        participants = self._participants()
        with self._lock:
            slowest = self._slowest(participants)
            ahead = max(0, push.step - slowest) if slowest != UNBOUNDED else 0
            self.records.append(SSPRecord(push.worker_id, push.step, slowest, ahead))
            self.max_ahead = max(self.max_ahead, ahead)
        result = super()._apply(push)
        with self._lock:
            self._clocks[push.worker_id] = max(self._clocks[push.worker_id], push.step + 1)
        self._release_waiting()
        return result

    def submit(self, push: Push, consumed=None) -> Ticket:
        """Apply ``push`` (or answer it from the record) here (``core.modes``); the ticket is
        settled once the worker may start its next step, or with ``BarrierTimeout`` by
        ``expire_overdue``."""
        started = time.perf_counter()
        ticket = Ticket()
        ticket.add_done_callback(lambda _: self.stats.pushed(time.perf_counter() - started))
        try:
            result = self._push(push)  # applied, or answered from the record
        except PSError as e:
            ticket.settle(e)
            return ticket
        need = push.step + 1 - self.staleness_bound
        if need <= 0:
            ticket.settle(result)
            return ticket
        with self._lock:
            self._waiting.append((ticket, push.worker_id, push.step + 1, need, self._now() + self.barrier_timeout,
                                  result))
        self._release_waiting()
        return ticket

    def expire_overdue(self) -> None:
        self._release_waiting()

    def _release_waiting(self) -> None:
        """Settle the waiting tickets whose workers may go on (or whose time is up)."""
        if not self._waiting:
            return
        participants = self._participants()
        now, settled = self._now(), []
        with self._lock:
            keep = []
            for entry in self._waiting:
                ticket, worker_id, step, need, deadline, result = entry
                behind = [w for w in participants if self._clocks[w] < need and w != worker_id]
                if not behind:
                    settled.append((ticket, result))
                elif now >= deadline:
                    settled.append((ticket, self._timeout(worker_id, step, need, behind)))
                else:
                    keep.append(entry)
            self._waiting = keep
        for ticket, outcome in settled:
            ticket.settle(outcome)

    def _timeout(self, worker_id: int, step: int, need: int, behind: list[int]) -> BarrierTimeout:
        return BarrierTimeout(
            f"ssp: worker {worker_id} may not start step {step} before worker(s) "
            f"{self.members.describe(behind)} finish step {need - 1} (staleness bound "
            f"{self.staleness_bound}); waited {self.barrier_timeout:g} s. Its push of step "
            f"{step - 1} was applied", missing=tuple(behind))

    def status(self) -> ModeStatus:
        participants = self._participants()
        with self._lock:
            slowest = self._slowest(participants)
            waiting = tuple(w for w in participants if self._clocks[w] == slowest) if participants else ()
            return ModeStatus(round=slowest if slowest != UNBOUNDED else 0, waiting_for=waiting,
                              active_workers=tuple(participants), max_ahead=self.max_ahead)

    def worker_joined(self, worker_id: int) -> None:
        """Elastic: a worker joining (or rejoining) starts at the slowest live one's clock."""
        if not self._elastic:
            return
        others = [w for w in self._participants() if w != worker_id]
        with self._lock:
            slowest = self._slowest(others)
            if slowest != UNBOUNDED:
                self._clocks[worker_id] = max(self._clocks[worker_id], slowest)
        self._release_waiting()

    def workers_died(self, worker_ids: list[int]) -> None:
        self._release_waiting()

    def export_state(self) -> tuple[StoreState, ModeStatus]:
        return self._snapshot(), self.status()

    def restore(self, status: ModeStatus) -> None:
        """As async: forget each worker's last step. The clocks start again from the
        restored membership's last steps (see ``_participants``)."""
        super().restore(status)
        with self._lock:
            self._clocks = [0] * self.members.num_workers
