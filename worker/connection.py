"""One worker's place in the cluster, for one model: register, join, pull, push, rejoin, leave.

    conn = Connection(config, model)        # a PSClient, or a ShardedClient for several --ps
    conn.register()                         # an index, the server's mode, where to start
    conn.join()                             # chief: initialize the server; others: wait and check
    version = conn.pull()                   # the server's parameters into the model
    reply = conn.push(payload, Work(conn.step, n), loss)  # gradients' payload; step moves on
    conn.leave(); conn.close()

Every way of training on tfps goes through one of these, held by the one engine
(``worker.engine.Engine``); its state is in plain fields (``__init__``). A thread renews
the lease (``Heartbeat``) from the start of ``join`` until ``close``: a chief's initialize
or a first pull of a large model over a slow link takes several lease periods, and a
worker sending or receiving is alive.

Guarantees: ``pull`` loads every trainable and floating non-trainable variable,
or raises with ``version`` and ``pulled`` as they were. ``push`` returns once the server
applied the gradients (sync: once the whole round is applied; async and ssp:
this push, after any staleness wait) or raises ``PSClientError``; each wait is
bounded (the barrier timeout plus 30 s in sync mode, 120 s otherwise).
``rejoin`` registers again within ``--reconnect-timeout`` or raises
``TrainingError``; it never re-initializes a server that has state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Mapping, Sequence

import grpc
import numpy as np

from protos import tfps_pb2 as pb
from ps_common import security
from ps_common.defaults import HEARTBEATS_PER_LEASE
from ps_common.names import broadcast_poster
from ps_common.reasons import Reason
from worker.client import PSClient, PSClientError, PushReply, Registration
from worker.config import AUTO_INDEX, ConfigError, WorkerConfig
from worker.gradients import get_values, non_trainable, set_values
from worker.sharded_client import ShardedClient

log = logging.getLogger("worker")


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why."""


def connect(config: WorkerConfig) -> PSClient | ShardedClient:
    """One server: a PSClient. Several shards in --ps: a ShardedClient, with the same methods."""
    kwargs = dict(
        timeout=max(30.0, config.connect_timeout),
        tls_ca_file=config.tls_ca_file or None, tls_cert_file=config.tls_cert_file or None,
        tls_key_file=config.tls_key_file or None, tls_server_name=config.tls_server_name or None,
        token=security.load_token(config.auth_token_file, os.environ),
        grad_wire_dtype=config.grad_wire_dtype,
        shm=config.shm,
        max_message_bytes=config.max_message_bytes,
        overlap=config.overlap,
        overlap_block_bytes=config.overlap_block_kib << 10,
    )
    addresses = config.ps_addresses
    return ShardedClient(addresses, **kwargs) if len(addresses) > 1 else PSClient(config.ps, **kwargs)


# Refusals a worker rides out by reconnecting and registering again: the server
# restarted without knowing us, or it declared us dead (a pause longer than the
# lease) or out of step. So is UNAVAILABLE: the server is down or restarting.
REJOIN = frozenset({Reason.NOT_REGISTERED, Reason.DECLARED_DEAD, Reason.NOT_INITIALIZED, Reason.LATE,
                    Reason.EARLY, Reason.NOT_IN_ROUND, Reason.PULL_FIRST})


POSTS_KEPT = 4  # the chief's broadcasts a restarted server is given again (a Keras fit posts two an epoch)


def recoverable(e: BaseException) -> bool:
    """Whether ``rejoin`` can ride out ``e``: a ``PSClientError`` of a server that is down or
    restarting, or that no longer knows this worker (``REJOIN``)."""
    return isinstance(e, PSClientError) and (e.code == grpc.StatusCode.UNAVAILABLE or e.reason in REJOIN)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one push is of: ``batch_size`` examples (``examples``: ``x, y``) of ``step`` (this
    worker's own shard's; sync: the round), unless the server dealt them: micro-batch
    ``micro_batch`` of round ``step`` (elastic sync) or leased task ``task`` (async and ssp
    with a data plan)."""

    step: int
    batch_size: int
    examples: tuple = ()
    micro_batch: int = -1
    task: int = -1


class Connection:
    """A worker's registration, step and lease for one model (module docstring)."""

    def __init__(self, config: WorkerConfig, model, optimizer_spec: dict | None = None):
        """``optimizer_spec`` (OptimizerConfig fields: a Keras model's compiled optimizer)
        replaces ``config.optimizer_spec()``: the chief initializes the server with it, and
        the others check the server's optimizer against it."""
        self.config, self.model = config, model
        self.optimizer_spec = dict(optimizer_spec) if optimizer_spec is not None else config.optimizer_spec()
        self.auto = config.worker_index == AUTO_INDEX  # the server assigns the index
        self.client = connect(config)
        self.registration: Registration | None = None
        self.step = 0  # the step this worker computes next (sync: the server's round; a dropped push skips ahead)
        self.version = -1  # the version the model holds: the last pull's
        self.pulled: dict[str, np.ndarray] = {}  # the values of the last pull
        self.seen = -1  # the newest server version this worker saw (after a server restart: how much was lost)
        self.posted: dict[str, bytes] = {}  # the chief's last broadcasts, posted again to a restarted server
        self.heartbeat: Heartbeat | None = None
        self.data_plan: dict | None = None  # elastic sync: the chief sends it with Initialize (worker.elastic)
        self.superseded: PSClientError | None = None  # set by the heartbeat: another process holds our index

    @property
    def worker_id(self) -> int:
        return self.registration.worker_id

    @property
    def sync(self) -> bool:
        """Sync mode: the server names the next step. Async and ssp apply pushes on arrival."""
        return self.registration.mode == "sync"

    # -- starting
    def register(self) -> Registration:
        """Register within --connect-timeout. An auto-index worker that finds every index
        taken retries meanwhile (a dead worker's index frees once its lease runs out), and
        from then on is the index the server gave it (``config.worker_index``), also when it
        rejoins. A sync worker starts at the server's round."""
        deadline = time.monotonic() + self.config.connect_timeout
        while True:
            try:
                reg = self._register(max(1.0, deadline - time.monotonic()))
                break
            except PSClientError as e:
                if e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    hint = " (or does its certificate not match --tls-ca-file?)" if self.config.tls_ca_file else ""
                    raise TrainingError(f"cannot reach the parameter server at {e.address} within "  # that shard
                                        f"--connect-timeout {self.config.connect_timeout:g} s: is ps-server "
                                        f"running there?{hint}") from None
                if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() + 1.0 > deadline:
                    raise
                log.info("no free worker index yet (%s); retrying", e.details)
                time.sleep(1.0)
        if self.auto:
            self.config = dataclasses.replace(self.config, worker_index=reg.worker_id)
        self.registration, self.seen = reg, reg.version
        self.step = reg.round if self.sync else 0
        return reg

    def join(self) -> None:
        """Chief: initialize the server from the model (or find it holds the same). Others:
        wait for that and check the model and optimizer match the server's. The lease is
        renewed from a thread from now until ``close``. ``worker.engine.Engine.join`` rides
        out a fault meanwhile."""
        self.heartbeat = self.heartbeat or Heartbeat(self)
        if self.config.is_chief:
            created = self._initialize()
            log.debug("%s the server's variables (%d tensors)",
                      "initialized" if created else "found identical state on", len(get_values(self.model)))
            return
        _, values = self.client.wait_initialized(self.worker_id, self.config.init_timeout)
        mine = {path: tuple(a.shape) for path, a in get_values(self.model).items()}
        theirs = {n: tuple(a.shape) for n, a in values.items()}
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()))[:4]
            raise ConfigError(f"this worker's model does not match the server's variables (differences: {diff}); "
                              "start every worker with the same --model")
        server_opt, wanted = self.client.status().optimizer, pb.OptimizerConfig(**self.optimizer_spec)
        differ = [k for k in self.optimizer_spec if getattr(server_opt, k) != getattr(wanted, k)]
        if differ:
            got, want = ({k: getattr(optimizer, k) for k in differ} for optimizer in (server_opt, wanted))
            raise ConfigError(f"the server trains with optimizer {got}, this worker was started with {want}")
        log.debug("the server's variables and optimizer match this worker's")

    def describe(self) -> str:
        """The registration in words, for the worker's start-up line."""
        reg, auto = self.registration, " (index assigned by the server)" if self.auto else ""
        return (f"registered as worker {reg.worker_id} of {reg.num_workers}{auto}; server mode {reg.mode}, "
                f"version {reg.version}, round {reg.round} at {self.config.ps}"
                + ("; chief" if self.config.is_chief else ""))

    # -- one step
    def check(self) -> None:
        """Raise the heartbeat's refusal once another process took this worker's index (a worker
        paused past its lease and replaced): from then on this process calls nothing for it."""
        if self.superseded is not None:
            raise self.superseded

    def pull(self, load: bool = True) -> int:
        """Load the server's parameters (and BatchNorm statistics) into the model (``load``; else
        only into ``pulled``, for a caller that assigns them itself); their version."""
        self.check()
        version, values = self.client.pull(self.worker_id)
        if load:
            set_values(self.model, values)
        self.version, self.pulled = version, values
        self.seen = max(self.seen, version)
        return version

    def push(self, payload: Mapping, work: Work, loss: float = 0.0, *,
             metrics: Mapping[str, np.ndarray] | None = None, set_learning_rates: Sequence[float] = ()) -> PushReply:
        """Push ``payload`` (``worker.gradients.as_pushed``) of ``work``, computed from the last
        pull. ``step`` moves on: past own work once pushed (sync: to where the server says, a
        dropped push skipping ahead); past a task before it is sent (the mode answers a step
        pushed twice from its record); a micro-batch's is the round's to move. ``metrics`` and
        ``set_learning_rates`` as in ``PSClient.push``."""
        self.check()
        dealt = work.micro_batch >= 0 or work.task >= 0  # waits the client's timeout, then asks again
        if work.task >= 0:
            self.step = work.step + 1
        timeout = None if dealt else self.registration.barrier_timeout + 30.0 if self.sync else 120.0
        reply = self.client.push(self.worker_id, work.step, self.version, work.batch_size, payload, loss,
                                 timeout=timeout, metrics=metrics, set_learning_rates=set_learning_rates,
                                 micro_batch=work.micro_batch, task=work.task)
        self.seen = max(self.seen, reply.version)
        if not dealt:
            self.step = max(reply.next_step, work.step + 1) if self.sync else work.step + 1
        return reply

    def broadcast(self, key: str, value: bytes | None, timeout: float) -> bytes:
        """The poster's decision under ``key`` (the chief's, or the worker's a vote's key names:
        ``broadcast_poster``): the poster posts ``value`` (bytes; it must give one) and gets it
        back at once; every other worker waits for it, at most ``timeout`` seconds (and the
        server's barrier timeout), else ``PSClientError`` DEADLINE_EXCEEDED. What a Keras fit
        agrees on at each epoch's end."""
        poster = broadcast_poster(key) == self.worker_id
        if poster:
            if value is None:
                raise ValueError(f"the poster must give a value for broadcast key {key!r}")
            self.posted = {**dict(list(self.posted.items())[-(POSTS_KEPT - 1):]), key: bytes(value)}
        return self.client.broadcast(self.worker_id, key, self.posted[key] if poster else None, timeout)

    # -- faults
    def rejoin(self, error: PSClientError) -> None:
        """Reconnect within --reconnect-timeout, register again, and set where to resume:
        sync at the server's round, async and ssp at the same step."""
        config, old, step = self.config, self.registration, self.step
        self.check()  # another process holds our index: nothing to rejoin
        log.warning("worker %d lost its place at step %d (%s); reconnecting for up to %g s",
                    config.worker_index, step, error, config.reconnect_timeout)
        deadline = time.monotonic() + config.reconnect_timeout
        delay = 0.2
        while True:
            try:
                new = self._register(timeout=min(5.0, max(0.5, deadline - time.monotonic())))
                if not new.initialized and config.is_chief:
                    # A server restarted with no checkpoint: carry on from our last parameters.
                    created = self._initialize(new.worker_id)
                    log.warning("server at %s had no state; re-initialized it from this worker's last parameters "
                                "(created=%s)", config.ps, created)
                elif not new.initialized:
                    self.client.wait_initialized(new.worker_id, max(1.0, deadline - time.monotonic()))
                break
            except PSClientError as e:
                if not recoverable(e) and e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                if time.monotonic() + delay > deadline:
                    raise TrainingError(f"lost the parameter server at {config.ps} and could not rejoin within "
                                        f"--reconnect-timeout {config.reconnect_timeout:g} s ({e})") from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        if new.incarnation != old.incarnation:
            # Sync: rounds this worker had seen completed that the restored state lacks. Async: the
            # versions it saw beyond the restored one (others' pushes it never saw may be lost too).
            if new.mode == "sync":
                lost = f": resuming at round {new.round}, {max(0, step - new.round)} step(s) of updates were lost"
            else:
                lost = (f": at least {max(0, self.seen - new.version)} update(s) were lost "
                        f"(this worker had seen version {self.seen})")
            log.warning("the server restarted (incarnation %s -> %s) at version %d%s", old.incarnation,
                        new.incarnation, new.version, lost)
            for key, value in self.posted.items():  # a worker may wait for one the restart lost
                self.client.broadcast(new.worker_id, key, value, self.client.timeout)
        self.registration, self.seen = new, new.version
        self.step = new.round if new.mode == "sync" else step
        log.info("worker %d rejoined: resuming at step %d", new.worker_id, self.step)

    # -- the end
    def leave(self) -> None:
        """Tell the server this worker finished (the lease stays renewed until ``close``)."""
        self.client.leave(self.worker_id)

    def close(self) -> None:
        """Stop renewing the lease and disconnect."""
        try:
            if self.heartbeat is not None:
                self.heartbeat.stop()
        finally:
            self.client.close()

    # -- helpers
    def _register(self, timeout: float) -> Registration:
        return self.client.register(self.config.worker_index, self.config.num_workers,
                                    f"{socket.gethostname()}:{os.getpid()}", timeout=timeout)

    def _initialize(self, worker_id: int | None = None) -> bool:
        return self.client.initialize(self.worker_id if worker_id is None else worker_id, get_values(self.model),
                                      self.optimizer_spec, non_trainable=[v.path for v in non_trainable(self.model)],
                                      data_plan=self.data_plan)

    @property
    def sparse_rule(self) -> str:
        """The rule the server steps repeated rows by (``worker.gradients``): its ``--sparse-rule``,
        or its optimizer's once initialized; before that (a server started without the flag)
        the one this worker's optimizer asks for, which the chief's Initialize gives it."""
        return self.registration.sparse_rule or self.optimizer_spec.get("sparse_rule") or "sum"


class Heartbeat:
    """Renews the connection's lease from a thread, so a long barrier wait or a slow step
    never looks like a death; it reports the connection's registration and step as they are
    (after a rejoin, the new ones). Errors are left to the training loop."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.interval = conn.config.heartbeat_interval or max(0.1, conn.registration.lease_timeout / HEARTBEATS_PER_LEASE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.conn.client.heartbeat(self.conn.registration.worker_id, self.conn.step,
                                           timeout=max(1.0, self.interval))
            except PSClientError as e:
                if e.reason is Reason.SUPERSEDED:  # another process took our index: stop acting for it
                    self.conn.superseded = e
                    return
                log.debug("heartbeat failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


__all__ = ["Connection", "Heartbeat", "TrainingError", "Work", "connect", "recoverable"]
