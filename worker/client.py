"""Every gRPC call a worker makes, in one place (with its transports, ``worker.transports``).

    client = PSClient("127.0.0.1:50051")
    reg = client.register(worker_index=0, num_workers=2)
    version, values = client.pull(reg.worker_id)
    reply = client.push(reg.worker_id, step, version, batch_size, grads, loss)
    value = client.broadcast(reg.worker_id, "epoch-1", b"stop" if chief else None, timeout=30.0)

NumPy in, NumPy out: no TensorFlow here. How a pull or push travels (one message on the
Session stream, streamed, PushPull, or shared memory) is in docs/speed.md. A full pull
sends the server the version and incarnation of the values this client holds, and gets
back only the variables that changed since (``worker.transports.PullCache``).

Same-host fast path, opt-in: ``PSClient(address, shm=True)``. At ``register`` the client
proves that the server can open its shared-memory segments; only then do large pushes and
pulls pass through them (``shm_active``), until a refusal turns it off for good
(``shm_fallback_reason``; what it guarantees: ``worker.transports.SharedMemory``).

Each call carries a deadline. Calls that are safe to repeat (Register, Initialize, Pull,
Leave, Status, Heartbeat, Broadcast) are retried on UNAVAILABLE by the channel's
service-config retry policy (a large model's streamed Initialize is not). Push is retried
only by the trainer, deliberately: the server answers a repeated (worker, step) from its
record instead of applying it twice. Failures surface as ``PSClientError`` whose message
names the call, the status code and the server's own explanation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import secrets
import threading
import time
from operator import attrgetter
from typing import Iterable, Mapping, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec, convert, stream, wire
from protos import tfps_pb2 as pb
from ps_common import security
from ps_common.reasons import Reason
from ps_common.records import PushReply, Registration
from ps_common.sparse import SparseRows
from worker.transports import (CallStream, OutgoingPush, PSClientError, PullCache, SharedMemory,
                               Streams, Unary, failures)

__all__ = ["PSClient", "PSClientError", "PushReply", "MicroReply", "Registration", "SERVICE_CONFIG", "SMALL_BYTES",
           "SMALL_SHM_BYTES"]

_RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "2s", "backoffMultiplier": 2,
                 "retryableStatusCodes": ["UNAVAILABLE"]}
_RETRIED = ("Register", "Initialize", "Pull", "Leave", "Status", "Heartbeat", "Broadcast")
SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": wire.SERVICE_NAME, "method": m} for m in _RETRIED], "retryPolicy": _RETRY_POLICY}]})


# Pushes and pulls of at most this many bytes go as one unary message: a streamed
# call costs a thread on each side and ~0.3 ms more (bench/barrier.py), which is
# more than moving 1 MiB. Larger ones are streamed, or go through shared memory,
# which already beats one message at 1 MiB (bench/transport.py): with shared
# memory on, the limit is SMALL_SHM_BYTES.
SMALL_BYTES = 1 << 20
SMALL_SHM_BYTES = 256 << 10


@dataclasses.dataclass(frozen=True)
class MicroReply(PushReply):
    """The reply to a micro-batch's push (elastic sync): ``more`` is the work to do next
    while the round goes on (this worker's rest, or a dead worker's part); None once the
    round completed, when the fields are the round's answer."""

    more: pb.Assignment | None = None


class PSClient(contextlib.AbstractContextManager):
    def __init__(
        self,
        address: str,
        timeout: float = 30.0,
        *,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls_server_name: str | None = None,
        token: str | None = None,
        grad_wire_dtype: str = "float32",
        shm: bool = False,
        small_bytes: int = SMALL_BYTES,
        max_message_bytes: int | None = None,
        overlap: bool = True,
        overlap_block_bytes: int = 0,
        session: bool = True,
    ):
        """TLS with ``tls_ca_file`` (plus a client certificate for mutual TLS); ``token`` is sent
        as ``authorization: Bearer`` on every call (``ps_common.security``). ``shm``: try the
        same-host fast path from ``register`` on. ``small_bytes``: pushes and pulls up to this
        size go as one message. ``max_message_bytes``: the channel's limit (None: ``protos.wire``'s
        process-wide one). ``overlap`` (sync: PushPull), ``overlap_block_bytes`` (> 0: every sync
        push a PushPull, in blocks of that many bytes) and ``session`` (one-message calls on the
        Session stream, ``CallStream``; False: unary calls) are in docs/speed.md."""
        if grad_wire_dtype not in stream.WIRE_DTYPES:
            raise ValueError(f"grad_wire_dtype must be one of {stream.WIRE_DTYPES}, got {grad_wire_dtype!r}")
        self.address = address
        self.timeout = timeout
        # Register's token (RegisterRequest.process): this client's registrations are one process's,
        # one incarnation of its index; a worker started again makes a new client, a new incarnation.
        self.process = secrets.token_hex(8)
        self.grad_wire_dtype = grad_wire_dtype
        self.small_bytes = small_bytes
        self.max_message_bytes = wire.max_message_bytes() if max_message_bytes is None else max_message_bytes
        self._options = wire.client_options(self.max_message_bytes) + [
            ("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)]
        self._security = dict(ca_file=tls_ca_file, cert_file=tls_cert_file, key_file=tls_key_file,
                              server_name=tls_server_name, token=token)
        self._channel = security.client_channel(address, options=self._options, **self._security)
        self._beats: tuple[grpc.Channel, Unary] | None = None  # heartbeats' own connection, made at the first one
        self._beats_lock = threading.Lock()
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.unary = Unary(self._channel, address, timeout)
        # One-message pulls, pushes and Work calls: on the Session stream, or unary ones when it is off.
        self.calls = CallStream(self._channel, address, timeout) if session else self.unary
        self.streams = Streams(self._channel, address, timeout)
        self.shared_memory = SharedMemory(self.streams, address, enabled=shm)
        self.shm = shm  # the fast path was asked for
        self.cache = PullCache()
        self.sync = False  # set by register: the server runs sync (a push may bring the new values back)
        self.overlap = overlap
        self.overlap_block_bytes = overlap_block_bytes

    # The fast path's state, read where it is kept: True while pushes and pulls go through shared memory, and why
    # it went off for good (None: it did not, or was never asked for).
    shm_active = property(attrgetter("shared_memory.active"))
    shm_fallback_reason = property(attrgetter("shared_memory.fallback_reason"))

    def close(self) -> None:
        if self.calls is not self.unary:
            self.calls.close()
        self._channel.close()
        with self._beats_lock:
            if self._beats is not None:
                self._beats[0].close()
        self.shared_memory.close()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------
    def wait_ready(self, timeout: float) -> None:
        """Block until the server answers its health check as SERVING, or raise."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PSClientError("Health", self.address, grpc.StatusCode.UNAVAILABLE,
                                    f"server not serving within {timeout:g} s ({last})")
            try:
                reply = self._health.Check(health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME),
                                           timeout=min(remaining, 5.0), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def health(self, timeout: float = 5.0) -> str:
        with failures("Health", self.address):
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def register(self, worker_index: int, num_workers: int = 0, name: str = "", timeout: float | None = None) -> Registration:
        """Join the cluster; with ``shm``, probe the same-host fast path too (``SharedMemory.register``)."""
        request = pb.RegisterRequest(worker_index=worker_index, num_workers=num_workers, worker_name=name,
                                     process=self.process)
        self.cache.fresh = False
        reply = self.shared_memory.register(request, lambda r: self.unary.call(
            "Register", r, timeout=timeout, wait_for_ready=True))  # the server may still be starting
        self.sync = reply.mode == pb.SYNC
        return convert.REGISTRATION.from_wire(reply, shm=self.shared_memory.active)

    def initialize(self, worker_id: int, variables: Mapping[str, np.ndarray], optimizer: Mapping,
                   non_trainable: Iterable[str] = (), data_plan: Mapping | None = None,
                   clip_group: Mapping | None = None, shard_group: Mapping | None = None) -> bool:
        """Store ``variables`` on the server, unless an identical state is there (False).
        ``non_trainable`` names the variables updated by pushed changes, not the optimizer.
        ``data_plan`` (``num_examples``, ``global_batch_size``, ``seed``): the job's data, from
        which the server deals. ``clip_group`` (``shards``, ``shard``, ``order``): the shards this
        one takes ``global_clipnorm``'s norm with. ``shard_group`` (``shards``, ``shard``): shard 0
        decides what each update holds (``ps_server.core.modes.base.ShardGroup``).

        Variables of up to half the channel's message limit in all go as one Initialize message,
        which the channel retries on UNAVAILABLE; larger ones are streamed in ~2 MiB chunks
        (InitializeStream), so a model of any size can be initialized. Half, so that protobuf's
        own bytes around the tensors never push a message over."""
        # The fields an InitializeRequest and an InitializeHeader share.
        fields = dict(worker_id=worker_id, optimizer=pb.OptimizerConfig(**optimizer),
                      non_trainable=sorted(non_trainable), **{field: make(**value) for field, make, value in (
                          ("data_plan", pb.DataPlan, data_plan), ("clip_group", pb.ClipGroup, clip_group),
                          ("shard_group", pb.ShardGroup, shard_group)) if value is not None})
        if sum(np.asarray(v).nbytes for v in variables.values()) <= self.max_message_bytes // 2:
            request = pb.InitializeRequest(**fields, variables=codec.encode_many(variables))
            return self.unary.call("Initialize", request).created
        try:
            arrays = {n: stream.to_wire(v) for n, v in variables.items()}
        except codec.CodecError as e:
            raise PSClientError("Initialize", self.address, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        header = pb.InitializeHeader(**fields, variables=stream.metas(arrays))
        return self.streams.initialize(header, [a for _, a in arrays.values()]).created

    def _unary_limit(self) -> int:
        return min(self.small_bytes, SMALL_SHM_BYTES) if self.shared_memory.active else self.small_bytes

    def pull(self, worker_id: int = -1, names: Iterable[str] = ()) -> tuple[int, dict[str, np.ndarray]]:
        """(version, values). Arrays are read-only and the client's own; a full pull (no
        ``names``) reuses the previous pull's arrays for the variables that did not change
        and writes a row-wise table's changed rows into the one copy (``PullCache``)."""
        names = list(names)
        full = not names
        fresh = self.cache.take_fresh() if full else None
        if fresh is not None:
            return fresh
        request = pb.PullRequest(worker_id=worker_id, names=names)
        if full:
            self.cache.ask(request)
        if full and self.cache.held is not None and self.cache.nbytes <= self._unary_limit():
            header, values = self.calls.pull(request)  # a small model: one message beats a stream
        else:
            answer = self.shared_memory.pull(request)
            header, values = answer if answer is not None else self.streams.pull(request)
        for a in values.values():
            a.flags.writeable = False
        if full:
            try:
                values = self.cache.complete(header, values)
            except ValueError as e:
                raise PSClientError("Pull", self.address, None, f"malformed reply: {e}") from None
            self.shared_memory.expect_pull(values)
        return header.version, values

    def push(self, worker_id: int, step: int, base_version: int, batch_size: int,
             gradients: Mapping[str, np.ndarray], loss: float = 0.0, timeout: float | None = None,
             metrics: Mapping[str, np.ndarray] | None = None, set_learning_rates: Sequence[float] = (),
             micro_batch: int = -1, task: int = -1) -> PushReply:
        """Applied once or refused whole, however it travels. A gradient may be a ``SparseRows``
        (an embedding's): only its rows travel. ``metrics`` (sync): small named tensors the
        server sums over the round in worker order; the reply's ``metrics`` is that sum, the
        same for every worker of the round. ``set_learning_rates[i]`` > 0: the constant rate
        of the spec's group i (without groups, i = 0: the optimizer's) from this update on
        (sync: its round's); the reply's ``learning_rate`` is the rate used. Work the server dealt: ``micro_batch`` of round ``step`` (elastic sync), answered
        by a ``MicroReply``; ``task`` (async and ssp with a data plan), a retry of one already
        applied answered from the server's record (``replayed``)."""
        try:
            arrays = {n: stream.to_wire(g.values if isinstance(g, SparseRows) else g, self.grad_wire_dtype)
                      for n, g in gradients.items()}
            metric_tensors = [codec.encode(n, np.asarray(m)) for n, m in (metrics or {}).items()]
        except codec.CodecError as e:
            raise PSClientError("Push", self.address, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        rows = {n: np.asarray(g.rows, dtype=np.int64) for n, g in gradients.items() if isinstance(g, SparseRows)}
        outgoing = OutgoingPush(worker_id, step, base_version, batch_size, loss, arrays, rows,
                                metrics=metric_tensors, set_learning_rates=[float(r) for r in set_learning_rates],
                                micro_batch=micro_batch, task=task)
        reply = self._send(outgoing, timeout)
        with failures("Push", self.address):
            record = convert.PUSH_REPLY.from_wire(reply)
        if micro_batch < 0:
            return record
        more = reply.assignment if reply.HasField("assignment") else None
        return MicroReply(**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)}, more=more)

    def work(self, worker_id: int, timeout: float | None = None) -> pb.Assignment:
        """Elastic sync: this worker's micro-batches (round, micro_batches, sizes, parts); waits
        until it has some, at most ``timeout`` (default: the client's). Async and ssp with a
        data plan: a task (``task`` set; ``round`` its id, ``sizes[0]`` its examples), or none
        (no sizes; ``finished`` when every task is applied), at once."""
        return self.calls.call("Work", pb.WorkRequest(worker_id=worker_id), timeout=timeout)

    def _send(self, outgoing: OutgoingPush, timeout: float | None) -> pb.PushResponse:
        rows, set_learning_rates = outgoing.rows, outgoing.set_learning_rates
        timeout = self.timeout if timeout is None else timeout
        self.cache.fresh = False
        push_pull = self.overlap and self.sync and not rows and not set_learning_rates \
            and outgoing.micro_batch < 0 and outgoing.task < 0  # server-dealt data takes no PushPull
        fine = push_pull and self.overlap_block_bytes > 0 and not self.shared_memory.active
        if outgoing.nbytes <= self._unary_limit() and not fine:  # one message beats a stream
            # The sync shortcut brings every variable whole: not after a sparse push, whose
            # next pull brings an embedding table's changed rows only (when the server
            # steps it row by row), nor for a large model.
            outgoing.return_values = (self.sync and not rows and self.cache.nbytes <= self._unary_limit()
                                      and not self.cache.row_deltas_seen)
            reply = self.calls.push(outgoing, timeout)
            self.cache.receive(reply, self.address)
        else:
            reply = self.shared_memory.push(outgoing, timeout)
            if reply is None:
                reply = self._push_pull(outgoing, timeout) if push_pull else self.streams.push(outgoing, timeout)
        return reply

    def _push_pull(self, outgoing: OutgoingPush, timeout: float) -> pb.PushResponse:
        """A sync push as PushPull. Confirmed values join the pull cache as the next pull's
        answer: the pushed variables' new values, the others those held at the push's base
        version (a sync round changes only what was pushed)."""
        reply, values = self.streams.push_pull(outgoing, timeout, self.overlap_block_bytes)
        held = self.cache.held
        if values is not None and held is not None and held[0] == reply.incarnation \
                and held[1] == outgoing.base_version and set(values) <= set(held[2]):
            self.cache.keep(reply.incarnation, reply.version, {n: values.get(n, held[2][n]) for n in held[2]},
                            fresh=True)
        return reply

    def optimizer_state(self, worker_id: int = -1, averages: Iterable[str] = (), window_batches: int = 0) -> \
            tuple[int, dict[str, np.ndarray], dict[str, dict]]:
        """(version, values, {variable: {slot: array, "iterations": n}}) as of one version:
        the parameters with the server's optimizer state (``PullRequest.optimizer_state``), in
        one message. ``averages``: these variables first take their moving averages (the end
        of a Keras ``fit`` with ``use_ema``; moved for the ``window_batches`` of a
        ``gradient_accumulation_steps`` window under way), and the pull cache holds the values
        from then on."""
        reply = self.unary.call("Pull", pb.PullRequest(worker_id=worker_id, optimizer_state=True,
                                                       averages=list(averages), window_batches=window_batches))
        states: dict[str, dict] = {}
        for name, a in codec.decode_many(reply.optimizer_state).items():
            variable, slot = name.rsplit("/", 1)
            states.setdefault(variable, {})[slot] = int(a) if slot == "iterations" else a
        values = codec.decode_many(reply.variables)
        if averages:  # the version stayed: a pull that knows it would keep the values held before
            self.cache.keep(reply.incarnation, reply.version, values)
        return reply.version, values, states

    def broadcast(self, worker_id: int, key: str, value: bytes | None, timeout: float) -> bytes:
        """The chief's (worker 0's) value under ``key``. The chief passes ``value`` and is
        answered at once; any other worker passes None and waits until the chief posted
        ``key``, at most ``timeout`` seconds (and the server's barrier timeout):
        DEADLINE_EXCEEDED after that. A repeated post of the same value is harmless, so
        the call is retried like the other idempotent ones."""
        if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
            raise ValueError(f"broadcast timeout must be a finite number of seconds >= 0, got {timeout!r}")
        request = pb.BroadcastRequest(worker_id=worker_id, key=key, value=value or b"", timeout_s=timeout)
        # The server answers by timeout_s; the deadline leaves it room to say so itself.
        return self.unary.call("Broadcast", request, timeout=timeout + max(5.0, 0.1 * timeout)).value

    def heartbeat(self, worker_id: int, step: int = -1, timeout: float = 5.0) -> str:
        """Renew this worker's lease; returns the server's incarnation. Over a connection of
        its own (``grpc.use_local_subchannel_pool``: a TCP connection this channel alone uses),
        so that a heartbeat never waits behind a push's or an initialize's bytes in the data
        connection's socket buffer and HTTP/2 windows: on a slow link a large push takes
        several lease periods to cross, and the worker sending it is alive."""
        with self._beats_lock:
            if self._beats is None:
                channel = security.client_channel(
                    self.address, options=self._options + [("grpc.use_local_subchannel_pool", 1)], **self._security)
                self._beats = channel, Unary(channel, self.address, self.timeout)
            beats = self._beats[1]
        request = pb.HeartbeatRequest(worker_id=worker_id, step=step, process=self.process)
        return beats.call("Heartbeat", request, timeout=timeout).incarnation

    def leave(self, worker_id: int) -> None:
        self.unary.call("Leave", pb.LeaveRequest(worker_id=worker_id))

    def status(self) -> pb.StatusResponse:
        return self.unary.call("Status", pb.StatusRequest())

    def wait_initialized(self, worker_id: int, timeout: float) -> tuple[int, dict[str, np.ndarray]]:
        """``self.pull(worker_id)`` once the chief has initialized the variables (of every shard,
        for a ``ShardedClient``), retrying with backoff; PSClientError after ``timeout``."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                return self.pull(worker_id)
            except PSClientError as e:
                if e.reason is not Reason.NOT_INITIALIZED:
                    raise
                if time.monotonic() + delay > deadline:
                    raise PSClientError("Pull", e.address, e.code,
                                        f"variables still not initialized after {timeout:g} s: is the chief "
                                        "(worker 0) running?", e.reason) from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
