"""Several ps-server shards with real processes: ps-launch --num-ps, and --ps HOST:PORT,HOST:PORT by hand.

The rule: "ps-server instances each own part of the variables ...
workers talk to all shards in parallel. ps-launch --num-ps M starts M shards.
Sync and async both work across shards (a sync round completes on every
shard)."
"""

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from ps_common.ports import free_port
from tests.cluster.conftest import port_of, read_log, wait_exit
from worker.client import PSClient
from worker.model import load_npz

pytestmark = pytest.mark.cluster

CNN_PARAMETERS = 3 * 3 * 32 + 32 + 21632 * 10 + 10


def start_shards(procs, n: int, mode: str, num_workers: int = 2) -> list[str]:
    """n ps-server processes, each with its own port file and log (<tag>-shard<i>.log); their addresses."""
    servers = []
    tag = f"{n}x{len(procs.procs)}"  # unique per call: a test may start several clusters
    for i in range(n):
        port_file = procs.tmp_path / f"{tag}-shard{i}.port"
        proc = procs.start([sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0",
                            "--port-file", str(port_file), "--mode", mode, "--num-workers", str(num_workers)],
                           f"{tag}-shard{i}")
        servers.append((proc, port_file))
    addresses = [f"127.0.0.1:{port_of(proc, port_file)}" for proc, port_file in servers]
    for address in addresses:
        with PSClient(address) as c:
            c.wait_ready(30)
    return addresses


def statuses(addresses):
    out = []
    for address in addresses:
        with PSClient(address) as c:
            out.append(c.status())
    return out


def train_by_hand(procs, ps: str, flags, chief_flags=()) -> None:
    w1 = procs.worker(ps, 1, 2, *flags)
    w0 = procs.worker(ps, 0, 2, *flags, *chief_flags)
    assert wait_exit(w0, 300) == 0, read_log(w0)[-3000:]
    assert wait_exit(w1, 300) == 0, read_log(w1)[-3000:]


def test_launch_two_shards_sync_trains_digits_and_every_shard_completes_every_round(tmp_path):
    metrics = tmp_path / "m.json"
    run = subprocess.run(
        [sys.executable, "-m", "ps_tools.launch", "--num-ps", "2", "--mode", "sync", "--workers", "2",
         "--dataset", "digits", "--epochs", "1", "--metrics-json", str(metrics)],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    m = json.loads(metrics.read_text())
    assert m["steps"] == 23 and m["test_accuracy"] >= 0.85, m
    assert "[ps 0]" in run.stdout and "[ps 1]" in run.stdout
    shards = m["shards"]
    assert m["num_ps"] == 2 and len(shards) == 2
    # Each holds a part, together all of the CNN; both completed the same 23 rounds.
    assert all(0 < s["parameters"] < CNN_PARAMETERS for s in shards)
    assert sum(s["parameters"] for s in shards) == CNN_PARAMETERS
    assert [(s["round"], s["version"]) for s in shards] == [(23, 23), (23, 23)]


# The flags of tests/cluster/test_sync_parity.py, for fewer steps.
SGD_FLAGS = ["--dataset", "digits", "--steps", "3", "--global-batch-size", "64", "--optimizer", "sgd",
             "--learning-rate", "0.1", "--seed", "3", "--intra-op-threads", "1", "--deterministic"]


def test_sync_sgd_over_two_shards_is_bit_identical_to_one_server(procs, tmp_path):
    one = start_shards(procs, 1, "sync")
    train_by_hand(procs, one[0], SGD_FLAGS, ["--save-weights", str(tmp_path / "one.npz")])
    two = start_shards(procs, 2, "sync")
    train_by_hand(procs, ",".join(two), SGD_FLAGS, ["--save-weights", str(tmp_path / "two.npz")])

    # The dense kernel really was cut, and each shard holds some of it.
    chief_log = read_log(procs.procs[-1])
    assert "cnn/dense/kernel/part_0_of_2" in chief_log and "cnn/dense/kernel/part_1_of_2" in chief_log
    a, b = load_npz(str(tmp_path / "one.npz")), load_npz(str(tmp_path / "two.npz"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
        assert np.array_equal(a[name], b[name]), f"{name}: max abs diff {np.max(np.abs(a[name] - b[name]))}"
    assert [s.round for s in statuses(two)] == [3, 3]


def test_async_over_two_shards_trains_digits(procs, tmp_path):
    addresses = start_shards(procs, 2, "async")
    result = tmp_path / "r.json"
    # Two epochs: after one, async accuracy on digits still varies from run to run
    # (0.79 to 0.92 seen, with one server as with two). After two, 0.90 to 0.95 on a quiet
    # machine and 0.84 in a CI run (a slowed worker's pushes are staler): 0.75 is below that and
    # far above what training that goes wrong ends at (chance is 0.1); the counts below check
    # that every push reached both shards.
    train_by_hand(procs, ",".join(addresses), ["--dataset", "digits", "--epochs", "2"],
                  ["--result-json", str(result)])
    r = json.loads(result.read_text())
    assert r["mode"] == "async" and r["test_accuracy"] >= 0.75, r
    # Every push of both workers (46 steps each) reached both shards.
    shards = statuses(addresses)
    assert [s.pushes_applied for s in shards] == [92, 92]
    assert sum(s.num_parameters for s in shards) == CNN_PARAMETERS and all(s.num_parameters for s in shards)
    assert "learned the placement" in read_log(procs.procs[-2])  # worker 1 read it from the shards


@pytest.mark.chaos
def test_sync_workers_ride_out_a_shard_restart_from_its_checkpoint(procs, tmp_path):
    """A shard killed mid-run and started again on its port restores an older round
    than the other shard holds; the workers rejoin and push each shard its own round."""
    (first,) = start_shards(procs, 1, "sync")
    port = free_port()
    argv = [sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", str(port), "--mode", "sync",
            "--num-workers", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "0.2"]
    second = procs.start(argv, "restarted-shard-before")
    ps = f"{first},127.0.0.1:{port}"
    with PSClient(ps.split(",")[1]) as c:
        c.wait_ready(30)
    flags = ["--dataset", "digits", "--steps", "30", "--log-every", "1", "--reconnect-timeout", "60"]
    w1 = procs.worker(ps, 1, 2, *flags)
    w0 = procs.worker(ps, 0, 2, *flags)
    deadline = time.monotonic() + 120
    while "step 10/30" not in read_log(w0):
        assert time.monotonic() < deadline and w0.poll() is None, read_log(w0)[-3000:]
        time.sleep(0.05)
    second.kill()
    second.wait()
    procs.start(argv, "restarted-shard-after")
    assert wait_exit(w0, 300) == 0, read_log(w0)[-3000:]
    assert wait_exit(w1, 300) == 0, read_log(w1)[-3000:]
    # No "rejoined" check: when the restored checkpoint holds exactly the round the workers
    # reached and no call hit the restart, they carry on without an error to rejoin on.
    first_status, second_status = statuses(ps.split(","))
    assert first_status.round == 30  # every step once on the shard that kept running
    # The restored shard took the cluster's round with its first push: both count alike.
    assert second_status.round == 30 and second_status.incarnation != ""


def test_launch_runs_backup_workers_over_two_shards_with_shard_0_s_contributors(tmp_path):
    """Three workers, two contributions a round: shard 0 picks them and commits each round on
    shard 1 with them (ps_server/core/modes/sync_mode.py), so both shards count the same."""
    metrics = tmp_path / "m.json"
    run = subprocess.run([sys.executable, "-m", "ps_tools.launch", "--num-ps", "2", "--workers", "3",
                          "--replicas-to-aggregate", "2", "--dataset", "digits", "--model", "cnn", "--steps", "12",
                          "--log-level", "WARNING", "--metrics-json", str(metrics)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    shards = json.loads(metrics.read_text())["shards"]
    assert len(shards) == 2
    for s in shards:
        assert (s["version"], s["pushes_applied"]) == (12, 24)
    assert shards[0]["examples_applied"] == shards[1]["examples_applied"]
