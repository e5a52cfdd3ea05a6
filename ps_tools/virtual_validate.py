"""``ps-compare --virtual --validate``: virtual time checked against real runs at small N.

    ps-compare --virtual --validate --workers 2,3,4 --profiles balanced,straggler --modes sync,async --out v/

For every (profile, N, mode, seed) it runs the real training (``ps-launch``: one server
and N worker processes on this machine, through ``ps_tools.compare.run_one``, the
straggler by ``--slowdown``), reads the workers' histories, and runs the same job in
virtual time (``ps_tools.virtual``) with what the real run measured:

- ``compute_s``: the median of every worker's per-step ``compute_cpu_s`` (the CPU time
  of its gradient; without the first step, which traces); the profile's factor (the
  straggler's 3x) on top; and since the real processes share this machine's cores, so do
  the simulation's (``cores``: ``--cores``, default this machine's count);
- ``latency_s``: half the 10th percentile of ``pull_s`` (a pull is a request and a reply
  on loopback, where bytes cost next to nothing; the fast ones waited least for a core):
  the per-call cost of gRPC here;
- with ``--validate-hosts MBPS,MS`` the real runs are on emulated hosts
  (``ps_tools.compare_hosts``: a network namespace per process on a bridge, every host's
  link shaped with ``tc tbf`` at MBPS, MS added each way by the relay before the server),
  and the twin gets each worker's link and the server's (shared by all) at MBPS and a
  one-way latency of MS plus the per-call cost: half of what the fast pulls took beyond
  their bytes at MBPS and the 2 x MS;
- ``step_overhead_s``: the median time between steps beyond their pull, compute, push
  and knobs (the worker loop's own work);
- ``retrace_s``: what a gradient call on a second batch size costs here beyond a traced
  one (the short last batch of an epoch traces the worker's tf.function again), timed on
  a fresh model before the simulation.

The twin evaluates on the real chief's grid (``--eval-every`` K: the values of its steps
K-1, 2K-1, ...; ``SimConfig.eval_every_rounds``), so that an accuracy passing the target
between two of the chief's evaluations is missed by both. The twin's job ends as the
real one does, when every worker has done the job's steps
(``SimConfig.job_in_steps``: a backup worker's dropped push is a step too). The real
time to the target is the chief's, less the first step's tracing and its own
evaluations before it (a virtual evaluation takes no time).

Nothing else is fitted: the server's costs are measured on scratch servers as in every
virtual run, and the accuracy comes from the simulation's own gradients. The report
holds, per run, the real and the virtual time to the target accuracy, their residual
((virtual - real) / real) and final accuracies, and per (profile, N) whether the two rank
the modes the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

from ps_tools import compare
from ps_tools.report import summarize_run
from ps_tools.virtual import SimConfig, Simulation, Workload

SLOWDOWN = 3.0


def scenario(profile: str, optimizer: str, learning_rate: float) -> compare.Scenario:
    knobs = {compare.ALL: f"--optimizer {optimizer} --learning-rate {learning_rate:g}"}
    if profile == "straggler":
        knobs[compare.LAST] = f"--slowdown {SLOWDOWN:g}"
    elif profile != "balanced":
        raise ValueError(f"--validate runs the balanced and straggler profiles, not {profile!r}")
    return compare.Scenario(profile, f"{profile} (real run)", knobs)


def measured(histories: list[dict]) -> dict:
    """The real run's per-step costs, medians over every worker's steps but the first:
    compute, pull, push, and the overhead (the time from one step's end to the next's
    beyond its pull, compute, push and knobs: the loop's own work), steps after which the
    chief evaluated left out of the overhead."""
    steps = [s for h in histories for s in h.get("steps", [])[1:]]
    if not steps:
        raise compare.CompareError("the real run's histories hold no steps past the first")
    evaluated = {e["step"] for e in histories[0].get("evals", [])}
    overheads = []
    for k, h in enumerate(histories):
        ss = h.get("steps", [])
        for a, b in zip(ss[1:], ss[2:]):
            if k == 0 and a["step"] in evaluated:
                continue
            spent = b["pull_s"] + b["compute_s"] + b["push_s"] + b.get("knob_s", 0.0)
            overheads.append(max(0.0, b["t"] - a["t"] - spent))
    pulls = sorted(s["pull_s"] for s in steps)
    return {"compute_s": statistics.median(s["compute_s"] for s in steps),
            "compute_cpu_s": statistics.median(s.get("compute_cpu_s", s["compute_s"]) for s in steps),
            "pull_s": statistics.median(pulls), "pull_fast_s": pulls[len(pulls) // 10],
            "push_s": statistics.median(s["push_s"] for s in steps),
            "overhead_s": statistics.median(overheads) if overheads else 0.0}


def real_time_to_target(histories: list[dict], target: float) -> float | None:
    """The chief's first evaluation at ``target`` or better, in seconds of training: from the
    start, less the first step's tracing (its time beyond a typical step) and less the
    chief's evaluations before it (the virtual run's evaluations take no time)."""
    chief = histories[0]
    steps, evals = chief.get("steps", []), chief.get("evals", [])
    if len(steps) < 3:
        return None
    typical = statistics.median(b["t"] - a["t"] for a, b in zip(steps[1:], steps[2:]))
    warmup = max(0.0, steps[0]["t"] - typical)
    spent = 0.0
    for e in evals:
        if e["test_accuracy"] >= target:
            return max(0.0, e["t"] - warmup - spent)
        spent += e.get("eval_s", 0.0)
    return None


def validate_one(args, profile: str, n: int, mode: str, seed: int, out: str, workload_of: dict) -> dict:
    real_args = argparse.Namespace(workers=n, dataset=args.dataset, model=args.model,
                                   global_batch_size=n * args.batch, steps=0, epochs=args.epochs,
                                   eval_every=args.eval_every, run_timeout=args.run_timeout,
                                   train_examples=args.train_examples)
    run_dir = os.path.join(out, "runs", profile, f"w{n}", mode, f"seed{seed}")
    network = getattr(args, "validate_network", None)
    where = scenario(profile, args.optimizer, args.learning_rate)
    if network is not None:
        where = dataclasses.replace(where, network=network)
    real = compare.run_one(real_args, where, mode, seed, run_dir, links="emulated" if network else "sleep")
    summary = summarize_run(real, args.target_accuracy)
    costs = measured(real["histories"])
    summary["time_to_target_s"] = real_time_to_target(real["histories"], args.target_accuracy)
    cfg = SimConfig(mode=mode, workers=n, profile=profile, model=args.model, dataset=args.dataset,
                    train_examples=args.train_examples, batch=args.batch, epochs=float(args.epochs),
                    optimizer=args.optimizer, learning_rate=args.learning_rate, seed=seed,
                    worker_mbps=0.0, server_mbps=0.0, slowdown=SLOWDOWN, compute_s=costs["compute_cpu_s"],
                    step_overhead_s=costs["overhead_s"], cores=args.cores, target_accuracy=args.target_accuracy,
                    job_in_steps=True, eval_every_rounds=args.eval_every)
    key = (n, seed)
    if key not in workload_of:
        workload_of[key] = Workload(cfg)
        workload_of[key].retrace_s = workload_of[key].measure_retrace()  # on its fresh model, first
    w = workload_of[key]
    latency = costs["pull_fast_s"] / 2
    if network is not None:  # the shaped links' own time taken out of the fast pulls: the per-call rest
        wire = network.latency_ms / 1000
        per_call = max(0.0, costs["pull_fast_s"] - w.pull_bytes * 8 / (network.rate_mbps * 1e6) - 2 * wire) / 2
        latency = wire + per_call
        cfg = dataclasses.replace(cfg, worker_mbps=network.rate_mbps, server_mbps=network.rate_mbps)
    costs["latency_s"] = latency
    cfg = dataclasses.replace(cfg, latency_s=latency, retrace_s=w.retrace_s)
    virtual = Simulation(cfg, workload_of[key]).run()
    r, v = summary["time_to_target_s"], virtual["time_to_target"]
    return {"profile": profile, "workers": n, "mode": mode, "seed": seed, "measured": costs,
            "real_time_to_target": r, "virtual_time_to_target": v,
            "residual": (v - r) / r if (r and v is not None) else None,
            "real_final_accuracy": summary["final_accuracy"], "virtual_final_accuracy": virtual["final_accuracy"],
            "real_train_s": summary["train_s"], "virtual_s": virtual["virtual_s"],
            "real_mean_staleness": (summary["staleness"] or {}).get("mean"),
            "virtual_mean_staleness": virtual["mean_staleness"], "command": real["command"],
            "links": real["links_description"]}


def rankings(rows: list[dict]) -> list[dict]:
    """Per (profile, N): the modes ordered by mean time to the target, real and virtual."""
    out = []
    keys = sorted({(r["profile"], r["workers"]) for r in rows})
    for profile, n in keys:
        mine = [r for r in rows if (r["profile"], r["workers"]) == (profile, n)]
        order = {}
        for side in ("real", "virtual"):
            means = {}
            for m in dict.fromkeys(r["mode"] for r in mine):
                times = [r[f"{side}_time_to_target"] for r in mine if r["mode"] == m]
                means[m] = statistics.mean(times) if all(t is not None for t in times) else float("inf")
            order[side] = sorted(means, key=means.get)
        out.append({"profile": profile, "workers": n, "real": order["real"], "virtual": order["virtual"],
                    "same": order["real"] == order["virtual"]})
    return out


def validation_lines(rows: list[dict], ranks: list[dict], target: float) -> list[str]:
    links = rows[0].get("links") if rows else None
    lines = ["## Validation: virtual time against real runs", "",
             f"Seconds to {target:g} test accuracy, real (ps-launch's processes on this machine"
             + (f"; {links}" if links else "") + ") and virtual (the same job, "
             "the real run's median compute and pull time), residual = (virtual - real) / real:", "",
             "| profile | N | mode | seed | real s | virtual s | residual | real accuracy | virtual accuracy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda t: "never" if t is None else f"{t:.2f}"
    for r in rows:
        res = "n/a" if r["residual"] is None else f"{r['residual']:+.0%}"
        lines.append(f"| {r['profile']} | {r['workers']} | {r['mode']} | {r['seed']} | "
                     f"{fmt(r['real_time_to_target'])} | {fmt(r['virtual_time_to_target'])} | {res} | "
                     f"{r['real_final_accuracy']:.3f} | {r['virtual_final_accuracy']:.3f} |")
    residuals = [abs(r["residual"]) for r in rows if r["residual"] is not None]
    if residuals:
        within = sum(x <= 0.25 for x in residuals)
        lines += ["", f"{within} of {len(residuals)} runs within 25 % (median |residual| "
                  f"{statistics.median(residuals):.0%}, largest {max(residuals):.0%})."]
    lines += ["", "| profile | N | real ranking | virtual ranking | same |", "| --- | --- | --- | --- | --- |"]
    for k in ranks:
        lines.append(f"| {k['profile']} | {k['workers']} | {' < '.join(k['real'])} | {' < '.join(k['virtual'])} | "
                     f"{'yes' if k['same'] else 'no'} |")
    return lines + [""]


def main(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    from ps_tools.virtual_compare import fits

    rows, workload_of = [], {}
    total = len(args.profile_list) * sum(fits(m, n) for n in args.worker_list for m in args.mode_list) * args.seeds
    for profile in args.profile_list:
        for n in args.worker_list:
            for mode in args.mode_list:
                if not fits(mode, n):  # backup at N = 2
                    continue
                for seed in range(args.seeds):
                    row = validate_one(args, profile, n, mode, seed, args.out, workload_of)
                    rows.append(row)
                    print(f"ps-compare: [{len(rows)}/{total}] validate N={n} {profile} {mode} seed {seed}: real "
                          f"{row['real_time_to_target']}, virtual {row['virtual_time_to_target']} s to "
                          f"{args.target_accuracy:g}", flush=True)
    ranks = rankings(rows)
    report = {"config": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, bool))},
              "validation": rows, "rankings": ranks}
    paths = [os.path.join(args.out, "validation.json"), os.path.join(args.out, "validation.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths[1], "w") as f:
        f.write("\n".join(["# ps-compare --virtual --validate", "", f"Command: `{args.command}`", ""]
                          + validation_lines(rows, ranks, args.target_accuracy)))
    print(f"ps-compare: wrote {', '.join(paths)}", flush=True)
    return 0
