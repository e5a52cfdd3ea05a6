"""bench/link_split.py runs on emulated hosts and reports, per N, when each transfer was in.

No timing is asserted (BENCHMARKS.md has the figures): only that every round timed all N
transfers, in order, that the last one is the reference (ratio 1), and that the link
carried no more than its rate: the last transfer is in no sooner than N x bytes at the
rate, less what tbf's bucket (64 KiB at this rate) lets through at once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_common.procs import dying_with_parent
from ps_tools.hosts import unavailable
from tests.hosts.conftest import ROOT

BYTES, RATE, BUCKET = 400_000, 20e6, 64 * 1024


def test_the_split_of_one_link_between_transfers_that_start_together_is_measured(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "split.json"
    proc = subprocess.run(dying_with_parent([sys.executable, "bench/link_split.py", "--workers", "2", "--rounds", "4",
                                             "--bytes", str(BYTES), "--rate", "20mbit", "--idle-s", "0.1",
                                             "--json-out", str(out)]),
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = json.loads(out.read_text()).values()
    assert report["equal_share_s"] == pytest.approx(2 * BYTES * 8 / RATE)
    assert len(report["rounds"]) == 3  # the first round left out
    for r in report["rounds"]:
        assert len(r) == 2 and r == sorted(r) and r[0] > 0
        assert r[1] >= (2 * BYTES - BUCKET) * 8 / RATE  # both through the server's one link
    assert [row["k"] for row in report["finished"]] == [1, 2] and report["finished"][1]["of_last"] == 1.0
    assert "2-th in:" in proc.stdout
