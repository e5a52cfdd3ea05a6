"""``ps-advise``: measure a cluster for a few steps, then recommend a mode and its settings.

    ps-advise --ps 10.0.0.5:50051                     # a running cluster (any mode)
    ps-advise --launch --workers 3 --dataset digits --worker-args 2 "--slowdown 3"      # a launch configuration

What it measures, per worker: the time of a step's work (pull, compute, upload),
how it splits into compute and communication, and (in a probe) its step-to-step
spread (p90 / median); the spread across workers (slowest / typical),
the model's size and the bandwidth to each server shard. A running cluster is
read from the servers' Status (each worker's moving-average ``work_s``, the time
between its pushes minus the time it spent inside them) and from pulls of the
whole model timed from here; a launch configuration is run for a few steps in
async mode (so that no worker's time includes waiting for another) with
``ps-launch``, and read from the workers' per-step histories; there a step's
compute is the CPU time of the gradients (``compute_cpu_s``) times the worker's
``--slowdown``, since the probe's workers share this machine's cores and the
time one waits for a core says nothing of the configuration.

The profile's records, the rules that read it (``decide``) and their calibration are
in ``ps_tools.study.advise_rules``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from ps_tools.study.advise_rules import (COMM_FRACTION, STRAGGLER_RATIO, Advice, AdviseError, Measurements,
                                         WorkerTimes, decide)


# -- measuring a running cluster -------------------------------------------------------


def measure_cluster(addresses: list[str], window: float, pulls: int = 3, token: str | None = None) -> Measurements:
    from protos.wire import mode_from_wire
    from worker.client import PSClient  # grpc: only when measuring
    from worker.sharded_client import combine_statuses

    statuses, bandwidth, model_bytes = [], {}, 0
    for address in addresses:
        with PSClient(address, token=token) as c:
            first = c.status()
            if not first.initialized:
                raise AdviseError(f"{address} holds no variables yet: start the training, then ps-advise")
            _, values = c.pull(-1)
            names = list(values)
            nbytes = sum(a.nbytes for a in values.values())
            t0 = time.perf_counter()
            for _ in range(pulls):
                c.pull(-1, names)  # by name: the whole model every time, no cache
            bandwidth[address] = nbytes * pulls / (time.perf_counter() - t0)
            model_bytes += nbytes
    time.sleep(window)  # let the moving averages cover the window
    for address in addresses:
        with PSClient(address, token=token) as c:
            statuses.append(c.status())
    slowest_link = min(bandwidth.values())
    comm = 2 * model_bytes / slowest_link if slowest_link > 0 else 0.0
    cluster = combine_statuses(statuses)  # each worker's work_s: the largest any shard saw
    workers = [WorkerTimes(w.worker_id, w.work_s, max(0.0, w.work_s - comm), min(comm, w.work_s))
               for w in cluster.workers if not (w.left or w.dead or w.pushes < 2)]
    if not workers:
        raise AdviseError("no worker has pushed twice yet: run ps-advise while training goes on")
    return Measurements(f"running cluster at {','.join(addresses)}", mode_from_wire(cluster.mode),
                        workers, model_bytes, bandwidth)


# -- measuring a launch configuration -----------------------------------------------------


def measure_launch(launch_args: list[str], steps: int, timeout: float) -> Measurements:
    from ps_tools.launch import parser as launch_parser

    parsed = launch_parser().parse_args(launch_args)
    workers = parsed.workers
    with tempfile.TemporaryDirectory(prefix="ps-advise-") as tmp:
        argv = [sys.executable, "-m", "ps_tools.launch", *launch_args, "--mode", "async", "--steps", str(steps),
                "--log-every", "1000000", "--metrics-json", os.path.join(tmp, "metrics.json")]
        for i in range(workers):
            argv += ["--worker-args", str(i), "--history-json " + shlex.quote(os.path.join(tmp, f"h{i}.json"))]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise AdviseError(f"the probe run failed (ps-launch exited {done.returncode}):\n{done.stdout[-2000:]}")
        with open(os.path.join(tmp, "metrics.json")) as f:
            metrics = json.load(f)
        histories = []
        for i in range(workers):
            with open(os.path.join(tmp, f"h{i}.json")) as f:
                histories.append(json.load(f))
    # float32 parameters, as the servers count them at the end of the probe
    model_bytes = 4 * sum(s.get("parameters", 0) for s in metrics.get("shards", [])) or _model_bytes(parsed)
    times = []
    for h in histories:
        steps_ = h["steps"][1:] or h["steps"]  # the first step carries TensorFlow's one-time setup
        knobs = h.get("knobs", {})
        slowdown = float(knobs.get("slowdown", 1.0) or 1.0)
        # CPU seconds, not wall: the probe's workers share this machine's cores, as their
        # own machines would not, and the time one waits for a core is not the configuration's.
        compute = statistics.median(s.get("compute_cpu_s", s["compute_s"]) * slowdown for s in steps_)
        comm = statistics.median(s["pull_s"] + s["push_s"] + max(0.0, s["knob_s"] - (slowdown - 1) * s["compute_s"])
                                 for s in steps_)
        work = sorted(s["pull_s"] + s["compute_s"] + s["push_s"] + s["knob_s"] for s in steps_)
        spread = work[int(0.9 * (len(work) - 1))] / statistics.median(work) if statistics.median(work) > 0 else 0.0
        times.append(WorkerTimes(h["worker_index"], compute + comm, compute, comm, spread))
    bandwidth = {"loopback": 2 * model_bytes / statistics.median(t.comm_s for t in times)
                 if any(t.comm_s for t in times) else math.inf}
    return Measurements(f"probe: ps-launch {shlex.join(launch_args)} (async, {steps} steps)", "async", times,
                        model_bytes, bandwidth)


def _model_bytes(parsed) -> int:
    from worker.model import build_model

    return sum(int(v.numpy().nbytes) for v in build_model(parsed.model or "cnn").trainable_variables)


def report(m: Measurements, advice: Advice) -> str:
    lines = [f"measured: {m.source} (mode {m.mode})",
             f"model: {m.model_bytes / 2**20:.2f} MiB; bandwidth of a whole-model pull: "
             + ", ".join(f"{a} {b / 2**20:.0f} MiB/s" if math.isfinite(b) else f"{a} -" for a, b in m.bandwidth.items()),
             "", "worker  step work (s)  compute (s)  communication (s)  p90/median"]
    for w in sorted(m.workers, key=lambda w: w.index):
        spread = f"{w.spread:.2f}" if w.spread else "-"
        lines.append(f"{w.index:>6}  {w.work_s:>13.4f}  {w.compute_s:>11.4f}  {w.comm_s:>17.4f}  {spread:>10}")
    lines += ["", f"slowest / typical step work: {m.straggler_ratio:.2f} (rule: >= {STRAGGLER_RATIO} is a straggler)",
              f"communication share of a step: {m.comm_fraction:.0%} (rule: >= {COMM_FRACTION:.0%} is "
              "communication-bound)", "",
              f"recommendation: {' '.join(advice.flags)}   [rule: {advice.rule}]", f"why: {advice.reason}"]
    if advice.alternative:
        lines.append(f"alternative: {advice.alternative}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ps-advise", description="Measure a cluster for a few steps and recommend "
                                "sync, async, ssp or backup workers, showing the numbers and the rule.")
    p.add_argument("--ps", help="a running cluster: its server(s), HOST:PORT[,HOST:PORT...]")
    p.add_argument("--window", type=float, default=5.0, help="running cluster: seconds to watch (default 5)")
    p.add_argument("--launch", nargs=argparse.REMAINDER,
                   help="a launch configuration: everything after it is ps-launch's arguments")
    p.add_argument("--probe-steps", type=int, default=20, help="launch: steps of the probe run (default 20)")
    p.add_argument("--timeout", type=float, default=600.0, help="launch: seconds the probe may take (default 600)")
    p.add_argument("--json-out", help="also write the measurements and the advice here")
    g = p.add_argument_group("prediction (ps_tools.study.advise_predict): the measured profile in virtual time")
    g.add_argument("--predict", action="store_true",
                   help="simulate the measured cluster at --predict-workers and decide by time to accuracy")
    g.add_argument("--predict-workers", type=int, help="N to predict for (default: the workers measured)")
    g.add_argument("--link-mbps", type=float,
                   help="each worker's and the server's link in Mbit/s (default: the pull bandwidth measured, "
                        "at most 10000)")
    g.add_argument("--latency-ms", type=float, default=0.5, help="one way, every message (default 0.5)")
    g.add_argument("--predict-modes", help="comma-separated: sync, async, sspS, backup, backupK "
                                           "(default sync,async,ssp4 and backup from 3 workers)")
    g.add_argument("--predict-seeds", type=int, default=2, help="runs per mode (default 2)")
    g.add_argument("--predict-epochs", type=float, help="the simulated job's epochs (default: the launch's)")
    g.add_argument("--target-accuracy", type=float, default=0.85, help="(default 0.85)")
    g.add_argument("--predict-model", help="a built-in model to simulate (default: the launch's; for --ps the "
                                           "built-in nearest in parameters, as a stand-in)")
    g.add_argument("--predict-dataset", help="a built-in dataset (default: the launch's; for --ps digits)")
    # Everything after --launch is ps-launch's, "--" first or not (argparse alone refuses
    # "--launch -- ARGS": it takes "--" as the end of options, then has no home for ARGS).
    argv = list(sys.argv[1:] if argv is None else argv)
    launch = None
    if "--launch" in argv:
        at = argv.index("--launch")
        argv, launch = argv[:at], argv[at + 1:]
        launch = launch[1:] if launch[:1] == ["--"] else launch
    args = p.parse_args(argv)
    if bool(args.ps) == (launch is not None):
        print("ps-advise: error: give either --ps HOST:PORT (a running cluster) or --launch ARGS...", file=sys.stderr)
        return 2
    try:
        if args.ps:
            from ps_common import security

            m = measure_cluster([a.strip() for a in args.ps.split(",")], args.window,
                                token=security.load_token(None, os.environ))
        else:
            if args.probe_steps < 3:
                raise AdviseError("--probe-steps must be >= 3")
            m = measure_launch(launch, args.probe_steps, args.timeout)
    except AdviseError as e:
        print(f"ps-advise: error: {e}", file=sys.stderr)
        return 1
    advice = decide(m)
    print(report(m, advice), flush=True)
    out = {"measurements": {**dataclasses.asdict(m), "straggler_ratio": m.straggler_ratio,
                            "comm_fraction": m.comm_fraction}, "advice": dataclasses.asdict(advice)}
    if args.predict:
        from ps_tools.study import advise_predict

        modes = [s.strip() for s in args.predict_modes.split(",") if s.strip()] if args.predict_modes else None
        try:
            prediction = advise_predict.predict(
                m, advice, args.predict_workers or len(m.workers), launch_args=launch, link_mbps=args.link_mbps,
                latency_ms=args.latency_ms, modes=modes, seeds=args.predict_seeds, epochs=args.predict_epochs,
                target=args.target_accuracy, model=args.predict_model, dataset=args.predict_dataset,
                progress=lambda line: print(line.replace("ps-compare:", "ps-advise:"), file=sys.stderr, flush=True))
        except AdviseError as e:
            print(f"ps-advise: error: {e}", file=sys.stderr)
            return 1
        print(advise_predict.report(prediction), flush=True)
        out["prediction"] = {**dataclasses.asdict(prediction), "advice": dataclasses.asdict(prediction.advice)}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
