"""ps-launch trains the tutorial CNN on digits with one server and two worker processes.

The rule: "ps-launch sync and async, 2 workers, digits, reach test accuracy >= 0.90
within 3 epochs", and the metrics file has the documented keys.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.cluster

KEYS = {"mode", "workers", "steps", "test_accuracy", "final_loss", "wall_s", "examples_per_s"}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_launch_two_workers_reaches_90_percent_on_digits_in_3_epochs(mode, tmp_path):
    metrics = tmp_path / "m.json"
    (tmp_path / "mpl").mkdir()  # a fresh matplotlib cache: Keras imports matplotlib, which builds its font cache
    run = subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", "--mode", mode, "--workers", "2", "--dataset", "digits",
         "--epochs", "3", "--metrics-json", str(metrics)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    m = json.loads(metrics.read_text())
    assert KEYS <= set(m)
    assert m["mode"] == mode and m["workers"] == 2
    assert m["steps"] == 3 * 23  # 1437 training images, global batch 64
    assert m["test_accuracy"] >= 0.90, m
    assert m["examples_per_s"] > 0 and m["wall_s"] > 0
    # Output of every process is relayed with its prefix.
    assert "[ps]" in run.stdout and "[worker 0]" in run.stdout and "[worker 1]" in run.stdout
    if mode == "sync":
        assert m["max_staleness"] == 0
    # The first minutes: one line from the launcher, then the server's own line; no configuration
    # dictionaries, no third-party notices.
    lines = run.stdout.splitlines()
    assert lines[0] == f"ps-launch: {mode}, 2 workers and 1 ps-server on loopback, training cnn on digits", lines[:5]
    first_ps = next(line for line in lines if line.startswith("[ps] "))
    assert re.search(rf"INFO ps_server: {mode}, 2 workers, listening on 127\.0\.0\.1:\d+ "
                     r"\(TLS off, token off, reflection on\)$", first_ps), first_ps
    output = run.stdout + run.stderr
    assert "configuration:" not in output and "fontManager" not in output and "font cache" not in output, \
        [line for line in lines if "configuration:" in line or "font" in line][:3]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def test_launch_stops_everything_and_fails_when_a_worker_dies(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ps_tools.launch", "--mode", "sync", "--workers", "2", "--dataset", "synthetic",
         "--steps", "100000", "--log-every", "5", "--barrier-timeout", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        victim, lines = None, []
        deadline = time.monotonic() + 180
        for line in launcher.stdout:
            lines.append(line)
            m = re.search(r"worker 1 registered \(.*:(\d+)\)", line)
            if m:
                victim = int(m.group(1))
            if victim and "[worker 1]" in line and "step 10/" in line:
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        assert victim, "".join(lines[-30:])
        children = _children(launcher.pid)
        assert len(children) == 3, children  # server and two workers
        os.kill(victim, signal.SIGKILL)
        rest, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 1, "".join(lines[-20:]) + rest[-3000:]
        assert "worker 1 exited with status -9" in rest
        # The launcher waited for every child it started: none is left running.
        assert [c for c in children if os.path.exists(f"/proc/{c}")] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)


def test_launch_bad_flag_is_a_one_line_error():
    run = subprocess.run([sys.executable, "-m", "ps_tools.launch", "--workers", "2", "--global-batch-size", "1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr
    assert "--global-batch-size" in run.stderr


# --shm alone: slow; the second case takes the same fast path, over two shards and in bfloat16
@pytest.mark.parametrize("extra", [pytest.param(("--shm",), marks=pytest.mark.slow),
                                   ("--shm", "--num-ps", "2", "--grad-wire-dtype", "bfloat16")])
def test_launch_with_the_same_host_fast_path_trains_through_shared_memory(extra, tmp_path):
    """The rule: "Same-host fast path ... opt-in, detected": on one host every worker's
    registration probe succeeds and the run trains as well as over gRPC alone."""
    metrics = tmp_path / "m.json"
    run = subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", "--mode", "sync", "--workers", "2", "--dataset", "digits",
         "--epochs", "2", "--metrics-json", str(metrics), *extra],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    m = json.loads(metrics.read_text())
    assert m["test_accuracy"] >= 0.88, m
    shards = 2 if "--num-ps" in extra else 1
    assert run.stdout.count("registered (") >= 2 * shards
    assert run.stdout.count("shared memory on") == run.stdout.count("registered ("), run.stdout[-3000:]
    assert "shared memory off" not in run.stdout + run.stderr


def test_launch_trains_deepcnn_on_a_subset_and_an_epoch_is_the_subset(tmp_path):
    # --train-examples reaches every worker through ps-launch: 130 examples at global batch 64
    # are 3 steps an epoch (64, 64, 2), against digits' 23.
    metrics = tmp_path / "m.json"
    run = subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", "--mode", "sync", "--workers", "2", "--dataset", "digits",
         "--model", "deepcnn", "--train-examples", "130", "--epochs", "2", "--metrics-json", str(metrics)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    m = json.loads(metrics.read_text())
    assert m["steps"] == 2 * 3 and 0.0 <= m["test_accuracy"] <= 1.0
    assert "training deepcnn on digits" in run.stdout.splitlines()[0]
