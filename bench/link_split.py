"""How TCP splits one shaped link between transfers that start together: N emulated
hosts each send the same message to one server host at once, every round.

    sudo python bench/link_split.py --workers 2,4 --rate 20mbit --bytes 870000 --rounds 12

What a sync round with backup workers gains depends on it: a round that takes the first
N-1 pushes of N ends when the (N-1)-th is in. Virtual time (``ps_tools.study.virtual.SharedLink``)
shares a link among transfers in proportion to a window plus the bytes each sent, so
transfers that start together share it equally and finish together; this measures what
real TCP does through ``tc tbf`` (``ps_tools.hosts``: a network namespace per host, the
server's download link shaped at ``--rate`` like every other).

Each source keeps one connection for every round, as gRPC does (its congestion window
carries over); the server says "go" to all at once, times each transfer's last byte from
there, then idles ``--idle-s`` (a round's pull and compute, when the uploads rest). The
first round is left out. It prints, for k = 1..N, the median time the k-th transfer
finished and its ratio to the last one's, beside the equal-share model's (every ratio
1.00: all finish at N x bytes / rate). Needs root (``hosts.unavailable()`` says why not).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PORT = 5555


def sink(n: int, size: int, rounds: int, idle_s: float) -> None:
    """In the server's host: accept n sources; each round, "go" to all, time each one's bytes."""
    server = socket.create_server(("0.0.0.0", PORT), backlog=n)
    conns = [server.accept()[0] for _ in range(n)]
    results = []
    for _ in range(rounds):
        for c in conns:
            c.sendall(b"g")
        t0, done = time.monotonic(), [0.0] * n

        def read(i: int) -> None:
            got = 0
            while got < size:
                chunk = conns[i].recv(1 << 20)
                if not chunk:
                    raise SystemExit(f"source {i} closed its connection")
                got += len(chunk)
            done[i] = time.monotonic() - t0

        readers = [threading.Thread(target=read, args=(i,)) for i in range(n)]
        for r in readers:
            r.start()
        for r in readers:
            r.join()
        results.append(sorted(done))
        time.sleep(idle_s)
    print(json.dumps(results), flush=True)


def source(host: str, size: int, rounds: int) -> None:
    """In a worker's host: one connection; each "go", the whole message."""
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((host, PORT))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    message = b"x" * size
    for _ in range(rounds):
        if conn.recv(1) != b"g":
            return
        conn.sendall(message)


def measure(n: int, rate: str, size: int, rounds: int, idle_s: float) -> list[list[float]]:
    from ps_tools.hosts import Hosts, rate_bits

    names = ["tfps-ps-0"] + [f"tfps-worker-{i}" for i in range(n)]
    me = os.path.abspath(__file__)
    with Hosts(names, rate=rate) as hosts:
        server = hosts.popen("tfps-ps-0", [sys.executable, me, "sink", str(n), str(size), str(rounds), str(idle_s)],
                             stdout=-1, text=True)
        sources = [hosts.popen(h, [sys.executable, me, "source", "tfps-ps-0", str(size), str(rounds)])
                   for h in names[1:]]
        out, _ = server.communicate(timeout=60 + 4 * rounds * (n * size * 8 / rate_bits(rate) + idle_s))
        for p in sources:
            p.wait(30)
        if server.returncode:
            raise SystemExit(f"link_split: the sink exited with status {server.returncode}")
    return json.loads(out)[1:]  # the first round opens the congestion windows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "sink":
        sink(int(argv[1]), int(argv[2]), int(argv[3]), float(argv[4]))
        return 0
    if argv and argv[0] == "source":
        source(argv[1], int(argv[2]), int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4", help="comma-separated numbers of sending hosts")
    p.add_argument("--rate", default="20mbit", help="every host's link, as tc writes it")
    p.add_argument("--bytes", type=int, default=870_000, help="one transfer (default: the cnn model's push)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--idle-s", type=float, default=0.3)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    from ps_tools.hosts import rate_bits, unavailable

    why = unavailable()
    if why:
        print(f"link_split: {why}", file=sys.stderr)
        return 2
    report = {}
    for n in (int(x) for x in args.workers.split(",")):
        res = measure(n, args.rate, args.bytes, args.rounds, args.idle_s)
        equal = n * args.bytes * 8 / rate_bits(args.rate)
        print(f"{n} transfers of {args.bytes} bytes at {args.rate}: equal shares finish all at {equal:.3f} s")
        rows = []
        for k in range(n):
            t = statistics.median(r[k] for r in res)
            ratio = statistics.median(r[k] / r[-1] for r in res)
            rows.append({"k": k + 1, "median_s": t, "of_last": ratio})
            print(f"  {k + 1}-th in: {t:.3f} s, {ratio:.2f} of the last (equal shares: 1.00)")
        report[n] = {"equal_share_s": equal, "finished": rows, "rounds": res}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
