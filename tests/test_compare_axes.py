"""ps-compare's axes (--models, --train-examples, --workers) and the report's spread rule, without training.

    python -m pytest -q tests/test_compare_axes.py

The runs here are made by hand (a chief's history with one evaluation, the launch
metrics), so every number the report derives can be checked: the rule is
|mean_a - mean_b| > 2 * sqrt(sd_a^2/n_a + sd_b^2/n_b) (``ps_tools.study.report``).
"""

import json
import math

import pytest

from ps_tools.study import compare, report
from ps_tools.study.compare import SCENARIOS, main, run_args
from ps_tools.study.compare_runs import launch_argv


def hand_run(mode, seed, t_reach, final_acc, scenario="balanced", model="cnn", train_examples=0, workers=3):
    """A run that first measured 0.9 test accuracy at ``t_reach`` seconds and ended at ``final_acc``."""
    chief = {"evals": [{"t": t_reach, "version": 5, "test_accuracy": 0.9}],
             "steps": [{"t": t_reach + 1.0, "version": 6, "staleness": 0, "loss": 0.5}]}
    return {"scenario": scenario, "mode": mode, "seed": seed, "model": model, "train_examples": train_examples,
            "workers": workers, "links": "loopback", "histories": [chief], "command": "by hand",
            "metrics": {"test_accuracy": final_acc, "train_s": t_reach + 1.0, "examples_per_s": 100.0}}


def config(**axes):
    axes = {"model": ["cnn"], "train_examples": [0], "workers": [3], **axes}
    one = lambda k: axes[k][0] if len(axes[k]) == 1 else None
    return {"scenarios": ["balanced"], "modes": ["sync", "async"], "seeds": 3, "workers": one("workers"),
            "dataset": "digits", "model": one("model"), "train_examples": one("train_examples"), "axes": axes,
            "epochs": 6, "steps": None, "global_batch_size": 256, "eval_every": 2, "target_accuracy": 0.85,
            "scenario_descriptions": {"balanced": SCENARIOS["balanced"].description}, "links_choice": "auto",
            "links_notes": [], "links": {"balanced": {"loopback": "loopback"}}, "command": "ps-compare (by hand)",
            "machine": "test", "wall_s": 1.0}


def rows_of(runs):
    return report.aggregate([report.summarize_run(r, 0.85) for r in runs])


def by_pair(tests, metric):
    return {tuple(t["modes"]): t for t in tests if t["metric"] == metric}


def test_clearly_separated_times_exceed_the_spread():
    # sync 10.0, 10.2, 9.8 (sd 0.2); async 5.0, 5.2, 4.8 (sd 0.2): threshold 2*sqrt(0.04/3 + 0.04/3).
    runs = [hand_run("sync", i, t, 0.95) for i, t in enumerate((10.0, 10.2, 9.8))]
    runs += [hand_run("async", i, t, 0.95) for i, t in enumerate((5.0, 5.2, 4.8))]
    t = by_pair(report.significance(rows_of(runs)), "time_to_target_s")[("sync", "async")]
    assert t["difference"] == pytest.approx(5.0)
    assert t["threshold"] == pytest.approx(2 * math.sqrt(0.04 / 3 * 2))
    assert t["exceeds"] is True and t["note"] == "exceeds spread" and t["n"] == [3, 3]
    acc = by_pair(report.significance(rows_of(runs)), "final_accuracy")[("sync", "async")]
    assert acc["difference"] == pytest.approx(0.0) and acc["exceeds"] is False  # equal accuracies, sd 0


def test_overlapping_times_are_within_the_spread():
    # sync 10, 6, 14 (mean 10, sd 4); async 9, 13, 5 (mean 9, sd 4): 1 s apart, threshold 2*sqrt(32/3) = 6.5 s.
    runs = [hand_run("sync", i, t, 0.9 + 0.01 * i) for i, t in enumerate((10.0, 6.0, 14.0))]
    runs += [hand_run("async", i, t, 0.93 - 0.01 * i) for i, t in enumerate((9.0, 13.0, 5.0))]
    t = by_pair(report.significance(rows_of(runs)), "time_to_target_s")[("sync", "async")]
    assert t["difference"] == pytest.approx(1.0)
    assert t["threshold"] == pytest.approx(2 * math.sqrt(32 / 3))
    assert t["exceeds"] is False and t["note"] == "within spread"


def test_with_one_seed_the_spread_is_unknown_and_nothing_is_claimed():
    runs = [hand_run("sync", 0, 10.0, 0.9), hand_run("async", 0, 1.0, 0.9)]
    for t in report.significance(rows_of(runs)):
        assert t["exceeds"] is None and t["threshold"] is None and t["note"] == "one seed: spread unknown"
    assert by_pair(report.significance(rows_of(runs)), "time_to_target_s")[("sync", "async")]["difference"] == 9.0


def test_a_mode_that_never_reached_the_target_has_no_time_difference():
    runs = [hand_run("sync", i, 10.0 + i, 0.95) for i in range(2)]
    runs += [dict(hand_run("async", i, 5.0, 0.5), histories=[{"evals": [], "steps": []}]) for i in range(2)]
    t = by_pair(report.significance(rows_of(runs)), "time_to_target_s")[("sync", "async")]
    assert t["exceeds"] is None and t["difference"] is None and t["note"] == "not reached in any seed"


def test_every_pair_of_modes_of_a_group_is_compared_on_both_metrics():
    runs = [hand_run(m, i, 5.0 + i, 0.9) for m in ("sync", "async", "ssp1") for i in range(2)]
    tests = report.significance(rows_of(runs))
    assert sorted((tuple(t["modes"]), t["metric"]) for t in tests) == sorted(
        (pair, metric) for pair in (("sync", "async"), ("sync", "ssp1"), ("async", "ssp1"))
        for metric in ("time_to_target_s", "final_accuracy"))


def test_the_report_has_a_group_per_model_and_says_which_differences_exceed_the_spread(tmp_path):
    runs = []
    for model, fast in (("tiny", (5.0, 5.2, 4.8)), ("cnn", (9.0, 13.0, 5.0))):
        runs += [hand_run("sync", i, t, 0.95, model=model) for i, t in enumerate((10.0, 10.2, 9.8) if model == "tiny"
                                                                                 else (10.0, 6.0, 14.0))]
        runs += [hand_run("async", i, t, 0.95, model=model) for i, t in enumerate(fast)]
    paths = report.write_report(str(tmp_path), config(model=["tiny", "cnn"]), runs)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert [(r["model"], r["mode"]) for r in doc["rows"]] == [("tiny", "sync"), ("tiny", "async"),
                                                                ("cnn", "sync"), ("cnn", "async")]
    assert all(r["train_examples"] == 0 and r["workers"] == 3 for r in doc["rows"] + doc["runs"])
    verdicts = {g["model"]: by_pair(g["significance"], "time_to_target_s")[("sync", "async")]["exceeds"]
                for g in doc["groups"]}
    assert verdicts == {"tiny": True, "cnn": False}
    assert {g["model"]: g["fastest_to_target"] for g in doc["groups"]} == {"tiny": "async", "cnn": "async"}
    md = (tmp_path / "report.md").read_text()
    assert "### balanced, tiny" in md and "### balanced, cnn" in md
    assert "| async vs | time to 0.85: difference (s) |" in md
    assert "| sync | +5.0 | 0.3 | exceeds spread |" in md and "| sync | +1.0 | 6.5 | within spread |" in md
    assert "Training: 3 workers, digits/tiny,cnn" in md
    assert {p.rsplit("/", 1)[1] for p in paths} >= {"plot-balanced-tiny.png", "plot-balanced-cnn.png",
                                                    "staleness-balanced-cnn.png"}
    assert "(plot-balanced-tiny.png)" in md
    assert any(line.startswith("[tiny] Fastest") for line in doc["findings"]["balanced"])


def test_one_value_of_each_axis_keeps_the_report_as_it_was(tmp_path):
    runs = [hand_run(m, i, 5.0 + i, 0.9) for m in ("sync", "async") for i in range(2)]
    paths = report.write_report(str(tmp_path), config(), runs)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["config"]["model"] == "cnn" and doc["config"]["workers"] == 3
    assert doc["compare_links"] == {} and len(doc["groups"]) == 1
    assert all(not line.startswith("[") for line in doc["findings"]["balanced"])
    md = (tmp_path / "report.md").read_text()
    assert "Training: 3 workers, digits/cnn, global batch 256" in md and "### balanced," not in md
    assert "(plot-balanced.png)" in md and {p.rsplit("/", 1)[1] for p in paths} == {
        "report.json", "report.md", "plot-balanced.png", "staleness-balanced.png"}


def run_main(monkeypatch, tmp_path, *argv):
    ran, written = [], []

    def fake_run(args, scenario, mode, seed, run_dir, links="sleep"):
        ran.append((args.model, args.train_examples, args.workers, mode, seed, run_dir,
                    launch_argv(args, scenario, mode, seed, run_dir, links)))
        return {"metrics": {"test_accuracy": 0.9}, "launch_s": 0.0}

    monkeypatch.setattr(compare, "run_one", fake_run)
    monkeypatch.setattr(compare, "write_report", lambda out, config, runs: written.append((config, runs)) or [])
    assert main(["--scenario", "balanced", "--out", str(tmp_path), *argv]) == 0
    return ran, written


def test_the_runs_loop_over_models_train_sizes_and_worker_counts(monkeypatch, tmp_path):
    ran, written = run_main(monkeypatch, tmp_path, "--models", "tiny,cnn", "--train-examples", "200,0",
                            "--workers", "2,3", "--modes", "sync,backup", "--seeds", "1")
    assert [r[:5] for r in ran] == [(m, n, w, mode, 0) for m in ("tiny", "cnn") for n in (200, 0) for w in (2, 3)
                                    for mode in ("sync", "backup")]
    first = ran[0]
    assert first[5] == str(tmp_path / "runs" / "balanced" / "tiny" / "n200" / "w2" / "sync" / "seed0")
    assert ran[7][5].endswith("/runs/balanced/tiny/nall/w3/backup/seed0")
    argv = first[6]
    assert argv[argv.index("--model") + 1] == "tiny" and argv[argv.index("--train-examples") + 1] == "200"
    assert argv[argv.index("--workers") + 1] == "2"
    backup = ran[3][6]  # tiny, 200, 3 workers, backup: rounds of the first 2 pushes
    assert backup[backup.index("--replicas-to-aggregate") + 1] == "2"
    assert "--train-examples" not in ran[4][6]  # 0: the whole set, the worker's default
    config, runs = written[0]
    assert config["axes"] == {"model": ["tiny", "cnn"], "train_examples": [200, 0], "workers": [2, 3]}
    assert config["model"] is None and config["workers"] is None
    assert [(r["model"], r["train_examples"], r["workers"]) for r in runs[:2]] == [("tiny", 200, 2)] * 2


def test_one_value_of_each_axis_keeps_the_run_directories_and_model_flag(monkeypatch, tmp_path):
    ran, written = run_main(monkeypatch, tmp_path, "--model", "mlp", "--workers", "2", "--modes", "sync",
                            "--seeds", "1")
    assert [r[:5] for r in ran] == [("mlp", 0, 2, "sync", 0)]
    assert ran[0][5] == str(tmp_path / "runs" / "balanced" / "sync" / "seed0")
    assert written[0][0]["model"] == "mlp" and written[0][0]["workers"] == 2


@pytest.mark.parametrize("argv, message", [
    (["--models", "tiny,resnet"], "--models: unknown 'resnet'; use tiny, deepcnn, cnn, mlp, mlp25m"),
    (["--model", "resnet"], "--model: unknown 'resnet'"),
    (["--workers", "2,x"], "--workers must be comma-separated integers, each a worker count, got '2,x'"),
    (["--workers", "0,2"], "--workers must be >= 1, got 0"),
    (["--train-examples", "200,-5"], "--train-examples must be >= 0, got -5"),
    (["--train-examples", "1e3"], "--train-examples must be comma-separated integers"),
    (["--models", "cnn,cnn"], "--models lists a value twice: cnn,cnn"),
    (["--workers", "1,3", "--modes", "sync,backup"], "--modes backup needs --workers >= 2"),
])
def test_bad_axis_lists_are_one_line_errors_with_exit_2(argv, message, capsys):
    assert main(["--scenario", "balanced", "--out", "unused", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ps-compare: error: {message}") and err.count("\n") == 1, err


def test_run_args_sets_one_point_and_leaves_the_rest():
    args = compare.parser().parse_args(["--out", "x", "--models", "tiny,cnn", "--workers", "2,4"])
    one = run_args(args, "tiny", 200, 4)
    assert (one.model, one.train_examples, one.workers, one.out) == ("tiny", 200, 4, "x")
    assert args.workers == "2,4"  # the parsed lists stay as given


def test_two_link_kinds_and_two_worker_counts_are_compared_per_count(tmp_path):
    runs = [dict(hand_run(m, i, t + i, 0.9, scenario="bandwidth", workers=w), links=k)
            for w in (2, 3) for k in ("sleep", "emulated") for m, t in (("sync", 4.0), ("async", 8.0))
            for i in range(2)]
    cfg = {**config(workers=[2, 3]), "scenarios": ["bandwidth"],
           "scenario_descriptions": {"bandwidth": SCENARIOS["bandwidth"].description},
           "links": {"bandwidth": {"sleep": "sleep knobs", "emulated": "emulated hosts"}}}
    report.write_report(str(tmp_path), cfg, runs)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert sorted(doc["compare_links"]) == ["bandwidth (2 workers)", "bandwidth (3 workers)"]
    assert [(g["workers"], g["links"]) for g in doc["groups"]] == [(2, "sleep"), (2, "emulated"), (3, "sleep"),
                                                                    (3, "emulated")]
    assert all(g["fastest_to_target"] == "sync" for g in doc["groups"])
    md = (tmp_path / "report.md").read_text()
    assert "#### bandwidth, 3 workers" in md and "### bandwidth, 2 workers: sleep vs emulated" in md
    assert "(plot-bandwidth-emulated-w3.png)" in md and (tmp_path / "plot-bandwidth-emulated-w3.png").exists()
