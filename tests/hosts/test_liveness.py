"""A worker whose bytes are crossing a slow link is alive: no lease runs out under it.

    python -m pytest -q -m '' tests/hosts/test_liveness.py

Real emulated hosts (``ps_tools.hosts``), every link shaped to 10 Mbit/s, and a model of
your own of 30 MB (a Dense layer of 7.5M parameters): the chief's Initialize, each pull
and each push take about 25 s to cross, two and a half of the default lease (10 s,
``--lease-timeout``). One server and one worker per mode, sync, async and ssp, side by
side on six hosts, two steps each, with the default lease and heartbeat: every job ends
with its two steps applied and no worker was ever declared dead.

Before, the heartbeat started only once the chief's Initialize had finished, and it
shared the data connection, where its bytes queued behind the push's in the socket
buffer: a worker sending its first 30 MB was declared dead ten seconds in. Now the lease
is renewed from the start of the join, over a connection of the heartbeats' own
(``worker.client.PSClient.heartbeat``).
"""

from __future__ import annotations

import pytest

from tests.hosts.conftest import PORT, read_log, wait_exit

pytestmark = pytest.mark.hosts


# About 170 s: slow, to keep the default run under 40 minutes.

MODULE = '''
import keras
import numpy as np
import tensorflow as tf


def build():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2500,)), keras.layers.Dense(3000), keras.layers.Dense(1)])
    model.compile(loss="mse")
    return model


def data(ctx):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 2500)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
    return (tf.data.Dataset.from_tensor_slices((x, y)).batch(ctx.global_batch_size),
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
'''
MODES = ("sync", "async", "ssp")


@pytest.mark.slow
def test_a_push_that_takes_several_lease_periods_to_cross_leaves_its_worker_alive_in_every_mode(
        host_cluster, tmp_path):
    (tmp_path / "bigmod.py").write_text(MODULE)
    names = [f"tfps-{role}-{m}" for m in MODES for role in ("ps", "worker")]
    c = host_cluster(names, rate="10mbit")
    servers = {}
    for m in MODES:
        host = f"tfps-ps-{m}"
        servers[m] = c.server(host, "--host", "0.0.0.0", "--port", str(PORT), "--mode", m, "--num-workers", "1",
                              *(("--staleness", "1") if m == "ssp" else ()))
        c.wait_serving(host, f"{host}:{PORT}", servers[m])
    workers = {m: c.worker(f"tfps-worker-{m}", "--ps", f"tfps-ps-{m}:{PORT}", "--worker-index", "0",
                           "--num-workers", "1", "--model", "bigmod:build", "--dataset", "bigmod:data",
                           "--steps", "2", "--global-batch-size", "32", "--log-level", "INFO")
               for m in MODES}
    for m in MODES:
        assert wait_exit(workers[m], 400) == 0, f"{m}:\n{read_log(workers[m])[-3000:]}\n{read_log(servers[m])[-3000:]}"
    for m in MODES:
        status = c.status(f"tfps-ps-{m}", f"tfps-ps-{m}:{PORT}")
        log = read_log(servers[m])
        assert "declared dead" not in log, f"{m}:\n{log[-3000:]}"
        assert status["pushes_applied"] == 2 and not any(w["dead"] for w in status["workers"]), (m, status)
