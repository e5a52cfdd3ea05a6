"""The parameter server's core: the one object the gRPC service drives.

    ps = ParameterServer(mode="sync", num_workers=2, barrier_timeout=60.0)
    reg = ps.register(worker_index=0, claimed_num_workers=2)
    ps.tick()        # every second or so: declare silent workers dead, apply the policy
    ps.initialize({"w": w0}, OptimizerSpec("sgd", learning_rate=0.1))
    version, values = ps.pull()
    version, changed = ps.pull(since=version)     # only variables updated after it
    ticket = ps.submit(Push(worker_id=0, step=0, base_version=version, batch_size=32, gradients=g,
                            metrics={"acc/total": d}, set_learning_rates=(0.05,)))  # both optional
    result = ticket.result(timeout=60.0)   # settled once the push is answered (a sync round)
    ps.submit_broadcast(0, "epoch-1", b"stop", 30.0)   # the chief posts; another worker's ticket: once posted
    state = ps.checkpoint_state()    # for core.checkpoint.write_checkpoint; None before initialize
    ParameterServer(mode="sync", num_workers=2).restore(state)   # carries on where ps was

Plain Python and NumPy: no gRPC, no protobuf, no TensorFlow (a test imports it
in a fresh interpreter to hold that). Errors are ``core.errors`` classes; the
service module maps them to gRPC status codes. Every method is thread-safe.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Callable, Iterable, Mapping

import numpy as np

from ps_common.names import broadcast_poster
from ps_common.records import Registration
from ps_common.sparse import SparseRows
from ps_server.core.optim import hogwild
from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.broadcast import Broadcasts
from ps_server.core.checkpoint import DataState, ServerState
from ps_server.core.clip_group import ClipGroup, ClipTimeout, NormBoard
from ps_server.core.data.cursor import Cursor, DataPlan, EpochLedger
from ps_server.core.modes.elastic_mode import ElasticReply, ElasticSyncMode
from ps_server.core.errors import ConfigMismatch, InvalidArgument, PSError, SpecConflict
from ps_server.core.membership import Membership, MembershipEvent, WorkerRecord
from ps_server.core.modes.base import ModeStatus, Push, PushResult, ShardGroup, Stats, Ticket
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.settings import Settings
from ps_server.core.store import StoreState, VariableStore
from ps_server.core.modes.ssp_mode import SSPMode
from ps_server.core.data.tasks import Task, TaskGate, TaskQueue
from ps_server.core.modes.sync_mode import SyncMode

log = logging.getLogger("ps_server.core")


@dataclasses.dataclass(frozen=True)
class TaskOffer:
    """Async and ssp with a data plan: what ``work`` hands a worker. ``task`` None: every
    task is handed out; ``finished`` says whether all are done (stop) or some may still
    come back (ask again soon)."""

    task: Task | None
    finished: bool


@dataclasses.dataclass(frozen=True)
class Status:
    """The server at a glance. ``ps_server.service`` sends it as ``StatusResponse`` by
    these fields (``STATUS`` there: same names, a few renamed or converted), so a field
    added here reaches the wire or fails ``tests/service/test_records.py``."""

    mode: str
    num_workers: int
    initialized: bool
    version: int
    round: int
    waiting_for: tuple[int, ...]
    workers: list[WorkerRecord]
    pushes_applied: int
    examples_applied: int
    mean_staleness: float
    max_staleness_seen: int  # observed; the bound (--max-staleness) is max_staleness
    optimizer: OptimizerSpec | None
    num_variables: int
    num_parameters: int
    uptime_s: float
    rounds_timed_out: int
    last_loss: float
    incarnation: str = ""
    pushes_dropped: int = 0
    pushes_replayed: int = 0
    rounds_aborted: int = 0
    dead_worker_policy: str = ""
    replicas_to_aggregate: int = 0
    lease_timeout: float = 0.0
    active_workers: tuple[int, ...] = ()
    last_checkpoint_version: int = -1  # -1: none written or restored by this process
    checkpoint_age_s: float = -1.0  # seconds since that checkpoint was written or restored
    staleness: int = -1  # ssp: S (--staleness); -1 in the other modes
    stale_gradient_policy: str = "none"
    max_staleness: int = 0  # policy drop: pushes staler than this are dropped (--max-staleness)
    pushes_scaled: int = 0
    max_ahead: int = 0  # ssp: the most steps an applied push was ahead of the slowest worker
    optimizer_iterations: int = 0  # the optimizer steps every trainable variable has had (Keras' iterations)
    learning_rate_now: float = 0.0  # the learning rate of the next update (a schedule's at that count); 0 before init
    # With a data plan (elastic sync's rounds, async and ssp's tasks): the examples each
    # epoch has applied so far, each counted once (epoch 0 first); () without one.
    epoch_examples: tuple[int, ...] = ()
    num_examples: int = 0  # the plan's dataset size: an epoch is complete at this many
    tasks_total: int = 0  # async and ssp with a data plan: the job's tasks (batches), and
    tasks_done: int = 0   # how many are applied, handed out and not done, and given back
    tasks_held: int = 0   # (a dead worker's, an expired lease's, a refused push's) waiting
    tasks_queued: int = 0  # to be handed out again
    # Who joined, left or was declared dead, when (wall time) and at which round and version,
    # oldest first: the newest ``membership.HISTORY_LIMIT``, and how many older ones were let go.
    membership: tuple[MembershipEvent, ...] = ()
    membership_dropped: int = 0


_REGISTRATION_FROM_STATUS = tuple(f for f in dataclasses.fields(Registration)
                                  if f.name in {g.name for g in dataclasses.fields(Status)})


def _store_part(state) -> dict:
    """The fields of a checkpoint (``ServerState``) that are the store's (``StoreState``),
    read from either: the checkpoint holds the store's snapshot under the same names."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(StoreState)}


def _mode(s: Settings, store: VariableStore, members: Membership, stats: Stats, clock):
    """The mode ``s`` asks for (``core.modes``)."""
    if s.elastic:
        return ElasticSyncMode(store, members, None, s.elastic_min_workers, s.barrier_timeout, stats, clock=clock)
    if s.mode == "sync":
        return SyncMode(store, members, s.num_workers, s.barrier_timeout, stats, clock=clock,
                        policy=s.dead_worker_policy, replacement_timeout=s.replacement_timeout,
                        replicas_to_aggregate=s.replicas_to_aggregate)
    if s.mode == "ssp":
        return SSPMode(store, members, s.staleness, s.barrier_timeout, stats, stale_policy=s.stale_gradient_policy,
                       max_staleness=s.max_staleness, clock=clock, apply=s.async_apply)
    return AsyncMode(store, members, stats, stale_policy=s.stale_gradient_policy, max_staleness=s.max_staleness,
                     apply=s.async_apply)


class ParameterServer:
    def __init__(self, mode: str = "sync", num_workers: int = 1, *, clock=time.monotonic, **settings):
        """``settings``: the rest of ``core.settings.Settings``, by name."""
        s = self.settings = Settings(mode, num_workers, **settings)
        self.incarnation = uuid.uuid4().hex[:12]
        self._clock = clock
        self.tasks: TaskQueue | None = None  # async and ssp with a data plan (core.data.tasks)
        self._gate = TaskGate()  # task pushes (shared) against checkpoints (exclusive): checkpoint_state
        self.members = Membership(num_workers, s.lease_timeout, clock=clock)
        self.store = VariableStore(s.sparse_updates, s.sparse_rule)  # --sparse-updates, --sparse-rule: core.optim.sparse
        self.stats = Stats()
        self.broadcasts = Broadcasts(timeout_limit=s.barrier_timeout, clock=clock)
        # global_clipnorm over several shards: the group, shard 0's board, and how a shard
        # asks shard 0 (set by the server layer: ``clip_peer(address)`` gives a function
        # ``(key, shard, squares, timeout) -> factor``; None: in-process, shard 0 only).
        self.clip_group: ClipGroup | None = None
        self.norm_board: NormBoard | None = None
        self.clip_peer = None
        # The model on shards where shard 0 decides what each update holds (``ShardGroup``,
        # from the chief's initialize); ``round_peer(address)`` gives shard 0 a function
        # ``(round, contributors, timeout) -> version`` that commits a round there (the server
        # layer's CommitRound call).
        self.shard_group: ShardGroup | None = None
        self.round_peer = None
        self._started = time.monotonic()
        self._checkpoint: tuple[int, float] | None = None  # (version, monotonic time) of the last one
        self.mode = _mode(s, self.store, self.members, self.stats, clock)

    def register(self, worker_index: int, claimed_num_workers: int = 0, name: str = "",
                 process: str = "") -> Registration:
        """Register (or register again) a worker process (``process``: its token). A process that
        takes an index from another (``WorkerRecord.replaced``: a restarted worker on its old index,
        an auto index handed a dead worker's) is a new incarnation: what the old one left (its
        last step and replay record, the tasks it held) is forgotten at once, so nothing of it
        answers or blocks the new one (``core.membership``)."""
        rec = self.members.register(worker_index, claimed_num_workers, name, at=self._position(), process=process)
        if rec.replaced:
            self.mode.worker_replaced(rec.worker_id)
            if self.tasks is not None:
                self._tasks_back(rec.worker_id, self.tasks.lost(rec.worker_id), "another process took its index")
        self.mode.worker_joined(rec.worker_id)
        # What a worker learns when it joins is the status's (mode, version, round, lease,
        # incarnation, ...), read once from there, plus its id and the barrier timeout.
        status = self.status()
        shared = {f.name: getattr(status, f.name) for f in _REGISTRATION_FROM_STATUS}
        return Registration(worker_id=rec.worker_id, barrier_timeout=self.settings.barrier_timeout,
                            round_restored=self.mode.round_restored(), sparse_rule=self.store.sparse_rule, **shared)

    def _position(self) -> tuple[int, int]:
        """(round, version) now, for the membership history. Takes the mode's lock: never call
        it from under a lock the mode may wait for."""
        return self.mode.status().round, self.store.version

    def finished(self) -> tuple[bool, list[int], list[int]]:
        """(done, left, dead): see Membership.finished; ps-server --exit-when-done stops on done.
        Elastic: once someone finished and nobody trains, however many indices were used."""
        return self.members.finished(every_index=not self.settings.elastic)

    def heartbeat(self, worker_id: int, step: int = -1, process: str = "") -> None:
        """Renew the worker's lease and its tasks'; Superseded (renewing nothing) when ``process``
        is not the one that holds the index now."""
        self.members.heartbeat(worker_id, process)
        if self.tasks is not None:
            self.tasks.renew(worker_id)

    def tick(self) -> list[int]:
        """Declare workers whose lease ran out dead and apply the dead-worker policy."""
        dead = self.members.expire(at=self._position())
        if dead:
            log.warning("worker(s) %s declared dead: no call or heartbeat for more than %g s",
                        self.members.describe(dead), self.members.lease_timeout)
            self.mode.workers_died(dead)
        if self.tasks is not None:
            for w in dead:
                self._tasks_back(w, self.tasks.lost(w), "it was declared dead")
            for task in self.tasks.expire():
                log.warning("task %d (epoch %d) goes back to the queue: its lease ran out", task.task_id, task.epoch)
        self.mode.expire_overdue()  # submit()'s waits have no thread watching their time
        self.broadcasts.expire_overdue()
        return dead

    def initialize(self, worker_id: int, variables: Mapping[str, np.ndarray], spec: OptimizerSpec,
                   non_trainable: Iterable[str] = (), owned: bool = False,
                   data_plan: DataPlan | None = None, clip_group: ClipGroup | None = None,
                   shard_group: ShardGroup | None = None) -> tuple[bool, int]:
        """(created, version). Repeating an identical initialization is harmless.
        ``owned``: the arrays are given up to the store, not copied (``store.initialize``).
        ``data_plan``: elastic sync's (required there, refused elsewhere): the job's examples,
        global batch and seed, from which the server's cursor deals every round; async and
        ssp's tasks, whose epochs a later plan of the same data extends (a later ``fit``).
        ``non_trainable``: variables updated by their pushed change, not the optimizer (``store``).
        ``shard_group``: this server's place among shards that follow shard 0 (``ShardGroup``).
        With ``async_apply="hogwild"`` an optimizer it cannot run in place is refused
        (InvalidArgument naming it) before anything is stored."""
        self.members.require(worker_id)
        if self.settings.async_apply == "hogwild":  # refused before anything is stored, naming the optimizer
            hogwild.check_supported(spec)
        self._check_shard_group(shard_group)
        cursor = self._cursor_of(data_plan)
        if cursor is not None and self.mode.cursor not in (None, cursor):
            raise SpecConflict(f"the job's data plan is {self.mode.cursor}; this initialize brings {cursor}")
        tasks = self._tasks_of(data_plan, shard_group)
        self._check_clip_group(clip_group, spec)
        created = self.store.initialize(variables, spec, frozenset(non_trainable), owned=owned)
        if clip_group is not None:
            self._use_clip_group(clip_group)
        self._use_shards(shard_group)
        if cursor is not None:
            self.mode.set_cursor(cursor)
        if tasks is not None and self.tasks is None:
            self._use_tasks(tasks)
        elif tasks is not None and tasks.total_tasks > self.tasks.total_tasks:  # a later fit: the job goes on
            self.tasks.extend(tasks.epochs, tasks.batches)
        return created, self.store.version

    # -- global_clipnorm over several shards (core.clip_group) -------------------------------
    def _check_clip_group(self, group: ClipGroup | None, spec: OptimizerSpec) -> None:
        """Refuse, before anything is stored, a clip group this server cannot take."""
        if group is None:
            return
        if spec.global_clipnorm is None:
            raise InvalidArgument("a clip group is for global_clipnorm over several shards; this optimizer "
                                  "does not clip globally")
        if group.shard != 0 and self.clip_peer is None:
            raise InvalidArgument("this server cannot reach shard 0 for the global norm (no peer connector)")
        if self.clip_group not in (None, group):
            raise SpecConflict(f"this shard clips with {self.clip_group}; this initialize brings {group}")

    def _use_clip_group(self, group: ClipGroup) -> None:
        """From now on every update's ``global_clipnorm`` factor is the group's (``clip_norm``)."""
        if self.clip_group == group:
            return
        self.clip_group = group
        self.norm_board = NormBoard(group, self.store.clip_scale_of) if group.shard == 0 else None
        ask = self.clip_peer(group.shards[0]) if group.shard else self._ask_board
        timeout = self.settings.barrier_timeout

        def across(key: str, squares: Mapping[str, np.floating]) -> np.floating:
            return ask(key, group.shard, squares, timeout)
        self.store.clip_across = across

    def clip_norm(self, key: str, shard: int, squares: Mapping[str, np.floating]) -> Ticket:
        """Shard ``shard``'s squares of update ``key`` (the ClipNorm call, on shard 0): the
        ticket settles with the factor once every shard's are in (``NormBoard``)."""
        if self.norm_board is None:
            raise InvalidArgument("this server is not shard 0 of a clip group: it gathers no norms")
        return self.norm_board.contribute(key, shard, squares)

    def _ask_board(self, key: str, shard: int, squares: Mapping[str, np.floating], timeout: float) -> np.floating:
        """Shard 0's own squares, waiting for the other shards' (lock-free: they come by RPC)."""
        ticket = self.norm_board.contribute(key, shard, squares)
        try:
            return ticket.result(timeout)
        except TimeoutError:
            self.norm_board.forget(key, shard)
            raise ClipTimeout(f"global_clipnorm: not every shard brought its gradients' norm for {key} within "
                              f"{timeout:g} s; nothing applied") from None

    def _use_tasks(self, tasks: TaskQueue) -> None:
        """Deal the job's data as ``tasks``: each push of one is applied and recorded done
        inside the gate (``checkpoint_state``)."""
        self.mode.deal_tasks(self._gate.applying, self._task_applied, self._task_answer)
        self.tasks = tasks

    def _tasks_of(self, plan: "DataPlan | None", group: ShardGroup | None = None) -> TaskQueue | None:
        """Async and ssp: the task queue a data plan makes (refusing one that conflicts with
        the job's), checked before anything is stored."""
        if self.mode.data_plan != "tasks":
            return None
        if plan is None:
            if self.tasks is not None:
                raise SpecConflict(f"this job's data is dealt as tasks ({_plan_text(self.tasks)}); an initialize "
                                   f"without that data plan belongs to another job")
            return None
        if self.store.initialized and self.tasks is None:
            raise SpecConflict("this job was initialized without a data plan (its workers read their own "
                               "shards); an initialize with one belongs to another job")
        if plan.epochs < 1:
            raise InvalidArgument(f"an async or ssp data plan needs the job's epochs (>= 1), got {plan.epochs}")
        queue = TaskQueue(plan.num_examples, plan.global_batch_size, plan.seed, plan.epochs,
                          self.members.lease_timeout, self._clock, follows=group is not None and group.shard > 0,
                          tasks=plan.tasks, applies=plan.applies)
        # the same data; a later fit's plan goes on to more epochs, a restarted chief's first fit's to fewer
        if self.tasks is not None and self.tasks.data != queue.data:
            raise SpecConflict(f"the job's data plan is {_plan_text(self.tasks)}; this initialize brings "
                               f"{_plan_text(queue)}")
        return queue

    def _cursor_of(self, plan: "DataPlan | None") -> Cursor | None:
        if self.mode.data_plan != "elastic":
            if plan is not None and not self.mode.data_plan:
                raise InvalidArgument("a sync data plan is for elastic sync (ps-server --elastic-min-workers: "
                                      "the server deals the batches); this server's workers read their own shards")
            return None
        if plan is None:
            raise InvalidArgument("elastic sync needs the job's data plan with initialize (examples, global "
                                  "batch size, seed): the server deals every round's micro-batches")
        return Cursor(plan.num_examples, plan.global_batch_size, plan.seed, self.settings.micro_batches, plan.applies)

    def _check_shard_group(self, group: ShardGroup | None) -> None:
        """Refuse, before anything is stored, a shard group this server cannot take."""
        if group is None:
            return
        if self.shard_group not in (None, group):
            raise SpecConflict(f"this server is shard {self.shard_group.shard} of {list(self.shard_group.shards)}; "
                               f"this initialize makes it shard {group.shard} of {list(group.shards)}")
        if group.shard == 0 and self._commits_rounds and self.round_peer is None:
            raise InvalidArgument("this server cannot reach the other shards to commit rounds (no peer connector)")

    @property
    def _commits_rounds(self) -> bool:
        """Shard 0 of a group decides what each round holds: elastic sync (its micro-batches),
        sync with backup workers (its contributors). Tasks are held by shard 0's queue."""
        s = self.settings
        return s.elastic or (self.mode.rounds and 0 < s.replicas_to_aggregate < s.num_workers)

    def _use_shards(self, group: ShardGroup | None) -> None:
        """From now on this server is its place in ``group``: shard 0 commits the rounds it
        completes on the others (``Mode.follow``), which follow it; with tasks each shard's
        queue knows its part (``TaskQueue(follows=...)``)."""
        if group is None or self.shard_group == group:
            return
        self.shard_group = group
        if not self._commits_rounds:
            return
        if group.shard:
            self.mode.follow(group.shard, None)
            return
        commits = [self.round_peer(a) for a in group.shards[1:]]
        pool = concurrent.futures.ThreadPoolExecutor(len(commits), thread_name_prefix="commit-round")
        timeout = self.settings.barrier_timeout

        def commit(round_: int, contributors: tuple) -> Callable[[], None]:
            started = [pool.submit(c, round_, contributors, timeout) for c in commits]

            def wait() -> None:
                failures = [f.exception() for f in started]
                first = next((e for e in failures if e is not None), None)
                if first is not None:
                    raise first if isinstance(first, PSError) else ConfigMismatch(str(first))
            return wait
        self.mode.follow(0, commit)

    def commit_round(self, round_: int, contributors: Iterable[int] = ()) -> int:
        """A shard that follows shard 0: apply round ``round_``, which shard 0 completed (the
        CommitRound call; with backup workers, of ``contributors``' pushes); the version after it."""
        if self.shard_group is None or not self.shard_group.shard:
            raise InvalidArgument("CommitRound is shard 0's call to the shards that follow it; this server "
                                  "follows no shard 0")
        return self.mode.commit_round(int(round_), tuple(int(w) for w in contributors))

    def work(self, worker_id: int) -> Ticket:
        """Elastic sync: a ticket for this worker's micro-batches (``ElasticSyncMode.work``).
        Async and ssp with a data plan: one settled at once with a ``TaskOffer``."""
        self.members.require(worker_id)
        if self.tasks is not None:
            task = self.tasks.take(worker_id)
            ticket = Ticket()
            ticket.settle(TaskOffer(task, task is None and self.tasks.finished))
            return ticket
        if self.mode.data_plan != "elastic":
            why = ("its chief initialized it without a data plan" if self.mode.data_plan == "tasks"
                   else "it is not elastic")
            raise InvalidArgument(f"work is dealt by elastic sync, or by async and ssp with a data plan; "
                                  f"this server's workers compute their own shards ({why})")
        return self.mode.work(worker_id)

    def pull(self, worker_id: int | None = None, names: Iterable[str] | None = None,
             since: int | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """(version, values); with ``since``, only the variables changed after that version."""
        if worker_id is not None and worker_id >= 0:
            self.members.require(worker_id)
        return self.store.read(names, since)

    def optimizer_state(self, worker_id: int | None = None) -> tuple[int, dict[str, np.ndarray], dict[str, dict]]:
        """(version, values, {variable: {slot: array, "iterations": n}}): every variable and
        its optimizer state as of one version (a checkpoint's snapshot: dense arrays as the
        store holds them, never written again; a row-wise table read whole): what a worker
        writes into a Keras model file."""
        if worker_id is not None and worker_id >= 0:
            self.members.require(worker_id)
        state, shared = self.store.export_state(), self.store.shared
        try:  # the values of the variables; the states of their second names too (``VariableStore.shared``)
            values = {n: np.asarray(v) for n, v in state.values.items() if n not in shared}
            states = {n: {k: (np.asarray(a) if k != "iterations" else int(a)) for k, a in s.items()}
                      for n, s in state.states.items()}
            return state.version, values, states
        finally:
            state.release()

    def take_averages(self, worker_id: int, names: Iterable[str], batches: int = 0) -> None:
        """``VariableStore.take_averages`` for a registered worker (the end of its ``fit``)."""
        self.members.require(worker_id)
        self.store.take_averages(list(names), batches)

    def pull_rows(self, worker_id: int | None = None, names: Iterable[str] | None = None,
                  since: int | None = None) -> tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(version, values, rows): ``pull``, but with ``since`` a row-wise table (``store``)
        comes as the rows changed after that version, ``rows[name]`` naming them."""
        if worker_id is not None and worker_id >= 0:
            self.members.require(worker_id)
        return self.store.read_rows(names, since)

    def check_push(self, worker_id: int, step: int, base_version: int, batch_size: int,
                   specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]], sparse: Iterable[str] = (),
                   metrics: Mapping[str, np.ndarray] | None = None, set_learning_rates=()) -> None:
        """Refuse a push from its header alone, before its gradients arrive (streamed pushes):
        the worker, the step bounds, the metrics' limits and the learning rate's value, and
        every gradient's name, shape and dtype (for the names in ``sparse``, rows of the
        variable). ``push`` checks all of it again, with the values."""
        self.members.require(worker_id)
        Push(worker_id, step, base_version, batch_size, {}, metrics=metrics or {},
             set_learning_rates=set_learning_rates).validate()
        self.store.check_learning_rates(set_learning_rates)
        self.store.check_gradient_specs(specs, frozenset(sparse))

    def overlap(self, worker_id: int, step: int, batch_size: int, gradients, set_learning_rates=(),
                sparse: bool = False, block_bytes: int = 0):
        """Sync: the speculation (``core.modes.overlap``) a streamed push joins, to ``offer`` its
        gradients to block by block (``gradients``: {name: (dtype, shape)} in the order
        its bytes come; ``block_bytes``: the blocks' size it asks for, 0 the default); None in
        other modes, or when its round is not speculated."""
        if not self.store.initialized:
            return None
        return self.mode.overlap(worker_id, step, batch_size, gradients, set_learning_rates, sparse, block_bytes)

    def offer(self, spec, worker_id: int, arrived) -> None:
        """``arrived``: [(name, block, gradient)] of one push (``SyncMode.offer``)."""
        self.mode.offer(spec, worker_id, arrived)

    def submit(self, push: Push, consumed: Callable[[], None] | None = None) -> Ticket:
        """Apply (or, in sync mode, contribute) one push: its work is done here, its wait (a
        sync round, the SSP bound) is the ticket, which the mode settles later (``core.modes``).
        A push is checked here, once, in every mode: its bounds (``Push.validate``) and each
        gradient's name, shape, dtype and finiteness (``VariableStore.check_gradients``); a mode
        takes it as checked. Gradients may be ``SparseRows`` (``core.optim.sparse``), made dense
        unless their rows alone are stepped (``--sparse-updates``).
        ``consumed`` is called once the push's gradient arrays are no longer needed, possibly
        long before the round's outcome (``SyncMode.submit``)."""
        try:  # the one check of a push: the modes take it as checked
            self.members.require(push.worker_id)
            push.validate()
            self.store.check_gradients(push.gradients, allow_nonfinite=self.settings.allow_nonfinite)
            arrived = self._clock()
            answered = self._task_begin(push)
            if answered is None:
                push, consumed = self._dense(push, consumed)
        except PSError as e:
            ticket = Ticket()
            ticket.settle(e)
            return ticket
        if answered is not None:
            ticket = Ticket()
            ticket.settle(answered)
            return ticket
        try:
            ticket = self.mode.submit(push, consumed)
        except PSError as e:
            self._task_refused(push.worker_id, push.task)
            ticket = Ticket()
            ticket.settle(e)
            return ticket
        # Not the push itself: its gradients are let go once folded.
        worker_id, step, task = push.worker_id, push.step, push.task

        def record(t: Ticket) -> None:
            try:
                result = t.result()
            except PSError:
                self._task_refused(worker_id, task)
                return
            self._recorded(worker_id, step, arrived, result)
        ticket.add_done_callback(record)
        return ticket

    # -- tasks (async and ssp with a data plan) -------------------------------------------
    def _task_begin(self, push: Push) -> PushResult | None:
        """Check a push against the task queue and pin its task (``TaskQueue.begin``); the
        recorded answer of a task this worker's push already did; None to apply it."""
        if self.tasks is None:
            if push.task >= 0:
                raise InvalidArgument(f"push names task {push.task}, but this server deals no tasks "
                                      f"(its chief initialized it without a data plan)")
            return None
        if push.task < 0:
            raise InvalidArgument("this job's data is dealt as tasks: a push names the task it trains on "
                                  "(ps-worker --elastic asks for them)")
        self.tasks.renew(push.worker_id)
        record = self.tasks.begin(push.worker_id, push.task)
        if record is not None:
            self.stats.count("replayed")
            return self._task_answer(push, record)
        size = self.tasks.task(push.task).size
        if push.batch_size != size:
            self.tasks.given_back(push.worker_id, push.task)
            raise InvalidArgument(f"task {push.task} holds {size} examples; this push says batch_size "
                                  f"{push.batch_size} (the task goes back to the queue)")
        return None

    def _task_answer(self, push: Push, record=None) -> PushResult | None:
        """The recorded answer of ``push`` when its task is done already (a retry, or its second
        copy under the worker's lock), else None."""
        record = record or self.tasks.record(push.task)
        if record is None:
            return None
        return PushResult(version=record.version, staleness=0, next_step=push.step + 1, replayed=True)

    def _task_applied(self, push: Push, result: PushResult) -> None:
        """The mode applied a task's push (done: its examples counted) or dropped it (too
        stale: the task goes back). Called at once, under the worker's lock: an ssp push
        whose wait for the bound then times out stays done."""
        if push.task < 0:
            return
        try:
            if result.dropped:
                self.tasks.given_back(push.worker_id, push.task)
            else:
                self.tasks.done(push.worker_id, push.task, result.version)
        except PSError as e:  # a bug guard: never lose the push's answer to it
            log.error("task %d of worker %d: %s", push.task, push.worker_id, e)

    def _task_refused(self, worker_id: int, task_id: int) -> None:
        """A task's push failed: unless it was applied first (ssp's wait for the bound comes
        after), the task goes back to the queue."""
        if self.tasks is None or task_id < 0 or self.tasks.record(task_id) is not None:
            return
        try:
            self.tasks.given_back(worker_id, task_id)
        except PSError:
            pass  # not pinned by this worker any more (taken back meanwhile): nothing to give

    def _tasks_back(self, worker_id: int, back: list, why: str) -> None:
        if back:
            log.warning("worker %d's task(s) %s go back to the queue: %s", worker_id,
                        [t.task_id for t in back], why)

    def _dense(self, push: Push, consumed: Callable[[], None] | None) -> tuple[Push, Callable[[], None] | None]:
        """Sparse gradients checked, and made dense unless stepped row-wise (``store.prepare``);
        ``consumed`` then also drops those arrays, which are ours: no frame keeps them while
        the push waits. Hogwild steps whole arrays in place, never rows: its sparse gradients
        are all made dense."""
        if not any(isinstance(g, SparseRows) for g in push.gradients.values()):
            return push, consumed
        dense = self.store.prepare(push.gradients, keep_sparse=self.settings.async_apply != "hogwild")
        given = consumed

        def dropped() -> None:
            dense.clear()
            if given is not None:
                given()
        return dataclasses.replace(push, gradients=dense), dropped

    def _recorded(self, worker_id: int, step: int, arrived: float, result: "PushResult | ElasticReply") -> None:
        # A replay answers a push already counted: its drop, if it was one, is not counted again.
        if isinstance(result, ElasticReply):  # one push per micro-batch; only a round's end has a result
            result = result.result or PushResult(version=self.store.version, staleness=0)
        self.members.record_push(worker_id, step, dropped=result.dropped and not result.replayed,
                                 arrived=arrived, done=self._clock())

    def leave(self, worker_id: int) -> None:
        self.members.leave(worker_id, at=self._position())
        self.mode.worker_left(worker_id)
        if self.tasks is not None:
            self._tasks_back(worker_id, self.tasks.lost(worker_id), "it left")

    def submit_broadcast(self, worker_id: int, key: str, value: bytes | None, timeout: float) -> Ticket:
        """The poster's value under ``key``, as a ticket: the chief's (worker 0's), or the worker's a
        key ending in ``@w<i>`` names (``broadcast_poster``). The poster posts ``value`` and is
        answered at once; any other registered worker's ticket is settled once it posted ``key``
        (its own ``value`` is ignored), or with BroadcastTimeout after ``timeout`` seconds, never
        more than the barrier timeout (``core.broadcast``)."""
        poster = broadcast_poster(key)
        if worker_id == poster:
            return Ticket.of(lambda: self.members.require(poster) or self.broadcasts.post(key, value or b""))
        try:
            self.members.require(worker_id)
        except PSError as e:
            ticket = Ticket()
            ticket.settle(e)
            return ticket
        return self.broadcasts.submit_wait(key, timeout)

    # -- checkpoints ---------------------------------------------------------------
    def checkpoint_state(self) -> ServerState | None:
        """Everything a restart needs, or None while nothing is initialized.

        Zero-copy and short: it holds the store's publish lock (and in sync mode
        the barrier's lock) only to collect references, and begins a snapshot of
        each row-wise table (``store.RowSnapshot``, read slice by slice as the file
        is written): call ``release()`` on it once written or abandoned. Consistency: in sync
        mode the values, optimizer state, version and round are those after one
        round exactly; in async mode each variable is whole and the version is
        a lower bound (``store`` docstring); with ``async_apply="hogwild"`` the
        arrays are copied under no lock, each whole-shaped, torn at worst
        (``async_mode``). Membership is read just after, and so are the stats
        without a data plan: their counters may be a push ahead. With one, the
        stats are of the values' moment too (below).

        The data plan's progress (``ServerState.data``) is of the same moment as the
        values, so a restart applies every batch exactly once:

        - Async and ssp with tasks: a done task in the file has its update in the
          file's values, and an update in the values has its task done. Each task's
          push holds the ``TaskGate`` shared from before its apply until its task is
          recorded done (``AsyncMode.applying``, ``on_applied``); this holds it
          exclusive while it collects the store's references and the done tasks, so
          no push is between the two. Pushes of different workers still run side by
          side; only a checkpoint waits for those in flight, and holds new ones back
          while it collects. So the snapshot is a moment between pushes: every
          variable holds the same pushes, and the version is exact (the previous
          version plus the pushes applied; with tasks from the start, the done tasks
          applied, dropped ones not counted). Hogwild too: its copy of the arrays is
          made under the exclusive gate (pushes wait for that copy, the one cost), so
          it is not torn; each done task's writes are in it, as far as racing pushes
          left them in the live run (hogwild's lost updates happen with or without a
          restart). An ssp push whose wait for the bound times out after its task was
          recorded is done in the file as it is live. The stats are read under the
          gate too: ``pushes_applied`` and ``examples_applied`` count exactly the done
          tasks, so after a restart they still end at one push per task.
        - Elastic sync: the ledger is folded when a round completes, under the
          mode's lock, with the round's apply, its stats and the round's advance; the
          store's snapshot, the round, the ledger and the stats are read under that
          lock (``ElasticSyncMode.export_round``): all after the same round. A
          round in progress is not saved (its pushes come again).
        """
        if not self.store.initialized:
            return None
        gate = self._gate.still() if self.tasks is not None else contextlib.nullcontext()
        with gate:  # with tasks, the stats under the gate too: they count the pushes the values hold
            store_state, mode_status, ledger, stats = self.mode.export_round()
            tasks = self.tasks.state() if self.tasks is not None else None
        return ServerState(
            mode=self.mode.name,
            num_workers=self.settings.num_workers,
            **_store_part(store_state),
            mode_status=ModeStatus(round=mode_status.round, rounds_timed_out=mode_status.rounds_timed_out,
                                   rounds_aborted=mode_status.rounds_aborted, skipped_rounds=mode_status.skipped_rounds),
            members=tuple(self.members.snapshot()),
            stats=stats,
            incarnation=self.incarnation,
            wall_time=time.time(),
            data=self._data_state(tasks, ledger),
            clip_group=self.clip_group,
            shard_group=self.shard_group,
        )

    def _data_state(self, tasks: dict | None, ledger: tuple | None) -> DataState | None:
        if tasks is not None:
            return DataState("tasks", tasks["num_examples"], tasks["batch_size"], tasks["seed"], tasks["epochs"],
                             tasks=tasks["tasks"], done_task_ids=tasks["done_task_ids"], done_workers=tasks["done_workers"],
                             done_versions=tasks["done_versions"], applies=tasks["applies"])
        if ledger is not None:
            c = self.mode.cursor
            complete, seen = ledger
            return DataState("elastic", c.num_examples, c.global_batch_size, c.seed, 0, c.micro_batches,
                             epochs_complete=complete, epochs_seen=seen, applies=c.applies)
        return None

    def _restored_data(self, data: DataState | None, group: ShardGroup | None = None):
        """What ``restore`` installs for ``data``: a TaskQueue, a (Cursor, EpochLedger), or None.
        ConfigMismatch, in one line, when it does not fit this server; builds, installs nothing."""
        if data is None:
            return None
        where = "start this server with the checkpoint's flags, or use another --checkpoint-dir"
        if data.kind == "tasks":
            if self.mode.data_plan != "tasks":
                raise ConfigMismatch(f"the checkpoint deals its data as async/ssp tasks ({data.describe()}); this "
                                     f"server runs sync: {where}")
            try:
                return TaskQueue.restore({"num_examples": data.num_examples, "batch_size": data.global_batch_size,
                                          "seed": data.seed, "epochs": data.epochs, "tasks": data.tasks,
                                          "applies": data.applies,
                                          **{k: getattr(data, k) for k in
                                             ("done_task_ids", "done_workers", "done_versions")}},
                                         self.members.lease_timeout, self._clock,
                                         follows=group is not None and group.shard > 0)
            except InvalidArgument as e:
                raise ConfigMismatch(f"the checkpoint's tasks do not fit its own plan ({data.describe()}): {e}") \
                    from None
        if self.mode.data_plan != "elastic":
            raise ConfigMismatch(f"the checkpoint was written by an elastic sync server ({data.describe()}); this "
                                 f"server is not elastic (--elastic-min-workers): {where}")
        if data.micro_batches != self.settings.micro_batches:
            raise ConfigMismatch(f"the checkpoint's rounds are cut into {data.micro_batches} micro-batches; this "
                                 f"server cuts them into {self.settings.micro_batches} (--micro-batches): {where}")
        try:
            cursor = Cursor(data.num_examples, data.global_batch_size, data.seed, data.micro_batches, data.applies)
            return cursor, EpochLedger.restore(data.num_examples, data.epochs_complete, data.epochs_seen)
        except InvalidArgument as e:
            raise ConfigMismatch(f"the checkpoint's ledger does not fit its own plan ({data.describe()}): {e}") \
                from None

    def restore(self, state: ServerState) -> None:
        """Carry on from a checkpoint, before serving: variables, optimizer state, version,
        the sync round (nothing pending), counters and membership (leases start now).

        The mode and the worker count must equal this server's: a sync round
        means nothing to async mode, and a round book for N workers cannot take
        another N. A different one raises ConfigMismatch and changes nothing;
        start the server with the checkpoint's --mode and --num-workers, or
        export the parameters (``ps-export``) and start a fresh cluster from
        them. A server that already holds variables refuses (SpecConflict).
        This process keeps its own new incarnation, so workers can tell that
        the server restarted.

        The data plan and its progress come back too (``checkpoint_state``): with
        tasks, the done ones stay done (a retried push of one is answered from
        its record) and every other is handed out again, lowest id first; in
        elastic sync the cursor and the ledger, so the epochs' counts go on. A
        later initialize from the chief with the same plan is harmless, another
        is SpecConflict. A plan that does not fit this server (an elastic one
        here without --elastic-min-workers, other micro-batches) is
        ConfigMismatch, and changes nothing.
        """
        if state.mode != self.mode.name or state.num_workers != self.settings.num_workers:
            raise ConfigMismatch(
                f"the checkpoint was written by a {state.mode} server with {state.num_workers} worker(s); "
                f"this server runs {self.mode.name} with {self.settings.num_workers}: start it with --mode {state.mode} "
                f"--num-workers {state.num_workers}, or use another --checkpoint-dir"
            )
        if self.settings.async_apply == "hogwild":
            hogwild.check_supported(state.optimizer)
        data = self._restored_data(state.data, state.shard_group)  # checked (and built) before anything changes
        if state.clip_group is not None:
            self._check_clip_group(state.clip_group, state.optimizer)
        self._check_shard_group(state.shard_group)
        self.store.restore_state(StoreState(**_store_part(state)))
        if state.clip_group is not None:
            self._use_clip_group(state.clip_group)
        self.mode.restore(state.mode_status)
        self.stats.restore(state.stats)
        # A restored worker may take the barrier timeout to register again (a requeued job's all start anew).
        self.members.restore(list(state.members), grace=self.settings.barrier_timeout)
        self._use_shards(state.shard_group)
        if isinstance(data, TaskQueue):
            self._use_tasks(data)
        elif data is not None:
            self.mode.set_cursor(*data)
        self.checkpointed(state.version)

    def checkpointed(self, version: int) -> None:
        """Note that a checkpoint of ``version`` was just written (or restored): Status reports it."""
        self._checkpoint = (version, time.monotonic())

    def status(self) -> Status:
        mode_status = self.mode.status()
        mean_s, max_s = self.stats.staleness_summary()
        specs = self.store.specs()
        return Status(
            mode=self.mode.name,
            num_workers=self.settings.num_workers,
            initialized=self.store.initialized,
            version=self.store.version,
            round=mode_status.round,
            waiting_for=mode_status.waiting_for,
            workers=self.members.snapshot(),
            pushes_applied=self.stats.pushes_applied,
            examples_applied=self.stats.examples_applied,
            mean_staleness=mean_s,
            max_staleness_seen=max_s,
            optimizer=self.store.initialized_spec,  # the rate set since: learning_rate_now
            num_variables=len(specs) - len(self.store.shared),  # a second name (``VariableStore.shared``): none
            num_parameters=self.store.num_parameters(),
            uptime_s=time.monotonic() - self._started,
            rounds_timed_out=mode_status.rounds_timed_out,
            last_loss=self.stats.last_loss,
            incarnation=self.incarnation,
            pushes_dropped=self.stats.dropped,
            pushes_replayed=self.stats.replayed,
            rounds_aborted=mode_status.rounds_aborted,
            dead_worker_policy=self.settings.dead_worker_policy if self.mode.rounds else "",
            replicas_to_aggregate=self.settings.replicas_to_aggregate,
            lease_timeout=self.members.lease_timeout,
            active_workers=mode_status.active_workers,
            last_checkpoint_version=self._checkpoint[0] if self._checkpoint else -1,
            checkpoint_age_s=time.monotonic() - self._checkpoint[1] if self._checkpoint else -1.0,
            staleness=self.settings.staleness,
            stale_gradient_policy=self.settings.stale_gradient_policy,
            max_staleness=self.settings.max_staleness,
            pushes_scaled=self.stats.scaled,
            max_ahead=mode_status.max_ahead,
            optimizer_iterations=self.store.optimizer_iterations() if self.store.initialized else 0,
            learning_rate_now=self.store.current_learning_rate() if self.store.initialized else 0.0,
            **self._data_status(),
            membership=tuple(self.members.history()),
            membership_dropped=self.members.dropped,
        )

    def _data_status(self) -> dict:
        if self.tasks is not None:
            t = self.tasks
            ts = t.status()
            return dict(epoch_examples=t.epoch_examples(),
                        num_examples=t.num_examples, tasks_total=ts.total, tasks_done=ts.done,
                        tasks_held=ts.held, tasks_queued=ts.queued)
        ledger = self.mode.ledger
        if ledger is None:
            return {}
        return dict(epoch_examples=ledger.counts(), num_examples=ledger.num_examples)


__all__ = ["ParameterServer", "Push", "PushResult", "Registration", "Status"]


def _plan_text(tasks: TaskQueue) -> str:
    """A task queue's data plan, in words."""
    return (f"{tasks.num_examples} examples, batches of {tasks.batch_size}, seed {tasks.seed}"
            + (f", {tasks.applies} tasks a batch" if tasks.applies > 1 else "") + f", {tasks.epochs} epoch(s)")
