"""The membership over time, from the core's Status to the wire and to ps-status's table.

    python -m pytest -q tests/service/test_membership_status.py
"""

import time

from ps_server import service
from ps_server.core.parameter_server import ParameterServer
from ps_tools import status as ps_status
from tests.core.threads import FakeClock


def churned():
    clock = FakeClock(now=0.0)
    ps = ParameterServer("sync", 4, lease_timeout=5.0, elastic_min_workers=2, clock=clock)
    ps.register(0, 4, "host:10")
    ps.register(1, 4, "host:11")
    ps.register(-1, 4, "host:12")  # auto: the lowest free index, 2
    ps.leave(1)
    clock.now += 6.0
    ps.heartbeat(0)
    ps.tick()  # worker 2 silent past its lease
    return ps


def test_the_status_on_the_wire_lists_every_membership_event_in_order():
    msg = service.status_to_wire(churned().status(), time.monotonic())
    assert [(e.event, e.worker_id, e.worker_name, e.round, e.version) for e in msg.membership] == [
        ("joined", 0, "host:10", 0, 0), ("joined", 1, "host:11", 0, 0), ("joined", 2, "host:12", 0, 0),
        ("left", 1, "host:11", 0, 0), ("dead", 2, "host:12", 0, 0)]
    assert msg.membership_dropped == 0 and all(e.wall_time > 1e9 for e in msg.membership)  # the epoch's seconds


def test_ps_status_prints_the_membership_as_a_table_of_time_round_version_event_worker():
    msg = service.status_to_wire(churned().status(), time.monotonic())
    text = ps_status.render("127.0.0.1:1", msg, history=20)
    lines = text.splitlines()
    at = lines.index("  membership over time (5 events)")
    assert lines[at + 1].split() == ["time", "round", "version", "event", "worker"]
    rows = [line.split() for line in lines[at + 2:]]
    assert [r[1:] for r in rows] == [["0", "0", "joined", "0", "(host:10)"], ["0", "0", "joined", "1", "(host:11)"],
                                     ["0", "0", "joined", "2", "(host:12)"], ["0", "0", "left", "1", "(host:11)"],
                                     ["0", "0", "dead", "2", "(host:12)"]]
    assert all(len(r[0]) == 8 and r[0].count(":") == 2 for r in rows)  # HH:MM:SS


def test_ps_status_shows_the_newest_events_says_how_many_earlier_and_can_hide_them():
    msg = service.status_to_wire(churned().status(), time.monotonic())
    msg.membership_dropped = 7  # older ones the server let go
    lines = ps_status.render("127.0.0.1:1", msg, history=2).splitlines()
    assert "  membership over time (2 events, 10 earlier not shown)" in lines
    assert [line.split()[3] for line in lines[-2:]] == ["left", "dead"]
    assert "membership" not in ps_status.render("127.0.0.1:1", msg, history=0)


def test_ps_status_says_which_process_on_an_index_a_worker_is_once_another_took_it():
    ps = churned()
    ps.register(2, 4, "host:13", process="new")  # a new process on the dead worker's index
    msg = service.status_to_wire(ps.status(), time.monotonic())
    assert [w.incarnation for w in msg.workers] == [1, 1, 2]
    row = next(line for line in ps_status.render("127.0.0.1:1", msg).splitlines() if "host:13" in line)
    assert row.endswith("host:13  (process 2 on this index)")
