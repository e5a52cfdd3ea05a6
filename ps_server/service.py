"""The gRPC face of the parameter server: protobuf in, core calls, protobuf out.

    servicer = ParameterServerServicer(core)
    tfps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, grpc_server)

This is the only module that turns protobuf into core calls, and core errors
into gRPC status codes, through the one table ``STATUS_OF``. Every error leaves
through ``context.abort(code, message)``; an unexpected exception is logged and
becomes ``INTERNAL``, never ``UNKNOWN``.

Same-host fast path (``protos.shm``; off with ``ParameterServerServicer(core,
allow_shm=False)``, ``ps-server --no-shm``): Register answers the worker's probe,
PushStream reads the gradients straight from the worker's segment (zero-copy,
read-only; no reference is kept once the push returns) and PullStream writes
the values into it. Every refusal of that path (disabled, a bad name, a missing
or foreign segment, an offset or size that does not fit) is FAILED_PRECONDITION
"shared memory: ...", raised before anything is applied or written.
"""

from __future__ import annotations

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
from ps_server.core import broadcast, errors
from ps_server.core.membership import WorkerRecord
from ps_server.core.modes import Push
from ps_server.core.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer, Status
from ps_common.names import NONE_AS_ZERO, schedule_from_wire, schedule_to_wire
from ps_common.sparse import SparseRows
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
    errors.StaleRound: grpc.StatusCode.FAILED_PRECONDITION,
    errors.FutureRound: grpc.StatusCode.OUT_OF_RANGE,
    errors.DuplicatePush: grpc.StatusCode.ALREADY_EXISTS,
    errors.BarrierTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.WorkerDead: grpc.StatusCode.ABORTED,
    shm.ShmError: grpc.StatusCode.FAILED_PRECONDITION,  # the worker falls back to the streams
    broadcast.BroadcastConflict: grpc.StatusCode.FAILED_PRECONDITION,
    broadcast.BroadcastTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
}

def status_code_for(exc: Exception) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


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
        if m.name == "PushStream":
            deserialize = _tolerant(pb.PushChunk, stream.deserializer(pb.PushChunk))
            serialize = pb.PushResponse.SerializeToString
            handler = grpc.stream_unary_rpc_method_handler
        elif m.name == "PushPull":
            deserialize = _tolerant(pb.PushChunk, stream.deserializer(pb.PushChunk))
            serialize = stream.serializer(pb.PushPullChunk)
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
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{method.__name__}: the request is not a valid {request.message_type}: {request.error}")
        try:
            return method(self, request, context)
        except (errors.PSError, codec.CodecError, shm.ShmError) as e:
            code = status_code_for(e)
            log.info("%s refused: %s: %s", method.__name__, code.name, e)
            context.abort(code, str(e))
        except Exception as e:  # a bug: say so, but never as UNKNOWN
            log.exception("%s failed unexpectedly", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}: {type(e).__name__}: {e}")

    return wrapper


def _none_as_zero(x):
    return 0 if x is None else x


def _zero_as_none(x):
    return None if x == 0 else x


def _schedule_from_wire(text: str):
    try:
        return schedule_from_wire(text)
    except ValueError as e:
        raise errors.InvalidArgument(str(e)) from None


# By Keras' argument names on both sides; the wire spells None as 0 and a schedule as JSON.
OPTIMIZER = convert.Conversion(
    OptimizerSpec, pb.OptimizerConfig,
    to_wire={"learning_rate_schedule": schedule_to_wire, **{f: _none_as_zero for f in NONE_AS_ZERO}},
    from_wire={"learning_rate_schedule": _schedule_from_wire, **{f: _zero_as_none for f in NONE_AS_ZERO}},
)


def optimizer_to_wire(spec: OptimizerSpec | None) -> pb.OptimizerConfig:
    return pb.OptimizerConfig() if spec is None else OPTIMIZER.to_wire(spec)


def optimizer_from_wire(msg: pb.OptimizerConfig) -> OptimizerSpec:
    return OPTIMIZER.from_wire(msg)


# The server's status as it travels: the core's records field by field (protos.convert).
WORKER_STATUS = convert.Conversion(
    WorkerRecord, pb.WorkerStatus,
    rename={"name": "worker_name", "last_seen": "last_seen_age_s"},  # the age is taken at the call (Status)
    local={"registered_at", "dead_since", "last_push_done"},  # the server's own clock readings
)
STATUS = convert.Conversion(
    Status, pb.StatusResponse,
    rename={"lease_timeout": "lease_timeout_s"},
    to_wire={"mode": wire.mode_to_wire, "optimizer": optimizer_to_wire},
)
CONVERSIONS = (*convert.CONVERSIONS, OPTIMIZER, WORKER_STATUS, STATUS)


def status_to_wire(s: Status, now: float) -> pb.StatusResponse:
    """``s`` as a StatusResponse; worker ages are seconds from their last call to ``now``."""
    age = lambda last_seen: now - last_seen  # noqa: E731
    return STATUS.to_wire(s, workers=lambda records: [WORKER_STATUS.to_wire(w, last_seen=age) for w in records])


def _push_header(request_iterator, method: str) -> pb.PushHeader:
    """The header a push stream must start with (a PushChunk with a header and no data)."""
    first = next(request_iterator, None)
    if isinstance(first, Malformed):
        raise codec.CodecError(f"the stream's first message is not a valid {first.message_type}: {first.error}")
    if not isinstance(first, pb.PushChunk) or not first.HasField("header") or first.data:
        raise codec.CodecError(f"{method}: the first message must carry the header, and no data")
    return first.header


def _data(chunk, method: str) -> memoryview:
    """A push stream's message after its header: data, or an error naming what came instead."""
    if not isinstance(chunk, memoryview):
        what = f"not a valid {chunk.message_type}: {chunk.error}" if isinstance(chunk, Malformed) else "a second header"
        raise codec.CodecError(f"{method}: after the header, every message must be data; got {what}")
    return chunk


def _sparse_names(metas) -> list[str]:
    """The names of the sparse gradients among ``metas`` (Tensor or TensorMeta);
    rows on a dense one are an error."""
    for m in metas:
        if m.rows and not m.sparse:
            raise codec.CodecError(f"tensor {m.name!r}: rows given but sparse is not set")
    return [m.name for m in metas if m.sparse]


def _sparse(gradients: dict[str, np.ndarray], metas) -> dict:
    """Sparse gradients (``Tensor.sparse``) as ``SparseRows`` of their rows, for the core to
    check and make dense; the others as they are."""
    names = _sparse_names(metas)
    if not names:
        return gradients
    rows = {m.name: np.asarray(m.rows, dtype=np.int64) for m in metas if m.sparse}
    return {n: SparseRows(rows[n], g) if n in rows else g for n, g in gradients.items()}


class ParameterServerServicer(pb_grpc.ParameterServerServicer):
    def __init__(self, core: ParameterServer, chunk_bytes: int | None = None, allow_shm: bool = True):
        self.core = core
        self.chunk_bytes = chunk_bytes or stream.CHUNK_BYTES
        self.buffers = BufferPool(keep=max(4, 2 * core.num_workers))
        self.allow_shm = allow_shm
        self.segments = shm.SegmentCache()  # the workers' shared-memory segments, mapped

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
        reg = self.core.register(request.worker_index, request.num_workers, request.worker_name or context.peer())
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
        variables = codec.decode_many(request.variables)
        created, version = self.core.initialize(request.worker_id, variables, optimizer_from_wire(request.optimizer),
                                                non_trainable=list(request.non_trainable))
        if created:
            log.info(
                "initialized %d variables (%d parameters) by worker %d, optimizer %s",
                len(variables), sum(v.size for v in variables.values()), request.worker_id,
                self.core.store.optimizer_spec.as_dict(),
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

    @_handled
    def Pull(self, request, context):
        version, values, rows = self._pull(request)
        tensors = codec.encode_many(values)
        for t in tensors:
            if t.name in rows:
                t.sparse = True
                t.rows.extend(rows[t.name].tolist())
        return pb.PullResponse(version=version, variables=tensors, incarnation=self.core.incarnation)

    @_handled
    def PullStream(self, request, context):
        # Everything that can fail happens here, before the first message.
        version, values, rows = self._pull(request)
        wire = {name: stream.to_wire(a) for name, a in values.items()}
        header = pb.PullHeader(version=version, incarnation=self.core.incarnation, variables=stream.metas(wire))
        for meta in header.variables:
            if meta.name in rows:
                meta.sparse = True
                meta.rows.extend(rows[meta.name].tolist())
        arrays = {name: a for name, (_, a) in wire.items()}
        if request.shm_name:
            segment = self._segment(request.worker_id, "pull", request.shm_name, writable=True)
            offsets, needed = shm.aligned_offsets(a.nbytes for a in arrays.values())
            if needed <= segment.size:
                shm.write(segment, arrays, offsets)
                header.shm = True
                header.shm_offsets.extend(offsets)
                return iter([pb.PullChunk(header=header)])
            header.shm_bytes_needed = needed  # too small: streamed this time
        return self._pull_chunks(header, list(arrays.values()))

    def _pull_chunks(self, header: pb.PullHeader, arrays: list[np.ndarray]):
        yield pb.PullChunk(header=header)
        yield from stream.chunk_buffers(arrays, self.chunk_bytes)

    @_handled
    def Push(self, request, context):
        gradients = _sparse(self._widen_half(codec.decode_many(request.gradients)), request.gradients)
        result = self.core.push(
            Push(
                worker_id=request.worker_id,
                step=request.step,
                base_version=request.base_version,
                batch_size=request.batch_size,
                gradients=gradients,
                loss=request.loss,
                metrics=codec.decode_many(request.metrics),
                set_learning_rate=request.set_learning_rate,
            )
        )
        reply = convert.PUSH_REPLY.to_wire(result)
        if request.return_values and self._values_stay_current() and not (result.dropped or result.replayed):
            version, values = self.core.pull(request.worker_id)
            if version == result.version:
                reply.variables.extend(codec.encode_many(values))
                reply.incarnation = self.core.incarnation
        return reply

    def _values_stay_current(self) -> bool:
        """Sync without backup workers: no round completes without every active worker,
        so the values after a worker's round are current until it pushes again."""
        core = self.core
        return core.mode_name == "sync" and core.replicas_to_aggregate in (0, core.num_workers)

    @_handled
    def PushStream(self, request_iterator, context):
        h = _push_header(request_iterator, "PushStream")
        layout = stream.Layout.of(h.gradients)
        if h.shm_offsets and not h.shm_name:
            raise codec.CodecError("PushStream: shm_offsets without shm_name")
        metrics = codec.decode_many(h.metrics)  # small: whole in the header
        self.core.check_push(h.worker_id, h.step, h.base_version, h.batch_size, self._widened(layout),
                             sparse=_sparse_names(h.gradients), metrics=metrics,
                             set_learning_rate=h.set_learning_rate)
        if h.shm_name:
            return self._push_from_segment(h, layout, metrics, request_iterator)
        buffer = self.buffers.acquire(layout.nbytes)
        try:
            assembler = stream.Assembler(layout, buffer)
            for chunk in request_iterator:
                assembler.feed(_data(chunk, "PushStream"))
            gradients = _sparse(self._widen_half(assembler.arrays()), h.gradients)
            result = self.core.push(Push(worker_id=h.worker_id, step=h.step, base_version=h.base_version,
                                         batch_size=h.batch_size, gradients=gradients, loss=h.loss,
                                         metrics=metrics, set_learning_rate=h.set_learning_rate))
        finally:  # the core keeps no reference to the gradients once push returns
            self.buffers.release(buffer)
        return convert.PUSH_REPLY.to_wire(result)

    @_handled
    def PushPull(self, request_iterator, context):
        """PushStream whose reply streams each variable's new value back as soon as every
        participant's gradient for it is in (``core.overlap``): the push is read on a
        thread of its own, offering each variable as its bytes complete, while this
        handler's replies send the speculated values in the push's order; the last reply
        is the push's answer and whether those values are the round's (``confirmed``)."""
        h = _push_header(request_iterator, "PushPull")
        if h.shm_name or h.shm_offsets:
            raise codec.CodecError("PushPull: gradients come as data messages, not through shared memory")
        layout = stream.Layout.of(h.gradients)
        metrics = codec.decode_many(h.metrics)
        sparse = _sparse_names(h.gradients)
        self.core.check_push(h.worker_id, h.step, h.base_version, h.batch_size, self._widened(layout),
                             sparse=sparse, metrics=metrics, set_learning_rate=h.set_learning_rate)
        names = [e.name for e in layout.entries]
        spec = self.core.overlap(h.worker_id, h.step, h.batch_size, {e.name: (e.dtype, e.shape) for e in layout.entries},
                                 h.set_learning_rate, bool(sparse))
        specs = self.core.store.specs()
        values_header = pb.PullHeader(variables=[
            pb.TensorMeta(name=n, dtype=codec.dtype_code(specs[n][0]), shape=list(specs[n][1])) for n in names])
        done, outcome = threading.Event(), {}
        buffer = self.buffers.acquire(layout.nbytes)

        def read() -> None:
            try:
                assembler = stream.Assembler(layout, buffer)
                # Each block of each gradient, with the byte at which it is complete; offered to
                # the round as soon as it is (the arrays are views of the buffer the bytes fill).
                pending, fulls = [], {}
                if spec is not None:
                    for e in layout.entries:
                        full = fulls[e.name] = np.frombuffer(buffer, e.dtype, count=math.prod(e.shape),
                                                             offset=e.offset).reshape(e.shape)
                        row_bytes = math.prod(e.shape[1:]) * e.dtype.itemsize if e.shape else e.nbytes
                        for b, rows in enumerate(spec.layout[e.name]):
                            end = e.offset + (e.nbytes if rows is None else rows[1] * row_bytes)
                            pending.append((end, e.name, b, full))
                    pending.reverse()
                for chunk in request_iterator:
                    assembler.feed(_data(chunk, "PushPull"))
                    while pending and pending[-1][0] <= assembler.received:
                        _, name, b, full = pending.pop()
                        self.core.offer(spec, h.worker_id, name, b, full)
                arrays = assembler.arrays()  # every byte the header announced arrived
                if spec is not None:  # the very arrays offered: the round confirms by their identity
                    arrays = fulls
                gradients = _sparse(self._widen_half(arrays), h.gradients)
                outcome["result"] = self.core.push(Push(
                    worker_id=h.worker_id, step=h.step, base_version=h.base_version, batch_size=h.batch_size,
                    gradients=gradients, loss=h.loss, metrics=metrics, set_learning_rate=h.set_learning_rate))
            except BaseException as e:  # answered by the replies below
                outcome["error"] = e
            finally:  # the core keeps no reference to the gradients once push returns
                self.buffers.release(buffer)
                done.set()
                if spec is not None:
                    spec.wake()

        threading.Thread(target=read, name=f"push-pull-{h.worker_id}", daemon=True).start()
        return self._push_pull_replies(values_header, names, spec, done, outcome, context)

    def _push_pull_replies(self, values_header, names, spec, done, outcome, context):
        sent_all = spec is not None
        try:
            yield pb.PushPullChunk(header=values_header)
            if spec is not None:
                for name, b in ((n, b) for n in names for b in range(len(spec.layout[n]))):
                    rows = spec.wait(name, b, done)
                    if rows is None:
                        sent_all = False
                        break
                    yield from stream.chunk_buffers([stream.to_wire(rows)[1]], self.chunk_bytes)
            done.wait()
            error = outcome.get("error")
            if error is not None:
                raise error
            result = outcome["result"]
            reply = convert.PUSH_REPLY.to_wire(result)
            reply.incarnation = self.core.incarnation
            confirmed = sent_all and spec.confirmed and not (result.dropped or result.replayed)
            yield pb.PushPullChunk(done=reply, confirmed=confirmed)
        except (errors.PSError, codec.CodecError) as e:
            code = status_code_for(e)
            log.info("PushPull refused: %s: %s", code.name, e)
            context.abort(code, str(e))
        except grpc.RpcError:
            raise
        except Exception as e:  # a bug: say so, but never as UNKNOWN
            log.exception("PushPull failed unexpectedly")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in PushPull: {type(e).__name__}: {e}")

    def _push_from_segment(self, h: pb.PushHeader, layout: stream.Layout, metrics: dict,
                           rest) -> pb.PushResponse:
        """A push whose gradients lie in the worker's segment: checked whole, then applied
        from read-only views of it. The core keeps no reference once push returns, and the
        worker leaves the segment alone until then."""
        if next(rest, None) is not None:
            raise codec.CodecError("PushStream: a push through shared memory (shm_name) carries no data messages")
        segment = self._segment(h.worker_id, "push", h.shm_name, writable=False)
        raw = shm.views(segment, layout.entries, list(h.shm_offsets))
        gradients = _sparse(self._widen_half(stream.widened(layout.entries, raw)), h.gradients)
        result = self.core.push(Push(worker_id=h.worker_id, step=h.step, base_version=h.base_version,
                                     batch_size=h.batch_size, gradients=gradients, loss=h.loss,
                                     metrics=metrics, set_learning_rate=h.set_learning_rate))
        return convert.PUSH_REPLY.to_wire(result)

    def _widen_half(self, gradients: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """float16 gradients of float32 variables widened (bfloat16 ones already are, by the
        decoders); every other gradient as it came, for the store to check."""
        if not any(g.dtype == np.float16 for g in gradients.values()):
            return gradients
        specs = self.core.store.specs()
        return {name: g.astype(np.float32) if g.dtype == np.float16 and name in specs
                and specs[name][0] == np.float32 else g for name, g in gradients.items()}

    def _widened(self, layout: stream.Layout) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """name -> (dtype, shape) as the store will see it once widened: bfloat16 always
        arrives as float32 (the decoders), float16 for a float32 variable (``_widen_half``)."""
        specs = self.core.store.specs()
        widened = lambda e: e.bfloat16 or (e.code == pb.FLOAT16 and e.name in specs  # noqa: E731
                                           and specs[e.name][0] == np.float32)
        return {e.name: (np.dtype(np.float32) if widened(e) else e.dtype, e.shape) for e in layout.entries}

    @_handled
    def Leave(self, request, context):
        self.core.leave(request.worker_id)
        self.segments.drop(request.worker_id)
        log.info("worker %d left", request.worker_id)
        return pb.LeaveResponse()

    @_handled
    def Heartbeat(self, request, context):
        self.core.heartbeat(request.worker_id, request.step)
        return pb.HeartbeatResponse(lease_timeout_s=self.core.members.lease_timeout, incarnation=self.core.incarnation)

    @_handled
    def Broadcast(self, request, context):
        # Blocks a non-chief for at most the barrier timeout; the thread pool is sized
        # for every worker to wait at once (as at the barrier).
        value = self.core.broadcast(request.worker_id, request.key, request.value, request.timeout_s)
        return pb.BroadcastResponse(value=value)

    @_handled
    def Status(self, request, context):
        return status_to_wire(self.core.status(), time.monotonic())
