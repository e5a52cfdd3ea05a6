"""bench/hosts_scaling.py runs end to end on emulated hosts (``--quick``) and reports every row.

No timing is asserted (BENCHMARKS.md has the figures): only that each configuration
ran, that every figure is there and positive, and that each fraction of the links'
limit lies in (0, 1.2]: above that the limit or the byte count would be wrong, since
shaped links cannot carry more than their rate (1.2 leaves room for tbf's burst and
the window's edges).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_common.procs import dying_with_parent
from ps_tools.hosts import unavailable
from tests.hosts.conftest import ROOT


@pytest.mark.slow  # ~66 s: the benchmark's smoke run, outside the default tier
def test_quick_scaling_run_reports_every_row_with_its_limit_fraction_and_ratio(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "scaling.json"
    proc = subprocess.run(dying_with_parent([sys.executable, "bench/hosts_scaling.py", "--quick", "--json", str(out)]),
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    r = report["r_bytes_per_s"]
    assert r == 100e6 / 8 and report["model_bytes"] == 3_745_320

    load = {(row["ps"], row["workers"]): row for row in report["throughput"]}
    assert set(load) == {(1, 2), (2, 2)}
    for (ps, workers), row in load.items():
        assert row["pushes"] > 0 and row["push_bytes_per_s"] > 0 and row["pull_bytes_per_s"] > 0
        assert row["throughput_bytes_per_s"] == pytest.approx(row["push_bytes_per_s"] + row["pull_bytes_per_s"])
        assert row["ps_links_bytes_per_s"] == pytest.approx(2 * ps * r)
        assert 0 < row["limit_bytes_per_s"] <= min(row["ps_links_bytes_per_s"], 2 * workers * r) + 1
        assert row["bound_by"] in ("PS links", "worker links")
        for key in ("fraction", "turns_fraction", "wire_fraction"):
            assert 0 < row[key] <= 1.2, (key, row)
        assert row["wire_in_bytes_per_s"] > 0 and row["wire_out_bytes_per_s"] > 0
        assert 0 <= row["retransmitted_percent"] < 100
        # the same pulls and pushes on bare sockets, side by side
        assert row["raw"]["pushes"] > 0 and 0 < row["raw"]["fraction"] <= 1.2, row["raw"]
        assert row["over_raw"] == pytest.approx(row["throughput_bytes_per_s"] / row["raw"]["throughput_bytes_per_s"])

    # Training with and without the overlap (PushPull), side by side in the one run.
    train = {(row["ps"], row["workers"], row["overlap"]): row for row in report["training"]}
    assert set(train) == {(1, 2, True), (1, 2, False), (2, 2, True), (2, 2, False)}
    for row in train.values():
        assert row["steps"] == 3 and row["measured_steps"] == 2 and row["global_batch"] == 64
        assert row["step_s"] > 0 and row["examples_per_s"] > 0 and row["links_need_s"] > 0
        assert 0 < row["fraction"] <= 1.2, row
        assert row["step_over_links_need"] == pytest.approx(1 / row["fraction"])
        assert row["push_bytes"] == report["model_bytes"]

    for part in ("throughput", "training"):
        assert set(report["ratios"][part]) == {"2/1"} and set(report["ratios"][part]["2/1"]) == {"2"}
        assert report["ratios"][part]["2/1"]["2"] > 0
    # The printed tables carry the same rows and the ratios.
    assert "(a) push+pull throughput" in proc.stdout and "(b) sync training" in proc.stdout
    assert "throughput 2/1 PS, by worker count: W=2:" in proc.stdout
    assert "training 2/1 PS, by worker count: W=2:" in proc.stdout
    assert set(report["ratios"]["overlap"]) == {"1", "2"} and all(
        v["2"] > 0 for v in report["ratios"]["overlap"].values())
    assert "training examples/s, overlap on / off, 1 PS, by worker count: W=2:" in proc.stdout
