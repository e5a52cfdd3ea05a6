"""Faults seen from the ``Session`` and ``tfps.keras`` front doors, with real server processes.

    pytest -q tests/chaos/test_front_door_faults.py

- A hand-written ``Session`` loop rides out a ps-server SIGKILLed and started again from
  its checkpoint, through ``Session.rejoin`` (``worker.api``): a checkpoint that holds
  every round pushed loses nothing, so the loop ends on the bits of a run with no fault.
- A ``tfps.keras`` worker SIGKILLed under ``--dead-worker-policy shrink``: the policy
  "stops expecting the dead worker and finishes rounds with the live ones"
  (``ps_server.core.modes.sync_mode``), so the other worker's ``model.fit`` finishes
  every round; and a ``Session`` worker's process SIGKILLed likewise leaves the other
  Session's loop to finish.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from ps_server.config import ServerConfig
from ps_server.server import build_server
from tests.chaos.test_server_restart import free_port, read_log, start_server
from tests.cluster.test_keras_fit import STEPS, fit
from tests.worker.test_combinations import batches, dense_model, session_run
from worker.client import PSClient, PSClientError

pytestmark = [pytest.mark.chaos, pytest.mark.cluster]


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.05)


def checkpointed(address: str, version: int) -> bool:
    """Whether the server at ``address`` applied ``version`` updates and checkpointed them all."""
    with PSClient(address) as client:
        try:
            status = client.status()
        except PSClientError:
            return False
    return status.version == status.last_checkpoint_version == version


@pytest.mark.recovery
def test_a_session_loop_rides_out_a_server_restart_from_its_checkpoint_to_the_undisturbed_bits(procs, tmp_path):
    """Sync, one worker, eight SGD steps; before step 4 (once the server checkpointed version 4)
    the server is SIGKILLed and started again on its port from the checkpoint. The loop's next
    call fails, ``Session.rejoin`` registers with the new server (a new incarnation) and the
    batch is trained again: the weights end as an in-process run's with no restart, to the bit."""
    data = batches(8, 8)
    undisturbed = build_server(ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=1)).start()
    try:
        want, _ = session_run(dense_model(8, 16), data, ps=undisturbed.address)
    finally:
        undisturbed.stop(grace=0.5)

    port, ckpt = free_port(), tmp_path / "ckpt"
    address = f"127.0.0.1:{port}"
    servers = [start_server(procs, port, ckpt, "ps", num_workers=1)]
    incarnations = []

    def restart(step: int) -> None:
        if step == 4:
            wait_for(lambda: checkpointed(address, 4), 30, "checkpoint of version 4")
            with PSClient(address) as client:
                incarnations.append(client.status().incarnation)
            servers[0].kill()
            servers[0].wait()
            servers.append(start_server(procs, port, ckpt, "ps-restarted", num_workers=1, ready=False))

    got, connection = session_run(dense_model(8, 16), data, before_step=restart, ps=address)
    assert len(servers) == 2, read_log(servers[0])[-2000:]
    assert got == want
    with PSClient(address) as client:
        status = client.status()
    assert status.version == len(data)
    assert status.incarnation == connection.registration.incarnation != incarnations[0]


def kill_worker_at(address: str, index: int, version: int, killed: list) -> None:
    """SIGKILL the worker process registered as ``index`` (its name is ``host:pid``) once the
    server reached ``version``."""
    with PSClient(address) as client:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                status = client.status()
            except PSClientError:
                status = None
            if status is not None and status.version >= version:
                name = next(w.worker_name for w in status.workers if w.worker_id == index)
                pid = int(name.rsplit(":", 1)[1])
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)


@pytest.mark.recovery
def test_a_keras_worker_killed_under_shrink_leaves_the_other_fit_to_finish_every_round(procs, tmp_path):
    """Two workers' ``model.fit`` (tests/cluster/keras_program.py), sync, two epochs of 23 rounds;
    worker 1 is SIGKILLed at round 5. Under shrink, with a lease of 2 s, worker 0 goes on alone:
    it exits 0 having applied all 46 rounds, none aborted or timed out, and worker 1 is dead."""
    epochs = 2
    _, address = procs.server("sync", 2, extra=("--dead-worker-policy", "shrink", "--lease-timeout", "2"))
    killed: list[int] = []
    killer = threading.Thread(target=kill_worker_at, args=(address, 1, 5, killed), daemon=True)
    killer.start()
    records = fit(procs, tmp_path, "sync", "--epochs", str(epochs), address=address, expect={0: 0, 1: -9})
    killer.join(10)
    assert killed, "worker 1 was never killed"
    assert [r["worker"] for r in records] == [0]
    assert records[0]["epochs"] == list(range(epochs)) and records[0]["version"] == epochs * STEPS
    assert np.isfinite(records[0]["history"]["loss"]).all() and records[0]["evaluate"]["accuracy"] > 0.5
    with PSClient(address) as client:
        status = client.status()
    assert status.version == epochs * STEPS and list(status.active_workers) == [0]
    assert [w.dead for w in sorted(status.workers, key=lambda w: w.worker_id)] == [False, True]
    assert status.rounds_aborted == 0 and status.rounds_timed_out == 0


SESSION_WORKER = '''
import sys

import keras
import numpy as np
import tensorflow as tf

from worker import api

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="hidden"), keras.layers.Dense(1, name="out")],
                         name="net")
rng = np.random.default_rng(1)
with api.Session(model, ps=sys.argv[1], worker_index=1, num_workers=2, optimizer="sgd", learning_rate=0.1) as session:
    while True:  # until killed
        x, y = rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)
        session.pull()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        session.push(tape.gradient(loss, model.trainable_variables), float(loss), batch_size=len(x))
'''


def test_a_session_worker_killed_under_shrink_leaves_the_other_session_to_finish_every_round(procs, tmp_path):
    """Two Session loops, sync, ``--dead-worker-policy shrink``: worker 1's process is
    SIGKILLed after round 3; once its lease runs out the server stops expecting it and
    worker 0's loop finishes all its steps alone, no round aborted or timed out."""
    _, address = procs.server("sync", 2, extra=("--dead-worker-policy", "shrink", "--lease-timeout", "2"))
    script = tmp_path / "session_worker.py"
    script.write_text(SESSION_WORKER)
    other = procs.start([sys.executable, str(script), address], "session1")
    done, killed = {}, threading.Event()
    # The chief waits before its step 4 until worker 1 is killed: 12 rounds of this model take
    # less than a poll of the status, so the kill would otherwise find the chief done.
    chief = threading.Thread(target=lambda: done.update(weights=session_run(
        dense_model(8, 16), batches(12, 8), before_step=lambda i: i == 4 and killed.wait(120), ps=address,
        worker_index=0, num_workers=2)[0]))
    chief.start()
    with PSClient(address) as client:
        wait_for(lambda: client.status().version >= 3 or other.poll() is not None, 120, "round 3")
        assert other.poll() is None, other.log_path.read_text()[-3000:]
        other.send_signal(signal.SIGKILL)
        killed.set()
        chief.join(120)
        assert not chief.is_alive() and "weights" in done
        status = client.status()
    assert status.version == 12 and status.rounds_aborted == status.rounds_timed_out == 0
    assert [w.worker_id for w in status.workers if w.dead] == [1]
