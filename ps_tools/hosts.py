"""Emulated hosts: machines on one Linux box, joined by real, shaped network links.

    with Hosts(["tfps-ps-0", "tfps-worker-0", "tfps-worker-1"], rate="1gbit") as hosts:
        ps = hosts.popen("tfps-ps-0", ["ps-server", "--port", "2222", ...])
        w = hosts.popen("tfps-worker-0", ["ps-worker", "--ps", "tfps-ps-0:2222", ...])
        hosts.cut("tfps-worker-0"); ...; hosts.restore("tfps-worker-0")
        hosts.shape("tfps-ps-0", rate="100mbit", loss=0.01)

Each host is a network namespace of its own (``tfps<tag>-<name>``) with one
interface, ``eth0``, at ``10.231.0.<i+1>/24``, one end of a veth pair whose other
end is a port of a bridge in a namespace of its own (``tfps<tag>-bridge``; not the
root namespace, whose FORWARD policy Docker sets to DROP). What a process started
in a host sees is what it would see on a machine of its own:

* its **name**: a UTS namespace per process with the host's name (``hostname``,
  ``socket.gethostname()``), and a hosts file listing every host by name
  (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``),
  so ``TF_CONFIG`` and ``--ps`` may name hosts (``tfps-ps-0:2222``);
* its own **/dev/shm**: a directory of this host's bind-mounted over ``/dev/shm`` in
  the process's mount namespace. Every process of one host shares it; no two hosts
  do, so tfps' same-host fast path (a shared-memory segment the server must open)
  falls back to the wire between hosts exactly as it does between real machines;
* its **link**: ``tc`` on both ends of the veth pair (``tbf``: the host's upload on
  ``eth0``, its download on the bridge port), so a host's traffic in each direction
  shares one rate-limited, queueing link, with real TCP congestion control; loss
  with ``iptables -m statistic --mode random`` where packets arrive (``loss`` of
  what the host receives, and of what it sends, dropped at the receiving host, so
  no sender sees an error). Its **TCP** is Linux's default congestion control,
  ``cubic``, whatever the machine's own namespace uses (``tcp``: another the kernel
  has, such as ``bbr``, or None to inherit it): a figure measured on emulated hosts
  then does not depend on the machine it ran on (``bench/allreduce_hosts.py`` shows
  how much the choice weighs when many flows share a link). This kernel has no
  ``netem``, so **latency** is added
  by a user-space relay (``relay``): a TCP proxy in the server's host that holds each
  chunk it forwards for the delay, in each direction, so a connection through it
  has ``2 × delay`` more round-trip time on real sockets (and the relay's own
  copying, well under a millisecond here);
* **cut** takes the host's port off the bridge (no RST, no FIN, no "no route":
  the host goes silent, as when the switch between machines fails), **restore**
  brings it back with the link's shaping.

Set-up and tear-down are idempotent. A set of hosts belongs to the process that
made it (its pid is in the state directory); a later ``start`` removes every set
whose owner is no longer alive (a killed test run), and ``stop`` kills every
process still in its hosts (``ip netns pids``) before deleting them, so nothing
started in a host outlives the set. Processes started with ``popen`` also die with
the process that started them (PR_SET_PDEATHSIG, ``ps_common.procs``).

Needs root, ``ip`` (iproute2) and ``tc``; ``unavailable()`` says in one line why
not, for callers to skip with. Plain Python: no gRPC, no TensorFlow.

The relay is also this module's command line::

    python -m ps_tools.hosts relay --listen 10.231.0.1:2222 --to 127.0.0.1:2223 --delay-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterable, Mapping, Sequence

from ps_common.procs import dying_with_parent

STATE_DIR = "/run/tfps-hosts"
PREFIX = "tfps"
SUBNET = "10.231.0"
_NS_RE = re.compile(rf"^{PREFIX}([0-9a-f]+)-(.+)$")
_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,58}[a-z0-9])?$")  # a DNS name: tfps-ps-0, job-ps-0.ns.svc


DEFAULT_TCP = "cubic"  # Linux's default congestion control (module docstring)


def tcp_available() -> list[str]:
    """The congestion controls this kernel has loaded (a namespace may pick any of them)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


_ALLOWED_TCP = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"


@contextlib.contextmanager
def _tcp_allowed(name: str):
    """While it lasts, ``name`` is in the machine's tcp_allowed_congestion_control. Linux lets
    a network namespace other than the machine's choose as its default only a congestion
    control on that list (others: EPERM), which holds the machine's own default and reno
    (a machine that runs bbr: "reno bbr", cubic loaded but not allowed). The list is put
    back as it was: a namespace keeps the default it chose."""
    with open(_ALLOWED_TCP) as f:
        before = f.read().split()
    if name in before:
        yield
        return
    with open(_ALLOWED_TCP, "w") as f:
        f.write(" ".join(before + [name]))
    try:
        yield
    finally:
        with open(_ALLOWED_TCP, "w") as f:
            f.write(" ".join(before))


class HostsError(RuntimeError):
    """Emulated hosts cannot be set up or changed; the message says why."""


def unavailable() -> str | None:
    """None if this machine can emulate hosts; otherwise one line saying why not."""
    if sys.platform != "linux":
        return f"emulated hosts need Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth pairs, tc)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"emulated hosts need the {tool!r} command (iproute2, util-linux), not found"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip() or probe.returncode}"
    return None


def _run(argv: Sequence[str], check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(list(argv), capture_output=True, text=True, input=input)
    if check and done.returncode != 0:
        raise HostsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


@dataclasses.dataclass
class Link:
    """How one host's link is shaped: ``rate`` as tc writes it ("1gbit", "100mbit"; None:
    as fast as the box), ``loss`` the chance each packet is dropped, in each direction."""

    rate: str | None = None
    loss: float = 0.0


def rate_bits(rate: str) -> float:
    """Bits per second of a rate as tc writes it ("20mbit", "1gbit", "500kbps"); HostsError otherwise."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)\s*", rate.lower())
    if not m:
        raise HostsError(f"rate {rate!r}: write it as tc does, e.g. 1gbit, 100mbit, 500kbit")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return value * (8 if m.group(3) == "bps" else 1)


def _tbf(rate: str) -> list[str]:
    """A tbf with a bucket of 1 ms at the rate (at least 64 KiB, so that one GSO packet of
    veth fits it whole) and a queue of 20 ms: TCP sees a link that paces and queues."""
    bits = rate_bits(rate)
    burst = max(65536, int(bits / 8 * 0.001))
    limit = max(2 * burst, int(bits / 8 * 0.020))
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


def _owner_alive(tag: str) -> bool:
    try:
        with open(os.path.join(STATE_DIR, tag, "owner")) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A pid reused by another program is not the owner: compare its start time.
    try:
        with open(os.path.join(STATE_DIR, tag, "owner")) as f:
            recorded = f.read().split()[1]
        return recorded == _start_time(pid)
    except (OSError, IndexError):
        return False


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def _kill_namespace_processes(ns: str) -> None:
    for _ in range(50):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _remove_set(tag: str, namespaces: Iterable[str]) -> None:
    for ns in namespaces:
        _kill_namespace_processes(ns)
    for ns in namespaces:
        _run(["ip", "netns", "delete", ns], check=False)
        shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
    root = os.path.join(STATE_DIR, tag)
    if os.path.isdir(root):
        for entry in os.listdir(root):
            shm = os.path.join(root, entry, "shm")
            if os.path.ismount(shm):
                _run(["umount", "-l", shm], check=False)
        shutil.rmtree(root, ignore_errors=True)


def remove_leftovers() -> list[str]:
    """Delete every set of hosts whose owner process is gone; returns the namespaces removed."""
    sets: dict[str, list[str]] = {}
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = _NS_RE.match(ns)
        if m:
            sets.setdefault(m.group(1), []).append(ns)
    if os.path.isdir(STATE_DIR):
        for tag in os.listdir(STATE_DIR):
            sets.setdefault(tag, [])
    removed = []
    for tag, namespaces in sets.items():
        if not _owner_alive(tag):
            _remove_set(tag, namespaces)
            removed += namespaces
    return removed


class Hosts:
    """``names`` emulated hosts joined by a bridge (module docstring); a context manager."""

    def __init__(self, names: Sequence[str], rate: str | None = None, loss: float = 0.0,
                 links: Mapping[str, Link] | None = None, aliases: Mapping[str, Iterable[str]] | None = None,
                 tcp: str | None = DEFAULT_TCP):
        """``links``: a host's own shaping instead of ``rate`` and ``loss``; ``aliases``: more
        names a host answers to in every hosts file (a pod's short and long DNS names);
        ``tcp``: every host's congestion control (None: the machine's)."""
        names = list(names)
        if not names:
            raise HostsError("no hosts named")
        for name in names:
            if not _NAME_RE.match(name):
                raise HostsError(f"host name {name!r}: lower-case letters, digits, '-' and '.', at most 60")
        if len(set(names)) != len(names):
            raise HostsError(f"host names repeat: {names}")
        if len(names) > 250:
            raise HostsError(f"at most 250 hosts, got {len(names)}")
        self.names = names
        self.tag = f"{os.getpid():x}{int(time.time() * 1000) % 0xfff:03x}"
        self.links = {n: dataclasses.replace((links or {}).get(n) or Link(rate, loss)) for n in names}
        self.aliases = {n: [a for a in (aliases or {}).get(n, ()) if a != n] for n in names}
        unknown = set(aliases or {}) - set(names)
        if unknown:
            raise HostsError(f"aliases for hosts that are not named: {sorted(unknown)}")
        if tcp is not None and tcp not in tcp_available():
            raise HostsError(f"TCP congestion control {tcp!r}: this kernel has {', '.join(tcp_available())}")
        self.tcp = tcp
        self._started = False

    # -- names ----------------------------------------------------------------------
    def namespace(self, name: str) -> str:
        self._index(name)
        return f"{PREFIX}{self.tag}-{name}"

    @property
    def bridge_namespace(self) -> str:
        return f"{PREFIX}{self.tag}-bridge"

    def address(self, name: str) -> str:
        """The host's address on the bridge."""
        return f"{SUBNET}.{self._index(name) + 1}"

    def _index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise HostsError(f"no host {name!r} (hosts: {', '.join(self.names)})") from None

    def _port(self, name: str) -> str:
        return f"p{self._index(name)}"

    def shm_dir(self, name: str) -> str:
        """The directory this host's processes see as /dev/shm."""
        return os.path.join(STATE_DIR, self.tag, name, "shm")

    # -- set-up and tear-down -------------------------------------------------------------
    def start(self) -> "Hosts":
        if self._started:
            return self
        why = unavailable()
        if why:
            raise HostsError(why)
        remove_leftovers()
        root = os.path.join(STATE_DIR, self.tag)
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, "owner"), "w") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
        self._started = True
        try:
            self._build()
        except BaseException:
            self.stop()
            raise
        return self

    def _build(self) -> None:
        br = self.bridge_namespace
        _run(["ip", "netns", "add", br])
        _run(["ip", "-n", br, "link", "set", "lo", "up"])
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
            f"{self.address(n)}\t{' '.join([n, *self.aliases[n]])}\n" for n in self.names)
        for name in self.names:
            ns = self.namespace(name)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", self._port(name),
                  "netns", br])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", br, "link", "set", self._port(name), "master", "br0"])
            _run(["ip", "-n", br, "link", "set", self._port(name), "up"])
            etc = os.path.join("/etc/netns", ns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts_file)
            shm = self.shm_dir(name)
            os.makedirs(shm, exist_ok=True)
            os.chmod(shm, 0o1777)
        if self.tcp is not None:
            with _tcp_allowed(self.tcp):
                for name in self.names:
                    _run(["ip", "netns", "exec", self.namespace(name), "sysctl", "-qw",
                          f"net.ipv4.tcp_congestion_control={self.tcp}"])
        for name in self.names:
            self._apply(name)

    def stop(self) -> None:
        """Kill every process in the hosts, delete them (idempotent)."""
        if not self._started:
            return
        _remove_set(self.tag, [self.namespace(n) for n in self.names] + [self.bridge_namespace])
        self._started = False

    def __enter__(self) -> "Hosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- links ------------------------------------------------------------------------
    def queue_counts(self, name: str) -> dict[str, tuple[int, int]]:
        """{"up": (packets sent, packets dropped), "down": ...}: what the queues of the host's
        link (its upload on eth0, its download on the bridge port) have passed and dropped
        since they were made; (0, 0) for a direction without shaping."""
        out = {}
        for way, where, dev in (("up", self.namespace(name), "eth0"), ("down", self.bridge_namespace, self._port(name))):
            text = _run(["ip", "netns", "exec", where, "tc", "-s", "qdisc", "show", "dev", dev]).stdout
            m = re.search(r"Sent \d+ bytes (\d+) pkt \(dropped (\d+)", text)
            out[way] = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        return out

    def shape(self, name: str, rate: str | None = ..., loss: float | None = None) -> None:
        """Change the host's link while it runs: ``rate`` (None: unlimited), ``loss``."""
        link = self.links[self.names[self._index(name)]]
        if rate is not ...:
            if rate is not None:
                rate_bits(rate)
            link.rate = rate
        if loss is not None:
            if not 0.0 <= loss < 1.0:
                raise HostsError(f"loss must be in [0, 1), got {loss}")
            link.loss = loss
        self._apply(name)

    def _apply(self, name: str) -> None:
        link = self.links[name]
        ns, br = self.namespace(name), self.bridge_namespace
        for where, dev in ((ns, "eth0"), (br, self._port(name))):
            if link.rate:
                _run(["ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", *_tbf(link.rate)])
            else:
                _run(["ip", "netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
        self._apply_loss()

    def _apply_loss(self) -> None:
        """Loss is dropped where packets arrive (INPUT), so that no sender sees it as an
        error (a drop in OUTPUT fails the sending call with EPERM): host H drops ``loss``
        of H's packets from anywhere (its download) and, of each other host X's, X's
        ``loss`` (X's upload)."""
        lossy = {n: link.loss for n, link in self.links.items() if link.loss > 0}
        if not lossy and not getattr(self, "_lossy", False):
            return
        if shutil.which("iptables") is None:
            raise HostsError("packet loss needs the 'iptables' command, not found")
        for name in self.names:
            ns = self.namespace(name)
            _run(["ip", "netns", "exec", ns, "iptables", "-F", "INPUT"])
            rules = [([], lossy[name])] if name in lossy else []
            rules += [(["-s", self.address(x)], p) for x, p in lossy.items() if x != name]
            for match, p in rules:
                _run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", "eth0", *match, "-m", "statistic",
                      "--mode", "random", "--probability", f"{p:.6f}", "-j", "DROP"])
        self._lossy = bool(lossy)

    def cut(self, name: str) -> None:
        """The host goes silent: its port leaves the bridge, so every packet to and from it
        is lost while both ends of its link stay up, as when a switch between machines
        fails: no RST, no FIN, no "no route" (a carrier lost on the host's own interface
        would tell its processes at once)."""
        _run(["ip", "-n", self.bridge_namespace, "link", "set", self._port(name), "nomaster"])

    def restore(self, name: str) -> None:
        """Bring a cut link back, shaped as before."""
        _run(["ip", "-n", self.bridge_namespace, "link", "set", self._port(name), "master", "br0"])
        self._apply(name)

    # -- processes --------------------------------------------------------------------
    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run in host ``name``: its network, name, hosts file and /dev/shm."""
        return ["ip", "netns", "exec", self.namespace(name), "unshare", "--uts", "--", "sh", "-c",
                'hostname "$1" && mount --bind "$2" /dev/shm && shift 2 && exec "$@"', "sh", name,
                self.shm_dir(name), *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in host ``name`` (subprocess.Popen's keyword arguments); it dies
        with this process, and with the set at ``stop``."""
        if not self._started:
            raise HostsError("start the hosts first")
        return subprocess.Popen(dying_with_parent(self.command(name, argv)), **kwargs)

    def run(self, name: str, argv: Sequence[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` in host ``name`` to its end (subprocess.run's keyword arguments)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(dying_with_parent(self.command(name, argv)), timeout=timeout, **kwargs)

    def kill_all(self, name: str) -> None:
        """Kill every process running in host ``name`` (a machine that lost power)."""
        _kill_namespace_processes(self.namespace(name))

    def relay(self, name: str, listen_port: int, target_port: int, delay_ms: float, **kwargs) -> subprocess.Popen:
        """A latency relay in host ``name``: ``<host>:listen_port`` forwards to
        ``127.0.0.1:target_port`` holding every chunk ``delay_ms`` in each direction."""
        argv = [sys.executable, "-m", "ps_tools.hosts", "relay", "--listen", f"{self.address(name)}:{listen_port}",
                "--to", f"127.0.0.1:{target_port}", "--delay-ms", str(delay_ms)]
        kwargs.setdefault("stdout", subprocess.DEVNULL)
        kwargs.setdefault("stderr", subprocess.DEVNULL)
        return self.popen(name, argv, **kwargs)


# -- the latency relay ----------------------------------------------------------------------

async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy reader to writer, each chunk written ``delay`` seconds after it was read, in order."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()

    async def send() -> None:
        while True:
            due, chunk = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                break
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    sender = asyncio.ensure_future(send())
    try:
        while True:
            chunk = await reader.read(1 << 16)
            queue.put_nowait((loop.time() + delay, chunk))
            if not chunk:
                break
        await sender
    except (ConnectionError, OSError):
        sender.cancel()
    finally:
        if not sender.done():
            sender.cancel()


async def _relay(listen: tuple[str, int], target: tuple[str, int], delay: float) -> None:
    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(*target)
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(_pipe(client_reader, server_writer, delay), _pipe(server_reader, client_writer, delay))
        finally:
            for w in (client_writer, server_writer):
                w.close()

    server = await asyncio.start_server(handle, *listen, reuse_address=True)
    async with server:
        await server.serve_forever()


def _host_port(raw: str) -> tuple[str, int]:
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, got {raw!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ps_tools.hosts", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("relay", help="a TCP relay that adds latency in each direction")
    r.add_argument("--listen", type=_host_port, required=True, metavar="HOST:PORT")
    r.add_argument("--to", type=_host_port, required=True, metavar="HOST:PORT")
    r.add_argument("--delay-ms", type=float, required=True)
    sub.add_parser("clean", help="remove emulated hosts left by runs that were killed")
    args = p.parse_args(argv)
    if args.command == "clean":
        for ns in remove_leftovers():
            print(f"removed {ns}")
        return 0
    if args.delay_ms < 0:
        p.error("--delay-ms must be >= 0")
    try:
        asyncio.run(_relay(args.listen, args.to, args.delay_ms / 1000.0))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
