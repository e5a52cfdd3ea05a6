"""Asynchronous mode: every push is applied the moment it arrives.

    mode = AsyncMode(store, members)                    # apply="locked", the default
    mode = AsyncMode(store, members, apply="hogwild")   # ps-server --async-apply hogwild
    result = mode.submit(push).result()   # settled at once: the gradient is applied

There is no barrier and no global lock. How a push is applied is ``apply``;
what "lock-free" means under each, exactly:

``apply="locked"`` (the default): a lock per variable, copy-on-write.

- What may interleave: pushes from different workers run concurrently. Each
  variable has its own lock, held only for that variable's optimizer step
  (read value, compute, swap in the new array). Two pushes may therefore update
  different variables at the same time, and a push may have updated some
  variables and not yet others when a pull reads them: a pull can return a mix
  of "before" and "after" for a push in flight (as in Hogwild!-style training).
  A gradient may have been computed on parameters several updates old; that
  staleness is recorded.
- What is still guaranteed: every accepted gradient is applied to every
  variable exactly once (no lost update: each variable's read-modify-write is
  serialized by its lock); no reader ever sees a half-written array
  (copy-on-write values); the version counts fully applied pushes, grows by one
  per push and never goes back; a pull returning version v includes every push
  counted in v; a rejected push (unknown worker, bad shape, NaN) changes nothing,
  because it is checked before any variable is touched.

``apply="hogwild"``: no lock around any arithmetic, updates in place
(Hogwild!, Niu et al. 2011; the arithmetic is ``core.optim.hogwild``'s).

- What may interleave: everything the locked apply allows, and also the element
  updates of concurrent pushes to the same variable. Each push writes its step
  into the stored arrays themselves (``w -= lr * g`` as one NumPy pass with
  ``out=``, which releases the GIL), racing with the others and never waiting
  for them, so one push may overwrite another's update of an element (a lost
  update: ``bench/load_test.py`` counts them). A pull may see a variable
  half-updated (torn: some elements before a push, some after), and two of
  its elements may reflect different sets of pushes. Optimizer slots (momentum,
  Adam's m and v) race the same way, and the step index of Adam's bias
  correction or of a learning-rate schedule may be the same for two concurrent
  pushes (``core.optim.hogwild``).
- What is still guaranteed: every accepted push is counted once in the version
  and in ``pushes_applied``, and each variable's ``iterations`` counts every
  step once; no push is applied twice (the exactly-once record below); a replay
  is answered from the record; shapes, dtypes and finiteness are checked before
  anything is written, so a refused push writes nothing; every element of a
  value or slot always holds a value some whole update produced (never an
  intermediate; second moments such as Adam's v stay >= 0), so with finite
  gradients every stored array stays finite unless a step itself overflows;
  the version never goes back, and a push counted in version v had written
  all of its updates before v was published (though a racing push may since
  have overwritten some).
  With one push at a time the values are bit-identical to the locked apply's.
- Pulls serialize the live arrays, torn values accepted: the store hands out a
  read-only view of each array the steps write; the transport copies its bytes
  once as it sends them (each element old or new), and no array a reader holds
  is ever freed or resized. ``read(since=v)`` still returns every variable
  written after a read at v.
- Checkpoints (``export_state``): every value and slot is copied under no lock,
  so the snapshot holds each array whole-shaped, each element torn at worst
  (finite when the inputs are), ``iterations`` and the version read under the
  store's lock; the version is a lower bound as with the locked apply. The file
  written from it is never corrupted: its bytes are those of the copies.
- Optimizers: sgd (plain, momentum, Nesterov), adam (amsgrad), adamw, adagrad,
  rmsprop (momentum; not centered), with clipping, weight decay and schedules.
  Another one, centered rmsprop or ``use_ema`` is refused at initialize with
  one line naming it (``core.optim.hogwild.check_supported``).
- The only locks a hogwild push takes: its worker's own (below), the store's
  ``_publish`` for a few integer assignments per variable (its step count and
  change stamp, as ``bump_version`` takes it for the version), and the stats'.
  None is held while an array is read or written.

Staleness of a push = the server version when its apply starts minus the
version its gradient was computed from (``base_version``).

Stale gradients (``stale_policy``): "none" applies every push as it is;
"drop" answers a push staler than ``max_staleness`` versions ``dropped``
(counted, nothing applied); "scale" applies it with the learning rate times
1/(1 + staleness) (counted as ``scaled`` when staleness > 0).

Learning rate: a push with ``set_learning_rates`` sets the optimizer's constant
learning rate (``VariableStore.set_learning_rates``; with optimizer groups, each
group's it names) just before its own update, so this update and every later one
use it; refused (a schedule, a group past the spec's) before anything is applied. A dropped push sets nothing. The reply's ``learning_rate`` is the
store's rate read just before the update, before the "scale" factor; a push of
another worker that sets a new rate meanwhile may change it under a concurrent
update, as any async interleaving may. Metrics (``Push.metrics``) are a sync
round's: they are checked against the limits and otherwise ignored here, but for
``SKIP_UPDATE`` > 0: that push's update is skipped (nothing applied, the version still
counts it; a Keras loss scale's step whose gradients are not finite).

Exactly once: a worker's steps must increase. A push repeating the worker's
last applied step (a retry after a lost reply) is answered from the record
(``replayed``) and not applied again; an older step is refused
(``StaleRound``). Pushes of one worker are serialized by that worker's own lock,
so two copies of the same retry cannot both apply; different workers never
wait for each other. That record is of one process: when another process takes
the worker's index (``worker_replaced``) it is forgotten, and the new process's
steps start wherever it starts them. With tasks (``deal_tasks``) the task is the
unit instead: a push of a task already done is answered from the task's record,
checked under the worker's lock, and its step is no input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable

import numpy as np

from ps_common.defaults import MAX_STALENESS
from ps_common.names import ASYNC_APPLIES, STALE_POLICIES, asks_skip
from ps_server.core.errors import InvalidArgument, StaleRound
from ps_server.core.membership import Membership
from ps_server.core.modes.base import Mode, ModeStatus, Push, PushResult, Stats, Ticket
from ps_server.core.store import StoreState, VariableStore


class AsyncMode(Mode):
    name = "async"
    data_plan = "tasks"

    def __init__(self, store: VariableStore, members: Membership, stats: Stats | None = None,
                 stale_policy: str = "none", max_staleness: int = MAX_STALENESS,
                 apply: str = "locked"):
        if apply not in ASYNC_APPLIES:
            raise InvalidArgument(f"apply must be one of {ASYNC_APPLIES}, got {apply!r}")
        if stale_policy not in STALE_POLICIES:
            raise InvalidArgument(f"stale_policy must be one of {STALE_POLICIES}, got {stale_policy!r}")
        if max_staleness < 0:
            raise InvalidArgument(f"max_staleness must be >= 0, got {max_staleness}")
        self.store = store
        self.members = members
        self.stats = stats or Stats()
        self.stale_policy = stale_policy
        self.max_staleness = max_staleness
        self.apply = apply
        self._worker_locks = [threading.Lock() for _ in range(members.num_workers)]
        self._last: dict[int, tuple[int, PushResult]] = {}  # worker -> (last applied step, its answer)
        # deal_tasks: ``applied`` is called with (push, result) once a push was applied or
        # dropped, under that worker's lock (the task queue's bookkeeping); ``applying`` is
        # held around a push's apply and that call (``tasks.TaskGate.applying``): a checkpoint
        # between the two would hold an update whose task is not done.
        self._applied: Callable[[Push, PushResult], None] | None = None
        self._applying: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._answered: Callable[[Push], PushResult | None] = lambda push: None

    def deal_tasks(self, applying: Callable[[], contextlib.AbstractContextManager],
                   applied: Callable[[Push, PushResult], None],
                   answered: Callable[[Push], PushResult | None] = lambda push: None) -> None:
        """``answered(push)``: the recorded answer of a push whose task is already done (under
        the worker's lock: a second copy of a retry), else None."""
        self._applying, self._applied, self._answered = applying, applied, answered

    def submit(self, push: Push, consumed=None) -> Ticket:
        """Apply ``push`` (or answer it from the record) here: a settled ticket, as an async
        push never waits for another (``core.modes``)."""
        def timed() -> PushResult:
            started = time.perf_counter()
            result = self._push(push)
            self.stats.pushed(time.perf_counter() - started)
            return result
        return Ticket.of(timed)

    def expire_overdue(self) -> None:
        """Nothing waits in async mode."""

    def _push(self, push: Push) -> PushResult:
        if push.batch_size == 0:
            raise InvalidArgument(f"async push from worker {push.worker_id} has no examples (batch_size 0)")
        with self._worker_locks[push.worker_id]:  # one worker's pushes in order; others run beside
            if push.task >= 0:  # the task's record, not the step, says whether it was applied
                answer = self._answered(push)
                if answer is not None:
                    self.stats.count("replayed")
                    return answer
            else:
                last = self._last.get(push.worker_id)
                if last is not None and push.step == last[0]:
                    self.stats.count("replayed")
                    return dataclasses.replace(last[1], replayed=True)
                if last is not None and push.step < last[0]:
                    raise StaleRound(f"worker {push.worker_id} already pushed step {last[0]}; "
                                     f"step {push.step} is older")
            with self._applying():
                result = self._apply(push)
                if push.task < 0:
                    self._last[push.worker_id] = (push.step, result)
                if self._applied is not None:  # before ssp's wait for the bound, which may time out
                    self._applied(push, result)
            return result

    def _apply(self, push: Push) -> PushResult:
        seen = self.store.version
        if push.base_version > seen:
            raise InvalidArgument(
                f"worker {push.worker_id} claims base_version {push.base_version}, "
                f"but the server is only at version {seen}"
            )
        staleness = seen - push.base_version
        if self.stale_policy == "drop" and staleness > self.max_staleness:
            self.stats.count("dropped")
            return PushResult(version=seen, staleness=staleness, contributors=0, dropped=True,
                              next_step=push.step + 1)
        self.store.set_learning_rates(push.set_learning_rates)  # refused (a schedule) before anything is applied
        learning_rate = self.store.current_learning_rate(push.gradients)  # before the "scale" policy's factor
        lr_scale = 1.0 / (1 + staleness) if self.stale_policy == "scale" else 1.0
        started = time.perf_counter()
        # One optimizer for the whole push (its learning rate, global_clipnorm's factor over all
        # of it), variable by variable in name order: reproducible; correctness does not depend on it.
        apply = self.store.apply_in_place if self.apply == "hogwild" else self.store.apply_push
        if not asks_skip(push.metrics):  # SKIP_UPDATE: nothing
            apply(push.gradients, lr_scale, key=f"push {push.worker_id}:{push.step}")
        version = self.store.bump_version()
        self.stats.applied(time.perf_counter() - started)
        if lr_scale != 1.0:
            self.stats.count("scaled")
        self.stats.record(pushes=1, examples=push.batch_size, staleness=[staleness], loss=push.loss)
        return PushResult(version=version, staleness=staleness, contributors=1, next_step=push.step + 1,
                          learning_rate=learning_rate)

    def status(self) -> ModeStatus:
        return ModeStatus(active_workers=tuple(range(self.members.num_workers)))

    def workers_died(self, worker_ids: list[int]) -> None:
        """Nothing waits for anyone in async mode: a dead worker only stops pushing."""

    def worker_joined(self, worker_id: int) -> None:
        """A worker that registers again carries on with its own steps."""

    def worker_replaced(self, worker_id: int) -> None:
        """Another process took the index: its steps are not the old one's (module docstring)."""
        with self._worker_locks[worker_id]:
            self._last.pop(worker_id, None)

    def export_state(self) -> tuple[StoreState, ModeStatus]:
        """The store's snapshot: each variable whole, its version a lower bound (see ``store``).
        Hogwild: every array copied under no lock (torn at worst, whole-shaped; module docstring)."""
        return self._snapshot(), self.status()

    def _snapshot(self) -> StoreState:
        state = self.store.export_state()
        if self.apply != "hogwild":
            return state
        copy = lambda a: np.array(a, copy=True) if isinstance(a, np.ndarray) else a  # noqa: E731
        return dataclasses.replace(state, values={n: copy(v) for n, v in state.values.items()},
                                   states={n: {k: copy(a) for k, a in s.items()} for n, s in state.states.items()})

    def restore(self, status: ModeStatus) -> None:
        """Forget each worker's last step: after a restart a worker resumes from its own step,
        which may repeat steps the checkpoint does not hold; they are applied (once) again."""
        for lock in self._worker_locks:
            lock.acquire()
        try:
            self._last.clear()
        finally:
            for lock in self._worker_locks:
                lock.release()
