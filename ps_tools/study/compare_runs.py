"""One run of ``ps-compare``: ``ps-launch`` for a scenario, a mode and a seed.

    run = run_one(args, SCENARIOS["straggler"], "sync", 0, "report/runs/straggler/sync/seed0", links="sleep")

A run is ``ps-launch`` (one server, N worker processes on this machine) with the
scenario's experiment knobs (``--slowdown``, ``--pause-at-step``), every worker
writing its per-step history and the chief evaluating the test accuracy every few
steps. A scenario with a network (bandwidth: a rate and a latency on every link) runs
on emulated hosts (``links="emulated"``: ``ps_tools.study.compare_hosts``) or on
loopback with the sleep knobs ``--bandwidth-mbps`` and ``--added-latency-ms``
(``"sleep"``). ``run_one`` returns what the report (``ps_tools.study.report``) needs.

Modes (``mode_flags``): ``sync``; ``async``; ``ssp1`` and ``ssp4`` (``--mode ssp
--staleness 1`` and ``4``); ``backup`` (sync finishing each round with the first
N-1 pushes: ``--replicas-to-aggregate N-1``). Scenarios: see ``SCENARIOS``.

Both ``ps_tools.study.compare`` (``ps-compare``: the runs over its axes) and
``ps_tools.study.virtual_validate`` (the real twins of virtual runs) run these, so
they are below both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time

from ps_tools.study.compare_hosts import LinksError, Network, describe, launch_command_text, run_on_hosts

LAST = -1  # the scenario knob goes to the last worker
ALL = -2  # ... to every worker


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    knobs: dict  # {worker index, LAST or ALL: "ps-worker flags"}
    network: Network | None = None  # every worker's link: emulated hosts or the sleep knobs (--links)


SCENARIOS = {
    "balanced": Scenario("balanced", "every worker at full speed", {}),
    "straggler": Scenario("straggler", "the last worker computes 3x slower (--slowdown 3)", {LAST: "--slowdown 3"}),
    "bandwidth": Scenario("bandwidth", "every worker's link at 20 Mbit/s with 5 ms latency", {},
                          Network(rate_mbps=20, latency_ms=5)),
    "pause": Scenario("pause", "the last worker pauses 3 s at step 10 (--pause-at-step 10 --pause-for 3)",
                      {LAST: "--pause-at-step 10 --pause-for 3"}),
}

MODES = ("sync", "async", "ssp1", "ssp4", "backup")


def mode_flags(mode: str, workers: int) -> list[str]:
    if mode == "sync":
        return ["--mode", "sync"]
    if mode == "async":
        return ["--mode", "async"]
    if mode.startswith("ssp") and mode[3:].isdigit():
        return ["--mode", "ssp", "--staleness", mode[3:]]
    if mode == "backup" or (mode.startswith("backup") and mode[6:].isdigit()):
        return ["--mode", "sync", "--replicas-to-aggregate", str(workers - int(mode[6:] or 1))]
    raise ValueError(f"unknown mode {mode!r}: use sync, async, sspS (S an integer), backup or backupK")


class CompareError(RuntimeError):
    pass


def scenario_worker_args(scenario: Scenario, workers: int, links: str = "sleep") -> dict[int, list[str]]:
    """Each worker's knobs; with ``links`` "sleep", the scenario's network as sleep knobs too."""
    out: dict[int, list[str]] = {}
    knobs = dict(scenario.knobs)
    if scenario.network is not None and links == "sleep":
        knobs[ALL] = (knobs.get(ALL, "") + " " + scenario.network.sleep_knobs()).strip()
    for where, flags in knobs.items():
        targets = range(workers) if where == ALL else [workers - 1 if where == LAST else where]
        for i in targets:
            out.setdefault(i, []).extend(shlex.split(flags))
    return out


def launch_argv(args, scenario: Scenario, mode: str, seed: int, run_dir: str, links: str) -> list[str]:
    """The ps-launch arguments (without the program) of one run (``args``: one point of the axes)."""
    per_worker = scenario_worker_args(scenario, args.workers, links)
    argv = [*mode_flags(mode, args.workers), "--workers", str(args.workers),
            "--dataset", args.dataset, "--model", args.model, "--global-batch-size", str(args.global_batch_size),
            "--seed", str(seed), "--metrics-json", os.path.join(run_dir, "metrics.json"),
            "--log-every", "1000000"]
    if getattr(args, "train_examples", 0):
        argv += ["--train-examples", str(args.train_examples)]
    argv += ["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs)]
    for i in range(args.workers):
        extra = per_worker.get(i, []) + ["--history-json", os.path.join(run_dir, f"history{i}.json")]
        if i == 0:
            extra += ["--eval-every", str(args.eval_every)]
        argv += ["--worker-args", str(i), shlex.join(extra)]
    return argv


def run_one(args, scenario: Scenario, mode: str, seed: int, run_dir: str, links: str = "sleep") -> dict:
    """One run (ps-launch on loopback, or its processes on emulated hosts: ``links``);
    returns what the report needs (metrics, histories, timings, how the links were made)."""
    run_dir = os.path.abspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    argv = launch_argv(args, scenario, mode, seed, run_dir, links)
    where = f"{scenario.name}/{mode}/seed {seed}" + (f" ({links})" if scenario.network is not None else "")
    t0 = time.monotonic()
    if links == "emulated":
        try:
            metrics = run_on_hosts(argv, scenario.network, run_dir, args.run_timeout)
        except LinksError as e:
            raise CompareError(f"{where} failed on emulated hosts: {e}") from None
        command = launch_command_text(argv, scenario.network)
    else:
        metrics = _run_launch(argv, where, run_dir, args.run_timeout)
        command = "ps-launch " + shlex.join(argv)
    histories = []
    for i in range(args.workers):
        with open(os.path.join(run_dir, f"history{i}.json")) as f:
            histories.append(json.load(f))
    return {"scenario": scenario.name, "mode": mode, "seed": seed, "model": args.model,
            "train_examples": getattr(args, "train_examples", 0), "workers": args.workers,
            "metrics": metrics, "histories": histories,
            "launch_s": time.monotonic() - t0, "command": command, "links": links,
            "links_description": describe(links, scenario.network)}


def _run_launch(argv: list[str], where: str, run_dir: str, timeout: float) -> dict:
    full = [sys.executable, "-m", "ps_tools.launch", *argv]
    with open(os.path.join(run_dir, "launch.log"), "w") as log:
        try:
            done = subprocess.run(full, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise CompareError(f"{where} did not finish within --run-timeout {timeout:g} s; "
                               f"see {run_dir}/launch.log") from None
    if done.returncode != 0:
        with open(os.path.join(run_dir, "launch.log")) as f:
            tail = f.read()[-2000:]
        raise CompareError(f"{where} failed (ps-launch exited {done.returncode}); "
                           f"the end of {run_dir}/launch.log:\n{tail}")
    with open(os.path.join(run_dir, "metrics.json")) as f:
        return json.load(f)
