"""A user's own ``model.compile`` + ``model.fit`` trains on tfps with the strategy line changed.

Real processes: a ps-server and one process per worker running the user's program
(``keras_program.py``, or the two examples through ``ps-launch -- python ...``),
each with ``TF_CONFIG`` as ps-launch sets it. The rules, from the Keras issue:
- the MultiWorkerMirroredStrategy and ParameterServerStrategy examples reach
  ``val_accuracy`` >= 0.90 on digits, sync and async;
- in sync mode the logged loss and metrics are the global batch's: every worker
  logs the same bits;
- each callback has its effect: the files the chief writes, the epoch
  EarlyStopping stops every worker at, the learning rate the server used from the
  stated round, TerminateOnNaN, the epoch BackupAndRestore resumes at.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from ps_common.procs import dying_with_parent

from .conftest import ROOT

pytestmark = pytest.mark.cluster

PROGRAM = os.path.join(ROOT, "tests", "cluster", "keras_program.py")
STEPS = 23  # 1437 examples in global batches of 64


def tf_config(address: str, index: int, workers: int) -> str:
    # Worker addresses are placeholders: tfps workers do not listen.
    return json.dumps({"cluster": {"ps": address.split(","), "worker": [f"127.0.0.1:{20000 + i}" for i in range(workers)]},
                       "task": {"type": "worker", "index": index}})


def fit(procs, tmp_path, mode: str, *flags: str, workers: int = 2, server_extra: tuple[str, ...] = (),
        expect: dict[int, int] | None = None, address: str | None = None, program: str = PROGRAM) -> list[dict]:
    """Run the program once per worker against a (new) server; each worker's record."""
    if address is None:
        _, address = procs.server(mode, workers, extra=server_extra)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    running = []
    for i in range(workers):
        log = open(tmp_path / f"keras-worker{i}-{time.monotonic_ns()}.log", "w")
        env = {**os.environ, "TF_CONFIG": tf_config(address, i, workers), "PYTHONUNBUFFERED": "1",
               "MPLCONFIGDIR": str(tmp_path / "mpl")}
        proc = subprocess.Popen(dying_with_parent([sys.executable, program, "--out", str(out), *flags]), stdout=log,
                                stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
        running.append((proc, log))
    wanted = expect or {i: 0 for i in range(workers)}
    codes = {}
    for i, (proc, log) in enumerate(running):
        try:
            # A worker expected to be stuck (its chief died) is stopped a moment after the chief.
            codes[i] = proc.wait(timeout=300 if wanted[i] is not None else 5)
        except subprocess.TimeoutExpired:
            if wanted[i] is not None:
                raise
            codes[i] = None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if any(codes[i] != wanted[i] for i in wanted if wanted[i] is not None):
        logs = "\n".join(open(log.name).read()[-3000:] for _, log in running)
        pytest.fail(f"exit codes {codes}, wanted {wanted}:\n{logs}")
    return [json.loads((out / f"worker{i}.json").read_text()) for i in range(workers)
            if (out / f"worker{i}.json").exists()]


def launch(tmp_path, mode: str, example: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", "--mode", mode, "--workers", "2", "--",
         sys.executable, os.path.join(ROOT, "examples", example)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")})


# keras_pss.py runs by default in tests/cluster/test_launch_elastic_keras.py (async tasks, a worker added)
@pytest.mark.parametrize("mode, example", [("sync", "keras_mwms.py"),
                                           pytest.param("async", "keras_pss.py", marks=pytest.mark.slow)])
def test_the_two_tensorflow_examples_reach_90_percent_on_digits_through_ps_launch(mode, example, tmp_path):
    run = launch(tmp_path, mode, example)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    found = re.findall(r"val_accuracy=([0-9.]+)", run.stdout + run.stderr)
    assert len(found) == 1, (run.stdout + run.stderr)[-3000:]  # the chief's line alone
    assert float(found[0]) >= 0.90, found


@pytest.mark.parametrize("mode", ["sync", pytest.param("ssp", marks=pytest.mark.slow)])  # ssp: the same seed
def test_an_unseeded_shuffle_reads_the_same_global_batches_on_every_worker(procs, tmp_path, mode):
    """``dataset.shuffle(n)`` with no seed, as most pipelines write it: every worker reads the same
    order (``Strategy()`` set TensorFlow's global seed); sync's rounds checked every batch's digest,
    ssp's each epoch's against the chief's."""
    records = fit(procs, tmp_path, mode, "--shuffle", "unseeded", "--epochs", "2")
    unshuffled = records[0]["next_pass_labels"]
    assert [r["next_pass_labels"] for r in records] == [unshuffled] * 2
    order = np.random.default_rng(0).permutation(1797)  # keras_program.py's split of digits
    from sklearn.datasets import load_digits
    assert unshuffled != load_digits(return_X_y=True)[1][order][:64].tolist()  # it did shuffle


def alone(tmp_path, *flags: str, program: str = PROGRAM, how: str = "--alone") -> dict:
    """The program's record as one plain process (``--alone``: Keras' own fit, no tfps; a
    program's ``--mirrored``: TensorFlow's MirroredStrategy)."""
    out = tmp_path / (how.strip("-") or "plain")
    out.mkdir(exist_ok=True)
    run = subprocess.run(dying_with_parent([sys.executable, program, "--out", str(out), *([how] if how else []),
                                            *flags]),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "worker0.json").read_text())


# async and ssp slow: the window is the worker's in every mode (tests/worker/test_keras_accumulation.py
# steps it against model.fit), and each push applied on arrival is the rows' one path (test_keras_programs)
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow),
                                  pytest.param("ssp", marks=pytest.mark.slow)])
def test_gradient_accumulation_makes_one_update_per_k_batches(procs, tmp_path, mode):
    """``SGD(..., gradient_accumulation_steps=2)``: sync with two workers ends within float
    rounding of one process (each round the mean over its window of the global batches'
    gradients, each part weighing as its share; 1.2e-7 measured, bound 5e-7 on the weights),
    with Keras' iterations, and over two server shards at one server's weights to the bit;
    async and ssp run, one push per window per worker."""
    records = fit(procs, tmp_path, mode, "--accumulate", "2", "--epochs", "2")
    want = alone(tmp_path, "--accumulate", "2", "--epochs", "2")
    windows = 2 * 23 // 2  # 23 batches an epoch: the windows run on across the epochs, as Keras'
    assert want["iterations"] == windows
    if mode == "sync":
        assert [r["version"] for r in records] == [r["iterations"] for r in records] == [windows] * 2
        for got, ref in zip(records[0]["weights"], want["weights"]):
            np.testing.assert_allclose(np.array(got), np.array(ref), rtol=0, atol=5e-7)
        (tmp_path / "two").mkdir()
        two = fit(procs, tmp_path / "two", mode, "--accumulate", "2", "--epochs", "2",
                  address=",".join(procs.server("sync", 2)[1] for _ in range(2)))
        assert two[0]["weights"] == records[0]["weights"] and two[0]["iterations"] == windows
    else:
        assert max(r["version"] for r in records) == 2 * windows  # each worker's window is one push (the
        # worker that ends last has seen every push)


def test_ema_overwrites_inside_accumulation_windows_on_two_workers_as_in_one_process(procs, tmp_path):
    """``SGD(..., gradient_accumulation_steps=2, use_ema=True, ema_overwrite_frequency=3)``: every
    third window Keras overwrites the variables with their averages at each of its batches and
    takes the window's second gradients there; each worker moves the server's averages for it as
    Keras does. Two sync workers end, averages swapped in, within float rounding of one process
    (bound 5e-7, as without ``use_ema``), and the same on both; without the overwrite inside the
    window they end 5.7e-3 apart."""
    flags = ("--accumulate", "2", "--ema-overwrite", "3", "--epochs", "2")
    records, want = fit(procs, tmp_path, "sync", *flags), alone(tmp_path, *flags)
    assert records[0]["weights"] == records[1]["weights"] and records[0]["iterations"] == want["iterations"] == 23
    for got, ref in zip(records[0]["weights"], want["weights"]):
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=0, atol=5e-7)


def test_sync_metric_state_combines_as_each_variable_s_aggregation_declares(procs, tmp_path):
    """A metric counting its step's examples, in a variable of each aggregation: 1437 examples
    an epoch, the chief's part 22 * 32 + 15 and worker 1's 22 * 32 + 14. "sum" logs the global
    batches' 1437 on both, "mean" 718.5, "only_first_replica" the chief's 719, "none" each its own."""
    records = fit(procs, tmp_path, "sync", "--count-metrics", "--epochs", "1")
    got = [{k: r["history"][f"examples_{k}"] for k in ("sum", "mean", "only_first_replica", "none")}
           for r in records]
    assert got == [{"sum": [1437.0], "mean": [718.5], "only_first_replica": [719.0], "none": [719.0]},
                   {"sum": [1437.0], "mean": [718.5], "only_first_replica": [719.0], "none": [718.0]}]
    chief_log = next(p for p in sorted(tmp_path.iterdir()) if p.name.startswith("keras-worker0")).read_text()
    assert "examples_none/count declare aggregation='none'" in chief_log


def test_fit_on_arrays_with_keras_default_shuffle_reads_the_same_global_batches_on_every_worker(procs, tmp_path):
    """``model.fit(x, y, batch_size=64)``: Keras shuffles the arrays each epoch (``shuffle=True``,
    no seed). Every worker draws the same order (``Strategy()`` set TensorFlow's global seed),
    so no round's batch digests differ and both end with the same global-batch metrics."""
    records = fit(procs, tmp_path, "sync", "--arrays", "--epochs", "2")
    assert records[0]["history"]["loss"] == records[1]["history"]["loss"] and records[0]["version"] == 2 * 23


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_workers_that_read_different_global_batches_stop_in_one_line_naming_the_cause(procs, tmp_path, mode):
    """Each worker's shuffle seeded by its index: sync stops every worker at the first round
    (each reply's sum of digests); async stops the worker whose epoch differs from the chief's."""
    fit(procs, tmp_path, mode, "--shuffle", "by-worker", "--epochs", "1",
        expect={0: 1, 1: 1} if mode == "sync" else {0: 0, 1: 1})
    logs = [(tmp_path / name).read_text() for name in sorted(os.listdir(tmp_path)) if name.startswith("keras-worker")]
    stopped = [log for log in logs if "read different global batches" in log or "read other global batches" in log]
    assert len(stopped) == (2 if mode == "sync" else 1), "\n".join(log[-2000:] for log in logs)
    assert all("Seed the shuffles" in log for log in stopped)
    if mode == "sync":
        assert all("workers of step 0 read different global batches" in log for log in stopped)


def test_sync_fit_logs_the_global_batch_metrics_the_same_on_every_worker_and_the_chief_writes(procs, tmp_path):
    a, b = fit(procs, tmp_path, "sync", "--callbacks", "checkpoint,csv,tensorboard", "--weights", "class")
    assert a["mode"] == "sync" and a["epochs"] == b["epochs"] == [0, 1, 2]
    # Each worker computed only half of every batch, yet both logged the same loss and accuracy, bit
    # for bit: the round's sum of every metric's change, which is the global batch's.
    assert a["history"] == b["history"]
    assert set(a["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert a["history"]["val_accuracy"][-1] >= 0.85
    # evaluate and predict after fit run on the server's final parameters, the same on both.
    assert a["evaluate"] == b["evaluate"] and a["predict"] == b["predict"]
    assert a["version"] == b["version"] == 3 * STEPS
    # The chief wrote every file; the other worker's writers were left out.
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("ckpt-*.keras")) == ["ckpt-1.keras", "ckpt-2.keras", "ckpt-3.keras"]
    rows = list(csv.DictReader(open(out / "log.csv")))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(a["history"]["val_accuracy"][-1])
    assert list((out / "tb").rglob("events.out.tfevents.*"))
    # The saved model is the trained one: it predicts what the workers predicted.
    import keras

    saved = keras.saving.load_model(out / "model.keras")
    np.testing.assert_allclose(saved.predict(_probe(), verbose=0), np.array(a["predict"]), atol=1e-6)
    assert a["seen_epochs"] == [0, 1, 2] and a["seen_batches"] == 3 * STEPS


@pytest.mark.slow  # the same claim runs by default in test_keras_every_feature.py (one and two shards, the same
# weights and history) and over two shards in test_keras_programs.py
def test_sync_fit_over_two_server_shards_gives_one_server_s_numbers_bit_for_bit(procs, tmp_path):
    """Each shard steps its own variables with the same optimizer (SGD with momentum here):
    the loss, the metrics, the final parameters are one server's, to the bit."""
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    one = fit(procs, tmp_path / "one", "sync", "--epochs", "1")
    shards = ",".join(procs.server("sync", 2)[1] for _ in range(2))
    two = fit(procs, tmp_path / "two", "sync", "--epochs", "1", address=shards)
    assert one[0]["history"] == two[0]["history"] == two[1]["history"]
    assert one[0]["predict"] == two[0]["predict"] and one[0]["evaluate"] == two[1]["evaluate"]
    assert two[0]["version"] == STEPS


def _probe():
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(labels))
    return (images[order] / 16.0).astype(np.float32)[1437:1442]


def test_learning_rate_scheduler_reaches_the_server_from_the_chiefs_next_round(procs, tmp_path):
    # Compiled at 0.3, the schedule says 0.1 from epoch 0's start: the server never uses 0.3.
    a, b = fit(procs, tmp_path, "sync", "--callbacks", "scheduler", "--learning-rate", "0.3")
    # Epoch 0 at 0.1, from epoch 1 on 0.02: the chief's first push of epoch 1 carries it, so the
    # server's round 23 (the first of epoch 1) is the first at the new rate, for every worker.
    for record in (a, b):
        used = record["server_learning_rates"]
        assert len(used) == 3 * STEPS
        assert used[:STEPS] == [pytest.approx(0.1)] * STEPS
        assert used[STEPS:] == [pytest.approx(0.02)] * (2 * STEPS)
    assert b["seen_lrs"] == a["seen_lrs"] == [pytest.approx(0.1), pytest.approx(0.02), pytest.approx(0.02)]


def test_async_early_stopping_and_reduce_lr_on_plateau_follow_the_chief_on_every_worker(procs, tmp_path):
    a, b = fit(procs, tmp_path, "async", "--callbacks", "early,plateau", "--epochs", "6")
    # min_delta 10: no epoch beats the first by 10, so ReduceLROnPlateau (patience 0) halves the rate
    # at the end of epochs 1 and 2, and EarlyStopping (patience 2) stops after epoch 2. Each async
    # worker logs its own loss, yet both stop at the chief's epoch and take the chief's rate.
    assert a["mode"] == "async"
    assert a["epochs"] == b["epochs"] == [0, 1, 2]
    assert a["seen_lrs"] == b["seen_lrs"] == [pytest.approx(0.1), pytest.approx(0.05), pytest.approx(0.025)]
    # The rate set at the end of epoch 1 goes with the chief's first push of epoch 2: from that
    # update on the server uses it. The other worker's pushes go on at the old rate until then, and
    # at the new one after (where the chief is by then depends on the timing: async).
    used = a["server_learning_rates"]
    assert used == [pytest.approx(0.1)] * (2 * STEPS) + [pytest.approx(0.05)] * STEPS
    other = [round(r, 6) for r in b["server_learning_rates"]]
    assert len(other) == 3 * STEPS and set(other) <= {0.1, 0.05} and other == sorted(other, reverse=True)


def test_terminate_on_nan_stops_every_sync_worker_at_the_same_batch_and_the_server_keeps_finite_state(
        procs, tmp_path):
    # A NaN in worker 0's half of global batch 5: its loss is NaN, logged into the round's sum (so
    # both workers see a NaN global loss and stop), and its gradients are not pushed.
    a, b = fit(procs, tmp_path, "sync", "--callbacks", "nan", "--nan-in-batch", "5")
    assert a["seen_batches"] == b["seen_batches"] == 6
    assert a["epochs"] == b["epochs"] == [0]
    assert np.isfinite(a["evaluate"]["loss"]) and a["evaluate"] == b["evaluate"]


def test_backup_and_restore_resumes_a_restarted_job_at_the_epoch_after_the_last_backup(procs, tmp_path):
    checkpoints = tmp_path / "ckpts"
    proc, address = procs.server("sync", 2, extra=("--checkpoint-dir", str(checkpoints),
                                                   "--checkpoint-interval", "0.2"))
    # The chief dies at the end of epoch 1, after BackupAndRestore saved it: the job is lost.
    fit(procs, tmp_path, "sync", "--callbacks", "backup", "--epochs", "4", "--exit-after-epoch", "1",
        address=address, expect={0: 3, 1: None})
    version_before = _server_version(address)
    assert version_before == 2 * STEPS
    # Restarted: the same program resumes at epoch 2 on the server's state (version goes on).
    a, b = fit(procs, tmp_path, "sync", "--callbacks", "backup", "--epochs", "4", address=address)
    assert a["epochs"] == b["epochs"] == [2, 3]
    assert a["version"] == b["version"] == version_before + 2 * STEPS
    assert a["history"]["val_accuracy"][-1] >= 0.85


def _server_version(address: str) -> int:
    from worker.client import PSClient

    with PSClient(address) as c:
        return int(c.status().version)


def test_ssp_fit_on_per_worker_batches_with_steps_per_epoch_initial_epoch_and_sample_weights(procs, tmp_path):
    a, b = fit(procs, tmp_path, "ssp", "--steps-per-epoch", "10", "--epochs", "4", "--initial-epoch", "1",
               "--validation-freq", "2", "--weights", "sample", "--per-worker", server_extra=("--staleness", "2"))
    assert a["mode"] == "ssp" and a["epochs"] == b["epochs"] == [1, 2, 3]
    assert len(a["history"]["val_accuracy"]) == 2  # Keras validates when (epoch + 1) % 2 == 0: epochs 1 and 3
    assert a["seen_batches"] == b["seen_batches"] == 30
