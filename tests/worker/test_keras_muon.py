"""Keras' ``Muon`` compiled under ``tfps.keras``: the server steps it, ``model.save`` holds its state.

    python -m pytest tests/worker/test_keras_muon.py -q

One worker's fit against a real in-process server, against one-process ``model.fit`` (eager) on
the same data: an Embedding (the AdamW rule, by its name, its gradient ``IndexedSlices``), a
hidden Dense kernel (the Muon rule), an output layer sent to AdamW by ``exclude_layers``. The
server's matrix products are NumPy's (``ps_server.core.optim.muon``), a few units in the last
place from TensorFlow's, and every later gradient carries that on: weights and optimizer
variables agree within ``ATOL`` (measured: 2.4e-7 after 6 steps), where a variable stepped by
the wrong rule, or a slot loaded into the wrong one, is 1e-3 and more apart.
"""

import contextlib

import keras
import numpy as np

from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.keras import Strategy

ATOL = 1e-6


def fitted(strategy=None):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 6, size=(48, 3)).astype(np.int32), rng.normal(size=(48, 1)).astype(np.float32)
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(12, 4, name="embedding"),
                                  keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh", name="hidden"),
                                  keras.layers.Dense(1, name="out")], name="net")
        model.compile(optimizer=keras.optimizers.Muon(learning_rate=0.02, exclude_layers=["/out/"]), loss="mse",
                      run_eagerly=strategy is None)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


def test_a_muon_fit_on_the_server_ends_where_model_fit_ends_and_model_save_holds_its_state(tmp_path):
    plain = fitted()
    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=1)).start()
    try:
        strategy = Strategy(ps=running.address, num_workers=1)
        model = fitted(strategy)
        model.save(str(tmp_path / "muon.keras"))  # under tfps: the server's state first (load_state)
        strategy.close()
    finally:
        running.stop(grace=0.5)
    for ours, theirs in zip(model.trainable_variables, plain.trainable_variables):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=ATOL, err_msg=ours.path)
    o, p = model.optimizer, plain.optimizer
    assert [v.path for v in model.trainable_variables] == [v.path for v in plain.trainable_variables]  # net/...
    assert [v is None for v in o.adam_velocities] == [v is None for v in p.adam_velocities] == \
        [False, True, False, False, False]  # the hidden kernel alone by the Muon rule
    assert int(o.iterations) == int(p.iterations) == 6
    for ours, theirs in zip(o.momentums + [v for v in o.adam_velocities if v is not None],
                            p.momentums + [v for v in p.adam_velocities if v is not None]):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=ATOL, err_msg=ours.path)
