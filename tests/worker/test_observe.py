"""The worker's observer (worker.observe): progress bar and log lines, TensorBoard, Prometheus.

    python -m pytest -q tests/worker/test_observe.py

No server and no training: the observer is fed history records built by hand, so
every expected value (counts, sums, rates) can be computed here. TensorFlow is
imported by one test only (for the TensorBoard event files).
"""

import io
import logging
import urllib.request

import pytest

from ps_common.settings import ConfigError
from worker.observe import Observer


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(step: int, *, loss: float = 0.5, batch_size: int = 32, staleness: int = 1, dropped: bool = False,
           pull_s: float = 0.01, compute_s: float = 0.02, push_s: float = 0.03, knob_s: float = 0.0) -> dict:
    """A trainer history record for step ``step`` (from 0); each step takes 0.1 s of ``t``."""
    return {"step": step, "loss": loss, "batch_size": batch_size, "base_version": step, "version": step + 1,
            "staleness": staleness, "dropped": dropped, "t": 0.1 * (step + 1), "pull_s": pull_s,
            "compute_s": compute_s, "push_s": push_s, "knob_s": knob_s}


# Progress: the bar on a terminal, log lines elsewhere.

def test_auto_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    assert Observer(progress="auto", stream=FakeTTY()).progress == "bar"
    assert Observer(progress="auto", stream=io.StringIO()).progress == "lines"
    assert Observer(progress="bar", stream=io.StringIO()).progress == "bar"
    with pytest.raises(ConfigError, match="--progress"):
        Observer(progress="fancy")


def test_the_bar_is_redrawn_in_place_and_ends_with_a_newline():
    out = FakeTTY()
    obs = Observer(total_steps=4, progress="bar", stream=out, refresh_s=0.0)
    for s in range(4):
        obs.step(record(s, loss=1.0 / (s + 1)))
    obs.finish({})
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    frames = [f.rstrip() for f in text.rstrip("\n").split("\r")[1:]]
    assert frames[0].startswith("step 1/4 [") and " 25% loss 1.0000 320 ex/s staleness 1 ETA 0s" in frames[0]
    assert frames[-1].startswith("step 4/4 [=") and "] 100% loss 0.2500" in frames[-1]
    assert frames[-1].endswith("took 0s") and "." not in frames[-1].split("]")[0]
    assert all(len(f) < 80 for f in frames)  # never wraps on an 80-column terminal
    obs.close()
    assert out.getvalue() == text  # finish already ended the line


def test_the_bar_is_redrawn_at_most_every_refresh_s_but_always_at_the_end():
    out = FakeTTY()
    obs = Observer(total_steps=50, progress="bar", stream=out, refresh_s=3600.0)
    for s in range(50):
        obs.step(record(s))
    obs.close()
    frames = out.getvalue().split("\r")[1:]
    assert [f.split(" [")[0] for f in frames] == ["step 1/50", "step 50/50"]


def test_finish_draws_the_last_record_held_back_by_the_refresh_interval():
    out = FakeTTY()
    obs = Observer(total_steps=10, progress="bar", stream=out, refresh_s=3600.0)
    for s in range(3):  # a run that ends early (a sync worker skipped ahead): step 3 was not drawn yet
        obs.step(record(s))
    obs.finish({})
    assert out.getvalue().rstrip().split("\r")[-1].startswith("step 3/10 ")
    assert out.getvalue().endswith("\n")


def test_a_log_record_during_the_bar_starts_on_a_clean_line():
    out = FakeTTY()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("worker")
    logger.addHandler(handler)
    try:
        obs = Observer(total_steps=4, progress="bar", stream=out, refresh_s=0.0)
        obs.step(record(0))
        obs.step(record(1))
        logger.warning("server restarted")
        obs.step(record(2))
        obs.step(record(3))
        obs.finish({})
        obs.close()
        assert obs._clear_bar_line not in handler.filters  # close unhooks it
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().split("\n")
    assert lines[0].split("\r")[-1] == "WARNING server restarted"  # the bar's line was blanked first
    assert lines[0].split("\r")[-2].strip() == ""
    assert lines[1].split("\r")[-1].startswith("step 4/4 ") and lines[2] == ""


def test_without_a_terminal_a_log_line_every_log_every_steps_and_at_the_last(caplog):
    out = io.StringIO()
    obs = Observer(total_steps=25, log_every=10, progress="auto", stream=out)
    with caplog.at_level(logging.INFO, logger="worker"):
        for s in range(25):
            obs.step(record(s, loss=0.25, dropped=s == 24))
        obs.finish({})
    obs.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "worker"]
    # 10 steps of 32 examples in 1.0 s of t; the last 5 in 0.5 s
    assert lines == ["step 10/25 loss 0.2500 examples/s 320 version 10 staleness 1",
                     "step 20/25 loss 0.2500 examples/s 320 version 20 staleness 1",
                     "step 25/25 loss 0.2500 examples/s 320 version 25 staleness 1"
                     " (gradient dropped: round finished without it)"]
    assert out.getvalue() == ""  # nothing drawn


def test_off_shows_nothing_per_step(caplog):
    out = FakeTTY()
    obs = Observer(total_steps=3, log_every=1, progress="off", stream=out)
    with caplog.at_level(logging.INFO, logger="worker"):
        for s in range(3):
            obs.step(record(s))
        obs.finish({"test_accuracy": 0.9})
    obs.close()
    assert out.getvalue() == "" and not [r for r in caplog.records if r.getMessage().startswith("step ")]


# TensorBoard.

def _read_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    import tensorflow as tf

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for raw in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(raw.numpy())
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, float(tf.make_ndarray(value.tensor))))
    return scalars


def test_tensorboard_scalars_per_step_per_evaluation_and_at_the_end(tmp_path):
    obs = Observer(worker_index=-1, total_steps=3, progress="off", logdir=str(tmp_path))
    obs.set_index(1)  # learned at registration: the directory is worker1
    for s in range(3):
        obs.step(record(s, loss=[0.9, 0.6, 0.3][s], staleness=s, knob_s=0.5))
    obs.evaluation({"step": 1, "t": 0.2, "version": 2, "test_accuracy": 0.75, "test_loss": 0.625, "eval_s": 0.01})
    obs.finish({"steps": 3, "test_accuracy": 0.875, "test_loss": 0.5})
    obs.close()
    obs.close()  # idempotent
    scalars = _read_scalars(tmp_path / "worker1")
    assert scalars["train/loss"] == [(1, pytest.approx(0.9)), (2, pytest.approx(0.6)), (3, pytest.approx(0.3))]
    assert scalars["train/staleness"] == [(1, 0), (2, 1), (3, 2)]
    assert scalars["time/step_s"] == [(s, pytest.approx(0.56)) for s in (1, 2, 3)]  # 0.01+0.02+0.03+0.5
    assert scalars["time/pull_s"] == [(s, pytest.approx(0.01)) for s in (1, 2, 3)]
    assert scalars["time/compute_s"] == [(s, pytest.approx(0.02)) for s in (1, 2, 3)]
    assert scalars["time/push_s"] == [(s, pytest.approx(0.03)) for s in (1, 2, 3)]
    assert scalars["throughput/examples_per_s"] == [(s, pytest.approx(320)) for s in (1, 2, 3)]
    assert scalars["eval/test_accuracy"] == [(2, 0.75)] and scalars["eval/test_loss"] == [(2, 0.625)]
    assert scalars["final/test_accuracy"] == [(3, 0.875)] and scalars["final/test_loss"] == [(3, 0.5)]
    assert not (tmp_path / "worker-1").exists()


# Prometheus.

def _scrape(port: int) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_on_port_0_count_every_step_fed():
    with Observer(worker_index=2, total_steps=5, progress="off", metrics_port=0) as obs:
        assert obs.metrics_port > 0
        before = _scrape(obs.metrics_port)
        assert before[("tfps_worker_steps_total", (("worker", "2"),))] == 0  # a known index reads 0 at once
        for s in range(5):
            obs.step(record(s, loss=0.125 * (s + 1), batch_size=10, staleness=s % 3, push_s=0.2))
        m = _scrape(obs.metrics_port)
    w = (("worker", "2"),)
    assert m[("tfps_worker_step_seconds_count", w)] == 5
    assert m[("tfps_worker_step_seconds_sum", w)] == pytest.approx(5 * 0.23)
    assert m[("tfps_worker_step_seconds_bucket", (("le", "0.25"), ("worker", "2")))] == 5
    assert m[("tfps_worker_step_seconds_bucket", (("le", "0.1"), ("worker", "2")))] == 0
    for phase, seconds in (("pull", 0.01), ("compute", 0.02), ("push", 0.2)):
        assert m[(f"tfps_worker_{phase}_seconds_count", w)] == 5
        assert m[(f"tfps_worker_{phase}_seconds_sum", w)] == pytest.approx(5 * seconds)
    assert m[("tfps_worker_steps_total", w)] == 5
    assert m[("tfps_worker_examples_total", w)] == 50
    assert m[("tfps_worker_examples_per_second", w)] == pytest.approx(100)  # 10 examples per 0.1 s
    assert m[("tfps_worker_staleness", w)] == 4 % 3
    assert m[("tfps_worker_loss", w)] == 0.625
    assert m[("tfps_worker_last_step", w)] == 5
    with pytest.raises(OSError):  # close stopped the exporter
        _scrape(obs.metrics_port)


def test_observers_have_registries_of_their_own_and_learn_their_index_late():
    a = Observer(worker_index=-1, progress="off", metrics_port=0)
    b = Observer(worker_index=0, progress="off", metrics_port=0)
    try:
        a.set_index(1)
        a.step(record(0))
        labels_a = {labels for name, labels in _scrape(a.metrics_port) if name == "tfps_worker_steps_total"}
        labels_b = {labels for name, labels in _scrape(b.metrics_port) if name == "tfps_worker_steps_total"}
        assert labels_a == {(("worker", "1"),)} and labels_b == {(("worker", "0"),)}
    finally:
        a.close()
        b.close()


def test_a_metrics_port_in_use_is_a_configuration_error():
    with Observer(progress="off", metrics_port=0) as first:
        with pytest.raises(ConfigError, match=f"--metrics-port {first.metrics_port}"):
            Observer(progress="off", metrics_port=first.metrics_port)


def test_no_metrics_port_no_exporter():
    obs = Observer(progress="off", metrics_port=None)
    assert obs.metrics_port == 0 and obs._httpd is None
    obs.close()


def test_tensorflow_is_imported_only_with_a_logdir():
    import subprocess
    import sys

    code = ("import sys; from worker.observe import Observer; o = Observer(total_steps=1, progress='off'); "
            "o.step({'step': 0, 'loss': 1.0, 'batch_size': 1, 'version': 1, 'staleness': 0, 't': 0.1, "
            "'pull_s': 0.0, 'compute_s': 0.0, 'push_s': 0.0}); o.finish({}); o.close(); "
            "assert 'tensorflow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
