"""The emulated hosts themselves: names, /dev/shm, links that shape, cut and delay."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ps_tools import hosts as hosts_module
from ps_tools.hosts import Hosts, HostsError, unavailable

pytestmark = pytest.mark.hosts

SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen()
print("listening", flush=True)
c, _ = s.accept(); n = 0; t = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t = t or time.monotonic(); n += len(b)
print(n * 8 / (time.monotonic() - t))
"""

SOURCE = r"""
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
buf = b"x" * (1 << 20); t = time.monotonic()
while time.monotonic() - t < float(sys.argv[3]): c.sendall(buf)
c.close()
"""

ECHO = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    while True:
        b = c.recv(65536)
        if not b: break
        c.sendall(b)
"""

PING = r"""
import socket, sys, time
for attempt in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        time.sleep(0.1)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
best = 1e9
for _ in range(20):
    t = time.monotonic(); c.sendall(b"p"); c.recv(1); best = min(best, time.monotonic() - t)
print(best)
"""


@pytest.fixture
def two_hosts():
    why = unavailable()
    if why:
        pytest.skip(why)
    with Hosts(["tfps-a", "tfps-b"]) as h:
        yield h


def _listening(proc):
    line = proc.stdout.readline()
    assert "listening" in line, line + proc.stdout.read()


def test_each_host_has_its_own_name_address_hosts_file_and_dev_shm(two_hosts):
    h = two_hosts
    assert h.run("tfps-b", ["hostname"]).stdout.strip() == "tfps-b"
    assert h.run("tfps-b", [sys.executable, "-c", "import socket; print(socket.gethostname())"]).stdout.strip() \
        == "tfps-b"
    assert h.run("tfps-b", ["getent", "hosts", "tfps-a"]).stdout.split()[0] == h.address("tfps-a")
    addresses = h.run("tfps-a", ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout
    assert f"{h.address('tfps-a')}/24" in addresses
    # A file in one host's /dev/shm is seen by its other processes, never by another host.
    assert h.run("tfps-a", ["sh", "-c", "echo x > /dev/shm/tfps-probe"]).returncode == 0
    assert h.run("tfps-a", ["cat", "/dev/shm/tfps-probe"]).stdout.strip() == "x"
    assert h.run("tfps-b", ["ls", "/dev/shm"]).stdout.strip() == ""
    import os
    assert not os.path.exists("/dev/shm/tfps-probe")  # nor by this machine's own


def test_a_shaped_link_carries_at_most_its_rate(two_hosts):
    h = two_hosts
    h.shape("tfps-a", rate="50mbit")
    sink = h.popen("tfps-a", [sys.executable, "-c", SINK, "5001"], stdout=subprocess.PIPE, text=True)
    _listening(sink)
    assert h.run("tfps-b", [sys.executable, "-c", SOURCE, "tfps-a", "5001", "2"]).returncode == 0
    bits_per_s = float(sink.communicate(timeout=30)[0].split()[-1])
    # The bucket lets its first burst through at once; beyond that the link paces.
    assert bits_per_s < 50e6 * 1.3, bits_per_s


def test_a_cut_link_is_silent_until_restored(two_hosts):
    h = two_hosts
    sink = h.popen("tfps-a", [sys.executable, "-c", SINK, "5002"], stdout=subprocess.PIPE, text=True)
    _listening(sink)
    h.cut("tfps-b")
    refused = h.run("tfps-b", [sys.executable, "-c", SOURCE, "tfps-a", "5002", "0.1"])
    # Silence, not a refusal: the connect times out, or finds no one to answer ARP (as
    # a machine behind a failed switch does); never a reset.
    assert refused.returncode != 0 and ("timed out" in refused.stderr or "No route to host" in refused.stderr), \
        refused.stderr[-500:]
    h.restore("tfps-b")
    assert h.run("tfps-b", [sys.executable, "-c", SOURCE, "tfps-a", "5002", "0.2"]).returncode == 0
    sink.communicate(timeout=30)


def test_the_relay_adds_its_delay_in_each_direction(two_hosts):
    h = two_hosts
    echo = h.popen("tfps-a", [sys.executable, "-c", ECHO, "6001"], stdout=subprocess.PIPE, text=True)
    _listening(echo)
    h.relay("tfps-a", 6000, 6001, delay_ms=20)
    rtt = float(h.run("tfps-b", [sys.executable, "-c", PING, "tfps-a", "6000"]).stdout.split()[-1])
    assert rtt >= 0.040, rtt  # 2 x 20 ms at the least; a busy machine only adds


UDP_ECHO = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
while True:
    b, a = s.recvfrom(64); s.sendto(b, a)
"""

UDP_COUNT = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.2)
got = 0
for i in range(int(sys.argv[3])):
    s.sendto(b"%d" % i, (sys.argv[1], int(sys.argv[2])))
    try:
        s.recvfrom(64); got += 1
    except socket.timeout:
        pass
print(got)
"""


def test_loss_drops_packets_and_can_be_taken_away(two_hosts):
    h = two_hosts
    echo = h.popen("tfps-a", [sys.executable, "-c", UDP_ECHO, "7000"], stdout=subprocess.PIPE, text=True)
    _listening(echo)
    h.shape("tfps-b", loss=0.5)  # each way: a round trip survives a quarter of the time
    counted = h.run("tfps-b", [sys.executable, "-c", UDP_COUNT, "tfps-a", "7000", "40"])
    assert counted.returncode == 0, counted.stderr[-2000:]
    got = int(counted.stdout)
    assert got < 30, got  # 40 x 0.25 = 10 expected; all 40 would mean no loss
    h.shape("tfps-b", loss=0.0)
    assert int(h.run("tfps-b", [sys.executable, "-c", UDP_COUNT, "tfps-a", "7000", "20"]).stdout) == 20


def test_stop_kills_what_runs_in_the_hosts_and_removes_them(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    h = Hosts(["tfps-a"]).start()
    sleeper = h.popen("tfps-a", ["sleep", "600"])
    namespaces = [h.namespace("tfps-a"), h.bridge_namespace]
    h.stop()
    h.stop()  # idempotent
    assert sleeper.wait(timeout=10) != 0
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in namespaces), listed


def test_a_killed_owner_s_hosts_are_removed_at_the_next_start(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    # A run killed outright (SIGKILL: no tear-down) leaves its namespaces behind.
    script = ("import os, signal\nfrom ps_tools.hosts import Hosts\nh = Hosts(['tfps-left']).start()\n"
              "print(h.namespace('tfps-left'), flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=hosts_module.__file__.rsplit("/ps_tools/", 1)[0])
    left = done.stdout.strip()
    assert left and left in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with Hosts(["tfps-a"]):
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert left not in listed, listed


def test_every_host_runs_linux_s_default_tcp_whatever_the_machine_s_is():
    why = unavailable()
    if why:
        pytest.skip(why)
    read = [sys.executable, "-c", "print(open('/proc/sys/net/ipv4/tcp_congestion_control').read().strip())"]
    machine = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    other = next((c for c in hosts_module.tcp_available() if c not in ("cubic", machine)), None)
    with Hosts(["tfps-a"]) as h, Hosts(["tfps-b"], tcp=other) as o, Hosts(["tfps-c"], tcp=None) as m:
        assert h.run("tfps-a", read).stdout.strip() == "cubic"
        assert o.run("tfps-b", read).stdout.strip() == (other or machine)
        assert m.run("tfps-c", read).stdout.strip() == machine
    with pytest.raises(HostsError, match="congestion control 'warp'"):
        Hosts(["tfps-a"], tcp="warp")


def test_bad_names_and_rates_are_refused_in_one_line():
    with pytest.raises(HostsError, match="host name"):
        Hosts(["Bad_Name"])
    with pytest.raises(HostsError, match="repeat"):
        Hosts(["a", "a"])
    with pytest.raises(HostsError, match="write it as tc does"):
        hosts_module._tbf("fast")
