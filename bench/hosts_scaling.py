"""Scaling on emulated hosts: push+pull throughput and sync training examples/s against
the number of worker hosts, with 1, 2 and 4 PS hosts, each next to the limit the links impose.

    sudo python bench/hosts_scaling.py --rate 100mbit --workers 1,2,4,8 --ps 1,2,4 --json hosts_scaling.json
    sudo python bench/hosts_scaling.py --quick        # the test's run: 1 and 2 PS hosts x 2 worker hosts, ~30 s

Every process runs on an emulated host of its own (``ps_tools.hosts``: a network
namespace, a name, a /dev/shm, one link shaped to ``--rate`` in each direction with
``tc tbf``, real TCP). The PS hosts are ``tfps-ps-0..3``, the worker hosts
``tfps-worker-0..7``; one set of hosts serves the whole run, and each configuration
starts fresh ``ps-server`` processes (one per PS host, each an ordinary shard) and
fresh clients, then stops them.

**The model** is the built-in ``mlp`` (``worker.model``): 936,330 float32
parameters, 3.75 MB, in six variables. With several PS hosts it is split exactly as
tfps splits it: through ``ShardedClient`` (``worker.sharding.plan``: large variables
cut into row slices, balanced by bytes). The split is not always even: with 4 shards
the largest holds 28.4 % of the bytes, not 25 % (the 0.5 MB kernel makes two slices of
256 KiB, the slicing minimum), so that shard's link fills first.

**(a) Push+pull throughput** (no TensorFlow, so that the clients cost little CPU):
on each worker host one synthetic worker (``--child synth``: a ``ShardedClient`` over
every PS host) pulls the whole model and pushes a gradient of it, again and again,
in async mode (no barrier: one worker's pull may overlap another's push, so both
directions of a PS link can be busy at once; a sync round would line them up).
Throughput = tensor bytes pushed + bytes pulled per second over a window of
``--seconds``, opened once every worker has been busy for 2 s; a call that straddles
an edge of the window counts for the share of its time inside. Beside it: the bytes on
the PS hosts' links over the window (``/proc/<server pid>/net/dev``, both directions;
the kernel counts a GSO super-packet's headers once, so this is close to the tensor
bytes), the TCP segments retransmitted by every host of the configuration
(``/proc/<pid>/net/snmp``: the links' tbf queues of 20 ms drop what overflows them),
the CPU of our processes and of the whole machine, and **raw**: the same pulls and
pushes, shard by shard, between bare TCP servers and clients on the same hosts
(``--child raw-server`` / ``raw-worker``; ``--no-raw`` leaves them out), which says how
much of the distance to the limit is TCP's on these links and how much is tfps'.

**The limit** each direction: every byte crosses one PS host's link and one worker
host's link, each ``r = rate / 8`` bytes per second each way. The PS side carries at
most ``r / s_max`` per direction (``s_max``: the largest shard's fraction of the
model; ``P x r`` when the split is even: the PS hosts' total link rate), the worker
side ``W x r``. Limit = ``min(r / s_max, W x r)`` per direction; push+pull limit =
twice that (full duplex: pushes in while pulls go out). Fraction = throughput / limit.
"Turns" = ``min(limit, W x r)``: a worker pulls, then pushes, so its own link is busy
one way at a time and W workers move at most ``W x r`` push+pull together. The tensor
bytes leave out the headers (TCP/IP, Ethernet, HTTP/2 and gRPC framing: about 4 % of
what tbf counts), so about 0.96 is the ceiling of a fraction.

**(b) Sync training**: ``ps-server --mode sync`` on each PS host and a real
``ps-worker`` (TensorFlow) on each worker host, ``--model mlp --dataset digits``,
``--batch-per-worker`` examples per worker per step (global batch = W x that), one
intra-op thread per worker. Step time is the chief's, from its history
(``--history-json``), over the steps after ``--warmup-steps``; examples/s = global
batch / step time. "Links need" = the time the busiest link needs for one step's
bytes, full duplex (the max of the two directions): ``max(W x s_max, 1) x M / r``
(``M``: the model's bytes; W gradients in through the PS links and W models out; a
worker's own link carries one of each). The ratio step time / links need is 1.0 when
the step is link-bound with both directions busy at once, about 2 when pushes and
pulls take turns.

It prints (a) and (b) with each figure's limit, the fraction of it reached, the
ratios 2 PS / 1 PS and 4 PS / 1 PS at each worker count (from this one run), and the
CPU use (of one core: our servers and clients; and the whole machine, busy % from
/proc/stat, x 2 cores): a figure measured with the cores near 200 % is limited by CPU,
not by the links. Needs root
(``ps_tools.hosts.unavailable()`` says why not). Exit status 0 when every
configuration ran, 1 otherwise, 2 for bad arguments or no emulated hosts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, ROOT)

from bench.load_test import cpu_seconds  # noqa: E402
from ps_common.procs import wait_for_port_file  # noqa: E402

# worker.model's "mlp" (Flatten, Dense(1024), Dense(128), Dense(10)), by shape: the
# synthetic clients import no TensorFlow. The names are the Keras variables' paths.
MLP: dict[str, tuple[int, ...]] = {
    "dense/kernel": (784, 1024), "dense/bias": (1024,),
    "dense_1/kernel": (1024, 128), "dense_1/bias": (128,),
    "dense_2/kernel": (128, 10), "dense_2/bias": (10,),
}
MODEL_BYTES = sum(4 * math.prod(s) for s in MLP.values())  # 3,745,320
# worker.model's "mlp25m" (Flatten, Dense(8192), Dense(2304), Dense(10)): 101,321,768 bytes
SHAPES: dict[str, dict[str, tuple[int, ...]]] = {"mlp": MLP, "mlp25m": {
    "dense/kernel": (784, 8192), "dense/bias": (8192,),
    "dense_1/kernel": (8192, 2304), "dense_1/bias": (2304,),
    "dense_2/kernel": (2304, 10), "dense_2/bias": (10,),
}}


def model_bytes(model: str = "mlp") -> int:
    return sum(4 * math.prod(s) for s in SHAPES[model].values())
PS_HOSTS = [f"tfps-ps-{i}" for i in range(4)]
WORKER_HOSTS = [f"tfps-worker-{i}" for i in range(8)]
PORT = 2300  # each configuration its own port: PORT + its number
SGD = {"name": "sgd", "learning_rate": 1e-3}
CALL_TIMEOUT = 300.0


def rate_bytes(rate: str) -> float:
    """Bytes per second of a tc rate ("100mbit")."""
    from ps_tools.hosts import rate_bits

    return rate_bits(rate) / 8


def shares(num_ps: int, model: str = "mlp") -> list[float]:
    """Each shard's fraction of the model's bytes, as ShardedClient places it."""
    from worker import sharding

    placement = sharding.plan({n: (s, "float32") for n, s in SHAPES[model].items()}, num_ps)
    load = [0] * num_ps
    for p in placement.pieces:
        load[p.shard] += 4 * math.prod(p.shape)
    return [x / model_bytes(model) for x in load]


def limit_per_direction(workers: int, num_ps: int, r: float) -> tuple[float, str]:
    """(bytes/s each way the links allow, which side binds)."""
    ps_side = r / max(shares(num_ps))
    worker_side = workers * r
    return (ps_side, "PS links") if ps_side <= worker_side else (worker_side, "worker links")


def links_need_s(workers: int, num_ps: int, r: float, model: str = "mlp") -> float:
    """Seconds the busiest link needs for one sync step's bytes, full duplex."""
    return max(workers * max(shares(num_ps, model)), 1.0) * model_bytes(model) / r


# -- measuring the machine ---------------------------------------------------------------
def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_percent(before: tuple[float, float], after: tuple[float, float]) -> float:
    busy, total = after[0] - before[0], after[1] - before[1]
    return round(100 * busy / total, 1) if total > 0 else float("nan")


def net_bytes(pid: int) -> tuple[int, int]:
    """(received, sent) bytes on eth0 of the host process ``pid`` runs in."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return 0, 0


def tcp_segments(pid: int) -> tuple[int, int]:
    """(segments sent, segments retransmitted) by TCP in the host process ``pid`` runs in."""
    with open(f"/proc/{pid}/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    named = dict(zip(rows[0][1:], rows[1][1:]))
    return int(named["OutSegs"]), int(named["RetransSegs"])


def hosts_tcp(choice: str) -> str | None:
    """``--tcp``'s value as ``Hosts(tcp=...)`` takes it: 'machine' is the machine's own (None)."""
    return None if choice == "machine" else choice


def queue_counts(hosts, names) -> dict:
    """Every named host's link queues: {name: {"up": (packets, dropped), "down": ...}}."""
    return {n: hosts.queue_counts(n) for n in names}


def drop_percent(before: dict, after: dict) -> dict[str, float]:
    """Of the packets the hosts' queues took between two ``queue_counts``, the per cent they
    dropped, per direction ("up": the hosts' own uploads; "down": the bridge ports towards them)."""
    out = {}
    for way in ("up", "down"):
        sent = sum(after[n][way][0] - before[n][way][0] for n in before)
        dropped = sum(after[n][way][1] - before[n][way][1] for n in before)
        out[way] = round(100 * dropped / max(1, sent + dropped), 2)
    return out


def machine() -> dict:
    return {"nproc": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
            "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                         if line.startswith("model name")), platform.processor())}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# -- (a) the synthetic worker, run in a worker host --------------------------------------
def synth_child(args: argparse.Namespace) -> int:
    """A synthetic worker: register on every shard, (chief) initialize, say ``ready``; on
    ``go WARM START END`` (CLOCK_MONOTONIC, shared by every namespace of this machine) pull
    and push from WARM until END; print a JSON tally of the bytes moved in [START, END] (a
    call that straddles an edge counts for the part of its time inside)."""
    from worker.sharded_client import ShardedClient

    addresses = args.addresses.split(",")
    index, workers = args.index, args.num_workers
    grads = {n: np.ones(s, np.float32) for n, s in MLP.items()}
    with ShardedClient(addresses, timeout=CALL_TIMEOUT) as client:
        client.wait_ready(120)
        reg = client.register(index, workers, name=f"synth-{index}")
        if index == 0:
            client.initialize(reg.worker_id, {n: np.zeros(s, np.float32) for n, s in MLP.items()}, SGD)
        state = {"version": client.wait_initialized(reg.worker_id, 120)[0], "step": 0}

        def pull() -> int:
            state["version"], values = client.pull(reg.worker_id)
            return sum(v.nbytes for v in values.values())

        def push() -> int:
            reply = client.push(reg.worker_id, state["step"], state["version"], 1, grads)
            state["version"] = reply.version
            state["step"] += 1
            return MODEL_BYTES

        return _window(pull, push)


def _window(pull, push) -> int:
    print("ready", flush=True)
    _, warm, start, end = sys.stdin.readline().split()
    warm, start, end = float(warm), float(start), float(end)

    def inside(t0: float, t1: float) -> float:
        """The fraction of the call [t0, t1] inside the window [start, end]."""
        return max(0.0, min(t1, end) - max(t0, start)) / (t1 - t0) if t1 > t0 else float(start <= t1 <= end)

    pushed = pulled = 0.0
    steps = 0
    time.sleep(max(0.0, warm - time.monotonic()))
    cpu0 = sum(os.times()[:2])
    while time.monotonic() < end:
        t0 = time.monotonic()
        n = pull()
        t1 = time.monotonic()
        pulled += n * inside(t0, t1)
        n = push()
        pushed += n * inside(t1, time.monotonic())
        steps += 1
    print(json.dumps({"pushed": pushed, "pulled": pulled, "steps": steps, "cpu_s": sum(os.times()[:2]) - cpu0}),
          flush=True)
    return 0


# -- (a) the same traffic on raw sockets: what TCP on these links gives ----------------
def raw_server_child(args: argparse.Namespace) -> int:
    """A bare PS on one TCP port: ``P`` + 8-byte length, then that many bytes: read them,
    answer one byte; ``G`` + length: send that many bytes. A thread per connection."""
    import socket
    import struct
    import threading

    def serve(conn) -> None:
        buf = bytearray(MODEL_BYTES)
        view = memoryview(buf)
        head = bytearray(9)
        try:
            while True:
                if not _recv_exact(conn, memoryview(head)):
                    return
                kind, n = head[:1], struct.unpack("!Q", head[1:])[0]
                if kind == b"P":
                    _recv_exact(conn, view[:n])
                    conn.sendall(b"k")
                else:
                    conn.sendall(view[:n])
        except OSError:
            return
        finally:
            conn.close()

    srv = socket.create_server(("0.0.0.0", args.port), reuse_port=False)
    srv.listen(64)
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(args.port))
    os.replace(args.port_file + ".tmp", args.port_file)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _recv_exact(sock, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def raw_worker_child(args: argparse.Namespace) -> int:
    """A synthetic worker on raw sockets: the shard of each PS host is its share of the
    model (as ShardedClient places it); a pull fetches every share at once, one thread
    per PS host, then a push sends them, as ``synth`` does through tfps."""
    import socket
    import struct
    from concurrent.futures import ThreadPoolExecutor

    addresses = args.addresses.split(",")
    sizes = [round(x * MODEL_BYTES) for x in shares(len(addresses))]
    conns = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        c = socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conns.append(c)
    bufs = [bytearray(n) for n in sizes]
    pool = ThreadPoolExecutor(len(conns))

    def pull_one(i: int) -> int:
        conns[i].sendall(b"G" + struct.pack("!Q", sizes[i]))
        _recv_exact(conns[i], memoryview(bufs[i]))
        return sizes[i]

    def push_one(i: int) -> int:
        conns[i].sendall(b"P" + struct.pack("!Q", sizes[i]))
        conns[i].sendall(bufs[i])
        _recv_exact(conns[i], memoryview(bytearray(1)))
        return sizes[i]

    return _window(lambda: sum(pool.map(pull_one, range(len(conns)))),
                   lambda: sum(pool.map(push_one, range(len(conns)))))


# -- the runs ----------------------------------------------------------------------------
class Run:
    """The hosts of the whole run, and a fresh port per configuration."""

    def __init__(self, hosts, workdir: str, rate: str):
        self.hosts, self.workdir, self.rate = hosts, workdir, rate
        self.r = rate_bytes(rate)
        self.configs = 0

    def env(self) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
        env.pop("TF_CONFIG", None)
        return env

    def servers(self, num_ps: int, workers: int, mode: str, tag: str, *extra: str) -> tuple[list, list[str]]:
        """``ps-server`` on each of the first ``num_ps`` PS hosts; ``mode`` raw: the bare one."""
        self.configs += 1
        port = PORT + self.configs
        procs, addresses = [], []
        for i, host in enumerate(PS_HOSTS[:num_ps]):
            port_file = os.path.join(self.workdir, f"{tag}-port-{i}")
            log = open(os.path.join(self.workdir, f"{tag}-ps{i}.log"), "w")
            argv = [sys.executable, os.path.abspath(__file__), "--child", "raw-server", "--port", str(port),
                    "--port-file", port_file] if mode == "raw" else [
                sys.executable, "-m", "ps_server", "--host", "0.0.0.0", "--port", str(port), "--port-file", port_file,
                "--mode", mode, "--num-workers", str(workers), "--threads", str(2 * workers + 16),
                "--lease-timeout", "3600", "--barrier-timeout", str(CALL_TIMEOUT), "--log-level", "WARNING", *extra]
            procs.append(self.hosts.popen(host, argv,
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir, env=self.env()))
            log.close()
            addresses.append(f"{host}:{port}")
        for i, p in enumerate(procs):
            wait_for_port_file(os.path.join(self.workdir, f"{tag}-port-{i}"), p, 60)
        return procs, addresses

    def log_tail(self, name: str, n: int = 1500) -> str:
        try:
            with open(os.path.join(self.workdir, name)) as f:
                return f.read()[-n:]
        except OSError:
            return ""


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def measure_throughput(run: Run, num_ps: int, workers: int, seconds: float, mode: str) -> dict:
    """One configuration's push+pull throughput; ``mode`` raw: on bare sockets."""
    tag = f"load-{mode}-{num_ps}ps-{workers}w"
    servers, addresses = run.servers(num_ps, workers, mode, tag)
    children = []
    try:
        for i, host in enumerate(WORKER_HOSTS[:workers]):
            err = open(os.path.join(run.workdir, f"{tag}-w{i}.log"), "w")
            children.append(run.hosts.popen(host, [
                sys.executable, os.path.abspath(__file__), "--child", "raw-worker" if mode == "raw" else "synth",
                "--addresses", ",".join(addresses),
                "--index", str(i), "--num-workers", str(workers)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=run.env()))
            err.close()
        for i, c in enumerate(children):
            line = c.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"synthetic worker {i} did not start: {line!r} "
                                   f"{run.log_tail(f'{tag}-w{i}.log')}")
        warm = time.monotonic() + 0.5
        start = warm + min(2.0, seconds / 2)  # every worker busy before the window opens
        end = start + seconds
        for c in children:
            c.stdin.write(f"go {warm} {start} {end}\n")
            c.stdin.flush()
        time.sleep(max(0.0, start - time.monotonic()))
        net0, cpu0 = [net_bytes(s.pid) for s in servers], cpu_times()
        tcp0 = [tcp_segments(x.pid) for x in [*servers, *children]]
        server_cpu0 = sum(cpu_seconds(s.pid) for s in servers)
        time.sleep(max(0.0, end - time.monotonic()))
        net1, cpu1 = [net_bytes(s.pid) for s in servers], cpu_times()
        tcp1 = [tcp_segments(x.pid) for x in [*servers, *children]]
        server_cpu = sum(cpu_seconds(s.pid) for s in servers) - server_cpu0
        tallies = []
        for i, c in enumerate(children):
            out, _ = c.communicate(timeout=CALL_TIMEOUT)
            if c.returncode != 0:
                raise RuntimeError(f"synthetic worker {i} failed ({c.returncode}): {run.log_tail(f'{tag}-w{i}.log')}")
            tallies.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        _stop([*children, *servers])
    pushed, pulled = sum(t["pushed"] for t in tallies), sum(t["pulled"] for t in tallies)
    per_dir, bound = limit_per_direction(workers, num_ps, run.r)
    throughput = (pushed + pulled) / seconds
    wire_in = sum(b[0] - a[0] for a, b in zip(net0, net1)) / seconds
    wire_out = sum(b[1] - a[1] for a, b in zip(net0, net1)) / seconds
    return {
        "ps": num_ps, "workers": workers, "mode": mode, "seconds": seconds,
        "pushes": sum(t["steps"] for t in tallies), "push_bytes_per_s": pushed / seconds,
        "pull_bytes_per_s": pulled / seconds, "throughput_bytes_per_s": throughput,
        "ps_links_bytes_per_s": 2 * num_ps * run.r,  # the PS hosts' total link rate, both directions
        "limit_bytes_per_s": 2 * per_dir, "bound_by": bound, "fraction": throughput / (2 * per_dir),
        # each worker pulls, then pushes: its own link busy one way at a time
        "turns_limit_bytes_per_s": min(2 * per_dir, workers * run.r),
        "turns_fraction": throughput / min(2 * per_dir, workers * run.r),
        "wire_in_bytes_per_s": wire_in, "wire_out_bytes_per_s": wire_out,
        "wire_fraction": (wire_in + wire_out) / (2 * per_dir),
        "machine_cpu_busy_percent": busy_percent(cpu0, cpu1),
        # of the TCP segments every host of the configuration sent in the window: the shaped
        # links' queues (tbf, 20 ms) drop what overflows them
        "retransmitted_percent": round(100 * sum(b[1] - a[1] for a, b in zip(tcp0, tcp1))
                                       / max(1, sum(b[0] - a[0] for a, b in zip(tcp0, tcp1))), 2),
        "client_cpu_percent": round(100 * sum(t["cpu_s"] for t in tallies) / (end - warm), 1),
        "server_cpu_percent": round(100 * server_cpu / seconds, 1),
        "largest_shard_share": max(shares(num_ps)),
    }


def measure_training(run: Run, num_ps: int, workers: int, steps: int, warmup: int, batch: int,
                     overlap: bool = True, model: str = "mlp", worker_flags: tuple[str, ...] = (),
                     server_flags: tuple[str, ...] = (), label: str = "") -> dict:
    """Sync training on ``workers`` worker hosts and ``num_ps`` PS hosts: the chief's step time
    after ``warmup`` steps, against the time the links need for a step's bytes. ``label`` tells
    configurations apart that differ in their flags alone."""
    tag = f"train-{model}-{num_ps}ps-{workers}w-{'overlap' if overlap else 'no-overlap'}{label and '-' + label}"
    servers, addresses = run.servers(num_ps, workers, "sync", tag, "--exit-when-done", *server_flags)
    history = os.path.join(run.workdir, f"{tag}-history.json")
    procs = []
    names = PS_HOSTS[:num_ps] + WORKER_HOSTS[:workers]
    try:
        cpu0, t0, queues0 = cpu_times(), time.monotonic(), queue_counts(run.hosts, names)
        for i, host in enumerate(WORKER_HOSTS[:workers]):
            log = open(os.path.join(run.workdir, f"{tag}-w{i}.log"), "w")
            procs.append(run.hosts.popen(host, [
                sys.executable, "-m", "worker", "--ps", ",".join(addresses), "--worker-index", str(i),
                "--num-workers", str(workers), "--model", model, "--dataset", "digits", "--steps", str(steps),
                "--global-batch-size", str(batch * workers), "--intra-op-threads", "1", "--log-level", "WARNING",
                "--progress", "off", "--overlap" if overlap else "--no-overlap", *worker_flags,
                *(("--history-json", history) if i == 0 else ())],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=run.workdir, env=run.env()))
            log.close()
        deadline = time.monotonic() + 600
        for i, p in enumerate(procs):
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"ps-worker {i} exited {code}: {run.log_tail(f'{tag}-w{i}.log')}")
        cpu1, wall, drops = cpu_times(), time.monotonic() - t0, drop_percent(queues0, queue_counts(run.hosts, names))
    finally:
        _stop([*procs, *servers])
    with open(history) as f:
        records = json.load(f)["steps"]
    if len(records) < warmup + 2:
        raise RuntimeError(f"the chief recorded {len(records)} steps, fewer than --warmup-steps + 2")
    window = records[warmup:]
    step_s = (window[-1]["t"] - records[warmup - 1]["t"]) / len(window) if warmup else \
        window[-1]["t"] / len(window)
    need = links_need_s(workers, num_ps, run.r, model)
    return {
        "model": model, "ps": num_ps, "workers": workers, "overlap": overlap, "steps": len(records),
        "measured_steps": len(window),
        "global_batch": batch * workers, "step_s": step_s, "examples_per_s": batch * workers / step_s,
        "push_bytes": window[-1]["push_bytes"], "links_need_s": need, "step_over_links_need": step_s / need,
        "link_limit_examples_per_s": batch * workers / need,
        "fraction": need / step_s,
        "compute_s": float(np.mean([r["compute_s"] for r in window])),
        "pull_s": float(np.mean([r["pull_s"] for r in window])),
        "push_s": float(np.mean([r["push_s"] for r in window])),
        # over the whole run of the configuration, start-up (TensorFlow's import) included
        "machine_cpu_busy_percent": busy_percent(cpu0, cpu1), "wall_s": wall,
        "largest_shard_share": max(shares(num_ps, model)),
        # of the packets the hosts' link queues took over the whole run: what tbf dropped
        "queue_drop_percent": drops,
    }


# -- printing ----------------------------------------------------------------------------
MB = 1e6


def ratios(rows: list[dict], key: str) -> dict[str, dict[str, float]]:
    """{"2/1": {workers: ratio}, "4/1": ...} of ``key`` at equal worker counts."""
    by = {(r["ps"], r["workers"]): r[key] for r in rows}
    out: dict[str, dict[str, float]] = {}
    for p in sorted({r["ps"] for r in rows}):
        if p == 1:
            continue
        out[f"{p}/1"] = {str(w): by[p, w] / by[1, w] for (q, w) in sorted(by) if q == p and (1, w) in by}
    return out


def overlap_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{ps: {workers: examples/s with overlap / without}} where both were run."""
    by = {(r["ps"], r["workers"], r["overlap"]): r["examples_per_s"] for r in rows}
    out: dict[str, dict[str, float]] = {}
    for (ps, w, o), x in sorted(by.items()):
        if o and (ps, w, False) in by:
            out.setdefault(str(ps), {})[str(w)] = x / by[ps, w, False]
    return out


def print_report(report: dict) -> None:
    rate = f"{report['rate']} (TCP {report.get('tcp', 'cubic')})"
    load, train = report["throughput"], report["training"]
    if load:
        print(f"\n(a) push+pull throughput, {report['load_mode']} mode, every link {rate} each way "
              f"(r = {report['r_bytes_per_s'] / MB:.2f} MB/s); MB/s of tensor bytes pushed + pulled")
        print("limit = 2 x min(r / largest shard's share, W x r) (PS links: 2 x P x r when evenly split); "
              "wire = bytes on the PS hosts' links; raw = the same pulls and pushes on bare TCP sockets")
        print("turns = min(limit, W x r): a worker pulls, then pushes, so its own link is busy one way at a time; "
              "retr %: TCP segments retransmitted; CPU %: of one core, the servers + clients / the whole machine")
        print(f"{'PS':>3} {'W':>3} {'push+pull':>10} {'limit':>8} {'bound by':>12} {'fraction':>8} "
              f"{'turns':>7} {'fr.':>5} {'wire':>7} {'retr %':>6} {'ours/all CPU %':>14} {'x 1 PS':>7} "
              f"{'raw':>7} {'raw fr.':>7} {'/ raw':>6}")
        base = {r["workers"]: r["throughput_bytes_per_s"] for r in load if r["ps"] == 1}
        for r in load:
            cpu = f"{r['server_cpu_percent'] + r['client_cpu_percent']:.0f} / {2 * r['machine_cpu_busy_percent']:.0f}"
            x = f"{r['throughput_bytes_per_s'] / base[r['workers']]:.2f}" if r["ps"] != 1 and r["workers"] in base \
                else "-"
            print(f"{r['ps']:>3} {r['workers']:>3} {r['throughput_bytes_per_s'] / MB:>10.2f} "
                  f"{r['limit_bytes_per_s'] / MB:>8.2f} {r['bound_by']:>12} {r['fraction']:>8.2f} "
                  f"{r['turns_limit_bytes_per_s'] / MB:>7.2f} {r['turns_fraction']:>5.2f} "
                  f"{(r['wire_in_bytes_per_s'] + r['wire_out_bytes_per_s']) / MB:>7.2f} "
                  f"{r['retransmitted_percent']:>6.1f} {cpu:>14} {x:>7} " + (
                      f"{r['raw']['throughput_bytes_per_s'] / MB:>7.2f} {r['raw']['fraction']:>7.2f} "
                      f"{r['over_raw']:>6.2f}" if "raw" in r else f"{'-':>7} {'-':>7} {'-':>6}"))
    if train:
        print(f"\n(b) sync training, ps-worker --model mlp on digits, {report['batch_per_worker']} examples per "
              f"worker per step, every link {rate}")
        print("links need = max(W x largest share, 1) x model bytes / r (the busiest link, full duplex); "
              "limit = global batch / links need")
        print("overlap: on, a sync push is PushPull (the round's values come back while it still arrives); "
              "off, push then pull (--no-overlap)")
        print(f"{'PS':>3} {'W':>3} {'overlap':>7} {'ex/s':>8} {'limit':>8} {'fraction':>8} {'step s':>7} {'need s':>7} "
              f"{'step/need':>9} {'pull s':>7} {'compute':>7} {'push s':>7} {'x 1 PS':>7}")
        base = {(r["workers"], r["overlap"]): r["examples_per_s"] for r in train if r["ps"] == 1}
        for r in train:
            key = (r["workers"], r["overlap"])
            x = f"{r['examples_per_s'] / base[key]:.2f}" if r["ps"] != 1 and key in base else "-"
            print(f"{r['ps']:>3} {r['workers']:>3} {'on' if r['overlap'] else 'off':>7} "
                  f"{r['examples_per_s']:>8.1f} {r['link_limit_examples_per_s']:>8.1f} "
                  f"{r['fraction']:>8.2f} {r['step_s']:>7.3f} {r['links_need_s']:>7.3f} "
                  f"{r['step_over_links_need']:>9.2f} {r['pull_s']:>7.3f} {r['compute_s']:>7.3f} "
                  f"{r['push_s']:>7.3f} {x:>7}")
    for name, rows in (("throughput", report["ratios"]["throughput"]), ("training", report["ratios"]["training"])):
        for k, v in rows.items():
            print(f"{name} {k} PS, by worker count: " + ", ".join(f"W={w}: {x:.2f}" for w, x in v.items()))
    for ps, v in report["ratios"].get("overlap", {}).items():
        print(f"training examples/s, overlap on / off, {ps} PS, by worker count: "
              + ", ".join(f"W={w}: {x:.2f}" for w, x in v.items()))
    for f in report["failures"]:
        print(f"FAILED: {f}")


def finish(report: dict, started: float, print_report, json_path: str | None) -> int:
    """Time the run, print it and write it as JSON; exit status 0 when nothing failed."""
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["uptime_after"] = uptime()
    print_report(report)
    print(f"\n{report['wall_s']:.0f} s; uptime before: {report['uptime_before']}; after: {report['uptime_after']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0 if not report["failures"] else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit", help="every host's link, each way, as tc writes it (default 100mbit)")
    p.add_argument("--workers", default="1,2,4,8", help="worker host counts, at most 8 (default 1,2,4,8)")
    p.add_argument("--ps", default="1,2,4", help="PS host counts, at most 4 (default 1,2,4)")
    p.add_argument("--seconds", type=float, default=6.0, help="(a): the measured window (default 6)")
    p.add_argument("--no-raw", action="store_true",
                   help="(a): leave out the same traffic on raw sockets (bare TCP servers and clients)")
    p.add_argument("--train-steps", type=int, default=8, help="(b): global steps per configuration (default 8)")
    p.add_argument("--warmup-steps", type=int, default=2, help="(b): first steps left out of the timing (default 2)")
    p.add_argument("--batch-per-worker", type=int, default=32, help="(b): examples per worker per step (default 32)")
    p.add_argument("--parts", default="throughput,training", help="throughput and/or training (default both)")
    p.add_argument("--overlap", choices=("on", "off", "both"), default="both",
                   help="(b): the workers' --overlap (PushPull), --no-overlap, or both side by side (default both)")
    p.add_argument("--tcp", default="cubic", help="the hosts' TCP congestion control (default cubic, Linux's own; "
                                                   "'machine': this machine's)")
    p.add_argument("--quick", action="store_true",
                   help="the test's run: --workers 2 --ps 1,2 --seconds 1.5 --train-steps 3 --warmup-steps 1")
    p.add_argument("--json", help="write the report here as JSON")
    p.add_argument("--child", choices=("synth", "raw-server", "raw-worker"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--addresses", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--num-workers", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.child:
        return {"synth": synth_child, "raw-server": raw_server_child, "raw-worker": raw_worker_child}[args.child](args)
    if args.quick:
        args.workers, args.ps, args.seconds, args.train_steps, args.warmup_steps = "2", "1,2", 1.5, 3, 1
    try:
        workers = [int(w) for w in args.workers.split(",")]
        num_ps = [int(n) for n in args.ps.split(",")]
        rate_bytes(args.rate)
    except Exception as e:  # noqa: BLE001
        p.error(str(e))
    parts = args.parts.split(",")
    if not all(1 <= w <= len(WORKER_HOSTS) for w in workers) or not all(1 <= n <= len(PS_HOSTS) for n in num_ps):
        p.error(f"--workers from 1 to {len(WORKER_HOSTS)}, --ps from 1 to {len(PS_HOSTS)}")
    if not set(parts) <= {"throughput", "training"} or args.seconds <= 0 or args.batch_per_worker < 1 \
            or args.warmup_steps < 0 or args.train_steps < args.warmup_steps + 2:
        p.error("--parts throughput,training; --seconds > 0; --train-steps >= --warmup-steps + 2")
    from ps_tools.hosts import Hosts, unavailable

    why = unavailable()
    if why:
        print(f"no emulated hosts: {why}", file=sys.stderr)
        return 2
    report = {"command": " ".join(["python", "bench/hosts_scaling.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "uptime_before": uptime(), "rate": args.rate, "r_bytes_per_s": rate_bytes(args.rate),
              "model_bytes": MODEL_BYTES, "shares": {str(n): shares(n) for n in num_ps},
              "tcp": args.tcp, "load_mode": "async", "batch_per_worker": args.batch_per_worker,
              "throughput": [], "training": [], "failures": []}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tfps-hosts-scaling-") as workdir:
        os.chmod(workdir, 0o755)
        with Hosts(PS_HOSTS[:max(num_ps)] + WORKER_HOSTS[:max(workers)], rate=args.rate,
                   tcp=hosts_tcp(args.tcp)) as hosts:
            run = Run(hosts, workdir, args.rate)
            for part in ("throughput", "training"):
                if part not in parts:
                    continue
                for n in num_ps:
                    for w in workers:
                        print(f"{part}: {n} PS host(s), {w} worker host(s) ...", file=sys.stderr, flush=True)
                        try:
                            if part == "throughput":
                                row = measure_throughput(run, n, w, args.seconds, "async")
                                if not args.no_raw:
                                    raw = measure_throughput(run, n, w, args.seconds, "raw")
                                    row["raw"] = {k: raw[k] for k in (
                                        "throughput_bytes_per_s", "fraction", "turns_fraction", "pushes",
                                        "retransmitted_percent", "server_cpu_percent", "client_cpu_percent",
                                        "machine_cpu_busy_percent")}
                                    row["over_raw"] = row["throughput_bytes_per_s"] / raw["throughput_bytes_per_s"]
                            else:
                                rows = [measure_training(run, n, w, args.train_steps, args.warmup_steps,
                                                         args.batch_per_worker, overlap=o)
                                        for o in {"on": (True,), "off": (False,), "both": (True, False)}[args.overlap]]
                        except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
                            report["failures"].append(f"{part} {n} PS x {w} workers: {type(e).__name__}: {e}")
                            continue
                        report[part].extend([row] if part == "throughput" else rows)
    first = report["training"][0]["overlap"] if report["training"] else True
    report["ratios"] = {"throughput": ratios(report["throughput"], "throughput_bytes_per_s"),
                        "training": ratios([r for r in report["training"] if r["overlap"] == first], "examples_per_s"),
                        "overlap": overlap_ratios(report["training"])}
    return finish(report, started, print_report, args.json)


if __name__ == "__main__":
    sys.exit(main())
