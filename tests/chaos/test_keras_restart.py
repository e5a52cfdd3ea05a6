"""``model.fit`` on tfps rides out a server restart, as ``ps-worker`` does.

    pytest -q tests/chaos/test_keras_restart.py

Issue 28: "A worker whose server restarts, or whose link is cut, rides it out as
``ps-worker`` does." Two sync workers run the user's program (``keras_program.py``)
against a ps-server that checkpoints every 0.5 s; once it has applied a few rounds
the server is SIGKILLed and started again on the same port from its checkpoints.
Both fits end, each worker says where it resumed, and in sync mode every worker ends
with the same evaluation and predictions (the same parameters).
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from tests.chaos.test_server_restart import free_port, read_log, start_server
from tests.cluster.test_keras_fit import fit
from worker.client import PSClient, PSClientError

pytestmark = [pytest.mark.chaos, pytest.mark.cluster]

KILL_AT_VERSION = 10  # of 69 rounds (3 epochs of 23)


def _checkpointed(ckpt_dir) -> int:
    """The version of the newest checkpoint in ``ckpt_dir`` (-1: none yet)."""
    return max((int(p.stem.split("-")[1]) for p in ckpt_dir.glob("ckpt-*.tfps")), default=-1)


def restart_at(procs, server, port: int, ckpt_dir, version: int, done: threading.Event,
               finished: threading.Event, seen: list) -> None:
    """Kill ``server`` once it reached ``version`` and a checkpoint of some rounds, and went on past
    the newest checkpoint (so the restart loses rounds the workers saw complete: each must notice and
    resume), then start it again and stay until ``finished``: the new server dies with the
    thread that started it (PDEATHSIG). ``seen``: the version read just before the kill."""
    with PSClient(f"127.0.0.1:{port}") as client:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                now = client.status().version
                if now >= version and now > _checkpointed(ckpt_dir) > 0:  # a checkpoint of some rounds
                    seen.append(now)
                    break
            except PSClientError:
                pass  # not initialized yet
            time.sleep(0.02)
    server.kill()
    server.wait()
    start_server(procs, port, ckpt_dir, "ps-restarted")
    done.set()
    finished.wait(600)


@pytest.mark.recovery
def test_keras_fit_rides_out_a_server_restart_and_every_worker_ends_with_the_same_parameters(procs, tmp_path):
    port, ckpt = free_port(), tmp_path / "ckpt"
    server = start_server(procs, port, ckpt, "ps")
    restarted, finished, seen = threading.Event(), threading.Event(), []
    killer = threading.Thread(target=restart_at, args=(procs, server, port, ckpt, KILL_AT_VERSION, restarted,
                                                       finished, seen), daemon=True)
    killer.start()
    try:
        records = fit(procs, tmp_path, "sync", "--epochs", "3", address=f"127.0.0.1:{port}")
    finally:
        finished.set()
        killer.join(60)
    assert restarted.is_set() and seen, read_log(server)[-2000:]
    restored = int(re.search(r"restored version (\d+)", (tmp_path / "ps-restarted.log").read_text()).group(1))
    logs = [p.read_text() for p in sorted(tmp_path.glob("keras-worker*.log"))]
    if restored < seen[0]:  # rounds the workers saw complete were lost (else a checkpoint raced the kill: rare)
        assert all("the server restarted" in log and "resuming at round" in log for log in logs), \
            "\n".join(log[-2000:] for log in logs)
    assert len(records) == 2 and records[0]["evaluate"] == records[1]["evaluate"]
    assert records[0]["predict"] == records[1]["predict"]
    assert records[0]["evaluate"]["accuracy"] > 0.8


LOST_AT_STEP = 10


def restart_when_pushed(procs, server, port: int, ckpt_dir, folder, finished: threading.Event) -> None:
    """Once worker 1's push of ``LOST_AT_STEP`` is in (``lost_reply_keras.py``), kill the server
    a checkpoint interval later, start it again, and tell worker 1 its reply is lost."""
    deadline = time.monotonic() + 240
    while not (folder / "pushed").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.6)  # one checkpoint interval: the restored state is at most that old
    server.kill()
    server.wait()
    start_server(procs, port, ckpt_dir, "ps-restarted")
    (folder / "restarted").write_text("")
    finished.wait(600)


@pytest.mark.recovery
def test_a_restart_that_lost_one_worker_s_reply_drops_its_batch_so_both_push_the_same_global_batch(
        procs, tmp_path, monkeypatch):
    """The server completes round 10 and dies; worker 0 had the reply (it pushes its batch 11 next),
    worker 1 lost it (it would push its batch 10 again). After the restart the workers post the
    batch each pushes next, and worker 1 drops batch 10, so the restored round is of one global
    batch: both fits end with the same parameters. Without it ``BatchDigests`` stops both workers
    (``DataMismatch``: each half of the round came from another global batch)."""
    port, ckpt, folder = free_port(), tmp_path / "ckpt", tmp_path / "signals"
    folder.mkdir()
    monkeypatch.setenv("TFPS_LOSE_REPLY", f"1:{LOST_AT_STEP}:{folder}")
    server = start_server(procs, port, ckpt, "ps")
    finished = threading.Event()
    killer = threading.Thread(target=restart_when_pushed, args=(procs, server, port, ckpt, folder, finished),
                              daemon=True)
    killer.start()
    try:
        records = fit(procs, tmp_path, "sync", "--epochs", "2", address=f"127.0.0.1:{port}",
                      program=os.path.join(os.path.dirname(__file__), "lost_reply_keras.py"))
    finally:
        finished.set()
        killer.join(60)
    assert (folder / "restarted").exists(), read_log(server)[-2000:]
    logs = [p.read_text() for p in sorted(tmp_path.glob("keras-worker*.log"))]
    assert "drops its batch" not in logs[0] and "drops its batch" in logs[1], logs[1][-3000:]
    assert records[0]["evaluate"] == records[1]["evaluate"] and records[0]["predict"] == records[1]["predict"]
