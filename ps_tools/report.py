"""The ``ps-compare`` report: numbers per run, their spread across seeds, tables and plots.

    paths = write_report(out_dir, config, runs)   # report.json, report.md, plot-*.png, staleness-*.png

A run is what ``ps_tools.compare.run_one`` returns: the launch metrics and every
worker's history (per step: t, loss, version, staleness, dropped; the chief's
"evals": test accuracy every few steps). From each run: the final test
accuracy, the time and the number of updates (server versions) until the
chief first measured the target accuracy, training time, examples/s, and the
staleness of every push. Per scenario and mode: the mean and standard
deviation of each over the seeds; the deviation is the mode's stability.
"""

from __future__ import annotations

import json
import math
import os
import statistics


def summarize_run(run: dict, target: float) -> dict:
    metrics, histories = run["metrics"], run["histories"]
    chief = histories[0]
    evals = list(chief.get("evals", []))
    steps = chief.get("steps", [])
    end_t = steps[-1]["t"] if steps else metrics.get("train_s", 0.0)
    end_version = steps[-1]["version"] if steps else 0
    curve = [(e["t"], e["version"], e["test_accuracy"]) for e in evals]
    curve.append((max(end_t, curve[-1][0] if curve else 0.0), end_version, metrics["test_accuracy"]))
    reached = next(((t, v) for t, v, acc in curve if acc >= target), None)
    staleness = [s["staleness"] for h in histories for s in h.get("steps", []) if not s.get("dropped")]
    dropped = sum(1 for h in histories for s in h.get("steps", []) if s.get("dropped"))
    return {
        "scenario": run["scenario"],
        "mode": run["mode"],
        "seed": run["seed"],
        "final_accuracy": metrics["test_accuracy"],
        "final_loss": metrics.get("final_loss"),
        "time_to_target_s": reached[0] if reached else None,
        "updates_to_target": reached[1] if reached else None,
        "train_s": metrics.get("train_s", end_t),
        "examples_per_s": metrics.get("examples_per_s"),
        "updates": end_version,
        "staleness": _distribution(staleness),
        "dropped": dropped,
        "accuracy_curve": [{"t": t, "version": v, "test_accuracy": a} for t, v, a in curve],
        "loss_curve": [{"t": s["t"], "version": s["version"], "loss": s["loss"]} for s in steps],
        "command": run.get("command", ""),
    }


def _distribution(values: list[int]) -> dict:
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    ordered = sorted(values)
    return {
        "counts": {str(k): c for k, c in sorted(counts.items())},
        "mean": statistics.fmean(values) if values else 0.0,
        "p90": ordered[int(0.9 * (len(ordered) - 1))] if ordered else 0,
        "max": ordered[-1] if ordered else 0,
    }


def _spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def aggregate(summaries: list[dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["scenario"], s["mode"]), []).append(s)
    rows = []
    for (scenario, mode), runs in groups.items():
        merged: dict[str, int] = {}
        for r in runs:
            for k, c in r["staleness"]["counts"].items():
                merged[k] = merged.get(k, 0) + c
        all_staleness = [int(k) for k, c in merged.items() for _ in range(c)]
        rows.append({
            "scenario": scenario,
            "mode": mode,
            "seeds": len(runs),
            "final_accuracy": _spread([r["final_accuracy"] for r in runs]),
            "time_to_target_s": _spread([r["time_to_target_s"] for r in runs]),
            "updates_to_target": _spread([r["updates_to_target"] for r in runs]),
            "train_s": _spread([r["train_s"] for r in runs]),
            "examples_per_s": _spread([r["examples_per_s"] for r in runs]),
            "staleness": _distribution(all_staleness),
            "dropped": sum(r["dropped"] for r in runs),
        })
    return rows


def _fmt(spread: dict, digits: int = 1, suffix: str = "") -> str:
    if spread["mean"] is None:
        return "not reached"
    text = f"{spread['mean']:.{digits}f} ± {spread['sd']:.{digits}f}{suffix}"
    return text


def findings(rows: list[dict], scenario: str, target: float) -> list[str]:
    """Plain sentences on what the table of one scenario shows."""
    mine = [r for r in rows if r["scenario"] == scenario]
    if not mine:
        return []
    reached = [r for r in mine if r["time_to_target_s"]["n"] == r["seeds"]]
    lines = []
    if reached:
        best = min(reached, key=lambda r: r["time_to_target_s"]["mean"])
        lines.append(f"Fastest to {target:.2f} test accuracy: **{best['mode']}**, "
                     f"{best['time_to_target_s']['mean']:.1f} s on average over {best['seeds']} seed(s).")
        sync = next((r for r in mine if r["mode"] == "sync"), None)
        if sync is not None and sync is not best and sync["time_to_target_s"]["n"]:
            ratio = sync["time_to_target_s"]["mean"] / best["time_to_target_s"]["mean"]
            lines.append(f"sync took {sync['time_to_target_s']['mean']:.1f} s, {ratio:.2f}x the time of {best['mode']}.")
    missed = [r["mode"] for r in mine if r["time_to_target_s"]["n"] < r["seeds"]]
    if missed:
        lines.append(f"Did not reach {target:.2f} in every seed: {', '.join(missed)}.")
    top = max(mine, key=lambda r: r["final_accuracy"]["mean"])
    steadiest = min(mine, key=lambda r: r["final_accuracy"]["sd"] if r["seeds"] > 1 else math.inf)
    lines.append(f"Best final accuracy: {top['mode']} ({_fmt(top['final_accuracy'], 4)}); "
                 f"smallest spread across seeds: {steadiest['mode']} (sd {steadiest['final_accuracy']['sd']:.4f}).")
    fastest = max(mine, key=lambda r: r["examples_per_s"]["mean"] or 0.0)
    lines.append(f"Highest throughput: {fastest['mode']} ({fastest['examples_per_s']['mean']:.0f} examples/s).")
    return lines


def _plots(out: str, scenario: str, summaries: list[dict], modes: list[str]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(modes)}
    runs = [s for s in summaries if s["scenario"] == scenario]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for s in runs:
        c = colors[s["mode"]]
        label = s["mode"] if s["seed"] == 0 else None
        acc = s["accuracy_curve"]
        axes[0][0].plot([p["t"] for p in acc], [p["test_accuracy"] for p in acc], color=c, alpha=0.8, label=label)
        axes[0][1].plot([p["version"] for p in acc], [p["test_accuracy"] for p in acc], color=c, alpha=0.8, label=label)
        loss = _smooth([p["loss"] for p in s["loss_curve"]])
        axes[1][0].plot([p["t"] for p in s["loss_curve"]], loss, color=c, alpha=0.8, label=label)
        axes[1][1].plot([p["version"] for p in s["loss_curve"]], loss, color=c, alpha=0.8, label=label)
    titles = (("test accuracy vs wall time", "seconds", "test accuracy"),
              ("test accuracy vs updates", "server version (updates applied)", "test accuracy"),
              ("training loss (chief, smoothed) vs wall time", "seconds", "loss"),
              ("training loss (chief, smoothed) vs updates", "server version (updates applied)", "loss"))
    for ax, (title, xlabel, ylabel) in zip([a for row in axes for a in row], titles):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ps-compare: {scenario} (one line per seed)")
    fig.tight_layout()
    curves = os.path.join(out, f"plot-{scenario}.png")
    fig.savefig(curves, dpi=80)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        counts: dict[int, int] = {}
        for s in runs:
            if s["mode"] == mode:
                for k, c in s["staleness"]["counts"].items():
                    counts[int(k)] = counts.get(int(k), 0) + c
        total = sum(counts.values()) or 1
        xs = sorted(counts)
        ax.bar([x + i * width for x in xs], [counts[x] / total for x in xs], width=width, color=colors[mode],
               label=mode)
    ax.set_title(f"staleness of applied pushes: {scenario}")
    ax.set_xlabel("staleness (versions between the pull and the apply)")
    ax.set_ylabel("share of pushes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    hist = os.path.join(out, f"staleness-{scenario}.png")
    fig.savefig(hist, dpi=80)
    plt.close(fig)
    return [curves, hist]


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def markdown(config: dict, rows: list[dict]) -> str:
    target = config["target_accuracy"]
    lines = [
        "# ps-compare report",
        "",
        f"Command: `{config['command']}`  ",
        f"Machine: {config['machine']}  ",
        f"Training: {config['workers']} workers, {config['dataset']}/{config['model']}, global batch "
        f"{config['global_batch_size']}, " + (f"{config['steps']} steps" if config.get("steps") else
                                               f"{config['epochs']} epochs") +
        f", {config['seeds']} seed(s) per mode; the chief evaluates every {config['eval_every']} of its steps.  ",
        f"Wall time of the whole comparison: {config.get('wall_s', 0):.0f} s.",
        "",
        "Columns: final test accuracy and time to reach "
        f"{target:.2f} (seconds of training, from the chief's evaluations) as mean ± standard deviation over "
        "the seeds (the deviation is the mode's stability); updates: server versions applied until then; "
        "staleness: versions between a push's pull and its apply.",
    ]
    for scenario in config["scenarios"]:
        lines += ["", f"## {scenario}", "", config["scenario_descriptions"][scenario], "",
                  f"| mode | final accuracy | time to {target:.2f} (s) | reached | updates to {target:.2f} | "
                  "training (s) | examples/s | staleness mean / p90 / max | dropped |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in [r for r in rows if r["scenario"] == scenario]:
            st = r["staleness"]
            lines.append(
                f"| {r['mode']} | {_fmt(r['final_accuracy'], 4)} | {_fmt(r['time_to_target_s'])} | "
                f"{r['time_to_target_s']['n']}/{r['seeds']} | {_fmt(r['updates_to_target'], 0)} | "
                f"{_fmt(r['train_s'])} | {_fmt(r['examples_per_s'], 0)} | "
                f"{st['mean']:.2f} / {st['p90']} / {st['max']} | {r['dropped']} |")
        lines += [""] + [f"- {line}" for line in findings(rows, scenario, target)]
        lines += ["", f"![{scenario}: accuracy and loss](plot-{scenario}.png)", "",
                  f"![{scenario}: staleness](staleness-{scenario}.png)"]
    return "\n".join(lines) + "\n"


def write_report(out: str, config: dict, runs: list[dict]) -> list[str]:
    summaries = [summarize_run(r, config["target_accuracy"]) for r in runs]
    rows = aggregate(summaries)
    report = {"config": config, "rows": rows, "runs": summaries,
              "findings": {s: findings(rows, s, config["target_accuracy"]) for s in config["scenarios"]}}
    paths = [os.path.join(out, "report.json"), os.path.join(out, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(config, rows))
    for scenario in config["scenarios"]:
        paths += _plots(out, scenario, summaries, config["modes"])
    return paths
