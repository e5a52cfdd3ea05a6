"""``ps-advise --predict`` (ps_tools.study.advise_predict): a measured step profile simulated at N
workers in virtual time, and the decision between the simulation and the rule.

    python -m pytest -q tests/worker/test_advise_predict.py
"""

import dataclasses
import math

import pytest

from ps_tools.study import advise_predict
from ps_tools.study.advise_rules import AdviseError, Measurements, WorkerTimes, decide
from ps_tools.study.compare import mode_flags
from ps_tools.study.virtual import SimConfig, Simulation, VirtualError, Workload

FREE = {"apply_s": 0.0, "fold_s": 0.0, "round_apply_s": 0.0, "decode_s": 0.0, "encode_s": 0.0}
LAUNCH = ["--workers", "3", "--model", "tiny", "--dataset", "digits", "--train-examples", "256", "--epochs", "2",
          "--optimizer", "sgd", "--learning-rate", "0.1", "--global-batch-size", "24"]


def measured(computes, spread=0.0, comm=0.001):
    return Measurements("by hand", "async", [WorkerTimes(i, c + comm, c, comm, spread) for i, c in enumerate(computes)],
                        4 * 7850, {"shard": 1e9})


def test_the_profile_is_the_typical_compute_and_each_workers_factor_and_jitter():
    typical, factors, sigmas = advise_predict.profile_of(measured([0.010, 0.012, 0.030], spread=1.2))
    assert typical == pytest.approx(0.011)  # the median of all but the slowest
    assert factors == pytest.approx((0.010 / 0.011, 0.012 / 0.011, 0.030 / 0.011))
    assert sigmas == pytest.approx((math.log(1.2) / 1.2816,) * 3)  # p90 / median 1.2 of a lognormal
    _, _, unmeasured = advise_predict.profile_of(measured([0.01, 0.01]))
    assert unmeasured == (0.05, 0.05)
    with pytest.raises(AdviseError, match="compute per step is 0"):
        advise_predict.profile_of(measured([0.0, 0.0]))


def test_measured_factors_1_1_3_are_the_straggler_profile_draw_for_draw():
    """The same seeded jitter, the same factor: a cluster measured as 1, 1, 3 runs exactly as
    the built-in straggler profile (slowdown 3), at N = 3 and repeated at N = 6 (where the
    profile has one straggler, the measured pattern two)."""
    base = SimConfig(model="tiny", dataset="digits", train_examples=256, batch=8, epochs=1.0, optimizer="sgd",
                     learning_rate=0.1, workers=3, mode="async", compute_s=0.01, latency_s=0.0)
    w = Workload(base)
    straggler = Simulation(dataclasses.replace(base, profile="straggler", slowdown=3.0), w, FREE).run()
    same = Simulation(dataclasses.replace(base, profile="measured", factors=(1.0, 1.0, 3.0), sigmas=(0.05,) * 3),
                      w, FREE).run()
    assert same["evals"] == straggler["evals"] and same["staleness"] == straggler["staleness"]
    w6 = Workload(dataclasses.replace(base, workers=6))  # a workload is per N: its global batch is N x batch
    six = Simulation(dataclasses.replace(base, workers=6, profile="measured", factors=(1.0, 1.0, 3.0)), w6, FREE)
    six_one = Simulation(dataclasses.replace(base, workers=6, profile="straggler", slowdown=3.0), w6, FREE)
    assert six.run()["evals"] != six_one.run()["evals"]
    with pytest.raises(VirtualError, match="factors > 0"):
        SimConfig(profile="measured", factors=(1.0, 0.0)).check()
    with pytest.raises(VirtualError, match="one per factor"):
        SimConfig(profile="measured", factors=(1.0, 2.0), sigmas=(0.1,)).check()


def test_the_prediction_runs_each_mode_at_the_users_n_and_decides_only_beyond_the_spread():
    m = measured([0.010, 0.010, 0.030])
    rule = decide(m)
    assert rule.rule == "straggler"
    lines = []
    p = advise_predict.predict(m, rule, 6, launch_args=LAUNCH, link_mbps=1000.0, latency_ms=0.2,
                               modes=["sync", "async", "backup"], seeds=2, target=0.5, progress=lines.append)
    assert [r["mode"] for r in p.rows] == ["sync", "async", "backup"] and len(lines) == 6
    assert p.config["workers"] == 6 and p.config["batch"] == 8 and p.config["factors"] == pytest.approx((1, 1, 3))
    assert p.config["worker_mbps"] == p.config["server_mbps"] == 1000.0 and p.config["latency_s"] == 0.0002
    rows = {r["mode"]: r for r in p.rows}
    assert rows["sync"]["mean_staleness"] == 0 and rows["async"]["mean_staleness"] > 0
    assert (p.decided_by, p.advice) == advise_predict.decide(p.rows, p.verdict, rule, 6, 0.5, 2)
    # the same configuration and server costs, the same timeline (the costs are measured here
    # unless given, and the times follow them; TensorFlow's float sums may differ in the last
    # bit between processes' thread pools, and move an accuracy sitting on the target)
    fixed = [advise_predict.predict(m, rule, 6, launch_args=LAUNCH, link_mbps=1000.0, latency_ms=0.2,
                                    modes=["sync", "async"], seeds=2, target=0.5, costs=FREE, progress=lines.append)
             for _ in range(2)]
    timeline = [[(r["virtual_s"], r["mean_staleness"], r["examples_per_s"]) for r in f.rows] for f in fixed]
    assert timeline[0] == timeline[1] and timeline[0][0][0] > 0
    text = advise_predict.report(p)
    assert "predicted for 6 workers" in text and f"[decided by: {p.decided_by}]" in text


def test_one_seed_never_decides_and_the_rule_stands():
    m = measured([0.010, 0.010, 0.030])
    rule = decide(m)
    p = advise_predict.predict(m, rule, 3, launch_args=LAUNCH, link_mbps=1000.0, modes=["sync", "async"], seeds=1,
                               target=0.3, progress=lambda line: None)
    assert p.decided_by == "rule" and p.advice.flags == rule.flags and "could not decide" in p.advice.reason


def row(mode, t, acc, t_sd=0.01, acc_sd=0.005, seeds=2):
    return {"mode": mode, "time_to_target": t, "time_to_target_sd": t_sd, "final_accuracy": acc,
            "final_accuracy_sd": acc_sd, "seeds": seeds, "reached": seeds if t is not None else 0}


def test_the_decision_goes_by_time_then_accuracy_then_the_rule_unless_the_simulation_shows_it_behind():
    from ps_tools.study.virtual_compare import verdicts

    def decided(*rows, rule_mode="async"):
        rows = [dict(r, profile="measured", workers=8) for r in rows]
        rule = dataclasses.replace(decide(measured([0.01, 0.01, 0.03])), mode=rule_mode, flags=["--mode", rule_mode])
        (verdict,) = verdicts(rows)
        return advise_predict.decide(rows, verdict, rule, 8, 0.85, 2)

    by, advice = decided(row("sync", 1.0, 0.90), row("async", 2.0, 0.90), row("backup", 1.5, 0.90))
    assert by == "simulation" and advice.flags == ["--mode", "sync"] and "first" in advice.reason
    # times level, accuracy decides
    by, advice = decided(row("sync", 1.00, 0.93), row("async", 1.01, 0.80), row("backup", 1.02, 0.90))
    assert by == "simulation" and advice.mode == "sync" and "most accurate" in advice.reason
    # sync and backup level on both; the rule's async behind on accuracy: the fastest level one
    by, advice = decided(row("sync", 1.005, 0.913), row("async", 1.00, 0.76), row("backup", 1.008, 0.911))
    assert by == "simulation" and advice.flags == mode_flags("sync", 8) and "rule's async is behind" in advice.reason
    # the rule's mode level with the best: it stands
    by, advice = decided(row("sync", 1.01, 0.913), row("async", 1.00, 0.912), row("backup", 1.5, 0.80))
    assert by == "rule" and advice.mode == "async" and "agrees" in advice.reason
    # the rule's async never reached the target: behind on time
    by, advice = decided(row("sync", 1.0, 0.91, t_sd=0.3), row("async", None, 0.5), row("backup", 1.1, 0.91, t_sd=0.3))
    assert by == "simulation" and advice.mode == "sync" and "did not reach" in advice.reason
    # nobody reached it: the rule
    by, advice = decided(row("sync", None, 0.5), row("async", None, 0.5))
    assert by == "rule" and "no mode reached" in advice.reason


def test_bad_requests_are_refused_before_any_run():
    m = measured([0.01, 0.01])
    rule = decide(m)
    with pytest.raises(AdviseError, match="backup workers need at least 2"):
        advise_predict.predict(m, rule, 1, launch_args=LAUNCH, modes=["backup"], progress=lambda line: None)
    with pytest.raises(AdviseError, match="unknown mode"):
        advise_predict.predict(m, rule, 4, launch_args=LAUNCH, modes=["fastest"], progress=lambda line: None)
    with pytest.raises(AdviseError, match="--predict-workers must be >= 1"):
        advise_predict.predict(m, rule, 0, launch_args=LAUNCH, progress=lambda line: None)
    with pytest.raises(AdviseError, match="--predict-seeds"):
        advise_predict.predict(m, rule, 2, launch_args=LAUNCH, seeds=0, progress=lambda line: None)


def test_a_running_clusters_stand_in_is_the_built_in_model_nearest_in_parameters():
    assert advise_predict.nearest_model(7_850) == "tiny"
    assert advise_predict.nearest_model(60_000) == "deepcnn"
    training = advise_predict.training_of(None, None, None, measured([0.01, 0.01]))
    assert training["model"] == "tiny" and training["dataset"] == "digits" and training["batch"] == 32
