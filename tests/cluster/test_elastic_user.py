"""Elastic sync with your own model and data: ``ps-worker --elastic --model mymod:build
--dataset mymod:data``, real processes.

The dataset function (written to the test's directory, the workers' current directory)
gives a seeded shuffle of 300 synthetic examples with sample weights, in global batches;
every worker reads it once into arrays (``worker.task.read_once``) and the server deals
their indices. Two epochs in global batches of 32 (10 rounds each, the last of 12
examples), each cut into 3 micro-batches: once undisturbed with two workers, once with
three of which worker 2 is SIGKILLed at round 5 (it pauses there, so the kill lands in
the middle of the job; its micro-batch moves to a live worker when its lease runs out).
The chief's final weights are the same bits, and the server counted every example of
both epochs exactly once. The disturbed run is also made over two server shards (shard 0
deals and commits, shard 1 follows: ``core.modes.elastic_mode``): the same bits as the
undisturbed run on one server, both shards' ledgers complete.
"""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest

from worker.client import PSClient
from worker.sharded_client import ShardedClient

from .conftest import wait_exit
from .test_elastic import wait_for_version

pytestmark = [pytest.mark.cluster, pytest.mark.recovery]

EXAMPLES = 300
BATCH = 32
STEPS = 2 * -(-EXAMPLES // BATCH)  # two epochs of 10 rounds
KILL_AT = 5

MODULE = '''
import keras
import numpy as np
import tensorflow as tf


def build():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def examples(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, x[:, :3].argmax(axis=1).astype("int64"), rng.uniform(0.5, 1.5, size=n).astype("float32")


def data(ctx):
    train = tf.data.Dataset.from_tensor_slices(examples(300, 0)).shuffle(300, seed=1).batch(ctx.global_batch_size)
    x, y, _ = examples(100, 1)
    return train, tf.data.Dataset.from_tensor_slices((x, y)).batch(50)
'''


def run(procs, tmp_path, disturbed: bool, shards: int = 1):
    workers = 3 if disturbed else 2
    addresses = [procs.server("sync", 3, extra=("--elastic-min-workers", str(workers), "--micro-batches", "3",
                                                 "--lease-timeout", "2"))[1] for _ in range(shards)]
    address = ",".join(addresses)
    flags = ("--elastic", "--model", "mymod:build", "--dataset", "mymod:data", "--epochs", "2",
             "--global-batch-size", str(BATCH), "--log-level", "WARNING")
    weights = tmp_path / f"final-{disturbed}.npz"
    chief = procs.worker(address, 0, 3, *flags, "--save-weights", str(weights),
                         "--history-json", str(tmp_path / f"h0-{disturbed}.json"))
    others = [procs.worker(address, i, 3, *flags, *(("--pause-at-step", str(KILL_AT), "--pause-for", "60")
                                                    if i == 2 else ()),
                           "--history-json", str(tmp_path / f"h{i}-{disturbed}.json"))
              for i in range(1, workers)]
    if disturbed:
        wait_for_version(addresses[0], KILL_AT)  # worker 2 holds round 5 (it pauses there)
        others[1].send_signal(signal.SIGKILL)
    assert wait_exit(chief, 120) == 0, chief.log_path.read_text()[-3000:]
    for p in others:
        assert wait_exit(p, 60) == (-signal.SIGKILL if disturbed and p is others[1] else 0)
    with ShardedClient(addresses) if shards > 1 else PSClient(address) as client:
        statuses = client.statuses() if shards > 1 else [client.status()]
    for s in statuses[1:]:  # every shard applied the same rounds, each example once
        assert (s.version, list(s.epoch_examples)) == (statuses[0].version, list(statuses[0].epoch_examples))
    return dict(np.load(weights)), statuses[0]


@pytest.mark.parametrize("shards", [pytest.param(1, marks=pytest.mark.slow), 2])  # one shard: the chaos tier's
def test_your_model_and_data_with_a_worker_killed_end_with_the_undisturbed_weights(procs, tmp_path, shards):
    (tmp_path / "mymod.py").write_text(MODULE)
    undisturbed, quiet = run(procs, tmp_path, False)
    disturbed, churned = run(procs, tmp_path, True, shards)
    assert undisturbed.keys() == disturbed.keys() and undisturbed
    for name in undisturbed:
        np.testing.assert_array_equal(disturbed[name], undisturbed[name], err_msg=name)
    # Every example of both epochs was counted once, whoever computed it.
    assert quiet.examples_applied == churned.examples_applied == 2 * EXAMPLES
    assert list(quiet.epoch_examples) == list(churned.epoch_examples) == [EXAMPLES, EXAMPLES]
    assert quiet.version == churned.version == STEPS
    # After the kill one of the two left computed two of a round's three micro-batches.
    doubled = [r for i in (0, 1) for r in json.loads((tmp_path / f"h{i}-True.json").read_text())["steps"]
               if r["micro_batches"] > 1]
    assert doubled, "no round was computed by fewer workers than micro-batches"


# async and ssp on one shard (~20 s each) are slow: async on two shards covers their ground, with
# ssp's workers killed, stopped and added in test_elastic_async and the seeded fault schedules.
@pytest.mark.parametrize("mode, shards", [pytest.param("async", 1, marks=pytest.mark.slow),
                                          pytest.param("ssp", 1, marks=pytest.mark.slow), ("async", 2)])
def test_your_model_and_data_on_async_tasks_apply_every_example_once_with_a_worker_killed(procs, tmp_path, mode,
                                                                                           shards):
    """Async and ssp deal your examples as tasks (core.data.tasks): a worker SIGKILLed while it
    holds one gives it back when its lease runs out, and every example of both epochs is
    applied exactly once, one push per task; over two shards, once on each shard."""
    (tmp_path / "mymod.py").write_text(MODULE)
    bound = ("--staleness", "2") if mode == "ssp" else ()
    addresses = [procs.server(mode, 3, extra=("--lease-timeout", "2", *bound))[1] for _ in range(shards)]
    address = ",".join(addresses)
    flags = ("--elastic", "--model", "mymod:build", "--dataset", "mymod:data", "--epochs", "2",
             "--global-batch-size", str(BATCH), "--log-level", "WARNING")
    # The whole job takes under a second here: worker 2 joins first (its model and data built),
    # and the other two wait 10 s after their first task, so a busy machine that starts worker 2's
    # steps late (it polls for the chief's Initialize) cannot let them take every task first.
    two = procs.worker(address, 2, 3, *flags, "--pause-at-step", str(KILL_AT), "--pause-for", "60")
    deadline = time.monotonic() + 120
    with PSClient(addresses[0]) as client:
        while not any(w.worker_id == 2 for w in client.status().workers):
            assert time.monotonic() < deadline and two.poll() is None, "worker 2 never joined"
            time.sleep(0.05)
    wait = ("--pause-at-step", "1", "--pause-for", "10")
    chief = procs.worker(address, 0, 3, *flags, *wait)
    one = procs.worker(address, 1, 3, *flags, *wait)
    deadline = time.monotonic() + 120
    with PSClient(addresses[0]) as client:
        while not any(w.worker_id == 2 and w.pushes >= KILL_AT for w in client.status().workers):
            assert time.monotonic() < deadline and chief.poll() is None, "worker 2 never reached its pause"
            time.sleep(0.05)
    two.send_signal(signal.SIGKILL)
    assert wait_exit(chief, 120) == 0, chief.log_path.read_text()[-3000:]
    assert wait_exit(one, 60) == 0
    tasks = 2 * -(-EXAMPLES // (BATCH // 3))  # a task is a third of the global batch: 3 workers
    for a in addresses:
        with PSClient(a) as client:
            s = client.status()
        assert s.tasks_total == s.tasks_done == s.pushes_applied == tasks and s.tasks_held == s.tasks_queued == 0
        assert list(s.epoch_examples) == [EXAMPLES, EXAMPLES] and s.examples_applied == 2 * EXAMPLES
