"""The cells of docs/combinations.md for ``tfps.keras`` and ``Session``, run for real.

    python -m pytest -q tests/worker/test_combinations.py

Every test starts real servers in this process (the ``server`` fixture, port 0) and
trains one small model through a front door with one feature on, then compares the
result with what the feature promises:
- shared memory (``shm=True``): the very bits of the default transport, and the server
  received the pushes' headers only;
- float16 / bfloat16 on the wire (``grad_wire_dtype``): the bits of a reference that
  rounds each gradient to that dtype, within a stated bound of the float32 run, and half
  the bytes received;
- backup workers (``replicas_to_aggregate=1`` of two): every round applies one
  contributor's gradient, the other push of the round is answered ``dropped``;
- a link cut between steps: ridden out (``Session.rejoin``, the Keras step's own
  ride-out), ending on the uncut run's bits.
"""

from __future__ import annotations

import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from worker import api
from worker.keras import Strategy

from .conftest import received_bytes

LR = 0.1


def batches(n: int, width: int, size: int = 8, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, width)).astype(np.float32), rng.normal(size=(size, 1)).astype(np.float32))
            for _ in range(n)]


def dense_model(width: int, hidden: int = 0):
    """Named, so that two of them in one process have the same variable paths (two workers)."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(hidden, name="hidden")] if hidden else []
    return keras.Sequential([keras.Input((width,)), *layers, keras.layers.Dense(1, name="out")], name="net")


def gradients(model, x, y) -> list:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return loss, tape.gradient(loss, model.trainable_variables)


def session_run(model, data, before_step=None, **flags) -> tuple[list[bytes], object]:
    """A hand-written SGD loop over ``data`` through a Session, riding out a lost server as
    the Session's docstring says; the final weights' bytes, and its (closed) connection."""
    with api.Session(model, optimizer="sgd", learning_rate=LR, **flags) as session:
        for i, (x, y) in enumerate(data):
            if before_step:
                before_step(i)
            while True:
                try:
                    session.pull()
                    loss, grads = gradients(model, x, y)
                    session.push(grads, float(loss), batch_size=len(x))
                    break
                except api.PSClientError as e:
                    if not api.recoverable(e):
                        raise
                    session.rejoin(e)
        session.pull()
    return [v.numpy().tobytes() for v in model.trainable_variables], session.connection


def fit_run(model, data, callbacks=(), **flags) -> tuple[list[bytes], object]:
    """``model.fit`` of ``model`` (built, not compiled) on ``data``'s batches, one epoch, SGD;
    the final weights' bytes and the strategy's (closed) connection."""
    strategy = Strategy(num_workers=1, **flags)
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    x, y = (np.concatenate(parts) for parts in zip(*data))
    model.fit(x, y, batch_size=len(data[0][0]), epochs=1, shuffle=False, verbose=0, callbacks=list(callbacks))
    connection = strategy.connection
    strategy.close()
    return [v.numpy().tobytes() for v in model.trainable_variables], connection


def payload_bytes(model) -> int:
    return sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)


# -- shared memory ------------------------------------------------------------------------
@pytest.mark.parametrize("door", ["session", "keras"])
def test_shared_memory_gives_the_default_transport_s_bits_and_carries_the_gradients(server, door):
    """Sync, one worker, a model of 1.4 MB (over the 1 MiB a push sends as one unary message):
    the same bits with and without ``shm=True``; with it the server received the pushes'
    headers only (``tfps_received_bytes_total``), without it every gradient."""
    data = batches(4, 600)
    run = session_run if door == "session" else fit_run
    results = {}
    for shm in (False, True):
        running = server("sync", 1, metrics=True)
        weights, connection = run(dense_model(600, 600), data, ps=running.address, shm=shm)
        client = connection.client
        results[shm] = weights, received_bytes(running), client.shm and client.shm_fallback_reason is None
    size = payload_bytes(dense_model(600, 600))
    assert results[True][0] == results[False][0]
    assert results[False][1] >= 4 * size and results[False][2] is False
    assert results[True][1] < 0.01 * size and results[True][2] is True


# -- float16 / bfloat16 on the wire -----------------------------------------------------------
def rounded(g: np.ndarray, dtype: str) -> np.ndarray:
    """``g`` rounded to ``dtype`` and widened back, as TensorFlow casts (round to nearest even)."""
    return tf.cast(tf.cast(g, dtype), tf.float32).numpy()


def rounded_reference(data, dtype: str) -> list[bytes]:
    """One process: SGD on the gradients of ``data`` rounded to ``dtype`` (w - lr * round(g))."""
    model = dense_model(8, 64)
    for x, y in data:
        _, grads = gradients(model, x, y)
        for v, g in zip(model.trainable_variables, grads):
            v.assign(v.numpy() - np.float32(LR) * rounded(g.numpy(), dtype))
    return [v.numpy().tobytes() for v in model.trainable_variables]


# Relative precision of the wire dtype: a rounded gradient is within EPS * |g| of the exact one.
EPS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("door", ["session", "keras"])
def test_a_half_precision_wire_steps_on_the_rounded_gradients_within_its_precision_of_float32(server, door,
                                                                                                 dtype):
    """Sync, one worker, five SGD steps: the half-precision run is bit for bit the one-process
    SGD on each gradient rounded to ``dtype`` (the server widens exactly); it differs from the
    float32 run by at most steps x lr x max|g| x EPS (each step's rounding moves a weight by at
    most lr x |g| x EPS; what that changes in later gradients is far smaller here: the measured
    difference is a fifth of the bound); and the server received about half the bytes."""
    data = batches(5, 8)
    run = session_run if door == "session" else fit_run
    results = {}
    for wire in ("float32", dtype):
        running = server("sync", 1, metrics=True)
        weights, _ = run(dense_model(8, 64), data, ps=running.address, grad_wire_dtype=wire)
        results[wire] = [np.frombuffer(w, np.float32) for w in weights], received_bytes(running)
    half, full = results[dtype][0], results["float32"][0]
    if door == "session":
        assert [w.tobytes() for w in half] == rounded_reference(data, dtype)
    else:  # Keras' compiled loss is the same mean squared error, reduced in its own order: a few ulps
        np.testing.assert_allclose(np.concatenate(half), np.concatenate(
            [np.frombuffer(w, np.float32) for w in rounded_reference(data, dtype)]), rtol=0, atol=1e-6)
    g_max = max(float(np.max(np.abs(g))) for x, y in data for g in gradients(dense_model(8, 64), x, y)[1])
    bound = len(data) * LR * g_max * EPS[dtype]
    difference = max(float(np.max(np.abs(a - b))) for a, b in zip(half, full))
    assert 0 < difference <= bound, (difference, bound)
    assert results[dtype][1] < 0.75 * results["float32"][1]


# -- backup workers ---------------------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 2])
def test_a_session_with_backup_workers_applies_one_contributor_per_round_and_drops_the_other(server, shards):
    """Two Sessions, ``replicas_to_aggregate=1``, taking turns in one thread: each round
    completes with the first push (w - lr * g of that worker alone, to the bit), and the
    other worker's push for that round is answered ``dropped`` and moves it to the next.
    Over two shards shard 0 picks the contributor and shard 1 steps with it alike."""
    runnings = [server("sync", 2, replicas_to_aggregate=1) for _ in range(shards)]
    models = [dense_model(8), dense_model(8)]
    sessions = [api.Session(m, ps=",".join(r.address for r in runnings), worker_index=i, num_workers=2,
                            optimizer="sgd", learning_rate=LR) for i, m in enumerate(models)]
    reference = dense_model(8)
    rounds = 6
    try:
        for r, (x, y) in enumerate(batches(rounds, 8)):
            first = r % 2
            for i in (first, 1 - first):
                sessions[i].pull()
                loss, grads = gradients(models[i], x, y)
                reply = sessions[i].push(grads, float(loss), batch_size=len(x))
                assert (reply.dropped, reply.version) == (i != first, r + 1)
                if i == first:
                    _, want = gradients(reference, x, y)
                    for v, g in zip(reference.trainable_variables, want):
                        v.assign(v.numpy() - np.float32(LR) * g.numpy())
        sessions[0].pull()
        statuses = [r.core.status() for r in runnings]
    finally:
        for s in sessions:
            s.close()
    assert [v.numpy().tobytes() for v in models[0].trainable_variables] == \
        [v.numpy().tobytes() for v in reference.trainable_variables]
    for status in statuses:
        assert (status.version, status.pushes_applied, status.pushes_dropped) == (rounds, rounds, rounds)
        assert [w.dropped for w in sorted(status.workers, key=lambda w: w.worker_id)] == [rounds // 2] * 2


@pytest.mark.parametrize("shards", [1, 2])
def test_a_keras_fit_with_backup_workers_applies_one_contributor_per_round(server, shards):
    """Two workers' ``model.fit`` in two threads, ``replicas_to_aggregate=1``: each of their
    2 x 8 pushes is either a round's one contributor or answered ``dropped``, so the server's
    rounds are its applied pushes; both fits end, on the server's parameters, with a lower loss.
    Over two shards, both count the same contributors (shard 0 picks them)."""
    runnings = [server("sync", 2, replicas_to_aggregate=1) for _ in range(shards)]
    running = runnings[0]
    data = batches(8, 8, size=16)
    x, y = (np.concatenate(parts) for parts in zip(*data))
    models, strategies, errors = [], [], []
    for i in range(2):
        strategy = Strategy(ps=",".join(r.address for r in runnings), worker_index=i, num_workers=2)
        model = dense_model(8)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        strategy.attach(model)
        models.append(model)
        strategies.append(strategy)
    start_loss = float(np.mean((dense_model(8)(x).numpy() - y) ** 2))

    def fit(model):
        try:
            model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        except BaseException as e:  # noqa: BLE001 - the test thread reports it
            errors.append(e)

    threads = [threading.Thread(target=fit, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    status = running.core.status()
    for other in runnings[1:]:
        them = other.core.status()
        assert (them.version, them.pushes_applied, [w.pushes for w in them.workers]) == \
            (status.version, status.pushes_applied, [w.pushes for w in status.workers])
    losses = [float(m.evaluate(x, y, verbose=0)) for m in models]  # each loads the server's parameters
    for s in strategies:
        s.close()
    assert status.pushes_applied + status.pushes_dropped == 2 * len(data)
    assert status.version == status.pushes_applied >= len(data)
    assert losses[0] == losses[1] < start_loss


# -- a link cut -------------------------------------------------------------------------------
class CutBetweenSteps:
    """Cuts ``proxy`` before step ``at`` and restores it (a thread) once the worker has tried to
    connect through the cut (a refused connection: its call failed with UNAVAILABLE) and
    ``for_s`` seconds have passed; the front door's ride-out must take it. Restoring on a
    timer alone let a worker slowed by a busy machine make its next call after the cut had
    ended, with nothing to ride out. After ``limit_s`` without an attempt it restores anyway
    (the test then fails on the missing second registration)."""

    def __init__(self, proxy, at: int, for_s: float = 0.5, limit_s: float = 30.0):
        self.proxy, self.at, self.for_s, self.limit_s = proxy, at, for_s, limit_s
        self.timer: threading.Thread | None = None
        self.dropped = -1

    def __call__(self, step: int) -> None:
        if step == self.at:
            refused = self.proxy.refused
            self.dropped = self.proxy.cut()
            self.timer = threading.Thread(target=self._restore, args=(refused,), name="restore", daemon=True)
            self.timer.start()

    def _restore(self, refused: int) -> None:
        start = time.monotonic()
        while time.monotonic() - start < self.limit_s and (
                self.proxy.refused == refused or time.monotonic() - start < self.for_s):
            time.sleep(0.05)
        self.proxy.restore()


@pytest.mark.recovery
@pytest.mark.parametrize("door", ["session", "keras"])
def test_a_link_cut_between_steps_is_ridden_out_and_ends_on_the_uncut_run_s_bits(server, door):
    """Sync, one worker through a TCP proxy that drops every connection before step 3 and
    refuses new ones for 0.5 s (a lease of 10 s: no death). ``Session.rejoin`` in the loop
    (``tfps.keras``: its step's ride-out) registers again and the batch is trained once:
    the final weights are the uncut run's, bit for bit, and the worker came back through a
    new connection and registered a second time."""
    from tests.chaos.test_worker_faults import CuttableProxy

    data = batches(6, 8)
    undisturbed = server("sync", 1, metrics=True)
    if door == "session":
        uncut, _ = session_run(dense_model(8, 16), data, ps=undisturbed.address)
    else:
        uncut, _ = fit_run(dense_model(8, 16), data, ps=undisturbed.address)
    running = server("sync", 1, metrics=True)
    proxy = CuttableProxy(running.address)
    cut = CutBetweenSteps(proxy, at=3)
    try:
        if door == "session":
            weights, _ = session_run(dense_model(8, 16), data, before_step=cut, ps=proxy.address)
        else:
            at_batch = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: cut(batch))
            weights, _ = fit_run(dense_model(8, 16), data, callbacks=[at_batch], ps=proxy.address)
        cut.timer.join()
        assert cut.dropped >= 1 and proxy.connections >= 2
    finally:
        proxy.close()
    assert weights == uncut
    assert received_bytes(running, "Register") == 2 * received_bytes(undisturbed, "Register")  # it rejoined
    status = running.core.status()
    assert (status.version, status.rounds_aborted, status.rounds_timed_out) == (len(data), 0, 0)


# -- sparse rows ------------------------------------------------------------------------------
def embedding_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(1000, 8, name="emb"),
                             keras.layers.Flatten(), keras.layers.Dense(1, name="out")], name="lookup")


def id_batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches of 8 x 3 ids out of 0..4: every batch looks some id up more than once."""
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 5, size=(8, 3)).astype(np.int32), rng.normal(size=(8, 1)).astype(np.float32))
            for _ in range(n)]


@pytest.mark.parametrize("rule", ["keras", "sum"])
def test_a_session_pushes_an_embedding_s_repeated_rows_and_the_server_steps_them_by_its_rule(server, rule):
    """Four Adagrad steps of a hand-written tape through a Session, an Embedding of 1000 x 8 looked
    up with repeated ids: a push carries the touched rows, not the 32 KB table; ``sparse_rule``
    "keras" ends on one-process Keras' ``apply_gradients`` of the same ``tf.IndexedSlices``, to the
    bit; "sum" on the same step of those gradients made dense (the occurrences summed first)."""
    data = id_batches(4)
    running = server("sync", 1, sparse_rule=rule, metrics=True)
    model = embedding_model()
    with api.Session(model, ps=running.address, optimizer="adagrad", learning_rate=LR) as session:
        for x, y in data:
            session.pull()
            loss, grads = gradients(model, x, y)
            assert isinstance(grads[0], tf.IndexedSlices)
            session.push(grads, float(loss), batch_size=len(x))
        session.pull()
    reference = embedding_model()
    optimizer = keras.optimizers.Adagrad(LR)
    for x, y in data:
        _, grads = gradients(reference, x, y)
        optimizer.apply_gradients(zip(grads if rule == "keras" else [tf.convert_to_tensor(g) for g in grads],
                                      reference.trainable_variables))
    got, want = ([v.numpy() for v in m.trainable_variables] for m in (model, reference))
    if rule == "keras":
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
    else:
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert received_bytes(running) < len(data) * 0.25 * 1000 * 8 * 4  # rows of at most 5 ids, not the table


def test_a_keras_fit_pushes_an_embedding_s_gradient_as_rows(server):
    """``model.fit`` with an Embedding of 1000 x 8: the server received, per push, far less than
    the 32 KB table (8 x 3 ids touch at most 24 rows: 24 x (8 x 4 + 8) bytes)."""
    running = server("sync", 1, metrics=True)
    data = id_batches(4)
    fit_run(embedding_model(), data, ps=running.address)
    assert received_bytes(running) < len(data) * (24 * (8 * 4 + 8) + 1000)


@pytest.mark.parametrize("mode, width, hidden", [("sync", 6, 4), ("async", 6, 4), ("sync", 1200, 120)])
def test_a_session_over_two_shards_with_global_clipnorm_gives_one_server_s_bits(server, mode, width, hidden):
    """``global_clipnorm`` (``--global-clipnorm``) over two shards: the shards take one norm
    together (ps_server/core/clip_group.py), so a Session's loop ends on one server's bits;
    the clip norm is small enough that every step clips. A 576 KB kernel, which the planner
    would cut in slices, stays whole under a norm (``worker.sharding.norms_of``)."""
    data = batches(4, width)
    runs = []
    for shards in (1, 2):
        address = ",".join(server(mode, 1).address for _ in range(shards))
        bits, connection = session_run(dense_model(width, hidden=hidden), data, ps=address, global_clipnorm=0.05)
        runs.append(bits)
        placement = getattr(connection.client, "placement", None)
        assert placement is None or all(p.parts == 1 for p in placement.pieces)
    assert runs[0] == runs[1]
    unclipped = session_run(dense_model(width, hidden=hidden), data, ps=server(mode, 1).address)[0]
    assert unclipped != runs[0]  # the norm did clip


def _embedding_data():
    x, y = (np.concatenate(parts) for parts in zip(*id_batches(4)))
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8)


def _compiled_embedding_model():
    model = embedding_model()
    model.compile(loss="mse")
    return model


@pytest.mark.parametrize("rule", ["keras", "sum"])
def test_the_ps_worker_loop_pushes_an_embedding_s_repeated_rows_and_the_server_steps_them_by_its_rule(
        server, tmp_path, rule):
    """The ``ps-worker`` loop (``api.train``, the same ``worker.engine.Engine``) on your
    Embedding model and data, four Adagrad steps with repeated ids: it pushes the touched
    rows, and the server's rule decides the step: "keras" ends on Keras' ``apply_gradients``
    of the ``tf.IndexedSlices``, "sum" on that of the gradients made dense (within 1e-6: the
    loop's loss is the compiled one, the reference's the same function eagerly)."""
    running = server("sync", 1, sparse_rule=rule, metrics=True)
    saved = tmp_path / "final.npz"
    api.train(_compiled_embedding_model, _embedding_data, ps=running.address, worker_index=0, num_workers=1,
              optimizer="adagrad", learning_rate=LR, global_batch_size=8, epochs=1, save_weights=str(saved))
    got = np.load(saved)
    reference = embedding_model()
    optimizer = keras.optimizers.Adagrad(LR)
    for x, y in id_batches(4):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, reference(x))
        grads = tape.gradient(loss, reference.trainable_variables)
        optimizer.apply_gradients(zip(grads if rule == "keras" else [tf.convert_to_tensor(g) for g in grads],
                                      reference.trainable_variables))
    for v in reference.trainable_variables:
        np.testing.assert_allclose(got[v.path.replace("/", "__")], v.numpy(), rtol=1e-6, atol=1e-7, err_msg=v.path)
    assert received_bytes(running) < 4 * 0.25 * 1000 * 8 * 4  # rows of at most 5 ids, not the table
