"""ps-compare and ps-advise with real processes, in tiny configurations.

    python -m pytest -q tests/cluster/test_compare_advise.py

ps-compare must write a complete report (tables, findings, plots, every run's
numbers); ps-advise must recommend async for a 3x straggler and
sync for a balanced, compute-bound cluster, both from a launch probe and from a
running cluster's own Status.
"""

import json
import subprocess
import sys

import pytest

from tests.cluster.conftest import read_log, wait_exit
from ps_tools.study.advise import STRAGGLER_RATIO
from worker.client import PSClient

pytestmark = pytest.mark.cluster


def advise(*argv, timeout=600):
    run = subprocess.run([sys.executable, "-m", "ps_tools.study.advise", *argv], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.slow  # ~41 s: every scenario trained; the ps-advise tests here stay in the default tier
def test_ps_compare_writes_a_complete_report(tmp_path):
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, "-m", "ps_tools.study.compare", "--scenario", "straggler", "--modes", "sync,ssp1",
                          "--seeds", "2", "--workers", "2", "--steps", "6", "--eval-every", "3",
                          "--dataset", "synthetic", "--target-accuracy", "0.05", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [(r["scenario"], r["mode"], r["seeds"]) for r in report["rows"]] == [("straggler", "sync", 2),
                                                                                  ("straggler", "ssp1", 2)]
    for row in report["rows"]:
        assert row["final_accuracy"]["n"] == 2 and row["final_accuracy"]["sd"] is not None
        assert row["time_to_target_s"]["n"] == 2  # a target every run reaches
        assert row["examples_per_s"]["mean"] > 0 and row["staleness"]["counts"]
    assert len(report["runs"]) == 4
    for r in report["runs"]:
        assert r["accuracy_curve"] and r["loss_curve"] and r["time_to_target_s"] is not None
    sync = next(r for r in report["rows"] if r["mode"] == "sync")
    assert sync["staleness"]["max"] == 0  # sync never applies a stale gradient
    md = (out / "report.md").read_text()
    assert "| mode | final accuracy | time to 0.05 (s) |" in md and "| ssp1 |" in md
    assert "Fastest to 0.05 test accuracy" in md and "(plot-straggler.png)" in md
    for png in ("plot-straggler.png", "staleness-straggler.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    histories = list((out / "runs" / "straggler" / "ssp1" / "seed1").glob("history*.json"))
    assert len(histories) == 2
    knobs = {json.loads(h.read_text())["worker_index"]: json.loads(h.read_text())["knobs"] for h in histories}
    assert knobs[1]["slowdown"] == 3.0 and knobs[0]["slowdown"] == 1.0  # the scenario's straggler: the last worker


def test_ps_advise_recommends_async_for_a_3x_straggler_and_sync_for_a_balanced_compute_bound_launch():
    # Two workers on this 2-core machine, one TensorFlow thread each: three workers, or two
    # whose thread pools each want both cores, share the cores unevenly, and on a busy
    # machine an unlucky one measured 1.45x to 1.66x the other with no knob at all. The
    # straggler's 3x stays far above the 1.25x rule either way.
    one_core_each = ["--workers", "2", "--dataset", "digits", "--global-batch-size", "512",
                     "--intra-op-threads", "1"]
    # A load beside the run (the image build of the docker tier, another job on the machine) can
    # hold one worker's core for a whole probe: the balanced launch is probed up to three times
    # and must be found balanced in one; a rule that calls it a straggler every time still fails.
    straggler = advise("--probe-steps", "20", "--launch", *one_core_each, "--worker-args", "1", "--slowdown 3")
    assert "[rule: straggler]" in straggler and "recommendation: --mode async" in straggler, straggler
    probes = []
    for _ in range(3):
        probes.append(advise("--probe-steps", "30", "--launch", *one_core_each))
        if "[rule: balanced]" in probes[-1]:
            break
    assert "[rule: balanced]" in probes[-1] and "recommendation: --mode sync" in probes[-1], "\n".join(probes)


def test_ps_advise_reads_a_running_sync_cluster_and_finds_its_straggler(procs, tmp_path):
    server, address = procs.server("sync", num_workers=2)
    common = ["--dataset", "digits", "--global-batch-size", "256", "--steps", "400"]
    workers = [procs.worker(address, 0, 2, *common), procs.worker(address, 1, 2, *common, "--slowdown", "3")]
    with PSClient(address) as c:
        for _ in range(600):
            if c.status().version >= 5:
                break
            assert all(w.poll() is None for w in workers), read_log(workers[0])[-2000:]
            import time

            time.sleep(0.2)
    # --predict: the measured profile simulated at 6 workers (ps_tools.study.advise_predict)
    out = advise("--ps", address, "--window", "2", "--json-out", str(tmp_path / "a.json"), "--predict",
                 "--predict-workers", "6", "--predict-epochs", "1", "--predict-modes", "sync,async,backup",
                 "--link-mbps", "1000")
    assert "running cluster at" in out and "(mode sync)" in out
    assert "[rule: straggler]" in out and "worker(s) [1]" in out, out
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["advice"]["mode"] == "async" and doc["measurements"]["straggler_ratio"] >= STRAGGLER_RATIO
    prediction = doc["prediction"]
    assert "predicted for 6 workers" in out and f"[decided by: {prediction['decided_by']}]" in out, out
    config = prediction["config"]
    assert config["workers"] == 6 and config["model"] == "cnn" and config["profile"] == "measured"  # cnn: the nearest
    factors = config["factors"]
    assert factors[0] == 1.0 and factors[1] >= STRAGGLER_RATIO, factors  # the slowed worker, as measured
    rows = {r["mode"]: r for r in prediction["rows"]}
    assert set(rows) == {"sync", "async", "backup"} and all(r["seeds"] == 2 for r in rows.values())
    assert rows["sync"]["mean_staleness"] == 0 < rows["async"]["mean_staleness"]
    for w in workers:
        w.kill()
        wait_exit(w, 30)
