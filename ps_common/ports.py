"""Free TCP ports for a process that starts later and must be told its port.

``bind(port 0)`` hands out a port from the kernel's ephemeral range, and the kernel hands the
same range to every outgoing connection and every other ``bind(0)`` on the machine: a port
picked there and closed can be taken before the process it was picked for listens (a clean-clone
run once lost a worker's ``--metrics-port P+1`` so). Below that range only explicit binds take
ports, so these picks come from there, at a random start (two pickers rarely meet), each one
checked bindable and held until all are picked.
"""

from __future__ import annotations

import random
import socket

_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 20000


def _below_ephemeral() -> range:
    try:
        with open(_RANGE) as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    return range(_LOWEST, first) if first - _LOWEST >= 1000 else range(0)


def free_ports(count: int, host: str = "127.0.0.1", consecutive: bool = False) -> list[int]:
    """``count`` distinct ports free on ``host`` now; ``consecutive``: P, P+1, ... (a flag
    that takes one port and offsets the rest, as ``ps-launch --metrics-port`` does)."""
    span = _below_ephemeral()
    for _ in range(200):
        if span:
            start = random.randrange(span.start, span.stop - count)
            wanted = [start + i for i in range(count)] if consecutive else random.sample(span, count)
        else:  # no room below the ephemeral range here: the kernel's picks
            wanted = [0] * count
        got = _bind_all(host, wanted)
        if got and (not consecutive or got == list(range(got[0], got[0] + count))):
            return got
    raise RuntimeError(f"no {count} free ports on {host}")


def _bind_all(host: str, ports: list[int]) -> list[int]:
    held: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket()
            held.append(s)
            s.bind((host, port))
        return [s.getsockname()[1] for s in held]
    except OSError:
        return []
    finally:
        for s in held:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
