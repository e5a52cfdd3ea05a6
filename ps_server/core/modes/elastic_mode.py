"""Elastic sync mode: workers come and go, every round still trains on its whole global batch.

    mode = ElasticSyncMode(store, members, Cursor(1437, 64, seed=0, micro_batches=4),
                           min_workers=2, barrier_timeout=60.0)
    mode.set_cursor(cursor)                      # or later: the chief's data plan, at initialize
    mode.worker_joined(w)                        # a worker registered (any time)
    work = mode.work(w).result()                 # Work(round, micro_batches, sizes): what to compute
    reply = mode.submit(Push(..., step=work.round, micro_batch=m, batch_size=work.sizes[i])).result()
    # ElasticReply(result=None, work=Work(...)): go on with this work (yours, or a dead worker's)
    # ElasticReply(result=PushResult(...), work=None): the round completed; pull, then ``work`` again
    mode.workers_died([w])                       # lease expired (or worker_left): its undelivered part moves

The data cursor belongs to the cluster (``core.data.cursor``): round ``r`` trains on
global batch ``r`` of the seeded sequence (with the cursor's ``applies`` n, rounds ``b * n``
to ``b * n + n - 1`` are batch ``b``: a step of n updates, each round's pushes of its own
optimizer's variables), cut into the cursor's fixed
micro-batches, dealt to the workers live when the round starts. A worker pushes
one gradient per micro-batch (``Push.micro_batch``, its ``batch_size`` that
micro-batch's examples), computed on the round's parameters (``work.round`` is the
version it pulls). Each is folded into the round's exact sum (``RoundSum``, keyed
by micro-batch) as it arrives. A push is answered at once while its worker has
micro-batches left to compute (``ElasticReply.work``); its last one waits for the
round, or for work moved to it from a worker that died: ``core.data.cursor`` explains
why the round's result then has the same bits whoever computed what.

- The first round starts when ``min_workers`` have joined; later rounds start
  as the previous one completes, with every live worker (one that joined during
  a round takes part from the next, or at once when the round has unowned work).
- A worker declared dead (``workers_died``: no heartbeat for the lease, or it
  left) gives its undelivered micro-batches to the live workers (``RoundWork.lost``);
  its own waits fail with ``WorkerDead``; what it delivered stays folded.
- Exactly once: a micro-batch is folded once (a repeated push of it is answered,
  not folded: the round's outcome once it ends, the recorded one after), and
  ``ledger`` (``EpochLedger``) marks every example of a completed round, refusing
  any marked twice, so every epoch trains on each example exactly once.
- A round that does not complete within ``barrier_timeout`` of its start is
  discarded (parameters unchanged, nothing counted in the ledger) and started
  again from its first micro-batch; its waiters fail with ``BarrierTimeout``.
- A learning rate set by a push (``Push.set_learning_rates``, the rate ``tfps.keras``'
  chief agreed for the epoch, which every worker sends with every push) is set at the
  round's completion, just before its update, as in ``SyncMode``; the pushes of one round
  must not name two. A discarded round leaves the rate as it was.
- A round one of whose pushes carries ``SKIP_UPDATE`` > 0 (``tfps.keras``: a micro-batch's
  gradients were not finite under a dynamic loss scale) completes without an update, as in
  ``SyncMode``: the version counts it, no variable changes, its examples are trained on.
  Such rounds are kept (``ModeStatus.skipped_rounds``, in checkpoints) and each work dealt
  names those before it (``Work.skipped_rounds``): a round's loss scale follows from them,
  so every worker, one that joined late too, computes the round at the same scale.
- With ``gradient_accumulation_steps`` k (``tfps.keras``: Keras' own option), a round is one
  batch, as one process takes it: the server holds the window (``VariableStore.accumulate_all``:
  each round's mean into the variables' ``accumulated`` slots, in checkpoints with the rest;
  the update at the window's k-th round that did not skip). So a loss scale's skip drops one
  batch, as in one process, and ``use_ema``'s averages move, and overwrite, at every round.
- Not here (refused with InvalidArgument): backup workers, other metrics summed over
  the round, and PushPull's speculation.

**Over several shards** (``follow``): shard 0 deals, as above; every
other shard is a follower. A worker pushes each micro-batch to the followers first,
and to shard 0 once they took it (``worker.sharded_client``), so every micro-batch shard
0 holds is on every shard. A follower folds a micro-batch from any worker (who computed
it changes nothing), answers at once with neither work nor result, never deals, never
times a round out, and applies a round only when shard 0 commits it (``commit``): shard
0, once its round is complete, starts the followers' commits (``self.commit``, set by
the server: the CommitRound call), applies its own part, and waits for theirs before it
answers. So no shard applies a round that shard 0 might still discard (its barrier
timeout), and a worker that pulls after shard 0's answer reads every shard at the new
version. A discarded round's micro-batches come again as repeats to the followers: the
same gradients (the same parameters, the same examples), answered, not folded. With
``global_clipnorm`` the shards' applies take one norm together (``core.clip_group``):
that is why shard 0 applies alongside its followers' commits, not after them.

Threading: one lock around the round; the aggregation and the optimizer step run
under it (as in ``SyncMode``); tickets are settled under it and their callbacks
must not block (``core.modes.Ticket``). Nothing here does network I/O.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from ps_common.names import SKIP_UPDATE, asks_skip
from ps_common.reasons import Reason
from ps_server.core.modes.aggregation import RoundSum, weighted_loss
from ps_server.core.data.cursor import Cursor, EpochLedger, RoundWork
from ps_server.core.errors import (BarrierTimeout, ConfigMismatch, FutureRound, InvalidArgument, PSError,
                                   SpecConflict, StaleRound, WorkerDead)
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Commit, Mode, ModeStatus, Push, PushResult, Stats, Ticket
from ps_server.core.modes.rounds import ROUNDS_REMEMBERED
from ps_server.core.store import StoreState, VariableStore


@dataclasses.dataclass(frozen=True)
class Work:
    """Micro-batches of ``round`` a worker is to compute, on the parameters of version ``round``."""

    round: int
    micro_batches: tuple[int, ...]
    sizes: tuple[int, ...]  # each one's examples: its push's batch_size
    skipped_rounds: tuple[int, ...] = ()  # the job's rounds before it completed without an update


@dataclasses.dataclass(frozen=True)
class ElasticReply:
    """A push's answer: the round's result once it completed, else the work to go on with."""

    result: PushResult | None = None
    work: Work | None = None


class ElasticSyncMode(Mode):
    name = "sync"
    rounds = True
    data_plan = "elastic"

    def __init__(self, store: VariableStore, members: Membership, cursor: Cursor | None, min_workers: int,
                 barrier_timeout: float, stats: Stats | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if min_workers < 1:
            raise InvalidArgument(f"min_workers must be >= 1, got {min_workers}")
        if barrier_timeout <= 0:
            raise InvalidArgument(f"barrier_timeout must be > 0, got {barrier_timeout}")
        self.store, self.members = store, members
        self.min_workers, self.barrier_timeout = min_workers, barrier_timeout
        self.stats = stats or Stats()
        self.cursor: Cursor | None = None
        self.ledger: EpochLedger | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._round = store.version  # one round is one version
        self._first_round = self._round  # the job's first round (0): it alone waits for min_workers
        self._started = 0.0
        self._reset_round()  # the round's work, sum, contributors, losses and rate
        self._pushes: dict[int, list[Ticket]] = {}   # worker -> its pushes waiting for the round
        self._asking: dict[int, list[tuple[Ticket, float]]] = {}  # worker -> its waiting ``work`` calls, since
        self._results: dict[int, PushResult] = {}    # completed round -> its answer, for repeats
        self._folded: dict[int, set[int]] = {}       # completed round -> its micro-batches, for repeats
        self._timed_out = 0
        self._skipped: list[int] = []  # the rounds completed without an update (a loss scale's skip)
        self.shard = 0  # over several shards: this one's index (0 deals; the others follow)
        self.commit: Commit | None = None  # shard 0 over several shards (``follow``)
        if cursor is not None:
            self.set_cursor(cursor)

    def follow(self, shard: int, commit: Commit | None) -> None:
        """Over several shards (module docstring), before the data plan is known."""
        with self._lock:
            self.shard, self.commit = shard, commit

    def set_cursor(self, cursor: Cursor, ledger: EpochLedger | None = None) -> None:
        """The job's data plan (the chief's, at initialize; or a checkpoint's, with its
        ``ledger``): rounds start once it is known. The same plan again is harmless; another
        one is refused (SpecConflict)."""
        with self._lock:
            if self.cursor is not None:
                if cursor != self.cursor:
                    raise SpecConflict(f"the elastic round's data plan is {self.cursor}; got {cursor}")
                return
            self.cursor, self.ledger = cursor, ledger or EpochLedger(cursor.num_examples)
            self._start_if_ready()

    # -- membership ---------------------------------------------------------------
    def worker_joined(self, worker_id: int) -> None:
        with self._lock:
            self._live.add(worker_id)
            if self._work is None:
                self._start_if_ready()
            elif not self.shard:  # a follower deals nothing
                self._hand_out(self._work.join(worker_id))

    def workers_died(self, worker_ids: list[int]) -> None:
        with self._lock:
            for w in worker_ids:
                if w not in self._live:
                    continue
                self._live.discard(w)
                error = WorkerDead(f"worker {w} was declared dead (no heartbeat for more than "
                                   f"{self.members.lease_timeout:g} s) or left; its undelivered micro-batches "
                                   "went to the live workers", dead=(w,), reason=Reason.DECLARED_DEAD)
                for ticket in self._pushes.pop(w, []) + [t for t, _ in self._asking.pop(w, [])]:
                    ticket.settle(error)
                if self._work is not None:
                    self._hand_out(self._work.lost(w))

    def worker_left(self, worker_id: int) -> None:
        self.workers_died([worker_id])  # what it had not delivered goes to the others

    # -- the worker's calls ---------------------------------------------------------
    def work(self, worker_id: int) -> Ticket:
        """A ticket for ``worker_id``'s micro-batches: at once when it has some in the current
        round, else when it is given some (a dead worker's, or the next round's)."""
        ticket = Ticket()
        with self._lock:
            if self.shard:
                ticket.settle(InvalidArgument(f"this server is shard {self.shard} of an elastic job: shard 0 deals "
                                              "the work; ask it"))
                return ticket
            if worker_id not in self._live:
                ticket.settle(InvalidArgument(f"worker {worker_id} has not joined the elastic round",
                                              reason=Reason.NOT_JOINED))
                return ticket
            mine = self._mine(worker_id)
            if mine is not None:
                ticket.settle(mine)
            else:
                self._asking.setdefault(worker_id, []).append((ticket, self._clock()))
        return ticket

    def submit(self, push: Push, consumed: Callable[[], None] | None = None) -> Ticket:
        ticket = Ticket()
        try:
            with self._lock:
                self._take(push, ticket)
        except PSError as e:
            ticket.settle(e)
        finally:
            if consumed is not None:
                consumed()
        return ticket

    def expire_overdue(self) -> None:
        with self._lock:
            now = self._clock()
            for w, asked in list(self._asking.items()):  # no work within a barrier timeout
                for ticket, since in asked:
                    if now - since >= self.barrier_timeout:
                        ticket.settle(BarrierTimeout(
                            f"worker {w} was given no work within {self.barrier_timeout:g} s (round {self._round}: "
                            f"{len(self._live)} of at least {self.min_workers} workers joined"
                            f"{'' if self.cursor else ', no data plan yet'})"))
                kept = [(t, since) for t, since in asked if not t.done()]
                if kept:
                    self._asking[w] = kept
                else:
                    del self._asking[w]
            if self._work is None or self.shard or now - self._started < self.barrier_timeout:
                return  # a follower's round ends when shard 0 commits it
            missing = sorted({w for m in self._work.outstanding if (w := self._work.owner(m)) is not None})
            error = BarrierTimeout(
                f"elastic sync round {self._round} timed out after {self.barrier_timeout:g} s waiting for "
                f"micro-batch(es) {list(self._work.outstanding)} (of worker(s) {missing or 'nobody'}); round "
                f"discarded, parameters unchanged at version {self.store.version}", missing=tuple(missing))
            self._timed_out += 1
            for tickets in list(self._pushes.values()):
                for t in tickets:
                    t.settle(error)
            self._pushes.clear()
            self._reset_round()
            self._start_if_ready()

    def status(self) -> ModeStatus:
        with self._lock:
            waiting = () if self._work is None else tuple(sorted(
                {w for m in self._work.outstanding if (w := self._work.owner(m)) is not None}))
            return ModeStatus(round=self._round, waiting_for=waiting, rounds_timed_out=self._timed_out,
                              active_workers=tuple(sorted(self._live)))

    def export_state(self) -> tuple[StoreState, ModeStatus]:
        store_state, status, _, _ = self.export_round()
        return store_state, status

    def export_round(self) -> tuple[StoreState, ModeStatus, tuple | None, dict]:
        """The store's snapshot, the round, the ledger's ``state`` (None before the data
        plan) and the counters (``ModeStats.export``), all after the same completed round:
        ``_complete`` applies a round, folds it into the ledger, counts it and moves the round
        on under this lock, and all four are read under it (counters read after it could hold
        a round the file's values lack, counted again when it is redone after a restart)."""
        with self._lock:
            return (self.store.export_state(),
                    ModeStatus(round=self._round, rounds_timed_out=self._timed_out,
                               active_workers=tuple(sorted(self._live)), skipped_rounds=tuple(self._skipped)),
                    None if self.ledger is None else self.ledger.state(),
                    self.stats.export())

    def commit_round(self, round_: int, contributors: tuple = ()) -> int:
        """A follower: shard 0 completed round ``round_``; apply this shard's part (at once
        when already applied). The version after it; ConfigMismatch when a micro-batch of
        it has not arrived here (nothing applied), FutureRound for a round not started."""
        with self._lock:
            if not self.shard:
                raise InvalidArgument("CommitRound is shard 0's call to the other shards of an elastic job; "
                                      "this server deals its own rounds")
            if round_ != self._round or self._work is None:
                raise self._lost_rounds(f"shard 0 commits round {round_}")
            if not self._work.complete:
                raise ConfigMismatch(f"shard {self.shard} lacks micro-batch(es) {list(self._work.outstanding)} of "
                                     f"round {round_}, which shard 0 completed; nothing applied here")
            error = self._complete()
            if error is not None:
                raise error
            return self.store.version

    def restore(self, status: ModeStatus) -> None:
        with self._lock:
            self._round = status.round  # the job's first round stays the one that waits for min_workers
            self._timed_out = status.rounds_timed_out
            self._skipped = list(status.skipped_rounds)
            self._reset_round()

    # -- under the lock -------------------------------------------------------------
    def _take(self, push: Push, ticket: Ticket) -> None:
        if set(push.metrics or ()) - {SKIP_UPDATE}:
            raise InvalidArgument("elastic sync sums no metrics over a round (but a loss scale's "
                                  f"{SKIP_UPDATE}); nothing applied")
        m, r, w = push.micro_batch, push.step, push.worker_id
        if r < self._round:
            if r in self._results and m in self._folded.get(r, ()):
                ticket.settle(ElasticReply() if self.shard else
                              ElasticReply(result=dataclasses.replace(self._results[r], replayed=True)))
                return
            raise StaleRound(f"push from worker {w} for round {r}, micro-batch {m}: that round completed "
                             f"without it (the server is collecting round {self._round})")
        if r > self._round:
            if self.shard:  # shard 0 dealt it after this shard applied every round before: not here
                raise self._lost_rounds(f"worker {w} pushes round {r}, which shard 0 deals")
            raise FutureRound(f"push from worker {w} is for round {r}; the server is collecting round "
                              f"{self._round}")
        if w not in self._live and not self.shard:  # a follower takes a micro-batch from anyone
            raise InvalidArgument(f"worker {w} has not joined the elastic round (or was declared dead)",
                                  reason=Reason.NOT_JOINED)
        if self._work is None:
            raise FutureRound(f"round {r} has not started: {len(self._live)} of at least {self.min_workers} "
                              "workers have joined" + ("" if self.cursor else ", and no data plan is known yet"))
        if m < 0:
            raise InvalidArgument(f"an elastic sync push names its micro-batch (0..{self.cursor.micro_batches - 1})")
        size = self._work.size(m)  # refuses an unknown micro-batch
        if push.batch_size != size:
            raise InvalidArgument(f"round {r}'s micro-batch {m} holds {size} examples; the push says "
                                  f"{push.batch_size}")
        rates = push.set_learning_rates
        self.store.check_learning_rates(rates)
        if rates and self._rates not in ((), rates):
            raise InvalidArgument(f"worker {w} sets the learning rates {rates!r} for round {r}, another push of it "
                                  f"{self._rates!r}; nothing applied")
        if self._work.receive(w, m, dealt_elsewhere=bool(self.shard)):
            self._rates = rates or self._rates
            self._skip = self._skip or asks_skip(push.metrics)
            self._sum.add(m, size, push.gradients)  # keyed by micro-batch: who computed it is no input
            self._contributors.add(w)
            self._losses.append((push.loss, size))
        if self.shard:  # a follower: taken; shard 0 says what next, and commits the round
            ticket.settle(ElasticReply())
            return
        mine = self._mine(w)
        if mine is not None and mine.round == r:
            ticket.settle(ElasticReply(work=mine))
        else:
            self._pushes.setdefault(w, []).append(ticket)
        if self._work.complete:
            self._complete()

    def _lost_rounds(self, what: str) -> ConfigMismatch:
        """A follower whose rounds and shard 0's parted: one of them restarted from an older
        checkpoint. Nothing can make the shards one model again: the job must stop."""
        return ConfigMismatch(f"shard {self.shard} has applied the rounds before {self._round}, and {what}: one of "
                              "the shards restarted from an older checkpoint and lost rounds the others kept; the "
                              "shards no longer hold one model. Start the job again (every shard from checkpoints "
                              "of the same round)")

    def _complete(self) -> PSError | None:
        """Apply the complete round (shard 0 over shards: the others' parts alongside) and
        answer its pushes; the error when it was not applied (the round then starts over)."""
        work, completed = self._work, self._round
        started = time.perf_counter()
        followers = self.commit(completed, ()) if self.commit is not None else (lambda: None)
        failed = None
        try:
            # gradient_accumulation_steps: a round is a batch, the server holds the window
            apply = self.store.accumulate_all if self.store.optimizer_spec.gradient_accumulation_steps \
                else self.store.apply_all
            with self.store.learning_rates(self._rates):
                version = self.store.bump_version() if self._skip else apply(self._sum.mean(), key=f"round {completed}")
        except PSError as e:  # nothing applied here (apply_all is all or nothing): the round starts over
            with contextlib.suppress(PSError):
                followers()  # their applies fail too (global_clipnorm: no norm), or nothing can undo them
            for tickets in self._pushes.values():
                for t in tickets:
                    t.settle(e)
            self._pushes.clear()
            self._reset_round()
            self._start_if_ready()
            return e
        try:
            followers()
        except PSError as e:  # applied here, not on every shard: the job cannot go on as one model
            failed = ConfigMismatch(f"round {completed} was applied on shard 0 but not on every other shard: {e}")
        self.stats.applied(time.perf_counter() - started)
        if self._skip:
            self._skipped.append(completed)
        micro = range(self.cursor.micro_batches)
        for m in micro if self.cursor.counts(completed) else ():  # a batch of several rounds: at its last
            self.ledger.fold(work.epoch, work.indices(m))
        sizes = [s for _, s in self._losses]
        self.stats.record(pushes=len(sizes), examples=sum(sizes), staleness=[0] * len(sizes),
                          loss=weighted_loss([loss for loss, _ in self._losses], sizes))
        result = PushResult(version=version, staleness=0, contributors=len(self._contributors),
                            next_step=completed + 1, learning_rate=self.store.current_learning_rate(),
                            metrics={SKIP_UPDATE: np.ones(1)} if self._skip else {})
        self._results[completed] = result
        self._folded[completed] = set(micro)
        self._results.pop(completed - ROUNDS_REMEMBERED, None)
        self._folded.pop(completed - ROUNDS_REMEMBERED, None)
        waiting, self._pushes = self._pushes, {}
        self._round = completed + 1
        self._reset_round()
        self._start_if_ready()
        for tickets in waiting.values():
            for t in tickets:
                t.settle(failed or ElasticReply(result=result))
        return failed

    def _reset_round(self) -> None:
        self._work: RoundWork | None = None
        self._sum = RoundSum(lambda: self.store.sparse_rule)
        self._contributors: set[int] = set()
        self._losses: list[tuple[float, int]] = []
        self._rates: tuple = ()  # the learning rates the round's pushes set (none: unchanged)
        self._skip = False  # a push of the round asks to skip its update (SKIP_UPDATE: a loss scale's)

    def _start_if_ready(self) -> None:
        # min_workers gates the job's first round only: later ones go on with whoever is live.
        needed = self.min_workers if self._round == self._first_round else 1
        if self.shard:  # a follower collects whatever shard 0 dealt, from whoever computed it
            needed = 0
        if self._work is not None or self.cursor is None or len(self._live) < needed:
            return
        self._work = self.cursor.round(self._round, () if self.shard else self._live)
        self._started = self._clock()
        for w in list(self._asking):
            self._answer_asking(w)

    def _mine(self, worker_id: int) -> Work | None:
        if self._work is None:
            return None
        micro = self._work.assigned(worker_id)
        if not micro:
            return None
        return Work(self._round, micro, tuple(self._work.size(m) for m in micro), tuple(self._skipped))

    def _hand_out(self, given: dict[int, tuple[int, ...]]) -> None:
        """Tell workers given more micro-batches: a waiting push is answered with them, a
        waiting ``work`` call too."""
        for w in given:
            mine = self._mine(w)
            if mine is None:
                continue
            for t in self._pushes.pop(w, []):
                t.settle(ElasticReply(work=mine))
            self._answer_asking(w)

    def _answer_asking(self, worker_id: int) -> None:
        mine = self._mine(worker_id)
        if mine is not None:
            for t, _ in self._asking.pop(worker_id, []):
                t.settle(mine)

