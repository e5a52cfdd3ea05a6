"""Exactly-once data for async and ssp training: batches handed out as tasks under leases.

    queue = TaskQueue(num_examples=1437, batch_size=64, seed=0, epochs=3, lease_timeout=10.0)
    task = queue.take(worker_id=1)          # Task(task_id, epoch, index, indices), or None
    queue.renew(1)                          # on each heartbeat or push: its tasks' leases
    record = queue.begin(1, task.task_id)   # the push arrived: None -> apply it; a TaskRecord
                                            # -> a retry of a done task: answer from the record
    queue.done(1, task.task_id, version)    # the push was applied at ``version``: True
    queue.given_back(1, task.task_id)       # or: the push was refused (too stale): back in the queue
    queue.lost(1); queue.expire()           # a dead worker's, or overdue, tasks go back
    queue.examples_done(0), queue.epoch_complete(0), queue.status(), queue.finished
    queue.extend(5)                         # a later fit of the same data: epochs 3 and 4 too
    TaskQueue(..., epochs=2, tasks=7)       # Keras' steps_per_epoch: 7 tasks, the 2nd pass cut short

What it serves (issue 17, item 3): "Batches are handed out as tasks; a batch is done
when its push is applied; a batch whose worker dies (lease) or whose push is refused
goes back to the queue; a retried push of a done batch is answered from the record.
Per epoch, the examples applied equal the dataset's size, counted by the server."

**The tasks.** Epoch ``e``'s examples are ``ps_common.batches.epoch_order(num_examples,
seed, e)`` cut into consecutive batches of ``batch_size`` (the last one of an epoch
smaller when the size does not divide): exactly ``ps_common.batches.global_batch``, so
task ``e * steps_per_epoch + index`` trains on the examples of global step
``e * steps_per_epoch + index`` of the sync modes. Task ids are that step number:
deterministic, the same after a restart, dense in ``0 .. total_tasks - 1``.

**Handing out (``take``).** A worker gets, first, the lowest-numbered task that was given
back (a dead worker's, an expired one, a refused push's), else the next fresh task in
order. It may hold several (prefetching); each is held under a lease that ends
``lease_timeout`` after it was taken or last renewed (``renew``, on every heartbeat and
push). ``None``: every task is handed out; the worker waits (some held task may still
come back) or, when ``finished``, stops.

**The epoch boundary.** Tasks of epoch ``e + 1`` are handed out only once every task of
epoch ``e`` has been handed out, not once every one is done: async workers never idle
at a boundary waiting for a straggler's last batch (that would be the barrier async
mode exists to avoid). So near a boundary a few batches of ``e`` may be applied after
the first ones of ``e + 1``; a given-back task of ``e`` still comes before any fresh one
of ``e + 1`` (lowest id first). Counts are per epoch of the task, not of the clock.

**Exactly once: only the current holder completes a task.** A push for a task that is
not done is taken only from the worker holding it now. A worker whose task was taken
away (it was declared lost, its lease ran out, or it gave the task back) and
handed out again is refused (``InvalidArgument``, saying who holds it): its late push
is stale. The other rule, "the first push to arrive wins, the other is a duplicate",
was rejected: with it two workers may both pass the check before either has applied,
so exactly-once would need one lock around every apply, which async mode does not
have (its pushes run side by side, each worker's in order under that worker's lock).
With "only the holder", each task that is not done has at most one worker allowed to
push it, so the worker's own lock is enough. Either rule wastes one computation of a
reassigned batch; this one wastes the stale one.

**Pinned while applied (``begin``).** ``begin`` checks a push and pins its task: from
then until ``done`` (applied) or ``given_back`` (refused), ``lost`` and ``expire`` leave it
where it is, so a task whose push is being applied is never handed to someone else
(the apply would then race the new holder's). A push is answered from the record,
``begin`` returning its ``TaskRecord``, only for the worker whose push did it (a retry
after a lost reply); another worker's push for a done task is refused.
``done`` without ``begin`` is accepted too (a caller that checks and applies under one
lock): it returns False for a task this worker already did (the retry) and counts nothing.

**Over several shards** (``follows``): shard 0 hands the tasks out and keeps the
leases, as above; every other shard's queue follows. A worker pushes a task to the
followers first, then to shard 0 (``worker.sharded_client``). A follower takes a task's
push from whichever worker brings it first (pinned to it while it is applied), answers
any later push of a done task from its record without applying it, and hands nothing
out. So each shard applies each task exactly once: shard 0 the holder's push, a follower
the first to arrive, which is the holder's but where a lease ran out between the two
pushes (then the follower's part is the gradient of the worker that lost the task: the
same examples, computed on parameters a few versions older, as async allows).

**Counting.** Each epoch keeps one bit per example; ``done`` marks its task's examples and
refuses (``InvalidArgument``, nothing changed) one already marked: a bug guard, since
the rules above already make it impossible. ``examples_done(e) == num_examples`` is
"every example of epoch ``e`` applied exactly once", checked by the server.

**A step of several applies** (``applies`` n: ``tfps.keras``, a GAN's ``train_step``
applying two optimizers, the second on the first's update). Each batch is n tasks in a
row, ``b * n + p`` for its apply ``p``: one push each, each handed out, leased, given back
and done on its own, as any task, so a worker lost between two applies of a batch loses
only the applies not yet done, and none is applied twice. A batch's examples count in its
epoch once its n tasks are all done, in whatever order they were.

**Checkpoints (``state`` / ``TaskQueue.restore``).** The state is the done tasks and their
records, as NumPy int64 arrays, and the job's shape as ints. Held tasks are not kept:
after a restore every task not done is handed out again, lowest id first, so a
restarted server repeats no done batch and loses none (a worker's push for a task it
held before the restart is refused: it holds nothing now; its retry of a done task is
answered from the restored record).

Thread-safe: one lock guards everything; nothing is called under it but NumPy, ``heapq``
and the ledger of examples (``cursor.EpochLedger``, whose lock is a leaf); the clock is
read before it is taken. Pure Python and NumPy: no gRPC, no
TensorFlow. ``ParameterServer`` wires it into async and ssp (``AsyncMode.on_applied``);
``TaskGate`` below keeps a checkpoint's done tasks and its values of one moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import threading
import time
from typing import Callable, Iterator

import numpy as np

import ps_common.batches as batches
from ps_common.reasons import Reason
from ps_server.core.data.cursor import EpochLedger
from ps_server.core.errors import InvalidArgument

ORDERS_KEPT = 3  # epoch orders cached: near a boundary two epochs are in use, and a given-back one


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
    """One batch to train on. ``indices`` is read-only; compare tasks by ``task_id``."""

    task_id: int
    epoch: int
    index: int  # the batch's place in its epoch
    indices: np.ndarray

    @property
    def size(self) -> int:
        return len(self.indices)


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """How a done task's push was answered: the worker whose push was applied, at which version."""

    task_id: int
    worker_id: int
    version: int


@dataclasses.dataclass(frozen=True)
class TaskStatus:
    """For Status: ``epoch`` is the lowest epoch not complete (``epochs`` once finished)."""

    epoch: int
    epochs: int
    total: int        # tasks in the whole job
    done: int
    held: int         # handed out, not done (pinned ones included)
    queued: int       # given back, waiting to be handed out again
    outstanding: int  # not done: total - done
    examples_done: int  # in ``epoch``
    num_examples: int


class TaskQueue:
    def __init__(self, num_examples: int, batch_size: int, seed: int, epochs: int, lease_timeout: float,
                 clock: Callable[[], float] = time.monotonic, follows: bool = False, tasks: int = 0,
                 applies: int = 1):
        for name, value in (("num_examples", num_examples), ("batch_size", batch_size), ("epochs", epochs),
                            ("applies", applies)):
            if not _is_int(value) or value < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")
        if not lease_timeout > 0:
            raise InvalidArgument(f"lease_timeout must be > 0 seconds, got {lease_timeout!r}")
        self.num_examples, self.batch_size = int(num_examples), int(batch_size)
        self.seed, self.epochs, self.lease_timeout = int(seed), int(epochs), float(lease_timeout)
        self.steps_per_epoch = batches.steps_per_epoch(self.num_examples, self.batch_size)
        self.applies = int(applies)  # the tasks each batch is (module docstring)
        self.batches = self._total(self.epochs, tasks)  # the job's batches
        self._clock = clock
        self.follows = follows  # a shard but 0: takes a task from whoever brings it (module docstring)
        self._lock = threading.Lock()  # guards everything below (module docstring)
        self._fresh = 0                          # the next task id never handed out
        self._queue: list[int] = []              # heap of given-back task ids
        self._queued: set[int] = set()
        self._holder: dict[int, int] = {}        # task id -> the worker holding it
        self._deadline: dict[int, float] = {}    # task id -> when its lease ends
        self._pinned: set[int] = set()           # held tasks whose push is being applied
        self._records: dict[int, TaskRecord] = {}
        self._ledger = EpochLedger(self.num_examples)  # elastic sync's too: one rule, one count
        self._orders: dict[int, np.ndarray] = {}  # epoch -> its order, the few used last

    # -- the tasks ---------------------------------------------------------------------
    def task(self, task_id: int) -> Task:
        """Task ``task_id`` (deterministic: the same in every process and after a restart)."""
        self._check_id(task_id)
        with self._lock:
            return self._task(int(task_id))

    def _task(self, task_id: int) -> Task:
        epoch, index = divmod(task_id // self.applies, self.steps_per_epoch)
        order = self._orders.pop(epoch, None)
        if order is None:
            order = batches.epoch_order(self.num_examples, self.seed, epoch)
            order.setflags(write=False)
        self._orders[epoch] = order  # the most recently used last
        if len(self._orders) > ORDERS_KEPT:
            del self._orders[next(iter(self._orders))]
        return Task(task_id, epoch, index, order[index * self.batch_size:(index + 1) * self.batch_size])

    def _total(self, epochs: int, tasks: int) -> int:
        """The job's batches: ``epochs`` whole passes, or ``tasks`` (> 0) within those passes, the
        last one reached (Keras' ``steps_per_epoch``: epochs that are not passes)."""
        if not _is_int(tasks) or tasks < 0 or tasks and -(-tasks // self.steps_per_epoch) != epochs:
            raise InvalidArgument(f"{tasks!r} tasks of {self.steps_per_epoch} a pass do not reach exactly "
                                  f"{epochs} pass(es)")
        return int(tasks) or epochs * self.steps_per_epoch

    def extend(self, epochs: int, tasks: int = 0) -> None:
        """The job goes on to ``epochs`` (``tasks``: as ``__init__`` takes them), a later ``fit``
        of the same data: the tasks added are handed out after every task before them."""
        total = self._total(epochs, tasks)
        if total < self.batches:
            raise InvalidArgument(f"a job of {self.batches} batches goes on to more, not {total}")
        with self._lock:
            self.epochs, self.batches = int(epochs), total

    @property
    def total_tasks(self) -> int:
        """The job's tasks: ``applies`` a batch."""
        return self.batches * self.applies

    @property
    def data(self) -> tuple[int, int, int, int]:
        """(examples, batch size, seed, applies): what every plan of the job holds alike."""
        return self.num_examples, self.batch_size, self.seed, self.applies

    # -- handing out -------------------------------------------------------------------
    def take(self, worker_id: int) -> Task | None:
        """The next task for ``worker_id``, held under a lease; None when every task is handed out."""
        self._check_worker(worker_id)
        if self.follows:
            raise InvalidArgument("this server is a shard of an elastic job but shard 0: shard 0 hands out the "
                                  "tasks; ask it")
        now = self._clock()
        with self._lock:
            if self._queue:
                task_id = heapq.heappop(self._queue)
                self._queued.discard(task_id)
            else:
                while self._fresh < self.total_tasks and self._fresh in self._records:
                    self._fresh += 1  # done before a restore
                if self._fresh == self.total_tasks:
                    return None
                task_id = self._fresh
                self._fresh += 1
            self._holder[task_id] = worker_id
            self._deadline[task_id] = now + self.lease_timeout
            return self._task(task_id)

    def renew(self, worker_id: int) -> int:
        """Extend the lease of every task ``worker_id`` holds; returns how many it holds."""
        now = self._clock()
        with self._lock:
            mine = [t for t, w in self._holder.items() if w == worker_id]
            for t in mine:
                self._deadline[t] = now + self.lease_timeout
            return len(mine)

    def held(self, worker_id: int) -> list[int]:
        with self._lock:
            return sorted(t for t, w in self._holder.items() if w == worker_id)

    # -- a push ------------------------------------------------------------------------
    def begin(self, worker_id: int, task_id: int) -> TaskRecord | None:
        """A push of ``task_id`` from ``worker_id`` arrived. None: apply it (the task is pinned
        until ``done`` or ``given_back``). A TaskRecord: this worker's push of it was already
        applied; answer from the record, apply nothing. InvalidArgument: not this worker's."""
        self._check_id(task_id)
        with self._lock:
            record = self._check_push(worker_id, task_id)
            if record is None:
                self._pinned.add(task_id)
                if self.follows:  # held by the worker whose push is being applied, while it is
                    self._holder[task_id], self._deadline[task_id] = worker_id, float("inf")
            return record

    def done(self, worker_id: int, task_id: int, applied_version: int) -> bool:
        """``worker_id``'s push of ``task_id`` was applied at ``applied_version``: True when newly
        done (its examples counted), False when this worker had already done it (a retry:
        nothing counted, the first record kept; see ``record``)."""
        self._check_id(task_id)
        if not _is_int(applied_version) or applied_version < 0:
            raise InvalidArgument(f"applied_version must be an integer >= 0, got {applied_version!r}")
        with self._lock:
            if self._check_push(worker_id, task_id) is not None:
                return False
            task = self._task(task_id)
            if self._batch_done(task_id):  # its batch's last task: the examples count
                self._ledger.fold(task.epoch, task.indices)  # the bug guard; raises before any change
            self._records[task_id] = TaskRecord(task_id, worker_id, int(applied_version))
            self._holder.pop(task_id, None), self._deadline.pop(task_id, None)
            self._pinned.discard(task_id)
            return True

    def given_back(self, worker_id: int, task_id: int) -> None:
        """``worker_id``'s push of ``task_id`` was refused (e.g. dropped as too stale): the task
        goes back to the queue, to be handed out again."""
        self._check_id(task_id)
        with self._lock:
            if self._check_push(worker_id, task_id) is not None:
                raise InvalidArgument(f"task {task_id} is already done (by worker {worker_id}'s push); "
                                      f"it cannot be given back")
            if self.follows:  # nothing to hand out again: the next push of it is taken
                self._holder.pop(task_id, None), self._deadline.pop(task_id, None)
                self._pinned.discard(task_id)
                return
            self._requeue(task_id)

    def record(self, task_id: int) -> TaskRecord | None:
        """How ``task_id``'s push was answered, if it is done."""
        self._check_id(task_id)
        with self._lock:
            return self._records.get(int(task_id))

    def _batch_done(self, task_id: int) -> bool:
        """Under the lock: whether every other task of ``task_id``'s batch is done."""
        first = task_id - task_id % self.applies
        return all(t in self._records for t in range(first, first + self.applies) if t != task_id)

    def _check_push(self, worker_id: int, task_id: int) -> TaskRecord | None:
        """Under the lock: None if ``worker_id`` holds ``task_id`` (not done), its record if this
        worker did it; InvalidArgument otherwise."""
        task_id = int(task_id)
        record = self._records.get(task_id)
        if record is not None:
            if record.worker_id == worker_id or self.follows:
                return record
            raise InvalidArgument(f"task {task_id} was already done by worker {record.worker_id}'s push "
                                  f"(version {record.version}); worker {worker_id} does not hold it", reason=Reason.TASK_DONE)
        holder = self._holder.get(task_id)
        if holder == worker_id or (self.follows and holder is None):
            return None
        if holder is not None:
            why = f"it is held by worker {holder}"
        elif task_id in self._queued:
            why = "it was given back and waits to be handed out again"
        else:
            why = "it was not handed out yet"
        raise InvalidArgument(f"worker {worker_id} does not hold task {task_id}: {why}; "
                              f"a worker pushes only the tasks it holds now (take a new one)", reason=Reason.TASK_NOT_HELD)

    # -- taking tasks back -------------------------------------------------------------
    def lost(self, worker_id: int) -> list[Task]:
        """``worker_id`` died or left: every task it holds goes back (those whose push is being
        applied stay, until ``done`` or ``given_back``). Returns them."""
        with self._lock:
            back = sorted(t for t, w in self._holder.items() if w == worker_id and t not in self._pinned)
            for t in back:
                self._requeue(t)
            return [self._task(t) for t in back]

    def expire(self, now: float | None = None) -> list[Task]:
        """Every held task whose lease ended before ``now`` (default: the clock) goes back,
        except one whose push is being applied. Returns them."""
        now = self._clock() if now is None else now
        with self._lock:
            back = sorted(t for t, d in self._deadline.items() if d < now and t not in self._pinned)
            for t in back:
                self._requeue(t)
            return [self._task(t) for t in back]

    def _requeue(self, task_id: int) -> None:
        del self._holder[task_id], self._deadline[task_id]
        self._pinned.discard(task_id)
        heapq.heappush(self._queue, task_id)
        self._queued.add(task_id)

    # -- counting ----------------------------------------------------------------------
    def examples_done(self, epoch: int) -> int:
        self._check_epoch(epoch)
        with self._lock:
            return self._ledger.count(epoch)

    def epoch_examples(self) -> tuple[int, ...]:
        """Each epoch's examples applied so far, epoch 0 to the newest begun (``EpochLedger.counts``)."""
        return self._ledger.counts() or (0,)

    def epoch_complete(self, epoch: int) -> bool:
        return self.examples_done(epoch) == self.num_examples

    @property
    def finished(self) -> bool:
        """Every task of every epoch is done."""
        with self._lock:
            return len(self._records) == self.total_tasks

    def status(self) -> TaskStatus:
        with self._lock:
            epoch = next((e for e in range(self.epochs) if self._ledger.count(e) < self.num_examples),
                         self.epochs)
            done = len(self._records)
            return TaskStatus(epoch=epoch, epochs=self.epochs, total=self.total_tasks, done=done,
                              held=len(self._holder), queued=len(self._queue),
                              outstanding=self.total_tasks - done,
                              examples_done=self._ledger.count(epoch) if epoch < self.epochs else 0,
                              num_examples=self.num_examples)

    # -- checkpoints -------------------------------------------------------------------
    def state(self) -> dict:
        """The done tasks and their records (plain ints and int64 arrays), for a checkpoint."""
        with self._lock:
            ids = sorted(self._records)
            return {
                "num_examples": self.num_examples, "batch_size": self.batch_size,
                "seed": self.seed, "epochs": self.epochs, "tasks": self.batches, "applies": self.applies,
                "done_task_ids": np.array(ids, np.int64),
                "done_workers": np.array([self._records[t].worker_id for t in ids], np.int64),
                "done_versions": np.array([self._records[t].version for t in ids], np.int64),
            }

    @classmethod
    def restore(cls, state: dict, lease_timeout: float,
                clock: Callable[[], float] = time.monotonic, follows: bool = False) -> "TaskQueue":
        """A queue with ``state``'s done tasks done; every other task is handed out again."""
        queue = cls(int(state["num_examples"]), int(state["batch_size"]), int(state["seed"]),
                    int(state["epochs"]), lease_timeout, clock, follows, int(state.get("tasks", 0)),
                    int(state.get("applies", 1)))
        ids, workers, versions = (np.asarray(state[k], np.int64).reshape(-1)
                                  for k in ("done_task_ids", "done_workers", "done_versions"))
        if not ids.size == workers.size == versions.size:
            raise InvalidArgument(f"task state: {ids.size} done task ids but {workers.size} workers "
                                  f"and {versions.size} versions")
        if (workers < 0).any() or (versions < 0).any():
            raise InvalidArgument("task state: done workers and versions must be >= 0")
        for t, w, v in zip(ids.tolist(), workers.tolist(), versions.tolist()):
            queue._check_id(t)
            if t in queue._records:
                raise InvalidArgument(f"task state: task {t} is listed twice: it would be trained on twice")
            queue._records[t] = TaskRecord(t, w, v)
        for t in queue._records:
            if t % queue.applies == queue.applies - 1 and queue._batch_done(t):
                task = queue._task(t)
                queue._ledger.fold(task.epoch, task.indices)
        return queue

    # -- checks ------------------------------------------------------------------------
    def _check_id(self, task_id: int) -> None:
        if not _is_int(task_id) or not 0 <= task_id < self.total_tasks:
            raise InvalidArgument(f"unknown task {task_id!r}: this job's tasks are 0..{self.total_tasks - 1} "
                                  f"({self.epochs} epochs of {self.steps_per_epoch} batches"
                                  + (f", {self.applies} tasks each)" if self.applies > 1 else ")"))

    def _check_epoch(self, epoch: int) -> None:
        if not _is_int(epoch) or not 0 <= epoch < self.epochs:
            raise InvalidArgument(f"unknown epoch {epoch!r}: this job has epochs 0..{self.epochs - 1}")

    @staticmethod
    def _check_worker(worker_id: int) -> None:
        if not _is_int(worker_id) or worker_id < 0:
            raise InvalidArgument(f"worker id must be an integer >= 0, got {worker_id!r}")


class TaskGate:
    """Pushes of tasks against a checkpoint's snapshot: a reader-writer lock.

        with gate.applying():   # a task's push: from before its apply until its task is recorded
            ...
        with gate.still():      # a checkpoint: while it collects the store's references and the done tasks
            ...

    Any number of pushes hold it together (``applying``, shared): they still run side by
    side, as async mode's pushes do. A checkpoint holds it alone (``still``, exclusive):
    it waits for the pushes in their apply to record their task, and holds new ones back
    until it has collected references (zero-copy, short; ``ParameterServer.checkpoint_state``).
    A waiting checkpoint goes before pushes that arrive after it: a steady stream of
    overlapping pushes cannot starve it. Lock order: a worker's lock (``AsyncMode``), then
    this, then the store's and the task queue's locks. Nothing that holds it waits for
    another push (ssp's wait for the bound comes after ``applying`` ends).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._no_snapshot = threading.Condition(self._lock)  # pushes wait here while a checkpoint holds it
        self._no_apply = threading.Condition(self._lock)     # a checkpoint waits here for pushes to finish
        self._applying = 0
        self._snapshots_waiting = 0
        self._snapshot = False

    @contextlib.contextmanager
    def applying(self) -> Iterator[None]:
        with self._lock:
            while self._snapshot or self._snapshots_waiting:
                self._no_snapshot.wait()
            self._applying += 1
        try:
            yield
        finally:
            with self._lock:
                self._applying -= 1
                if not self._applying:
                    self._no_apply.notify_all()

    @contextlib.contextmanager
    def still(self) -> Iterator[None]:
        with self._lock:
            self._snapshots_waiting += 1
            try:
                while self._snapshot or self._applying:
                    self._no_apply.wait()
            finally:
                self._snapshots_waiting -= 1
            self._snapshot = True
        try:
            yield
        finally:
            with self._lock:
                self._snapshot = False
                self._no_apply.notify_all()  # another checkpoint waiting
                self._no_snapshot.notify_all()


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
