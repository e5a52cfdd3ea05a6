"""Synchronous mode: one barrier per step.

    mode = SyncMode(store, members, num_workers=2, barrier_timeout=60.0)
    ticket = mode.submit(push)   # settled once the round completes (or ends otherwise)

Round ``r`` waits until each active worker has pushed step ``r`` (or, with
backup workers, until the first ``replicas_to_aggregate`` pushes arrived). While
the round's pushes fit ``aggregation.HELD_BYTES`` together, each is held whole and
the round's gradient is their batch-weighted sum in worker-id order; beyond, each
push is folded on arrival into the exact batch-weighted mean, rounded once, and its
gradients are let go (``consumed``), so such a round holds one accumulator, not every
push (``aggregation.RoundSum``: either way the bits do not depend on the order of
arrival). The thread whose push fills the round takes the mean, applies the optimizer
once, bumps the version, and only then are all pushes of the round answered,
each with the new version and ``next_step``. Every worker therefore pulls the
same parameters for round ``r + 1``; the result equals one optimizer step on
the whole global batch of the workers that contributed.

Guarantees:
- a gradient is applied at most once, and only as part of a full round;
  pushes are idempotent per (worker, step): a retry while the first is waiting
  gets the same answer, a retry after the round completed gets the recorded
  answer (``replayed``), and neither is applied twice;
- a push for a future round (``FutureRound``), for a completed round it was not
  part of (``StaleRound``; with backup workers it is answered ``dropped`` and
  counted instead, and the same late push sent again is answered ``dropped``
  and ``replayed``, counted once), or from a worker dropped from the cluster is
  refused and changes nothing;
- a round that does not fill within ``barrier_timeout`` seconds of its first
  push is discarded (parameters unchanged) and every waiting push fails with
  ``BarrierTimeout`` naming the workers that never pushed;
- when a worker the round needs is declared dead (``Membership.expire``), the
  ``policy`` decides: ``abort`` ends the round at once with ``WorkerDead`` for
  every waiter (and for new pushes while it stays dead); ``wait`` keeps the
  round open until a replacement registers with that index, up to
  ``replacement_timeout`` after the death, then aborts (a replacement that
  registers in time has a whole ``barrier_timeout`` to push); ``shrink`` stops
  expecting the dead worker and finishes rounds with the live ones, weighted by
  their batch shares (a worker that registers again is expected again).

Metrics and the learning rate (``Push.metrics``, ``Push.set_learning_rates``):
- every push of a round carries metrics of the same names, shapes and dtypes, or
  none; a push that differs from the round's first is refused (InvalidArgument
  naming the difference) before it joins, and the round goes on without it;
- the round's metrics are summed element by element in worker-id order, in the
  tensors' own dtype (``aggregation.sum_metrics``), over the round's
  contributors only (with backup workers, not the dropped ones); every
  contributor's reply carries the same sum, a replay the recorded one, a dropped
  push none;
- a round whose summed ``SKIP_UPDATE`` metric is > 0 (some worker's gradients were not
  finite under a Keras loss scale) is completed without an update: the version counts
  it, no variable changes, and every reply carries the sum, so every worker skips alike
  (also where every push of it weighs 0: every worker's gradients were not finite);
- a round in which any contributor set learning rates is applied with them: they
  are set (``VariableStore.set_learning_rates``: with optimizer groups, each
  group's) at completion, just before the optimizer step, and stay for later
  rounds. Other rates than another push of the round set, or any rate while that
  optimizer runs a schedule, refuse the push that brings them, before it joins.
  Every reply's ``learning_rate`` is the rate the round was applied with (with
  groups, that of the first group whose variables the round carries).

**Backup workers over several shards** (``follow``): shard 0 picks each round's
contributors (its first ``replicas_to_aggregate`` pushes), and every shard must step
with the same ones. A worker pushes to the other shards first, then to shard 0
(``worker.sharded_client``), so every contributor shard 0 picks has reached every
shard. A follower keeps each push of the round whole (a copy: the caller's buffer is
given back) and answers it at once; it never completes, times out or aborts a round on
its own. Shard 0, once its round is full, starts ``commit(round, contributors)`` on the
followers (the CommitRound call), applies its own part alongside, and answers the
round's pushes when every shard has applied: a follower steps with the contributors'
pushes alone, and the others are late there too (answered ``dropped``). With
``global_clipnorm`` the shards take one norm for the round (``core.clip_group``).

Threading: ``RoundBook`` is the deterministic core; this class owns the one
lock around it. Each generation (a round, until completed or aborted) keeps its
waiting tickets apart, so a fast worker's push of the next round never settles
the last one's. The aggregation and apply run under the lock: no push of the
next round can arrive before it ends anyway. Nothing here does network I/O.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from ps_common.defaults import REPLACEMENT_TIMEOUT
from ps_common.names import DEAD_WORKER_POLICIES, asks_skip
from ps_common.reasons import Reason
from ps_server.core.modes.aggregation import (RoundSum, holds, metric_difference, metric_spec, push_bytes, sum_metrics,
                                               weighted_loss)
from ps_server.core.errors import BarrierTimeout, ConfigMismatch, InvalidArgument, PSError, WorkerDead
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Commit, Mode, ModeStatus, Push, PushResult, Stats, Ticket
from ps_server.core.modes.overlap import BLOCK_BYTES, Speculation, blocks
from ps_server.core.modes.rounds import ROUNDS_REMEMBERED, RoundBook
from ps_server.core.store import StoreState, VariableStore


class SyncMode(Mode):
    name = "sync"
    rounds = True

    def __init__(
        self,
        store: VariableStore,
        members: Membership,
        num_workers: int,
        barrier_timeout: float,
        stats: Stats | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: str = "abort",
        replacement_timeout: float = REPLACEMENT_TIMEOUT,
        replicas_to_aggregate: int = 0,
    ):
        if barrier_timeout <= 0:
            raise InvalidArgument(f"barrier_timeout must be > 0, got {barrier_timeout}")
        if policy not in DEAD_WORKER_POLICIES:
            raise InvalidArgument(f"dead-worker policy must be one of {DEAD_WORKER_POLICIES}, got {policy!r}")
        self.store = store
        self.members = members
        self.barrier_timeout = barrier_timeout
        self.policy = policy
        self.replacement_timeout = replacement_timeout
        self.stats = stats or Stats()
        self._clock = clock
        self._lock = threading.Lock()
        self._book = RoundBook(num_workers, start_round=store.version, quorum=replicas_to_aggregate)
        self._results: dict[int, PushResult] = {}  # completed round -> its answer, for replays
        self._dropped: set[tuple[int, int]] = set()  # (worker, round) answered dropped, recent rounds
        self._dead_since: dict[int, float] = {}  # dead workers still expected (abort/wait policies)
        self._round_started: float | None = None
        self._rounds_timed_out = 0
        self._rounds_aborted = 0
        self._speculation: Speculation | None = None  # the current round's (core.modes.overlap)
        self._sum = RoundSum(lambda: self.store.sparse_rule)  # the current round's pushes, folded (a fresh one each generation)
        self._tickets: dict[int, list[Ticket]] = {}  # generation -> submit()'s waiting pushes
        self.shard = 0  # backup workers over several shards: this one's index (module docstring)
        self.commit: Commit | None = None  # shard 0 of them

    def follow(self, shard: int, commit: Commit | None) -> None:
        """Backup workers over several shards (module docstring)."""
        with self._lock:
            self.shard, self.commit = shard, commit

    # -- pushes ------------------------------------------------------------------
    def submit(self, push: Push, consumed: Callable[[], None] | None = None) -> Ticket:
        """Contribute ``push`` (``core.modes``): the ticket is settled with the round's outcome
        by whoever ends it; a round out of time ends at ``expire_overdue``. ``consumed`` is
        called once the round no longer needs the push's gradient arrays (folded into the
        round's sum), before the round ends: a caller may reuse their memory from then on."""
        started = time.perf_counter()
        ticket = Ticket()
        ticket.add_done_callback(lambda _: self.stats.pushed(time.perf_counter() - started))
        try:
            with self._lock:
                entered = self._enter(push, consumed)
                if not isinstance(entered, PushResult):  # the current generation: settled when it ends
                    self._tickets.setdefault(entered, []).append(ticket)
                    return ticket
        except PSError as e:
            ticket.settle(e)
            return ticket
        ticket.settle(entered)
        return ticket

    def expire_overdue(self) -> None:
        """End the current round if it ran out of time (``_deadline``); a follower's ends
        when shard 0 commits it."""
        with self._lock:
            if not self.shard and self._book.pushed() and self._tickets.get(self._book.generation) \
                    and self._clock() >= self._deadline():
                self._expire_round(self._book.round)

    def _enter(self, push: Push, consumed: Callable[[], None] | None) -> PushResult | int:
        """Take a checked push, lock held: its answer, or the generation whose end it waits for."""
        kind = self._book.check(push.worker_id, push.step)
        if kind == "replay":
            self.stats.count("replayed")
            return dataclasses.replace(self._results[push.step], replayed=True, next_step=self._book.round)
        if kind == "late":
            version = self.store.version
            # A late push sent again (its reply was lost) is answered the same, counted once.
            again = (push.worker_id, push.step) in self._dropped
            self.stats.count("replayed" if again else "dropped")
            if not again:
                self._dropped.add((push.worker_id, push.step))
                self._dropped = {(w, s) for w, s in self._dropped if s > push.step - ROUNDS_REMEMBERED}
            return PushResult(version=version, staleness=version - push.base_version, contributors=0,
                              dropped=True, next_step=self._book.round, replayed=again)
        if self.shard and kind == "join":  # a round shard 0 aborted, pushed again: the same gradient
            return self._taken()
        if kind == "new":
            if push.base_version != self.store.version:
                raise InvalidArgument(
                    f"worker {push.worker_id} computed its gradient for round {push.step} on version "
                    f"{push.base_version}, but sync round {push.step} is on version {self.store.version}; "
                    "pull first", reason=Reason.PULL_FIRST
                )
            if not self.shard:
                self._raise_if_blocked()
            self._check_round_extras(push)
            if self.shard:  # kept whole until shard 0 names the round's contributors
                self._book.add(push.worker_id, push.step, dataclasses.replace(
                    push, gradients={n: _owned(g) for n, g in push.gradients.items()}))
                if consumed is not None:
                    consumed()
                return self._taken()
            if not self._book.pushed():
                self._round_started = self._clock()
            record = self._fold(push)
            if not record.gradients and consumed is not None:
                consumed()
            if self._book.add(push.worker_id, push.step, record):
                return self._complete(self._book.generation)
        return self._book.generation

    def _taken(self) -> PushResult:
        """A follower's answer to a push it keeps: nothing applied yet; shard 0 answers the round."""
        version = self.store.version
        return PushResult(version=version, staleness=0, contributors=0, next_step=self._book.round)

    def commit_round(self, round_: int, contributors: tuple) -> int:
        """A follower: shard 0 completed round ``round_`` with ``contributors``' pushes; step
        with theirs (ConfigMismatch, nothing applied, when one has not arrived here)."""
        with self._lock:
            if not self.shard:
                raise InvalidArgument("CommitRound is shard 0's call to the shards that follow it; this server "
                                      "decides its own rounds")
            if round_ != self._book.round:
                raise ConfigMismatch(
                    f"shard {self.shard} collects round {self._book.round}; shard 0 commits round {round_}: one of "
                    "the shards restarted from an older checkpoint and lost rounds the others kept; the shards "
                    "no longer hold one model. Start the job again (every shard from checkpoints of the same round)")
            missing = sorted(set(contributors) - set(self._book.pushed()))
            if missing or not contributors:
                raise ConfigMismatch(f"shard {self.shard} lacks the push(es) of worker(s) {missing} for round "
                                     f"{round_}, which shard 0 completed with them; nothing applied here")
            return self._complete(self._book.generation, only=tuple(contributors)).version

    def _fold(self, push: Push) -> Push:
        """What the round keeps of a new push, lock held: the push without its gradients,
        folded into the round's sum; or, when the push joined the round's speculation
        (``core.modes.overlap``, which confirms by the arrays' identity), the push whole. A fold
        that fails half-way (no memory) aborts the round: its sum can no longer be trusted."""
        spec = self._speculation
        if spec is not None and spec.generation == self._book.generation and push.worker_id in spec.sizes:
            return push
        if not self._sum.count and holds(push_bytes(push.gradients), self._book.num_workers):
            # Held whole, summed in worker-id order when the round completes; its own dict: a
            # caller may empty the one it passed once ``submit`` returns (the arrays stay).
            return dataclasses.replace(push, gradients=dict(push.gradients))
        generation = self._book.generation
        try:
            self._sum.add(push.worker_id, push.batch_size, push.gradients)
        except BaseException as e:
            self._book.abort()
            self._settle(generation, e if isinstance(e, PSError) else InvalidArgument(
                f"sync round {self._book.round} could not take worker {push.worker_id}'s push "
                f"({type(e).__name__}: {e}); round discarded, parameters unchanged"))
            raise
        return dataclasses.replace(push, gradients={})

    # -- overlap: new values while the round still arrives (core.modes.overlap) --------------------
    def overlap(self, worker_id: int, step: int, batch_size: int, gradients, set_learning_rates=(),
                sparse: bool = False, block_bytes: int = 0) -> Speculation | None:
        """The speculation a streamed push joins, or None when its round is not speculated
        (``core.modes.overlap``; the push itself then goes on as any other). ``gradients``: the
        push's {name: (dtype, shape)} in the order its bytes come; ``block_bytes`` (0: the
        default) the blocks' size when this push is the round's first."""
        spec_of_optimizer = self.store.optimizer_spec
        if (self._book.quorum or set_learning_rates or sparse or spec_of_optimizer is None
                or spec_of_optimizer.global_clipnorm is not None or spec_of_optimizer.groups):
            return None
        held = sum(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for d, s in gradients.values())
        if not holds(held, self._book.num_workers):
            return None  # a speculated round holds every push whole: only while they fit
        specs, non_trainable = self.store.specs(), self.store.non_trainable()
        if any(name not in specs or specs[name] != (np.dtype(d), tuple(s)) for name, (d, s) in gradients.items()):
            return None  # another dtype on the wire (half precision), or a push the round will refuse
        whole = spec_of_optimizer.clipnorm is not None
        with self._lock:
            try:
                kind = self._book.check(worker_id, step)
            except PSError:
                return None  # the push will be refused, saying why
            if kind != "new":
                return None
            spec = self._speculation
            if spec is None or spec.generation != self._book.generation:
                layout = {name: blocks(shape, np.dtype(dtype).itemsize, whole or name in non_trainable,
                                       block_bytes or BLOCK_BYTES) for name, (dtype, shape) in gradients.items()}
                spec = self._speculation = Speculation(self._book.generation, layout)
            if set(spec.names) != set(gradients):  # each worker may send them in its own order
                return None
            spec.sizes[worker_id] = batch_size
            return spec

    def offer(self, spec: Speculation, worker_id: int, arrived) -> None:
        """Blocks of a push's gradients have arrived: ``arrived`` is [(name, block, gradient)],
        ``gradient`` the whole array the push will carry. The offer that completes a block
        (every active worker's is in) computes its speculated values."""
        for name, block, gradient in arrived:
            with self._lock:
                if spec.generation != self._book.generation or spec.abandoned or (name, block) in spec.computing:
                    continue
                spec.arrays[name][worker_id] = gradient
                offered = spec.offered.setdefault((name, block), set())
                offered.add(worker_id)
                if not (self._book.active <= offered and all(w in spec.sizes for w in offered)):
                    continue
                spec.computing.add((name, block))
                contributions = sorted((w, spec.arrays[name][w]) for w in offered)
                sizes = [spec.sizes[w] for w, _ in contributions]
            spec.compute(name, block, self.store, contributions, sizes)

    def _check_round_extras(self, push: Push) -> None:
        """Refuse, changing nothing, a push whose metrics or learning rate cannot join the
        round's pushes so far: other metric names, shapes or dtypes (every push of a round
        carries the same or none), other learning rates than those already asked for, or a
        learning rate the store cannot set (``check_learning_rates``: a schedule). Lock held."""
        pending = self._book.peek()
        if pending:
            first = pending[0]
            difference = metric_difference(metric_spec(first.metrics), metric_spec(push.metrics))
            if difference is not None:
                raise InvalidArgument(
                    f"worker {push.worker_id}'s push for round {push.step} {difference}, unlike worker "
                    f"{first.worker_id}'s: every push of a round carries the same metrics (or none); nothing applied")
        if push.set_learning_rates:
            try:
                self.store.check_learning_rates(push.set_learning_rates)
            except InvalidArgument as e:
                raise InvalidArgument(f"worker {push.worker_id} sets the learning rate for round {push.step}, "
                                      f"but {e}; nothing applied") from None
            asked = {p.set_learning_rates for p in pending if p.set_learning_rates}
            if asked and push.set_learning_rates not in asked:
                raise InvalidArgument(
                    f"worker {push.worker_id} sets the learning rates {push.set_learning_rates!r} for round "
                    f"{push.step}, but another push of that round set {asked.pop()!r}; nothing applied")

    def _deadline(self) -> float:
        started = self._round_started if self._round_started is not None else self._clock()
        deadline = started + self.barrier_timeout
        if self.policy == "wait":
            # A dead worker's index may be filled by a replacement: give it its time.
            for w in self._book.missing():
                if w in self._dead_since:
                    deadline = max(deadline, self._dead_since[w] + self.replacement_timeout)
        return deadline

    def _complete(self, generation: int, only: tuple | None = None) -> PushResult:
        """Aggregate and apply the full round (a follower: ``only`` its contributors' pushes,
        which it kept whole). Called with the lock held."""
        pushes: list[Push] = self._book.peek()
        if only is not None:
            pushes = [p for p in pushes if p.worker_id in only]
        followers = (self.commit(self._book.round, tuple(p.worker_id for p in pushes)) if self.commit is not None
                     else (lambda: None))
        started = time.perf_counter()
        rates = next((p.set_learning_rates for p in pushes if p.set_learning_rates), ())  # all alike
        # the reply's rate: their optimizer (group)'s
        names = self._sum.names.union(*(p.gradients for p in pushes)) if self.store.optimizer_spec.groups else ()
        speculation = self._speculation if self._speculation is not None \
            and self._speculation.generation == generation and not rates else None
        metrics = sum_metrics([p.metrics for p in pushes])
        skip = asks_skip(metrics)
        kept = speculation.confirm(pushes) if speculation is not None and not skip else None  # core.modes.overlap
        try:
            # Every variable speculated from exactly these pushes: those values are the round's.
            mean = None
            if kept is None and not skip:
                held = not self._sum.count  # every push kept whole (a follower's too): none folded
                if held:
                    self._sum.hold = holds(push_bytes(pushes[0].gradients), self._book.num_workers)
                for p in pushes:
                    if held or p.gradients:  # else folded already
                        self._sum.add(p.worker_id, p.batch_size, p.gradients)
                mean = self._sum.mean()
            with self.store.learning_rates(rates):  # this round is applied with them
                learning_rate = self.store.current_learning_rate(names)
                version = self.store.bump_version() if skip else self.store.publish(kept) if kept is not None \
                    else self.store.apply_all(mean, key=f"round {self._book.round}")
        except PSError as e:  # every shard was empty, or the step was refused: drop the round,
            with contextlib.suppress(PSError):
                followers()  # their steps fail too (global_clipnorm: no norm), or nothing can undo them
            self._book.abort()  # state unchanged (apply_all publishes all or nothing); answer every waiter
            self._settle(generation, e)
            raise
        failed = None
        try:
            followers()
        except PSError as e:  # applied here, not on every shard: the job cannot go on as one model
            failed = ConfigMismatch(f"round {self._book.round} was applied on shard 0 but not on every other "
                                    f"shard: {e}")
        self.stats.applied(time.perf_counter() - started)
        completed = self._book.round
        self._book.take(only)
        sizes = [p.batch_size for p in pushes]
        self.stats.record(
            pushes=len(pushes),
            examples=sum(sizes),
            staleness=[0] * len(pushes),
            # a skipped round may weigh nothing (every worker's gradients not finite): no loss then
            loss=weighted_loss([p.loss for p in pushes], sizes) if sum(sizes) else float("nan"),
        )
        result = PushResult(version=version, staleness=0, contributors=len(pushes), next_step=self._book.round,
                            learning_rate=learning_rate, metrics=metrics)
        self._results[completed] = result
        self._results.pop(completed - ROUNDS_REMEMBERED, None)
        if speculation is not None:
            speculation.settle(confirmed=kept is not None)
        self._settle(generation, failed or result)
        if failed is not None:
            raise failed  # the push that completed the round is answered so too
        return result

    def _expire_round(self, step: int) -> None:
        """The round ran out of time: a plain timeout, or no replacement for a dead worker."""
        dead = tuple(w for w in self._book.missing() if w in self._dead_since)
        if dead:
            self._abort_for_dead(dead, f"no replacement registered within {self.replacement_timeout:g} s")
            return
        generation = self._book.generation
        missing = self._book.abort()
        self._rounds_timed_out += 1
        pushed = self.members.describe(w for w in sorted(self._book.active) if w not in missing)
        self._settle(generation, BarrierTimeout(
            f"sync round {step} timed out after {self.barrier_timeout:g} s waiting for "
            f"worker(s) {self.members.describe(missing)}; pushed: {pushed or 'none'}; "
            f"round discarded, parameters unchanged at version {self.store.version}",
            missing=missing,
        ))

    def _abort_for_dead(self, dead: tuple[int, ...], why: str) -> None:
        generation = self._book.generation
        self._book.abort()
        self._rounds_aborted += 1
        self._settle(generation, self._dead_error(dead, why))

    def _dead_error(self, dead: tuple[int, ...], why: str) -> WorkerDead:
        return WorkerDead(
            f"sync round {self._book.round} cannot complete: worker(s) {self.members.describe(dead)} died "
            f"(no heartbeat for more than {self.members.lease_timeout:g} s); {why} (dead-worker policy "
            f"{self.policy}); parameters unchanged at version {self.store.version}",
            dead=dead,
        )

    def _blocking_dead(self) -> tuple[int, ...]:
        """Dead workers without whom the current round cannot fill."""
        dead_missing = tuple(w for w in self._book.missing() if w in self._dead_since)
        if not dead_missing:
            return ()
        if self._book.quorum:
            live_possible = len(self._book.pushed()) + len(self._book.missing()) - len(dead_missing)
            return dead_missing if live_possible < self._book.needed else ()
        return dead_missing

    def _raise_if_blocked(self) -> None:
        if self.policy == "abort":
            dead = self._blocking_dead()
            if dead:
                raise self._dead_error(dead, "the round was aborted")

    def _settle(self, generation: int, outcome: PushResult | PSError) -> None:
        spec = self._speculation
        if spec is not None and spec.generation == generation:
            if not spec.confirmed:
                spec.settle(confirmed=False)  # aborted, timed out, refused: nothing speculated is kept
            self._speculation = None
        for ticket in self._tickets.pop(generation, ()):
            ticket.settle(outcome)  # its callbacks only hand the outcome on; they do not block
        self._sum = RoundSum(lambda: self.store.sparse_rule)  # the next generation folds its own
        self._round_started = None

    # -- membership ----------------------------------------------------------------
    def workers_died(self, worker_ids: list[int]) -> None:
        """Apply the dead-worker policy to workers the lease check just declared dead (a
        follower: shard 0 applies it; its choice of contributors reaches this shard)."""
        if not worker_ids or self.shard:
            return
        with self._lock:
            now = self._clock()
            for w in worker_ids:
                if w not in self._book.active:
                    continue
                if self.policy == "shrink":
                    self._book.deactivate(w)
                else:
                    self._dead_since[w] = now
            if self.policy == "shrink":
                if self._book.full():
                    with contextlib.suppress(PSError):  # its waiters are answered either way
                        self._complete(self._book.generation)
            elif self.policy == "abort":
                dead = self._blocking_dead()
                if dead and self._book.pushed():
                    self._abort_for_dead(dead, "the round was aborted")

    def worker_joined(self, worker_id: int) -> None:
        """A worker (re)registered: it is expected in rounds again."""
        with self._lock:
            replaced = self._dead_since.pop(worker_id, None) is not None
            if replaced and self.policy == "wait" and self._round_started is not None \
                    and worker_id in self._book.missing():
                # The round waited for this replacement: give it a whole barrier
                # timeout to pull and push, not what is left of the first push's.
                self._round_started = max(self._round_started, self._clock())
            self._book.activate(worker_id)

    # -- checkpoints ---------------------------------------------------------------
    def export_state(self) -> tuple[StoreState, ModeStatus]:
        """The store's snapshot and the round it is at, taken under the barrier's lock.

        Rounds are applied under this lock, so the snapshot is exactly the state
        after round ``status.round - 1``; pushes waiting in the current round are
        not part of it (a restart asks for them again).
        """
        with self._lock:
            return self.store.export_state(), self._status()

    def restore(self, status: ModeStatus) -> None:
        """Restart the round book at ``status.round``: no pending pushes, every worker
        expected, no record of earlier rounds (a push for one is late). Counters
        of timed-out and aborted rounds carry on."""
        with self._lock:
            generation = self._book.generation + 1  # stays monotonic for anyone holding one
            self._book = RoundBook(self._book.num_workers, start_round=status.round, quorum=self._book.quorum,
                                   restored=True)
            self._book.generation = generation
            if self._speculation is not None:
                self._speculation.settle(confirmed=False)
                self._speculation = None
            self._sum = RoundSum(lambda: self.store.sparse_rule)
            self._results.clear()
            self._dropped.clear()
            self._dead_since.clear()
            self._round_started = None
            self._rounds_timed_out = status.rounds_timed_out
            self._rounds_aborted = status.rounds_aborted

    # -- status --------------------------------------------------------------------
    @property
    def round(self) -> int:
        with self._lock:
            return self._book.round

    def round_restored(self) -> bool:
        """Restored from a checkpoint and no push taken since (``RoundBook``)."""
        with self._lock:
            return self._book.restored

    def status(self) -> ModeStatus:
        with self._lock:
            return self._status()

    def _status(self) -> ModeStatus:
        return ModeStatus(
            round=self._book.round,
            waiting_for=self._book.missing() if self._book.pushed() else (),
            rounds_timed_out=self._rounds_timed_out,
            rounds_aborted=self._rounds_aborted,
            active_workers=tuple(sorted(self._book.active)),
        )


def _owned(g):
    """A copy of a push's gradient (an array, or ``SparseRows``) that owns its memory."""
    return np.array(g, copy=True) if isinstance(g, np.ndarray) else copy.deepcopy(g)
