"""Several ps-server shards behind the same methods as ``PSClient`` (docs/speed.md).

    client = ShardedClient(["127.0.0.1:50051", "127.0.0.1:50052"], timeout=30.0)
    reg = client.register(worker_index=0, num_workers=2)
    client.initialize(reg.worker_id, values, optimizer)    # chief: plan, then each shard its pieces
    version, values = client.pull(reg.worker_id)           # whole variables again
    reply = client.push(reg.worker_id, step, version, batch_size, grads, loss)

Each shard is an ordinary ``ps-server`` that knows nothing of the others; everything
sharded happens here, on one ``PSClient`` per shard, calling the shards at once.

**Placement.** The chief's ``initialize`` plans (``worker.sharding.plan``); the other
workers' first ``pull`` learns the placement from the pieces the shards hold
(``worker.sharding.learn``), so the shards are the one source of truth and a worker whose
model differs sees the same error as with one server. The plan is deterministic, so a
restarted chief's repeated initialization is harmless. A plan that leaves a shard empty
is refused. With an option that takes a whole variable's norm (``sharding.norms_of``) no
variable is cut; ``global_clipnorm`` takes one norm over the shards.

**Versions.** ``pull`` returns the smallest shard version and remembers each shard's;
``push(..., base_version=...)`` sends every shard its own version from the pull that
returned ``base_version`` (a version no pull returned goes to every shard as it is).

**Registration.** The shards must agree on the mode, the worker count and the worker id.
Registrations, pushes and statuses are combined field by field by the ``*_RULES`` tables
below. In sync mode every shard counts rounds alike; when one restored from an older
checkpoint lost rounds the others kept, ``register`` says where every worker resumes.

**Shard 0 decides** (``ps_server.core.modes.base.ShardGroup``) where an update's content
is one server's choice: elastic sync's micro-batches, tasks (``Work`` goes to shard 0
alone), the contributors of a round with backup workers. A push then goes to the other
shards first and to shard 0 once they took it, whose reply is the answer. A registration
that finds such shards at parted rounds stops the job in one line.

**Failures.** A call waits for every shard, then raises the first ``PSClientError`` to
arrive (its ``address`` names the shard). A push is not atomic across shards: sync mode
realigns the rounds when the worker registers again; in async mode that gradient is
partly applied, as async's per-variable apply already allows.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import logging
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterable, Mapping, Sequence

import grpc
import numpy as np

from protos import tfps_pb2 as pb
from ps_common.settings import ConfigError
from ps_common.names import SKIP_UPDATE, unshared
from ps_common.records import PushReply, Registration
from worker import sharding
from worker.client import PSClient, PSClientError

log = logging.getLogger("worker")

_VERSIONS_REMEMBERED = 8  # pulls whose per-shard versions a push may name


class ShardedClient:
    def __init__(
        self,
        addresses: Sequence[str],
        timeout: float = 30.0,
        *,
        min_slice_bytes: int = sharding.DEFAULT_MIN_SLICE_BYTES,
        clients: Sequence | None = None,
        **client_kwargs,
    ):
        """``client_kwargs`` (TLS files, ``token``) go to every shard's ``PSClient``;
        ``clients`` replaces those with ready objects that have PSClient's methods
        (tests pass fakes)."""
        addresses = list(addresses)
        if not addresses:
            raise ValueError("ShardedClient needs at least one address")
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"an address is listed twice: {addresses}")
        self.addresses = addresses
        self.address = ",".join(addresses)
        self.timeout = timeout
        self.min_slice_bytes = min_slice_bytes
        self._clients = list(clients) if clients is not None else [
            PSClient(a, timeout, **client_kwargs) for a in addresses]
        n = len(self._clients)
        # One thread per shard (gRPC releases the GIL while it waits). Control calls have their own
        # pool: a push waiting in the shards' barriers holds every data thread, and leases must go on.
        self._data = ThreadPoolExecutor(n, thread_name_prefix="shard-data")
        self._control = ThreadPoolExecutor(n, thread_name_prefix="shard-control")
        # Guards the fields below; never held across a call to a shard.
        self._lock = threading.Lock()
        self.placement: sharding.Placement | None = None
        # Shard 0 decides what each update holds (a shard group: elastic sync, tasks, backup
        # workers): set by a data plan, a Work call, or backup workers seen at registration.
        self._led = False
        self._pulled: collections.OrderedDict[int, list[int]] = collections.OrderedDict()

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self._data.shutdown(wait=True, cancel_futures=True)
        self._control.shutdown(wait=True, cancel_futures=True)

    def _each(self, pool: ThreadPoolExecutor, call: Callable, shards: Sequence[int] | None = None) -> list:
        """``call(i, client)`` on the shards (default: all) at once; their results in that order
        once all answered, or the first exception to arrive."""
        shards = range(self.num_shards) if shards is None else shards
        futures = {pool.submit(call, i, self._clients[i]): i for i in shards}
        results, first = {}, None
        for f in as_completed(futures):
            try:
                results[futures[f]] = f.result()
            except Exception as e:  # noqa: BLE001 - re-raised below, once every shard answered
                first = first or e
        if first is not None:
            raise first
        return [results[i] for i in shards]

    def _error(self, call: str, code: grpc.StatusCode | None, details: str) -> PSClientError:
        return PSClientError(call, self.address, code, details)

    @contextlib.contextmanager
    def _refusing(self, call: str, code: grpc.StatusCode | None, why: str = ""):
        """A ``ShardingError`` inside as the ``PSClientError`` of ``call``, its message after ``why``."""
        try:
            yield
        except sharding.ShardingError as e:
            raise self._error(call, code, f"{why}{e}") from None

    # -- control -----------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        """Block until every shard answers its health check as SERVING, or raise."""
        self._each(self._control, lambda i, c: c.wait_ready(timeout))

    def health(self, timeout: float = 5.0) -> str:
        """SERVING when every shard is; otherwise the first other status, in shard order."""
        states = self._each(self._control, lambda i, c: c.health(timeout))
        return next((s for s in states if s != "SERVING"), "SERVING")

    def register(self, worker_index: int, num_workers: int = 0, name: str = "",
                 timeout: float | None = None) -> Registration:
        def register(i, c):
            return c.register(worker_index, num_workers, name, timeout=timeout)

        regs = []
        if worker_index < 0:  # auto: shard 0 assigns the index, the others are told it
            regs = self._each(self._control, register, shards=[0])
            worker_index = regs[0].worker_id
        regs += self._each(self._control, register, shards=range(len(regs), self.num_shards))
        if len({(r.mode, r.num_workers, r.worker_id) for r in regs}) > 1:
            runs = ", ".join(f"{a} runs {r.mode} with {r.num_workers} workers (worker id {r.worker_id})"
                             for a, r in zip(self.addresses, regs))
            raise self._error("Register", grpc.StatusCode.FAILED_PRECONDITION,
                              f"the shards disagree: {runs}; start every shard with the same --mode and --num-workers")
        combined = combine_records(regs, REGISTRATION_RULES)
        sync = combined.mode == "sync"
        if sync and self.num_shards > 1 and self._backup_workers(combined.num_workers):
            self._led = True
        rounds = [r.round for r in regs]
        if sync and self._led and any(not rounds[0] <= r <= rounds[0] + 1 for r in rounds[1:]):
            raise self._error("Register", grpc.StatusCode.FAILED_PRECONDITION,
                              f"the shards of this job collect rounds {rounds}: one restarted from an older "
                              "checkpoint and lost rounds the others kept (shard 0 decides every round; the "
                              "others may be one ahead while it commits). Start the job again, every shard from "
                              "checkpoints of the same round")
        if sync and len(set(rounds)) > 1:
            # The shards that kept their rounds say where the cluster is: the lowest of them (a
            # shard one round ahead completed the round this worker pushed last; pushing that
            # step again is answered from its record). A restored shard's first push sets its
            # round to that one, for every worker alike. Only restored shards: the newest.
            kept = [r.round for r in regs if not r.round_restored]
            resume = min(kept) if kept else max(rounds)
            log.warning("the shards collect different rounds (%s): resuming at round %d (a shard that restarted "
                        "lost the rounds since its last checkpoint; it collects round %d next)",
                        ", ".join(f"{a}: {r}{' (restored)' if g.round_restored else ''}"
                                  for a, r, g in zip(self.addresses, rounds, regs)), resume, resume)
            combined = dataclasses.replace(combined, round=resume)
        with self._lock:
            self._pulled.clear()
        return combined

    def _backup_workers(self, num_workers: int) -> bool:
        """Whether the shards run backup workers (then shard 0 picks each round's contributors
        and the others follow it); every shard must run the same ``--replicas-to-aggregate``."""
        ks = [s.replicas_to_aggregate for s in self.statuses()]
        if len(set(ks)) > 1:
            runs = ", ".join(f"{a}: {k}" for a, k in zip(self.addresses, ks))
            raise self._error("Register", grpc.StatusCode.FAILED_PRECONDITION,
                              f"the shards run different --replicas-to-aggregate ({runs}); start every shard "
                              "with the same")
        return 0 < ks[0] < num_workers

    def heartbeat(self, worker_id: int, step: int = -1, timeout: float = 5.0) -> str:
        """Renew the lease on every shard; returns the shards' incarnations joined."""
        return ",".join(self._each(self._control, lambda i, c: c.heartbeat(worker_id, step, timeout=timeout)))

    def leave(self, worker_id: int) -> None:
        self._each(self._control, lambda i, c: c.leave(worker_id))

    def statuses(self) -> list[pb.StatusResponse]:
        """Every shard's own Status, in shard order."""
        return self._each(self._control, lambda i, c: c.status())

    def status(self) -> pb.StatusResponse:
        """One Status for the whole cluster (see ``combine_statuses``)."""
        return combine_statuses(self.statuses())

    # -- data --------------------------------------------------------------------
    def initialize(self, worker_id: int, variables: Mapping[str, np.ndarray], optimizer: Mapping,
                   non_trainable: Iterable[str] = (), data_plan: Mapping | None = None) -> bool:
        """Plan (once), then send every shard its pieces. True if any shard was created by this call.
        ``data_plan`` (elastic sync, or async and ssp tasks): every shard gets it, with the
        shards' addresses and its own index (shard 0 deals; module docstring)."""
        placement = self.placement
        if placement is None:
            try:
                # An optimizer that takes a whole variable's norm steps whole variables: none is cut.
                whole = sys.maxsize if sharding.norms_of(optimizer) else self.min_slice_bytes
                placement = sharding.plan(sharding.specs_of(variables), self.num_shards, whole)
            except sharding.ShardingError as e:
                raise ConfigError(f"cannot shard the model over {self.num_shards} servers: {e}") from None
            empty = placement.empty_shards()
            if empty:
                raise ConfigError(
                    f"--ps lists {self.num_shards} servers but the model makes only {len(placement.pieces)} "
                    f"pieces (variables and slices): {', '.join(self.addresses[s] for s in empty)} would hold "
                    f"nothing; list at most {len(placement.pieces)} servers")
        with self._refusing("Initialize", grpc.StatusCode.INVALID_ARGUMENT):
            per_shard = placement.split(variables)
        optimizer = sharding.grouped(optimizer, placement)
        non_trainable = set(non_trainable)  # each shard is told which of its pieces they are
        of = {p.name: p.variable for p in placement.pieces}
        pieces = [{piece for piece in per_shard[i] if of[piece] in non_trainable} for i in range(self.num_shards)]
        # global_clipnorm: the shards take one norm together (ps_server/core/clip_group.py).
        group = ({"shards": list(self.addresses), "order": [p.name for p in placement.pieces]}
                 if optimizer.get("global_clipnorm") else None)
        self._led = self._led or data_plan is not None
        led = {"shards": list(self.addresses)} if self._led else None  # shard 0 decides what updates hold
        created = self._each(self._data, lambda i, c: c.initialize(
            worker_id, per_shard[i], optimizer, pieces[i], clip_group=group and {**group, "shard": i},
            data_plan=data_plan, shard_group=led and {**led, "shard": i}))
        self._adopt(placement, "planned")
        return any(created)

    def _adopt(self, placement: sharding.Placement, how: str) -> None:
        with self._lock:
            if self.placement is not None:
                return
            self.placement = placement
        log.info("%s the placement of %d variables in %d pieces over %d shards:", how, len(placement.variables),
                 len(placement.pieces), self.num_shards)
        for line in placement.describe(self.addresses):
            log.info("  %s", line)

    def optimizer_state(self, worker_id: int = -1, averages: Iterable[str] = (), window_batches: int = 0) -> \
            tuple[int, dict[str, np.ndarray], dict[str, dict]]:
        """``PSClient.optimizer_state`` of the whole model: a variable cut in row slices has
        each slot's slices concatenated (a variable whose slots are shaped otherwise, a norm's,
        is never cut: ``sharding.norms_of``), its step count its first slice's. ``averages``: each shard's
        pieces of these variables."""
        if self.placement is None:
            self.pull(worker_id)  # learns the placement
        placement, wanted = self.placement, {}
        for name in averages:  # a variable's, or its second name's (a later optimizer group's average)
            variable = name if name in placement.variables else unshared(name)[0]
            wanted.setdefault(variable, []).append(name[len(variable):])
        pieces = {i: [p.name + suffix for p in placement.on_shard(i) for suffix in wanted.get(p.variable, ())]
                  for i in range(self.num_shards)}
        replies = self._each(self._data, lambda i, c: c.optimizer_state(worker_id, pieces[i], window_batches))
        values = placement.join([r[1] for r in replies])
        of, parts = {p.name: p for p in placement.pieces}, {}  # a variable's states (a second name's too), by part
        for _, _, held in replies:
            for name, state in held.items():
                piece = of[unshared(name)[0]]
                parts.setdefault(piece.variable + name[len(piece.name):], {})[piece.part] = state
        states = {}
        for name, by_part in parts.items():
            got = [by_part[k] for k in sorted(by_part)]
            states[name] = {k: got[0][k] if len(got) == 1 or np.ndim(got[0][k]) == 0
                            else np.concatenate([g[k] for g in got]) for k in got[0]}
        return min(r[0] for r in replies), values, states

    def pull(self, worker_id: int = -1, names: Iterable[str] = ()) -> tuple[int, dict[str, np.ndarray]]:
        """(the smallest shard version, {variable: array}); the first pull of a worker
        that did not initialize learns the placement from what the shards hold."""
        names = list(names)
        placement = self.placement
        wanted = {i: () for i in range(self.num_shards)}  # every shard's every piece
        if placement is not None and names:
            with self._refusing("Pull", grpc.StatusCode.NOT_FOUND):
                wanted = placement.shards_of(names)
        shards = sorted(wanted)
        replies = dict(zip(shards, self._each(self._data, lambda i, c: c.pull(worker_id, wanted[i]), shards)))
        per_shard = [replies[i][1] if i in replies else {} for i in range(self.num_shards)]
        if placement is None:
            with self._refusing("Pull", None, "the shards do not hold one model's variables: "):
                placement = sharding.learn(per_shard)
            self._adopt(placement, "learned")
        with self._refusing("Pull", None, "the shards' contents do not match the placement: "):
            values = placement.join(per_shard, partial=bool(names))
        if names:
            missing = [n for n in names if n not in values]
            if missing:
                raise self._error("Pull", grpc.StatusCode.NOT_FOUND, f"unknown variable(s) {missing[:4]}")
            values = {n: values[n] for n in names}
        versions = [replies[i][0] for i in shards]
        version = min(versions)
        if len(replies) == self.num_shards:
            with self._lock:
                self._pulled[version] = versions
                self._pulled.move_to_end(version)
                while len(self._pulled) > _VERSIONS_REMEMBERED:
                    self._pulled.popitem(last=False)
        return version, values

    def push(self, worker_id: int, step: int, base_version: int, batch_size: int,
             gradients: Mapping[str, np.ndarray], loss: float = 0.0, timeout: float | None = None,
             metrics: Mapping[str, np.ndarray] | None = None, set_learning_rates: Sequence[float] = (),
             micro_batch: int = -1, task: int = -1) -> PushReply:
        """Each shard gets its pieces of the gradients, its own base version and (sync) its own
        round; the replies are combined by ``PUSH_RULES``. ``set_learning_rates`` go to every
        shard; ``metrics`` to shard 0 alone, whose round sums them, but for ``SKIP_UPDATE``, which
        every shard gets. Where shard 0 decides (module docstring), it gets the push last and its
        reply is the answer, so it never holds a push another shard lacks."""
        placement = self.placement
        if placement is None:
            raise self._error("Push", grpc.StatusCode.FAILED_PRECONDITION,
                              "no placement yet: initialize or pull before the first push")
        with self._refusing("Push", grpc.StatusCode.INVALID_ARGUMENT):
            per_shard = placement.split(gradients, partial=True)  # each shard refuses what is missing
        with self._lock:
            bases = self._pulled.get(base_version, [base_version] * self.num_shards)
        # A skip (a loss scale's non-finite gradients) is every shard's: each skips the same updates
        others = {SKIP_UPDATE: metrics[SKIP_UPDATE]} if metrics and SKIP_UPDATE in metrics else None

        def push(i, c):
            return c.push(worker_id, step, bases[i], batch_size, per_shard[i], loss, timeout=timeout,
                          metrics=metrics if i == 0 else others, set_learning_rates=set_learning_rates,
                          micro_batch=micro_batch, task=task)

        if self._led or micro_batch >= 0 or task >= 0:
            self._each(self._data, push, shards=range(1, self.num_shards))
            return self._each(self._data, push, shards=[0])[0]
        replies = self._each(self._data, push)
        if len({r.dropped for r in replies}) > 1:
            which = ", ".join(f"{a}: {'dropped' if r.dropped else 'applied'}" for a, r in zip(self.addresses, replies))
            raise self._error("Push", grpc.StatusCode.FAILED_PRECONDITION,
                              f"the shards disagree on step {step}'s gradient ({which})")
        return combine_records(replies, PUSH_RULES)

    def work(self, worker_id: int, timeout: float | None = None) -> pb.Assignment:
        """``PSClient.work`` on shard 0 alone, which deals every round (elastic sync) or task."""
        self._led = True
        return self._clients[0].work(worker_id, timeout=timeout)

    def broadcast(self, worker_id: int, key: str, value: bytes | None, timeout: float) -> bytes:
        """``PSClient.broadcast`` on shard 0 alone: one board for the cluster."""
        return self._clients[0].broadcast(worker_id, key, value, timeout)

    wait_initialized = PSClient.wait_initialized  # through this client's pull: every shard's
    __enter__, __exit__ = PSClient.__enter__, PSClient.__exit__  # this client's close


# -- combining the shards' answers: one rule per field ----------------------------------
# Each rule takes the shards' values of one field, in shard order, and returns the cluster's.
# The tables name every field (a test holds them to it): a new field has no value until it has a rule.


def first(values):
    """The first shard's: the same on every shard (checked where it matters), or a
    choice every shard makes alike (the optimizer, the policies)."""
    return values[0]


def union_sorted(values):
    """Every worker id any shard lists, once, sorted."""
    return sorted({v for vs in values for v in vs})


def first_named(values):
    """The first non-empty name."""
    return next((v for v in values if v), "")


REGISTRATION_RULES: dict[str, Callable] = {
    "worker_id": first,  # register refuses shards that disagree on it, the mode or the worker count
    "mode": first,
    "num_workers": first,
    "initialized": all,  # only if every shard is
    "version": min,  # the version every shard has reached
    "barrier_timeout": max,  # a push deadline above every shard's barrier
    "round": max,  # the newest round any shard collects (register resumes otherwise after a restore)
    "round_restored": any,
    "sparse_rule": first,  # every shard is started alike (ps-launch); the first's rule is the job's
    "lease_timeout": min,  # heartbeat within the shortest lease
    "incarnation": ",".join,  # a restart of any shard shows as a new incarnation
    "shm": all,  # the fast path is on only if every shard's probe succeeded
}

PUSH_RULES: dict[str, Callable] = {
    "version": min,
    "staleness": max,
    "contributors": min,
    "dropped": any,  # push refuses shards that disagree on it
    "next_step": max,  # every shard counts rounds alike (a restored one takes the cluster's)
    "replayed": all,  # replayed only if no shard applied it now
    "learning_rate": first,  # every shard runs the same optimizer at the same count (and set rate)
    "metrics": first,  # only shard 0 is sent the metrics, so only its round sums them
}

WORKER_RULES: dict[str, Callable] = {
    "worker_id": first,  # the key the records are merged by
    "worker_name": first_named,
    "last_step": max,
    "last_seen_age_s": max,  # the staleest lease
    "left": all,  # left only when it left every shard
    "pushes": min,  # the pushes every shard has counted
    "dead": any,  # dead when any shard declared it so
    "dropped": max,  # each drop happens on every shard
    "incarnation": max,  # a shard that saw the newest process
    "work_s": max,  # the slowest view of its time between pushes
    "wait_s": max,  # its longest wait inside a shard's push
}


def merge_workers(per_shard) -> list[pb.WorkerStatus]:
    """Each worker's records on the shards combined by ``WORKER_RULES``, by worker id. A worker
    a shard never saw counts there as not left, never pushed (``last_step`` -1)."""
    ids = sorted({w.worker_id for ws in per_shard for w in ws})
    by_id = [{w.worker_id: w for w in reversed(list(ws))} for ws in per_shard]  # a shard's first record of each
    return [combine_records([shard.get(i, pb.WorkerStatus(worker_id=i, last_step=-1)) for shard in by_id],
                             WORKER_RULES) for i in ids]


STATUS_RULES: dict[str, Callable] = {
    "mode": first,
    "num_workers": first,
    "initialized": all,
    "version": min,  # what must hold on every shard takes the weakest shard
    "round": max,
    "waiting_for": union_sorted,
    "workers": merge_workers,
    "pushes_applied": min,
    "examples_applied": min,
    "mean_staleness": max,
    "max_staleness_seen": max,
    "optimizer": first,
    "num_variables": sum,  # pieces: each shard holds its own
    "num_parameters": sum,
    "uptime_s": min,
    "rounds_timed_out": max,  # the event counters take the largest: each event happens on every shard
    "last_loss": first,
    "incarnation": ",".join,
    "pushes_dropped": max,
    "pushes_replayed": max,
    "rounds_aborted": max,
    "dead_worker_policy": first,
    "replicas_to_aggregate": max,
    "lease_timeout_s": min,
    "active_workers": union_sorted,
    "last_checkpoint_version": min,
    "checkpoint_age_s": max,
    "staleness": first,  # every shard runs with the same flags
    "max_ahead": max,
    "stale_gradient_policy": first,
    "max_staleness": first,
    "pushes_scaled": max,
    "optimizer_iterations": min,  # the updates every shard has made
    "learning_rate_now": first,  # every shard steps the same schedule at the same count
    # A data plan's counts (elastic sync, async and ssp tasks) are one server's: --elastic
    # workers take one server, never shards.
    "epoch_examples": first,
    "num_examples": first,
    "tasks_total": first,
    "tasks_done": first,
    "tasks_held": first,
    "tasks_queued": first,
    "membership": first,  # every worker registers with, leaves and heartbeats every shard: shard 0's history
    "membership_dropped": first,
}


def combine_records(records: Sequence, rules: Mapping[str, Callable]):
    """One dataclass record or protobuf message from the shards' (in shard order), field by field by ``rules``."""
    cls = type(records[0])
    fields = cls.DESCRIPTOR.fields if hasattr(cls, "DESCRIPTOR") else dataclasses.fields(cls)
    return cls(**{f.name: rules[f.name]([getattr(r, f.name) for r in records]) for f in fields})


def combine_statuses(statuses: Sequence[pb.StatusResponse]) -> pb.StatusResponse:
    """One Status for several shards, with the meaning the trainer reads from one server
    (``STATUS_RULES``, and ``WORKER_RULES`` for each worker)."""
    return combine_records(statuses, STATUS_RULES)
