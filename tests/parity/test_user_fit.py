"""``ps-parity --model M --dataset D``: the user's own ``model.fit`` under TensorFlow's strategies and tfps.

A user's program is written to tmp_path: an MLP on scikit-learn's 8x8 digits, compiled
with Adam (0.003), 10 epochs, global batch 48 over 1437 training examples (29 full batches
and a last one of 45: uneven), 3 workers. The default test runs the pairs that carry a bound:

- tfps sync vs Keras 3 MirroredStrategy: Adam <= 1e-6 after step 1 and <= 2e-4 after
  the last step (the last batch of 45 divides into 3 equal shards, so the bound applies
  to it unchanged);
- tfps async vs tf_keras ParameterServerStrategy: validation accuracy within 0.03.

The full matrix (tf_keras MWMS, and Keras 3 MWMS / PSS, which fail upstream) is ``slow``.
Every process a run starts dies with it (``dying_with_parent``; SIGKILL on the way out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tf_strategies import user_parity
from tf_strategies.user_parity import Check, Outcome

pytestmark = pytest.mark.parity

# Async runs differ from run to run. Measured here: over 2 epochs at Adam 0.01 the validation
# accuracy of tf_keras PSS ranged 0.88-0.95 (a stale Adam step now and then throws the loss up);
# at 0.003 over 4 epochs, still climbing, the two async runners' gap went over 0.03 now and then
# (0.031); over 10 epochs, near the plateau (0.95-0.97), it stayed <= 0.006 in the runs measured.
EPOCHS = 10

USER_PROGRAM = textwrap.dedent('''
    """A user's program: an MLP on the 8x8 digits, built with tf.keras (Keras 3 or tf_keras)."""
    import numpy as np
    import tensorflow as tf
    from tensorflow import keras

    GLOBAL_BATCH = 48


    def build():
        model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.003),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model


    def data():
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        d = load_digits()
        x = (d.data / 16.0).astype(np.float32)
        y = d.target.astype(np.int64)
        xt, xv, yt, yv = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
        order = np.random.default_rng(0).permutation(len(yt))  # shuffled once, the same in every process
        train = tf.data.Dataset.from_tensor_slices((xt[order], yt[order])).batch(GLOBAL_BATCH)
        val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(GLOBAL_BATCH)
        return train, val
''')


@pytest.fixture
def user_program(tmp_path):
    (tmp_path / "digits_user.py").write_text(USER_PROGRAM)
    return tmp_path


def ps_parity(cwd, *args, timeout=1500):
    out = cwd / "p.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")]))
    env.pop("TF_CONFIG", None)
    run = subprocess.run([sys.executable, "-m", "tf_strategies.parity", "--model", "digits_user:build",
                          "--dataset", "digits_user:data", "--workers", "3", "--epochs", str(EPOCHS), *args,
                          "--json-out", str(out)], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    return run, (json.loads(out.read_text()) if out.exists() else None)


def _checks(report):
    return {c["name"]: c for c in report["checks"]}


@pytest.mark.slow  # ~67 s: ps-parity's own runs are test_parity_cli's; the Keras programs' parity, tests/cluster
def test_tfps_matches_mirrored_and_tf_keras_pss_on_the_users_model_fit(user_program):
    run, report = ps_parity(user_program, "--runners", "mirrored,tfk-pss,tfps-sync,tfps-async",
                            "--plot", str(user_program / "p.png"))
    assert report is not None, run.stderr[-4000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert report["model"]["batch_sizes"][-1] == 45 and len(report["model"]["batch_sizes"]) == 30
    runners = report["runners"]
    assert all(r["status"] == "ok" for r in runners.values()), runners
    checks = _checks(report)
    steps = EPOCHS * 30
    c1, ck = checks["tfps-sync vs mirrored, step 1"], checks[f"tfps-sync vs mirrored, step {steps}"]
    assert c1["gated"] and c1["ok"] and c1["value"] <= 1e-6, c1
    assert ck["gated"] and ck["ok"] and ck["value"] <= 2e-4, ck
    gap = checks["tfps-async vs tfk-pss val accuracy gap"]
    assert gap["ok"] and gap["value"] <= 0.03, gap
    assert runners["tfps-sync"]["vs_mirrored"]["final"] == ck["value"]
    assert len(runners["tfk-pss"]["history"]["loss"]) == EPOCHS and runners["tfk-pss"]["keras"].startswith("tf_keras 2.21")
    for name in runners:  # one table row each
        assert f"\n{name} " in run.stdout
    assert (user_program / "p.png").stat().st_size > 10_000


def test_a_tf_keras_that_cannot_be_installed_fails_its_runner_with_pips_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("TFPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as on a machine without PyPI
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(user_parity.RunnerFailed, match=r"cannot install tf_keras==2\.21\.0 \(pip exit \d+\): .+"):
        user_parity.ensure_tf_keras(timeout=120)
    outcome = user_parity.run_runner(user_parity.RUNNERS[user_parity.RUNNER_NAMES.index("tfk-pss")],
                                     {"model": "m:f", "dataset": "m:f", "epochs": 1, "workers": 3, "seed": 0,
                                      "intra_op_threads": 1, "initial_weights": ""}, str(tmp_path), 60)
    assert outcome.status == "failed" and outcome.reason.startswith("cannot install tf_keras"), outcome
    _, checks = user_parity.compare({"optimizer": "Adam", "batch_sizes": [48, 45], "epochs": 1}, 3,
                                    {"tfk-pss": outcome})
    assert [(c.name, c.ok) for c in checks] == [("tfk-pss finished", False)]


def _ok(name, step1, final, acc=0.9):
    return Outcome(name, result={"val_accuracy": acc}, step1=[step1], final=[final])


def test_bounds_follow_the_optimizer_and_what_mirrored_does_with_an_uneven_batch():
    import numpy as np

    z = np.zeros(3, np.float32)
    info = {"optimizer": "SGD", "batch_sizes": [48, 48, 45], "epochs": 2}
    outcomes = {"mirrored": _ok("mirrored", z, z), "tfps-sync": _ok("tfps-sync", z, z + 1e-7)}
    _, checks = user_parity.compare(info, 3, outcomes)
    by = {c.name: c for c in checks}
    assert by["tfps-sync vs mirrored, step 1"].ok and by["tfps-sync vs mirrored, step 1"].limit == 0.0
    last = by["tfps-sync vs mirrored, step 6"]  # SGD: bit-identical, 1e-7 violates it
    assert last.gated and not last.ok and "divides into 3 equal shards" in last.detail

    info = dict(info, optimizer="Adam", batch_sizes=[48, 48, 29])  # 29 = 10 + 10 + 9 shards
    _, checks = user_parity.compare(info, 3, dict(outcomes, **{"tfps-sync": _ok("tfps-sync", z, z + 1e-3)}))
    last = {c.name: c for c in checks}["tfps-sync vs mirrored, step 6"]
    assert not last.gated and last.ok and last.value == pytest.approx(1e-3) and "not gated" in last.detail

    known = Outcome("keras-mwms", status="known-failing", reason="worker 0: ValueError: ...")
    failed = Outcome("tfps-async", status="failed", reason="exit 1: boom")
    _, checks = user_parity.compare(info, 3, {"keras-mwms": known, "tfps-async": failed,
                                              "tfk-pss": _ok("tfk-pss", z, z)})
    assert sorted((c.name, c.ok) for c in checks) == [
        ("tfps-async finished", False), ("tfps-async vs tfk-pss val accuracy gap", False)]
    assert isinstance(checks[0], Check)


@pytest.mark.slow
def test_full_matrix(user_program):
    """Every runner: tf_keras MWMS is bit-identical to MirroredStrategy here; Keras 3 MWMS and
    PSS model.fit fail upstream (keras-team/keras#20585) and are reported with their error."""
    run, report = ps_parity(user_program, "--plot", str(user_program / "p.png"), timeout=2400)
    assert report is not None, run.stderr[-4000:]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-4000:]
    runners = report["runners"]
    assert set(runners) == set(user_parity.RUNNER_NAMES)
    assert runners["tfk-mwms"]["status"] == "ok" and runners["tfk-mwms"]["vs_mirrored"]["final"] <= 2e-4
    for name in ("keras-mwms", "keras-pss"):
        r = runners[name]
        assert r["status"] in ("known-failing", "ok"), r
        if r["status"] == "known-failing":
            assert r["reason"] and f"{name} " in run.stdout and "KNOWN" in run.stdout


def _embedding_model(keras, optimizer):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 3)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(pooled))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("optimizer, ids, named", [
    ("adam", [[1, 1, 2, 3], [4, 5, 1, 2]], True),  # row 1 three times: Adam squares each occurrence
    ("adamw", [[1, 1, 2, 3], [4, 5, 1, 2]], True),
    ("sgd", [[1, 1, 2, 3], [4, 5, 1, 2]], False),  # linear in the gradient: the same step
    ("adam", [[0, 1, 2, 3], [4, 5, 6, 7]], False),  # no row repeats
])
def test_the_init_process_names_the_sparse_rule_where_it_changes_the_step(optimizer, ids, named):
    """"Make ps-parity detect the case and name it instead of reporting an unexplained difference."
    Keras 3 itself is the judge: one step on the slices against one on them summed."""
    import numpy as np
    import tensorflow as tf
    from tensorflow import keras

    from tf_strategies.user_fit import sparse_rule

    model = _embedding_model(keras, optimizer)
    rule = sparse_rule(keras, tf, model, (tf.constant(ids, tf.int32), tf.constant(np.array([0, 1]), tf.int64)))
    if named:
        assert rule["variables"] == [model.trainable_variables[0].path] and rule["step_difference"] > 1e-4
        assert rule["optimizer"] == type(model.optimizer).__name__
    else:
        assert rule is None


def test_a_named_sparse_rule_reports_the_sync_difference_without_gating_it():
    import numpy as np

    z = np.zeros(3, np.float32)
    info = {"optimizer": "Adam", "batch_sizes": [48, 48], "epochs": 1,
            "sparse_rule": {"variables": ["embedding/embeddings"], "optimizer": "Adam", "step_difference": 3e-3}}
    outcomes = {"mirrored": _ok("mirrored", z, z), "tfps-sync": _ok("tfps-sync", z + 1e-2, z + 0.1)}
    _, checks = user_parity.compare(info, 2, outcomes)
    assert [c.name for c in checks] == ["tfps-sync vs mirrored, step 1", "tfps-sync vs mirrored, step 2"]
    assert all(c.ok and not c.gated and "the sparse rule: embedding/embeddings repeat rows" in c.detail
               for c in checks)
    assert all("tfps ran --sparse-rule sum" in c.detail for c in checks)
    _, gated = user_parity.compare(dict(info, sparse_rule=None), 2, outcomes)
    assert all(c.gated and not c.ok for c in gated)  # the same difference, unexplained, fails


def test_under_sparse_rule_keras_the_sync_comparison_stays_gated_and_names_the_rule():
    """tfps ran Keras' own rule (ps-parity --sparse-rule keras): a difference is not explained
    by the rule any more, so the gate holds; the detail says which rule tfps ran."""
    import numpy as np

    z = np.zeros(3, np.float32)
    info = {"optimizer": "Adam", "batch_sizes": [48, 48], "epochs": 1, "tfps_sparse_rule": "keras",
            "sparse_rule": {"variables": ["embedding/embeddings"], "optimizer": "Adam", "step_difference": 3e-3}}
    far = {"mirrored": _ok("mirrored", z, z), "tfps-sync": _ok("tfps-sync", z + 1e-2, z + 0.1)}
    _, checks = user_parity.compare(info, 2, far)
    assert all(c.gated and not c.ok and "tfps ran --sparse-rule keras" in c.detail for c in checks)
    equal = {"mirrored": _ok("mirrored", z, z), "tfps-sync": _ok("tfps-sync", z, z)}
    _, checks = user_parity.compare(info, 2, equal)
    assert all(c.gated and c.ok for c in checks)
