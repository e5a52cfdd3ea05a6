"""Virtual time (ps_tools.study.virtual): the link and event model by hand, and runs of the real
server core with real gradients whose times and staleness follow from fixed costs."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from ps_tools.study.virtual import Events, SharedLink, SimConfig, Simulation, VirtualError, Workload, fair_rates

# Fixed costs (not measured): the times below follow from them exactly, whatever the machine.
COMPUTE = 0.010
FREE = {"compute_s": COMPUTE, "apply_s": 0.0, "fold_s": 0.0, "round_apply_s": 0.0, "decode_s": 0.0, "encode_s": 0.0}
BASE = SimConfig(model="tiny", dataset="digits", train_examples=256, batch=8, epochs=2.0, optimizer="sgd",
                 learning_rate=0.1, latency_s=0.0, worker_mbps=0.0, server_mbps=0.0, workers=4)


@pytest.fixture(scope="module")
def workload():
    return Workload(BASE)


def run(workload, costs=FREE, **changes):
    sim = Simulation(dataclasses.replace(BASE, **changes), workload, costs)
    return sim, sim.run()


def test_fair_rates_share_a_link_max_min():
    assert fair_rates(10.0, [100.0, 100.0]) == [5.0, 5.0]
    assert fair_rates(10.0, [1.0, 100.0, 100.0]) == [1.0, 4.5, 4.5]  # the capped flow's rest is shared
    assert fair_rates(math.inf, [3.0, 7.0]) == [3.0, 7.0]
    assert fair_rates(10.0, [math.inf]) == [10.0]


def test_transfers_through_a_shared_link_take_their_bytes_over_its_rate():
    ev = Events()
    link = SharedLink(ev, bytes_per_s=1000.0)
    done = {}
    for i in range(4):  # four at once: each gets a quarter, all end after 4 x 500 bytes / 1000
        link.send(500, math.inf, lambda i=i: done.setdefault(i, ev.now))
    ev.at(1.0, lambda: link.send(100, 200.0, lambda: done.setdefault("late", ev.now)))
    ev.run(until=lambda: False)
    # 0-1 s: four at 250 B/s. Then the late flow takes its cap of 200 and the four share 800
    # until it is done at 1.5 s; the four end when all 2100 bytes are across.
    assert done["late"] == pytest.approx(1.5, abs=1e-9)
    assert done[0] == done[3] == pytest.approx(2.1, abs=1e-9)
    assert link.busy_s == pytest.approx(2.1, abs=1e-9)


def test_a_transfer_under_way_keeps_the_larger_share_of_a_windowed_link():
    """TCP-like shares (window + bytes sent): two transfers started together share equally;
    one started later gets less than half, so the earlier one ends sooner than under equal
    shares (1.5 s), and the link stays busy as long (every byte at its rate)."""
    ev = Events()
    link = SharedLink(ev, bytes_per_s=1000.0, window=100.0)
    done = {}
    link.send(1000, math.inf, lambda: done.setdefault("a", ev.now))
    ev.at(0.5, lambda: link.send(1000, math.inf, lambda: done.setdefault("b", ev.now)))
    ev.run(until=lambda: False)
    assert 1.0 < done["a"] < 1.2 and done["b"] == pytest.approx(2.0, abs=1e-9)
    ev2 = Events()
    link2 = SharedLink(ev2, bytes_per_s=1000.0, window=100.0)
    for k in "cd":
        link2.send(1000, math.inf, lambda k=k: done.setdefault(k, ev2.now))
    ev2.run(until=lambda: False)
    assert done["c"] == done["d"] == pytest.approx(2.0, abs=1e-9)
    assert fair_rates(900.0, [math.inf, math.inf], [2.0, 1.0]) == [600.0, 300.0]
    assert fair_rates(900.0, [100.0, math.inf], [2.0, 1.0]) == [100.0, 800.0]  # a capped flow's rest goes on


def test_a_run_is_a_function_of_its_configuration(workload):
    _, a = run(workload, mode="async", profile="tail")
    _, b = run(workload, mode="async", profile="tail")
    assert a["evals"] == b["evals"] and a["staleness"] == b["staleness"]
    _, c = run(workload, mode="async", profile="tail", seed=1)
    assert c["evals"] != a["evals"]


def test_sync_in_virtual_time_is_one_big_batch(workload):
    """Four workers' rounds equal one worker taking the whole global batch each step."""
    four, r4 = run(workload, mode="sync")
    one = Simulation(dataclasses.replace(BASE, workers=1, batch=32), Workload(dataclasses.replace(BASE, workers=1,
                                                                                                batch=32)), FREE)
    r1 = one.run()
    assert r4["updates"] == r1["updates"] == 2 * 256 // 32
    assert r4["mean_staleness"] == 0
    assert len(one.final_values) == len(four.final_values) == 2
    # The same variables in the same order (a second model in one process has other names).
    for a, b in zip(four.final_values.values(), one.final_values.values()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    moved = [np.abs(a - b).max() for a, b in zip(one.final_values.values(), workload.initial.values())]
    assert min(moved) > 1e-3  # it trained


def test_a_sync_round_waits_for_the_straggler_and_async_does_not(workload):
    _, sync_b = run(workload, mode="sync")
    _, sync_s = run(workload, mode="sync", profile="straggler", slowdown=3.0)
    # 16 rounds of compute (jitter of 5 %: the slowest of 4 each round), nothing else costs.
    assert sync_b["virtual_s"] == pytest.approx(16 * COMPUTE, rel=0.15)
    assert sync_s["virtual_s"] == pytest.approx(3 * sync_b["virtual_s"], rel=0.15)
    _, async_b = run(workload, mode="async")
    _, async_s = run(workload, mode="async", profile="straggler", slowdown=3.0)
    # Async loses only the straggler's missing two thirds: 3 1/3 of 4 workers' throughput.
    assert async_s["examples_per_s"] == pytest.approx(async_b["examples_per_s"] * (3 + 1 / 3) / 4, rel=0.1)
    # Balanced async: each push is about N - 1 updates old.
    assert 2.5 <= async_b["mean_staleness"] <= 3.5


def test_ssp_holds_fast_workers_to_the_bound(workload):
    _, async_s = run(workload, mode="async", profile="straggler")
    _, ssp_s = run(workload, mode="ssp1", profile="straggler")
    assert async_s["max_ahead"] == 0  # async keeps no clocks
    assert ssp_s["max_ahead"] <= 1
    assert ssp_s["examples_per_s"] < 0.7 * async_s["examples_per_s"]


def test_backup_workers_finish_rounds_without_the_straggler(workload):
    _, sync_s = run(workload, mode="sync", profile="straggler")
    _, backup = run(workload, mode="backup", profile="straggler")
    assert backup["dropped"] > 0
    assert backup["virtual_s"] < 0.6 * sync_s["virtual_s"]


def test_a_job_in_steps_ends_as_a_real_run_and_a_dropped_backup_push_is_a_step(workload):
    """job_in_steps (the validation's twins): every worker does the job's 2 x 256 / 32 = 16
    steps; backup's rounds take 3 of 4 pushes, so 16 rounds apply 16 x 3 x 8 examples, where
    the study's job (examples applied) runs backup until 2 x 256 are."""
    costs = dict(FREE, compute_s=COMPUTE)
    _, steps = run(workload, costs, mode="backup", profile="straggler", job_in_steps=True)
    assert steps["updates"] == 16 and steps["examples"] == 16 * 3 * 8
    _, examples = run(workload, costs, mode="backup", profile="straggler")
    assert examples["examples"] >= 2 * 256 and examples["updates"] > 16
    _, sync = run(workload, costs, mode="sync", job_in_steps=True)
    assert sync["updates"] == 16 and sync["examples"] == 2 * 256


def test_a_diverged_run_ends_where_the_server_refused_its_nan_gradient(workload):
    """SGD at 1e38: the weights overflow to inf, a gradient holds NaN, the server refuses it and
    applies nothing (as a real one does); the run ends there and says so, no exception."""
    wild = dataclasses.replace(BASE, mode="async", learning_rate=1e38)
    r = Simulation(wild, Workload(wild), FREE).run()  # the optimizer is the workload's
    assert r["diverged"] and "NaN or Inf" in r["diverged"] and r["examples"] < 2 * 256
    _, fine = run(workload, mode="async")
    assert fine["diverged"] is None


def test_the_evaluations_follow_the_real_chiefs_grid(workload):
    """eval_every_rounds 2 (the validation's, from --eval-every 2): the chief evaluates the
    values it pulled for its steps 1, 3, 5, ...: sync versions 1, 3, ..., 15 of the 16 rounds
    (with the start and the end); the default grid evaluates every round."""
    costs = dict(FREE, compute_s=COMPUTE)
    _, every = run(workload, costs, mode="sync", job_in_steps=True)
    _, chief = run(workload, costs, mode="sync", job_in_steps=True, eval_every_rounds=2)
    assert [e["version"] for e in every["evals"]] == list(range(17))
    assert [e["version"] for e in chief["evals"]] == [0, *range(1, 17, 2), 16]


def test_the_servers_link_is_shared_by_every_worker(workload):
    """Sync, compute free: each round pulls N models out and pushes N gradients in through
    the server's one link, one direction after the other. The models come back with the
    pushes' replies (the sync shortcut): one latency each way per round, not two, and one
    more for the first pull's request."""
    costs = dict(FREE, compute_s=1e-9)
    _, r = run(workload, costs, mode="sync", server_mbps=8.0, latency_s=0.001)
    w = workload
    per_round = 4 * (w.pull_bytes + w.push_bytes) / 1e6 + 2 * 0.001
    assert r["virtual_s"] == pytest.approx(r["updates"] * per_round + 0.001, rel=1e-4)
    _, fast = run(workload, costs, mode="sync", server_mbps=8.0, latency_s=0.001, shards=2)
    assert fast["virtual_s"] < 0.6 * r["virtual_s"]


def test_the_server_is_one_queue(workload):
    """Async with a server slower than the workers: throughput is the server's apply rate."""
    costs = dict(FREE, apply_s=0.01, compute_s=0.001)
    _, r = run(workload, costs, mode="async")
    assert r["server_busy"] == pytest.approx(1.0, abs=0.05)
    assert r["pushes"] / r["virtual_s"] == pytest.approx(100.0, rel=0.05)


def test_bad_configurations_are_refused(workload):
    for changes, words in (({"mode": "backup", "workers": 1}, "at least 2"), ({"mode": "fast"}, "unknown mode"),
                           ({"profile": "storm"}, "profile"), ({"latency_s": -1.0}, "latency_s"),
                           ({"slowdown": 0.5}, "slowdown")):
        with pytest.raises(VirtualError, match=words):
            dataclasses.replace(BASE, **changes).check()


def test_ps_compare_virtual_64_workers_quick(tmp_path):
    """The acceptance: ps-compare --virtual --workers 64 --quick writes its report."""
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "ps_tools.study.compare", "--virtual", "--workers", "64", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [r["mode"] for r in report["rows"]] == ["sync", "async", "ssp1", "ssp4", "backup"]
    assert all(r["workers"] == 64 for r in report["runs"])
    sync = next(r for r in report["runs"] if r["mode"] == "sync")
    async_ = next(r for r in report["runs"] if r["mode"] == "async")
    assert sync["mean_staleness"] == 0 and async_["mean_staleness"] > 10  # 64 workers: stale async pushes
    # The whole epoch was applied, rounded down to whole rounds of 64 x 8 examples.
    assert sync["examples"] == sync["train_examples"] // 512 * 512
    assert min(e["test_accuracy"] for e in sync["evals"][-10:]) <= sync["end_accuracy"] \
        <= max(e["test_accuracy"] for e in sync["evals"][-10:])
    assert report["chen"] == [dict(report["chen"][0], profile="balanced", workers=64)]
    md = (out / "report.md").read_text()
    assert "| 64 |" in md and "fastest" in md
    assert os.path.getsize(out / "plot-balanced.png") > 10_000


def test_ps_compare_virtual_refuses_bad_flags(tmp_path):
    for flags, words in ((["--profiles", "storm"], "--profiles"), (["--workers", "1", "--modes", "backup"],
                                                                   "at least 2"),
                         (["--workers", "0"], "--workers"), (["--model", "huge"], "--model")):
        done = subprocess.run([sys.executable, "-m", "ps_tools.study.compare", "--virtual", *flags, "--out",
                               str(tmp_path)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and words in done.stderr and "ps-compare: error:" in done.stderr, done.stderr


def test_the_chen_comparison_says_which_half_held():
    from ps_tools.study.virtual_compare import chen_comparison

    def row(mode, times, accs):
        mean = lambda v: sum(v) / len(v)
        sd = lambda v: (sum((x - mean(v)) ** 2 for x in v) / (len(v) - 1)) ** 0.5
        return {"profile": "balanced", "workers": 8, "mode": mode, "seeds": len(times),
                "time_to_target": mean(times), "time_to_target_sd": sd(times),
                "final_accuracy": mean(accs), "final_accuracy_sd": sd(accs)}

    config = {"modes": ["sync", "backup", "async"], "profiles": ["balanced"], "workers": [8],
              "target_accuracy": 0.9}
    rows = [row("sync", [2.0, 2.1, 1.9], [0.93, 0.94, 0.93]), row("backup", [1.0, 1.1, 0.9], [0.93, 0.92, 0.94]),
            row("async", [1.5, 1.6, 1.4], [0.90, 0.91, 0.90])]
    _, (one,) = chen_comparison(config, rows)
    assert (one["sync_mode"], one["sooner"], one["more_accurate"]) == ("backup", "yes", "yes")
    rows[2] = row("async", [0.5, 0.6, 0.4], [0.92, 0.94, 0.93])  # async sooner; accuracy within the spread
    _, (one,) = chen_comparison(config, rows)
    assert (one["sooner"], one["more_accurate"]) == ("no", "within spread")


def test_the_real_runs_costs_and_time_to_target_are_read_from_histories():
    from ps_tools.study.virtual_validate import measured, real_time_to_target

    def step(i, t):
        return {"step": i, "t": t, "pull_s": 0.001, "compute_s": 0.004, "push_s": 0.003, "knob_s": 0.0}

    # The first step traces (0.5 s); then 10 ms a step, 2 ms of it the loop's own.
    chief = {"steps": [step(0, 0.5)] + [step(i, 0.5 + 0.01 * i) for i in range(1, 8)],
             "evals": [{"step": 3, "t": 0.53, "test_accuracy": 0.5, "eval_s": 0.0},
                       {"step": 5, "t": 0.55, "test_accuracy": 0.9, "eval_s": 0.0}]}
    got = measured([chief, {"steps": chief["steps"]}])
    assert got["compute_s"] == 0.004 and got["pull_s"] == 0.001
    assert got["overhead_s"] == pytest.approx(0.002)
    # 0.55 s less the tracing (0.5 - 0.01): 0.06 s of training.
    assert real_time_to_target([chief], 0.85) == pytest.approx(0.06)
    chief["evals"][0]["eval_s"] = 0.02  # an evaluation before it is not training time
    assert real_time_to_target([chief], 0.85) == pytest.approx(0.04)
    assert real_time_to_target([chief], 0.95) is None


def test_the_rankings_hold_virtual_time_to_the_pairs_the_real_seeds_decide():
    from ps_tools.study.virtual_validate import rankings, validation_lines

    def row(mode, seed, real, virtual):
        return {"profile": "balanced", "workers": 3, "mode": mode, "seed": seed, "real_time_to_target": real,
                "virtual_time_to_target": virtual, "residual": None, "real_final_accuracy": 0.9,
                "virtual_final_accuracy": 0.9, "real_train_s": 10.0, "virtual_s": 12.0}

    # Real: sync and backup level (their seeds overlap), async never there: async is decided
    # last against both; sync against backup asks nothing of the simulation.
    rows = [row("sync", 0, 10.0, 11.0), row("sync", 1, 14.0, 12.0),
            row("backup", 0, 11.0, 9.0), row("backup", 1, 12.0, 9.5),
            row("async", 0, None, None), row("async", 1, None, 30.0)]
    (one,) = rankings(rows)
    assert one["real"] == ["backup", "sync", "async"] and one["virtual"] == ["backup", "sync", "async"]
    assert one["decided"] == ["sync < async", "backup < async"] and one["kept"] and one["same"]
    # Virtual async reaching 0.85 before sync in both seeds contradicts a decided pair.
    rows[4:] = [row("async", 0, None, 5.0), row("async", 1, None, 6.0)]
    (one,) = rankings(rows)
    assert one["virtual"][0] == "async" and one["contradicted"] == ["sync < async", "backup < async"]
    assert not one["kept"]
    # Seeds far apart beyond their scatter decide the pair; a mode that misses in one seed
    # of two decides nothing against one that always reached the target.
    rows = [row("sync", 0, 10.0, 20.0), row("sync", 1, 10.2, 20.2),
            row("backup", 0, 20.0, 10.0), row("backup", 1, 20.4, 10.4),
            row("async", 0, 5.0, 50.0), row("async", 1, None, 60.0)]
    (one,) = rankings(rows)
    assert one["decided"] == ["sync < backup"] and one["contradicted"] == ["sync < backup"]
    md = "\n".join(validation_lines(rows, [one], 0.85))
    assert "| balanced | 3 | sync < backup < async | backup < sync < async | no | sync < backup | no: sync < backup |" \
        in md and "decided pairs kept in 0 of 1 (0 of 1 pairs)" in md
    assert "The whole job: 6 of 6 runs within 25 % (median |residual| 20%" in md


@pytest.mark.cluster
def test_validation_against_real_runs_writes_the_table(tmp_path):
    """Real ps-launch runs (2 workers, sync and async) and their virtual twins: virtual sync
    trains the same job as the real one (same data, same rounds), so its final accuracy is
    the real run's; the table holds both times and their residual."""
    out = tmp_path / "v"
    done = subprocess.run([sys.executable, "-m", "ps_tools.study.compare", "--virtual", "--validate", "--workers", "2",
                           "--profiles", "balanced", "--modes", "sync,async", "--seeds", "1", "--epochs", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "validation.json").read_text())
    rows = {r["mode"]: r for r in report["validation"]}
    assert sorted(rows) == ["async", "sync"]
    assert rows["sync"]["virtual_final_accuracy"] == rows["sync"]["real_final_accuracy"]
    for r in rows.values():
        assert r["real_time_to_target"] > 0 and r["virtual_time_to_target"] > 0
        assert r["residual"] == pytest.approx((r["virtual_time_to_target"] - r["real_time_to_target"])
                                              / r["real_time_to_target"])
        assert 0 < r["measured"]["compute_s"] < 1
    (ranks,) = report["rankings"]
    assert ranks["workers"] == 2 and sorted(ranks["real"]) == ["async", "sync"] and "kept" in ranks
    md = (out / "validation.md").read_text()
    assert "| balanced | 2 | sync | 0 |" in md and "pairs the real runs decide" in md and "The whole job:" in md


def test_workers_sharing_two_cores_compute_at_half_speed(workload):
    _, own = run(workload, mode="sync")
    _, shared = run(workload, mode="sync", cores=2.0)
    assert shared["virtual_s"] == pytest.approx(2 * own["virtual_s"], rel=0.1)
    _, plenty = run(workload, mode="sync", cores=8.0)
    assert plenty["virtual_s"] == pytest.approx(own["virtual_s"], rel=1e-6)


def test_a_second_batch_size_costs_one_retrace(workload):
    # 256 examples in rounds of 32: no short batch; 250 leaves one of 26 at the end of each epoch.
    _, whole = run(workload, mode="async", retrace_s=1.0)
    _, plain = run(workload, mode="async")
    assert whole["virtual_s"] == pytest.approx(plain["virtual_s"])
    short = Workload(dataclasses.replace(BASE, train_examples=250))
    a = Simulation(dataclasses.replace(BASE, train_examples=250, mode="sync"), short, FREE).run()
    b = Simulation(dataclasses.replace(BASE, train_examples=250, mode="sync", retrace_s=1.0), short, FREE).run()
    assert b["virtual_s"] - a["virtual_s"] == pytest.approx(1.0, abs=0.05)  # once per worker, in parallel
