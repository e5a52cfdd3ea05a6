"""``ps-advise --predict``: the measured cluster, simulated at the user's N and link.

    ps-advise --predict --predict-workers 64 --link-mbps 1000 --launch -- --workers 3 --dataset digits

The rules of ``ps_tools.study.advise_rules`` read a step profile; they cannot say what 64 workers
would do, where an async gradient's staleness and a sync round's wait for the slowest
grow with N. This runs the virtual-time comparison (``ps_tools.study.virtual``: the real server
core, real TensorFlow gradients, time from a model) for the user's N, with the profile
measured here:

- **compute**: the typical worker's compute per step (the median of all but the slowest,
  as the rules' reference), and each measured worker's factor against it, repeated in
  order up to N (one straggler among 3 measured stays one worker in 3); each step's
  jitter is lognormal with the sigma that gives the worker's measured p90 / median
  (``sigma = ln(p90/median) / 1.2816``; 0.05 where not measured);
- **the links**: ``--link-mbps`` for each worker's and the server's link (default: the
  whole-model pull bandwidth measured, at most 10,000 Mbit/s), ``--latency-ms`` one way;
- **the training**: the launch's model, dataset, examples per worker per step
  (``--global-batch-size / --workers`` of the launch: at N workers the global batch is N
  times that, as adding machines does), optimizer and learning rate; for a running
  cluster (``--ps``), whose model this cannot compute, a stand-in built-in model
  (``--predict-model``, default the one nearest in parameters) on ``--predict-dataset``:
  the times are the cluster's, the accuracy curve is the stand-in's.

The modes (``--predict-modes``, default sync, async, ssp4 and backup where N >= 3) run for
``--predict-seeds`` seeds each; "beyond the spread" is a difference of more than 2
standard errors over the seeds, as ``ps-compare`` reports (``decide``):

1. the fastest mode to ``--target-accuracy`` decides if it leads every other beyond the
   spread (a mode that never reached the target is behind);
2. else, of it and the modes within its spread, the most accurate at the end decides if
   it leads the others beyond the spread;
3. else the rule's mode stands if it is one of those still level (the report says the
   simulation agrees), and the fastest of them replaces it if it is not: the simulation
   shows the rule's choice behind, on time or on accuracy.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from ps_tools.study.advise_rules import Advice, AdviseError, Measurements

DEFAULT_MBPS = 10_000.0


@dataclasses.dataclass
class Prediction:
    workers: int
    config: dict  # the SimConfig of the runs, but mode, seed
    rows: list[dict]  # per mode: ps_tools.study.virtual_compare.summarize
    verdict: dict  # ps_tools.study.virtual_compare.verdicts
    decided_by: str  # "simulation" or "rule"
    advice: Advice


def profile_of(m: Measurements) -> tuple[float, tuple, tuple]:
    """The typical compute per step, each worker's factor against it and its jitter sigma."""
    workers = sorted(m.workers, key=lambda w: w.index)
    computes = sorted(w.compute_s for w in workers)
    typical = statistics.median(computes[:-1] if len(computes) > 1 else computes)
    if not typical > 0:
        raise AdviseError("the measured compute per step is 0: nothing to simulate")
    factors = tuple(max(w.compute_s, 1e-9) / typical for w in workers)
    sigmas = tuple(min(1.0, math.log(w.spread) / 1.2816) if w.spread > 1 else 0.05 for w in workers)
    return typical, factors, sigmas


def nearest_model(params: int) -> str:
    """The built-in model whose parameter count is nearest (in ratio) to ``params``."""
    from worker.model import MODELS, build_model

    counts = {name: sum(int(v.numpy().size) for v in build_model(name).trainable_variables)
              for name in MODELS if name != "mlp25m"}
    return min(counts, key=lambda name: abs(math.log(counts[name] / max(params, 1))))


def training_of(launch_args: list[str] | None, model: str | None, dataset: str | None, m: Measurements) -> dict:
    """The SimConfig fields of the training: the launch's, or the stand-in's for a cluster."""
    from worker.config import WorkerConfig

    d = WorkerConfig()
    if launch_args is not None:
        from ps_tools.launch import parser as launch_parser

        a = launch_parser().parse_args(launch_args)
        gbs = a.global_batch_size or d.global_batch_size
        return {"model": model or a.model or d.model, "dataset": dataset or a.dataset or d.dataset,
                "train_examples": a.train_examples or 0, "batch": max(1, gbs // a.workers),
                "epochs": float(a.epochs or d.epochs), "optimizer": a.optimizer or d.optimizer,
                "learning_rate": a.learning_rate or 0.0}
    return {"model": model or nearest_model(m.model_bytes // 4), "dataset": dataset or d.dataset,
            "train_examples": 0, "batch": max(1, d.global_batch_size // max(1, len(m.workers))),
            "epochs": float(d.epochs), "optimizer": d.optimizer, "learning_rate": 0.0}


def default_modes(n: int) -> list[str]:
    return ["sync", "async", "ssp4"] + (["backup"] if n >= 3 else [])


def predict(m: Measurements, rule: Advice, workers: int, *, launch_args: list[str] | None = None,
            link_mbps: float | None = None, latency_ms: float = 0.5, modes: list[str] | None = None,
            seeds: int = 2, epochs: float | None = None, target: float = 0.85, model: str | None = None,
            dataset: str | None = None, costs: dict | None = None, progress=print) -> Prediction:
    """``costs``: the server's seconds per apply, fold, round, decode and encode
    (``Simulation``); None: measured here, once."""
    from ps_tools.study.virtual import SimConfig, VirtualError, mode_options
    from ps_tools.study.virtual_compare import run_study, summarize, verdicts

    if workers < 1:
        raise AdviseError(f"--predict-workers must be >= 1, got {workers}")
    if seeds < 1:
        raise AdviseError(f"--predict-seeds must be >= 1, got {seeds}")
    modes = modes or default_modes(workers)
    try:
        for mode in modes:
            mode_options(mode, workers)
    except VirtualError as e:
        raise AdviseError(f"--predict-modes: {e}") from None
    typical, factors, sigmas = profile_of(m)
    if link_mbps is None:
        measured = min(m.bandwidth.values()) * 8 / 1e6 if m.bandwidth else math.inf
        link_mbps = min(DEFAULT_MBPS, measured) if math.isfinite(measured) and measured > 0 else DEFAULT_MBPS
    training = training_of(launch_args, model, dataset, m)
    if epochs is not None:
        training["epochs"] = float(epochs)
    try:
        base = SimConfig(mode=modes[0], workers=workers, profile="measured", factors=factors, sigmas=sigmas,
                         compute_s=typical, latency_s=latency_ms / 1000, worker_mbps=link_mbps,
                         server_mbps=link_mbps, shards=max(1, len(m.bandwidth)), target_accuracy=target,
                         whole_rounds=True, **training)
        base.check()
        runs, _ = run_study([workers], ["measured"], modes, seeds, base, progress=progress, costs=costs)
    except VirtualError as e:
        raise AdviseError(f"the simulation: {e}") from None
    rows = sorted(summarize(runs, target), key=lambda r: modes.index(r["mode"]))
    (verdict,) = verdicts(rows)
    decided_by, advice = decide(rows, verdict, rule, workers, target, seeds)
    config = {k: v for k, v in dataclasses.asdict(base).items() if k not in ("mode", "seed")}
    return Prediction(workers, config, rows, verdict, decided_by, advice)


def _beyond(a: dict, b: dict) -> bool:
    """a's final accuracy above b's by more than 2 standard errors over the seeds."""
    if a["seeds"] < 2 or b["seeds"] < 2:
        return False
    se = math.sqrt(a["final_accuracy_sd"] ** 2 / a["seeds"] + b["final_accuracy_sd"] ** 2 / b["seeds"])
    return a["final_accuracy"] - b["final_accuracy"] > 2 * se


def decide(rows: list[dict], verdict: dict, rule: Advice, workers: int, target: float,
           seeds: int) -> tuple[str, Advice]:
    """("simulation" or "rule", the advice). In order: the fastest mode to the target, if it
    leads every other beyond the spread; else, among it and the modes within its spread,
    the most accurate at the end, if it leads them beyond the spread; else the rule's
    mode stands while it is among those (fast and accurate within the spread), and the
    fastest of them replaces it when it is not (the simulation shows it behind)."""
    from ps_tools.study.compare_runs import mode_flags

    by = {r["mode"]: r for r in rows}

    def advice(mode: str, reason: str) -> tuple[str, Advice]:
        flags = mode_flags(mode, workers)
        return "simulation", Advice(flags[1], flags, "simulation", f"in the simulation of {workers} workers, "
                                    f"{reason} (over {seeds} seed(s))", f"the rule would say "
                                    f"{' '.join(rule.flags)} [{rule.rule}] from the measured profile")

    if seeds < 2:
        return "rule", dataclasses.replace(rule, reason=f"{rule.reason}; the simulation of {workers} workers could "
                                           "not decide (one seed: the spread is unknown)")
    if verdict["fastest"] is None:
        return "rule", dataclasses.replace(rule, reason=f"{rule.reason}; the simulation of {workers} workers could "
                                           "not decide (no mode reached the target in every seed of the job)")
    fastest = by[verdict["fastest"]]
    close = [fastest] + [by[a["mode"]] for a in verdict["against"] if a["exceeds"] is not True]
    if len(close) == 1:
        return advice(fastest["mode"], f"{fastest['mode']} reached {target:g} test accuracy first "
                      f"({fastest['time_to_target']:.3g} s), ahead of every other mode beyond the spread")
    best = max(close, key=lambda r: r["final_accuracy"])
    level = [r for r in close if r is best or not _beyond(best, r)]
    names = ", ".join(r["mode"] for r in close)
    if len(level) == 1:
        return advice(best["mode"], f"{names} reached {target:g} within the spread of each other, and "
                      f"{best['mode']} ended the most accurate ({best['final_accuracy']:.3f}), beyond the spread")
    ruled = rule.mode
    if ruled not in by:
        return "rule", dataclasses.replace(rule, reason=f"{rule.reason}; the simulation of {workers} workers did "
                                           f"not run {ruled} (--predict-modes)")
    if ruled in {r["mode"] for r in level}:
        return "rule", dataclasses.replace(rule, reason=f"{rule.reason}; the simulation of {workers} workers "
                                           f"agrees: {ruled} is among the fastest and most accurate within the "
                                           f"spread ({', '.join(r['mode'] for r in level)})")
    first = min(level, key=lambda r: r["time_to_target"] if r["time_to_target"] is not None else math.inf)
    behind = by[ruled]
    if behind in close:
        how = f"it ended at {behind['final_accuracy']:.3f}, below {best['mode']}'s {best['final_accuracy']:.3f}"
    elif behind["time_to_target"] is None:
        how = f"it did not reach {target:g} in every seed"
    else:
        how = f"it took {behind['time_to_target']:.3g} s to {target:g}, beyond the spread of the fastest"
    return advice(first["mode"], f"the rule's {ruled} is behind beyond the spread ({how}) while "
                  f"{', '.join(r['mode'] for r in level)} reached {target:g} within the spread of each other "
                  f"and ended within it too; {first['mode']} was the fastest of them")


def report(p: Prediction) -> str:
    c = p.config
    lines = ["", f"predicted for {p.workers} workers (virtual time: the real server core and TensorFlow gradients, "
             f"time from the measured profile):",
             f"  {c['model']} on {c['dataset']}, {c['batch']} examples per worker per step, {c['epochs']:g} epoch(s), "
             f"{c['optimizer']}; links {c['worker_mbps']:g} Mbit/s, {c['latency_s'] * 1000:g} ms one way; "
             f"compute {c['compute_s'] * 1000:.2f} ms x factors "
             + ", ".join(f"{f:.2f}" for f in c["factors"]) + " (repeated to N)", "",
             f"mode       to {c['target_accuracy']:g} (s)        end accuracy   staleness  server busy"]
    for r in p.rows:
        if r["time_to_target"] is not None:
            t = f"{r['time_to_target']:.3f}" + (f" ± {r['time_to_target_sd']:.3f}" if r["time_to_target_sd"] else "")
        else:
            t = f"{r['reached']} of {r['seeds']} seeds" if r["reached"] else "never"
        lines.append(f"{r['mode']:<9}  {t:<20}  {r['final_accuracy']:.3f}          {r['mean_staleness']:>9.1f}  "
                     f"{r['server_busy']:>10.0%}")
    lines += ["", f"prediction: {' '.join(p.advice.flags)}   [decided by: {p.decided_by}]", f"why: {p.advice.reason}"]
    if p.decided_by == "simulation" and p.advice.alternative:
        lines.append(f"({p.advice.alternative} alone)")
    return "\n".join(lines)
