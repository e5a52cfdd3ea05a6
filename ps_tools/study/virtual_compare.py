"""``ps-compare --virtual``: sync, async, ssp and backup workers for N simulated workers.

    ps-compare --virtual --workers 64 --quick --out report/
    ps-compare --virtual --workers 2,4,8,16,32,64,128,256 --profiles balanced,straggler,tail \\
        --seeds 3 --server-mbps 1000 --out report/

Every (profile, N, mode, seed) is one run of ``ps_tools.study.virtual.Simulation`` (the job:
``--epochs`` of the training set, rounded down to whole sync rounds): the real
server core and real TensorFlow gradients, time from a model of compute, links and the
server (see that module). The compute and server costs are measured once per N here and
shared by every mode and profile of that N, so the modes differ only in what the modes do.
Writes report.json (every run, with its evaluations), report.md (time to the target
accuracy per mode against N, final accuracy, staleness, examples/s of virtual time, and
whether the fastest mode's lead exceeds the spread over the seeds) and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import sys
import time

from ps_tools.study.virtual import (MODES, PROFILES, SimConfig, Simulation, VirtualError, Workload, fits,
                                    mode_options)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-compare --virtual",
        description="Compare sync, async, ssp and backup workers for N simulated workers in virtual time: the "
        "real server core and real TensorFlow gradients, time from a model of compute, links and the server.")
    p.add_argument("--virtual", action="store_true", required=True, help="this mode (virtual time)")
    p.add_argument("--workers",
                   help="comma-separated worker counts N (default 2,4,8,16,32,64; --validate 2,3,4)")
    p.add_argument("--profiles", default="balanced,straggler",
                   help=f"comma-separated, from {', '.join(PROFILES)} (default %(default)s; --quick balanced)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: sync, async, sspS, backup")
    p.add_argument("--seeds", type=int, help="runs per profile, N and mode, seeds 0..K-1 (default 3; --quick 1)")
    p.add_argument("--validate", action="store_true",
                   help="run each configuration for real too (ps-launch on this machine) and compare: "
                   "ps_tools.study.virtual_validate (defaults then: --workers 2,3,4, --dataset digits, --batch 32)")
    p.add_argument("--validate-hosts", metavar="MBPS,MS",
                   help="--validate: the real runs on emulated hosts (ps_tools.hosts, root), every host's link "
                   "shaped to MBPS Mbit/s with MS ms added each way; their twins get the same links")
    p.add_argument("--eval-every", type=int, default=2, help="--validate: the real chief evaluates every N steps")
    p.add_argument("--run-timeout", type=float, default=900.0, help="--validate: seconds one real run may take")
    p.add_argument("--cores", type=float,
                   help="the whole cluster's processes share this many cores (0: a machine each; default 0, "
                   "--validate this machine's count, as its real runs do)")
    p.add_argument("--model", default="tiny", help="a built-in model (default tiny)")
    p.add_argument("--dataset", help="a built-in dataset (default digits-large; --validate digits)")
    p.add_argument("--train-examples", type=int, default=0, help="train on this many examples (0: all)")
    p.add_argument("--batch", type=int, help="each worker's examples per step (default 8; --validate 32)")
    p.add_argument("--epochs", type=float, help="passes over the training set (default 3; --quick 1)")
    p.add_argument("--optimizer", default="sgd", help="the server's optimizer (default sgd)")
    p.add_argument("--learning-rate", type=float, default=0.1, help="(default 0.1)")
    p.add_argument("--latency-ms", type=float, default=0.5, help="one way, every message (default 0.5)")
    p.add_argument("--worker-mbps", type=float, default=10000.0, help="each worker's link (default 10000; 0: "
                   "unlimited)")
    p.add_argument("--server-mbps", type=float, default=10000.0,
                   help="the server's link, shared by all workers (default 10000; 0: unlimited)")
    p.add_argument("--shards", type=int, default=1, help="server shards, each with a link of its own (default 1)")
    p.add_argument("--slowdown", type=float, default=3.0, help="the straggler profile's factor (default 3)")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="one step's compute in ms instead of the one measured here (0: measure)")
    p.add_argument("--target-accuracy", type=float, default=0.85, help="(default 0.85)")
    p.add_argument("--quick", action="store_true", help="one seed, one epoch, the balanced profile: minutes")
    p.add_argument("--out", required=True, help="directory for report.md, report.json and the plots")
    return p


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VirtualError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise VirtualError(f"{what} must be integers >= 1, got {text!r}")
    return values


def configure(args) -> tuple[list[int], list[str], list[str], SimConfig]:
    args.workers = args.workers or ("2,3,4" if args.validate else "2,4,8,16,32,64")
    args.dataset = args.dataset or ("digits" if args.validate else "digits-large")
    args.batch = args.batch or (32 if args.validate else 8)
    if args.validate and args.epochs is None:
        args.epochs = 3.0
    if args.validate and (args.epochs or 1) != int(args.epochs or 1):
        raise VirtualError("--validate runs whole --epochs (the real runs count epochs)")
    args.validate_network = None
    if args.validate_hosts is not None:
        if not args.validate:
            raise VirtualError("--validate-hosts is for --validate")
        try:
            rate, latency = (float(x) for x in args.validate_hosts.split(","))
        except ValueError:
            raise VirtualError(f"--validate-hosts: give MBPS,MS (e.g. 20,5), got {args.validate_hosts!r}") from None
        if not (rate > 0 and latency >= 0):
            raise VirtualError(f"--validate-hosts: the rate must be > 0 and the latency >= 0, got "
                               f"{args.validate_hosts!r}")
        from ps_tools.study.compare_hosts import Network

        args.validate_network = Network(rate_mbps=rate, latency_ms=latency)
    if args.cores is None:
        args.cores = float(os.cpu_count() or 1) if args.validate else 0.0
    workers = _ints(args.workers, "--workers")
    if args.quick and args.profiles == parser().get_default("profiles"):
        args.profiles = "balanced"
    profiles = [s.strip() for s in args.profiles.split(",") if s.strip()]
    bad = [s for s in profiles if s not in PROFILES]
    if bad or not profiles:
        raise VirtualError(f"--profiles: unknown {bad or args.profiles!r}; use {', '.join(PROFILES)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes:
        raise VirtualError("--modes is empty")
    for m in modes:  # a mode must fit some N; where it does not (backupK at N <= K) it is left out
        errors = []
        for n in workers:
            try:
                mode_options(m, n)
            except VirtualError as e:
                errors.append(e)
        if len(errors) == len(workers):
            raise errors[0]
    args.seeds = args.seeds or (1 if args.quick else 3)
    args.epochs = args.epochs or (1.0 if args.quick else 3.0)
    if args.seeds < 1:
        raise VirtualError("--seeds must be >= 1")
    from worker.data import DATASETS
    from worker.model import MODELS

    if args.model not in MODELS:
        raise VirtualError(f"--model: unknown {args.model!r}; use one of {', '.join(MODELS)}")
    if args.dataset not in DATASETS:
        raise VirtualError(f"--dataset: unknown {args.dataset!r}; use one of {', '.join(DATASETS)}")
    base = SimConfig(model=args.model, dataset=args.dataset, train_examples=args.train_examples, batch=args.batch,
                     epochs=args.epochs, optimizer=args.optimizer, learning_rate=args.learning_rate,
                     latency_s=args.latency_ms / 1000, worker_mbps=args.worker_mbps, server_mbps=args.server_mbps,
                     shards=args.shards, slowdown=args.slowdown, compute_s=args.compute_ms / 1000, cores=args.cores,
                     target_accuracy=args.target_accuracy, workers=workers[0], mode=modes[0], profile=profiles[0],
                     whole_rounds=True)
    base.check()
    return workers, profiles, modes, base


def run_study(workers: list[int], profiles: list[str], modes: list[str], seeds: int, base: SimConfig,
              progress=print, costs: dict | None = None) -> tuple[list[dict], dict]:
    """Every run of the study and the costs measured per N (``costs``: the server's, given;
    the compute is then the configuration's ``compute_s`` or measured)."""
    runs, costs_of = [], {}
    total = sum(fits(m, n) for n in workers for m in modes) * len(profiles) * seeds
    for n in workers:
        workloads = {}
        for seed in range(seeds):
            for profile in profiles:
                for mode in modes:
                    if not fits(mode, n):
                        continue
                    cfg = dataclasses.replace(base, workers=n, profile=profile, mode=mode, seed=seed)
                    if seed not in workloads:
                        workloads[seed] = Workload(cfg)
                    sim = Simulation(cfg, workloads[seed], costs_of.get(n, costs))
                    costs_of.setdefault(n, sim.costs)
                    run = sim.run()
                    runs.append(run)
                    reached = run["time_to_target"]
                    progress(f"ps-compare: [{len(runs)}/{total}] N={n} {profile} {mode} seed {seed}: "
                             f"accuracy {run['final_accuracy']:.3f}, to {base.target_accuracy:g} "
                             f"{'never' if reached is None else f'{reached:.3f} s'} (virtual), "
                             + ("diverged (a NaN gradient refused), " if run.get("diverged") else "") +
                             f"{run['wall_s']:.1f} s here")
    return runs, costs_of


def _mean_sd(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return mean, sd


def summarize(runs: list[dict], target: float) -> list[dict]:
    """One row per (profile, N, mode): means and spreads over the seeds."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["profile"], r["workers"], r["mode"]), []).append(r)
    rows = []
    for (profile, n, mode), rs in groups.items():
        times = [r["time_to_target"] for r in rs if r["time_to_target"] is not None]
        t_mean, t_sd = _mean_sd(times) if times else (None, None)
        acc_mean, acc_sd = _mean_sd([r.get("end_accuracy", r["final_accuracy"]) for r in rs])
        rows.append({"profile": profile, "workers": n, "mode": mode, "seeds": len(rs), "reached": len(times),
                     "time_to_target": t_mean if len(times) == len(rs) else None, "time_to_target_sd": t_sd,
                     "final_accuracy": acc_mean, "final_accuracy_sd": acc_sd,
                     "mean_staleness": _mean_sd([r["mean_staleness"] for r in rs])[0],
                     "examples_per_s": _mean_sd([r["examples_per_s"] for r in rs])[0],
                     "virtual_s": _mean_sd([r["virtual_s"] for r in rs])[0],
                     "server_busy": _mean_sd([r["server_busy"] for r in rs])[0],
                     "diverged": sum(bool(r.get("diverged")) for r in rs),
                     "times": times})
    return rows


def verdicts(rows: list[dict]) -> list[dict]:
    """Per (profile, N): the fastest mode to the target and whether its lead over each
    other mode exceeds the spread (|difference| > 2 standard errors of it, over the seeds)."""
    out = []
    by: dict = {}
    for r in rows:
        by.setdefault((r["profile"], r["workers"]), []).append(r)
    for (profile, n), rs in sorted(by.items()):
        reached = [r for r in rs if r["time_to_target"] is not None]
        if not reached:
            out.append({"profile": profile, "workers": n, "fastest": None, "against": []})
            continue
        best = min(reached, key=lambda r: r["time_to_target"])
        against = []
        for r in rs:
            if r is best:
                continue
            if r["time_to_target"] is None:
                against.append({"mode": r["mode"], "difference": None, "exceeds": True, "why": "never reached"})
                continue
            diff = r["time_to_target"] - best["time_to_target"]
            if best["seeds"] < 2 or r["seeds"] < 2:
                against.append({"mode": r["mode"], "difference": diff, "exceeds": None, "why": "one seed"})
                continue
            se = math.sqrt(best["time_to_target_sd"] ** 2 / best["seeds"] + r["time_to_target_sd"] ** 2 / r["seeds"])
            against.append({"mode": r["mode"], "difference": diff, "threshold": 2 * se, "exceeds": diff > 2 * se})
        out.append({"profile": profile, "workers": n, "fastest": best["mode"], "against": against})
    return out


def _fmt(mean, sd) -> str:
    if mean is None:
        return "never"
    return f"{mean:.3f}" + (f" ± {sd:.3f}" if sd else "")


def write_report(out: str, config: dict, runs: list[dict], costs_of: dict) -> list[str]:
    os.makedirs(out, exist_ok=True)
    rows = summarize(runs, config["target_accuracy"])
    verdict = verdicts(rows)
    report = {"config": config, "costs": {str(n): c for n, c in costs_of.items()}, "rows": rows,
              "verdicts": verdict, "runs": runs}
    paths = [os.path.join(out, "report.json"), os.path.join(out, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    modes, workers = config["modes"], config["workers"]
    lines = ["# ps-compare --virtual", "",
             f"Command: `{config['command']}`  ", f"Machine: {config['machine']}  ",
             f"Wall time: {config['wall_s']:.0f} s for {len(runs)} runs", "",
             f"Model `{config['model']}` ({runs[0]['params']:,} parameters; a pull {runs[0]['pull_bytes']:,} bytes, "
             f"a push {runs[0]['push_bytes']:,}) on `{config['dataset']}` ({runs[0]['train_examples']} training "
             f"examples), {config['batch']} examples per worker step (a sync round: N x {config['batch']}), "
             f"{config['epochs']:g} epochs, {config['optimizer']} at {config['learning_rate']:g}; links "
             f"{config['latency_ms']:g} ms one way, each worker's {config['worker_mbps']:g} Mbit/s, the server's "
             f"{config['server_mbps']:g} Mbit/s shared" + (f" ({config['shards']} shards)" if config['shards'] > 1
                                                          else "") + ".", "",
             "Costs measured here, per N (the same for every mode and profile of it): "
             + "; ".join(f"N={n}: compute {c['compute_s'] * 1000:.2f} ms, apply {c['apply_s'] * 1000:.3f} ms, "
                         f"fold {c['fold_s'] * 1000:.3f} ms, round step {c['round_apply_s'] * 1000:.3f} ms, "
                         f"push decode {c.get('decode_s', 0) * 1000:.3f} ms, pull encode {c.get('encode_s', 0) * 1000:.3f} ms"
                         for n, c in costs_of.items()), ""]
    for profile in config["profiles"]:
        lines += [f"## {profile}", "",
                  f"Virtual seconds to {config['target_accuracy']:g} test accuracy (mean ± sd over seeds; "
                  "never: some seed did not reach it):", "",
                  "| N | " + " | ".join(modes) + " | fastest |", "| --- | " + " | ".join("---" for _ in modes) + " | --- |"]
        for n in workers:
            cells = []
            for m in modes:
                r = next((r for r in rows if (r["profile"], r["workers"], r["mode"]) == (profile, n, m)), None)
                cells.append("n/a" if r is None else _fmt(r["time_to_target"], r["time_to_target_sd"]))
            v = next(v for v in verdict if (v["profile"], v["workers"]) == (profile, n))
            lead = ""
            if v["fastest"]:
                within = [a["mode"] for a in v["against"] if a["exceeds"] is False]
                unknown = any(a["exceeds"] is None for a in v["against"])
                lead = v["fastest"] + (f" (within spread: {', '.join(within)})" if within else "") \
                    + (" (one seed: spread unknown)" if unknown else "")
            lines.append(f"| {n} | " + " | ".join(cells) + f" | {lead or 'none'} |")
        lines += ["", "Final test accuracy (the mean of each run's last 10 evaluations, then over seeds), mean "
                  "staleness, examples per virtual second, server busy share:", "",
                  "| N | mode | final accuracy | staleness | examples/s | server busy |", "| --- | --- | --- | --- | --- | --- |"]
        for n in workers:
            for m in modes:
                r = next((r for r in rows if (r["profile"], r["workers"], r["mode"]) == (profile, n, m)), None)
                if r is None:
                    continue
                m_ = m + (f" (diverged in {r['diverged']} of {r['seeds']} seeds)" if r.get("diverged") else "")
                lines.append(f"| {n} | {m_} | {_fmt(r['final_accuracy'], r['final_accuracy_sd'])} | "
                             f"{r['mean_staleness']:.1f} | {r['examples_per_s']:.0f} | {r['server_busy']:.0%} |")
        lines.append("")
        paths += _plots(out, profile, config, rows, runs)
        lines += [f"![{profile}](plot-{profile}.png)", ""]
    chen_lines, chen = chen_comparison(config, rows)
    if chen:
        report["chen"] = chen
        with open(paths[0], "w") as f:
            json.dump(report, f, indent=1)
        lines += chen_lines
        paths += _chen_plot(out, config, rows)
        lines += ["![sync with backup workers against async](plot-chen.png)", ""]
    with open(paths[1], "w") as f:
        f.write("\n".join(lines))
    return paths


def chen_comparison(config: dict, rows: list[dict]) -> tuple[list[str], list[dict]]:
    """Chen et al., "Revisiting Distributed Synchronous SGD" (2016): sync with a few backup
    workers reaches a given accuracy sooner than async, and a better final accuracy, as N
    grows. Per profile and N: the best of sync and its backup modes against async, and
    whether each half of the claim held (a lead within the spread, or one seed, counts as
    not shown)."""
    backups = [m for m in config["modes"] if m == "sync" or m.startswith("backup")]
    if "async" not in config["modes"] or not backups:
        return [], []
    out, lines = [], ["## Sync with backup workers against async (Chen et al., 2016)", "",
                      "Chen et al. found synchronous SGD with a few backup workers faster to a given accuracy "
                      "than asynchronous SGD, and more accurate in the end, as the number of workers grows "
                      "(Inception and ImageNet, 50 to 100 workers). Here, per N: the fastest of "
                      f"{', '.join(backups)} against async, virtual seconds to {config['target_accuracy']:g} "
                      "and final test accuracy (each run's last 10 evaluations, mean over seeds).", ""]
    for profile in config["profiles"]:
        lines += [f"### {profile}", "", "| N | best sync | its time | async time | its accuracy | async accuracy "
                  "| sooner | more accurate |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for n in config["workers"]:
            mine = {r["mode"]: r for r in rows if r["profile"] == profile and r["workers"] == n}
            a = mine.get("async")
            cands = [mine[m] for m in backups if m in mine]
            if a is None or not cands:
                continue
            reached = [c for c in cands if c["time_to_target"] is not None]
            best = min(reached, key=lambda c: c["time_to_target"]) if reached else \
                max(cands, key=lambda c: c["final_accuracy"])
            sooner = _lead(best, a, "time_to_target", smaller=True)
            accurate = _lead(best, a, "final_accuracy", smaller=False)
            out.append({"profile": profile, "workers": n, "sync_mode": best["mode"],
                        "sync_time": best["time_to_target"], "async_time": a["time_to_target"],
                        "sync_accuracy": best["final_accuracy"], "async_accuracy": a["final_accuracy"],
                        "sooner": sooner, "more_accurate": accurate})
            lines.append(f"| {n} | {best['mode']} | {_fmt(best['time_to_target'], best['time_to_target_sd'])} | "
                         f"{_fmt(a['time_to_target'], a['time_to_target_sd'])} | {best['final_accuracy']:.3f} | "
                         f"{a['final_accuracy']:.3f} | {sooner} | {accurate} |")
        lines.append("")
    return lines, out


def _lead(best: dict, other: dict, key: str, smaller: bool) -> str:
    """"yes", "no" or "within spread" (or "one seed"): did ``best`` beat ``other`` on ``key``?"""
    b, o = best[key], other[key]
    if key == "time_to_target":
        if b is None:
            return "no" if o is not None else "neither reached"
        if o is None:
            return "yes (async never)"
    diff = (o - b) if smaller else (b - o)
    if best["seeds"] < 2 or other["seeds"] < 2:
        return ("yes" if diff > 0 else "no") + " (one seed)"
    se = math.sqrt(best[f"{key}_sd"] ** 2 / best["seeds"] + other[f"{key}_sd"] ** 2 / other["seeds"])
    if abs(diff) <= 2 * se:
        return "within spread"
    return "yes" if diff > 0 else "no"


def _chen_plot(out: str, config: dict, rows: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in config["modes"] if m == "sync" or m.startswith("backup") or m == "async"]
    fig, axes = plt.subplots(len(config["profiles"]), 2, figsize=(11, 3.6 * len(config["profiles"])),
                             squeeze=False)
    for (a, b), profile in zip(axes, config["profiles"]):
        for m in modes:
            mine = sorted((r for r in rows if r["profile"] == profile and r["mode"] == m), key=lambda r: r["workers"])
            pts = [(r["workers"], r["time_to_target"]) for r in mine if r["time_to_target"] is not None]
            if pts:
                a.plot(*zip(*pts), marker="o", label=m)
            b.plot([r["workers"] for r in mine], [r["final_accuracy"] for r in mine], marker="o", label=m)
        for ax in (a, b):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers N")
            ax.legend()
        a.set_ylabel(f"virtual s to {config['target_accuracy']:g}")
        a.set_title(f"{profile}: time to target")
        b.set_ylabel("final test accuracy")
        b.set_title(f"{profile}: final accuracy")
    fig.tight_layout()
    path = os.path.join(out, "plot-chen.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def _plots(out: str, profile: str, config: dict, rows: list[dict], runs: list[dict]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in config["modes"]:
        pts = [(r["workers"], r["time_to_target"]) for r in rows
               if r["profile"] == profile and r["mode"] == m and r["time_to_target"] is not None]
        if pts:
            a.plot(*zip(*sorted(pts)), marker="o", label=m)
    a.set_xscale("log", base=2)
    a.set_xlabel("workers N")
    a.set_ylabel(f"virtual s to {config['target_accuracy']:g} accuracy")
    a.set_title(f"{profile}: time to target against N")
    a.legend()
    n_max = max(config["workers"])
    for m in config["modes"]:
        r = next((r for r in runs if r["profile"] == profile and r["mode"] == m and r["workers"] == n_max
                  and r["seed"] == 0), None)
        if r:
            b.plot([e["t"] for e in r["evals"]], [e["test_accuracy"] for e in r["evals"]], label=m)
    b.set_xlabel("virtual seconds")
    b.set_ylabel("test accuracy")
    b.set_title(f"{profile}: N={n_max}, seed 0")
    b.legend()
    fig.tight_layout()
    path = os.path.join(out, f"plot-{profile}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        workers, profiles, modes, base = configure(args)
    except VirtualError as e:
        print(f"ps-compare: error: {e}", file=sys.stderr)
        return 2
    config = {"virtual": True, "workers": workers, "profiles": profiles, "modes": modes, "seeds": args.seeds,
              "model": args.model, "dataset": args.dataset, "train_examples": args.train_examples,
              "batch": args.batch, "epochs": args.epochs, "optimizer": args.optimizer,
              "learning_rate": args.learning_rate, "latency_ms": args.latency_ms, "worker_mbps": args.worker_mbps,
              "server_mbps": args.server_mbps, "shards": args.shards, "slowdown": args.slowdown,
              "target_accuracy": args.target_accuracy, "command": "ps-compare " + shlex.join(argv),
              "machine": f"{platform.node() or 'this machine'}: {os.cpu_count()} cores, {platform.platform()}"}
    if args.validate:
        from ps_tools.study import virtual_validate
        from ps_tools.study.compare_runs import CompareError

        args.worker_list, args.profile_list, args.mode_list = workers, profiles, modes
        args.command, args.epochs = config["command"], int(args.epochs)
        try:
            return virtual_validate.main(args)
        except (CompareError, ValueError) as e:
            print(f"ps-compare: error: {e}", file=sys.stderr)
            return 1
    started = time.monotonic()
    try:
        runs, costs_of = run_study(workers, profiles, modes, args.seeds, base,
                                   progress=lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        print("ps-compare: interrupted", file=sys.stderr)
        return 130
    config["wall_s"] = time.monotonic() - started
    paths = write_report(args.out, config, runs, costs_of)
    print(f"ps-compare: wrote {', '.join(paths)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
