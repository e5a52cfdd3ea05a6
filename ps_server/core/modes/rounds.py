"""Bookkeeping of synchronous rounds: plain, single-threaded, deterministic.

    book = RoundBook(num_workers=2)
    book.add(worker_id=0, step=0, item=g0)   # -> False: still waiting for 1
    book.add(worker_id=1, step=0, item=g1)   # -> True: the round is full
    items = book.take()                      # [g0, g1] in worker-id order; round 1 starts

Round ``r`` collects one push per *active* worker for step ``r`` and is full
when ``quorum`` of them have pushed (all active workers by default; fewer with
backup workers). A push for a later round (``step > round``) is refused, and so
is a push from a worker that is not active. ``check`` classifies a push for an
earlier round: it was part of that round (``"replay"``: answer from the record),
or the round completed without it (``"late"``). A second push of the same
worker in the current round is ``"join"``: it waits for the same outcome as the
first (idempotent retry).

A book that starts from a checkpoint (``restored=True``) takes its first push
for any later round too, and collects that round from then on: a shard restored
from an older checkpoint than the others kept then counts rounds as they do
(the rounds in between are lost, as with one server), and no worker needs its
own idea of how far behind each shard is. The first push taken ends that.

``abort()`` throws the round's pushes away without advancing it: the same
round starts over. Each completion or abort starts a new *generation*, so a
waiter can tell that the round it joined has ended even when the next round
has the same number (after an abort) or has already started (a fast worker).

Membership changes (``deactivate`` for the shrink policy, ``activate`` when a
worker rejoins) take effect at once. This class has no locks and no clock;
``sync_mode.SyncMode`` wraps it with both.
"""

from __future__ import annotations

from typing import Any

from ps_common.reasons import Reason
from ps_server.core.errors import DuplicatePush, FutureRound, InvalidArgument, StaleRound, UnknownWorker

# How many completed rounds remember who contributed (for replays of lost replies).
ROUNDS_REMEMBERED = 16


class RoundBook:
    def __init__(self, num_workers: int, start_round: int = 0, quorum: int = 0, restored: bool = False):
        if num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {num_workers}")
        if not 0 <= quorum <= num_workers:
            raise InvalidArgument(f"quorum must be in 0..{num_workers}, got {quorum}")
        self.num_workers = num_workers
        self.quorum = quorum  # 0: every active worker
        self.round = start_round
        self.restored = restored  # the first push may name a later round (module docstring)
        self.generation = 0
        self.active: set[int] = set(range(num_workers))
        self._pending: dict[int, Any] = {}
        self._contributors: dict[int, frozenset[int]] = {}  # completed round -> who was in it

    @property
    def needed(self) -> int:
        """Pushes that complete the current round."""
        return min(self.quorum, len(self.active)) if self.quorum else len(self.active)

    def check(self, worker_id: int, step: int) -> str:
        """How ``add(worker_id, step, ...)`` would be taken: "new", "join", "replay" or "late".

        Raises, changing nothing, for a push that can never be taken.
        """
        if not 0 <= worker_id < self.num_workers:
            raise InvalidArgument(f"worker id {worker_id} is outside 0..{self.num_workers - 1}")
        if step < self.round:
            contributors = self._contributors.get(step)
            if contributors is not None and worker_id in contributors:
                return "replay"
            if self.quorum and contributors is not None:
                return "late"
            raise StaleRound(
                f"push from worker {worker_id} for step {step} is late: round {step} "
                f"already completed (the server is collecting round {self.round})"
            )
        if step > self.round and not (self.restored and not self._pending):
            raise FutureRound(
                f"push from worker {worker_id} for step {step} is early: round {self.round} "
                f"has not completed yet"
            )
        if worker_id not in self.active:
            raise UnknownWorker(
                f"worker {worker_id} is not part of sync round {self.round} (it was dropped from the "
                f"cluster); register again to rejoin", reason=Reason.NOT_IN_ROUND
            )
        return "join" if worker_id in self._pending else "new"

    def add(self, worker_id: int, step: int, item: Any) -> bool:
        """Record one new push (``check`` said "new"); True when the round is full."""
        kind = self.check(worker_id, step)
        if kind == "join":
            raise DuplicatePush(f"worker {worker_id} already pushed for round {self.round}")
        if kind != "new":
            raise StaleRound(f"push from worker {worker_id} for step {step} is late: round {step} already completed")
        if step > self.round:  # restored: the first push sets the round collected from now on
            self.round = step
        self.restored = False
        self._pending[worker_id] = item
        return self.full()

    def full(self) -> bool:
        """Every active worker pushed (or, with a quorum, that many pushes arrived).

        A push made by a worker that was deactivated afterwards still counts: it
        was computed on this round's parameters.
        """
        if not self._pending:
            return False
        if self.quorum:
            return len(self._pending) >= self.needed
        return self.active <= self._pending.keys()

    def pushed(self) -> tuple[int, ...]:
        return tuple(sorted(self._pending))

    def missing(self) -> tuple[int, ...]:
        return tuple(w for w in sorted(self.active) if w not in self._pending)

    def peek(self) -> list[Any]:
        """This round's items in worker-id order, leaving the round as it is."""
        return [self._pending[w] for w in sorted(self._pending)]

    def take(self, only: Any = None) -> list[Any]:
        """Hand out the full round's items in worker-id order and start the next round.
        ``only`` (workers who pushed): the round is theirs, whether or not it is full (a shard
        that follows shard 0's choice of contributors); the others' pushes are late."""
        if only is None and not self.full():
            raise RuntimeError(f"round {self.round} is not full: missing {self.missing()}")
        chosen = sorted(self._pending) if only is None else sorted(only)
        items = [self._pending[w] for w in chosen]
        self._contributors[self.round] = frozenset(chosen)
        self._contributors.pop(self.round - ROUNDS_REMEMBERED, None)
        self._pending.clear()
        self.round += 1
        self.generation += 1
        return items

    def abort(self) -> tuple[int, ...]:
        """Drop this round's pushes; the same round starts over. Returns who was missing."""
        missing = self.missing()
        self._pending.clear()
        self.generation += 1
        return missing

    def deactivate(self, worker_id: int) -> None:
        """Stop expecting this worker (shrink). A push it already made this round stays."""
        self.active.discard(worker_id)

    def activate(self, worker_id: int) -> None:
        self.active.add(worker_id)
