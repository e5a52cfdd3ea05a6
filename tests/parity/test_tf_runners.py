"""TensorFlow's own strategies compute the same bits as the one-process oracle.

NOTES-tensorflow.md: "Two hand-written replicas (GradientTape on each half,
averaged) plus a Keras optimizer are bit-identical to MirroredStrategy after 1
and 20 steps, SGD and Adam ... provided both sides use the same settings", and
"Averaging per-replica means inside MirroredStrategy (wrong scaling) shows up
as a ... weight difference at step 1: a parity check must catch it."

Every runner runs through its CLI in a fresh interpreter, as ``ps-parity``
runs it, from one initial-weights file. MultiWorkerMirroredStrategy runs
inside ``isolation.isolated`` so its 0.0.0.0 listeners never face the network.
Runs are cached per module: each (runner, spec) trains once.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from tf_strategies import common, isolation

pytestmark = pytest.mark.parity

RUNNER_TIMEOUT_S = 300


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    return env


def run_cli(runner: str, spec: common.RunSpec, out, *extra: str, timeout: float = RUNNER_TIMEOUT_S):
    argv = [sys.executable, "-m", f"tf_strategies.{runner}", "--spec-json", spec.to_json(), "--out", str(out), *extra]
    if runner == "mwms":
        argv, _ = isolation.isolated(argv)
    env = dict(_env(), TMPDIR=str(os.path.dirname(str(out))))  # a failed launcher leaves its logs there
    return subprocess.run(isolation.dying_with_parent(argv), capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def base_spec(tmp_path_factory) -> common.RunSpec:
    spec = common.RunSpec(model="cnn", dataset="digits", steps=3, global_batch_size=64, optimizer="sgd",
                          learning_rate=0.01, seed=0, num_workers=2, intra_op_threads=1, deterministic=True)
    path = str(tmp_path_factory.mktemp("init") / "initial.npz")
    made = subprocess.run(
        [sys.executable, "-c", "import sys; from tf_strategies import common; "
         "common.write_initial_weights(common.RunSpec.from_json(sys.argv[1]), sys.argv[2])", spec.to_json(), path],
        capture_output=True, text=True, timeout=120, env=_env(),
    )
    assert made.returncode == 0, made.stderr[-3000:]
    return dataclasses.replace(spec, initial_weights=path)


@pytest.fixture(scope="module")
def train(tmp_path_factory, base_spec):
    cache: dict[tuple[str, str], common.RunResult] = {}

    def train(runner: str, **changes) -> common.RunResult:
        spec = dataclasses.replace(base_spec, **changes)
        key = (runner, spec.to_json())
        if key not in cache:
            out = tmp_path_factory.mktemp(runner)
            started = time.monotonic()
            done = run_cli(runner, spec, out)
            assert done.returncode == 0, f"{runner} exited {done.returncode}:\n{done.stderr[-3000:]}"
            result = common.load_result(str(out))
            print(f"{runner} {changes}: {time.monotonic() - started:.1f} s, {result.steps_per_s:.1f} steps/s")
            cache[key] = result
        return cache[key]

    return train


def assert_bit_identical(a: common.RunResult, b: common.RunResult) -> None:
    step1 = common.max_abs_diff(a.weights_step1, b.weights_step1)
    final = common.max_abs_diff(a.weights_final, b.weights_final)
    assert (step1, final) == (0.0, 0.0), f"{a.runner} vs {b.runner}: step 1 {step1:.3g}, final {final:.3g}"
    assert a.losses == b.losses
    assert a.test_accuracy == b.test_accuracy


# adam: the same runners and check as sgd (Adam's maths against Keras: tests/core/test_optimizers.py)
@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adam", marks=pytest.mark.slow)])
def test_oracle_and_mirrored_are_bit_identical_after_step_1_and_3(train, base_spec, optimizer):
    lr = {"sgd": 0.01, "adam": 0.001}[optimizer]
    oracle = train("oracle", optimizer=optimizer, learning_rate=lr)
    mirrored = train("mirrored", optimizer=optimizer, learning_rate=lr)
    assert_bit_identical(oracle, mirrored)

    initial = common.load_initial_weights(base_spec.initial_weights)
    assert [w.shape for w in oracle.weights_final] == [w.shape for w in initial]
    assert common.max_abs_diff(oracle.weights_step1, initial) > 0.0  # it did train
    assert len(oracle.losses) == 3 and oracle.examples == 3 * 64
    assert 0.0 <= oracle.test_accuracy <= 1.0 and oracle.steps_per_s > 0.0 and oracle.wall_s > 0.0


@pytest.mark.cluster
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mwms_and_mirrored_are_bit_identical_after_step_1_and_3(train, optimizer):
    lr = {"sgd": 0.01, "adam": 0.001}[optimizer]
    assert_bit_identical(train("mwms", optimizer=optimizer, learning_rate=lr),
                         train("mirrored", optimizer=optimizer, learning_rate=lr))


def test_wrong_local_mean_doubles_the_first_step_and_parity_sees_it(train, base_spec):
    # Two equal shards of 32: summing local means is twice the global mean, so
    # the wrong first step is exactly twice the right one. Its distance from the
    # right weights is lr * max|g| (7.4e-4 for this model, data and seed),
    # four orders of magnitude above any rounding a parity check tolerates.
    right = train("mirrored").weights_step1
    wrong = train("mirrored", steps=1, loss_scaling="wrong-local-mean").weights_step1
    initial = common.load_initial_weights(base_spec.initial_weights)
    assert common.max_abs_diff(wrong, right) > 1e-4
    twice_right = [w0 + 2.0 * (w - w0) for w0, w in zip(initial, right)]
    assert common.max_abs_diff(wrong, twice_right) < 1e-7


def _marked_spec(base_spec, tmp_path, name: str, **changes) -> tuple[common.RunSpec, str]:
    """A spec whose text (in every worker's command line) is unique to this test."""
    marker = str(tmp_path / name)
    os.link(base_spec.initial_weights, marker)
    return dataclasses.replace(base_spec, initial_weights=marker, **changes), marker


def _pids_with(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker.encode() in cmdline and b"--role\0worker" in cmdline:
            pids.append(int(pid))
    return pids


def _catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (15 - 1)))


@pytest.mark.cluster
def test_mwms_launcher_kills_every_worker_when_its_deadline_passes(base_spec, tmp_path):
    spec, marker = _marked_spec(base_spec, tmp_path, "deadline-init.npz")
    started = time.monotonic()
    done = run_cli("mwms", spec, tmp_path / "out", "--timeout", "1", timeout=60)
    assert done.returncode != 0
    assert "did not finish within 1 s" in done.stderr, done.stderr[-3000:]
    assert time.monotonic() - started < 30
    assert not _pids_with(marker), "workers outlived the launcher"


@pytest.mark.cluster
def test_mwms_workers_die_with_a_killed_launcher_although_tensorflow_catches_sigterm(base_spec, tmp_path):
    spec, marker = _marked_spec(base_spec, tmp_path, "orphan-init.npz", steps=1_000_000)
    argv, _ = isolation.isolated([sys.executable, "-m", "tf_strategies.mwms", "--spec-json", spec.to_json(),
                                  "--out", str(tmp_path / "out")])
    launcher = subprocess.Popen(isolation.dying_with_parent(argv), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=dict(_env(), TMPDIR=str(tmp_path)))
    try:
        deadline = time.monotonic() + 120
        while True:  # until both workers have joined the cluster (TensorFlow then catches SIGTERM)
            workers = _pids_with(marker)
            try:
                if len(workers) == 2 and all(_catches_sigterm(p) for p in workers):
                    break
            except (OSError, StopIteration):
                pass
            assert launcher.poll() is None, "launcher exited early"
            assert time.monotonic() < deadline, "workers did not join the cluster in 120 s"
            time.sleep(0.2)
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pids_with(marker), "workers outlived a killed launcher"
    finally:
        for pid in _pids_with(marker):  # only this test's workers
            os.kill(pid, 9)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_all_three_runners_are_bit_identical_after_20_steps(train, optimizer):
    lr = {"sgd": 0.01, "adam": 0.001}[optimizer]
    mirrored = train("mirrored", steps=20, optimizer=optimizer, learning_rate=lr)
    assert_bit_identical(train("oracle", steps=20, optimizer=optimizer, learning_rate=lr), mirrored)
    assert_bit_identical(train("mwms", steps=20, optimizer=optimizer, learning_rate=lr), mirrored)


@pytest.mark.slow
@pytest.mark.cluster
def test_three_replicas_strategies_agree_bitwise_and_oracle_within_rounding(train):
    # Both strategies all-reduce with the RING collective, which sums chunks
    # starting from different replicas: with 3 replicas that is another
    # rounding than add_n in replica order (see tf_strategies.oracle).
    changes = dict(steps=20, num_workers=3, optimizer="adam", learning_rate=0.001, global_batch_size=96)
    mirrored = train("mirrored", **changes)
    assert_bit_identical(train("mwms", **changes), mirrored)
    oracle = train("oracle", **changes)
    assert common.max_abs_diff(oracle.weights_final, mirrored.weights_final) < 1e-6
