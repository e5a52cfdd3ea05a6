"""Synchronous mode: one barrier per step.

    mode = SyncMode(store, members, num_workers=2, barrier_timeout=60.0)
    result = mode.push(push)     # blocks until all workers pushed this round

Round ``r`` waits until each of the N workers has pushed step ``r``. The thread
whose push fills the round aggregates the gradients (batch-weighted mean, in
worker-id order: ``aggregation.weighted_mean``), applies the optimizer once,
bumps the version, and only then are all pushes of the round answered, each
with the new version. Every worker therefore pulls the same parameters for
round ``r + 1``; the result equals one optimizer step on the whole global batch.

Guarantees:
- a gradient is applied at most once, and only as part of a full round;
- a push for a completed round (``StaleRound``), a future round
  (``FutureRound``) or a second push in a round (``DuplicatePush``) is refused
  and changes nothing;
- a round that does not fill within ``barrier_timeout`` seconds of its first
  push is discarded (parameters unchanged) and every waiting push fails with
  ``BarrierTimeout`` naming the workers that never pushed; the workers may
  push that step again.

Threading: ``RoundBook`` is the deterministic core; this class owns the one
lock around it and the condition ``_round_ended`` (a generation ended:
completed or aborted). The aggregation and apply run under the lock: no push
of the next round can arrive before it ends anyway, since every worker is
waiting. Nothing here does network I/O.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Callable

from ps_server.core.aggregation import weighted_loss, weighted_mean
from ps_server.core.errors import BarrierTimeout, InvalidArgument, PSError
from ps_server.core.membership import Membership
from ps_server.core.modes import ModeStatus, Push, PushResult, Stats
from ps_server.core.rounds import RoundBook
from ps_server.core.store import VariableStore

# How many ended generations keep their outcome for waiters that wake late.
_OUTCOMES_KEPT = 8


class SyncMode:
    name = "sync"

    def __init__(
        self,
        store: VariableStore,
        members: Membership,
        num_workers: int,
        barrier_timeout: float,
        stats: Stats | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if barrier_timeout <= 0:
            raise InvalidArgument(f"barrier_timeout must be > 0, got {barrier_timeout}")
        self.store = store
        self.members = members
        self.barrier_timeout = barrier_timeout
        self.stats = stats or Stats()
        self._clock = clock
        self._lock = threading.Lock()
        self._round_ended = threading.Condition(self._lock)
        self._book = RoundBook(num_workers, start_round=store.version)
        self._outcomes: dict[int, PushResult | PSError] = {}
        self._rounds_timed_out = 0

    def push(self, push: Push) -> PushResult:
        push.validate()
        self.store.check_gradients(push.gradients)
        with self._lock:
            self._book.check(push.worker_id, push.step)
            if push.base_version != self.store.version:
                raise InvalidArgument(
                    f"worker {push.worker_id} computed its gradient for round {push.step} on version "
                    f"{push.base_version}, but sync round {push.step} is on version {self.store.version}; pull first"
                )
            full = self._book.add(push.worker_id, push.step, push)
            generation = self._book.generation
            if full:
                return self._complete(generation)
            deadline = self._clock() + self.barrier_timeout
            while self._book.generation == generation:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    self._abort(generation, push.step)
                    break
                self._round_ended.wait(remaining)
            outcome = self._outcomes[generation]
        if isinstance(outcome, PSError):
            raise copy.copy(outcome)  # each waiter gets its own instance (and traceback)
        return outcome

    def _complete(self, generation: int) -> PushResult:
        """Aggregate and apply the full round. Called with the lock held."""
        pushes: list[Push] = self._book.peek()
        try:
            mean = weighted_mean([(p.batch_size, p.gradients) for p in pushes])
        except PSError as e:  # every shard was empty: drop the round, state unchanged
            self._book.abort()
            self._settle(generation, e)
            raise
        version = self.store.apply_all(mean)
        self._book.take()
        sizes = [p.batch_size for p in pushes]
        self.stats.record(
            pushes=len(pushes),
            examples=sum(sizes),
            staleness=[0] * len(pushes),
            loss=weighted_loss([p.loss for p in pushes], sizes),
        )
        result = PushResult(version=version, staleness=0, contributors=len(pushes))
        self._settle(generation, result)
        return result

    def _abort(self, generation: int, step: int) -> None:
        missing = self._book.abort()
        self._rounds_timed_out += 1
        pushed = self.members.describe(w for w in range(self._book.num_workers) if w not in missing)
        error = BarrierTimeout(
            f"sync round {step} timed out after {self.barrier_timeout:g} s waiting for "
            f"worker(s) {self.members.describe(missing)}; pushed: {pushed or 'none'}; "
            f"round discarded, parameters unchanged at version {self.store.version}",
            missing=missing,
        )
        self._settle(generation, error)

    def _settle(self, generation: int, outcome: PushResult | PSError) -> None:
        self._outcomes[generation] = outcome
        for old in [g for g in self._outcomes if g <= generation - _OUTCOMES_KEPT]:
            del self._outcomes[old]
        self._round_ended.notify_all()

    def status(self) -> ModeStatus:
        with self._lock:
            return ModeStatus(
                round=self._book.round,
                waiting_for=self._book.missing() if self._book.pushed() else (),
                rounds_timed_out=self._rounds_timed_out,
            )
