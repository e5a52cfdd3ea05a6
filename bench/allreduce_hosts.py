"""tfps sync against all-reduce (MultiWorkerMirroredStrategy) on the same emulated hosts, side by side.

    sudo python bench/allreduce_hosts.py --rate 100mbit --workers 2,4 --ps 1,2,n --models mlp,mlp25m --json ar.json
    sudo python bench/allreduce_hosts.py --models mlp --workers 4 --ps n --tcp cubic,bbr   # the hosts' TCP
    sudo python bench/allreduce_hosts.py --quick        # the test's run: mlp, 2 worker hosts, 1 PS host, 3 steps

Where a parameter server should win: on links. A sync step moves each worker's
gradient in and the new model out. With ``k = N`` server hosts (the model split
evenly), each worker's link carries the model ``M`` once each way per step; a ring
all-reduce carries ``2(N-1)/N x M`` each way (reduce-scatter, then all-gather). So
with the links the bottleneck, tfps' examples/s can reach ``2(N-1)/N`` times
all-reduce's (BytePS, OSDI 2020): 1.0 at N = 2, 1.5 at N = 4, 1.75 at N = 8. With
``k = 1`` one server host's link carries ``N x M`` each way, and all-reduce wins
from N = 2 on.

Every configuration runs on emulated hosts (``ps_tools.hosts``: a network namespace
per host, one link each way shaped to ``--rate`` with ``tc tbf``, real TCP), one set
per ``--tcp`` congestion control (default ``cubic``, Linux's own; ``--tcp cubic,bbr``
runs every configuration under each, in turn): worker hosts ``tfps-worker-0..N-1``,
PS hosts ``tfps-ps-0..k-1``. The choice weighs on tfps, not on the ring: each worker
host sends to k server hosts and each server host to N workers at once (k x N
flows), where a ring has one flow per link and direction.

- **mwms**: TensorFlow's ``MultiWorkerMirroredStrategy`` (``tf_strategies.mwms``'s
  worker: its own ``TF_CONFIG`` naming the worker hosts, one process per worker host,
  the RING collective over gRPC, a ``GradientTape`` loop whose optimizer all-reduces
  the gradients across the hosts' shaped links).
- **tfps k**: ``ps-server --mode sync`` on each of ``k`` PS hosts (an ordinary shard
  each) and a real ``ps-worker`` on each worker host (``bench/hosts_scaling.py``'s
  training part), the server's default lease.

Both train the same model (``mlp``, 3.75 MB, or ``mlp25m``, 101 MB) on ``digits``
with plain SGD (learning rate 0.01), ``--batch-per-worker`` examples per worker per
step, one intra-op thread per worker, op determinism on in both. Step time: the
chief's, over the steps after ``--warmup-steps`` (tfps: its ``--history-json``; MWMS:
each step's end as its loop records it, ``RunResult.step_ends_s``). examples/s =
global batch / step time. Beside each: the time the busiest link needs for one
step's bytes, full duplex (all-reduce: ``2(N-1)/N x M / r``; tfps:
``max(N x s_max, 1) x M / r``, ``s_max`` the largest shard's share), and the ratio
tfps / mwms at each N with the bound ``2(N-1)/N`` next to it, all from this one run.
How busy the machine's cores were over the configuration (start-up included; 100 %:
every core) says when a figure is the cores', not the links'; the packets the hosts'
link queues dropped (``Hosts.queue_counts``: their own uploads, and the bridge ports
towards them) say how hard TCP found the links.

Needs root. Exit status 0 when every configuration ran, 1 otherwise, 2 for bad
arguments or no emulated hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, ROOT)

from bench.hosts_scaling import (  # noqa: E402
    PS_HOSTS, SHAPES, WORKER_HOSTS, Run, _stop, busy_percent, cpu_times, drop_percent, finish, hosts_tcp, machine,
    model_bytes, measure_training, queue_counts, rate_bytes, uptime,
)

MWMS_PORT = 2600  # each MWMS configuration its own: MWMS_PORT + its number
LEARNING_RATE = 0.01


def ring_need_s(workers: int, r: float, model: str) -> float:
    """Seconds a worker's link needs for one ring all-reduce of the model, full duplex."""
    return 2 * (workers - 1) / workers * model_bytes(model) / r


def measure_mwms(run: Run, workers: int, steps: int, warmup: int, batch: int, model: str,
                 heartbeat_s: float = 0.0) -> dict:
    """MultiWorkerMirroredStrategy's workers, one per worker host, ``TF_CONFIG`` naming the hosts."""
    from tf_strategies.common import RunSpec, load_result

    run.configs += 1
    port = MWMS_PORT + run.configs
    tag = f"mwms-{model}-{workers}w"
    spec = RunSpec(model=model, steps=steps, global_batch_size=batch * workers, optimizer="sgd",
                   learning_rate=LEARNING_RATE, num_workers=workers, intra_op_threads=1,
                   heartbeat_timeout_s=heartbeat_s)
    cluster = [f"{host}:{port}" for host in WORKER_HOSTS[:workers]]
    procs = []
    try:
        cpu0, t0, queues0 = cpu_times(), time.monotonic(), queue_counts(run.hosts, WORKER_HOSTS[:workers])
        for i, host in enumerate(WORKER_HOSTS[:workers]):
            env = dict(run.env(), TF_CONFIG=json.dumps({"cluster": {"worker": cluster},
                                                         "task": {"type": "worker", "index": i}}))
            with open(os.path.join(run.workdir, f"{tag}-w{i}.log"), "w") as log:
                procs.append(run.hosts.popen(host, [
                    sys.executable, "-m", "tf_strategies.mwms", "--role", "worker", "--index", str(i),
                    "--spec-json", spec.to_json(), "--out", os.path.join(run.workdir, f"{tag}-w{i}")],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=run.workdir, env=env))
        deadline = time.monotonic() + 900
        for i, p in enumerate(procs):
            code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"mwms worker {i} exited {code}: {run.log_tail(f'{tag}-w{i}.log')}")
        cpu1, wall = cpu_times(), time.monotonic() - t0
        drops = drop_percent(queues0, queue_counts(run.hosts, WORKER_HOSTS[:workers]))
    finally:
        _stop(procs)
    ends = load_result(os.path.join(run.workdir, f"{tag}-w0")).step_ends_s
    if len(ends) < warmup + 2:
        raise RuntimeError(f"mwms' chief recorded {len(ends)} steps, fewer than --warmup-steps + 2")
    step_s = (ends[-1] - (ends[warmup - 1] if warmup else 0.0)) / (len(ends) - warmup)
    need = ring_need_s(workers, run.r, model)
    return {"system": "mwms", "model": model, "ps": 0, "workers": workers, "steps": len(ends),
            "measured_steps": len(ends) - warmup, "global_batch": batch * workers, "step_s": step_s,
            "examples_per_s": batch * workers / step_s, "links_need_s": need, "step_over_links_need": step_s / need,
            "machine_cpu_busy_percent": busy_percent(cpu0, cpu1), "wall_s": wall, "queue_drop_percent": drops}


def measure_tfps(run: Run, num_ps: int, workers: int, steps: int, warmup: int, batch: int, model: str,
                 block_kib: int = 0) -> dict:
    row = measure_training(run, num_ps, workers, steps, warmup, batch, model=model,
                           worker_flags=("--optimizer", "sgd", "--learning-rate", str(LEARNING_RATE),
                                         "--overlap-block-kib", str(block_kib)),
                           server_flags=("--lease-timeout", "10"),  # the default lease, not the scaling bench's
                           label=f"b{block_kib}")
    return {"system": "tfps", "block_kib": block_kib, **{k: row[k] for k in (
        "model", "ps", "workers", "steps", "measured_steps", "global_batch", "step_s", "examples_per_s",
        "links_need_s", "step_over_links_need", "machine_cpu_busy_percent", "wall_s", "compute_s", "pull_s",
        "push_s", "largest_shard_share", "queue_drop_percent")}}


def side_by_side(rows: list[dict], r: float) -> list[dict]:
    """tfps k / mwms examples/s at each (TCP, model, N); beside it what the links alone allow
    (the ring's link need over tfps k's) and the bound 2(N-1)/N."""
    mwms = {(row["tcp"], row["model"], row["workers"]): row["examples_per_s"]
            for row in rows if row["system"] == "mwms"}
    return [{"tcp": row["tcp"], "model": row["model"], "workers": row["workers"], "ps": row["ps"],
             "block_kib": row["block_kib"], "ratio": row["examples_per_s"] / mwms[row["tcp"], row["model"], row["workers"]],
             "links_ratio": ring_need_s(row["workers"], r, row["model"]) / row["links_need_s"],
             "bound": 2 * (row["workers"] - 1) / row["workers"]}
            for row in rows if row["system"] == "tfps" and (row["tcp"], row["model"], row["workers"]) in mwms]


def print_report(report: dict) -> None:
    print(f"\nrate {report['rate']} per host each way; SGD, {report['batch_per_worker']} examples per worker "
          f"per step; step time after {report['warmup_steps']} warm-up steps")
    print(f"{'TCP':>5} {'model':>7} {'N':>2} {'system':>12} {'step ms':>9} {'ex/s':>8} {'links need ms':>14} "
          f"{'step/need':>10} {'CPU %':>6} {'drops % up/down':>16}")
    for r in report["rows"]:
        system = "mwms" if r["system"] == "mwms" else f"tfps k={r['ps']}" + (f" b{r['block_kib']}" * bool(
            r["block_kib"]))
        print(f"{r['tcp']:>5} {r['model']:>7} {r['workers']:>2} {system:>12} {1000 * r['step_s']:>9.0f} "
              f"{r['examples_per_s']:>8.1f} "
              f"{1000 * r['links_need_s']:>14.0f} {r['step_over_links_need']:>10.2f} "
              f"{r['machine_cpu_busy_percent']:>6.0f} "
              f"{'{up:.1f} / {down:.1f}'.format(**r['queue_drop_percent']):>16}")
    print(f"\n{'TCP':>5} {'model':>7} {'N':>2} {'k':>2} {'block KiB':>9} {'tfps/mwms':>10} {'links allow':>12} {'bound 2(N-1)/N':>15}")
    for s in report["side_by_side"]:
        print(f"{s['tcp']:>5} {s['model']:>7} {s['workers']:>2} {s['ps']:>2} {s['block_kib'] or '-':>9} "
              f"{s['ratio']:>10.2f} "
              f"{s['links_ratio']:>12.2f} "
              f"{s['bound']:>15.2f}")
    for f in report["failures"]:
        print(f"FAILED {f}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="100mbit", help="every host's link, each way, as tc writes it (default 100mbit)")
    p.add_argument("--workers", default="2,4", help=f"worker host counts N, at most {len(WORKER_HOSTS)} (default 2,4)")
    p.add_argument("--ps", default="1,2,n", help="server host counts k, 'n' for N (default 1,2,n); at most "
                                                  f"{len(PS_HOSTS)}, larger ones are left out")
    p.add_argument("--models", default="mlp", help=f"of {', '.join(SHAPES)} (default mlp)")
    p.add_argument("--steps", default="mlp=8,mlp25m=4", help="global steps per configuration, per model "
                                                            "(default mlp=8,mlp25m=4)")
    p.add_argument("--warmup-steps", type=int, default=2, help="first steps left out of the timing (default 2)")
    p.add_argument("--batch-per-worker", type=int, default=32, help="examples per worker per step (default 32)")
    p.add_argument("--tcp", default="cubic", help="the hosts' TCP congestion control, a list: each its own set "
                                                   "of hosts, in turn (default cubic, Linux's own; 'machine': "
                                                   "this machine's)")
    p.add_argument("--mwms-heartbeat-s", type=float, default=0.0,
                   help="MWMS' coordination service heartbeat timeout (default 0: TensorFlow's own, 10 s)")
    p.add_argument("--overlap-block-kib", default="0,32",
                   help="tfps workers' --overlap-block-kib, a list: each its own configuration (default 0,32: "
                        "PushPull over 1 MiB in 512 KiB blocks, then every push in 32 KiB blocks)")
    p.add_argument("--quick", action="store_true",
                   help="the test's run: --models mlp --workers 2 --ps 1 --steps mlp=3 --warmup-steps 1 "
                        "--overlap-block-kib 32")
    p.add_argument("--json", help="write the report here as JSON")
    return p


def _plan(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[int], list[str], list[str], dict]:
    if args.quick:
        args.models, args.workers, args.ps, args.steps, args.warmup_steps = "mlp", "2", "1", "mlp=3", 1
        args.overlap_block_kib = "32"
    try:
        workers = [int(w) for w in args.workers.split(",")]
        ps = [k.strip() for k in args.ps.split(",")]
        models = args.models.split(",")
        steps = {m: int(n) for m, n in (kv.split("=") for kv in args.steps.split(","))}
        rate_bytes(args.rate)
        args.tcp = [t.strip() for t in args.tcp.split(",")]
        args.overlap_block_kib = [int(b) for b in args.overlap_block_kib.split(",")]
    except Exception as e:  # noqa: BLE001
        p.error(str(e))
    if not all(2 <= w <= len(WORKER_HOSTS) for w in workers):
        p.error(f"--workers from 2 to {len(WORKER_HOSTS)}")
    if not all(k == "n" or k.isdigit() and int(k) >= 1 for k in ps):
        p.error("--ps: server host counts, or n")
    if not set(models) <= set(SHAPES) or not set(models) <= set(steps):
        p.error(f"--models of {', '.join(SHAPES)}, each with its --steps")
    if args.warmup_steps < 0 or any(steps[m] < args.warmup_steps + 2 for m in models) or args.batch_per_worker < 1:
        p.error("--steps >= --warmup-steps + 2 for every model")
    return workers, ps, models, steps


def run_all(hosts, workdir: str, args, report: dict, tcp: str, models, workers, ps, steps) -> None:
    """Every configuration on one set of hosts, its rows and failures into ``report``."""
    with hosts:
        run = Run(hosts, workdir, args.rate)
        for model in models:
            for n in workers:
                ks = sorted({w for w in (n if k == "n" else int(k) for k in ps) if w <= len(PS_HOSTS)})
                for system, k, b in [("mwms", 0, 0)] + [("tfps", k, b) for k in ks for b in args.overlap_block_kib]:
                    print(f"{tcp} {model}: {system}{f' k={k} b={b}' if k else ''}, N={n} ...", file=sys.stderr,
                          flush=True)
                    try:
                        row = (measure_mwms(run, n, steps[model], args.warmup_steps, args.batch_per_worker, model,
                                            args.mwms_heartbeat_s)
                               if system == "mwms" else
                               measure_tfps(run, k, n, steps[model], args.warmup_steps, args.batch_per_worker, model,
                                            b))
                        report["rows"].append({"tcp": tcp, **row})
                    except Exception as e:  # noqa: BLE001 - reported, and the exit status says so
                        report["failures"].append(f"{tcp} {model} {system} k={k} b={b} N={n}: "
                                                  f"{type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    workers, ps, models, steps = _plan(p, args)
    from ps_tools.hosts import Hosts, unavailable

    why = unavailable()
    if why:
        print(f"no emulated hosts: {why}", file=sys.stderr)
        return 2
    report = {"command": " ".join(["python", "bench/allreduce_hosts.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": machine(), "uptime_before": uptime(), "rate": args.rate, "r_bytes_per_s": rate_bytes(args.rate),
              "tcp": args.tcp, "mwms_heartbeat_s": args.mwms_heartbeat_s,
              "batch_per_worker": args.batch_per_worker, "warmup_steps": args.warmup_steps,
              "model_bytes": {m: model_bytes(m) for m in models}, "rows": [], "failures": []}
    counts = sorted({min(w if k == "n" else int(k), len(PS_HOSTS)) for w in workers for k in ps})
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tfps-allreduce-") as workdir:
        os.chmod(workdir, 0o755)
        for tcp in args.tcp:
            run_all(Hosts(PS_HOSTS[:max(counts)] + WORKER_HOSTS[:max(workers)], rate=args.rate,
                          tcp=hosts_tcp(tcp)), workdir, args, report, tcp, models, workers, ps,
                    steps)
    report["side_by_side"] = side_by_side(report["rows"], report["r_bytes_per_s"])
    return finish(report, started, print_report, args.json)


if __name__ == "__main__":
    sys.exit(main())
