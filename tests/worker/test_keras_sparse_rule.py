"""``ps-server --sparse-rule`` seen from a user's ``model.fit`` on ``tfps.keras``.

    python -m pytest tests/worker/test_keras_sparse_rule.py -q

One worker's fit in this process against a real in-process server, an Embedding looked up
with repeated ids in every batch, against one-process Keras ``model.fit`` on the same data:
- no rule given (the default: tfps.keras' optimizer asks "keras") and rule "keras" end with
  Keras' own weights, bit for bit (the worker pushed every occurrence, the server stepped
  them as Keras does);
- rule "sum" ends elsewhere on the table: the repeated rows were summed first.
"""

import keras
import numpy as np
import pytest

from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.keras import Strategy

VOCAB, BATCH = 12, 8


def data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, size=(32, 3)).astype(np.int32)  # ids 0..4 only: every batch repeats some
    return x, rng.normal(size=(32, 1)).astype(np.float32)


def build(optimizer, run_eagerly: bool = False):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(VOCAB, 4),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False, run_eagerly=run_eagerly)
    return model


def on_tfps(rule: str, optimizer) -> list:
    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=1,
                                        sparse_rule=rule)).start()
    try:
        strategy = Strategy(ps=running.address, num_workers=1)
        with strategy.scope():
            model = build(optimizer)
        model.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        assert strategy.connection.sparse_rule == (rule or "keras")
        strategy.close()
        return [v.numpy() for v in model.trainable_variables]
    finally:
        running.stop(grace=0.5)


@pytest.mark.parametrize("cls", ["Adam", "Adagrad", "ScheduleFreeAdamW"])
def test_the_default_and_rule_keras_end_a_fit_with_one_process_keras_weights_and_rule_sum_does_not(cls):
    """Against Keras' fit run eagerly: its compiled step (a tf.function) is Grappler's, which
    rounds Adagrad's step 1 ulp apart after 4 steps here (docs/sparse.md; Adam: the same bits)."""
    model = build(getattr(keras.optimizers, cls)(learning_rate=0.1), run_eagerly=True)
    model.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    want = [v.numpy() for v in model.trainable_variables]
    for rule in ("", "keras"):
        keras_rule = on_tfps(rule, getattr(keras.optimizers, cls)(learning_rate=0.1))
        assert [w.tobytes() for w in keras_rule] == [w.tobytes() for w in want], \
            f"{rule!r}: max difference {max(float(np.max(np.abs(a - b))) for a, b in zip(keras_rule, want))}"
    summed = on_tfps("sum", getattr(keras.optimizers, cls)(learning_rate=0.1))
    assert summed[0].tobytes() != want[0].tobytes()  # the embedding: repeated rows summed first
