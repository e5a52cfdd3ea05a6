"""Server restarts with real processes: checkpoints, rejoining workers, export.

    pytest -q tests/chaos/test_server_restart.py

Issue: "Workers reconnect after a server restart and carry on from the restored
version; at most one checkpoint interval of updates is lost, and the log says
how many." And: "The state can be exported as a Keras model file (.keras or
.weights.h5) that keras.models.load_model (or load_weights) opens."

One training run (module fixture ``restart``) serves the tests of the first
sentence: a ps-server writing checkpoints every 0.5 s, two sync workers on
digits for 3 epochs; after a few rounds the server is SIGKILLed and started
again on the same port with the same checkpoint directory. When training has
finished the server gets SIGTERM (final checkpoint), is started once more to
show it restores that version, and the result is exported with ps-export, from
the checkpoint and from the live server, and loaded by Keras in a fresh
process. The other tests drive a ps-server from the test with a PSClient (no
TensorFlow) and check SIGTERM, a damaged checkpoint and a mismatched mode.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ps_common.ports import free_port  # noqa: F401  (the other chaos tests import it from here)
from ps_server.core.checkpoint import latest_valid, list_checkpoints
from ps_server.core.optim.optimizers import OptimizerSpec
from tests.cluster.conftest import Procs, read_log, wait_exit
from tests.withheld import messages_withheld
from worker.client import PSClient

pytestmark = [pytest.mark.chaos, pytest.mark.cluster]

INTERVAL = 0.5  # --checkpoint-interval
KILL_AT_VERSION = 12
# How late a checkpoint may be beyond its interval on a loaded machine (scheduling, fsync).
SLACK_S = 0.5
WORKER_FLAGS = ("--dataset", "digits", "--epochs", "3", "--reconnect-timeout", "60", "--log-every", "5")
QUIET_TF = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0"}


def start_server(procs: Procs, port: int, ckpt_dir, log_name: str, mode: str = "sync", num_workers: int = 2,
                 interval: float = INTERVAL, ready: bool = True):
    proc = procs.start(
        [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", str(port), "--mode", mode,
         "--num-workers", str(num_workers), "--checkpoint-dir", str(ckpt_dir),
         "--checkpoint-interval", str(interval)],
        log_name,
    )
    if ready:
        with PSClient(f"127.0.0.1:{port}") as client:
            try:
                client.wait_ready(60)
            except Exception:
                pytest.fail(f"ps-server {log_name} not serving; log:\n{read_log(proc)[-3000:]}")
    return proc


def stop_with_sigterm(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    code = wait_exit(proc, 30)
    log = read_log(proc)
    assert code == 0, log[-3000:]
    return log


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, **QUIET_TF)
    env.pop("TF_CONFIG", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


# -- one run: kill, restart, finish, SIGTERM, restore, export ------------------------------
@pytest.fixture(scope="module")
def restart(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    procs = Procs(tmp)
    try:
        # Its tests are marked recovery: the scenario runs with the refusals' text withheld
        # (module-scoped, it starts before their own fixture), and only the scenario does.
        with messages_withheld():
            run = _restart_scenario(procs, tmp)
        yield run
    finally:
        procs.stop_all()


def _restart_scenario(procs: Procs, tmp) -> dict:
    port, ckpt = free_port(), tmp / "ckpt"
    address = f"127.0.0.1:{port}"
    run: dict = {"ckpt": ckpt, "tmp": tmp}
    ps1 = start_server(procs, port, ckpt, "ps1")
    w1 = procs.worker(address, 1, 2, *WORKER_FLAGS)
    w0 = procs.worker(address, 0, 2, *WORKER_FLAGS, "--result-json", str(tmp / "result.json"))
    run["workers"] = (w0, w1)

    samples: list[tuple[float, int]] = []  # (monotonic time, version) seen before the kill
    with PSClient(address) as client:
        deadline = time.monotonic() + 240
        while True:
            version = client.status().version
            samples.append((time.monotonic(), version))
            fresh = [p for p in list_checkpoints(str(ckpt)) if not p.endswith("ckpt-000000000000.tfps")]
            if version >= KILL_AT_VERSION and fresh:
                break
            assert w0.poll() is None and w1.poll() is None, read_log(w0)[-3000:] + read_log(w1)[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.01)
    ps1.kill()
    run["killed_at"], run["killed_wall"] = time.monotonic(), time.time()
    ps1.wait(timeout=30)
    run["version_before_kill"] = samples[-1][1]
    run["samples"] = samples
    newest = latest_valid(str(ckpt))
    assert newest is not None
    run["on_disk"], run["on_disk_path"] = newest[0].version, newest[1]
    run["on_disk_mtime"] = os.stat(newest[1]).st_mtime

    ps2 = start_server(procs, port, ckpt, "ps2")
    run["worker_codes"] = (wait_exit(w0, 180), wait_exit(w1, 60))
    with PSClient(address) as client:
        run["version_at_sigterm"] = client.status().version
    run["ps1_log"], run["ps2_log"] = read_log(ps1), stop_with_sigterm(ps2)

    ps3 = start_server(procs, port, ckpt, "ps3")
    with PSClient(address) as client:
        status = client.status()
        run["ps3_status"] = (status.version, status.round, status.last_checkpoint_version)
    model, live = tmp / "model.keras", tmp / "live.weights.h5"
    exports = [
        procs.start([sys.executable, "-m", "ps_tools.export", "--checkpoint", str(ckpt), "--model", "cnn",
                     "--out", str(model)], "export-checkpoint"),
        procs.start([sys.executable, "-m", "ps_tools.export", "--from-server", address, "--model", "cnn",
                     "--out", str(live)], "export-live"),
    ]
    run["export_codes"] = [wait_exit(p, 120) for p in exports]
    run["export_logs"] = [read_log(p) for p in exports]
    run["ps3_log"] = stop_with_sigterm(ps3)
    run["model"], run["live"] = model, live
    return run


@pytest.mark.recovery
def test_workers_rejoin_a_restarted_server_and_reach_the_accuracy_of_an_undisturbed_run(restart):
    w0, w1 = restart["workers"]
    logs = read_log(w0) + read_log(w1)
    assert restart["worker_codes"] == (0, 0), logs[-4000:]
    result = json.loads((restart["tmp"] / "result.json").read_text())
    assert result["steps"] == result["version"] == 69  # 3 epochs of 23 rounds, each applied once
    assert result["test_accuracy"] >= 0.90, result
    assert "the server restarted" in logs
    assert "Traceback" not in logs


@pytest.mark.recovery
def test_restarted_server_restores_the_newest_checkpoint_and_says_so(restart):
    log = restart["ps2_log"]
    v = restart["on_disk"]
    assert 0 < v <= restart["version_before_kill"] + 1
    assert f"restored version {v} (round {v}) from {restart['on_disk_path']}" in log, log[:3000]
    assert "2 worker(s) known" in log


@pytest.mark.recovery
def test_at_most_one_interval_of_updates_is_lost_and_workers_say_how_many(restart):
    # The newest checkpoint was at most one interval old when the server died ...
    age = restart["killed_wall"] - restart["on_disk_mtime"]
    assert age <= INTERVAL + SLACK_S, age
    # ... so the rounds lost are those of at most one interval (plus the round in flight).
    t_kill = restart["killed_at"]
    window = [v for t, v in restart["samples"] if t >= t_kill - INTERVAL - SLACK_S]
    rounds_in_an_interval = window[-1] - window[0] if window else 0
    v = restart["on_disk"]
    w0, w1 = restart["workers"]
    reports = re.findall(r"resuming at round (\d+), (\d+) step\(s\) of updates were lost", read_log(w0) + read_log(w1))
    assert reports, read_log(w0)[-3000:]
    for round_, lost in ((int(r), int(n)) for r, n in reports):
        assert round_ == v
        # The worker's step when it lost the server is the round then in progress, or, when the
        # kill fell between a round's completion and its reply, the round that just completed
        # (the worker never saw it: one fewer than the server had).
        assert restart["version_before_kill"] - v - 1 <= lost <= restart["version_before_kill"] - v + 2, \
            (lost, restart["version_before_kill"], v)
        assert lost <= rounds_in_an_interval + 2, (lost, rounds_in_an_interval)


@pytest.mark.recovery
def test_sigterm_writes_a_final_checkpoint_that_the_next_start_restores(restart):
    v = restart["version_at_sigterm"]
    assert v == 69
    assert re.search(rf"final checkpoint: version {v} \(round {v}\) written to \S+ in \d+ ms", restart["ps2_log"])
    assert f"restored version {v} (round {v})" in restart["ps3_log"]
    assert restart["ps3_status"] == (v, v, v)


@pytest.mark.recovery
def test_ps_export_output_loads_with_keras_and_reproduces_the_chiefs_test_accuracy(restart):
    assert restart["export_codes"] == [0, 0], restart["export_logs"]
    assert "from " + str(restart["ckpt"]) in restart["export_logs"][0]
    result = json.loads((restart["tmp"] / "result.json").read_text())
    code = f"""
import json, keras
from worker import model as models
from worker.data import load_dataset
models.tf_setup(deterministic=True)
data = load_dataset("digits")
loaded = keras.models.load_model({str(restart["model"])!r})
_, acc_keras = models.evaluate(loaded, data.x_test, data.y_test)
metrics = loaded.evaluate(data.x_test, data.y_test, verbose=0, return_dict=True)
plain = models.build_model("cnn")
plain.load_weights({str(restart["live"])!r})
_, acc_weights = models.evaluate(plain, data.x_test, data.y_test)
print(json.dumps({{"keras": acc_keras, "weights": acc_weights, "compiled": metrics["accuracy"],
                  "optimizer": type(loaded.optimizer).__name__, "iterations": int(loaded.optimizer.iterations.numpy())}}))
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["keras"] == got["weights"] == result["test_accuracy"], (got, result)
    assert abs(got["compiled"] - result["test_accuracy"]) < 1e-6
    assert got["optimizer"] == "Adam" and got["iterations"] == 69


# -- a server driven by hand: no TensorFlow ------------------------------------------------------
def _train_by_hand(address: str, steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    with PSClient(address) as client:
        client.register(0, 1)
        client.initialize(0, {"w": rng.standard_normal((3, 2)).astype(np.float32), "b": np.zeros(2, np.float32)},
                          OptimizerSpec("adam", learning_rate=0.01).as_dict())
        for step in range(steps):
            version, values = client.pull(0)
            client.push(0, step, version, 4, {n: rng.standard_normal(a.shape).astype(a.dtype)
                                              for n, a in values.items()})
        return client.pull(0)[1]


def test_sigterm_writes_a_final_checkpoint_with_every_acknowledged_update(procs, tmp_path):
    port, ckpt = free_port(), tmp_path / "ckpt"
    server = start_server(procs, port, ckpt, "first", num_workers=1, interval=3600)  # never periodic here
    values = _train_by_hand(f"127.0.0.1:{port}", 5)
    assert list_checkpoints(str(ckpt)) == []
    log = stop_with_sigterm(server)
    assert "final checkpoint: version 5 (round 5)" in log, log[-2000:]
    assert [os.path.basename(p) for p in list_checkpoints(str(ckpt))] == ["ckpt-000000000005.tfps"]

    (ckpt / "ckpt-000000000007.tfps").write_bytes(b"half a checkpoint")  # a damaged newer file
    again = start_server(procs, port, ckpt, "second", num_workers=1, interval=3600)
    with PSClient(f"127.0.0.1:{port}") as client:
        status = client.status()
        assert (status.version, status.round, status.initialized) == (5, 5, True)
        assert status.last_checkpoint_version == 5 and status.checkpoint_age_s >= 0
        version, restored = client.pull()
        assert all(restored[n].tobytes() == values[n].tobytes() for n in values)
        reg = client.register(0, 1)
        assert (reg.initialized, reg.round) == (True, 5)
        assert client.push(0, 5, 5, 4, {n: np.ones_like(a) for n, a in values.items()}).version == 6
    log = stop_with_sigterm(again)
    assert re.search(r"WARNING ps_server.checkpoint: skipping checkpoint \S+ckpt-000000000007.tfps: "
                     r"not a tfps checkpoint \(bad magic\)", log), log[:3000]
    assert "restored version 5 (round 5)" in log and "final checkpoint: version 6" in log


def test_a_checkpoint_of_another_mode_stops_the_server_with_a_clear_error(procs, tmp_path):
    port, ckpt = free_port(), tmp_path / "ckpt"
    server = start_server(procs, port, ckpt, "sync1", num_workers=1, interval=3600)
    _train_by_hand(f"127.0.0.1:{port}", 2)
    stop_with_sigterm(server)
    wrong = start_server(procs, port, ckpt, "async1", mode="async", num_workers=1, ready=False)
    assert wait_exit(wrong, 60) == 2
    error = read_log(wrong).strip().splitlines()[-1]
    assert error.startswith("ps-server: error: cannot restore ") and "ckpt-000000000002.tfps" in error, error
    assert "written by a sync server with 1 worker(s); this server runs async with 1" in error, error


def test_export_refuses_a_model_whose_variables_differ_and_lists_the_differences():
    """ps-export: "Names or shapes that do not match are an error that lists the differences"."""
    from ps_tools.export import ExportError, assign

    class Var:
        def __init__(self, path, shape):
            self.path, self.shape, self.assigned = path, shape, None

        def assign(self, value):
            self.assigned = value

    class Model:
        trainable_variables = [Var("cnn/dense/kernel", (5, 10)), Var("cnn/dense/bias", (10,))]

    model = Model()
    with pytest.raises(ExportError) as e:
        assign(model, {"cnn/dense/kernel": np.zeros((4, 10)), "mlp/dense/bias": np.zeros(10)})
    message = str(e.value)
    assert "cnn/dense/kernel is [5, 10] in the model but [4, 10] in the source" in message
    assert "cnn/dense/bias [10] is not in the source" in message and "mlp/dense/bias [10] is not in the model" in message
    assert all(v.assigned is None for v in model.trainable_variables)  # nothing half-assigned
