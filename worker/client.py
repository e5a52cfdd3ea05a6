"""Every gRPC call a worker makes, in one place.

    client = PSClient("127.0.0.1:50051")
    reg = client.register(worker_index=0, num_workers=2)
    version, values = client.pull(reg.worker_id)
    reply = client.push(reg.worker_id, step, version, batch_size, grads, loss)

NumPy in, NumPy out: no TensorFlow here. Pulls and pushes are streamed in
~1 MiB chunks (``PullStream``, ``PushStream``: ``protos.stream``). A full pull
sends the server the version and incarnation of the values this client holds,
and gets back only the variables that changed since (the rest come from its
cache). ``grad_wire_dtype="float16"`` or ``"bfloat16"`` halves a push's float32
gradient bytes (the server widens them back; off by default: it costs accuracy).
Each call carries a deadline. Calls
that are safe to repeat (Register, Initialize, Pull, Leave, Status, Heartbeat)
are retried on UNAVAILABLE by the channel's service-config retry policy. Push
is retried only by the trainer, deliberately: the server answers a repeated
(worker, step) from its record instead of applying it twice. Failures surface as
``PSClientError`` whose message names the call, the status code and the
server's own explanation.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Iterable, Mapping

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec, stream, wire
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from ps_server import security

MODE_NAMES = {pb.SYNC: "sync", pb.ASYNC: "async"}

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


class PSClientError(RuntimeError):
    def __init__(self, call: str, address: str, code: grpc.StatusCode | None, details: str):
        self.call, self.address, self.code, self.details = call, address, code, details
        code_name = code.name if code is not None else "ERROR"
        super().__init__(f"{call} to {address} failed: {code_name}: {details}")


@dataclasses.dataclass(frozen=True)
class Registration:
    worker_id: int
    mode: str
    num_workers: int
    initialized: bool
    version: int
    barrier_timeout: float
    round: int = 0
    lease_timeout: float = 10.0
    incarnation: str = ""


@dataclasses.dataclass(frozen=True)
class PushReply:
    version: int
    staleness: int
    contributors: int
    dropped: bool = False
    next_step: int = 0
    replayed: bool = False


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
    ):
        """TLS with ``tls_ca_file`` (plus a client certificate for mutual TLS); ``token``
        is sent as ``authorization: Bearer`` on every call (see ``ps_server.security``)."""
        if grad_wire_dtype not in stream.WIRE_DTYPES:
            raise ValueError(f"grad_wire_dtype must be one of {stream.WIRE_DTYPES}, got {grad_wire_dtype!r}")
        self.address = address
        self.timeout = timeout
        self.grad_wire_dtype = grad_wire_dtype
        # The last full pull: (incarnation, version, values); what the next one may skip.
        self._cache: tuple[str, int, dict[str, np.ndarray]] | None = None
        self._channel = security.client_channel(
            address,
            options=wire.channel_options() + [("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 1)],
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

    def close(self) -> None:
        self._channel.close()

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
        reply = self._call(
            "Register",
            pb.RegisterRequest(worker_index=worker_index, num_workers=num_workers, worker_name=name),
            timeout=timeout,
            wait_for_ready=True,  # the server may still be starting
        )
        return Registration(
            worker_id=reply.worker_id,
            mode=MODE_NAMES.get(reply.mode, "unknown"),
            num_workers=reply.num_workers,
            initialized=reply.initialized,
            version=reply.version,
            barrier_timeout=reply.barrier_timeout_s,
            round=reply.round,
            lease_timeout=reply.lease_timeout_s,
            incarnation=reply.incarnation,
        )

    def initialize(self, worker_id: int, variables: Mapping[str, np.ndarray], optimizer: Mapping) -> bool:
        reply = self._call(
            "Initialize",
            pb.InitializeRequest(
                worker_id=worker_id,
                optimizer=pb.OptimizerConfig(**optimizer),
                variables=codec.encode_many(variables),
            ),
        )
        return reply.created

    def pull(self, worker_id: int = -1, names: Iterable[str] = ()) -> tuple[int, dict[str, np.ndarray]]:
        """(version, values), streamed. Arrays are read-only; a full pull (no ``names``)
        reuses the previous pull's arrays for the variables that did not change."""
        names = list(names)
        cache = self._cache if not names else None
        request = pb.PullRequest(worker_id=worker_id, names=names)
        if cache is not None:
            request.known_incarnation, request.known_version = cache[0], cache[1]
        try:
            replies = self._pull_stream(request, timeout=self.timeout, wait_for_ready=False)
            header = next(replies)
            if not isinstance(header, pb.PullChunk) or not header.HasField("header"):
                raise PSClientError("PullStream", self.address, None, "the reply did not start with a header")
            header = header.header
            assembler = stream.Assembler(stream.Layout.of(header.variables))
            for chunk in replies:
                if not isinstance(chunk, memoryview):
                    raise PSClientError("PullStream", self.address, None, "a second header in the reply")
                assembler.feed(chunk)
            values = assembler.arrays()
        except grpc.RpcError as e:
            raise PSClientError("Pull", self.address, e.code(), e.details() or "") from None
        except (codec.CodecError, StopIteration) as e:
            raise PSClientError("Pull", self.address, None, f"malformed reply: {e or 'empty stream'}") from None
        for a in values.values():
            a.flags.writeable = False
        if cache is not None and header.incarnation == cache[0]:
            values = {n: values.get(n, cache[2][n]) for n in cache[2]} if set(values) <= set(cache[2]) else values
        if not names:
            self._cache = (header.incarnation, header.version, values)
        return header.version, values

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
        try:
            wire_arrays = {n: stream.to_wire(g, self.grad_wire_dtype) for n, g in gradients.items()}
        except codec.CodecError as e:
            raise PSClientError("Push", self.address, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        header = pb.PushHeader(worker_id=worker_id, step=step, base_version=base_version, batch_size=batch_size,
                               loss=loss, gradients=stream.metas(wire_arrays))

        def messages():
            yield pb.PushChunk(header=header)
            yield from stream.chunk_buffers([a for _, a in wire_arrays.values()])

        try:
            reply = self._push_stream(messages(), timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as e:
            raise PSClientError("Push", self.address, e.code(), e.details() or "") from None
        return PushReply(reply.version, reply.staleness, reply.contributors, reply.dropped, reply.next_step,
                         reply.replayed)

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
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                return self.pull(worker_id)
            except PSClientError as e:
                if e.code != grpc.StatusCode.FAILED_PRECONDITION or "not initialized" not in e.details:
                    raise
                if time.monotonic() + delay > deadline:
                    raise PSClientError("Pull", self.address, e.code,
                                        f"variables still not initialized after {timeout:g} s: is the chief (worker 0) running?") from None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
