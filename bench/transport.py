"""Transport benchmark: push + pull of 1, 10 and 100 MiB through our server,
against a raw loopback socket and TensorFlow's own gRPC runtime, in one run.

    python bench/transport.py --sizes 1,10,100 --reps 5 --json-out transport.json

For each allocator setting (glibc's default, and "tuned": large buffers kept
mapped instead of page-faulting on every message) it measures, in fresh
processes started with that environment:

- ours: one float32 variable of the given size on a real ``ps-server``
  (127.0.0.1, async mode, SGD): one Push of its gradient plus one Pull of it;
- ours-shm: the same with ``PSClient(shm=True)``, the same-host fast path
  (``protos/shm.py``): the tensors go through shared memory, gRPC carries the
  headers (the run fails if the probe does not succeed);
- raw: a TCP socket pair on 127.0.0.1 moving the same bytes there and back;
- tensorflow: a variable placed on a ``tf.distribute.Server`` ps task, written
  (``assign``) and read back (``read_value``) from a client process; the two run
  in a private network namespace because TensorFlow's servers listen on all
  interfaces.

Throughput = 2 x size / (time of one push + one pull), median of ``--reps``
after one warm-up. It prints every figure and the ratios ours/raw,
ours/tensorflow and ours-shm/tensorflow, each from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from protos import wire  # noqa: E402
from ps_common.procs import dying_with_parent, wait_for_port_file  # noqa: E402
from tf_strategies.isolation import free_ports, isolated  # noqa: E402

MIB = 2**20
TUNED = wire.ALLOCATOR_ENV
ALLOCATORS = {"default": {}, "tuned": TUNED}


def _env(alloc: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TUNED}
    env.update(ALLOCATORS[alloc])
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


def _time_reps(fn, reps: int) -> float:
    fn()  # warm-up: first-touch allocations, connection set-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- ours ------------------------------------------------------------------------------
def measure_ours(sizes: list[int], reps: int, shm: bool = False) -> dict:
    """One fresh server per size, holding one variable of that size; ``shm``: through
    the same-host fast path."""
    from worker.client import PSClient

    spec = {"name": "sgd", "learning_rate": 1e-9, "momentum": 0.0, "nesterov": False,
            "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}
    out = {}
    for mib in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            port_file = os.path.join(tmp, "port")
            server = subprocess.Popen(
                dying_with_parent([sys.executable, "-m", "ps_server", "--port", "0", "--port-file", port_file,
                                   "--mode", "async", "--num-workers", "1", "--log-level", "WARNING",
                                   "--lease-timeout", "3600"]),
                env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                address = f"127.0.0.1:{wait_for_port_file(port_file, server, 60)}"
                with PSClient(address, timeout=300, shm=shm) as client:
                    client.wait_ready(30)
                    if client.register(0, 1).shm != shm:
                        raise RuntimeError(f"the shared-memory probe failed: {client.shm_fallback_reason}")
                    client.initialize(0, {"v": np.zeros(mib * MIB // 4, np.float32)}, spec)
                    grads = {"v": np.ones(mib * MIB // 4, np.float32)}
                    step = [0]

                    def once():
                        version, _ = client.pull(0)
                        client.push(0, step[0], version, 1, grads)
                        step[0] += 1

                    once()  # with shm=True the first pull sizes the pull segment: one more warm-up
                    out[mib] = 2 * mib * MIB / _time_reps(once, reps) / 2**30
                    if client.shm_active != shm:  # a fallback during the run would make the figure a lie
                        raise RuntimeError(f"shared memory went off: {client.shm_fallback_reason}")
            finally:
                server.kill()
                server.wait()
    return out


# -- raw socket ----------------------------------------------------------------------
def _recv_exact(sock, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def measure_raw(sizes: list[int], reps: int) -> dict:
    out = {}
    for mib in sizes:
        n = mib * MIB
        srv = socket.create_server(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        echo = subprocess.Popen(dying_with_parent([sys.executable, "-c", _ECHO, str(port), str(n), str(reps + 1)]),
                                env=dict(os.environ))
        srv.close()
        time.sleep(0.3)
        out_buf = np.ones(n, np.uint8).tobytes()
        in_buf = bytearray(n)
        conn = socket.create_connection(("127.0.0.1", port), timeout=60)

        def once():
            conn.sendall(out_buf)
            _recv_exact(conn, memoryview(in_buf))

        out[mib] = 2 * n / _time_reps(once, reps) / 2**30
        conn.close()
        echo.wait(60)
    return out


# A child that listens again on the same port and sends back every message it gets.
_ECHO = r"""
import socket, sys
port, n, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
srv = socket.create_server(("127.0.0.1", port))
conn, _ = srv.accept()
buf = bytearray(n); view = memoryview(buf)
for _ in range(reps):
    got = 0
    while got < n:
        got += conn.recv_into(view[got:])
    conn.sendall(buf)
"""


# -- TensorFlow's runtime ------------------------------------------------------------
_TF_PS = r"""
import os, sys, tensorflow as tf
cluster = tf.train.ClusterSpec({"ps": [sys.argv[1]], "worker": [sys.argv[2]]})
tf.distribute.Server(cluster, job_name="ps", task_index=0, protocol="grpc").join()
"""

_TF_CLIENT = r"""
import json, statistics, sys, time
import numpy as np, tensorflow as tf
ps, worker, sizes, reps = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")], int(sys.argv[4])
cluster = tf.train.ClusterSpec({"ps": [ps], "worker": [worker]})
tf.config.experimental_connect_to_cluster(cluster, job_name="worker", task_index=0)
out = {}
for mib in sizes:
    n = mib * 2**20 // 4
    with tf.device("/job:ps/task:0/device:CPU:0"):
        v = tf.Variable(tf.zeros([n], tf.float32))
    data = np.ones(n, np.float32)
    def once():
        v.assign(data)
        v.read_value().numpy()
    once()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); once(); times.append(time.perf_counter() - t)
    out[mib] = 2 * mib * 2**20 / statistics.median(times) / 2**30
print(json.dumps(out))
"""

_TF_PAIR = r"""
import os, subprocess, sys
ps_src, client_src, a, b, sizes, reps = sys.argv[1:7]
ps = subprocess.Popen([sys.executable, "-c", ps_src, f"127.0.0.1:{a}", f"127.0.0.1:{b}"],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    run = subprocess.run([sys.executable, "-c", client_src, f"127.0.0.1:{a}", f"127.0.0.1:{b}", sizes, reps],
                         capture_output=True, text=True, timeout=900)
    sys.stdout.write(run.stdout); sys.stderr.write(run.stderr[-2000:])
    sys.exit(run.returncode)
finally:
    ps.kill(); ps.wait()
"""


def measure_tensorflow(sizes: list[int], reps: int) -> dict:
    a, b = free_ports(2)
    argv, note = isolated([sys.executable, "-c", _TF_PAIR, _TF_PS, _TF_CLIENT, str(a), str(b),
                           ",".join(map(str, sizes)), str(reps)])
    run = subprocess.run(dying_with_parent(argv), capture_output=True, text=True, timeout=1200,
                         env=dict(os.environ))
    if run.returncode != 0:
        raise RuntimeError(f"tensorflow transport run failed: {run.stderr[-1500:]}")
    return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


# -- driver ----------------------------------------------------------------------------
def child(which: str, sizes: list[int], reps: int) -> None:
    fn = {"ours": measure_ours, "ours-shm": lambda s, r: measure_ours(s, r, shm=True), "raw": measure_raw,
          "tensorflow": measure_tensorflow}[which]
    print(json.dumps(fn(sizes, reps)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,10,100", help="MiB, comma-separated (default 1,10,100)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json-out")
    p.add_argument("--child", choices=("ours", "ours-shm", "raw", "tensorflow"), help=argparse.SUPPRESS)
    p.add_argument("--skip-tensorflow", action="store_true")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        child(args.child, sizes, args.reps)
        return 0
    results: dict = {}
    for alloc in ALLOCATORS:
        for which in ("ours", "ours-shm", "raw") + (() if args.skip_tensorflow else ("tensorflow",)):
            run = subprocess.run(dying_with_parent([sys.executable, os.path.abspath(__file__), "--child", which,
                                                    "--sizes", args.sizes, "--reps", str(args.reps)]),
                                 capture_output=True, text=True, env=_env(alloc), timeout=1800)
            if run.returncode != 0:
                print(f"{alloc}/{which} failed: {run.stderr[-800:]}", file=sys.stderr)
                continue
            results.setdefault(alloc, {})[which] = {int(k): v for k, v in
                                                    json.loads(run.stdout.strip().splitlines()[-1]).items()}
    print(f"push+pull throughput, GiB/s (median of {args.reps}); ratios from the same run")
    print(f"{'allocator':<9} {'MiB':>4} {'ours':>7} {'ours-shm':>8} {'raw':>7} {'tf':>7} {'ours/raw':>9} "
          f"{'ours/tf':>8} {'ours-shm/tf':>11}")
    for alloc, r in results.items():
        for mib in sizes:
            ours, shm, raw, tf = (r.get(k, {}).get(mib) for k in ("ours", "ours-shm", "raw", "tensorflow"))
            fmt = lambda x, w=7: f"{x:{w}.2f}" if x else " " * (w - 1) + "-"  # noqa: E731
            ratio = lambda a, b, w=9: f"{a / b:{w}.2f}" if a and b else " " * (w - 1) + "-"  # noqa: E731
            print(f"{alloc:<9} {mib:>4} {fmt(ours)} {fmt(shm, 8)} {fmt(raw)} {fmt(tf)} {ratio(ours, raw)} "
                  f"{ratio(ours, tf, 8)} {ratio(shm, tf, 11)}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"sizes_mib": sizes, "reps": args.reps, "gib_per_s": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
