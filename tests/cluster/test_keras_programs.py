"""Keras programs as the keras.io guides write them, each run as one plain process (or under
TensorFlow's MirroredStrategy over two logical CPUs) and under tfps with the strategy line
changed: real servers, one process per worker (``test_keras_fit.fit``).

The bounds: sync with two workers ends within float rounding of one process where the
program has no per-replica state (the mean of two halves' gradients against one batch's:
1e-6 on weights of order 0.1-1 after 32 steps); where it has (BatchNormalization's batch
statistics are each worker's part's, as each replica's are), it ends where
MirroredStrategy(2) ends, its trainable weights to the bit.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from worker.client import PSClient

from .conftest import ROOT
from .test_keras_fit import alone, fit

pytestmark = pytest.mark.cluster

CUSTOM_STEP = os.path.join(ROOT, "tests", "cluster", "programs", "custom_step.py")
GAN = os.path.join(ROOT, "tests", "cluster", "programs", "gan.py")
MIXED = os.path.join(ROOT, "tests", "cluster", "programs", "mixed_precision.py")
GAN_MIXED = os.path.join(ROOT, "tests", "cluster", "programs", "gan_mixed_precision.py")
TEXT = os.path.join(ROOT, "tests", "cluster", "programs", "text_two_outputs.py")
LSTM_RMSPROP = os.path.join(ROOT, "tests", "cluster", "programs", "lstm_rmsprop.py")
RUNNING_MAX = os.path.join(ROOT, "tests", "cluster", "programs", "running_max.py")


def gap(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(np.array(x) - np.array(y)))) for x, y in zip(a["weights"], b["weights"]))


def two_shards(procs) -> str:
    """Two new sync servers' addresses, as ``--ps`` lists shards."""
    return ",".join(procs.server("sync", 2)[1] for _ in range(2))


def test_an_overridden_train_step_runs_under_sync_over_two_shards_as_in_one_process(procs, tmp_path):
    """The guide's ``train_step`` (tape, ``self.optimizer.apply``, its own loss tracker and metric)
    runs as written; the server steps the optimizer. Over two shards (one server's bits:
    ``test_each_row_over_two_shards_is_one_server_s_bits``; one server: the next test)."""
    plain = alone(tmp_path, "--no-norm", program=CUSTOM_STEP)
    two = fit(procs, tmp_path, "sync", "--no-norm", address=two_shards(procs), program=CUSTOM_STEP)
    assert gap(two[0], plain) < 1e-6 and two[0]["weights"] == two[1]["weights"]
    assert two[0]["iterations"] == plain["iterations"] == 32
    assert two[0]["history"] == two[1]["history"]  # the global batch's, on every worker
    assert two[0]["history"]["accuracy"] == plain["history"]["accuracy"]
    np.testing.assert_allclose(two[0]["history"]["loss"], plain["history"]["loss"], rtol=1e-6)


def test_an_overridden_train_step_with_batch_normalization_ends_where_mirrored_strategy_ends(procs, tmp_path):
    """Each worker's BatchNormalization normalizes by its part's statistics, as each replica's
    does: the trainable weights are MirroredStrategy(2)'s to the bit. (The moving statistics
    are the mean of the workers'; MirroredStrategy keeps each replica's own.)"""
    mirrored = alone(tmp_path, program=CUSTOM_STEP, how="--mirrored")
    ours = fit(procs, tmp_path, "sync", program=CUSTOM_STEP)
    trainable = [0, 1, 2, 3, 6, 7]  # hidden kernel and bias, gamma, beta, logits kernel and bias
    assert [ours[0]["weights"][i] for i in trainable] == [mirrored["weights"][i] for i in trainable]
    assert ours[0]["history"]["accuracy"] == mirrored["history"]["accuracy"]


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_overridden_train_step_trains_async_and_ssp(procs, tmp_path, mode):
    """Each push applied on arrival (ssp: within its bound): every worker's own step, served."""
    records = fit(procs, tmp_path, mode, "--no-norm", program=CUSTOM_STEP)
    assert len(records) == 2
    assert all(r["history"]["accuracy"][-1] > 0.7 for r in records), [r["history"] for r in records]
    assert max(r["iterations"] for r in records) == 64  # the server's: 2 workers x 2 epochs x 16 steps


def test_two_optimizers_applied_to_one_variable_under_sync_end_where_one_process_ends(procs, tmp_path):
    """``--twice``: the guide's step applies Adam, then SGD with momentum, to every variable.
    The server keeps each optimizer's state of each variable, SGD's by its second name
    (``ps_common.names.shared_name``), and steps the one value from the other's update: two
    sync workers over two server shards end within 1e-6 of one process (the mean of two halves'
    gradients against one batch's, twice a step). Shards against one server, to the bit, a
    variable cut in slices too: tests/worker/test_sharded_groups.py and test_keras_strategy.py.
    Async and ssp: ``test_two_optimizers_applied_to_one_variable_train_async_and_ssp``."""
    plain = alone(tmp_path, "--no-norm", "--twice", program=CUSTOM_STEP)
    ours = fit(procs, tmp_path, "sync", "--no-norm", "--twice", address=two_shards(procs), program=CUSTOM_STEP)
    assert gap(ours[0], plain) < 1e-6 and ours[0]["weights"] == ours[1]["weights"]
    assert ours[0]["iterations"] == plain["iterations"] == 32


@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.slow)])
def test_two_optimizers_applied_to_one_variable_train_async_and_ssp(procs, tmp_path, mode):
    """Each push applied on arrival: each apply of a step one push, of its optimizer's state."""
    records = fit(procs, tmp_path, mode, "--no-norm", "--twice", program=CUSTOM_STEP)
    assert len(records) == 2
    assert all(r["history"]["accuracy"][-1] > 0.7 for r in records), [r["history"] for r in records]


CHECKPOINT_RESUME = os.path.join(ROOT, "tests", "cluster", "programs", "checkpoint_resume.py")


def resumed(tmp_path, name: str, file) -> dict:
    """One plain process: ``load_model(file)`` and one more epoch."""
    return alone(tmp_path / name, "--resume", str(file), program=CHECKPOINT_RESUME, how="")


def test_a_keras_file_written_under_tfps_resumes_in_one_process_as_the_plain_file_does(procs, tmp_path):
    """``ModelCheckpoint`` to ``.keras`` writes the server's optimizer state (Adam's moments and
    step count): one sync worker's file is the plain run's, every variable to the bit, and so
    is what one process trains from it."""
    for name in ("plain", "one", "r-plain", "r-one"):
        (tmp_path / name).mkdir()
    plain = alone(tmp_path / "plain", program=CHECKPOINT_RESUME)
    one = fit(procs, tmp_path / "one", "sync", workers=1, program=CHECKPOINT_RESUME)[0]
    assert one["optimizer"] == plain["optimizer"] and one["weights"] == plain["weights"]
    assert len(plain["optimizer"]) == 10 and plain["iterations"] == 23  # iterations, rate, 4 m, 4 v
    after_plain = resumed(tmp_path, "r-plain", tmp_path / "plain" / "alone" / "model.keras")
    after_one = resumed(tmp_path, "r-one", tmp_path / "one" / "out" / "model.keras")
    assert after_one == after_plain and after_plain["iterations"] == 46


@pytest.mark.slow  # the state joined from two shards into a file: also tests/worker/test_keras_strategy.py's
# MultiOptimizer test (model.save over two shards, every optimizer variable the plain run's)
def test_a_keras_file_written_by_two_workers_over_two_shards_holds_the_optimizer_state(procs, tmp_path):
    """Two workers' file, over two server shards, holds the state (the weights then differ from
    one process's in the last bits, as the mean of two halves' gradients does)."""
    for name in ("plain", "two", "r-plain", "r-two"):
        (tmp_path / name).mkdir()
    plain = alone(tmp_path / "plain", program=CHECKPOINT_RESUME)
    after_plain = resumed(tmp_path, "r-plain", tmp_path / "plain" / "alone" / "model.keras")
    two = fit(procs, tmp_path / "two", "sync", address=two_shards(procs), program=CHECKPOINT_RESUME)[0]  # joined
    assert two["iterations"] == plain["iterations"] == 23
    after_two = resumed(tmp_path, "r-two", tmp_path / "two" / "out" / "model.keras")
    assert after_two["iterations"] == 46 and len(after_two["optimizer"]) == 10
    assert max(float(np.max(np.abs(np.array(a) - np.array(b))))
               for a, b in zip(after_two["weights"], after_plain["weights"])) < 1e-5


def test_a_gan_s_two_optimizers_are_each_served_and_end_where_one_process_and_mirrored_strategy_end(procs, tmp_path):
    """The discriminator's Adam, then the generator's (another learning rate) through the updated
    discriminator: each ``apply_gradients`` a round of its own variables on the server, each
    stepped by its own optimizer (``OptimizerSpec.groups``), the first loaded into the
    step's graph before the second tape runs. Sync, 2 workers: within 1e-6 of one process,
    MirroredStrategy(2)'s weights to the bit; each optimizer counts its own steps; over two
    server shards, one server's weights to the bit. Run eagerly: the next test; async and ssp:
    ``test_each_row_trains_async_and_ssp``."""
    plain = alone(tmp_path, program=GAN)
    mirrored = alone(tmp_path, program=GAN, how="--mirrored")
    ours = fit(procs, tmp_path, "sync", program=GAN)
    assert ours[0]["weights"] == mirrored["weights"] == ours[1]["weights"]
    assert gap(ours[0], plain) < 1e-6
    assert ours[0]["iterations"] == plain["iterations"] == [32, 32]
    np.testing.assert_allclose(ours[0]["history"]["d_loss"], plain["history"]["d_loss"], rtol=1e-6)
    (tmp_path / "two").mkdir()  # over two shards: a push of one optimizer's variables reaches every shard
    two = fit(procs, tmp_path / "two", "sync", address=two_shards(procs), program=GAN)
    assert two[0]["weights"] == ours[0]["weights"] and two[0]["iterations"] == [32, 32]


def test_a_gan_under_elastic_sync_is_two_rounds_a_batch_whose_bits_do_not_depend_on_who_computes(
        procs, tmp_path, monkeypatch):
    """``elastic=True`` (``TFPS_ELASTIC``): each batch is two rounds, the discriminator's update
    of every micro-batch, then the generator's through it. Two workers, each computing one of a
    round's two micro-batches, end at the bits of one worker computing both (a round's result is
    a function of its micro-batches alone), each optimizer counting its 16 updates of the epoch;
    the server counts 32 rounds and each example once. (One worker against ``model.fit``, to the
    bit: tests/worker/test_keras_strategy.py.)"""
    monkeypatch.setenv("TFPS_ELASTIC", "1")
    runs = []
    for workers in (2, 1):
        _, address = procs.server("sync", workers, extra=("--elastic-min-workers", str(workers),
                                                          "--micro-batches", "2"))
        (tmp_path / str(workers)).mkdir()
        runs.append(fit(procs, tmp_path / str(workers), "sync", "--epochs", "1", workers=workers, address=address,
                        program=GAN))
        with PSClient(address) as client:
            status = client.status()
        assert status.version == 32 and list(status.epoch_examples) == [1024]
    (two, other), (one,) = runs
    assert two["weights"] == other["weights"] == one["weights"]
    assert two["iterations"] == one["iterations"] == [16, 16]


@pytest.mark.parametrize("mode", ["async", pytest.param("ssp", marks=pytest.mark.slow)])  # ssp: the same queue
def test_a_gan_under_elastic_async_is_two_tasks_a_batch_each_applied_once(procs, tmp_path, monkeypatch, mode):
    """``elastic=True`` on async (ssp) tasks: each batch of 32 (64 / 2 workers) is two tasks, the
    discriminator's apply, then the generator's (``TaskQueue.applies``), each one push applied
    on arrival. Two workers take them as they come: the server counts 64 tasks done, each once,
    and each example of the epoch once. (One worker taking them in turn ends at ``model.fit``'s
    bits: tests/worker/test_keras_strategy.py.)"""
    monkeypatch.setenv("TFPS_ELASTIC", "1")
    _, address = procs.server(mode, 2)
    ours = fit(procs, tmp_path, mode, "--epochs", "1", address=address, program=GAN)
    with PSClient(address) as client:
        status = client.status()
    assert (status.tasks_total, status.tasks_done, status.version) == (64, 64, 64)
    assert list(status.epoch_examples) == [1024] and len(ours) == 2
    assert all(np.isfinite(np.array(w)).all() for w in ours[0]["weights"])


@pytest.mark.slow  # a plain run and two workers' of the GAN (~30 s); the default tier holds the same rule
# in one worker against model.fit, to the bit (tests/worker/test_keras_strategy.py, two optimizers' callbacks)
def test_a_callback_changing_a_gan_s_discriminator_rate_ends_where_one_process_ends(procs, tmp_path):
    """A user's callback sets ``d_optimizer.learning_rate`` at epoch 1's start: the chief's next
    push of the discriminator's variables carries it, the server sets that group's rate alone
    (the generator's stays 1e-3), and sync with two workers ends within 1e-6 of one process
    (the mean of two halves' gradients against one batch's, as without the callback; 3e-8
    measured, where the same run without the callback ends 8.4e-3 away)."""
    plain = alone(tmp_path, "--d-learning-rate-at-1", "1e-4", program=GAN)
    ours = fit(procs, tmp_path, "sync", "--d-learning-rate-at-1", "1e-4", program=GAN)
    assert gap(ours[0], plain) < 1e-6 and ours[0]["weights"] == ours[1]["weights"]
    np.testing.assert_allclose(ours[0]["history"]["d_loss"], plain["history"]["d_loss"], rtol=1e-6)
    rates = [float(np.float32(r)) for r in (3e-4, 1e-3, 1e-4, 1e-3)]  # (d's, g's) in epochs 0 and 1
    assert ours[0]["server_learning_rates"] == ours[1]["server_learning_rates"] == \
        rates[:2] * 16 + rates[2:] * 16  # 16 steps an epoch, each a push of d's variables, then g's


@pytest.mark.slow  # the GAN's sync run is the default tier's; run eagerly, the same step traced once more
def test_a_gan_run_eagerly_ends_where_one_process_ends(procs, tmp_path):
    """``run_eagerly=True``: the optimizers are found by tracing the step once before fit, and
    each eager step's first ``apply`` is pushed at once: within 1e-6 of one process."""
    plain = alone(tmp_path, program=GAN)
    eager = fit(procs, tmp_path, "sync", "--eagerly", program=GAN)
    assert gap(eager[0], plain) < 1e-6 and eager[0]["weights"] == eager[1]["weights"]
    assert eager[0]["iterations"] == [32, 32]


def test_mixed_float16_ends_where_mirrored_strategy_ends_and_an_overflow_skips_the_step_on_every_worker(
        procs, tmp_path):
    """``mixed_float16``: Keras' own step scales the loss, and the server steps the gradients
    unscaled as ``LossScaleOptimizer`` unscales them: sync with two workers is MirroredStrategy(2)'s
    weights to the bit (both 4.6e-3 from one process: float16 sums over half batches). An
    example that overflows float16 on worker 1 alone skips that round on both workers, as in one
    process: the same steps made, the same scale and counter; the weights stay within float16's
    rounding of one process's. That run is over two server shards: every shard skips the round
    (one server's bits: ``test_each_row_over_two_shards_is_one_server_s_bits``). Async and ssp:
    ``test_each_row_trains_async_and_ssp``."""
    (tmp_path / "plain").mkdir(), (tmp_path / "overflow").mkdir()
    mirrored = alone(tmp_path / "plain", program=MIXED, how="--mirrored")
    ours = fit(procs, tmp_path / "plain", "sync", program=MIXED)
    assert ours[0]["optimizer"] == "LossScaleOptimizer"
    assert ours[0]["weights"] == ours[1]["weights"] == mirrored["weights"]
    assert ours[0]["scale"] == mirrored["scale"] and ours[0]["iterations"] == mirrored["iterations"] == 32
    plain = alone(tmp_path / "overflow", "--overflow-batch", "3", program=MIXED)
    skipped = fit(procs, tmp_path / "overflow", "sync", "--overflow-batch", "3", program=MIXED,
                  address=two_shards(procs))
    assert plain["iterations"] == 30 and plain["scale"] == 32768.0 / 4  # one skip an epoch, each halving
    assert [(r["iterations"], r["scale"], r["step_counter"]) for r in skipped] == \
        [(plain["iterations"], plain["scale"], plain["step_counter"])] * 2
    assert skipped[0]["weights"] == skipped[1]["weights"] and gap(skipped[0], plain) < 0.05


def test_mixed_float16_with_gradient_accumulation_skips_a_batch_that_overflows_on_one_worker_on_every_worker(
        procs, tmp_path):
    """``mixed_float16`` with ``gradient_accumulation_steps=2``: one process skips a batch whose
    gradients are not finite, and the window waits for another (Keras' inner optimizer counts
    finite batches only). The overflowing example is in worker 1's part of batch 3: the workers
    vote on each batch of a window (``Strategy.vote``, on the server's broadcast board), so
    worker 0 skips it too, and both end with one process's updates, scale and counter, the
    weights within float16's rounding of its."""
    plain = alone(tmp_path, "--overflow-batch", "3", "--accumulate", "2", program=MIXED)
    ours = fit(procs, tmp_path, "sync", "--overflow-batch", "3", "--accumulate", "2", program=MIXED)
    assert plain["iterations"] == 15 and plain["scale"] == 32768.0 / 4  # 30 finite batches of 32; two skips
    assert [(r["iterations"], r["scale"], r["step_counter"]) for r in ours] == \
        [(plain["iterations"], plain["scale"], plain["step_counter"])] * 2
    assert ours[0]["weights"] == ours[1]["weights"] and gap(ours[0], plain) < 0.05


@pytest.mark.slow  # five runs of the GAN (~70 s); the default tier holds the same rule in one worker against
# model.fit, to the bit (tests/worker/test_keras_loss_scale.py)
def test_a_gan_in_half_precision_each_optimizer_under_its_own_loss_scale_ends_where_one_process_ends(
        procs, tmp_path):
    """A GAN under ``mixed_float16``, each optimizer in its own ``LossScaleOptimizer`` (the
    mixed-precision guide's custom loop): each ``apply`` a round of its own variables, its push
    carrying its own skip flag, its scale stepped on that round's agreed skip. Sync, 2 workers:
    MirroredStrategy(2)'s weights to the bit, within 5e-5 of one process (float16 sums over half
    batches: 1.4e-5 measured, MirroredStrategy's own distance). An image that overflows float16
    on worker 1 alone, in the discriminator's step alone, skips the discriminator's round on
    both workers and halves its scale alone, as one process does: the generator's updates go on,
    each optimizer at one process's iterations, scale and counter (1.2e-5 from its weights)."""
    (tmp_path / "plain").mkdir(), (tmp_path / "overflow").mkdir()
    plain = alone(tmp_path / "plain", program=GAN_MIXED)
    mirrored = alone(tmp_path / "plain", program=GAN_MIXED, how="--mirrored")
    ours = fit(procs, tmp_path / "plain", "sync", program=GAN_MIXED)
    assert ours[0]["weights"] == ours[1]["weights"] == mirrored["weights"] and gap(ours[0], plain) < 5e-5
    assert ours[0]["iterations"] == mirrored["iterations"] == plain["iterations"] == [32, 32]
    overflow = alone(tmp_path / "overflow", "--overflow-batch", "3", program=GAN_MIXED)
    skipped = fit(procs, tmp_path / "overflow", "sync", "--overflow-batch", "3", program=GAN_MIXED)
    assert overflow["iterations"] == [30, 32] and overflow["scales"] == [32768.0 / 4, 32768.0]  # d's: halved twice
    assert [(r["iterations"], r["scales"], r["step_counters"]) for r in skipped] == \
        [(overflow["iterations"], overflow["scales"], overflow["step_counters"])] * 2
    assert skipped[0]["weights"] == skipped[1]["weights"] and gap(skipped[0], overflow) < 5e-5
    np.testing.assert_allclose(skipped[0]["history"]["d_loss"], overflow["history"]["d_loss"], rtol=1e-4)


def test_a_text_model_with_two_outputs_and_steps_per_execution_ends_where_one_process_ends(procs, tmp_path):
    """TextVectorization, an Embedding (repeated rows, stepped by Keras' own rule by default),
    a GRU and two outputs, Adam, ``steps_per_execution=4`` over 22 batches an epoch (the last
    partial): sync with two workers ends within 1e-6 of one process (the mean of two halves'
    gradients against one batch's) with the same batch-end callbacks (6 an epoch) and step count,
    run over two server shards (one server's bits: ``test_each_row_over_two_shards_is_one_server_s_bits``;
    async and ssp: ``test_each_row_trains_async_and_ssp``). The logged losses, each output's too,
    are one process's, though the last batch divides 11 and 10: each worker's change to an
    output's loss tracker weighs as its share of the batch (Keras counts the step once)."""
    plain = alone(tmp_path, program=TEXT)
    ours = fit(procs, tmp_path, "sync", address=two_shards(procs), program=TEXT)
    assert ours[0]["weights"] == ours[1]["weights"] and gap(ours[0], plain) < 1e-6
    assert ours[0]["batch_ends"] == plain["batch_ends"] == [6, 6] and ours[0]["iterations"] == plain["iterations"]
    for key in ("loss", "cls_loss", "length_loss"):  # each output's too: the step traced as Keras traces it
        np.testing.assert_allclose(ours[0]["history"][key], plain["history"][key], rtol=1e-5)


def test_an_lstm_text_model_under_rmsprop_ends_where_one_process_ends(procs, tmp_path):
    """TextVectorization, an Embedding (repeated rows: RMSprop steps them by Keras' own rule by
    default), an LSTM and a Dense output, RMSprop: sync with two workers ends within 1e-6 of one
    process (the mean of two halves' gradients against one batch's: 1.6e-7 measured on weights
    of order 0.1-1 after 16 steps), the same on both workers, with one process's accuracy. Over
    two shards: ``test_each_row_over_two_shards_is_one_server_s_bits``; async and ssp:
    ``test_each_row_trains_async_and_ssp``."""
    plain = alone(tmp_path, program=LSTM_RMSPROP)
    ours = fit(procs, tmp_path, "sync", program=LSTM_RMSPROP)
    assert ours[0]["weights"] == ours[1]["weights"] and gap(ours[0], plain) < 1e-6
    assert ours[0]["iterations"] == plain["iterations"] == 16
    assert ours[0]["history"]["accuracy"] == plain["history"]["accuracy"]
    np.testing.assert_allclose(ours[0]["history"]["loss"], plain["history"]["loss"], rtol=1e-6)


def test_a_running_maximum_declared_aggregation_none_is_each_worker_s_own_under_sync(procs, tmp_path):
    """A user's ``Metric`` keeping the largest absolute error of the epoch, its variable declared
    ``aggregation="none"`` (a maximum does not add up): sync with two workers, each worker logs
    the running maximum of its own half of each global batch, and the chief says so in one line.
    The weights end within 2e-6 of one process (4.8e-7 measured: two ulps of the output bias,
    2.7), the same on both workers. Run over two server shards (one server's bits, each worker's
    own maximum too: ``test_each_row_over_two_shards_is_one_server_s_bits``).

    What holds of the maxima: a worker's part of a batch is a contiguous half, so the larger of
    the workers' maxima is one process's, each at most one process's, wherever the weights are one
    process's. Epoch 0's maximum is its first batch's, at the initial weights every run shares
    (a half's errors are the same bits as the whole batch's rows): one process's to the bit, and
    the workers' differ (9.5349 and 9.4692). Epoch 1's are of weights within float rounding of
    one process's: within float rounding of it (worker 0's 6.0541582, one process's 6.0541592,
    both of batch 28's first half; worker 1's 6.0519524 of batch 23's second half), not its bits."""
    plain = alone(tmp_path, program=RUNNING_MAX)
    ours = fit(procs, tmp_path, "sync", address=two_shards(procs), program=RUNNING_MAX)
    assert ours[0]["weights"] == ours[1]["weights"] and gap(ours[0], plain) < 2e-6
    assert ours[0]["iterations"] == plain["iterations"] == 32
    assert ours[0]["history"]["loss"] == ours[1]["history"]["loss"]  # aggregation "sum": the global batch's
    np.testing.assert_allclose(ours[0]["history"]["loss"], plain["history"]["loss"], rtol=1e-6)
    mine = [r["history"]["max_error"] for r in ours]
    assert [r["max_error"] for r in ours] == [m[-1] for m in mine]  # the metric's state is the worker's own
    assert all(a != b for a, b in zip(*mine)), mine  # each worker's own, not a shared state
    assert max(m[0] for m in mine) == plain["history"]["max_error"][0]
    np.testing.assert_allclose(max(m[1] for m in mine), plain["history"]["max_error"][1], rtol=1e-6)
    assert all(m[epoch] <= plain["history"]["max_error"][epoch] * (1 + 1e-6) for m in mine for epoch in (0, 1))
    chief_log = next(p for p in sorted(tmp_path.iterdir()) if p.name.startswith("keras-worker0")).read_text()
    assert "max_error/max declare aggregation='none'" in chief_log


@pytest.mark.slow  # each row runs over one server or over two shards in the default tier
@pytest.mark.parametrize("program, flags", [(CUSTOM_STEP, ("--no-norm",)), (MIXED, ("--overflow-batch", "3")),
                                            (TEXT, ()), (LSTM_RMSPROP, ()), (RUNNING_MAX, ())],
                         ids=["custom-step", "mixed-overflow", "text", "lstm", "running-max"])
def test_each_row_over_two_shards_is_one_server_s_bits(procs, tmp_path, program, flags):
    """Sync with two workers over two server shards: one server's weights and logged history
    (each worker's own metric state too), to the bit."""
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    one = fit(procs, tmp_path / "one", "sync", *flags, program=program)
    two = fit(procs, tmp_path / "two", "sync", *flags, address=two_shards(procs), program=program)
    assert two[0]["weights"] == one[0]["weights"] == one[1]["weights"]
    assert [r["history"] for r in two] == [r["history"] for r in one]


@pytest.mark.slow  # each row's sync run is the default tier's; a push applied on arrival is the same worker path
# for every row, which test_an_overridden_train_step_trains_async_and_ssp keeps in the default tier
@pytest.mark.parametrize("program, flags, mode", [
    (GAN, ("--eagerly",), "async"), (GAN, ("--eagerly",), "ssp"), (MIXED, (), "async"), (MIXED, (), "ssp"),
    (GAN_MIXED, ("--overflow-batch", "3"), "async"), (GAN_MIXED, ("--overflow-batch", "3"), "ssp"),
    (TEXT, (), "async"), (TEXT, (), "ssp"), (LSTM_RMSPROP, (), "async"), (LSTM_RMSPROP, (), "ssp"),
], ids=["gan-eager-async", "gan-eager-ssp", "mixed-async", "mixed-ssp", "gan-mixed-overflow-async",
        "gan-mixed-overflow-ssp", "text-async", "text-ssp", "lstm-async", "lstm-ssp"])
def test_each_row_trains_async_and_ssp(procs, tmp_path, program, flags, mode):
    """Each push applied on arrival (ssp: within its bound): both workers end, every logged value
    finite; under mixed_float16 each push's own skip, and both learn (accuracy above 0.5); the
    half-precision GAN's overflow (worker 1's) skips worker 1's discriminator updates alone."""
    records = fit(procs, tmp_path, mode, *flags, program=program)
    assert len(records) == 2
    assert all(np.isfinite(v).all() for r in records for v in r["history"].values()), [r["history"] for r in records]
    if program == MIXED:
        assert all(r["history"]["accuracy"][-1] > 0.5 for r in records), [r["history"] for r in records]
    if program == GAN_MIXED:  # each worker's own batches' skips: its loss scale halved once an epoch, or never
        assert [r["scales"][0] for r in records] == [32768.0, 32768.0 / 4], [r["scales"] for r in records]
