"""TensorFlow's ParameterServerStrategy runner (tf_strategies.pss), run as ps-parity runs it.

    pytest tests/parity/test_pss.py -m "not slow"

Each run is the CLI in a fresh interpreter, wrapped by ``isolation.isolated``
so TensorFlow's 0.0.0.0 listeners never face the network. The initial weights
come from a different seed than the run's, and the same subprocess computes the
loss of shard 0 and shard 1 of the first global batch under them: a scheduled
first step reads the untouched initial weights, so its loss shows whether the
weights (and, with 2 ps tasks, their shards) were assigned correctly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tf_strategies import common, isolation

pytestmark = pytest.mark.cluster

RUN_TIMEOUT_S = 300
DIGITS_TRAIN = 1437  # examples in the digits training split: 23 global batches of 64
WEIGHT_SEED = 7

_EXPECTED = """
import dataclasses, json, sys
from tf_strategies import common
from worker import model as models
from worker.data import load_dataset

spec = common.RunSpec.from_json(sys.argv[1])
common.write_initial_weights(dataclasses.replace(spec, seed=int(sys.argv[3])), sys.argv[2])
model = models.build_model(spec.model, spec.seed)
common.assign_weights(model.trainable_variables, common.load_initial_weights(sys.argv[2]))
data = load_dataset(spec.dataset)
_, shards = next(common.step_batches(spec, len(data.y_train)))
print(json.dumps([models.evaluate(model, data.x_train[s], data.y_train[s])[0] for s in shards]))
"""


def _env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    return env


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[common.RunSpec, list[np.ndarray], list[float]]:
    """(spec with initial weights, those weights, expected loss of each shard of the first batch)."""
    spec = common.RunSpec(model="cnn", dataset="digits", global_batch_size=64, optimizer="adam", seed=0,
                          num_workers=2, intra_op_threads=1, deterministic=True)
    path = str(tmp_path_factory.mktemp("init") / "initial.npz")
    made = subprocess.run([sys.executable, "-c", _EXPECTED, spec.to_json(), path, str(WEIGHT_SEED)],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert made.returncode == 0, made.stderr[-3000:]
    first_losses = json.loads(made.stdout.strip().splitlines()[-1])
    return dataclasses.replace(spec, initial_weights=path), common.load_initial_weights(path), first_losses


def run_pss(spec: common.RunSpec, num_ps: int, out) -> subprocess.CompletedProcess:
    argv, _ = isolation.isolated([sys.executable, "-m", "tf_strategies.pss", "--spec-json", spec.to_json(),
                                  "--num-ps", str(num_ps), "--out", str(out)])
    return subprocess.run(isolation.dying_with_parent(argv), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=_env())


def train(base, tmp_path, num_ps: int, steps: int) -> common.RunResult:
    spec, _, _ = base
    done = run_pss(dataclasses.replace(spec, steps=steps), num_ps, tmp_path / "out")
    assert done.returncode == 0, f"pss exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    print(done.stdout.strip().splitlines()[-1])
    return common.load_result(str(tmp_path / "out"))


def check_common(result: common.RunResult, base, steps: int) -> None:
    spec, initial, first_losses = base
    # One scheduled step per shard of every global batch, nothing synchronous.
    assert len(result.losses) == steps * spec.num_workers
    assert all(math.isfinite(x) for x in result.losses)
    assert result.weights_step1 is None
    # Whole weights (shards concatenated), in trainable_variables order.
    assert [w.shape for w in result.weights_final] == [w.shape for w in initial]
    assert all(np.all(np.isfinite(w)) for w in result.weights_final)
    assert common.max_abs_diff(result.weights_final, initial) > 0
    # The first step to read the variables reads the assigned initial weights (the
    # other of the first two may already see its update: the steps run concurrently).
    assert any(abs(result.losses[i] - first_losses[i]) < 1e-5 for i in range(2)), (result.losses[:2], first_losses)
    assert result.steps_per_s > 0 and result.wall_s > 0


def test_one_ps_learns_digits_in_one_epoch(base, tmp_path):
    result = train(base, tmp_path, num_ps=1, steps=23)
    check_common(result, base, steps=23)
    assert result.examples == DIGITS_TRAIN
    assert np.mean(result.losses[-10:]) < 0.5 * np.mean(result.losses[:10])
    assert result.test_accuracy >= 0.85
    assert "1 PS" in result.notes


def test_two_ps_shard_the_variables_and_report_whole_weights(base, tmp_path):
    result = train(base, tmp_path, num_ps=2, steps=3)
    check_common(result, base, steps=3)
    assert result.examples == 3 * 64
    assert "FixedShardsPartitioner(2)" in result.notes


def test_a_spec_it_cannot_honour_exits_3_with_one_line(base, tmp_path):
    spec = dataclasses.replace(base[0], steps=2, loss_scaling="wrong-local-mean")
    done = run_pss(spec, 1, tmp_path / "out")
    assert done.returncode == 3
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runner pss cannot start: "), done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("num_ps", [1, 2])
def test_three_epochs_reach_high_accuracy(base, tmp_path, num_ps):
    result = train(base, tmp_path, num_ps=num_ps, steps=3 * 23)
    check_common(result, base, steps=3 * 23)
    assert result.examples == 3 * DIGITS_TRAIN
    assert result.test_accuracy >= 0.90
