"""A sync run through the real server computes exactly what one process computes.

The rule: "sync with SGD and 2 workers gives, after 5 steps, bit-identical
parameters to one process that computes the two shard gradients with the same
tape and combines them as the server does, and matches one full-batch process
within 1e-5."
"""

import subprocess
import sys

import numpy as np
import pytest

from tests.cluster.conftest import read_log, wait_exit
from worker.model import load_npz

pytestmark = pytest.mark.cluster

# Same data, seed, model and TensorFlow settings for every run compared.
FLAGS = ["--dataset", "digits", "--steps", "5", "--global-batch-size", "64", "--optimizer", "sgd",
         "--learning-rate", "0.1", "--seed", "3", "--intra-op-threads", "1", "--deterministic"]


def _reference(tmp_path, *extra) -> dict:
    out = tmp_path / f"ref{len(extra)}.npz"
    run = subprocess.run([sys.executable, "-m", "tf_strategies.reference", *FLAGS, "--workers", "2",
                          "--out", str(out), *extra], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return load_npz(str(out))


def test_sync_sgd_two_workers_is_bit_identical_to_one_process_after_5_steps(procs, tmp_path):
    server, address = procs.server("sync", 2)
    weights = tmp_path / "ps.npz"
    w1 = procs.worker(address, 1, 2, *FLAGS)
    w0 = procs.worker(address, 0, 2, *FLAGS, "--save-weights", str(weights))
    assert wait_exit(w0, 300) == 0, read_log(w0)[-3000:]
    assert wait_exit(w1, 300) == 0, read_log(w1)[-3000:]
    ours = load_npz(str(weights))

    sharded = _reference(tmp_path)
    assert sorted(ours) == sorted(sharded)
    for name in ours:
        assert ours[name].dtype == sharded[name].dtype == np.float32
        assert np.array_equal(ours[name], sharded[name]), (
            f"{name}: max abs diff {np.max(np.abs(ours[name] - sharded[name]))}"
        )

    full = _reference(tmp_path, "--full-batch")
    worst = max(float(np.max(np.abs(ours[n] - full[n]))) for n in ours)
    assert worst <= 1e-5, worst
    assert "step 5/5" in read_log(w0) and "version 5" in read_log(w0)
