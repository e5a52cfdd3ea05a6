"""The experiment knobs and per-step timing, with real processes.

The rules: a worker started with "--slowdown F" sleeps (F-1) times its compute
time after each step's gradients, "--added-latency-ms L" sleeps L ms before
each pull and push, "--pause-at-step K --pause-for S" sleeps S seconds once
before step K; "--history-json" records each step's phases and the knobs'
sleeps; "--eval-every K": the chief evaluates the pulled parameters every K
steps. The knobs return what they asked to sleep, so the history's knob_s is
checked exactly; wall-clock comparisons between workers are left out (the
machine is shared), only lower bounds that a sleep guarantees are checked.
"""

import json
import statistics
import subprocess
import sys

import pytest

from tests.cluster.conftest import Procs, read_log, wait_exit

pytestmark = pytest.mark.cluster

STEPS = 8
TIMING = ("t", "pull_s", "compute_s", "push_s", "knob_s")


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """One async run, 2 workers: worker 1 slowed, delayed and paused; the chief evaluates every 4 steps."""
    tmp = tmp_path_factory.mktemp("knobs")
    procs = Procs(tmp)
    try:
        _, address = procs.server(mode="async", num_workers=2)
        common = ["--dataset", "synthetic", "--steps", str(STEPS)]
        w0 = procs.worker(address, 0, 2, *common, "--eval-every", "4", "--history-json", str(tmp / "h0.json"))
        w1 = procs.worker(address, 1, 2, *common, "--slowdown", "3", "--added-latency-ms", "20",
                          "--pause-at-step", "2", "--pause-for", "0.5", "--history-json", str(tmp / "h1.json"))
        for w in (w0, w1):
            assert wait_exit(w, 300) == 0, read_log(w)[-3000:]
        histories = [json.loads((tmp / f"h{i}.json").read_text()) for i in (0, 1)]
        for h, w in zip(histories, (w0, w1)):
            h["log"] = read_log(w)
        yield histories
    finally:
        procs.stop_all()


def test_a_slowed_worker_sleeps_twice_its_compute_plus_the_latency_and_pauses_once(async_run):
    h = async_run[1]
    assert h["worker_index"] == 1
    assert h["knobs"] == {"slowdown": 3.0, "bandwidth_mbps": 0.0, "added_latency_ms": 20.0,
                          "pause_at_step": 2, "pause_for": 0.5}
    steps = h["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    for s in steps:
        pause = 0.5 if s["step"] == 2 else 0.0
        slowed = 0.0 if s["step"] == 0 else 2 * s["compute_s"]  # the first step (TF's tracing) is not slowed
        # (3 - 1) * compute, 20 ms before the pull and 20 ms before the push.
        assert s["knob_s"] == pytest.approx(slowed + 0.040 + pause, abs=1e-6), s
    assert "experiment knobs: compute 3x slower, 20 ms added before every pull and push, " \
        "a 0.5 s pause before step 2" in h["log"]


def test_an_unshaped_worker_sleeps_nothing_and_every_step_is_timed(async_run):
    assert async_run[0]["knobs"]["slowdown"] == 1.0
    assert all(s["knob_s"] == 0 for s in async_run[0]["steps"])
    for h in async_run:
        steps = h["steps"]
        for s in steps:
            assert set(TIMING) <= set(s) and all(s[k] >= 0 for k in TIMING), s
        ts = [s["t"] for s in steps]
        assert ts == sorted(ts) and len(set(ts)) == len(ts), ts
        # A sleep never ends early: each step lasted at least its phases plus what the knobs slept.
        for before, s in zip([{"t": 0.0}] + steps, steps):
            assert s["t"] - before["t"] >= s["pull_s"] + s["compute_s"] + s["push_s"] + s["knob_s"] - 1e-6, s
        assert ts[-1] <= h["train_s"]
        # The gradients' CPU time is measured too (ps-advise's probe reads it), and the
        # slowdown's sleep is not in it: worker 1 sleeps 2x its compute, yet its CPU
        # seconds stay near the unshaped worker's, not 3x them.
        assert all(s["compute_cpu_s"] > 0 for s in steps), steps
    cpu = [statistics.median(s["compute_cpu_s"] for s in h["steps"][1:]) for h in async_run]
    assert cpu[1] < 2 * cpu[0], cpu


def test_the_chief_evaluates_the_pulled_parameters_every_k_steps(async_run):
    h = async_run[0]
    assert h["eval_every"] == 4
    evals = h["evals"]
    assert [e["step"] for e in evals] == [3, 7]  # after 4 and 8 steps
    by_step = {s["step"]: s for s in h["steps"]}
    for e in evals:
        assert 0 <= e["test_accuracy"] <= 1 and e["test_loss"] > 0 and e["eval_s"] > 0, e
        assert e["version"] == by_step[e["step"]]["base_version"]  # the parameters pulled for that step
        assert e["t"] >= by_step[e["step"]]["t"]
        nxt = by_step.get(e["step"] + 1)
        if nxt:  # the evaluation is outside the next step's phases, but inside its t
            phases = nxt["pull_s"] + nxt["compute_s"] + nxt["push_s"] + nxt["knob_s"]
            assert nxt["t"] - e["t"] >= e["eval_s"] + phases - 1e-6, (e, nxt)
    assert async_run[1]["evals"] == [] and async_run[1]["eval_every"] == 0  # the chief's job only


def test_launch_worker_args_reach_that_worker_only(tmp_path):
    h0, h1 = tmp_path / "h0.json", tmp_path / "h1.json"
    run = subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", "--mode", "async", "--workers", "2", "--dataset", "synthetic",
         "--steps", "3", "--worker-args", "0", f"--history-json {h0}",
         "--worker-args", "1", f"--slowdown 2 --history-json {h1}"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    w0, w1 = json.loads(h0.read_text()), json.loads(h1.read_text())
    assert (w0["knobs"]["slowdown"], w1["knobs"]["slowdown"]) == (1.0, 2.0)
    assert w1["steps"][0]["knob_s"] == 0  # the first step carries TensorFlow's one-time tracing: not slowed
    assert all(s["knob_s"] == pytest.approx(s["compute_s"]) for s in w1["steps"][1:])
    assert all(s["knob_s"] == 0 for s in w0["steps"])
