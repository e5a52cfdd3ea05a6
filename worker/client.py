"""Every gRPC call a worker makes, in one place.

    client = PSClient("127.0.0.1:50051")
    reg = client.register(worker_index=0, num_workers=2)
    version, values = client.pull(reg.worker_id)
    reply = client.push(reg.worker_id, step, version, batch_size, grads, loss)

NumPy in, NumPy out: no TensorFlow here. Pulls and pushes of more than
``SMALL_BYTES`` are streamed in ~2 MiB chunks (``PullStream``, ``PushStream``: ``protos.stream``). A full pull
sends the server the version and incarnation of the values this client holds,
and gets back only the variables that changed since (the rest come from its
cache). ``grad_wire_dtype="float16"`` or ``"bfloat16"`` halves a push's float32
gradient bytes (the server widens them back; off by default: it costs accuracy).

Same-host fast path, opt-in: ``PSClient(address, shm=True)``. At ``register``
the client creates two shared-memory segments in ``/dev/shm`` (``protos.shm``:
``tfps-<pid>-<random>``, mode 0600), writes a random token into one and names
both; the server must read the token back and write a nonce into the other.
Only then do pushes put the gradients into the push segment and pulls have the
server write the values into the pull segment, with gRPC carrying the headers
alone; ``shm_active`` says whether that is the case. A failed probe (a server
on another host, one started with ``--no-shm``, an older one), a segment that
cannot be made (``/dev/shm`` full: a container's is 64 MiB unless
``--shm-size`` says more), or any "shared memory:" refusal on a call makes the
client log one line and stream from then on; a refused call is repeated over
the stream, which is safe because a refusal changes nothing on the server. The
values a pull returns are copies, valid after the next pull. ``close()``
unlinks the segments, and so does interpreter exit; a SIGKILLed worker leaves
them behind (``ls /dev/shm/tfps-*``; the pid in the name says whose).

Each call carries a deadline. Calls
that are safe to repeat (Register, Initialize, Pull, Leave, Status, Heartbeat)
are retried on UNAVAILABLE by the channel's service-config retry policy. Push
is retried only by the trainer, deliberately: the server answers a repeated
(worker, step) from its record instead of applying it twice. Failures surface as
``PSClientError`` whose message names the call, the status code and the
server's own explanation.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Iterable, Mapping

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec, convert, shm as shmem, stream, wire
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from ps_common import security
from ps_common.records import PushReply, Registration
from ps_common.sparse import SparseRows

log = logging.getLogger("worker.client")

# Codes a server answers only once its handler has finished with a call: after
# any other failure (a deadline, a dropped connection) the server may still be
# reading or writing the call's segment, so the client takes a new one.
_HANDLER_DONE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAUTHENTICATED,
                 grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}

_RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": wire.SERVICE_NAME, "method": m} for m in ("Register", "Initialize", "Pull", "Leave", "Status", "Heartbeat")],
                "retryPolicy": _RETRY_POLICY,
            }
        ]
    }
)


# Pushes and pulls of at most this many bytes go as one unary message: a streamed
# call costs a thread on each side and ~0.3 ms more (bench/barrier.py), which is
# more than moving 1 MiB. Larger ones are streamed, or go through shared memory,
# which already beats one message at 1 MiB (bench/transport.py): with shared
# memory on, the limit is SMALL_SHM_BYTES.
SMALL_BYTES = 1 << 20
SMALL_SHM_BYTES = 256 << 10


class PSClientError(RuntimeError):
    def __init__(self, call: str, address: str, code: grpc.StatusCode | None, details: str):
        self.call, self.address, self.code, self.details = call, address, code, details
        code_name = code.name if code is not None else "ERROR"
        super().__init__(f"{call} to {address} failed: {code_name}: {details}")


class _ShmRefused(Exception):
    """The fast path cannot serve this call; nothing was applied: repeat it over the stream."""


class _Slot:
    """One of the client's segments (push or pull), lent to one call at a time (``lock``)."""

    def __init__(self, role: str):
        self.role = role
        self.lock = threading.Lock()
        self.segment: shmem.Segment | None = None
        self.want = 0  # bytes the next call will likely need (the server said, or the model's size)

    def ensure(self, nbytes: int) -> shmem.Segment:
        """A segment of at least ``nbytes`` (and ``want``): this one, or a new one. Sizes are
        fixed for a segment's life, so growing means a new name. OSError if it cannot be made."""
        if self.segment is None or self.segment.size < max(nbytes, self.want):
            new = shmem.Segment.create(max(nbytes, self.want))
            self.close()
            self.segment = new
        return self.segment

    def close(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def _read_segment(segment: shmem.Segment, layout: stream.Layout, offsets: list[int]) -> dict[str, np.ndarray]:
    """Copies of the values the server wrote into ``segment``; _ShmRefused if an offset
    does not fit (``shm.views`` checks every one first)."""
    try:
        views = shmem.views(segment, layout.entries, offsets)
    except shmem.ShmError as e:
        raise _ShmRefused(f"the reply's {e}") from None
    return {name: v.copy() for name, v in views.items()}


class PSClient:
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
    ):
        """TLS with ``tls_ca_file`` (plus a client certificate for mutual TLS); ``token``
        is sent as ``authorization: Bearer`` on every call (see ``ps_common.security``).
        ``shm``: try the same-host fast path (module docstring) from ``register`` on.
        ``small_bytes``: pushes and pulls up to this size go as one unary message."""
        if grad_wire_dtype not in stream.WIRE_DTYPES:
            raise ValueError(f"grad_wire_dtype must be one of {stream.WIRE_DTYPES}, got {grad_wire_dtype!r}")
        self.address = address
        self.timeout = timeout
        self.grad_wire_dtype = grad_wire_dtype
        self.small_bytes = small_bytes
        # Sync: a push reply may carry the new parameters (PushRequest.return_values);
        # then the next full pull is answered from them without a call (_fresh).
        self._sync = False
        self._fresh = False
        # The last full pull: (incarnation, version, values); what the next one may skip.
        self._cache: tuple[str, int, dict[str, np.ndarray]] | None = None
        self._channel = security.client_channel(
            address,
            options=wire.client_options() + [("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)],
            ca_file=tls_ca_file,
            cert_file=tls_cert_file,
            key_file=tls_key_file,
            server_name=tls_server_name,
            token=token,
        )
        self._stub = pb_grpc.ParameterServerStub(self._channel)
        method = f"/{wire.SERVICE_NAME}/"
        self._pull_stream = self._channel.unary_stream(
            method + "PullStream", request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=stream.deserializer(pb.PullChunk))
        self._push_stream = self._channel.stream_unary(
            method + "PushStream", request_serializer=stream.serializer(pb.PushChunk),
            response_deserializer=pb.PushResponse.FromString)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # Same-host fast path: asked for, on (a probe succeeded since the last register),
        # and why it went off for good (None: it did not).
        self.shm = shm
        self._shm_on = False
        self.shm_fallback_reason: str | None = None
        self._shm_lock = threading.Lock()  # guards shm_fallback_reason; leaf lock
        self._push_slot, self._pull_slot = _Slot("push"), _Slot("pull")

    @property
    def shm_active(self) -> bool:
        """True while pushes and pulls go through shared memory."""
        return self._shm_on

    def _fall_back(self, reason: str) -> None:
        """Stream from now on; say why once."""
        self._shm_on = False
        with self._shm_lock:
            first, self.shm_fallback_reason = self.shm_fallback_reason is None, self.shm_fallback_reason or reason
        if first:
            log.warning("same-host shared memory off for %s, streaming over gRPC from now on: %s",
                        self.address, reason)

    def _release_segments(self) -> None:
        """Close the segments no call is using (the others: at close() or exit)."""
        for slot in (self._push_slot, self._pull_slot):
            if slot.lock.acquire(blocking=False):
                try:
                    slot.close()
                finally:
                    slot.lock.release()

    def _lend(self, slot: _Slot, worker_id: int) -> _Slot | None:
        """The slot, locked, if this call may use shared memory; None: stream it. A slot
        busy with another call of this client (a push waiting at a barrier) is not waited for."""
        if not self._shm_on or worker_id < 0 or not slot.lock.acquire(blocking=False):
            return None
        return slot

    def close(self) -> None:
        self._channel.close()
        for slot in (self._push_slot, self._pull_slot):
            slot.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, name: str, request, timeout: float | None = None, wait_for_ready: bool = False):
        try:
            return getattr(self._stub, name)(
                request, timeout=self.timeout if timeout is None else timeout, wait_for_ready=wait_for_ready
            )
        except grpc.RpcError as e:
            raise PSClientError(name, self.address, e.code(), e.details() or "") from None

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
                reply = self._health.Check(
                    health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME),
                    timeout=min(remaining, 5.0), wait_for_ready=True,
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))

    def health(self, timeout: float = 5.0) -> str:
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            raise PSClientError("Health", self.address, e.code(), e.details() or "") from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def register(self, worker_index: int, num_workers: int = 0, name: str = "", timeout: float | None = None) -> Registration:
        """Join the cluster; with ``shm``, probe the same-host fast path too (every time:
        a restarted server may run elsewhere)."""
        request = pb.RegisterRequest(worker_index=worker_index, num_workers=num_workers, worker_name=name)
        self._shm_on = False
        self._fresh = False
        held = self._hold_for_probe()
        try:
            token = self._probe_request(request) if held else None
            reply = self._call("Register", request, timeout=timeout,
                               wait_for_ready=True)  # the server may still be starting
            if token is not None:
                self._probe_answer(reply, token)
        finally:
            for slot in held:
                slot.lock.release()
        if self.shm and self.shm_fallback_reason is not None:
            self._release_segments()
        self._sync = reply.mode == pb.SYNC
        return convert.REGISTRATION.from_wire(reply, shm=self._shm_on)

    def _hold_for_probe(self) -> list[_Slot]:
        """Both slots, locked, when a probe is due; [] otherwise (or while a call uses one)."""
        if not self.shm or self.shm_fallback_reason is not None:
            return []
        held = []
        for slot in (self._push_slot, self._pull_slot):
            if not slot.lock.acquire(blocking=False):
                for h in held:
                    h.lock.release()
                return []
            held.append(slot)
        return held

    def _probe_request(self, request: pb.RegisterRequest) -> bytes | None:
        """Name both segments in ``request`` with a fresh token in the push one; the token,
        or None when the segments cannot be made (then the client streams for good)."""
        try:
            push = self._push_slot.ensure(shmem.TOKEN_BYTES)
            pull = self._pull_slot.ensure(shmem.TOKEN_BYTES)
        except OSError as e:
            self._fall_back(f"cannot create a segment in {shmem.DIRECTORY}: {e}")
            return None
        token = shmem.new_token()
        push.array[:shmem.TOKEN_BYTES] = np.frombuffer(token, np.uint8)
        pull.array[:shmem.TOKEN_BYTES] = 0
        request.shm_push_name, request.shm_pull_name = push.name, pull.name
        return token

    def _probe_answer(self, reply: pb.RegisterResponse, token: bytes) -> None:
        nonce = self._pull_slot.segment.array[:shmem.TOKEN_BYTES].tobytes()
        if reply.shm_error:
            self._fall_back(f"the server refused the probe: {reply.shm_error}")
        elif reply.shm_token != token or reply.shm_nonce != nonce or len(nonce) != shmem.TOKEN_BYTES:
            self._fall_back("the server does not see this client's segments (another host, another /dev/shm, "
                            "or a server without the fast path)")
        else:
            self._shm_on = True

    def initialize(self, worker_id: int, variables: Mapping[str, np.ndarray], optimizer: Mapping,
                   non_trainable: Iterable[str] = ()) -> bool:
        """Store ``variables`` on the server, unless an identical state is there (False).
        ``non_trainable`` names the variables updated by pushed changes, not the optimizer."""
        reply = self._call(
            "Initialize",
            pb.InitializeRequest(
                worker_id=worker_id,
                optimizer=pb.OptimizerConfig(**optimizer),
                variables=codec.encode_many(variables),
                non_trainable=sorted(non_trainable),
            ),
        )
        return reply.created

    def pull(self, worker_id: int = -1, names: Iterable[str] = ()) -> tuple[int, dict[str, np.ndarray]]:
        """(version, values), streamed or through shared memory. Arrays are read-only and
        the client's own; a full pull (no ``names``) reuses the previous pull's arrays for
        the variables that did not change."""
        names = list(names)
        if not names and self._fresh and self._cache is not None:
            self._fresh = False  # the last push's reply brought them: nothing can have changed since
            return self._cache[1], self._cache[2]
        cache = self._cache if not names else None
        request = pb.PullRequest(worker_id=worker_id, names=names)
        if cache is not None:
            request.known_incarnation, request.known_version = cache[0], cache[1]
        if cache is not None and sum(a.nbytes for a in cache[2].values()) <= self._unary_limit():
            header, values = self._pull_unary(request)  # a small model: one message beats a stream
        else:
            slot = self._lend(self._pull_slot, worker_id)
            try:
                try:
                    header, values = self._pull_once(request, slot)
                except _ShmRefused as e:
                    self._fall_back(str(e))
                    request.ClearField("shm_name")
                    header, values = self._pull_once(request, None)
            finally:
                if slot is not None:
                    slot.lock.release()
            if slot is not None and not self._shm_on:
                self._release_segments()
        for a in values.values():
            a.flags.writeable = False
        if cache is not None and header.incarnation == cache[0]:
            values = {n: values.get(n, cache[2][n]) for n in cache[2]} if set(values) <= set(cache[2]) else values
        if not names:
            self._cache = (header.incarnation, header.version, values)
            self._pull_slot.want = max(self._pull_slot.want, shmem.needed_bytes(a.nbytes for a in values.values()))
        return header.version, values

    def _unary_limit(self) -> int:
        return min(self.small_bytes, SMALL_SHM_BYTES) if self._shm_on else self.small_bytes

    def _pull_unary(self, request: pb.PullRequest) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        reply = self._call("Pull", request)
        try:
            values = codec.decode_many(reply.variables)
        except codec.CodecError as e:
            raise PSClientError("Pull", self.address, None, f"malformed reply: {e}") from None
        return pb.PullHeader(version=reply.version, incarnation=reply.incarnation), values

    def _pull_once(self, request: pb.PullRequest, slot: _Slot | None) -> tuple[pb.PullHeader, dict[str, np.ndarray]]:
        """One PullStream: through ``slot``'s segment if given (_ShmRefused when it cannot
        be), else streamed."""
        segment = None
        if slot is not None:
            try:
                segment = slot.ensure(shmem.MIN_BYTES)
            except OSError as e:
                raise _ShmRefused(f"cannot create a segment in {shmem.DIRECTORY}: {e}") from None
            request.shm_name = segment.name
        try:
            replies = self._pull_stream(request, timeout=self.timeout, wait_for_ready=False)
            first = next(replies)
            if not isinstance(first, pb.PullChunk) or not first.HasField("header"):
                raise PSClientError("PullStream", self.address, None, "the reply did not start with a header")
            header = first.header
            layout = stream.Layout.of(header.variables)
            if header.shm:
                if segment is None:
                    raise PSClientError("PullStream", self.address, None, "a shared-memory reply to a streamed pull")
                values = _read_segment(segment, layout, list(header.shm_offsets))
                if next(replies, None) is not None:
                    raise _ShmRefused("a shared-memory reply went on with data messages")
                return header, values
            assembler = stream.Assembler(layout)
            for chunk in replies:
                if not isinstance(chunk, memoryview):
                    raise PSClientError("PullStream", self.address, None, "a second header in the reply")
                assembler.feed(chunk)
            if slot is not None and header.shm_bytes_needed > segment.size:
                slot.want = max(slot.want, header.shm_bytes_needed)  # the next pull gets a big enough one
            return header, assembler.arrays()
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if segment is not None and code == grpc.StatusCode.FAILED_PRECONDITION \
                    and details.startswith("shared memory:"):
                raise _ShmRefused(details) from None
            if slot is not None and code not in _HANDLER_DONE:
                slot.close()  # the server may still write into it
            raise PSClientError("Pull", self.address, code, details) from None
        except (codec.CodecError, StopIteration) as e:
            raise PSClientError("Pull", self.address, None, f"malformed reply: {e or 'empty stream'}") from None

    def push(
        self,
        worker_id: int,
        step: int,
        base_version: int,
        batch_size: int,
        gradients: Mapping[str, np.ndarray],
        loss: float = 0.0,
        timeout: float | None = None,
    ) -> PushReply:
        """Streamed, or through shared memory; either way applied once or refused whole.

        A gradient may be a ``SparseRows`` (an embedding's): only its rows travel."""
        try:
            wire_arrays = {n: stream.to_wire(g.values if isinstance(g, SparseRows) else g, self.grad_wire_dtype)
                           for n, g in gradients.items()}
        except codec.CodecError as e:
            raise PSClientError("Push", self.address, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        rows = {n: np.asarray(g.rows, dtype=np.int64) for n, g in gradients.items() if isinstance(g, SparseRows)}
        timeout = self.timeout if timeout is None else timeout
        self._fresh = False
        nbytes = sum(a.nbytes for _, a in wire_arrays.values()) + sum(r.nbytes for r in rows.values())
        if nbytes <= self._unary_limit():  # one message beats a stream
            reply = self._call("Push", pb.PushRequest(
                worker_id=worker_id, step=step, base_version=base_version, batch_size=batch_size, loss=loss,
                gradients=[pb.Tensor(name=n, dtype=code, shape=a.shape, data=a.tobytes(), sparse=n in rows,
                                     rows=rows[n].tolist() if n in rows else ()) for n, (code, a) in wire_arrays.items()],
                return_values=self._sync), timeout=timeout)
            if reply.variables:
                try:
                    values = codec.decode_many(reply.variables)
                except codec.CodecError as e:
                    raise PSClientError("Push", self.address, None, f"malformed reply: {e}") from None
                self._cache, self._fresh = (reply.incarnation, reply.version, values), True
        else:
            reply = self._push_large(worker_id, step, base_version, batch_size, loss, wire_arrays, timeout, rows)
        return convert.PUSH_REPLY.from_wire(reply)

    def _push_large(self, worker_id: int, step: int, base_version: int, batch_size: int, loss: float,
                    wire_arrays: dict[str, tuple[int, np.ndarray]], timeout: float,
                    rows: Mapping[str, np.ndarray] | None = None) -> pb.PushResponse:
        """Through the push segment when shared memory is on, else streamed."""
        header = pb.PushHeader(worker_id=worker_id, step=step, base_version=base_version, batch_size=batch_size,
                               loss=loss, gradients=stream.metas(wire_arrays))
        for meta in header.gradients:
            if rows and meta.name in rows:
                meta.sparse = True
                meta.rows.extend(rows[meta.name].tolist())
        reply = None
        slot = self._lend(self._push_slot, worker_id)
        if slot is not None:
            try:
                reply = self._push_through_segment(slot, header, [a for _, a in wire_arrays.values()], timeout)
            except _ShmRefused as e:  # nothing was applied: stream it instead
                self._fall_back(str(e))
                header.ClearField("shm_name")
                header.ClearField("shm_offsets")
            finally:
                slot.lock.release()
            if not self._shm_on:
                self._release_segments()
        if reply is None:
            def messages():
                yield pb.PushChunk(header=header)
                yield from stream.chunk_buffers([a for _, a in wire_arrays.values()])

            try:
                reply = self._push_stream(messages(), timeout=timeout)
            except grpc.RpcError as e:
                raise PSClientError("Push", self.address, e.code(), e.details() or "") from None
        return reply

    def _push_through_segment(self, slot: _Slot, header: pb.PushHeader, arrays: list[np.ndarray],
                              timeout: float) -> pb.PushResponse:
        """The gradients into the push segment, then the header alone. The segment stays
        untouched until the reply (the caller holds the slot): the server reads it in place."""
        offsets, needed = shmem.aligned_offsets(a.nbytes for a in arrays)
        try:
            segment = slot.ensure(needed)
        except OSError as e:
            raise _ShmRefused(f"cannot create a segment of {needed} bytes in {shmem.DIRECTORY}: {e}") from None
        for a, off in zip(arrays, offsets):
            segment.array[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        header.shm_name = segment.name
        header.shm_offsets.extend(offsets)
        try:
            return self._push_stream(iter([pb.PushChunk(header=header)]), timeout=timeout)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("shared memory:"):
                raise _ShmRefused(details) from None
            if code not in _HANDLER_DONE:
                slot.close()  # the server may still read it (a push waiting at the barrier)
            raise PSClientError("Push", self.address, code, details) from None

    def heartbeat(self, worker_id: int, step: int = -1, timeout: float = 5.0) -> str:
        """Renew this worker's lease; returns the server's incarnation."""
        reply = self._call("Heartbeat", pb.HeartbeatRequest(worker_id=worker_id, step=step), timeout=timeout)
        return reply.incarnation

    def leave(self, worker_id: int) -> None:
        self._call("Leave", pb.LeaveRequest(worker_id=worker_id))

    def status(self) -> pb.StatusResponse:
        return self._call("Status", pb.StatusRequest())

    def wait_initialized(self, worker_id: int, timeout: float) -> tuple[int, dict[str, np.ndarray]]:
        """Pull once the chief has initialized the variables; raise after timeout."""
        return pull_when_initialized(self, worker_id, timeout)


def pull_when_initialized(client, worker_id: int, timeout: float) -> tuple[int, dict[str, np.ndarray]]:
    """``client.pull(worker_id)`` once the chief has initialized the variables (of every
    shard, for a ``ShardedClient``), retrying with backoff; PSClientError after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return client.pull(worker_id)
        except PSClientError as e:
            if e.code != grpc.StatusCode.FAILED_PRECONDITION or "not initialized" not in e.details:
                raise
            if time.monotonic() + delay > deadline:
                raise PSClientError("Pull", e.address, e.code,
                                    f"variables still not initialized after {timeout:g} s: is the chief "
                                    "(worker 0) running?") from None
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
