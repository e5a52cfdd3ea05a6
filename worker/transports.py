"""The ways a PSClient moves a pull or a push, behind one interface.

    unary = Unary(channel, address, timeout)              # one message each way
    calls = CallStream(channel, address, timeout)         # one message each way, on one long-lived stream
    streams = Streams(channel, address, timeout)          # ~2 MiB chunks (protos.stream)
    shared = SharedMemory(streams, address, enabled=True) # same-host segments (protos.shm)
    header, values = transport.pull(request)              # each: (PullHeader, {name: array})
    reply = transport.push(outgoing, timeout)             # each: PushResponse

``worker.client.PSClient`` picks one per call and keeps the pull cache (``PullCache``)
above them; docs/speed.md says when each is used. Failures leave as ``PSClientError``.
``SharedMemory`` returns None when it does not serve a call (then the caller streams);
a refusal changes nothing on the server, so repeating the call over the stream is safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from concurrent import futures
from typing import Mapping

import grpc
import numpy as np

from protos import codec, shm as shmem, stream, wire
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from ps_common.reasons import REASON_KEY, Reason

log = logging.getLogger("worker.client")

# Codes a server answers only once its handler has finished with a call: after
# any other failure (a deadline, a dropped connection) the server may still be
# reading or writing the call's segment, so the client takes a new one.
HANDLER_DONE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}


class PSClientError(RuntimeError):
    """A call that failed: its status ``code`` (None: the reply itself was wrong), the
    server's ``reason`` (``ps_common.reasons``: what a worker decides on) and the
    ``details``, for people."""

    def __init__(self, call: str, address: str, code: grpc.StatusCode | None, details: str,
                 reason: Reason = Reason.UNSPECIFIED):
        self.call, self.address, self.code, self.details, self.reason = call, address, code, details, reason
        code_name = code.name if code is not None else "ERROR"
        why = f" ({reason.value})" if reason is not Reason.UNSPECIFIED else ""
        super().__init__(f"{call} to {address} failed: {code_name}{why}: {details}")

    @classmethod
    def of(cls, call: str, address: str, e: grpc.RpcError) -> "PSClientError":
        """The error a failed gRPC call ``e`` is, with the reason its trailing metadata names."""
        sent = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
        return cls(call, address, e.code(), e.details() or "", Reason.of_wire(sent.get(REASON_KEY)))


@contextlib.contextmanager
def failures(call: str, address: str):
    """A failed gRPC call, or a reply that does not decode, as the ``PSClientError`` of ``call``."""
    try:
        yield
    except grpc.RpcError as e:
        raise PSClientError.of(call, address, e) from None
    except (codec.CodecError, StopIteration) as e:
        raise PSClientError(call, address, None, f"malformed reply: {e or 'empty stream'}") from None


@dataclasses.dataclass
class OutgoingPush:
    """One push, its gradients already in wire form; each transport makes its messages from it."""

    worker_id: int
    step: int
    base_version: int
    batch_size: int
    loss: float
    arrays: dict[str, tuple[int, np.ndarray]]  # name -> (wire dtype code, C-contiguous little-endian array)
    rows: Mapping[str, np.ndarray]  # sparse gradients: name -> the rows its array holds
    return_values: bool = False  # unary only: the sync shortcut (PullCache.receive)
    # Small tensors the sync server sums over the round (PushRequest.metrics), already
    # encoded: every transport sends them whole, in the request or the stream's header.
    metrics: list[pb.Tensor] = dataclasses.field(default_factory=list)
    set_learning_rates: list[float] = dataclasses.field(default_factory=list)  # PushRequest's: groups' new rates
    micro_batch: int = -1  # elastic sync: the micro-batch of the round this gradient is of
    task: int = -1  # async and ssp with a data plan: the task this gradient trains on

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.arrays.values()) + sum(r.nbytes for r in self.rows.values())

    def request(self) -> pb.PushRequest:
        return pb.PushRequest(
            **self._fields(), return_values=self.return_values,
            gradients=[pb.Tensor(name=n, dtype=code, shape=a.shape, data=a.tobytes(), sparse=n in self.rows,
                                 rows=self.rows[n].tolist() if n in self.rows else ())
                       for n, (code, a) in self.arrays.items()])

    def header(self) -> pb.PushHeader:
        return pb.PushHeader(**self._fields(), gradients=stream.metas(self.arrays, self.rows))

    def buffers(self) -> list[np.ndarray]:
        return [a for _, a in self.arrays.values()]

    def _fields(self) -> dict:
        """The fields a PushRequest and a PushHeader share; a server-dealt push's micro-batch or task if set."""
        dealt = {name: value for name, value in (("micro_batch", self.micro_batch), ("task", self.task)) if value >= 0}
        return dict(worker_id=self.worker_id, step=self.step, base_version=self.base_version,
                    batch_size=self.batch_size, loss=self.loss, metrics=self.metrics,
                    set_learning_rates=self.set_learning_rates, **dealt)


class Unary:
    """One message each way, by ``call``: control calls, and pushes and pulls up to PSClient's ``small_bytes``."""

    def __init__(self, channel: grpc.Channel, address: str, timeout: float):
        self.address, self.timeout = address, timeout
        self._stub = pb_grpc.ParameterServerStub(channel)

    def call(self, name: str, request, timeout: float | None = None, wait_for_ready: bool = False):
        with failures(name, self.address):
            return getattr(self._stub, name)(
                request, timeout=self.timeout if timeout is None else timeout, wait_for_ready=wait_for_ready)

    def pull(self, request: pb.PullRequest) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        """The reply as a streamed one's: (header, values), a row delta's rows in the header."""
        reply = self.call("Pull", request)
        with failures("Pull", self.address):
            values = codec.decode_many(reply.variables)
        header = pb.PullHeader(version=reply.version, incarnation=reply.incarnation)
        header.variables.extend(pb.TensorMeta(name=t.name, dtype=t.dtype, shape=t.shape, sparse=True, rows=t.rows)
                                for t in reply.variables if t.sparse)  # row deltas (PullRequest.row_deltas)
        return header, values

    def push(self, outgoing: OutgoingPush, timeout: float) -> pb.PushResponse:
        return self.call("Push", outgoing.request(), timeout=timeout)


# A CallFailure's code number -> its gRPC status code.
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# The calls a CallStream repeats on a new stream when the old one broke (UNAVAILABLE), as the
# channel's retry policy repeats them as unary calls (worker.client.SERVICE_CONFIG).
SESSION_RETRIES = {"Pull": 4}
_END = object()  # ends a CallStream's request iterator


class CallStream:
    """One long-lived bidirectional stream (rpc Session) that carries this client's Pull,
    Push and Work calls, each a SessionRequest answered by the SessionReply of its id
    (docs/speed.md). Same interface and errors as ``Unary``; a broken stream fails every
    call in flight with its status (a Pull is repeated on a new one), and a call past its
    deadline is DEADLINE_EXCEEDED and cancelled on the server."""

    pull, push = Unary.pull, Unary.push  # Unary's, through this stream's call

    def __init__(self, channel: grpc.Channel, address: str, timeout: float):
        self.address, self.timeout = address, timeout
        self._method = channel.stream_stream(
            f"/{wire.SERVICE_NAME}/Session", request_serializer=pb.SessionRequest.SerializeToString,
            response_deserializer=pb.SessionReply.FromString)
        self._lock = threading.Lock()  # guards the fields below; leaf lock
        self._requests: queue.SimpleQueue | None = None  # the open stream's outgoing messages
        self._replies = None  # the open stream's call object
        self._waiting: dict[int, tuple[queue.SimpleQueue, "futures.Future", str]] = {}  # id: (stream, answer, name)
        self._next = 0

    def call(self, name: str, request, timeout: float | None = None):
        kind = name.lower()
        for attempt in range(SESSION_RETRIES.get(name, 0) + 1):
            try:
                reply = self._call_once(name, kind, request, self.timeout if timeout is None else timeout)
                break
            except PSClientError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE or attempt == SESSION_RETRIES.get(name, 0):
                    raise
                time.sleep(min(2.0, 0.1 * 2 ** attempt))
        if reply.HasField("failure"):
            f = reply.failure
            raise PSClientError(name, self.address, STATUS_CODES.get(f.code, grpc.StatusCode.UNKNOWN), f.details,
                                Reason.of_wire(f.reason))
        return getattr(reply, kind)

    def _call_once(self, name: str, kind: str, request, timeout: float) -> pb.SessionReply:
        answer: futures.Future = futures.Future()
        with self._lock:
            requests = self._open()
            self._next += 1
            call = self._next
            self._waiting[call] = (requests, answer, name)
            requests.put(pb.SessionRequest(call=call, **{kind: request}))
        try:
            return answer.result(timeout)
        except futures.TimeoutError:
            with self._lock:
                if self._waiting.pop(call, None) is not None:
                    requests.put(pb.SessionRequest(call=call, cancel=True))
            raise PSClientError(name, self.address, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    def _open(self) -> queue.SimpleQueue:
        """The open stream's request queue (a new stream when none is open); under the lock."""
        if self._requests is None:
            requests: queue.SimpleQueue = queue.SimpleQueue()
            replies = self._method(iter(requests.get, _END), wait_for_ready=False)
            self._requests, self._replies = requests, replies
            threading.Thread(target=self._read, args=(requests, replies), name="tfps-session", daemon=True).start()
        return self._requests

    def _read(self, requests: queue.SimpleQueue, replies) -> None:
        """Hand each reply to its call; when the stream ends, fail the calls still waiting on it with
        its status, or UNAVAILABLE (as a connection lost) when the server ended it: it answers every
        call before it ends one."""
        error: grpc.RpcError | None = None
        try:
            for reply in replies:
                with self._lock:
                    waiting = self._waiting.pop(reply.call, None)
                if waiting is not None:
                    waiting[1].set_result(reply)
        except grpc.RpcError as e:
            error = e
        with self._lock:
            if self._requests is requests:
                self._requests = self._replies = None
            ended = [call for call, (q, _, _) in self._waiting.items() if q is requests]
            failed = [self._waiting.pop(call)[1:] for call in ended]
        requests.put(_END)
        for answer, name in failed:
            answer.set_exception(PSClientError.of(name, self.address, error) if error is not None else PSClientError(
                name, self.address, grpc.StatusCode.UNAVAILABLE, "the session stream ended with this call unanswered"))

    def close(self) -> None:
        with self._lock:
            requests, replies, self._requests, self._replies = self._requests, self._replies, None, None
        if requests is not None:
            requests.put(_END)
            replies.cancel()


# PushPull's data messages: about half a speculation block (ps_server.core.overlap), so
# that each block is usable soon after its bytes arrive.
PUSH_PULL_CHUNK_BYTES = 256 << 10


def _chunked(chunk_type, header, buffers: list[np.ndarray], chunk_bytes: int | None = None):
    """A streamed call's messages: ``chunk_type(header=header)``, then the buffers' bytes."""
    yield chunk_type(header=header)
    yield from stream.chunk_buffers(buffers, chunk_bytes)


class Streams:
    """PullStream, PushStream and InitializeStream: a header, then the tensors' bytes in
    ~2 MiB data messages framed by hand (``protos.stream``), so no message ever holds a
    whole model."""

    def __init__(self, channel: grpc.Channel, address: str, timeout: float):
        self.address, self.timeout = address, timeout
        path = f"/{wire.SERVICE_NAME}/"
        self.pull_stream = channel.unary_stream(path + "PullStream", pb.PullRequest.SerializeToString,
                                                stream.deserializer(pb.PullChunk))
        self.push_stream = channel.stream_unary(path + "PushStream", stream.serializer(pb.PushChunk),
                                                pb.PushResponse.FromString)
        self.push_pull_stream = channel.stream_stream(path + "PushPull", stream.serializer(pb.PushChunk),
                                                      stream.deserializer(pb.PushPullChunk))
        self.initialize_stream = channel.stream_unary(path + "InitializeStream", stream.serializer(pb.InitializeChunk),
                                                      pb.InitializeResponse.FromString)

    def initialize(self, header: pb.InitializeHeader, arrays: list[np.ndarray]) -> pb.InitializeResponse:
        """One InitializeStream: ``header``, then the bytes of ``arrays`` (its variables in
        wire form, in its order). Not retried: a stream cannot be replayed by the channel."""
        with failures("Initialize", self.address):
            return self.initialize_stream(_chunked(pb.InitializeChunk, header, arrays), timeout=self.timeout)

    def pull(self, request: pb.PullRequest,
             read_segment=None) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        """One PullStream. ``read_segment(header, layout, rest)`` (SharedMemory's) reads
        the values of a reply whose header says they lie in the caller's segment; without
        it such a reply is an error."""
        with failures("Pull", self.address):
            replies = self.pull_stream(request, timeout=self.timeout, wait_for_ready=False)
            first = next(replies)
            if not isinstance(first, pb.PullChunk) or not first.HasField("header"):
                raise PSClientError("PullStream", self.address, None, "the reply did not start with a header")
            header = first.header
            layout = stream.Layout.of(header.variables)
            if header.shm:
                if read_segment is None:
                    raise PSClientError("PullStream", self.address, None, "a shared-memory reply to a streamed pull")
                return header, read_segment(header, layout, replies)
            assembler = stream.Assembler(layout)
            for chunk in replies:
                if not isinstance(chunk, memoryview):
                    raise PSClientError("PullStream", self.address, None, "a second header in the reply")
                assembler.feed(chunk)
            return header, assembler.arrays()

    def push(self, outgoing: OutgoingPush, timeout: float, header: pb.PushHeader | None = None) -> pb.PushResponse:
        """One PushStream: ``header`` (default: the push's own), then the gradients' bytes
        unless the header names a segment that holds them."""
        header = outgoing.header() if header is None else header
        messages = _chunked(pb.PushChunk, header, [] if header.shm_name else outgoing.buffers())
        with failures("Push", self.address):
            return self.push_stream(messages, timeout=timeout)

    def push_pull(self, outgoing: OutgoingPush, timeout: float,
                  block_bytes: int = 0) -> tuple[pb.PushResponse, dict | None]:
        """One PushPull (sync): the gradients go out while the round's new values come back,
        each variable's as soon as the server has it (``ps_server.core.overlap``), in blocks of
        ``block_bytes`` (0: the server's). Returns the push's answer and the new values of the
        pushed variables when the server confirms they are the round's, else None (pull them)."""
        header = outgoing.header()
        header.overlap_block_bytes = block_bytes
        # Smaller chunks than a PushStream's: the server can use a block only once the
        # message holding its last byte has arrived whole.
        messages = _chunked(pb.PushChunk, header, outgoing.buffers(), block_bytes or PUSH_PULL_CHUNK_BYTES)
        with failures("Push", self.address):
            replies = self.push_pull_stream(messages, timeout=timeout)
            first = next(replies)
            if not isinstance(first, pb.PushPullChunk) or not first.HasField("header"):
                raise PSClientError("PushPull", self.address, None, "the reply did not start with a header")
            assembler = stream.Assembler(stream.Layout.of(first.header.variables))
            for message in replies:
                if isinstance(message, memoryview):
                    assembler.feed(message)
                elif message.HasField("done"):
                    complete = message.confirmed and assembler.received == assembler.layout.nbytes
                    return message.done, (assembler.arrays() if complete else None)
                else:
                    raise PSClientError("PushPull", self.address, None, "a second header in the reply")
            raise PSClientError("PushPull", self.address, None, "the reply ended without the push's answer")


class _ShmRefused(Exception):
    """The fast path cannot serve this call; nothing was applied: repeat it over the stream."""


class _Slot:
    """One of the client's segments (push or pull), lent to one call at a time (``lock``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.segment: shmem.Segment | None = None
        self.want = 0  # bytes the next call will likely need (the server said, or the model's size)

    def ensure(self, nbytes: int) -> shmem.Segment:
        """A segment of at least ``nbytes`` (and ``want``): this one, or a new one. Sizes are
        fixed for a segment's life, so growing means a new name. _ShmRefused if it cannot be made."""
        size = max(nbytes, self.want)
        if self.segment is None or self.segment.size < size:
            try:
                new = shmem.Segment.create(size)
            except OSError as e:
                raise _ShmRefused(f"cannot create a segment of {size} bytes in {shmem.DIRECTORY}: {e}") from None
            self.close()
            self.segment = new
        return self.segment

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class SharedMemory:
    """The same-host fast path: two segments of this client's in ``/dev/shm``
    (``protos.shm``: ``tfps-<pid>-<random>``, mode 0600), one for pushes, one for pulls.

    ``register`` probes it: the client writes a random token into the push segment and
    names both; the server must read the token back and write a nonce into the pull one.
    Only then is it ``active``: pushes put the gradients into the push segment and pulls
    have the server write the values into the pull segment, with gRPC carrying the headers
    alone. A failed probe, a segment that cannot be made, or a "shared memory:" refusal of a
    call turns it off for good with one log line (``fallback_reason``); a refused call is
    repeated over the stream. The values a pull returns are copies, valid after the next
    pull. A segment lives until ``close()`` (or interpreter exit) unlinks it, or until a
    call fails in a way that leaves the server possibly still using it (a deadline, a
    dropped connection): then it is dropped and the next call makes a new one. A SIGKILLed
    worker leaves its segments behind (``ls /dev/shm/tfps-*``; the pid says whose).
    """

    def __init__(self, streams: Streams, address: str, enabled: bool):
        self.streams, self.address, self.enabled = streams, address, enabled
        self.active = False
        self.fallback_reason: str | None = None  # why it went off for good; None: it did not
        self._lock = threading.Lock()  # guards fallback_reason; leaf lock
        self.push_slot, self.pull_slot = _Slot(), _Slot()

    def fall_back(self, reason: str) -> None:
        """Stream from now on; say why once."""
        self.active = False
        with self._lock:
            first, self.fallback_reason = self.fallback_reason is None, self.fallback_reason or reason
        if first:
            log.warning("same-host shared memory off for %s, streaming over gRPC from now on: %s",
                        self.address, reason)

    def release_segments(self) -> None:
        """Close the segments no call is using (the others: at close() or exit)."""
        for slot in (self.push_slot, self.pull_slot):
            if slot.lock.acquire(blocking=False):
                try:
                    slot.close()
                finally:
                    slot.lock.release()

    def close(self) -> None:
        for slot in (self.push_slot, self.pull_slot):
            slot.close()

    # -- the probe, at register ----------------------------------------------------
    def register(self, request: pb.RegisterRequest, call) -> pb.RegisterResponse:
        """``call(request)``'s reply (Register), with the probe when one is due: on, not off for
        good, and no call using a slot. Every register probes again: a restarted server may run
        elsewhere."""
        self.active = False
        due = self.enabled and self.fallback_reason is None
        held = [slot for slot in (self.push_slot, self.pull_slot) if due and slot.lock.acquire(blocking=False)]
        try:
            token = self._probe_request(request) if len(held) == 2 else None
            reply = call(request)
            if token is not None:
                self._probe_answer(reply, token)
        finally:
            for slot in held:
                slot.lock.release()
        if self.fallback_reason is not None:
            self.release_segments()
        return reply

    def _probe_request(self, request: pb.RegisterRequest) -> bytes | None:
        """Name both segments in ``request`` with a fresh token in the push one; the token,
        or None when the segments cannot be made (then the client streams for good)."""
        try:
            push, pull = self.push_slot.ensure(shmem.TOKEN_BYTES), self.pull_slot.ensure(shmem.TOKEN_BYTES)
        except _ShmRefused as e:
            self.fall_back(str(e))
            return None
        token = shmem.new_token()
        push.array[:shmem.TOKEN_BYTES] = np.frombuffer(token, np.uint8)
        pull.array[:shmem.TOKEN_BYTES] = 0
        request.shm_push_name, request.shm_pull_name = push.name, pull.name
        return token

    def _probe_answer(self, reply: pb.RegisterResponse, token: bytes) -> None:
        nonce = self.pull_slot.segment.array[:shmem.TOKEN_BYTES].tobytes()
        if reply.shm_error:
            self.fall_back(f"the server refused the probe: {reply.shm_error}")
        elif reply.shm_token != token or reply.shm_nonce != nonce or len(nonce) != shmem.TOKEN_BYTES:
            self.fall_back("the server does not see this client's segments (another host, another /dev/shm, "
                           "or a server without the fast path)")
        else:
            self.active = True

    # -- pulls and pushes -------------------------------------------------------------
    def expect_pull(self, values: Mapping[str, np.ndarray]) -> None:
        """The next pull will likely need room for ``values``."""
        self.pull_slot.want = max(self.pull_slot.want, shmem.needed_bytes(a.nbytes for a in values.values()))

    def pull(self, request: pb.PullRequest) -> tuple[pb.PullHeader, dict[str, np.ndarray]] | None:
        """A PullStream that has the server write the values into the pull segment; None
        when shared memory does not serve it (then the caller streams)."""
        answer = self._serve(self.pull_slot, request.worker_id, lambda slot: self._pull_once(request, slot))
        if answer is None:
            request.ClearField("shm_name")
        return answer

    def _serve(self, slot: _Slot, worker_id: int, once):
        """``once(slot)`` with the slot locked for it; None when shared memory does not serve the
        call: off, the slot busy with another call of this client (a push waiting at a barrier:
        not waited for), or refused (nothing was applied: the caller streams it)."""
        if not self.active or worker_id < 0 or not slot.lock.acquire(blocking=False):
            return None
        try:
            return once(slot)
        except _ShmRefused as e:
            self.fall_back(str(e))
            return None
        except PSClientError as e:
            if e.reason is Reason.SHM_REFUSED:
                self.fall_back(e.details)
                return None
            if e.code is not None and e.code not in HANDLER_DONE:
                slot.close()  # the server may still be using it (a push waiting at the barrier)
            raise
        finally:
            slot.lock.release()
            if not self.active:
                self.release_segments()

    def _pull_once(self, request: pb.PullRequest, slot: _Slot) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        segment = slot.ensure(shmem.MIN_BYTES)
        request.shm_name = segment.name

        def read(header: pb.PullHeader, layout: stream.Layout, rest) -> dict[str, np.ndarray]:
            """Copies of the values the server wrote into the segment (``shm.views`` checks every offset first)."""
            try:
                views = shmem.views(segment, layout.entries, list(header.shm_offsets))
            except shmem.ShmError as e:
                raise _ShmRefused(f"the reply's {e}") from None
            if next(rest, None) is not None:
                raise _ShmRefused("a shared-memory reply went on with data messages")
            return {name: v.copy() for name, v in views.items()}

        header, values = self.streams.pull(request, read_segment=read)
        if not header.shm and header.shm_bytes_needed > segment.size:
            slot.want = max(slot.want, header.shm_bytes_needed)  # the next pull gets a big enough one
        return header, values

    def push(self, outgoing: OutgoingPush, timeout: float) -> pb.PushResponse | None:
        """The gradients into the push segment, then the header alone; None when shared
        memory does not serve it (then the caller streams). The segment stays untouched
        until the reply (this call holds the slot): the server reads it in place."""
        return self._serve(self.push_slot, outgoing.worker_id, lambda slot: self._push_once(outgoing, slot, timeout))

    def _push_once(self, outgoing: OutgoingPush, slot: _Slot, timeout: float) -> pb.PushResponse:
        arrays = {name: a for name, (_, a) in outgoing.arrays.items()}
        offsets, needed = shmem.aligned_offsets(a.nbytes for a in arrays.values())
        segment = slot.ensure(needed)
        shmem.write(segment, arrays, offsets)  # as the server writes a pull's values (offsets checked)
        header = outgoing.header()
        header.shm_name = segment.name
        header.shm_offsets.extend(offsets)
        return self.streams.push(outgoing, timeout, header=header)


class PullCache:
    """The last full pull: (incarnation, version, values). The next full pull names that
    version and incarnation and gets back only the variables changed since, and of a table
    the server steps row by row only the rows changed since (``PullRequest.row_deltas``); the
    others are these arrays again (read-only, so sharing them is safe). A row-wise table's
    array is therefore this client's one copy, written in place by a later pull (copied once
    at the first delta): read-only to everyone else, it holds the server's values as of the
    last pull (sync: exactly that version; async: each row as of it or later)."""

    def __init__(self) -> None:
        self.held: tuple[str, int, dict[str, np.ndarray]] | None = None
        self.fresh = False  # held came with a push reply (receive): no pull needed
        self.row_deltas_seen = False  # the server sent row deltas: it holds row-wise tables
        self._owned: dict[str, np.ndarray] = {}  # arrays this cache made, which it may write

    def take_fresh(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """(version, values) when the last push's reply brought them, once; else None."""
        if not (self.fresh and self.held is not None):
            return None
        self.fresh = False  # nothing can have changed since
        return self.held[1], self.held[2]

    def ask(self, request: pb.PullRequest) -> None:
        """Name what this client holds, so the server can skip it (and send row deltas)."""
        if self.held is not None:
            request.known_incarnation, request.known_version = self.held[0], self.held[1]
            request.row_deltas = True

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.held[2].values()) if self.held is not None else 0

    def complete(self, header: pb.PullHeader, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A full pull's values: the changed ones from ``values`` (a row delta written into
        the held copy), the others from the cache (same server process only); then held
        for the next pull. ValueError for row deltas that do not fit what is held."""
        held = self.held
        deltas = {m.name: m for m in header.variables if m.sparse}
        if held is not None and header.incarnation == held[0] and set(values) <= set(held[2]):
            for name, meta in deltas.items():
                values[name] = self._write_rows(name, held[2][name], np.array(meta.rows, np.int64), values[name])
            values = {n: values.get(n, held[2][n]) for n in held[2]}
        elif deltas:
            raise ValueError(f"row deltas for {sorted(deltas)[:4]}, which this client does not hold")
        self.row_deltas_seen = self.row_deltas_seen or bool(deltas)
        self.keep(header.incarnation, header.version, values)
        return values

    def _write_rows(self, name: str, held: np.ndarray, rows: np.ndarray, delta: np.ndarray) -> np.ndarray:
        if held.ndim < 1 or delta.shape != (len(rows),) + held.shape[1:] or delta.dtype != held.dtype:
            raise ValueError(f"row delta of {name!r} is {delta.dtype}{list(delta.shape)} for {len(rows)} row(s); "
                             f"the copy held is {held.dtype}{list(held.shape)}")
        if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= held.shape[0]):
            raise ValueError(f"row delta of {name!r} names rows outside 0..{held.shape[0] - 1}")
        copy = held if self._owned.get(name) is held else held.copy()  # copied once, then written in place
        copy.flags.writeable = True
        copy[rows] = delta
        copy.flags.writeable = False
        self._owned[name] = copy
        return copy

    def keep(self, incarnation: str, version: int, values: dict[str, np.ndarray], fresh: bool = False) -> None:
        """Hold ``values`` (made read-only) as the next full pull's base; ``fresh``: its answer."""
        for a in values.values():
            a.flags.writeable = False
        self.held, self.fresh = (incarnation, version, values), fresh
        self._owned = {n: a for n, a in self._owned.items() if values.get(n) is a}  # those still held

    def receive(self, reply: pb.PushResponse, address: str) -> None:
        """Sync: the new parameters a push's reply carries, if the server granted them
        (``PushRequest.return_values``: they stay current until this worker pushes again),
        as the next full pull's answer, without a call."""
        if not reply.variables:
            return
        with failures("Push", address):
            self.keep(reply.incarnation, reply.version, codec.decode_many(reply.variables), fresh=True)
