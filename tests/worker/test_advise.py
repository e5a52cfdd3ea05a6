"""ps-advise's rules (ps_tools.study.advise_rules.decide) on hand-made measurements: each rule and its boundary.

    python -m pytest -q tests/worker/test_advise.py
"""

import pytest

from ps_tools.study.advise import report
from ps_tools.study.advise_rules import COMM_FRACTION, STRAGGLER_RATIO, Measurements, WorkerTimes, decide


def measured(works, comm_share=0.1):
    workers = [WorkerTimes(i, w, w * (1 - comm_share), w * comm_share) for i, w in enumerate(works)]
    return Measurements("test", "sync", workers, model_bytes=4 << 20, bandwidth={"a:1": 100e6})


def test_balanced_compute_bound_cluster_gets_sync():
    advice = decide(measured([0.10, 0.11, 0.105]))
    assert (advice.mode, advice.rule, advice.flags) == ("sync", "balanced", ["--mode", "sync"])


def test_one_worker_three_times_slower_gets_async_with_backup_workers_as_the_alternative():
    advice = decide(measured([0.10, 0.10, 0.30]))
    assert (advice.mode, advice.rule, advice.flags) == ("async", "straggler", ["--mode", "async"])
    assert "--replicas-to-aggregate 2" in advice.alternative and "[2]" in advice.reason


def test_straggler_boundary():
    just_below = decide(measured([0.1, 0.1, 0.1 * STRAGGLER_RATIO * 0.99]))
    assert just_below.mode == "sync"
    assert decide(measured([0.1, 0.1, 0.1 * STRAGGLER_RATIO])).mode == "async"
    two = decide(measured([0.1, 0.3]))  # two workers: the faster one is the reference; no backup alternative
    assert two.mode == "async" and two.alternative == ""


def test_communication_bound_cluster_keeps_sync_with_half_the_bytes():
    advice = decide(measured([0.1, 0.1, 0.1], comm_share=COMM_FRACTION))
    assert (advice.mode, advice.rule) == ("sync", "communication-bound")
    assert advice.flags == ["--mode", "sync", "--grad-wire-dtype", "bfloat16"]
    assert decide(measured([0.1, 0.1, 0.1], comm_share=COMM_FRACTION * 0.99)).rule == "balanced"


def test_the_straggler_rule_comes_first():
    assert decide(measured([0.1, 0.1, 0.4], comm_share=0.9)).rule == "straggler"


def test_report_shows_the_numbers_and_the_rule():
    m = measured([0.10, 0.10, 0.30])
    text = report(m, decide(m))
    assert "slowest / typical step work: 3.00" in text and "[rule: straggler]" in text
    assert "model: 4.00 MiB" in text and "recommendation: --mode async" in text


@pytest.mark.parametrize("argv", [[], ["--ps", "a:1", "--launch", "--workers", "2"]])
def test_exactly_one_of_ps_and_launch(argv, capsys):
    from ps_tools.study.advise import main

    assert main(argv) == 2
    assert "give either --ps" in capsys.readouterr().err
