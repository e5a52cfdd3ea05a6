"""``ps-compare``: the same training under sync, async, SSP and backup workers, in named scenarios.

    ps-compare --scenario straggler --quick --out report/
    ps-compare --scenario balanced,straggler,bandwidth,pause --seeds 3 --out report/
    ps-compare --scenario balanced --models tiny,cnn,mlp --train-examples 200,0 --workers 2,4 --out report/

For every scenario, mode and seed it runs ``ps-launch`` (one server, N worker
processes on this machine; one run is ``ps_tools.study.compare_runs.run_one``) with
the scenario's experiment knobs (``--slowdown``, ``--pause-at-step``), every worker
writing its per-step history and the chief evaluating the test accuracy every few
steps. A scenario with a network (bandwidth: a rate and a latency on every link)
runs, per ``--links``, on emulated hosts (the same processes in network namespaces
of their own, every link shaped with tc, the latency by a relay in the server's
host: ``ps_tools.study.compare_hosts``) or on loopback with the sleep knobs
``--bandwidth-mbps`` and ``--added-latency-ms``; ``auto`` (default) emulates where
the machine can, ``both`` runs each such scenario both ways.
``ps_tools.study.report`` turns the runs into report.json, report.md and PNG plots:
loss and accuracy against wall time and against updates, time to the target
accuracy, final accuracy, examples/s, staleness, and the spread of each across
seeds (the stability of a mode, measured), and says per scenario how its links
were made. With ``--virtual`` the command is ``ps_tools.study.virtual_compare``'s
(N simulated workers in virtual time).

Three more axes, each a comma-separated list: ``--models`` (built-in models, from
``tiny`` to ``mlp25m``; default the one ``--model``), ``--train-examples`` (the
size of the training set, ``ps-worker --train-examples``; 0: all of it) and
``--workers``. The runs are every scenario x model x training-set size x worker
count x mode x seed; a comparison group is one scenario (and link kind), model,
size and worker count, and the report says for each pair of modes in a group
whether the difference of their means exceeds the spread across seeds
(``ps_tools.study.report.significance``).

Modes (``--modes``): ``sync``; ``async``; ``ssp1`` and ``ssp4`` (``--mode ssp
--staleness 1`` and ``4``); ``backup`` (sync finishing each round with the first
N-1 pushes: ``--replicas-to-aggregate N-1``). Scenarios: see ``compare_runs.SCENARIOS``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time

from ps_tools.study.compare_hosts import LINK_CHOICES, LinksError, describe, plan_links
from ps_tools.study.compare_runs import MODES, SCENARIOS, CompareError, mode_flags, run_one
from ps_tools.study.report import write_report
from worker.model import MODELS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ps-compare",
        description="Train the same model under sync, async, ssp and backup workers, in named scenarios, "
        "with a few seeds each, and write a report (Markdown, JSON, PNG plots).",
    )
    p.add_argument("--scenario", default="straggler",
                   help=f"comma-separated, from {', '.join(SCENARIOS)}, or all (default straggler)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated: sync, async, sspS (S: the bound), backup (default: %(default)s)")
    p.add_argument("--seeds", type=int, help="runs per scenario and mode, seeds 0..N-1 (default 3; --quick 2)")
    p.add_argument("--workers", default="3", help="worker processes, or a comma-separated list of counts to "
                   "compare (default 3)")
    p.add_argument("--dataset", default="digits", help="digits (default), digits-large, mnist or synthetic")
    p.add_argument("--model", default="cnn", help=f"one of {', '.join(MODELS)} (default cnn)")
    p.add_argument("--models", help="comma-separated models to compare, of the same (default: --model)")
    p.add_argument("--train-examples", default="0",
                   help="comma-separated training-set sizes (ps-worker --train-examples; 0: the whole set; "
                   "default 0)")
    p.add_argument("--epochs", type=int, help="epochs per run (default 12; --quick 6)")
    p.add_argument("--steps", type=int, help="steps per run instead of epochs")
    # 256: each worker's compute outweighs the per-step overhead of pulling and pushing a
    # small model, as it does in real training; at 64 a 3x slower compute barely shows.
    p.add_argument("--global-batch-size", type=int, default=256, help="(default 256)")
    p.add_argument("--eval-every", type=int, default=2, help="the chief evaluates every N of its steps (default 2)")
    p.add_argument("--target-accuracy", type=float, default=0.85,
                   help="time to reach this test accuracy is reported (default 0.85)")
    p.add_argument("--quick", action="store_true", help="fewer epochs and seeds: a report in minutes")
    p.add_argument("--out", required=True, help="directory for report.md, report.json, the plots and the runs")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take (default 900)")
    p.add_argument("--links", default="auto", choices=LINK_CHOICES,
                   help="how a scenario's network (bandwidth) is made: emulated (hosts in network namespaces, "
                   "links shaped with tc, latency by a relay; needs root, ip and tc), sleep (the "
                   "--bandwidth-mbps/--added-latency-ms knobs on loopback), both (each way, compared), "
                   "auto (default: emulated where available, else sleep, saying why)")
    return p


def parse_axes(args) -> tuple[list[str], list[int], list[int]]:
    """The models, training-set sizes and worker counts to compare; ``CompareError`` says
    what is wrong with a list."""
    if args.models is not None:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        flag = "--models"
    else:
        models, flag = [args.model], "--model"
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise CompareError(f"{flag}: unknown {', '.join(map(repr, unknown)) or repr(args.models)}; "
                           f"use {', '.join(MODELS)}")
    sizes = _int_list(args.train_examples, "--train-examples", "a training-set size (0: all)", low=0)
    workers = _int_list(args.workers, "--workers", "a worker count", low=1)
    for axis, flag in ((models, "--models"), (sizes, "--train-examples"), (workers, "--workers")):
        if len(set(axis)) < len(axis):
            raise CompareError(f"{flag} lists a value twice: {','.join(map(str, axis))}")
    return models, sizes, workers


def _int_list(text, flag: str, what: str, low: int) -> list[int]:
    items = [t.strip() for t in str(text).split(",")]
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise CompareError(f"{flag} must be comma-separated integers, each {what}, got {text!r}") from None
    bad = [v for v in values if v < low]
    if bad:
        raise CompareError(f"{flag} must be >= {low}, got {','.join(map(str, bad))}")
    return values


def run_args(args, model: str, train_examples: int, workers: int):
    """``args`` for one point of the axes: one model, training-set size and worker count."""
    return argparse.Namespace(**{**vars(args), "model": model, "train_examples": train_examples,
                                 "workers": workers})


def _choices(args: argparse.Namespace) -> tuple:
    """What the flags choose: (scenarios, models, sizes, worker counts, modes, each scenario's
    links, notes on the links); CompareError for a choice that cannot run. Fills in the
    seeds and epochs ``--quick`` implies."""
    names = list(SCENARIOS) if args.scenario == "all" else [s.strip() for s in args.scenario.split(",") if s.strip()]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown or not names:
        raise CompareError(f"--scenario: unknown {unknown or args.scenario!r}; use {', '.join(SCENARIOS)} or all")
    models, sizes, worker_counts = parse_axes(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        try:
            mode_flags(m, worker_counts[0])
        except ValueError as e:
            raise CompareError(f"--modes: {e}") from None
    if "backup" in modes and min(worker_counts) < 2:
        raise CompareError("--modes backup needs --workers >= 2")
    args.seeds = args.seeds or (2 if args.quick else 3)
    args.epochs = args.epochs or (6 if args.quick else 12)
    if args.seeds < 1 or args.epochs < 1 or args.eval_every < 1:
        raise CompareError("--seeds, --epochs and --eval-every must be >= 1")
    try:
        plan, notes = plan_links(args.links, names, SCENARIOS)
    except LinksError as e:
        raise CompareError(str(e)) from None
    return names, models, sizes, worker_counts, modes, plan, notes


def main(argv: list[str] | None = None) -> int:
    if "--virtual" in (sys.argv[1:] if argv is None else argv):  # N simulated workers: ps_tools.study.virtual_compare
        from ps_tools.study.virtual_compare import main as virtual_main

        return virtual_main(argv)
    args = parser().parse_args(argv)
    try:
        names, models, sizes, worker_counts, modes, plan, notes = _choices(args)
    except CompareError as e:
        print(f"ps-compare: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"ps-compare: {note}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    axes = {"model": models, "train_examples": sizes, "workers": worker_counts}
    config = {"scenarios": names, "modes": modes, "seeds": args.seeds,
              # One value each: as before; an axis with several is in "axes" only (here None).
              "workers": worker_counts[0] if len(worker_counts) == 1 else None,
              "dataset": args.dataset, "model": models[0] if len(models) == 1 else None,
              "train_examples": sizes[0] if len(sizes) == 1 else None, "axes": axes,
              "epochs": None if args.steps else args.epochs, "steps": args.steps or None,
              "global_batch_size": args.global_batch_size, "eval_every": args.eval_every,
              "target_accuracy": args.target_accuracy,
              "scenario_descriptions": {n: SCENARIOS[n].description for n in names},
              "links_choice": args.links, "links_notes": notes,
              "links": {n: {k: describe(k, SCENARIOS[n].network) for k in plan[n]} for n in names},
              "command": "ps-compare " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{platform.node() or 'this machine'}: {os.cpu_count()} cores, {platform.platform()}"}
    runs = []
    points = [(m, n, w) for m in models for n in sizes for w in worker_counts]
    total = sum(len(plan[n]) for n in names) * len(points) * len(modes) * args.seeds
    started = time.monotonic()
    try:
        for name in names:
            for links in plan[name]:
                for model, size, workers in points:
                    one = run_args(args, model, size, workers)
                    # Only an axis with several values names a level of the run directories.
                    point = [part for part, several in ((model, len(models) > 1),
                                                        (f"n{size or 'all'}", len(sizes) > 1),
                                                        (f"w{workers}", len(worker_counts) > 1)) if several]
                    for mode in modes:
                        for seed in range(args.seeds):
                            parts = [name, links] if len(plan[name]) > 1 else [name]
                            run_dir = os.path.join(args.out, "runs", *parts, *point, mode, f"seed{seed}")
                            shown = f" ({links})" if SCENARIOS[name].network is not None else ""
                            shown += "".join(f" {p}" for p in point)
                            print(f"ps-compare: [{len(runs) + 1}/{total}] {name}{shown} {mode} seed {seed}",
                                  flush=True)
                            run = run_one(one, SCENARIOS[name], mode, seed, run_dir, links)
                            print(f"ps-compare:   test accuracy {run['metrics']['test_accuracy']:.4f}, "
                                  f"{run['launch_s']:.0f} s", flush=True)
                            run.update(model=model, train_examples=size, workers=workers)
                            runs.append(run)
    except CompareError as e:
        print(f"ps-compare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ps-compare: interrupted", file=sys.stderr)
        return 130
    config["wall_s"] = time.monotonic() - started
    paths = write_report(args.out, config, runs)
    print(f"ps-compare: wrote {', '.join(paths)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
