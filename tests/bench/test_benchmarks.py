"""Each benchmark (BENCHMARKS.md) runs end to end in a tiny configuration and writes its JSON.

    pytest tests/bench       # barrier and server: a few seconds each; training: 25-45 s on 2 cores

No timing is asserted (the machines are shared and noisy): only that every
figure the benchmark reports is there and positive.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_common.procs import dying_with_parent
from tests.cluster.conftest import ROOT

pytestmark = pytest.mark.cluster


def run_bench(script: str, *flags: str, out, timeout: float) -> dict:
    proc = subprocess.run(dying_with_parent([sys.executable, f"bench/{script}", *flags, "--json-out", str(out)]),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_barrier_reports_p50_p99_of_ours_and_bare_and_their_ratio(tmp_path):
    report = run_bench("barrier.py", "--workers", "2,3", "--rounds", "5", "--warmup", "1",
                       out=tmp_path / "barrier.json", timeout=120)
    assert set(report["results"]) == {"2", "3"}
    for n, r in report["results"].items():
        for kind in ("ours", "unary", "bare"):
            assert r[kind]["p50_ms"] > 0 and r[kind]["p99_ms"] >= r[kind]["p50_ms"]
            assert r[kind]["samples"] == 5 * int(n)
        assert r["p50_ratio"] > 0 and r["p99_ratio"] > 0 and r["unary_p50_ratio"] > 0


def test_server_reports_inprocess_bandwidths_and_load_with_one_and_two_servers(tmp_path):
    report = run_bench("server.py", "--sizes", "1", "--reps", "1", "--clients", "4", "--steps", "2",
                       "--model-mib", "0.25", out=tmp_path / "server.json", timeout=180)
    assert set(report["gib_per_s"]) == {"default", "tuned"}
    for rows in report["gib_per_s"].values():
        row = rows["1"]
        for key in ("numpy_add", "aggregate_2", "aggregate_8", "fold_8", "adam_apply",
                    "aggregate_2_ratio", "aggregate_8_ratio", "fold_8_ratio", "adam_apply_ratio"):
            assert row[key] > 0, key
    results = report["load"]["results"]
    assert set(results) == {"sync", "async"}
    for r in results.values():
        for servers in ("1", "2"):
            assert r[servers]["pushes"] == 4 * 2
            assert r[servers]["pushes_per_s"] > 0 and r[servers]["mib_per_s"] > 0
        assert r["ratio_2_over_1"] > 0


def test_optimizer_step_reports_fused_and_numpy_bandwidths_of_every_optimizer(tmp_path):
    from ps_server.core.optim import kernels

    report = run_bench("optimizer_step.py", "--sizes", "1", "--reps", "1", "--optimizers", "sgd,adam",
                       out=tmp_path / "optimizer_step.json", timeout=180)
    row = report["gib_per_s"]["1"]
    paths = ("fused", "fused_2t", "numpy") if kernels.available() else ("numpy",)
    assert set(row) == {"numpy_add", *(f"{name}/{path}" for name in ("sgd", "adam") for path in paths)}
    assert all(x > 0 for x in row.values()), row


@pytest.mark.slow  # ~55 s: the benchmark's smoke run, outside the default tier
@pytest.mark.parity  # TensorFlow's own strategies run too
def test_training_reports_examples_per_s_of_every_runner_and_the_ratios(tmp_path):
    report = run_bench("training.py", "--models", "cnn", "--steps", "3", out=tmp_path / "training.json",
                       timeout=900)
    cnn = report["results"]["cnn"]
    assert cnn["spec"]["steps"] == 3 and cnn["spec"]["num_workers"] == 2
    for name in ("mwms", "ours-sync", "ours-sync-shm", "pss", "ours-async", "ours-async-shm"):
        r = cnn["runners"][name]
        assert r["status"] == "ok", r
        assert r["examples"] == 3 * 64 and r["examples_per_s"] > 0
        assert ("shared memory" in r["notes"]) == name.endswith("-shm"), r["notes"]
    assert set(cnn["ratios"]) == {"ours-sync/mwms", "ours-sync-shm/mwms", "ours-async/pss", "ours-async-shm/pss"}
    assert all(v > 0 for v in cnn["ratios"].values())


def test_sparse_reports_bytes_and_latency_of_sparse_and_dense_pushes_and_their_ratios(tmp_path):
    report = run_bench("sparse.py", "--rows", "2000", "--dim", "8", "--touched", "16,200", "--reps", "2",
                       out=tmp_path / "sparse.json", timeout=180)
    assert set(report["results"]) == {"16", "200"}
    for r in report["results"].values():
        for kind in ("sparse", "dense"):
            assert r[kind]["bytes_per_push"] > 0 and r[kind]["push_ms"] > 0
        assert r["bytes_ratio_dense_over_sparse"] > 1 and r["latency_ratio_dense_over_sparse"] > 0
