"""Transport settings shared by both ends of the wire.

    channel = grpc.insecure_channel(addr, options=wire.client_options())
    server = grpc.server(pool, options=wire.server_options())

One setting, ``MAX_MESSAGE_BYTES``, raises gRPC's 4 MiB default on the client and
the server alike, so a payload one side can send the other can receive. It can be
lowered or raised with the environment variable ``TFPS_MAX_MESSAGE_MB``.
"""

from __future__ import annotations

import os

from ps_common.names import MODES

SERVICE_NAME = "tfps.v1.ParameterServer"


def mode_to_wire(name: str) -> int:
    """A mode name of ``ps_common.names.MODES`` as the proto's ``Mode`` value (SYNC, ...)."""
    from protos import tfps_pb2 as pb

    return pb.Mode.Value(name.upper())


def mode_from_wire(value: int) -> str:
    """The proto's ``Mode`` value as its name in ``MODES``; "unknown" for one outside it."""
    from protos import tfps_pb2 as pb

    name = pb.Mode.Name(value).lower() if value in pb.Mode.values() else ""
    return name if name in MODES else "unknown"

# gRPC lengths are signed 32-bit: 2 GiB - 1 is the ceiling.
_GRPC_CEILING = 2**31 - 1


def max_message_bytes() -> int:
    raw = os.environ.get("TFPS_MAX_MESSAGE_MB", "1024")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"TFPS_MAX_MESSAGE_MB must be a number of MiB, got {raw!r}") from None
    if mb <= 0:
        raise ValueError(f"TFPS_MAX_MESSAGE_MB must be positive, got {raw!r}")
    return min(int(mb * 2**20), _GRPC_CEILING)


MAX_MESSAGE_BYTES = max_message_bytes()


def channel_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


# Keepalive: a client pings a connection that carried no data for KEEPALIVE_MS and
# drops it when the answer takes longer than KEEPALIVE_MS more; its calls then fail
# UNAVAILABLE, which workers ride out by reconnecting. Without it a cut link (a
# container disconnected from its network, a host gone without a FIN) leaves calls
# waiting for their deadlines, a minute or more. The server lets clients ping that
# often (gRPC's default would answer such pings with GOAWAY "too_many_pings").
KEEPALIVE_MS = 10_000


def client_options() -> list[tuple[str, int]]:
    return channel_options() + [
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a long barrier wait
    ]


def server_options() -> list[tuple[str, int]]:
    # so_reuseport off: two servers must never silently share a port.
    return channel_options() + [
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ]


# glibc malloc settings for processes that move large messages: keep big buffers
# mapped instead of returning them to the kernel after every message, so a fresh
# 100 MiB receive buffer does not page-fault on every step. Measured with
# bench/transport.py (BENCHMARKS.md): 2-5x push+pull throughput at 10-100 MiB.
# In the environment they take effect from a process's start (ps-launch starts
# its children with them); tune_allocator() sets the same from inside a running
# process (ps-server and ps-worker call it first thing, however started).
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1073741824",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_ARENA_MAX": "1",
}

# mallopt(3) parameter numbers, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def tune_allocator(environ=os.environ) -> str:
    """Apply ALLOCATOR_ENV's settings to this process through glibc's mallopt.

    Returns what was done, for the log. Does nothing where the user set any
    MALLOC_* variable (their choice wins) or the C library is not glibc.
    Measured on a 100 MiB buffer allocated and filled again and again: 7.0 ms
    per round with glibc's defaults, 2.4 ms after this call, as with the variables.
    """
    if any(k.startswith("MALLOC_") for k in environ):
        return "allocator: left as the MALLOC_* environment sets it"
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "allocator: not glibc, left alone"
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 1 << 30), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1)))
    return "allocator: glibc tuned for large buffers" if ok else "allocator: glibc refused mallopt, left alone"
