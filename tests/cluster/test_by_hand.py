"""The three processes started by hand, with the installed console scripts.

The rule: "ps-server plus two ps-worker started by hand train as well", and bad
flags, an unreachable server or a mismatched configuration give a one-line
error and a non-zero exit, not a traceback.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.cluster.conftest import port_of, read_log, wait_exit

pytestmark = pytest.mark.cluster

BIN = os.path.dirname(sys.executable)


def script(name: str) -> str:
    path = os.path.join(BIN, name)
    return path if os.path.exists(path) else shutil.which(name)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if ": error:" in line]


def test_server_and_two_workers_started_by_hand_train_digits_to_90_percent(procs, tmp_path):
    port_file = tmp_path / "port"
    # DEBUG: the resolved configuration and the allocator's note are logged at that level.
    server = procs.start([script("ps-server"), "--mode", "async", "--num-workers", "2", "--port", "0",
                          "--port-file", str(port_file), "--log-level", "DEBUG"], "ps")
    address = f"127.0.0.1:{port_of(server, port_file)}"
    result = tmp_path / "result.json"
    common = ["--ps", address, "--num-workers", "2", "--dataset", "digits", "--epochs", "3", "--log-level", "DEBUG"]
    w0 = procs.start([script("ps-worker"), *common, "--worker-index", "0", "--result-json", str(result)], "worker0")
    w1 = procs.start([script("ps-worker"), *common, "--worker-index", "1"], "worker1")
    assert wait_exit(w0, 600) == 0, read_log(w0)[-3000:]
    assert wait_exit(w1, 600) == 0, read_log(w1)[-3000:]
    metrics = json.loads(result.read_text())
    assert metrics["mode"] == "async" and metrics["test_accuracy"] >= 0.90, metrics
    assert "test_accuracy=" in read_log(w0)
    # Started by hand, without ps-launch's environment, both tune the allocator themselves.
    for p in (server, w0, w1):
        assert "allocator: glibc tuned for large buffers" in read_log(p), read_log(p)[:2000]
    # The server's first INFO line says what it is; its resolved configuration is at DEBUG.
    lines = read_log(server).splitlines()
    info = [line for line in lines if " INFO " in line]
    assert info[0].endswith(f"INFO ps_server: async, 2 workers, listening on {address} "
                            "(TLS off, token off, reflection on)"), info[:3]
    (config,) = [line.split("configuration: ", 1)[1] for line in lines if " DEBUG ps_server: configuration: " in line]
    assert {k: v for k, v in json.loads(config).items() if k in ("mode", "num_workers", "port")} == \
        {"mode": "async", "num_workers": 2, "port": 0}
    server.send_signal(15)
    assert wait_exit(server, 30) == 0, read_log(server)


def test_worker_with_unreachable_server_fails_with_one_line_error():
    run = subprocess.run([script("ps-worker"), "--ps", "127.0.0.1:1", "--connect-timeout", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert _error_lines(run.stderr) == [
        "ps-worker: error: worker 0: cannot reach the parameter server at 127.0.0.1:1 within "
        "--connect-timeout 1 s: is ps-server running there?"
    ]


def test_worker_with_mismatched_worker_count_fails_with_one_line_error(procs):
    server, address = procs.server("sync", num_workers=2)
    run = subprocess.run([script("ps-worker"), "--ps", address, "--num-workers", "3", "--worker-index", "0",
                          "--dataset", "synthetic"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    errors = _error_lines(run.stderr)
    assert len(errors) == 1 and "--num-workers 3" in errors[0] and "server runs with 2" in errors[0], run.stderr


@pytest.mark.parametrize("argv, expected", [
    (["ps-server", "--mode", "bulk"], "invalid choice"),
    (["ps-server", "--num-workers", "0"], "--num-workers must be >= 1"),
    (["ps-server", "--port", "70000"], "--port must be in 0..65535"),
    (["ps-worker", "--ps", "nohost"], "--ps must be HOST:PORT"),
    (["ps-worker", "--worker-index", "2", "--num-workers", "2"], "--worker-index must be in 0..1"),
    (["ps-worker", "--global-batch-size", "0"], "--global-batch-size"),
    (["ps-launch", "--workers", "0"], "--workers must be >= 1"),
])
def test_bad_flags_give_one_line_error_and_exit_2(argv, expected):
    run = subprocess.run([script(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = _error_lines(run.stderr)
    assert len(errors) == 1 and expected in errors[0], run.stderr


def test_server_port_in_use_is_a_one_line_error(procs):
    server, address = procs.server("sync", 1)
    port = address.rsplit(":", 1)[1]
    run = subprocess.run([script("ps-server"), "--port", port], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert len(_error_lines(run.stderr)) == 1 and port in run.stderr


def test_tf_config_names_the_server_and_the_worker_index(procs, tmp_path):
    server, address = procs.server("sync", num_workers=1)
    tf_config = json.dumps({"cluster": {"ps": [address], "worker": ["127.0.0.1:1"]},
                            "task": {"type": "worker", "index": 0}})
    result = tmp_path / "r.json"
    run = subprocess.run([script("ps-worker"), "--dataset", "synthetic", "--steps", "3", "--result-json", str(result)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TF_CONFIG": tf_config})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(result.read_text())["steps"] == 3


def test_auto_index_workers_and_a_server_that_exits_when_they_are_done(procs, tmp_path):
    """As under `docker compose --scale worker=2`: identical workers, indexes from the
    server; the server checkpoints and exits 0 once both left, the chief having left last."""
    ckpt = tmp_path / "ckpt"
    server, address = procs.server("sync", num_workers=2, extra=("--exit-when-done", "--checkpoint-dir", str(ckpt)))
    result = tmp_path / "result.json"
    common = [sys.executable, "-m", "worker", "--ps", address, "--num-workers", "2", "--worker-index", "auto",
              "--dataset", "synthetic", "--steps", "6", "--result-json", str(result),
              "--save-weights", str(tmp_path / "w.npz"), "--save-model", str(tmp_path / "model.keras")]
    workers = [procs.start(common, f"auto{i}") for i in range(2)]
    for w in workers:
        assert wait_exit(w, 300) == 0, read_log(w)[-3000:]
    logs = [read_log(w) for w in workers]
    assigned = sorted(int(line.split("registered as worker ")[1].split()[0])
                      for log in logs for line in log.splitlines() if "registered as worker" in line)
    assert assigned == [0, 1], logs
    assert all("(index assigned by the server)" in log for log in logs)
    chief = logs[0] if "worker0:" in logs[0] else logs[1]
    assert "test_accuracy=" in chief  # only the chief evaluates and writes the result
    assert json.loads(result.read_text())["steps"] == 6
    # The chief's Keras file holds the server's final parameters.
    import keras
    import numpy as np

    model = keras.models.load_model(tmp_path / "model.keras")
    from worker.model import load_npz

    saved = load_npz(str(tmp_path / "w.npz"))  # server names: the model's name, then each variable's path
    assert len(saved) == len(model.trainable_variables)
    for v in model.trainable_variables:
        (name,) = [n for n in saved if n == v.path or n.endswith("/" + v.path)]
        np.testing.assert_array_equal(v.numpy(), saved[name])
    assert wait_exit(server, 30) == 0, read_log(server)[-3000:]
    log = read_log(server)
    assert "every worker is done (finished: [0, 1], declared dead: none): exiting (--exit-when-done)" in log, log
    assert "final checkpoint: version 6" in log, log


@pytest.mark.parametrize("argv, expected", [
    (["ps-server", "--mode", "ssp"], {"mode": "ssp", "num_workers": 3, "shm": False}),
    (["ps-worker", "--dataset", "synthetic"], {"dataset": "synthetic", "num_workers": 3, "shm": True}),
    (["ps-launch", "--workers", "3"], {"servers": 1, "workers": 3}),
])
def test_print_config_prints_the_resolved_configuration_as_json_and_exits_0(argv, expected):
    env = {**os.environ, "TFPS_NUM_WORKERS": "3", "TFPS_SERVER_SHM": "0", "TFPS_WORKER_SHM": "1"}
    env.pop("TF_CONFIG", None)
    run = subprocess.run([script(argv[0]), *argv[1:], "--print-config"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    doc = json.loads(run.stdout)
    if argv[0] == "ps-launch":
        assert {"servers": len(doc["servers"]), "workers": len(doc["workers"])} == expected
        assert [w["worker_index"] for w in doc["workers"]] == [0, 1, 2] and doc["servers"][0]["num_workers"] == 3
    else:
        assert {k: doc[k] for k in expected} == expected
