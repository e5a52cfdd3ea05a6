"""Transport settings shared by both ends of the wire.

    channel = grpc.insecure_channel(addr, options=wire.channel_options())
    server = grpc.server(pool, options=wire.server_options())

One setting, ``MAX_MESSAGE_BYTES``, raises gRPC's 4 MiB default on the client and
the server alike, so a payload one side can send the other can receive. It can be
lowered or raised with the environment variable ``TFPS_MAX_MESSAGE_MB``.
"""

from __future__ import annotations

import os

SERVICE_NAME = "tfps.v1.ParameterServer"

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


def server_options() -> list[tuple[str, int]]:
    # so_reuseport off: two servers must never silently share a port.
    return channel_options() + [("grpc.so_reuseport", 0)]


# glibc malloc settings for processes that move large messages: keep big buffers
# mapped instead of returning them to the kernel after every message, so a fresh
# 100 MiB receive buffer does not page-fault on every step. Measured with
# bench/transport.py (BENCHMARKS.md): 2-5x push+pull throughput at 10-100 MiB.
# They only take effect in a process started with them in its environment.
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1073741824",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_ARENA_MAX": "1",
}
