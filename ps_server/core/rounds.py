"""Bookkeeping of synchronous rounds: plain, single-threaded, deterministic.

    book = RoundBook(num_workers=2)
    book.add(worker_id=0, step=0, item=g0)   # -> False: still waiting for 1
    book.add(worker_id=1, step=0, item=g1)   # -> True: the round is full
    items = book.take()                      # [g0, g1] in worker-id order; round 1 starts

Round ``r`` collects exactly one push per worker for step ``r``. A push for an
earlier round (``step < round``) or a later one (``step > round``) is refused,
and so is a second push of the same worker in a round. ``abort()`` throws the
round's pushes away without advancing it (the barrier timed out): the workers
may push the same step again.

Each completion or abort starts a new *generation*, so a waiter can tell that
the round it joined has ended even when the next round has the same number
(after an abort) or has already started (a fast worker). This class has no
locks and no clock; ``sync_mode.SyncMode`` wraps it with both.
"""

from __future__ import annotations

from typing import Any

from ps_server.core.errors import DuplicatePush, FutureRound, InvalidArgument, StaleRound


class RoundBook:
    def __init__(self, num_workers: int, start_round: int = 0):
        if num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.round = start_round
        self.generation = 0
        self._pending: dict[int, Any] = {}

    def check(self, worker_id: int, step: int) -> None:
        """Raise if ``add(worker_id, step, ...)`` would be refused; changes nothing."""
        if not 0 <= worker_id < self.num_workers:
            raise InvalidArgument(f"worker id {worker_id} is outside 0..{self.num_workers - 1}")
        if step < self.round:
            raise StaleRound(
                f"push from worker {worker_id} for step {step} is late: round {step} "
                f"already completed (the server is collecting round {self.round})"
            )
        if step > self.round:
            raise FutureRound(
                f"push from worker {worker_id} for step {step} is early: round {self.round} "
                f"has not completed yet"
            )
        if worker_id in self._pending:
            raise DuplicatePush(f"worker {worker_id} already pushed for round {self.round}")

    def add(self, worker_id: int, step: int, item: Any) -> bool:
        """Record one push; True when every worker has pushed this round."""
        self.check(worker_id, step)
        self._pending[worker_id] = item
        return len(self._pending) == self.num_workers

    def pushed(self) -> tuple[int, ...]:
        return tuple(sorted(self._pending))

    def missing(self) -> tuple[int, ...]:
        return tuple(w for w in range(self.num_workers) if w not in self._pending)

    def peek(self) -> list[Any]:
        """This round's items in worker-id order, leaving the round as it is."""
        return [self._pending[w] for w in sorted(self._pending)]

    def take(self) -> list[Any]:
        """Hand out the full round's items in worker-id order and start the next round."""
        if len(self._pending) != self.num_workers:
            raise RuntimeError(f"round {self.round} is not full: missing {self.missing()}")
        items = [self._pending[w] for w in sorted(self._pending)]
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
