"""A user's Keras program under ``ps-launch --elastic``: workers added and stopped mid-run, the undisturbed bits.

    python -m pytest -q tests/cluster/test_launch_elastic_keras.py

Real processes: ps-launch starts an elastic sync ps-server (``--elastic 2:3``: each
round's global batch cut into 3 micro-batches) and one of the two examples as every
worker (``tfps.keras.Strategy()``, told by ``TFPS_ELASTIC`` that the server deals the
examples of its ``model.fit`` dataset). Each example runs twice: undisturbed with two
workers; and with two workers, a third started at round 10 (every worker pauses 8 s
at round 20, so that it has started TensorFlow and joins mid-run: a pause changes no
bit) and stopped by SIGTERM at round 60 (``--scale-at 10:3 --scale-at 60:2``: it
leaves the job and exits 143). The rules, from docs/elastic.md: both runs exit 0;
the stopped worker left, nobody was declared dead; the server applied every example
once per epoch (its ledger: every epoch complete, the same count each); and the final
parameters, read from the server's final checkpoint, are the undisturbed run's bit
for bit.

The pss example also runs scaled over two server shards (``--num-ps 2``: shard 0 deals
and commits each round, shard 1 follows): both shards' final checkpoints together are the
undisturbed one-server run's parameters, bit for bit, and each shard's ledger is complete.

By hand, without ps-launch: a ps-server (``--elastic-min-workers 3 --lease-timeout 2``)
and three processes of the MultiWorkerMirroredStrategy example, once undisturbed, once
with worker 2 SIGKILLed mid-run (its undelivered micro-batch moves to a live worker when
its lease runs out): the same final parameters, every example once per epoch.
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

from ps_common.procs import dying_with_parent
from ps_server.core.checkpoint import latest_valid
from worker.client import PSClient

from .conftest import ROOT, read_log, wait_exit

pytestmark = [pytest.mark.cluster, pytest.mark.recovery]

EXAMPLES = 1437  # the examples' training set: 80 % of digits
ROUNDS_PER_EPOCH = 23  # global batches of 64


def launch(tmp_path, name: str, example: str, *flags: str, env: dict | None = None) -> tuple[str, object]:
    """Run ps-launch to its end; its output and the server's final checkpoint (with shards,
    each shard's, in shard order)."""
    checkpoints = tmp_path / name
    run = subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", "--elastic", "2:3", "--workers", "2", "--checkpoint-dir",
         str(checkpoints), *flags, "--", sys.executable, os.path.join(ROOT, "examples", example)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
        env={**os.environ, "MPLCONFIGDIR": str(tmp_path / "mpl"), **(env or {})})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    shards = sorted(checkpoints.glob("shard-*"))
    if shards:
        return out, [latest_valid(str(d))[0] for d in shards]
    state, _ = latest_valid(str(checkpoints))
    return out, state


# keras_mwms scaled is slow: in the default run it is killed by hand (SIGKILL, below), and
# keras_pss is the one scaled.
@pytest.mark.parametrize("example, epochs", [pytest.param("keras_mwms.py", 5, marks=pytest.mark.slow),
                                             # ~58 s; the default run keeps the same scaling over two shards
                                             pytest.param("keras_pss.py", 10, marks=pytest.mark.slow)])
def test_an_example_scaled_2_3_2_mid_run_ends_with_the_undisturbed_weights_every_example_once(
        tmp_path, example, epochs):
    _, plain = launch(tmp_path, "plain", example)
    out, scaled = launch(tmp_path, "scaled", example, "--scale-at", "10:3", "--scale-at", "60:2",
                         env={"TFPS_PAUSE_AT_STEP": "20", "TFPS_PAUSE_FOR": "8"})

    events = re.findall(r"ps-launch: round (\d+): worker (\d) (\w+)", out)
    assert ("joined", "2") in [(e, w) for _, w, e in events], events  # the added worker took part mid-run
    (left,) = [int(r) for r, w, e in events if (w, e) == ("2", "left")]
    assert 60 <= left < epochs * ROUNDS_PER_EPOCH, events
    assert not [e for e in events if e[2] in ("dead", "rejoined")], events
    assert "worker 2 stopped by SIGTERM: left the job" in out, out[-3000:]
    assert re.search(r"val_accuracy=0\.9[0-9]+", out), out[-2000:]  # the chief's line: it learned

    for state in (plain, scaled):  # every example once per epoch: the server's ledger and count
        assert state.version == epochs * ROUNDS_PER_EPOCH
        assert state.data.num_examples == EXAMPLES and state.data.global_batch_size == 64
        assert state.data.epochs_complete == tuple(range(epochs)) and not state.data.epochs_seen
    assert f"examples per epoch {[EXAMPLES] * epochs} of {EXAMPLES}" in out

    assert sorted(plain.values) == sorted(scaled.values)
    for name in plain.values:
        np.testing.assert_array_equal(np.asarray(scaled.values[name]), np.asarray(plain.values[name]), err_msg=name)


# ~50 s: slow. Elastic sync over two shards to the undisturbed bits is test_elastic_user's
# worker killed on two shards, and this front door's is the SIGKILL test below.
@pytest.mark.slow
def test_the_pss_example_over_two_shards_scaled_2_3_2_ends_with_one_server_s_undisturbed_weights(tmp_path):
    _, plain = launch(tmp_path, "plain", "keras_pss.py")
    out, shards = launch(tmp_path, "shards", "keras_pss.py", "--num-ps", "2", "--scale-at", "10:3",
                         "--scale-at", "60:2", env={"TFPS_PAUSE_AT_STEP": "20", "TFPS_PAUSE_FOR": "8"})
    events = re.findall(r"ps-launch: round (\d+): worker (\d) (\w+)", out)
    assert ("2", "joined") in [(w, e) for _, w, e in events] and ("2", "left") in [(w, e) for _, w, e in events]
    assert not [e for e in events if e[2] in ("dead", "rejoined")], events
    assert len(shards) == 2 and all(len(s.values) for s in shards)
    for i, state in enumerate(shards):
        assert state.version == 10 * ROUNDS_PER_EPOCH and state.shard_group.shard == i
        assert state.data.epochs_complete == tuple(range(10)) and not state.data.epochs_seen
    joined = {**shards[0].values, **shards[1].values}
    assert sorted(joined) == sorted(plain.values)
    for name in plain.values:
        np.testing.assert_array_equal(np.asarray(joined[name]), np.asarray(plain.values[name]), err_msg=name)


# One shard is ~24 s more of the default run (40 min on a fresh machine): slow, as the same
# job over two shards covers its ground and more (every task routed to both servers).
@pytest.mark.parametrize("num_ps", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_the_pss_example_on_async_tasks_applies_every_example_once_per_epoch_with_a_worker_added_and_stopped(
        tmp_path, num_ps):
    """Async (ssp is the same path, in one process: tests/worker/test_keras_strategy.py): the
    tasks are batches of 64 / 3 = 21 examples, 69 an epoch; a worker started at version 30
    and stopped at version 300 (it hands back the task it held). Every task applied once,
    on each shard (``--num-ps 2``: shard 0 hands out the tasks, shard 1 follows)."""
    out, _ = launch(tmp_path, "async", "keras_pss.py", "--mode", "async", "--scale-at", "30:3", "--scale-at", "300:2",
                    "--num-ps", str(num_ps), env={"TFPS_PAUSE_AT_STEP": "20", "TFPS_PAUSE_FOR": "8"})
    events = re.findall(r"ps-launch: round \d+: worker (\d) (\w+)", out)
    assert ("2", "joined") in events and ("2", "left") in events, events
    assert not [e for e in events if e[1] in ("dead", "rejoined")], events
    assert "worker 2 stopped by SIGTERM: left the job" in out, out[-3000:]
    assert out.count(f"examples per epoch {[EXAMPLES] * 10} of {EXAMPLES}; tasks done 690 of 690") == num_ps, \
        out[-3000:]
    assert re.search(r"val_accuracy=0\.9[0-9]+", out), out[-2000:]


def by_hand(procs, tmp_path, name: str, kill_at: int | None = None) -> tuple[int, dict, list[int]]:
    """Three workers of the example against a server started by hand, worker 2 SIGKILLed once
    the server's round reaches ``kill_at``: the final version, parameters and examples per epoch."""
    _, address = procs.server("sync", 3, extra=("--elastic-min-workers", "3", "--micro-batches", "3",
                                                 "--lease-timeout", "2"))
    workers = []
    for i in range(3):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLCONFIGDIR": str(tmp_path / "mpl"), "TFPS_ELASTIC": "true",
               "TF_ENABLE_ONEDNN_OPTS": "0",
               "TF_CONFIG": json.dumps({"cluster": {"ps": [address], "worker": [f"127.0.0.1:{20000 + j}" for j in range(3)]},
                                        "task": {"type": "worker", "index": i}})}
        log = tmp_path / f"{name}-worker{i}.log"
        proc = subprocess.Popen(dying_with_parent([sys.executable, os.path.join(ROOT, "examples", "keras_mwms.py")]),
                                stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
        proc.log_path = log
        procs.procs.append(proc)
        workers.append(proc)
    with PSClient(address) as client:
        if kill_at is not None:
            deadline = time.monotonic() + 120
            while client.status().round < kill_at:
                assert time.monotonic() < deadline and workers[2].poll() is None, read_log(workers[2])[-2000:]
                time.sleep(0.02)
            workers[2].send_signal(signal.SIGKILL)
        for i, proc in enumerate(workers):
            code = wait_exit(proc, 300)
            assert code == (-signal.SIGKILL if i == 2 and kill_at is not None else 0), read_log(proc)[-3000:]
        status = client.status()
        version, values = client.pull()
    return version, {k: np.array(v) for k, v in values.items()}, [int(n) for n in status.epoch_examples]


def test_a_keras_worker_sigkilled_mid_run_changes_no_bit_of_the_result(procs, tmp_path):
    plain = by_hand(procs, tmp_path, "plain")
    killed = by_hand(procs, tmp_path, "killed", kill_at=30)
    assert plain[0] == killed[0] == 5 * ROUNDS_PER_EPOCH
    assert plain[2] == killed[2] == [EXAMPLES] * 5
    assert sorted(plain[1]) == sorted(killed[1])
    for name in plain[1]:
        np.testing.assert_array_equal(killed[1][name], plain[1][name], err_msg=name)


# ~90 s: slow. In one process, tests/worker/test_keras_strategy.py checks each epoch's rounds
# at the scheduled rate and async tasks carrying it.
@pytest.mark.slow
def test_rates_callbacks_change_and_a_second_fit_with_a_worker_added_and_stopped_end_at_the_undisturbed_bits(
        tmp_path):
    """tests/cluster/programs/elastic_rates.py: a LearningRateScheduler halving the rate it last
    set and a ReduceLROnPlateau on val_loss, over two fits of two epochs (rounds 0-31, 32-63).
    The chief agrees its rate at each epoch's start and every worker sends it with every push,
    so the worker started at round 34 (whose own scheduler starts from the compiled rate, and
    whose first fit finds the cluster past it) pushes the second fit's rounds at the chief's
    rate: the rates and the final parameters are the undisturbed run's, bit for bit."""
    program = os.path.join(ROOT, "tests", "cluster", "programs", "elastic_rates.py")
    plain_out, plain = launch(tmp_path, "plain", program)
    out, scaled = launch(tmp_path, "scaled", program, "--scale-at", "34:3", "--scale-at", "56:2",
                         env={"TFPS_PAUSE_AT_STEP": "44", "TFPS_PAUSE_FOR": "8"})
    events = re.findall(r"ps-launch: round (\d+): worker (\d) (\w+)", out)
    assert ("joined", "2") in [(e, w) for _, w, e in events] and ("left", "2") in [(e, w) for _, w, e in events]
    (rates,) = re.findall(r"rates=(\[.*\])", plain_out)
    assert re.findall(r"rates=(\[.*\])", out) == [rates]
    rates = json.loads(rates)
    assert len(rates) == 4 and all(b <= a / 2 for a, b in zip([0.01] + rates, rates)), rates  # halved, or more
    assert plain.version == scaled.version == 4 * 16
    for name in plain.values:
        np.testing.assert_array_equal(np.asarray(scaled.values[name]), np.asarray(plain.values[name]), err_msg=name)


# ~75 s: slow. In one process, tests/worker/test_keras_strategy.py checks the rounds that skip and
# the scale each round is computed at.
@pytest.mark.slow
def test_a_dynamic_loss_scale_with_a_worker_added_and_stopped_ends_at_the_undisturbed_bits(tmp_path):
    """tests/cluster/programs/elastic_mixed.py: mixed_float16 under a LossScaleOptimizer whose
    scale overflows the gradients at the start and again after each growth, so rounds skip all
    through the job. The worker started at round 8 joins during round 16's pause, past five
    skipped rounds it never saw: it computes each round at the scale the server's record of the
    skipped rounds gives (Assignment.skipped_rounds), so the same rounds skip and the final
    parameters are the undisturbed run's, bit for bit; over two server shards too (every shard
    gets each push's skip: both skip the same rounds)."""
    program = os.path.join(ROOT, "tests", "cluster", "programs", "elastic_mixed.py")
    plain_out, plain = launch(tmp_path, "plain", program)
    out, scaled = launch(tmp_path, "scaled", program, "--scale-at", "8:3", "--scale-at", "36:2",
                         env={"TFPS_PAUSE_AT_STEP": "16", "TFPS_PAUSE_FOR": "10"})
    joined = [int(r) for r, w, e in re.findall(r"ps-launch: round (\d+): worker (\d) (\w+)", out)
              if (w, e) == ("2", "joined")]
    assert joined and 5 < joined[0] < 30, out[-3000:]
    skipped = plain.mode_status.skipped_rounds
    assert len([r for r in skipped if r < joined[0]]) >= 5 and [r for r in skipped if r > joined[0]], skipped
    assert scaled.mode_status.skipped_rounds == skipped and plain.version == scaled.version == 3 * 16
    assert re.findall(r"scale=(\S+)", out) == re.findall(r"scale=(\S+)", plain_out)
    _, shards = launch(tmp_path, "shards", program, "--num-ps", "2", "--scale-at", "8:3", "--scale-at", "36:2",
                       env={"TFPS_PAUSE_AT_STEP": "16", "TFPS_PAUSE_FOR": "10"})
    assert [s.mode_status.skipped_rounds for s in shards] == [skipped, skipped]
    over_shards = {**shards[0].values, **shards[1].values}
    for name in plain.values:
        np.testing.assert_array_equal(np.asarray(scaled.values[name]), np.asarray(plain.values[name]), err_msg=name)
        np.testing.assert_array_equal(np.asarray(over_shards[name]), np.asarray(plain.values[name]), err_msg=name)


# ~40 s: slow. In one process, tests/worker/test_keras_strategy.py goes on to a second and a third
# fit on async and ssp tasks, every task once.
@pytest.mark.slow
def test_a_second_fit_on_async_tasks_goes_on_to_its_epochs_with_a_worker_added_and_stopped(tmp_path):
    """tests/cluster/programs/elastic_rates.py under async: two fits of two epochs each, 1,024
    examples in tasks of 64 / 3 = 21 (49 an epoch); the chief's second Initialize extends the
    job to four epochs. A worker started at version 40 (in the first fit, which finds the
    cluster past its epoch 0) and stopped at version 120 (in the second): every example once in
    each of the four epochs, every task applied once."""
    program = os.path.join(ROOT, "tests", "cluster", "programs", "elastic_rates.py")
    out, state = launch(tmp_path, "async", program, "--mode", "async", "--scale-at", "40:3", "--scale-at", "120:2",
                        env={"TFPS_PAUSE_AT_STEP": "30", "TFPS_PAUSE_FOR": "6"})
    events = re.findall(r"ps-launch: round \d+: worker (\d) (\w+)", out)
    assert ("2", "joined") in events and ("2", "left") in events, events
    assert "examples per epoch [1024, 1024, 1024, 1024] of 1024; tasks done 196 of 196" in out, out[-3000:]
    assert state.version == 196 and re.search(r"rates=\[", out), out[-2000:]

