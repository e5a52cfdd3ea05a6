"""Workers on a GPU: sync parity with one process, and a ~100 MB model through push and pull.

    python -m pytest tests/gpu -q

The rules: sync with two workers, each computing on the GPU, ends within float rounding
of one process on the same GPU (``tests/cluster/keras_program.py``, digits, 2 epochs;
bound 1e-5 on the weights: a GPU's kernels need not be deterministic); a model of
25 M float32 parameters (100 MB) computed on the GPU is pushed whole and pulled back,
and the server's values are ``w - lr * g`` to the bit (SGD).
"""

from __future__ import annotations

import time

import numpy as np

from tests.cluster.test_keras_fit import alone, fit


def test_two_sync_workers_on_the_gpu_end_within_float_rounding_of_one_process(procs, tmp_path):  # noqa: F811
    records = fit(procs, tmp_path, "sync", "--epochs", "2")
    want = alone(tmp_path, "--epochs", "2")
    for got, ref in zip(records[0]["weights"], want["weights"]):
        np.testing.assert_allclose(np.array(got), np.array(ref), rtol=0, atol=1e-5)


def test_a_100_mb_model_computed_on_the_gpu_is_pushed_and_pulled_to_the_bit(tmp_path):
    import keras
    import tensorflow as tf

    from ps_server.config import ServerConfig
    from ps_server.server import build_server
    from worker import api

    running = build_server(ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=1)).start()
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5000,)), keras.layers.Dense(5000, use_bias=False)])
        model.compile(loss="mse")
        x = tf.random.stateless_normal((8, 5000), seed=(1, 2))
        with api.Session(model, ps=running.address, worker_index=0, num_workers=1, optimizer="sgd",
                         learning_rate=0.1) as session:
            session.pull()
            before = model.trainable_variables[0].numpy().copy()
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x)))
            grad = tape.gradient(loss, model.trainable_variables)[0]
            start = time.monotonic()
            session.push([grad], float(loss), batch_size=8)
            session.pull()
            seconds = time.monotonic() - start
        want = before - np.float32(0.1) * grad.numpy()
        assert model.trainable_variables[0].numpy().tobytes() == want.tobytes()
        print(f"100 MB push and pull: {seconds:.2f} s on {grad.device or 'the CPU'}")
    finally:
        running.stop(grace=0.5)
