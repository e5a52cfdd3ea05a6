"""ps-export reads a checkpoint one array at a time (``ps_tools.export``).

    python -m pytest tests/test_export.py -q

The rule checked, from the module docstring: "beside the model's own weights and
slots, memory holds one array of the checkpoint, never a second copy of the state";
and that what it writes is still the checkpoint's arrays, bit for bit.
"""

import hashlib
import tracemalloc

import numpy as np
import pytest

from ps_server.core import checkpoint
from ps_server.core.optim.optimizers import OptimizerSpec


class Var:
    """A model variable that keeps a digest of what it was given (its own copy, as Keras')."""

    def __init__(self, path, shape):
        self.path, self.shape, self.given = path, shape, None

    def assign(self, value):
        value = np.asarray(value)
        self.given = (value.dtype, value.shape, hashlib.sha256(value).hexdigest())


class Model:
    def __init__(self, shapes):
        self.trainable_variables = [Var(n, s) for n, s in shapes.items()]


def test_export_assigns_a_checkpoint_one_array_at_a_time(tmp_path, monkeypatch):
    from ps_tools.export import assign, load_source

    monkeypatch.setattr(checkpoint, "_CHUNK", 1 << 20)
    rng = np.random.default_rng(0)
    values = {f"m/dense_{i}/kernel": rng.standard_normal((1 << 18, 4)).astype(np.float32) for i in range(6)}  # 6 x 4 MiB
    state = checkpoint.ServerState(mode="async", num_workers=1, version=3, optimizer=OptimizerSpec("sgd"),
                                   values=values, states={n: {"iterations": 3} for n in values})
    checkpoint.write_checkpoint(str(tmp_path), state)
    model = Model({n: a.shape for n, a in values.items()})
    expected = {n: (a.dtype, a.shape, hashlib.sha256(a).hexdigest()) for n, a in values.items()}
    del state, values
    tracemalloc.start()
    try:
        _, source, _, _ = load_source(checkpoint=str(tmp_path))
        assign(model, source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert {v.path: v.given for v in model.trainable_variables} == expected
    assert peak < (4 << 20) + (1 << 20), peak  # one 4 MiB array read at a time, never the 24 MiB state


@pytest.fixture(scope="module")
def keras():
    from worker import model as models

    models.tf_setup(deterministic=True)
    import keras as keras_module

    return keras_module


def test_an_exported_model_holds_the_checkpoint_weights_and_adam_slots_bit_for_bit(tmp_path, keras):
    from ps_tools.export import export
    from worker import model as models

    keras.backend.clear_session()
    model = models.build_model("cnn")
    rng = np.random.default_rng(1)
    values = {v.path: rng.standard_normal(tuple(v.shape)).astype(np.float32) for v in model.trainable_variables}
    states = {n: {"m": rng.standard_normal(a.shape).astype(np.float32),
                  "v": np.abs(rng.standard_normal(a.shape)).astype(np.float32), "iterations": 5}
              for n, a in values.items()}
    state = checkpoint.ServerState(mode="async", num_workers=1, version=5,
                                   optimizer=OptimizerSpec("adam", learning_rate=0.01), values=values, states=states)
    path = checkpoint.write_checkpoint(str(tmp_path / "ckpt"), state)
    out = str(tmp_path / "model.keras")
    export(out, "cnn", checkpoint=path)
    loaded = keras.models.load_model(out)
    names = list(values)  # the order of the model's trainable variables (a loaded model's paths differ)
    assert len(loaded.trainable_variables) == len(names)
    for name, v in zip(names, loaded.trainable_variables):
        assert np.asarray(v.numpy()).tobytes() == values[name].tobytes(), name
    optimizer = loaded.optimizer
    for slot, attribute in (("m", "_momentums"), ("v", "_velocities")):
        for name, keras_slot in zip(names, getattr(optimizer, attribute)):
            assert np.asarray(keras_slot.numpy()).tobytes() == states[name][slot].tobytes(), (slot, name)
    assert int(optimizer.iterations.numpy()) == 5


def test_a_checkpoint_of_several_optimizers_exports_its_weights_and_says_the_optimizers_are_not_saved(
        tmp_path, keras):
    """``OptimizerSpec.groups`` (a model's own step applied two optimizers): ps-export's models
    compile one optimizer, so the file holds the weights and the summary says why no optimizer."""
    from ps_tools.export import export
    from worker import model as models

    keras.backend.clear_session()
    model = models.build_model("mlp")
    rng = np.random.default_rng(2)
    values = {v.path: rng.standard_normal(tuple(v.shape)).astype(np.float32) for v in model.trainable_variables}
    names = list(values)
    adam, sgd = OptimizerSpec("adam", learning_rate=0.01), OptimizerSpec("sgd", learning_rate=0.1)
    spec = OptimizerSpec("adam", learning_rate=0.01, groups=((tuple(names[:2]), adam), (tuple(names[2:]), sgd)))
    states = {n: {**({"m": np.zeros_like(a), "v": np.zeros_like(a)} if i < 2 else {}), "iterations": 3}
              for i, (n, a) in enumerate(values.items())}
    state = checkpoint.ServerState(mode="sync", num_workers=1, version=3, optimizer=spec, values=values,
                                   states=states)
    path = checkpoint.write_checkpoint(str(tmp_path / "ckpt"), state)
    summary = export(str(tmp_path / "model.keras"), "mlp", checkpoint=path)
    assert "not saved: the server runs 2 optimizers, each over its own variables" in summary
    loaded = keras.models.load_model(str(tmp_path / "model.keras"))
    for name, v in zip(names, loaded.trainable_variables):
        assert np.asarray(v.numpy()).tobytes() == values[name].tobytes(), name
