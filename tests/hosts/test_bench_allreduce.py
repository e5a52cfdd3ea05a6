"""bench/allreduce_hosts.py runs end to end on emulated hosts (``--quick``): both systems train.

No timing is asserted (BENCHMARKS.md has the figures): only that MultiWorkerMirroredStrategy
and tfps both trained over the shaped links, every figure is there, each step took at
least what its links need (shaped links cannot carry more than their rate; 0.8 leaves
room for tbf's burst), and the ratio printed is the two runs' examples/s.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_common.procs import dying_with_parent
from ps_tools.hosts import unavailable
from tests.hosts.conftest import ROOT


@pytest.mark.slow  # ~40 s: the benchmark's smoke run, outside the default tier
def test_quick_run_trains_mwms_and_tfps_on_the_same_links_and_prints_their_ratio(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "allreduce.json"
    proc = subprocess.run(dying_with_parent([sys.executable, "bench/allreduce_hosts.py", "--quick", "--json", str(out)]),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["model_bytes"] == {"mlp": 3_745_320}
    rows = {(row["system"], row["ps"]): row for row in report["rows"]}
    assert set(rows) == {("mwms", 0), ("tfps", 1)} and rows["tfps", 1]["block_kib"] == 32  # --overlap-block-kib
    for row in rows.values():
        assert row["workers"] == 2 and row["steps"] == 3 and row["measured_steps"] == 2 and row["global_batch"] == 64
        assert row["step_s"] > 0 and row["examples_per_s"] == pytest.approx(64 / row["step_s"])
        assert row["step_over_links_need"] >= 0.8, row
        assert row["tcp"] == "cubic" and all(0 <= row["queue_drop_percent"][w] < 100 for w in ("up", "down")), row
    r = report["r_bytes_per_s"]
    assert rows["mwms", 0]["links_need_s"] == pytest.approx(3_745_320 / r)  # 2(N-1)/N = 1 at N = 2
    assert rows["tfps", 1]["links_need_s"] == pytest.approx(2 * 3_745_320 / r)  # one server host: 2 models each way
    [pair] = report["side_by_side"]
    assert pair["ratio"] == pytest.approx(rows["tfps", 1]["examples_per_s"] / rows["mwms", 0]["examples_per_s"])
    assert pair["links_ratio"] == pytest.approx(0.5) and pair["bound"] == 1.0
    assert f"{pair['ratio']:.2f}" in proc.stdout and "tfps/mwms" in proc.stdout
