"""ps-compare's ``--links``: the bandwidth scenario on emulated hosts, on the sleep knobs, or both.

    python -m pytest -q tests/hosts/test_compare_links.py

The real run (skipped where emulated hosts are unavailable, saying why) trains the
bandwidth scenario both ways in a tiny configuration and checks that the report
names how each run's links were made and compares the two; the others check the
flag's parsing and fallback without training (any machine).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ps_tools.study import compare, compare_hosts
from ps_tools.study.compare import SCENARIOS, main
from ps_tools.study.compare_hosts import LinksError, plan_links
from ps_tools.study.compare_runs import scenario_worker_args
from ps_tools.hosts import unavailable

EMULATED = "emulated hosts: tc tbf 20 Mbit/s per host, 5 ms each way by relay"
REASON = "emulated hosts need root (network namespaces, veth pairs, tc)"


@pytest.mark.slow  # ~50 s: two short trainings on shaped links, outside the default tier
def test_a_short_comparison_on_emulated_and_sleep_links_names_each_and_compares_them(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "report"
    run = subprocess.run([sys.executable, "-m", "ps_tools.study.compare", "--scenario", "bandwidth", "--links", "both",
                          "--modes", "sync,async", "--seeds", "1", "--workers", "2", "--steps", "4",
                          "--eval-every", "2", "--dataset", "synthetic", "--target-accuracy", "0.05",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "bandwidth (emulated) sync seed 0" in run.stdout and "bandwidth (sleep) sync seed 0" in run.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["links"] == {"bandwidth": {
        "sleep": "sleep knobs on loopback: --bandwidth-mbps 20 --added-latency-ms 5 on every worker",
        "emulated": EMULATED}}
    assert sorted((r["links"], r["mode"]) for r in report["rows"]) == [
        ("emulated", "async"), ("emulated", "sync"), ("sleep", "async"), ("sleep", "sync")]
    assert {r["links"] for r in report["runs"]} == {"emulated", "sleep"}
    both = report["compare_links"]["bandwidth"]
    assert both["kinds"] == ["sleep", "emulated"]
    for kind in both["kinds"]:
        assert set(both["per_kind"][kind]["examples_per_s"]) == {"sync", "async"}
    assert both["sentences"] and all(line.startswith(("[sleep]", "[emulated]"))
                                     for line in report["findings"]["bandwidth"])
    md = (out / "report.md").read_text()
    assert f"Links: {EMULATED}." in md and "Links: sleep knobs on loopback" in md
    assert "### bandwidth: sleep vs emulated" in md and "| examples/s, emulated |" in md
    for name in ("bandwidth-sleep", "bandwidth-emulated"):
        assert f"(plot-{name}.png)" in md
        assert (out / f"plot-{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = out / "runs" / "bandwidth"
    # Emulated: no sleep knob; the workers on hosts of their own, reaching the server by name.
    knobs = json.loads((runs / "emulated" / "sync" / "seed0" / "history1.json").read_text())["knobs"]
    assert knobs["bandwidth_mbps"] == 0.0 and knobs["added_latency_ms"] == 0.0
    server_log = (runs / "emulated" / "sync" / "seed0" / "server.log").read_text()
    assert "registered (tfps-worker-0:" in server_log and "registered (tfps-worker-1:" in server_log, server_log
    metrics = json.loads((runs / "emulated" / "sync" / "seed0" / "metrics.json").read_text())
    assert metrics["links"] == EMULATED and metrics["steps"] == 4 and metrics["mode"] == "sync"
    # Sleep: the knobs on every worker, on loopback.
    knobs = json.loads((runs / "sleep" / "async" / "seed0" / "history0.json").read_text())["knobs"]
    assert knobs["bandwidth_mbps"] == 20.0 and knobs["added_latency_ms"] == 5.0


def test_emulated_or_both_where_hosts_are_unavailable_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compare_hosts.hosts_mod, "unavailable", lambda: REASON)
    for choice in ("emulated", "both"):
        with pytest.raises(LinksError) as e:
            plan_links(choice, ["bandwidth"], SCENARIOS)
        assert "\n" not in str(e.value) and REASON in str(e.value)
        out = tmp_path / choice
        assert main(["--scenario", "bandwidth", "--links", choice, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"ps-compare: error: --links {choice}: {REASON}"), err
        assert not out.exists()
    # A scenario without a network needs no emulated hosts, whatever --links says.
    assert plan_links("emulated", ["straggler"], SCENARIOS) == ({"straggler": ["loopback"]}, [])


def test_auto_falls_back_to_the_sleep_knobs_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(compare_hosts.hosts_mod, "unavailable", lambda: REASON)
    plan, notes = plan_links("auto", ["bandwidth", "pause"], SCENARIOS)
    assert plan == {"bandwidth": ["sleep"], "pause": ["loopback"]}
    assert len(notes) == 1 and REASON in notes[0] and "bandwidth use(s) the sleep knobs" in notes[0]
    # Through main, with the training and the report stubbed: every run gets the sleep knobs.
    ran, written = [], []

    def fake_run(args, scenario, mode, seed, run_dir, links="sleep"):
        ran.append((scenario.name, mode, seed, links, scenario_worker_args(scenario, args.workers, links)))
        return {"metrics": {"test_accuracy": 0.9}, "launch_s": 0.0}

    monkeypatch.setattr(compare, "run_one", fake_run)
    monkeypatch.setattr(compare, "write_report", lambda out, config, runs: written.append(config) or [])
    assert main(["--scenario", "bandwidth", "--modes", "sync", "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert f"ps-compare: --links auto: {REASON}" in capsys.readouterr().out
    assert [r[:4] for r in ran] == [("bandwidth", "sync", 0, "sleep")]
    assert ran[0][4][2] == ["--bandwidth-mbps", "20", "--added-latency-ms", "5"]
    assert written[0]["links"] == {"bandwidth": {"sleep": "sleep knobs on loopback: --bandwidth-mbps 20 "
                                                           "--added-latency-ms 5 on every worker"}}
    assert written[0]["links_choice"] == "auto" and REASON in written[0]["links_notes"][0]


def test_the_plan_for_each_choice_where_hosts_are_available(monkeypatch):
    monkeypatch.setattr(compare_hosts.hosts_mod, "unavailable", lambda: None)
    names = ["balanced", "bandwidth"]
    assert plan_links("auto", names, SCENARIOS) == ({"balanced": ["loopback"], "bandwidth": ["emulated"]}, [])
    assert plan_links("emulated", names, SCENARIOS)[0]["bandwidth"] == ["emulated"]
    assert plan_links("both", names, SCENARIOS)[0]["bandwidth"] == ["sleep", "emulated"]
    monkeypatch.setattr(compare_hosts.hosts_mod, "unavailable", lambda: pytest.fail("sleep needs no probe"))
    assert plan_links("sleep", names, SCENARIOS)[0]["bandwidth"] == ["sleep"]
    # On emulated hosts the network is tc's and the relay's: no worker sleeps for it.
    assert scenario_worker_args(SCENARIOS["bandwidth"], 3, "emulated") == {}
    assert scenario_worker_args(SCENARIOS["straggler"], 3, "emulated") == {2: ["--slowdown", "3"]}


def test_an_unknown_links_choice_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--links", "fast", "--out", "x"])
    assert e.value.code == 2 and "--links: invalid choice: 'fast'" in capsys.readouterr().err
