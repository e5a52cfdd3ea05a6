"""``ps-compare --virtual --validate``: virtual time checked against real runs at small N.

    ps-compare --virtual --validate --workers 2,3,4 --profiles balanced,straggler --modes sync,async --out v/

For every (profile, N, mode, seed) it runs the real training (``ps-launch``: one server
and N worker processes on this machine, through ``ps_tools.study.compare_runs.run_one``, the
straggler by ``--slowdown``), reads the workers' histories, and runs the same job in
virtual time (``ps_tools.study.virtual``) with what the real run measured:

- ``compute_s``: the median of every worker's per-step ``compute_cpu_s`` (the CPU time
  of its gradient; without the first step, which traces); the profile's factor (the
  straggler's 3x) on top; and since the real processes share this machine's cores, so do
  the simulation's (``cores``: ``--cores``, default this machine's count);
- ``latency_s``: half the 10th percentile of ``pull_s`` (a pull is a request and a reply
  on loopback, where bytes cost next to nothing; the fast ones waited least for a core):
  the per-call cost of gRPC here;
- with ``--validate-hosts MBPS,MS`` the real runs are on emulated hosts
  (``ps_tools.study.compare_hosts``: a network namespace per process on a bridge, every host's
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
((virtual - real) / real), the same for the whole job's time, and final accuracies; per
(profile, N) the order of the modes each way and the pairs the real seeds decide, each
kept or contradicted by virtual time (``rankings``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics

from ps_tools.study import compare_runs
from ps_tools.study.report import spread, spread_test, summarize_run
from ps_tools.study.virtual import SimConfig, Simulation, Workload, fits

SLOWDOWN = 3.0


def scenario(profile: str, optimizer: str, learning_rate: float) -> compare_runs.Scenario:
    knobs = {compare_runs.ALL: f"--optimizer {optimizer} --learning-rate {learning_rate:g}"}
    if profile == "straggler":
        knobs[compare_runs.LAST] = f"--slowdown {SLOWDOWN:g}"
    elif profile != "balanced":
        raise ValueError(f"--validate runs the balanced and straggler profiles, not {profile!r}")
    return compare_runs.Scenario(profile, f"{profile} (real run)", knobs)


def measured(histories: list[dict]) -> dict:
    """The real run's per-step costs, medians over every worker's steps but the first:
    compute, pull, push, and the overhead (the time from one step's end to the next's
    beyond its pull, compute, push and knobs: the loop's own work), steps after which the
    chief evaluated left out of the overhead."""
    steps = [s for h in histories for s in h.get("steps", [])[1:]]
    if not steps:
        raise compare_runs.CompareError("the real run's histories hold no steps past the first")
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
    real = compare_runs.run_one(real_args, where, mode, seed, run_dir, links="emulated" if network else "sleep")
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
            "residual": _residual(v, r),
            "real_final_accuracy": summary["final_accuracy"], "virtual_final_accuracy": virtual["final_accuracy"],
            "real_train_s": summary["train_s"], "virtual_s": virtual["virtual_s"],
            "real_mean_staleness": (summary["staleness"] or {}).get("mean"),
            "virtual_mean_staleness": virtual["mean_staleness"], "command": real["command"],
            "links": real["links_description"]}


def _order_key(times: list) -> tuple:
    """A mode's place: the seeds that missed the target (fewer first), then the mean time
    of those that reached it."""
    reached = [t for t in times if t is not None]
    return (len(times) - len(reached), statistics.fmean(reached) if reached else math.inf)


def _decided(a: list, b: list) -> int:
    """-1 where the times ``a`` (one per seed, None: never reached) are ahead of ``b`` by
    more than the seeds explain, 1 where behind, 0 where it cannot be said: one reached the
    target in every seed and the other in none, or both in every seed with means apart by
    more than twice the standard error of their difference (``report.spread_test``; with
    one seed each, the means alone). Seeds that disagree on whether a mode gets there at
    all decide nothing."""
    ra, rb = all(t is not None for t in a), all(t is not None for t in b)
    na, nb = all(t is None for t in a), all(t is None for t in b)
    if ra and nb:
        return -1
    if na and rb:
        return 1
    if not (ra and rb):
        return 0
    test = spread_test(spread(a), spread(b))
    if test["exceeds"] is False or test["difference"] == 0:
        return 0
    return -1 if test["difference"] < 0 else 1


def rankings(rows: list[dict]) -> list[dict]:
    """Per (profile, N): the modes in order of time to the target, real and virtual
    (``_order_key``), whether the two orders are the same, and the pairs the real runs
    decide (``_decided``): each is ``kept`` when virtual time puts the two in the same
    order, ``contradicted`` otherwise. A pair the real seeds leave undecided asks nothing
    of the simulation: with its spread, either order is what the real runs show."""
    out = []
    keys = sorted({(r["profile"], r["workers"]) for r in rows})
    for profile, n in keys:
        mine = [r for r in rows if (r["profile"], r["workers"]) == (profile, n)]
        modes = list(dict.fromkeys(r["mode"] for r in mine))
        times = {side: {m: [r[f"{side}_time_to_target"] for r in mine if r["mode"] == m] for m in modes}
                 for side in ("real", "virtual")}
        order = {side: sorted(modes, key=lambda m: _order_key(times[side][m])) for side in times}
        decided, contradicted = [], []
        for i, a in enumerate(modes):
            for b in modes[i + 1:]:
                verdict = _decided(times["real"][a], times["real"][b])
                if not verdict:
                    continue
                first, second = (a, b) if verdict < 0 else (b, a)
                decided.append(f"{first} < {second}")
                if order["virtual"].index(first) > order["virtual"].index(second):
                    contradicted.append(f"{first} < {second}")
        out.append({"profile": profile, "workers": n, "real": order["real"], "virtual": order["virtual"],
                    "same": order["real"] == order["virtual"], "decided": decided, "contradicted": contradicted,
                    "kept": not contradicted})
    return out


def _residual(virtual: float | None, real: float | None) -> float | None:
    return (virtual - real) / real if (real and virtual is not None) else None


def _within(residuals: list[float | None], what: str) -> list[str]:
    got = [abs(x) for x in residuals if x is not None]
    if not got:
        return []
    return [f"{what}: {sum(x <= 0.25 for x in got)} of {len(got)} runs within 25 % (median |residual| "
            f"{statistics.median(got):.0%}, largest {max(got):.0%})."]


def validation_lines(rows: list[dict], ranks: list[dict], target: float) -> list[str]:
    links = rows[0].get("links") if rows else None
    lines = ["## Validation: virtual time against real runs", "",
             f"Seconds to {target:g} test accuracy, real (ps-launch's processes on this machine"
             + (f"; {links}" if links else "") + ") and virtual (the same job, "
             "the real run's median compute and pull time), residual = (virtual - real) / real; "
             "then the same for the whole job (the chief's training time as ps-launch reports it, its first "
             "step's tracing and its evaluations included, which virtual time does not charge), which "
             "depends on the model of time alone, not on the order the gradients arrived in:", "",
             "| profile | N | mode | seed | real s | virtual s | residual | job real s | job virtual s | "
             "job residual | real accuracy | virtual accuracy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda t: "never" if t is None else f"{t:.2f}"
    pct = lambda x: "n/a" if x is None else f"{x:+.0%}"
    for r in rows:
        job = _residual(r.get("virtual_s"), r.get("real_train_s"))
        lines.append(f"| {r['profile']} | {r['workers']} | {r['mode']} | {r['seed']} | "
                     f"{fmt(r['real_time_to_target'])} | {fmt(r['virtual_time_to_target'])} | {pct(r['residual'])} | "
                     f"{fmt(r.get('real_train_s'))} | {fmt(r.get('virtual_s'))} | {pct(job)} | "
                     f"{r['real_final_accuracy']:.3f} | {r['virtual_final_accuracy']:.3f} |")
    lines += [""] + _within([r["residual"] for r in rows], f"Time to {target:g}")
    lines += _within([_residual(r.get("virtual_s"), r.get("real_train_s")) for r in rows], "The whole job")
    lines += ["", "The modes in order of time to the target (fewer seeds that never reached it first, then the "
              "mean time), and the pairs the real runs decide: one mode reached the target in every seed and "
              "the other in none, or both in every seed with means apart by more than twice the standard "
              "error of their difference (one seed each: the means). A pair is kept when virtual time orders "
              "it the same way.", "",
              "| profile | N | real order | virtual order | same order | pairs the real runs decide | kept |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in ranks:
        kept = "yes" if k["kept"] else "no: " + ", ".join(k["contradicted"])
        lines.append(f"| {k['profile']} | {k['workers']} | {' < '.join(k['real'])} | {' < '.join(k['virtual'])} | "
                     f"{'yes' if k['same'] else 'no'} | {', '.join(k['decided']) or 'none'} | {kept} |")
    if ranks:
        lines += ["", f"Same order in {sum(k['same'] for k in ranks)} of {len(ranks)}; the real runs' decided "
                  f"pairs kept in {sum(k['kept'] for k in ranks)} of {len(ranks)} "
                  f"({sum(len(k['decided']) for k in ranks) - sum(len(k['contradicted']) for k in ranks)} of "
                  f"{sum(len(k['decided']) for k in ranks)} pairs)."]
    return lines + [""]


def main(args) -> int:
    os.makedirs(args.out, exist_ok=True)
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
