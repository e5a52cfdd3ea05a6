"""Transport settings shared by both ends of the wire.

    channel = grpc.insecure_channel(addr, options=wire.client_options())
    server = grpc.server(pool, options=wire.server_options())

One setting, the largest message, raises gRPC's 4 MiB default on the client and
the server alike, so a payload one side can send the other can receive. It is the
``max_message_mb`` field of both processes' configurations (``--max-message-mb``,
``TFPS_MAX_MESSAGE_MB``, default ``ps_common.defaults.MAX_MESSAGE_MB``), and each passes it in:

    wire.server_options(config.max_message_bytes)      # ps_server.server
    wire.client_options(config.max_message_bytes)

Called without it, the option functions (and ``MAX_MESSAGE_BYTES``) use this
process's setting: the value its command handed to ``use_max_message_mb`` (ps-server
and ps-worker do, with their configuration's), else the same setting read through
the configuration resolver (``ps_common.settings``) from the environment when they
are called, never when this module is imported.
"""

from __future__ import annotations

import dataclasses
import os

from ps_common.defaults import MAX_MESSAGE_MB
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

_process_max_message_mb: float | None = None  # use_max_message_mb; None: from the environment


def use_max_message_mb(mb: float | None) -> None:
    """Make ``mb`` this process's message limit for the option functions called
    without one (a command calls it once with its configuration's ``max_message_mb``);
    None: back to reading the environment."""
    global _process_max_message_mb
    if mb is not None:
        check_max_message_mb(mb)
    _process_max_message_mb = mb


def max_message_bytes(mb: float | None = None) -> int:
    """``mb`` MiB as bytes, capped at gRPC's ceiling; None: this process's setting
    (``use_max_message_mb``, else TFPS_MAX_MESSAGE_MB read now through the resolver)."""
    if mb is None:
        mb = _process_max_message_mb
    if mb is None:
        mb = _TransportSetting.from_environment().max_message_mb
    return min(int(mb * 2**20), _GRPC_CEILING)


def check_max_message_mb(mb: float) -> None:
    """Raise ConfigError unless ``mb`` is a usable message limit (a positive number of MiB)."""
    from ps_common.settings import ConfigError

    if not (mb > 0 and mb != float("inf")):
        raise ConfigError(f"--max-message-mb (TFPS_MAX_MESSAGE_MB) must be a positive number of MiB, got {mb:g}")


@dataclasses.dataclass(frozen=True)
class _TransportSetting:
    """The one transport setting both processes share, for callers without a configuration."""

    max_message_mb: float = MAX_MESSAGE_MB

    @classmethod
    def from_environment(cls) -> "_TransportSetting":
        from ps_common.settings import resolve

        setting = resolve(cls, None, os.environ)
        check_max_message_mb(setting.max_message_mb)
        return setting


def __getattr__(name: str):
    # wire.MAX_MESSAGE_BYTES, as before, but read when asked for, not at import.
    if name == "MAX_MESSAGE_BYTES":
        return max_message_bytes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def channel_options(max_bytes: int | None = None) -> list[tuple[str, int]]:
    """gRPC's message limits at ``max_bytes`` (None: ``max_message_bytes()``)."""
    limit = max_message_bytes() if max_bytes is None else max_bytes
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
    ]


# Keepalive: a client pings a connection that carried no data for KEEPALIVE_MS and
# drops it when the answer takes longer than KEEPALIVE_MS more; its calls then fail
# UNAVAILABLE, which workers ride out by reconnecting. Without it a cut link (a
# container disconnected from its network, a host gone without a FIN) leaves calls
# waiting for their deadlines, a minute or more. The server lets clients ping that
# often (gRPC's default would answer such pings with GOAWAY "too_many_pings"): its
# argument is "grpc.http2.min_ping_interval_without_data_ms" (the C macro is named
# ..._MIN_RECV_PING_INTERVAL_...; a key spelled after the macro is ignored, and a worker
# waiting in one call past three pings, ~30 s, was cut off).
KEEPALIVE_MS = 10_000


def client_options(max_bytes: int | None = None) -> list[tuple[str, int]]:
    return channel_options(max_bytes) + [
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging through a long barrier wait
    ]


# With many workers, a push waiting for the server's receive budget (ps_server.buffers)
# leaves its bytes in gRPC's own buffers, up to the stream's flow-control window, which
# gRPC grows by probing the bandwidth-delay product (on loopback to about the whole push):
# 256 workers' waiting pushes of 1.15 MB held 280 MB there. From MANY_WORKERS on, the
# server keeps each stream's window at STREAM_WINDOW_BYTES (enough for 1 GB/s at 200 us
# round trips per stream), so what waits stays in the workers' memory.
MANY_WORKERS = 64
STREAM_WINDOW_BYTES = 64 << 10


def server_options(max_bytes: int | None = None, workers: int = 1) -> list[tuple[str, int]]:
    # so_reuseport off: two servers must never silently share a port.
    options = channel_options(max_bytes) + [
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ]
    if workers >= MANY_WORKERS:
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES)]
    return options


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
