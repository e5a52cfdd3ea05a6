"""The ``ps-compare`` report: numbers per run, their spread across seeds, tables and plots.

    paths = write_report(out_dir, config, runs)   # report.json, report.md, plot-*.png, staleness-*.png

A run is what ``ps_tools.study.compare_runs.run_one`` returns: the launch metrics and every
worker's history (per step: t, loss, version, staleness, dropped; the chief's
"evals": test accuracy every few steps). From each run: the final test
accuracy, the time and the number of updates (server versions) until the
chief first measured the target accuracy, training time, examples/s, and the
staleness of every push. Per scenario, link kind and mode: the mean and
standard deviation of each over the seeds; the deviation is the mode's stability.

Each run says how its network was made (``links``: "loopback" for a scenario
without one, "sleep" for the sleep knobs, "emulated" for emulated hosts; see
``ps_tools.study.compare_hosts``). Where a scenario ran with more than one kind
(``ps-compare --links both``), each kind has its own table, plots
(``plot-<scenario>-<kind>.png``) and findings, and ``compare_links`` says how the
conclusions differ: the fastest mode to the target under each, and each mode's
time to the target and examples/s side by side.

The axes (``ps-compare --models``, ``--train-examples``, ``--workers``): every run
and row names its model, training-set size (0: all) and worker count; a
comparison group is one scenario, link kind, model, size and worker count. Where
an axis has several values each group has its own table, findings and plots
(``plot-<scenario>-<model>-n<size>-w<workers>.png``, naming only the axes that vary).

**Does a difference exceed the spread?** (``significance``) For every pair of
modes a, b of a group and each of time to the target and final accuracy: the
difference of the means exceeds the spread when
``|mean_a - mean_b| > 2 * sqrt(sd_a**2 / n_a + sd_b**2 / n_b)``, twice the
standard error of the difference (Welch's, without the t quantile: with 2 or 3
seeds a rough rule, meant to flag differences that the seeds' own scatter could
have made). With one seed of either mode the spread is unknown and nothing is
claimed; time to the target counts only the seeds that reached it.
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
        "links": run.get("links", "loopback"),
        "model": run.get("model"),
        "train_examples": run.get("train_examples"),
        "workers": run.get("workers"),
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


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


AXES = ("model", "train_examples", "workers")  # with scenario and links: a comparison group


def group_of(r: dict) -> tuple:
    """(model, train_examples, workers) of a run summary or row."""
    return tuple(r.get(k) for k in AXES)


def aggregate(summaries: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["scenario"], s.get("links", "loopback"), group_of(s), s["mode"]), []).append(s)
    rows = []
    for (scenario, links, point, mode), runs in groups.items():
        merged: dict[str, int] = {}
        for r in runs:
            for k, c in r["staleness"]["counts"].items():
                merged[k] = merged.get(k, 0) + c
        all_staleness = [int(k) for k, c in merged.items() for _ in range(c)]
        rows.append({
            "scenario": scenario,
            "links": links,
            **dict(zip(AXES, point)),
            "mode": mode,
            "seeds": len(runs),
            "final_accuracy": spread([r["final_accuracy"] for r in runs]),
            "time_to_target_s": spread([r["time_to_target_s"] for r in runs]),
            "updates_to_target": spread([r["updates_to_target"] for r in runs]),
            "train_s": spread([r["train_s"] for r in runs]),
            "examples_per_s": spread([r["examples_per_s"] for r in runs]),
            "staleness": _distribution(all_staleness),
            "dropped": sum(r["dropped"] for r in runs),
        })
    return rows


def _fmt(spread: dict, digits: int = 1, suffix: str = "") -> str:
    if spread["mean"] is None:
        return "not reached"
    text = f"{spread['mean']:.{digits}f} ± {spread['sd']:.{digits}f}{suffix}"
    return text


def spread_test(a: dict, b: dict) -> dict:
    """The rule of the module docstring on two spreads (``spread``) of one metric."""
    if not a["n"] or not b["n"]:
        return {"difference": None, "threshold": None, "exceeds": None, "note": "not reached in any seed"}
    difference = a["mean"] - b["mean"]
    if a["n"] < 2 or b["n"] < 2:
        return {"difference": difference, "threshold": None, "exceeds": None, "note": "one seed: spread unknown"}
    threshold = 2.0 * math.sqrt(a["sd"] ** 2 / a["n"] + b["sd"] ** 2 / b["n"])
    exceeds = abs(difference) > threshold
    return {"difference": difference, "threshold": threshold, "exceeds": exceeds,
            "note": "exceeds spread" if exceeds else "within spread"}


SIGNIFICANCE_METRICS = ("time_to_target_s", "final_accuracy")


def significance(rows: list[dict]) -> list[dict]:
    """For the rows of one comparison group, every pair of modes (in row order) and each of
    ``SIGNIFICANCE_METRICS``: difference (mean of the first minus the second), threshold (two
    standard errors of the difference), exceeds (None where it cannot be said: one seed, or
    not reached) and a note saying so."""
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            for metric in SIGNIFICANCE_METRICS:
                out.append({"modes": [a["mode"], b["mode"]], "metric": metric, "n": [a[metric]["n"], b[metric]["n"]],
                            **spread_test(a[metric], b[metric])})
    return out


def fastest_mode(rows: list[dict]) -> dict | None:
    """The row that reached the target soonest on average, of those that reached it in every
    seed (else of those that reached it at all); None when none did."""
    for pool in ([r for r in rows if r["time_to_target_s"]["n"] == r["seeds"]],
                 [r for r in rows if r["time_to_target_s"]["n"]]):
        if pool:
            return min(pool, key=lambda r: r["time_to_target_s"]["mean"])
    return None


def _in_group(r: dict, scenario: str, links: str | None, point: tuple | None) -> bool:
    return (r["scenario"] == scenario and links in (None, r.get("links", "loopback"))
            and point in (None, group_of(r)))


def groups(rows: list[dict], scenario: str, links: str | None = None) -> list[tuple]:
    """The (model, train_examples, workers) points a scenario (and link kind) ran, in run order."""
    out = []
    for r in rows:
        if _in_group(r, scenario, links, None) and group_of(r) not in out:
            out.append(group_of(r))
    return out


def group_label(point: tuple, config: dict) -> str:
    """The axes of a point that vary in this comparison, in words ("" when none does)."""
    axes = config.get("axes") or {}
    words = []
    for key, value in zip(AXES, point):
        if len(axes.get(key, [])) > 1:
            words.append({"model": f"{value}", "workers": f"{value} workers",
                          "train_examples": f"{value or 'all'} training examples"}[key])
    return ", ".join(words)


def _group_name(point: tuple, config: dict) -> str:
    axes = config.get("axes") or {}
    parts = {"model": str(point[0]), "train_examples": f"n{point[1] or 'all'}", "workers": f"w{point[2]}"}
    return "-".join(parts[k] for k in AXES if len(axes.get(k, [])) > 1)


def findings(rows: list[dict], scenario: str, target: float, links: str | None = None,
             point: tuple | None = None) -> list[str]:
    """Plain sentences on what the table of one scenario (and link kind, and point of the
    axes, if given) shows."""
    mine = [r for r in rows if _in_group(r, scenario, links, point)]
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


def _plots(out: str, scenario: str, summaries: list[dict], modes: list[str], links: str | None = None,
           point: tuple | None = None, config: dict | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {m: plt.get_cmap("tab10")(i % 10) for i, m in enumerate(modes)}
    runs = [s for s in summaries if _in_group(s, scenario, links, point)]
    name, shown = _names(scenario, links, point, config or {})
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
    fig.suptitle(f"ps-compare: {shown} (one line per seed)")
    fig.tight_layout()
    curves = os.path.join(out, f"plot-{name}.png")
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
    ax.set_title(f"staleness of applied pushes: {shown}")
    ax.set_xlabel("staleness (versions between the pull and the apply)")
    ax.set_ylabel("share of pushes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    hist = os.path.join(out, f"staleness-{name}.png")
    fig.savefig(hist, dpi=80)
    plt.close(fig)
    return [curves, hist]


def _smooth(values: list[float], window: int = 5) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def _names(scenario: str, links: str | None, point: tuple | None, config: dict) -> tuple[str, str]:
    """(file name part, title) of a scenario, link kind (None: the only one) and point of the axes."""
    extra = _group_name(point, config) if point is not None else ""
    label = group_label(point, config) if point is not None else ""
    name = "-".join(p for p in (scenario, links, extra) if p)
    shown = scenario + "".join(f", {p}" for p in (links, label) if p)
    if links and not label:
        shown = f"{scenario} ({links})"
    return name, shown


def _significance_markdown(mine: list[dict], target: float) -> list[str]:
    """The fastest mode of a group against each other one: differences and whether they exceed the spread."""
    best = fastest_mode(mine)
    if best is None or len(mine) < 2:
        return []

    def cell(test: dict, digits: int) -> str:
        return "-" if test["difference"] is None else f"{test['difference']:+.{digits}f}"

    def bound(test: dict, digits: int) -> str:
        return "-" if test["threshold"] is None else f"{test['threshold']:.{digits}f}"

    lines = ["", f"Does a difference exceed the spread? {best['mode']} (fastest to {target:.2f}) against each "
             "other mode: the other's mean minus its own; it exceeds the spread when larger than twice the "
             "standard error of the difference, sqrt(sd_a²/n_a + sd_b²/n_b).", "",
             f"| {best['mode']} vs | time to {target:.2f}: difference (s) | 2 SE (s) | time | "
             "final accuracy: difference | 2 SE | accuracy |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for other in mine:
        if other is best:
            continue
        t = spread_test(other["time_to_target_s"], best["time_to_target_s"])
        a = spread_test(other["final_accuracy"], best["final_accuracy"])
        lines.append(f"| {other['mode']} | {cell(t, 1)} | {bound(t, 1)} | {t['note']} | "
                     f"{cell(a, 4)} | {bound(a, 4)} | {a['note']} |")
    return lines


def markdown(config: dict, rows: list[dict]) -> str:
    target = config["target_accuracy"]
    lines = [
        "# ps-compare report",
        "",
        f"Command: `{config['command']}`  ",
        f"Machine: {config['machine']}  ",
        f"Training: {_training_words(config)}, global batch "
        f"{config['global_batch_size']}, " + (f"{config['steps']} steps" if config.get("steps") else
                                               f"{config['epochs']} epochs") +
        f", {config['seeds']} seed(s) per mode; the chief evaluates every {config['eval_every']} of its steps.  ",
        f"Wall time of the whole comparison: {config.get('wall_s', 0):.0f} s.  ",
        f"Links (`--links {config.get('links_choice', 'sleep')}`): each scenario says how its network was made "
        "(emulated hosts: a network namespace per process, links shaped with tc, latency by a relay; sleep "
        "knobs: each worker sleeps bytes/rate before its push, on loopback).",
        "",
        "Columns: final test accuracy and time to reach "
        f"{target:.2f} (seconds of training, from the chief's evaluations) as mean ± standard deviation over "
        "the seeds (the deviation is the mode's stability); updates: server versions applied until then; "
        "staleness: versions between a push's pull and its apply.",
    ]
    for scenario in config["scenarios"]:
        kinds = _kinds(config, rows, scenario)
        lines += ["", f"## {scenario}", "", config["scenario_descriptions"][scenario]]
        for kind in kinds:
            several = len(kinds) > 1
            name = f"{scenario}-{kind}" if several else scenario
            described = config.get("links", {}).get(scenario, {}).get(kind)
            if several:
                lines += ["", f"### {scenario}, {kind}"]
            if described:
                lines += ["", f"Links: {described}."]
            points = groups(rows, scenario, kind)
            for point in points:
                if len(points) > 1:
                    name = _names(scenario, kind if several else None, point, config)[0]
                    lines += ["", f"{'####' if several else '###'} {scenario}, {group_label(point, config)}"]
                mine = [r for r in rows if _in_group(r, scenario, kind, point)]
                lines += ["", f"| mode | final accuracy | time to {target:.2f} (s) | reached | updates to "
                          f"{target:.2f} | training (s) | examples/s | staleness mean / p90 / max | dropped |",
                          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
                for r in mine:
                    st = r["staleness"]
                    lines.append(
                        f"| {r['mode']} | {_fmt(r['final_accuracy'], 4)} | {_fmt(r['time_to_target_s'])} | "
                        f"{r['time_to_target_s']['n']}/{r['seeds']} | {_fmt(r['updates_to_target'], 0)} | "
                        f"{_fmt(r['train_s'])} | {_fmt(r['examples_per_s'], 0)} | "
                        f"{st['mean']:.2f} / {st['p90']} / {st['max']} | {r['dropped']} |")
                lines += [""] + [f"- {line}" for line in findings(rows, scenario, target, kind, point)]
                lines += _significance_markdown(mine, target)
                lines += ["", f"![{name}: accuracy and loss](plot-{name}.png)", "",
                          f"![{name}: staleness](staleness-{name}.png)"]
        if len(kinds) > 1:
            for point in groups(rows, scenario):
                label = group_label(point, config)
                mine = [r for r in rows if _in_group(r, scenario, None, point)]
                lines += ["", f"### {scenario}{f', {label}' if label else ''}: {' vs '.join(kinds)}", ""]
                lines += _links_markdown(compare_links(mine, scenario, target, kinds), target)
    notes = config.get("links_notes") or []
    if notes:
        lines += ["", "## Links", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _training_words(config: dict) -> str:
    """"3 workers, digits/cnn" as before for one value of each axis; the lists where several."""
    axes = config.get("axes") or {}
    workers = axes.get("workers") or [config["workers"]]
    models = axes.get("model") or [config["model"]]
    sizes = axes.get("train_examples") or [config.get("train_examples") or 0]
    text = f"{','.join(map(str, workers))} workers, {config['dataset']}/{','.join(models)}"
    if sizes != [0]:
        text += ", training examples " + ",".join(str(n) if n else "all" for n in sizes)
    return text


def _kinds(config: dict, rows: list[dict], scenario: str) -> list[str]:
    """The link kinds a scenario ran with, in run order."""
    kinds = []
    for r in rows:
        if r["scenario"] == scenario and r.get("links", "loopback") not in kinds:
            kinds.append(r.get("links", "loopback"))
    planned = list(config.get("links", {}).get(scenario, {}))
    return [k for k in planned if k in kinds] + [k for k in kinds if k not in planned]


def compare_links(rows: list[dict], scenario: str, target: float, kinds: list[str]) -> dict:
    """How the conclusions of one scenario differ between link kinds: per kind, the fastest
    mode to the target (of those that reached it in every seed), the highest throughput,
    and each mode's mean time to the target and examples/s; plus sentences saying so."""
    per_kind = {}
    for kind in kinds:
        mine = [r for r in rows if r["scenario"] == scenario and r.get("links", "loopback") == kind]
        reached = [r for r in mine if r["time_to_target_s"]["n"] == r["seeds"]]
        best = min(reached, key=lambda r: r["time_to_target_s"]["mean"]) if reached else None
        fastest = max(mine, key=lambda r: r["examples_per_s"]["mean"] or 0.0) if mine else None
        per_kind[kind] = {
            "fastest_to_target": best["mode"] if best else None,
            "highest_throughput": fastest["mode"] if fastest else None,
            "time_to_target_s": {r["mode"]: r["time_to_target_s"]["mean"] for r in mine},
            "examples_per_s": {r["mode"]: r["examples_per_s"]["mean"] for r in mine},
            "ranking": [r["mode"] for r in sorted(reached, key=lambda r: r["time_to_target_s"]["mean"])],
        }
    winners = {k: v["fastest_to_target"] for k, v in per_kind.items()}
    sentences = []
    if len(set(winners.values())) == 1:
        sentences.append(f"Both agree on the fastest mode to {target:.2f}: **{next(iter(winners.values()))}**.")
    else:
        sentences.append(f"They disagree on the fastest mode to {target:.2f}: " + "; ".join(
            f"{k}: **{w or 'none reached it in every seed'}**" for k, w in winners.items()) + ".")
    rankings = {k: v["ranking"] for k, v in per_kind.items()}
    if len({tuple(r) for r in rankings.values()}) > 1:
        sentences.append("Order by time to the target: " + "; ".join(
            f"{k}: {' < '.join(r) or '(none)'}" for k, r in rankings.items()) + ".")
    if len(kinds) == 2:
        a, b = kinds
        ratios = {m: per_kind[b]["examples_per_s"][m] / per_kind[a]["examples_per_s"][m]
                  for m in per_kind[a]["examples_per_s"] if m in per_kind[b]["examples_per_s"]
                  and per_kind[a]["examples_per_s"][m] and per_kind[b]["examples_per_s"][m]}
        if ratios:
            sentences.append(f"Throughput under {b} as a share of under {a}: " + ", ".join(
                f"{m} {r:.2f}x" for m, r in ratios.items()) + ".")
    return {"kinds": kinds, "per_kind": per_kind, "agree_on_fastest": len(set(winners.values())) == 1,
            "sentences": sentences}


def _links_markdown(comparison: dict, target: float) -> list[str]:
    kinds = comparison["kinds"]
    modes = []
    for k in kinds:
        modes += [m for m in comparison["per_kind"][k]["examples_per_s"] if m not in modes]

    def cell(value, digits):
        return "-" if value is None else f"{value:.{digits}f}"

    lines = ["| mode | " + " | ".join(f"time to {target:.2f} (s), {k}" for k in kinds) + " | " +
             " | ".join(f"examples/s, {k}" for k in kinds) + " |",
             "| --- |" + " --- |" * (2 * len(kinds))]
    for m in modes:
        lines.append(f"| {m} | " + " | ".join(cell(comparison["per_kind"][k]["time_to_target_s"].get(m), 1)
                                            for k in kinds) + " | " +
                     " | ".join(cell(comparison["per_kind"][k]["examples_per_s"].get(m), 0) for k in kinds) + " |")
    return lines + [""] + [f"- {s}" for s in comparison["sentences"]]


def write_report(out: str, config: dict, runs: list[dict]) -> list[str]:
    target = config["target_accuracy"]
    single = {"model": config.get("model"), "train_examples": config.get("train_examples", 0),
              "workers": config.get("workers")}
    summaries = [summarize_run({**single, **r}, target) for r in runs]  # older runs: the config's one value
    rows = aggregate(summaries)
    kinds = {s: _kinds(config, rows, s) for s in config["scenarios"]}
    found, compared, grouped = {}, {}, []
    for s in config["scenarios"]:
        points = groups(rows, s)
        found[s] = []
        for point in points:
            label = group_label(point, config)
            for k in kinds[s]:
                tags = [t for t in (k if len(kinds[s]) > 1 else "", label if len(points) > 1 else "") if t]
                prefix = f"[{', '.join(tags)}] " if tags else ""
                found[s] += [prefix + line for line in findings(rows, s, target, k, point)]
                mine = [r for r in rows if _in_group(r, s, k, point)]
                grouped.append({"scenario": s, "links": k, **dict(zip(AXES, point)),
                                "fastest_to_target": (fastest_mode(mine) or {}).get("mode"),
                                "significance": significance(mine)})
            if len(kinds[s]) > 1:
                mine = [r for r in rows if _in_group(r, s, None, point)]
                compared[f"{s} ({label})" if len(points) > 1 else s] = compare_links(mine, s, target, kinds[s])
    report = {"config": config, "rows": rows, "runs": summaries, "findings": found, "groups": grouped,
              "compare_links": compared}
    paths = [os.path.join(out, "report.json"), os.path.join(out, "report.md")]
    with open(paths[0], "w") as f:
        json.dump(report, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(config, rows))
    for scenario in config["scenarios"]:
        points = groups(rows, scenario)
        for point in points:
            shown = point if len(points) > 1 else None
            if len(kinds[scenario]) > 1:
                for kind in kinds[scenario]:
                    paths += _plots(out, scenario, summaries, config["modes"], kind, shown, config)
            else:
                paths += _plots(out, scenario, summaries, config["modes"], None, shown, config)
    return paths
