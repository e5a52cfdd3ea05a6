"""Your own model through the API and the CLI (issue: bring your own model; worker.task, worker.api).

Real processes on loopback: ps-launch with ``--model examples.recommender:build_model
--dataset examples.recommender:make_dataset`` (three inputs, two embedding tables,
BatchNorm), scraped while it runs; and examples/custom_loop.py, a hand-written
GradientTape step, as two worker processes against a ps-server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

from ps_common.ports import free_ports
from ps_common.procs import dying_with_parent
from tests.cluster.conftest import ROOT as REPO
from tests.cluster.conftest import read_log, wait_exit

pytestmark = pytest.mark.cluster


def _scrape(port: int) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    return {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def _value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    for name, got, value in families.get(family, []):
        if (sample is None or name == sample) and all(got.get(k) == v for k, v in labels.items()):
            return value
    raise KeyError(f"{family} {sample or ''} {labels} not in the scrape")


@pytest.fixture(scope="module")
def recommender_run(tmp_path_factory):
    """One sync run of the example with 2 workers, its server and chief scraped mid-run."""
    tmp = tmp_path_factory.mktemp("recommender")
    port = free_ports(3, consecutive=True)[0]  # server P, worker 0 P+1, worker 1 P+2
    argv = [sys.executable, "-m", "ps_tools.launch", "--mode", "sync", "--workers", "2",
            "--model", "examples.recommender:build_model", "--dataset", "examples.recommender:make_dataset",
            "--epochs", "6", "--global-batch-size", "256", "--learning-rate", "0.01",
            "--save-model", str(tmp / "model.keras"), "--metrics-json", str(tmp / "m.json"),
            "--metrics-port", str(port), "--logdir", str(tmp / "tb"),
            "--worker-args", "0", f"--history-json {tmp / 'h0.json'}"]
    scrapes: dict[str, dict] = {}
    stop = threading.Event()

    def scraper():  # keep the first scrape taken once training is under way (20 steps of 750)
        while "server" not in scrapes and not stop.wait(0.25):
            try:
                server, chief = _scrape(port), _scrape(port + 1)
            except (OSError, ValueError):
                continue
            try:
                if _value(chief, "tfps_worker_steps", "tfps_worker_steps_total", worker="0") >= 20:
                    scrapes["server"], scrapes["chief"] = server, chief
            except KeyError:
                pass

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    try:
        proc = subprocess.run(dying_with_parent(argv), cwd=REPO, capture_output=True, text=True, timeout=420)
    finally:
        stop.set()
        thread.join(5)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, json.loads((tmp / "m.json").read_text()), scrapes, proc.stdout + proc.stderr


def test_a_model_with_three_inputs_two_embeddings_and_batchnorm_trains_from_module_function_flags(recommender_run):
    _, metrics, _, _ = recommender_run
    assert metrics["test_accuracy"] >= 0.85, metrics
    assert metrics["steps"] == 6 * 125


def test_embedding_gradients_travel_as_rows_measured_on_the_wire(recommender_run):
    """Each push carries the touched rows of the 1000x8 and 400x8 tables, not the tables:
    what the worker records, and what the server's byte counter received."""
    from examples.recommender import DIM, NUM_ITEMS, NUM_USERS

    tmp, metrics, scrapes, _ = recommender_run
    steps = json.loads((tmp / "h0.json").read_text())["steps"]
    tables = (NUM_USERS + NUM_ITEMS) * DIM * 4
    dense_push = tables + 52 * 4 + 28 * 64 * 4 + 64 * 4 + 64 * 4 + 4 + 4 * 4 * 4  # + the dense layers, BN
    pushed = np.mean([s["push_bytes"] for s in steps])
    # 128 examples per worker touch at most 128 rows of each table: 128 * (8 * 4 + 8) bytes each
    assert pushed < 2 * 128 * (DIM * 4 + 8) + (dense_push - tables) + 1000, pushed
    assert pushed < 0.45 * dense_push
    server = scrapes["server"]
    received = sum(v for name, labels, v in server["tfps_received_bytes"]
                   if name == "tfps_received_bytes_total" and labels.get("method", "").startswith(("Push", "Session")))
    pushes = _value(server, "tfps_pushes_applied", "tfps_pushes_applied_total")
    assert pushes >= 20
    assert received / pushes < 0.45 * dense_push, (received, pushes)


def test_the_metrics_endpoints_answer_mid_run_with_the_listed_series(recommender_run):
    _, _, scrapes, _ = recommender_run
    server, chief = scrapes["server"], scrapes["chief"]
    rounds = _value(server, "tfps_rounds_completed", "tfps_rounds_completed_total")
    assert 10 <= rounds <= 750
    assert _value(server, "tfps_live_workers") == 2
    assert _value(server, "tfps_push_staleness_versions", "tfps_push_staleness_versions_count") >= rounds
    assert _value(server, "tfps_apply_seconds", "tfps_apply_seconds_count") >= rounds - 1
    for worker in ("0", "1"):
        assert _value(server, "tfps_worker_wait_seconds", worker=worker) >= 0
    assert _value(server, "tfps_pushes_dropped", "tfps_pushes_dropped_total") == 0
    steps = _value(chief, "tfps_worker_steps", "tfps_worker_steps_total", worker="0")
    assert steps >= 20
    assert _value(chief, "tfps_worker_step_seconds", "tfps_worker_step_seconds_count", worker="0") == steps
    assert _value(chief, "tfps_worker_examples_per_second", worker="0") > 0
    assert _value(chief, "tfps_worker_push_seconds", "tfps_worker_push_seconds_count", worker="0") == steps


def test_each_worker_writes_tensorboard_summaries_under_logdir(recommender_run):
    tmp, metrics, _, _ = recommender_run
    script = f"""
import glob, json, tensorflow as tf
out = {{}}
for worker in ("worker0", "worker1"):
    tags = {{}}
    for path in glob.glob({str(tmp / "tb")!r} + "/" + worker + "/events.out.tfevents.*"):
        for raw in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(raw.numpy())
            for v in event.summary.value:
                tags[v.tag] = tags.get(v.tag, 0) + 1
    out[worker] = tags
print(json.dumps(out))
"""
    got = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert got.returncode == 0, got.stderr[-3000:]
    tags = json.loads(got.stdout.strip().splitlines()[-1])
    for worker in ("worker0", "worker1"):
        for tag in ("train/loss", "train/staleness", "time/step_s", "time/push_s", "throughput/examples_per_s"):
            assert tags[worker].get(tag) == metrics["steps"], (worker, tag, tags[worker])
    assert tags["worker0"].get("final/test_accuracy") == 1


def test_the_saved_model_loads_and_reproduces_the_reported_accuracy_with_the_servers_batchnorm_statistics(
        recommender_run):
    tmp, metrics, _, _ = recommender_run
    script = f"""
import json, keras, numpy as np
from examples.recommender import make_dataset
model = keras.models.load_model({str(tmp / 'model.keras')!r})
_, test = make_dataset()
acc = keras.metrics.BinaryAccuracy()
for x, y in test:
    acc.update_state(y[:, None], model(x, training=False))
mean = np.asarray(model.get_layer("feature_norm").moving_mean)
print(json.dumps({{"accuracy": float(acc.result()), "moving_mean": mean.tolist()}}))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(got["accuracy"] - metrics["test_accuracy"]) < 1e-6
    # the server kept BatchNorm's moving statistics: the ages (normal, mean 40) are there
    assert abs(got["moving_mean"][1] - 40.0) < 3.0, got["moving_mean"]


def test_a_hand_written_gradient_tape_step_trains_through_the_session(procs):
    """examples/custom_loop.py, two workers against a sync ps-server: every round applied once."""
    server, address = procs.server("sync", 2, extra=("--exit-when-done",))
    script = os.path.join(REPO, "examples", "custom_loop.py")
    workers = [procs.start([sys.executable, script, "--ps", address, "--worker-index", str(i), "--num-workers", "2",
                            "--epochs", "3"], f"worker{i}") for i in range(2)]
    for w in workers:
        assert wait_exit(w, 400) == 0, read_log(w)[-3000:]
    chief, other = read_log(workers[0]), read_log(workers[1])
    assert float(chief.rsplit("test_accuracy=", 1)[1].split()[0]) >= 0.7, chief[-2000:]
    assert "server version 375" in chief and "server version 375" in other  # 3 epochs x 125 rounds
    assert wait_exit(server, 60) == 0  # --exit-when-done: both workers left
