"""The gRPC face of the parameter server: protobuf in, core calls, protobuf out.

    servicer = ParameterServerServicer(core)
    tfps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, grpc_server)

This is the only module that turns protobuf into core calls, and core errors
into gRPC status codes, through the one table ``STATUS_OF``. Every error leaves
through ``context.abort(code, message)`` with its reason (``ps_common.reasons``) as the
trailing metadata ``tfps-reason``; an unexpected exception is logged and becomes
``INTERNAL``, never ``UNKNOWN``.

Same-host fast path (``protos.shm``; off with ``ParameterServerServicer(core,
allow_shm=False)``, ``ps-server --no-shm``): Register answers the worker's probe,
PushStream reads the gradients straight from the worker's segment (zero-copy,
read-only; no reference is kept once the push returns) and PullStream writes
the values into it. Every refusal of that path (disabled, a bad name, a missing
or foreign segment, an offset or size that does not fit) is FAILED_PRECONDITION with
reason SHM_REFUSED, raised before anything is applied or written.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time

import grpc

import numpy as np

from protos import codec, convert, shm, stream, wire
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from ps_server import peers
from ps_server.core import broadcast, errors
from ps_server.core.clip_group import ClipGroup, ClipTimeout
from ps_server.core.data.cursor import DataPlan
from ps_server.core.modes.elastic_mode import ElasticReply
from ps_server.core.membership import MembershipEvent, WorkerRecord
from ps_server.core.modes.base import Push, ShardGroup
from ps_server.core.modes.aggregation import holds
from ps_server.core.modes.overlap import MAX_BLOCK_BYTES, MIN_BLOCK_BYTES, NOT_YET
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer, Status, TaskOffer
from ps_common.names import NONE_AS_ZERO, schedule_from_wire, schedule_to_wire
from ps_common.reasons import REASON_KEY, Reason, reason_of
from ps_server.aio import AsyncBudget, settled
from ps_server.buffers import BufferPool

log = logging.getLogger("ps_server.service")

# The one error table: core exception class -> gRPC status code.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    codec.CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.NotInitialized: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SpecConflict: grpc.StatusCode.ALREADY_EXISTS,
    errors.ConfigMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.UnknownWorker: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NoFreeIndex: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Superseded: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StaleRound: grpc.StatusCode.FAILED_PRECONDITION,
    errors.FutureRound: grpc.StatusCode.OUT_OF_RANGE,
    errors.DuplicatePush: grpc.StatusCode.ALREADY_EXISTS,
    errors.BarrierTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.WorkerDead: grpc.StatusCode.ABORTED,
    errors.Busy: grpc.StatusCode.UNAVAILABLE,
    shm.ShmError: grpc.StatusCode.FAILED_PRECONDITION,  # the worker falls back to the streams
    broadcast.BroadcastConflict: grpc.StatusCode.FAILED_PRECONDITION,
    broadcast.BroadcastTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
}

REFUSALS = (errors.PSError, codec.CodecError, shm.ShmError)  # each has a reason (ps_common.reasons)

# Refusals a worker expects while it waits its turn and rides out by asking again: logged
# at DEBUG, where every other refusal is at INFO (a start of N workers is not N refusals).
EXPECTED = frozenset({Reason.NOT_INITIALIZED})


def status_code_for(exc: Exception) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


def _refused(name: str, e: Exception) -> grpc.StatusCode:
    """``e``'s status code, the refusal logged."""
    code, reason = status_code_for(e), reason_of(e)
    log.log(logging.DEBUG if reason in EXPECTED else logging.INFO, "%s refused: %s (%s): %s",
            name, code.name, reason.value, e)
    return code


# The most of a refusal's message a reply carries. The message travels as a header, and a
# client refuses headers over 16 KiB in all: a barrier timeout naming 1024 workers came back
# as RESOURCE_EXHAUSTED, not as itself. The log keeps the whole message.
DETAILS_LIMIT = 2000


def _details(e: Exception) -> str:
    text = str(e)
    if len(text) <= DETAILS_LIMIT:
        return text
    return f"{text[:DETAILS_LIMIT]} ... ({len(text) - DETAILS_LIMIT} more characters in the server's log)"


def _reason_metadata(e: Exception) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries ``e``'s reason to the client."""
    return ((REASON_KEY, reason_of(e).value),)


class Malformed:
    """Stands in for a request whose bytes do not parse as its message type."""

    def __init__(self, message_type: str, error: Exception):
        self.message_type, self.error = message_type, error


def _tolerant(message_class, parse=None):
    """A request deserializer that never raises (grpcio would answer INTERNAL): bad bytes
    become a ``Malformed``. ``parse`` defaults to ``message_class.FromString``; streams
    pass ``protos.stream.deserializer``, which makes data chunks zero-copy memoryviews."""
    parse = parse or message_class.FromString

    def tolerant(data: bytes):
        try:
            return parse(data)
        except Exception as e:  # DecodeError and friends
            return Malformed(message_class.DESCRIPTOR.full_name, e)

    return tolerant


def _counted_in(deserialize, count):
    """``deserialize``, first adding each request message's size to ``count``."""
    def counted(data: bytes):
        count(len(data))
        return deserialize(data)

    return counted


def _counted_out(serialize, count):
    """``serialize``, then adding each response message's size to ``count``."""
    def counted(msg) -> bytes:
        data = serialize(msg)
        count(len(data))
        return data

    return counted


def add_to_server(servicer: "ParameterServerServicer", server: grpc.Server, traffic=None) -> None:
    """Register the service like the generated ``add_ParameterServerServicer_to_server``,
    but with deserializers that let malformed bytes reach ``_handled`` (INVALID_ARGUMENT),
    and the streams' hand-framed data chunks (``protos.stream``).

    ``traffic`` (``ps_server.metrics.Metrics``; None: not counted) gives, per method name,
    ``traffic.received(name)`` and ``traffic.sent(name)``: callables that take the size in
    bytes of each request or response message (protobuf or data chunk; gRPC's own framing,
    headers and TLS are not counted)."""
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    handlers = {}
    for m in service.methods:
        method = getattr(servicer, m.name)
        if m.name in ("PushStream", "InitializeStream"):
            chunk = getattr(pb, m.input_type.name)
            deserialize = _tolerant(chunk, stream.deserializer(chunk))
            serialize = getattr(pb, m.output_type.name).SerializeToString
            handler = grpc.stream_unary_rpc_method_handler
        elif m.name == "PushPull":
            deserialize = _tolerant(pb.PushChunk, stream.deserializer(pb.PushChunk))
            serialize = stream.serializer(pb.PushPullChunk)
            handler = grpc.stream_stream_rpc_method_handler
        elif m.name == "Session":
            deserialize = _tolerant(pb.SessionRequest)
            serialize = pb.SessionReply.SerializeToString
            handler = grpc.stream_stream_rpc_method_handler
        elif m.name == "PullStream":
            deserialize = _tolerant(pb.PullRequest)
            serialize = stream.serializer(pb.PullChunk)
            handler = grpc.unary_stream_rpc_method_handler
        else:
            deserialize = _tolerant(getattr(pb, m.input_type.name))
            serialize = getattr(pb, m.output_type.name).SerializeToString
            handler = grpc.unary_unary_rpc_method_handler
        if traffic is not None:
            deserialize = _counted_in(deserialize, traffic.received(m.name))
            serialize = _counted_out(serialize, traffic.sent(m.name))
        handlers[m.name] = handler(method, request_deserializer=deserialize, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _handled(method):
    """Turn every exception of an RPC handler into a precise status."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            _refuse_malformed(method.__name__, request)
            return method(self, request, context)
        except REFUSALS as e:
            code = _refused(method.__name__, e)
            context.set_trailing_metadata(_reason_metadata(e))
            context.abort(code, _details(e))
        except Exception as e:  # a bug: say so, but never as UNKNOWN
            log.exception("%s failed unexpectedly", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {type(e).__name__}: {e}")

    return wrapper


def _refuse_malformed(name: str, request) -> None:
    if isinstance(request, Malformed):
        raise codec.CodecError(f"{name}: the request is not a valid {request.message_type}: {request.error}")


def _handled_async(method):
    """``_handled`` for a handler that awaits (``ps_server.aio``)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            _refuse_malformed(method.__name__, request)
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            await _abort_for(method.__name__, e, context)

    return wrapper


async def _abort_for(name: str, e: Exception, context) -> None:
    """End the call with ``e``'s status from the error table (called in the except block)."""
    code, details, reason = _ending(name, e)
    await context.abort(code, details, trailing_metadata=((REASON_KEY, reason),) if reason else ())


def _failure(name: str, e: Exception) -> pb.CallFailure:
    """``_ending`` as a Session's CallFailure (called in the except block)."""
    code, details, reason = _ending(name, e)
    return pb.CallFailure(code=code.value[0], details=details, reason=reason)


def _ending(name: str, e: Exception) -> tuple[grpc.StatusCode, str, str]:
    """How call ``name`` ends for ``e`` (called in the except block): its status from the
    error table, the details and the reason; an unexpected exception is INTERNAL, no reason."""
    if isinstance(e, REFUSALS):
        return _refused(name, e), _details(e), reason_of(e).value
    log.exception("%s failed unexpectedly", name)  # a bug: say so, but never as UNKNOWN
    return grpc.StatusCode.INTERNAL, f"internal error in {name}: {type(e).__name__}: {e}", ""


def _handled_stream(method):
    """``_handled`` for a handler that is an async generator (a streamed reply)."""

    @functools.wraps(method)
    async def wrapper(self, request_iterator, context):
        try:
            async for reply in method(self, request_iterator, context):
                yield reply
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            await _abort_for(method.__name__, e, context)

    return wrapper


def _forget(calls: dict, call: int, task: asyncio.Task) -> None:
    """A Session's call ``call`` is done: no longer running (unless its id was reused since)."""
    if calls.get(call) is task:
        del calls[call]


async def _speculated(spec, name: str, block: int, reading: asyncio.Future):
    """``Speculation.peek`` awaited: the block's values, or None when they will not come."""
    loop = asyncio.get_running_loop()
    while True:
        got = spec.peek(name, block, reading.done())  # ready already: no listener needed
        if got is not NOT_YET:
            return got
        changed = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(lambda: changed.done() or changed.set_result(None))
        spec.listen(wake)  # before looking again, so that no change between the two is missed
        got = spec.peek(name, block, reading.done())
        if got is not NOT_YET:
            return got
        reading.add_done_callback(lambda _: changed.done() or changed.set_result(None))
        try:
            await asyncio.wait_for(changed, 1.0)
        except asyncio.TimeoutError:
            pass


async def _header(request_iterator, method: str, chunk_class=pb.PushChunk):
    """The header a request stream must start with (a ``chunk_class``, PushChunk or
    InitializeChunk, with a header and no data)."""
    first = None
    async for first in request_iterator:
        break
    if isinstance(first, Malformed):
        raise codec.CodecError(f"the stream's first message is not a valid {first.message_type}: {first.error}")
    if not isinstance(first, chunk_class) or not first.HasField("header") or first.data:
        raise codec.CodecError(f"{method}: the first message must carry the header, and no data")
    return first.header


async def _received_async(layout: stream.Layout, buffer: np.ndarray, request_iterator, method: str,
                          on_bytes=None) -> dict[str, np.ndarray]:
    """The arrays of a request stream's data messages, received into ``buffer``;
    ``on_bytes(received)`` after each message."""
    assembler = stream.Assembler(layout, buffer)
    async for chunk in request_iterator:
        assembler.feed(_data(chunk, method))
        if on_bytes is not None:
            await on_bytes(assembler.received)
    return assembler.arrays()


def _none_as_zero(x):
    return 0 if x is None else x


def _zero_as_none(x):
    return None if x == 0 else x


def _schedule_from_wire(text: str):
    try:
        return schedule_from_wire(text)
    except ValueError as e:
        raise errors.InvalidArgument(str(e)) from None


def _groups_to_wire(groups) -> list:
    return [pb.OptimizerGroup(variables=names, optimizer=optimizer_to_wire(spec)) for names, spec in groups or ()]


def _groups_from_wire(groups) -> tuple | None:
    return tuple((tuple(g.variables), optimizer_from_wire(g.optimizer)) for g in groups) or None


# By Keras' argument names on both sides; the wire spells None as 0 and a schedule as JSON.
OPTIMIZER = convert.Conversion(
    OptimizerSpec, pb.OptimizerConfig,
    to_wire={"learning_rate_schedule": schedule_to_wire, "sparse_rule": lambda rule: rule or "",
             "groups": _groups_to_wire, **{f: _none_as_zero for f in NONE_AS_ZERO}},
    from_wire={"learning_rate_schedule": _schedule_from_wire, "groups": _groups_from_wire,
               **{f: _zero_as_none for f in NONE_AS_ZERO}},
)


def optimizer_to_wire(spec: OptimizerSpec | None) -> pb.OptimizerConfig:
    return pb.OptimizerConfig() if spec is None else OPTIMIZER.to_wire(spec)


def optimizer_from_wire(msg: pb.OptimizerConfig) -> OptimizerSpec:
    return OPTIMIZER.from_wire(msg)


# The server's status as it travels: the core's records field by field (protos.convert).
WORKER_STATUS = convert.Conversion(
    WorkerRecord, pb.WorkerStatus,
    rename={"name": "worker_name", "last_seen": "last_seen_age_s"},  # the age is taken at the call (Status)
    local={"registered_at", "dead_since", "last_push_done",  # the server's own clock readings
           "process", "replaced"},  # the process's token stays on the server
)
MEMBERSHIP_EVENT = convert.Conversion(MembershipEvent, pb.MembershipEvent, rename={"name": "worker_name"})
STATUS = convert.Conversion(
    Status, pb.StatusResponse,
    rename={"lease_timeout": "lease_timeout_s"},
    to_wire={"mode": wire.mode_to_wire, "optimizer": optimizer_to_wire,
             "membership": lambda events: [MEMBERSHIP_EVENT.to_wire(e) for e in events]},
)
CONVERSIONS = (*convert.CONVERSIONS, OPTIMIZER, WORKER_STATUS, MEMBERSHIP_EVENT, STATUS)


def _assignment(work, parts: int) -> pb.Assignment:
    """Elastic sync's ``Work``, or async and ssp's ``TaskOffer``, as an Assignment."""
    if isinstance(work, TaskOffer):
        if work.task is None:
            return pb.Assignment(round=-1, task=True, finished=work.finished)
        return pb.Assignment(round=work.task.task_id, sizes=[work.task.size], task=True)
    return pb.Assignment(round=work.round, micro_batches=list(work.micro_batches), sizes=list(work.sizes),
                         parts=parts, skipped_rounds=list(work.skipped_rounds))


def status_to_wire(s: Status, now: float) -> pb.StatusResponse:
    """``s`` as a StatusResponse; worker ages are seconds from their last call to ``now``."""
    age = lambda last_seen: now - last_seen  # noqa: E731
    return STATUS.to_wire(s, workers=lambda records: [WORKER_STATUS.to_wire(w, last_seen=age) for w in records])


def _data(chunk, method: str) -> memoryview:
    """A request stream's message after its header: data, or an error naming what came instead."""
    if not isinstance(chunk, memoryview):
        what = f"not a valid {chunk.message_type}: {chunk.error}" if isinstance(chunk, Malformed) else "a second header"
        raise codec.CodecError(f"{method}: after the header, every message must be data; got {what}")
    return chunk


# Bytes of streamed pushes the server receives at once (``ps_server.aio.AsyncBudget``):
# at least two pushes (two cores keep busy copying them in), at least RECEIVE_BYTES. A sync
# round holds every push whole (at most core.modes.aggregation.HELD_BYTES of
# them): for pushes of that size the budget takes them all.
RECEIVE_BYTES = 16 << 20
SEND_BYTES = 16 << 20  # bytes of PullStream replies being sent at once (one always, however large)
BUSY_WAIT_S = 120.0  # at most this long for room, within the call's deadline
# A store of at most this many bytes of values: a call's work (a fold, a round's step, a
# pull's encoding) takes microseconds, less than the two thread switches of a hop to the
# pool and back, so it is done on the loop (bench/barrier.py measures the difference).
INLINE_BYTES = 64 << 10


class _Loan:
    """A receive buffer and its share of the budget, given back once (whichever comes first:
    the core saying it is done with the gradients, or the handler ending). ``gradients``,
    the views of the buffer handed to the core, is emptied then: a push waiting at the
    barrier keeps no reference to its bytes (nor does any frame of its handler)."""

    def __init__(self, servicer: "ParameterServerServicer", nbytes: int, buffer: np.ndarray):
        self._servicer, self.nbytes, self.buffer = servicer, nbytes, buffer
        self.gradients: dict = {}
        self._lock = threading.Lock()
        self._out = True

    def give_back(self) -> None:
        with self._lock:
            if not self._out:
                return
            self._out = False
            buffer, self.buffer = self.buffer, None
            self.gradients.clear()
        self._servicer.buffers.release(buffer)
        self._servicer.receiving.release(self.nbytes)


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    def __init__(self, core: ParameterServer, chunk_bytes: int | None = None, allow_shm: bool = True):
        self.core = core
        self.chunk_bytes = chunk_bytes or stream.CHUNK_BYTES
        self.buffers = BufferPool(keep=max(4, 2 * core.settings.num_workers), keep_bytes=RECEIVE_BYTES // 2)
        self.receiving = AsyncBudget(RECEIVE_BYTES)
        self.sending = AsyncBudget(SEND_BYTES)  # PullStream replies in flight
        self.pool = None  # the server's thread pool (ps_server.aio.LoopServer.pool): the work of a call
        self.control = None  # its thread for Status (LoopServer.control); None: the loop's default executor
        self.allow_shm = allow_shm
        self.segments = shm.SegmentCache()  # the workers' shared-memory segments, mapped
        self._store_bytes: int | None = None  # the store's values' bytes, once initialized (_inline)

    async def _work(self, fn, *args):
        """``fn(*args)`` on the pool: everything that computes or takes a core lock. For a
        small store (``INLINE_BYTES``) on the loop itself: every hold of a core lock is then
        as short as the work, and the hop would cost more than the work."""
        if self._inline():
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def _inline(self) -> bool:
        if self._store_bytes is None:  # a store's shapes never change once initialized
            if (not self.core.store.initialized or self.core.clip_group is not None
                    or self.core.shard_group is not None):
                return False  # a clip group's updates, a committed round wait for the other shards: never on the loop
            self._store_bytes = self.core.store.nbytes()
        return self._store_bytes <= INLINE_BYTES

    def _segment(self, worker_id: int, role: str, name: str, writable: bool) -> shm.Mapping:
        """A worker's segment, mapped; ShmError when this server does not take it."""
        if not self.allow_shm:
            raise shm.ShmError("refused: this server was started with --no-shm")
        if worker_id < 0:
            raise shm.ShmError("needs a registered worker id")
        return self.segments.get(worker_id, role, name, writable)

    def _probe(self, worker_id: int, push_name: str, pull_name: str) -> tuple[bytes, bytes]:
        """(the token at the start of the push segment, the nonce written at the start of the pull one)."""
        push = self._segment(worker_id, "push", push_name, writable=False)
        pull = self._segment(worker_id, "pull", pull_name, writable=True)
        for m in (push, pull):
            if m.size < shm.TOKEN_BYTES:
                raise shm.ShmError(f"segment {m.name!r} holds {m.size} bytes, fewer than the probe's "
                                   f"{shm.TOKEN_BYTES}")
        nonce = shm.new_token()
        pull.array[:shm.TOKEN_BYTES] = np.frombuffer(nonce, np.uint8)
        return push.array[:shm.TOKEN_BYTES].tobytes(), nonce

    def _since(self, request) -> int | None:
        """The version a pull may skip unchanged variables from, if the caller's copies are ours."""
        if request.known_incarnation and request.known_incarnation == self.core.incarnation:
            return request.known_version
        return None

    @_handled
    def Register(self, request, context):
        if not request.HasField("worker_index"):
            raise errors.InvalidArgument("Register needs worker_index: this worker's index, or -1 for the server to "
                                         "assign one; a request without it is refused, never taken as the chief")
        reg = self.core.register(request.worker_index, request.num_workers, request.worker_name or context.peer(),
                                 process=request.process)
        self.segments.drop(reg.worker_id)  # a new registration brings its own segments, if any
        reply = convert.REGISTRATION.to_wire(reg)
        fast_path = ""
        if request.shm_push_name or request.shm_pull_name:
            try:
                reply.shm_token, reply.shm_nonce = self._probe(reg.worker_id, request.shm_push_name,
                                                               request.shm_pull_name)
                fast_path = ", shared memory on"
            except shm.ShmError as e:  # never fails the registration: the worker streams instead
                self.segments.drop(reg.worker_id)
                reply.shm_error = str(e)
                fast_path = f", {e}"
        log.info("worker %d registered (%s)%s", reg.worker_id, request.worker_name or context.peer(), fast_path)
        return reply

    @_handled
    def Initialize(self, request, context):
        return self._initialize(request, codec.decode_many(request.variables))

    @_handled_async
    async def InitializeStream(self, request_iterator, context):
        """Initialize, its variables' bytes streamed (``protos.stream``): checked from the
        header first, then received straight into one buffer of the model's size, whose
        views the store keeps as its values (aligned ones: no second copy); nothing is stored
        unless every byte the header announced, and no more, arrived. Async like
        PushStream: the bytes are copied in on the loop, the core's work is on the pool,
        and the buffer counts against the receive budget while it is filled."""
        h = await _header(request_iterator, "InitializeStream", pb.InitializeChunk)
        layout = stream.Layout.of(h.variables)
        for m in h.variables:
            if m.sparse or m.rows:
                raise codec.CodecError(f"InitializeStream: variable {m.name!r} is marked sparse; a variable "
                                       "comes whole")
        await self._work(self._check_initialize, h)  # before a model's bytes are taken in
        await self._admit(layout.nbytes, context)
        try:
            # Not from the buffer pool: the model arrives once, and the pool would keep it.
            variables = await _received_async(layout, np.empty(layout.nbytes, np.uint8), request_iterator,
                                              "InitializeStream")
            return await self._work(self._initialize, h, variables, True)
        finally:
            self.receiving.release(layout.nbytes)

    def _check_initialize(self, h: pb.InitializeHeader) -> None:
        """What the header alone can refuse: an unknown worker, an invalid optimizer."""
        self.core.members.require(h.worker_id)
        optimizer_from_wire(h.optimizer).validate()

    def _initialize(self, request, variables: dict[str, np.ndarray], owned: bool = False) -> pb.InitializeResponse:
        """The core's initialize for an InitializeRequest or an InitializeHeader (the same
        fields but the variables' bytes), ``variables`` decoded from either; ``owned``: views
        of a buffer of ours, which the store keeps instead of copying."""
        plan = request.data_plan if request.HasField("data_plan") else None
        group = request.clip_group if request.HasField("clip_group") else None
        created, version = self.core.initialize(
            request.worker_id, variables, optimizer_from_wire(request.optimizer),
            non_trainable=list(request.non_trainable), owned=owned,
            data_plan=DataPlan(plan.num_examples, plan.global_batch_size, plan.seed, plan.epochs, plan.tasks,
                               plan.applies or 1)
            if plan is not None else None,
            shard_group=ShardGroup(tuple(request.shard_group.shards), request.shard_group.shard)
            if request.HasField("shard_group") else None,
            clip_group=ClipGroup(tuple(group.shards), group.shard, tuple(group.order)) if group is not None else None)
        if created:
            log.info(
                "initialized %d variables (%d parameters) by worker %d, optimizer: %s",
                len(variables), sum(v.size for v in variables.values()), request.worker_id,
                self.core.store.optimizer_spec.describe(),
            )
        return pb.InitializeResponse(created=created, version=version)

    def _pull(self, request) -> tuple[int, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(version, values, rows) for a pull: with ``row_deltas`` and a version the caller
        holds, a row-wise table as its changed rows (``rows[name]`` says which), else whole."""
        since = self._since(request)
        if request.row_deltas and since is not None:
            return self.core.pull_rows(request.worker_id, list(request.names), since=since)
        version, values = self.core.pull(request.worker_id, list(request.names), since=since)
        return version, values, {}

    @_handled_async
    async def Pull(self, request, context):
        return await self._pull_call(request)

    async def _pull_call(self, request) -> pb.PullResponse:
        return await self._work(self._pull_reply, request)

    def _pull_reply(self, request) -> pb.PullResponse:
        if request.averages:
            self.core.take_averages(request.worker_id, request.averages, request.window_batches)
        if request.optimizer_state:
            version, values, states = self.core.optimizer_state(request.worker_id)
            slots = {f"{n}/{k}": (np.asarray(a, np.int64) if k == "iterations" else a)
                     for n, s in states.items() for k, a in s.items()}
            return pb.PullResponse(version=version, variables=codec.encode_many(values), incarnation=self.core.incarnation,
                                   optimizer_state=codec.encode_many(slots))
        version, values, rows = self._pull(request)
        tensors = codec.encode_many(values)
        for t in tensors:
            if t.name in rows:
                t.sparse = True
                t.rows.extend(rows[t.name].tolist())
        return pb.PullResponse(version=version, variables=tensors, incarnation=self.core.incarnation)

    @_handled_stream
    async def PullStream(self, request, context):
        # Everything that can fail happens before the first message (on the pool: it reads
        # the store and may write a shared-memory segment).
        header, arrays = await self._work(self._pull_prepared, request)
        nbytes = sum(a.nbytes for a in arrays)
        remaining = context.time_remaining()
        # Every worker of a sync round pulls at once: the send budget lets a few streams send
        # at a time instead of queueing a thousand models in gRPC's buffers (a pull that waits
        # longer than its deadline allows is sent anyway: the budget bounds memory, not work).
        granted = await self.sending.acquire(nbytes, min(remaining, BUSY_WAIT_S) if remaining else BUSY_WAIT_S)
        try:
            yield pb.PullChunk(header=header)
            for chunk in stream.chunk_buffers(arrays, self.chunk_bytes):
                yield chunk
        finally:
            if granted:
                self.sending.release(nbytes)

    def _pull_prepared(self, request) -> tuple[pb.PullHeader, list[np.ndarray]]:
        """The header of a PullStream and the arrays its data messages carry (none when they
        went through the worker's shared-memory segment)."""
        if request.optimizer_state or request.averages:
            raise errors.InvalidArgument("the optimizer's state and its averages come by Pull, not PullStream")
        version, values, rows = self._pull(request)
        wire = {name: stream.to_wire(a) for name, a in values.items()}
        header = pb.PullHeader(version=version, incarnation=self.core.incarnation,
                               variables=stream.metas(wire, rows))
        arrays = {name: a for name, (_, a) in wire.items()}
        if request.shm_name:
            segment = self._segment(request.worker_id, "pull", request.shm_name, writable=True)
            offsets, needed = shm.aligned_offsets(a.nbytes for a in arrays.values())
            if needed <= segment.size:
                shm.write(segment, arrays, offsets)
                header.shm = True
                header.shm_offsets.extend(offsets)
                return header, []
            header.shm_bytes_needed = needed  # too small: streamed this time
        return header, list(arrays.values())

    @_handled_async
    async def Push(self, request, context):
        return await self._push_call(request)

    async def _push_call(self, request) -> pb.PushResponse:
        """One hop to the pool for the push; a second only to encode the values a reply
        carries (``return_values``), else the small reply is built on the loop."""
        result = await settled(await self._work(self._submit_unary, request))
        if request.return_values and self._values_stay_current():
            return await self._work(self._push_reply, request, result)
        return self._stream_reply(result)

    def _submit_unary(self, request):
        gradients = self._decoded(codec.decode_many(request.gradients), request.gradients)
        try:
            return self.core.submit(self._push_of(request, gradients, codec.decode_many(request.metrics)))
        finally:  # a push waiting at the barrier keeps no bytes of its request (its arrays are views)
            gradients.clear()
            request.ClearField("gradients")

    def _push_reply(self, request, result) -> pb.PushResponse:
        """``_stream_reply``, and the values after the push (asked, and they stay current)."""
        reply = self._stream_reply(result)
        result = result.result if isinstance(result, ElasticReply) else result  # None: the round goes on
        if result is not None and not (result.dropped or result.replayed):
            version, values = self.core.pull(request.worker_id)
            if version == result.version:
                reply.variables.extend(codec.encode_many(values))
                reply.incarnation = self.core.incarnation
        return reply

    def _values_stay_current(self) -> bool:
        """Sync without backup workers: no round completes without every active worker,
        so the values after a worker's round are current until it pushes again."""
        core = self.core
        return core.mode.rounds and core.settings.replicas_to_aggregate in (0, core.settings.num_workers)

    @_handled_async
    async def PushStream(self, request_iterator, context):
        h = await _header(request_iterator, "PushStream")
        layout = stream.Layout.of(h.gradients)
        if h.shm_offsets and not h.shm_name:
            raise codec.CodecError("PushStream: shm_offsets without shm_name")
        metrics = codec.decode_many(h.metrics)  # small: whole in the header
        await self._work(self._check, h, layout, metrics)
        if h.shm_name:
            rest = [chunk async for chunk in request_iterator]
            ticket = await self._work(self._push_from_segment, h, layout, metrics, iter(rest))
            return self._stream_reply(await settled(ticket))
        loan = await self._lend(layout.nbytes, context)
        received = _received_async(layout, loan.buffer, request_iterator, "PushStream")
        return self._stream_reply(await self._submit_lent(h, metrics, loan, received))

    async def _submit_lent(self, h: pb.PushHeader, metrics: dict, loan: "_Loan", received) -> object:
        """The result of the push whose gradients ``received`` (awaited) reads into ``loan``'s
        buffer; the loan given back once the core is done with them, or at the latest here."""
        try:
            loan.gradients = self._decoded(await received, h.gradients)
            ticket = await self._work(self.core.submit, self._push_of(h, loan.gradients, metrics), loan.give_back)
            return await settled(ticket)
        finally:  # the core keeps no reference to the gradients once its ticket is settled
            loan.give_back()

    def _stream_reply(self, result) -> pb.PushResponse:
        """A push's answer (elastic sync's: the work to do next, or once its round completed the round's)."""
        if isinstance(result, ElasticReply):
            return self._elastic_reply(result) if result.result is None else convert.PUSH_REPLY.to_wire(result.result)
        return convert.PUSH_REPLY.to_wire(result)

    def _check(self, h: pb.PushHeader, layout: stream.Layout, metrics: dict) -> None:
        self.core.check_push(h.worker_id, h.step, h.base_version, h.batch_size, stream.arriving(layout.entries, self.core.store.specs()),
                             sparse=codec.sparse_names(h.gradients), metrics=metrics,
                             set_learning_rates=h.set_learning_rates)

    @staticmethod
    def _push_of(h: "pb.PushHeader | pb.PushRequest", gradients, metrics: dict) -> Push:
        """The core's Push of a PushStream's header or a unary PushRequest (the same fields)."""
        return Push(worker_id=h.worker_id, step=h.step, base_version=h.base_version, batch_size=h.batch_size,
                    gradients=gradients, loss=h.loss, metrics=metrics, set_learning_rates=h.set_learning_rates,
                    micro_batch=h.micro_batch if h.HasField("micro_batch") else -1,
                    task=h.task if h.HasField("task") else -1)

    def _elastic_reply(self, reply: ElasticReply) -> pb.PushResponse:
        """Elastic sync, the round going on: the current version and the work to do next."""
        version = self.core.store.version
        if reply.work is None:  # a follower shard took it: shard 0 says what next
            return pb.PushResponse(version=version, next_step=version)
        return pb.PushResponse(version=version, next_step=version,
                               assignment=_assignment(reply.work, self.core.settings.micro_batches))

    async def _lend(self, nbytes: int, context) -> "_Loan":
        """A receive buffer of ``nbytes`` within the receive budget (``ps_server.buffers``);
        Busy when the pushes in flight leave no room before the call's deadline."""
        await self._admit(nbytes, context)
        return _Loan(self, nbytes, self.buffers.acquire(nbytes))

    async def _admit(self, nbytes: int, context) -> None:
        """Take ``nbytes`` of the receive budget (give them back with ``receiving.release``);
        Busy when the streams in flight leave no room before the call's deadline."""
        remaining = context.time_remaining() if context is not None else None
        wait = min(remaining, BUSY_WAIT_S) if remaining is not None else BUSY_WAIT_S
        limit = max(self.receiving.limit, 2 * nbytes)
        workers = self.core.settings.num_workers
        if holds(nbytes, workers):
            limit = max(limit, nbytes * workers)  # a sync round holds every push whole
        if not await self.receiving.acquire(nbytes, wait, limit):
            raise errors.Busy(f"the server is receiving {self.receiving.in_use} bytes of other streams, its "
                              f"budget of {self.receiving.limit}; waited {wait:.0f} s for room for {nbytes}; "
                              "nothing done, call again")

    @_handled_stream
    async def PushPull(self, request_iterator, context):
        """PushStream whose reply streams each variable's new value back as soon as every
        participant's gradient for it is in (``core.overlap``): the push is read by a task of
        its own, offering each variable as its bytes complete, while this handler's replies
        send the speculated values in the push's order; the last reply is the push's answer
        and whether those values are the round's (``confirmed``)."""
        h = await _header(request_iterator, "PushPull")
        if self.core.settings.elastic:
            raise errors.InvalidArgument("PushPull: elastic sync takes its micro-batches through Push or PushStream")
        if h.shm_name or h.shm_offsets:
            raise codec.CodecError("PushPull: gradients come as data messages, not through shared memory")
        layout = stream.Layout.of(h.gradients)
        metrics = codec.decode_many(h.metrics)
        sparse = codec.sparse_names(h.gradients)
        await self._work(self._check, h, layout, metrics)
        names = [e.name for e in layout.entries]
        if h.overlap_block_bytes and not MIN_BLOCK_BYTES <= h.overlap_block_bytes <= MAX_BLOCK_BYTES:
            raise errors.InvalidArgument(f"PushPull: overlap_block_bytes is {h.overlap_block_bytes}; 0 (the "
                                         f"server's) or {MIN_BLOCK_BYTES} to {MAX_BLOCK_BYTES}; nothing applied")
        spec = await self._work(self.core.overlap, h.worker_id, h.step, h.batch_size,
                                {e.name: (e.dtype, e.shape) for e in layout.entries}, h.set_learning_rates,
                                bool(sparse), h.overlap_block_bytes)
        specs = self.core.store.specs()
        values_header = pb.PullHeader(variables=[
            pb.TensorMeta(name=n, dtype=codec.dtype_code(specs[n][0]), shape=list(specs[n][1])) for n in names])
        loan = await self._lend(layout.nbytes, context)
        reading = asyncio.ensure_future(self._push_pull_read(h, layout, metrics, loan, request_iterator, spec))
        try:
            yield pb.PushPullChunk(header=values_header)
            sent_all = spec is not None
            if spec is not None:
                for name, b in ((n, b) for n in names for b in range(len(spec.layout[n]))):
                    rows = await _speculated(spec, name, b, reading)
                    if rows is None:
                        sent_all = False
                        break
                    for chunk in stream.chunk_buffers([stream.to_wire(rows)[1]], self.chunk_bytes):
                        yield chunk
            result = await reading
            reply = convert.PUSH_REPLY.to_wire(result)
            reply.incarnation = self.core.incarnation
            confirmed = sent_all and spec.confirmed and not (result.dropped or result.replayed)
            yield pb.PushPullChunk(done=reply, confirmed=confirmed)
        finally:
            if not reading.done():
                reading.cancel()

    async def _push_pull_read(self, h, layout, metrics, loan, request_iterator, spec):
        if spec is None:
            received = _received_async(layout, loan.buffer, request_iterator, "PushPull")
        else:
            received = self._received_offering(layout, loan.buffer, request_iterator, spec, h.worker_id)
        try:
            return await self._submit_lent(h, metrics, loan, received)
        finally:
            if spec is not None:
                spec.wake()

    async def _received_offering(self, layout: stream.Layout, buffer: np.ndarray, request_iterator, spec,
                                 worker_id: int) -> dict[str, np.ndarray]:
        """``_received_async``, offering each block of each gradient to the round's speculation as
        soon as its bytes are in (the arrays are views of the buffer the bytes fill)."""
        pending, fulls = [], {}  # (the byte at which a block is complete, name, block, array)
        for e in layout.entries:
            full = fulls[e.name] = np.frombuffer(buffer, e.dtype, count=math.prod(e.shape),
                                                 offset=e.offset).reshape(e.shape)
            row_bytes = math.prod(e.shape[1:]) * e.dtype.itemsize if e.shape else e.nbytes
            for b, rows in enumerate(spec.layout[e.name]):
                end = e.offset + (e.nbytes if rows is None else rows[1] * row_bytes)
                pending.append((end, e.name, b, full))
        pending.reverse()

        async def offer(received: int) -> None:
            arrived = []  # every block a message completed, offered in one hand-off
            while pending and pending[-1][0] <= received:
                _, name, b, full = pending.pop()
                arrived.append((name, b, full))
            if arrived:
                await self._work(self.core.offer, spec, worker_id, arrived)

        await _received_async(layout, buffer, request_iterator, "PushPull", on_bytes=offer)
        return fulls  # the very arrays offered: the round confirms by their identity

    def _push_from_segment(self, h: pb.PushHeader, layout: stream.Layout, metrics: dict, rest):
        """A push whose gradients lie in the worker's segment: checked whole, then applied
        from read-only views of it; its ticket. The core keeps no reference once the ticket
        is settled, and the worker leaves the segment alone until then."""
        if next(rest, None) is not None:
            raise codec.CodecError("PushStream: a push through shared memory (shm_name) carries no data messages")
        segment = self._segment(h.worker_id, "push", h.shm_name, writable=False)
        raw = shm.views(segment, layout.entries, list(h.shm_offsets))
        gradients = self._decoded(stream.widened(layout.entries, raw), h.gradients)
        return self.core.submit(self._push_of(h, gradients, metrics))

    def _decoded(self, gradients: dict[str, np.ndarray], metas) -> dict:
        """A push's decoded gradients as the core takes them (``codec.as_gradients``)."""
        return codec.as_gradients(gradients, metas, self.core.store.specs)

    @_handled
    def Leave(self, request, context):
        self.core.leave(request.worker_id)
        self.segments.drop(request.worker_id)
        log.info("worker %d left", request.worker_id)
        return pb.LeaveResponse()

    @_handled
    def Heartbeat(self, request, context):
        self.core.heartbeat(request.worker_id, request.step, process=request.process)
        return pb.HeartbeatResponse(lease_timeout_s=self.core.members.lease_timeout, incarnation=self.core.incarnation)

    @_handled_async
    async def Work(self, request, context):
        """Elastic sync: this worker's micro-batches; waits (holding no thread) until it has some.
        Async and ssp with a data plan: a task, at once."""
        return await self._work_call(request)

    async def _work_call(self, request) -> pb.Assignment:
        ticket = await self._work(self.core.work, request.worker_id)
        return _assignment(await settled(ticket), self.core.settings.micro_batches)

    @_handled_stream
    async def Session(self, request_iterator, context):
        """A worker's calls on one stream (SessionRequest): each runs as its unary call
        would, concurrently with the others (a push waiting at the barrier holds up no
        pull), and is answered on the stream when done, a refusal as a CallFailure with
        the status, details and reason the unary call would end with. A message that
        does not parse ends the stream (INVALID_ARGUMENT), as it would a unary call; so
        does the stream's end, once every call on it is answered."""
        replies: asyncio.Queue = asyncio.Queue()
        calls: dict[int, asyncio.Task] = {}
        reader = asyncio.ensure_future(self._session_read(request_iterator, calls, replies))
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            await reader  # its error, if it ended on one (_handled_stream: its status)
        finally:
            reader.cancel()
            for task in list(calls.values()):
                task.cancel()

    async def _session_read(self, request_iterator, calls: dict, replies: asyncio.Queue) -> None:
        try:
            async for request in request_iterator:
                _refuse_malformed("Session", request)
                kind = request.WhichOneof("request")
                if kind == "cancel":
                    task = calls.pop(request.call, None)
                    if task is not None:
                        task.cancel()
                elif request.call in calls:
                    busy = errors.InvalidArgument(f"Session: call {request.call} is already running on this stream")
                    replies.put_nowait(pb.SessionReply(call=request.call, failure=_failure("Session", busy)))
                else:
                    task = asyncio.ensure_future(self._session_call(request.call, kind, request, replies))
                    calls[request.call] = task
                    task.add_done_callback(functools.partial(_forget, calls, request.call))
            await asyncio.gather(*calls.values(), return_exceptions=True)
        finally:
            replies.put_nowait(None)

    _SESSION_CALLS = {"pull": ("Pull", "_pull_call"), "push": ("Push", "_push_call"), "work": ("Work", "_work_call")}

    async def _session_call(self, call: int, kind: str | None, request, replies: asyncio.Queue) -> None:
        name, method = self._SESSION_CALLS.get(kind, ("Session", None))
        try:
            if method is None:
                raise codec.CodecError(f"Session: call {call} names no request")
            reply = pb.SessionReply(call=call, **{kind: await getattr(self, method)(getattr(request, kind))})
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reply = pb.SessionReply(call=call, failure=_failure(name, e))
        replies.put_nowait(reply)

    @_handled_async
    async def ClipNorm(self, request, context):
        # Shard 0 of a clip group (core.clip_group): waits, holding no thread, for every
        # shard's squares of the update, at most the caller's timeout.
        ticket = self.core.clip_norm(request.key, request.shard, peers.squares_of(request))
        try:
            wait = request.timeout_s if math.isfinite(request.timeout_s) and request.timeout_s > 0 else 0.0
            scale = await asyncio.wait_for(settled(ticket), min(wait, self.core.settings.barrier_timeout))
        except asyncio.TimeoutError:
            self.core.norm_board.forget(request.key, request.shard)
            raise ClipTimeout(f"global_clipnorm: not every shard brought its norm for {request.key} in time; "
                              "nothing applied") from None
        return pb.ClipNormResponse(scale=float(scale), dtype=np.asarray(scale).dtype.str)

    @_handled_async
    async def CommitRound(self, request, context):
        # A shard that follows shard 0: it completed the round; apply this shard's part (on the
        # pool: with global_clipnorm it waits for shard 0's factor).
        version = await self._work(self.core.commit_round, request.round, request.contributors)
        return pb.CommitRoundResponse(version=version)

    @_handled_async
    async def Broadcast(self, request, context):
        # A non-chief waits, holding no thread, for at most the barrier timeout.
        ticket = await self._work(self.core.submit_broadcast, request.worker_id, request.key, request.value,
                                  request.timeout_s)
        return pb.BroadcastResponse(value=await settled(ticket))

    @_handled_async
    async def Status(self, request, context):
        # Off the pool, where the pushes' and pulls' work queues (a sync round of 1,024 ends in
        # 1,024 pulls' encodes): an operator's call waits behind none of it.
        return await asyncio.get_running_loop().run_in_executor(
            self.control, lambda: status_to_wire(self.core.status(), time.monotonic()))
