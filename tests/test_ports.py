"""ps_common.ports: ports for a process told its port, picked below the ephemeral range.

A port picked there is not handed to an outgoing connection or a ``bind(0)`` before the
process it was picked for listens (a clean-clone run once lost a worker's metrics port so)."""

import socket

from ps_common.ports import free_ports


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_picks_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(20000 <= p < _ephemeral_low() for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_run_over_a_port_someone_listens_on_is_skipped(monkeypatch):
    from ps_common import ports

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", free_ports(1)[0]))
        blocker.listen()
        held = blocker.getsockname()[1]
        starts = iter([held - 1, held - 1, held + 1])  # twice over the listener, then past it
        monkeypatch.setattr(ports.random, "randrange", lambda lo, hi: next(starts))
        assert free_ports(3, consecutive=True) == [held + 1, held + 2, held + 3]
