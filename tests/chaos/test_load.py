"""A short run of the load test: many workers at once against one real ps-server.

    pytest -m chaos tests/chaos/test_load.py

Runs ``bench/load_test.py`` (16 workers in 2 processes, 5 s per mode) as a
subprocess, once for the module, and checks what the load test measures: no
call fails, sync rounds are applied exactly once each, the async apply loses
no element update, and the server's memory does not grow. The full run
(64 workers x 30 s) is in RELIABILITY.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_common.procs import dying_with_parent
from tests.cluster.conftest import ROOT

pytestmark = [pytest.mark.chaos, pytest.mark.cluster]

CLIENTS = 16
SECONDS = 5
PEAK_RSS_LIMIT_MIB = 768  # a 16-worker run peaks near 150 MiB; this only catches a runaway


@pytest.fixture(scope="module")
def load(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("load") / "load.json"
    proc = subprocess.run(
        dying_with_parent([sys.executable, "bench/load_test.py", "--mode", "both", "--clients", str(CLIENTS),
                           "--seconds", str(SECONDS), "--procs", "2", "--json-out", str(out)]),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.exists(), f"load test wrote no results (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    results["_output"] = proc.stdout + proc.stderr[-3000:]
    results["_exit"] = proc.returncode
    return results


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_call_of_every_worker_succeeds_under_load(load, mode):
    r = load[mode]
    assert r["clients"] == CLIENTS
    assert r["pushes"] > 0, load["_output"]
    assert r["errors"] == 0, r["error_samples"]
    assert r["server_exit_code"] == 0, "ps-server did not shut down cleanly on SIGTERM"


def test_sync_under_load_every_element_equals_minus_the_completed_rounds(load):
    """sync_mode: "a gradient is applied at most once, and only as part of a full round".
    With all-ones gradients, SGD lr 1 and 16 workers (1/16 is exact), R rounds give -R."""
    r = load["sync"]
    rounds = r["rounds"]
    assert rounds > 0
    assert r["expected_value"] == -rounds
    assert r["elements_wrong"] == 0, f"{r['elements_wrong']} of {r['elements']} elements differ from {-rounds}"
    assert r["server_version"] == rounds
    assert r["server_pushes_applied"] == r["pushes"] == rounds * CLIENTS
    assert r["worker_rounds_min"] == r["worker_rounds_max"] == rounds


def test_async_under_load_loses_no_element_update(load):
    """async_mode: "every accepted gradient is applied to every variable exactly once
    (no lost update: each variable's read-modify-write is serialized by its lock)"."""
    r = load["async"]
    assert r["server_pushes_applied"] == r["pushes"] == r["server_version"]
    assert r["expected_value"] == -r["pushes"]
    assert r["lost_element_updates"] == 0
    assert r["extra_element_updates"] == 0
    assert r["elements_wrong"] == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_server_memory_stays_bounded_under_load(load, mode):
    m = load[mode]["memory"]
    assert m["peak_mib"] < PEAK_RSS_LIMIT_MIB, m
    assert m["post_warmup_mib"] is not None, m
    assert m["end_mib"] <= 1.5 * m["post_warmup_mib"], m
    assert m["bounded"], m


def test_load_test_exits_zero_when_every_check_holds(load):
    assert load["_exit"] == 0, load["_output"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_status_and_health_are_measured_side_by_side_under_load(load, mode):
    """The bench reports each control call's latencies and failures, the probe's own wake-up
    lag and the server's threads' CPU time (issue 27); a call may only fail by its deadline."""
    r = load[mode]
    probe = r["control_calls"]
    for name in ("Status", "Health"):
        calls = probe[name]
        assert calls["calls"] > 0 and calls["calls"] == probe["Status"]["calls"], probe
        if calls["calls"] > calls["failed"]:
            assert 0 < calls["p50_ms"] <= calls["p99_ms"] <= calls["max_ms"], calls
        assert all("DEADLINE_EXCEEDED" in f for f in calls["failure_samples"]), calls
    assert probe["wake_lag"]["p50_ms"] is not None and probe["wake_lag"]["p50_ms"] >= 0
    assert r["server_thread_times"]["ran_s"] > 0 and r["server_thread_times"]["waited_for_cpu_s"] >= 0
