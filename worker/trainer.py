"""The worker's training loop against a parameter server.

    result = train(WorkerConfig(ps="127.0.0.1:50051", worker_index=0, num_workers=2))

``TrainingLoop.run`` reads top to bottom: ``start`` (register, join), then each work
item through the one engine (``worker.engine``) until the last step, then ``finish``.
The work is this worker's shard of each global batch (``own_shard``) or, with
``--elastic``, what the server deals (``worker.elastic``).

A step is the engine's (pull, one tape, push, one history row); after a failure the
worker can ride out (the server restarting, this worker declared dead) it rejoins and
resumes where the server says. The history's fields (``--history-json``) and the
chief's ``--eval-every`` records: docs/compare.md (experiment knobs); ``compute_cpu_s``
is the CPU time this process spent computing the gradients (on shared cores it leaves
out the time spent waiting for one).

The chief (worker 0) initializes the server from its freshly built model; the others
wait for that, pull, and check that their model and optimizer match. At the end the
chief (after the other workers have left, in async and ssp) evaluates the final
parameters. Several servers in ``--ps``: the same loop over a ``ShardedClient``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import numpy as np

from ps_common.procs import write_atomically
from worker import elastic
from worker import model as models
from worker import task as tasks
from worker.config import ConfigError, WorkerConfig
from worker.connection import TrainingError, Work
from worker.engine import Engine
from worker.gradients import Gradients, non_trainable, trainable
from worker.observe import Observer

log = logging.getLogger("worker")


class WorkerLogTag(logging.Filter):
    """Adds ``%(worker)s`` ("worker1") to log records. ps-worker's log format uses it:
    with --worker-index auto the index is known only once the server assigned it."""

    index = -1  # "worker?" until ps-worker or the registration sets it

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = f"worker{self.index}" if self.index >= 0 else "worker?"
        return True


LOG_TAG = WorkerLogTag()


def train(config: WorkerConfig, task: tasks.Task | None = None) -> dict:
    """Train ``task`` (default: the one ``config`` names, ``worker.task.from_config``) against
    the parameter server; returns the chief's final scores (the others: their step count)."""
    tf = models.tf_setup(config.deterministic, config.intra_op_threads)
    device = models.device_name()
    log.debug("computes on %s (TensorFlow %s)", device, tf.__version__)
    task = task or tasks.from_config(config)
    with tf.device(device):
        model = task.build_model()
    log.debug("training %s: %d steps, %d trainable and %d non-trainable variables", task.name, task.total_steps,
              len(trainable(model)), len(non_trainable(model)))
    if config.initial_weights:
        try:
            models.load_ordered_npz(model, config.initial_weights)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"--initial-weights: {e}") from None
    with Observer(worker_index=config.worker_index, total_steps=task.total_steps, log_every=config.log_every,
                  progress=config.progress, logdir=config.logdir, metrics_port=config.metrics_port or None,
                  metrics_host=config.metrics_host) as observer:
        loop = TrainingLoop(config, task, model, observer, device)
        try:
            return loop.run()
        finally:
            loop.conn.close()


class TrainingLoop:
    """One worker's training: its state is the fields set here (module docstring)."""

    def __init__(self, config: WorkerConfig, task: tasks.Task, model, observer: Observer, device: str = "/CPU:0"):
        self.task, self.model, self.observer, self.device = task, model, observer, device
        self.gradients = Gradients(model, task.loss)
        self.batches = None  # this worker's part of each global batch, once its index is known
        self.history: list[dict] = []  # one record per step pushed (--history-json)
        self.evals: list[dict] = []  # the chief's --eval-every scores
        # SIGTERM's flag, while an --elastic loop trains (worker.elastic)
        self.engine = Engine(config, model, self.compute, stop=elastic.SigtermFlag() if config.elastic else None,
                             task=task, record=self.record)
        self.conn, self.knobs = self.engine.conn, self.engine.knobs  # registration, step, pulls; the knobs

    config = Engine.config  # the configuration, with the index the server assigned (``--worker-index auto``)

    def run(self) -> dict:
        """Start, take the work where the registration says (this worker's own shard; with
        --elastic what the server deals: ``worker.elastic``), finish."""
        engine = self.engine
        with elastic.leaving_at_sigterm(engine.stop, lambda: engine) if self.config.elastic else contextlib.nullcontext():
            engine.call(self.start)  # --elastic: registers, sets the data plan and joins as SIGTERM allows
            engine.t0 = time.monotonic()  # when training started
            if not self.config.elastic:
                self.own_shard()
            else:
                (elastic.round_at if self.conn.sync else elastic.task_at)(engine)
        return self.finish()

    # -- start
    def start(self) -> None:
        """Register (one INFO line says where this worker stands), learn the index (auto), join."""
        import tensorflow as tf

        reg = self.conn.register()
        if self.conn.auto:  # from now on this worker is the index the server gave it
            LOG_TAG.index = reg.worker_id
            self.observer.set_index(reg.worker_id)
            self.task.rebind(reg.worker_id, self.config.num_workers)
        extras = [f"experiment knobs: {self.knobs.describe()}"] if self.knobs.active else []
        if self.observer.metrics_port:
            extras.append(f"metrics on http://{self.config.metrics_host}:{self.observer.metrics_port}/metrics")
        log.info("%s; computes on %s (TensorFlow %s); %s, %d steps%s", self.conn.describe(), self.device,
                 tf.__version__, self.task.name, self.task.total_steps, "".join(f"; {e}" for e in extras))
        if self.config.elastic:
            elastic.set_data_plan(self.engine, reg)
        self.engine.join()
        if self.config.elastic and getattr(self.task, "dealt", None) is not None:  # your dataset, read once
            elastic.same_data(self.engine)
        self.batches = self.task.batches(self.config.worker_index, self.config.num_workers)

    def own_shard(self) -> None:
        """Each step this worker's shard of the global batch; on a failure the worker can
        ride out, rejoin (the step is then where the server says) and record nothing."""
        def one() -> dict:
            x, y, n = self.batches.get(self.conn.step)
            return self.engine(Work(self.conn.step, n, (x, y)))[0]

        while self.conn.step < self.task.total_steps:
            row = self.engine.ride_out(one)
            self.record(row)
            if self.config.is_chief:
                self._after_step(row["step"], row["base_version"])

    def record(self, row: dict) -> None:
        self.history.append(row)
        self.observer.step(row)

    def compute(self, work: Work) -> tuple[float, dict | None]:
        """(mean loss, payload) of ``work``'s examples against the parameters pulled; no
        payload for a worker a tiny last batch left nothing."""
        if not work.batch_size:
            return 0.0, None
        import tensorflow as tf

        x, y, *weights = work.examples  # your dataset's dealt examples (--elastic) carry a sample weight too
        with tf.device(self.device):
            return self.gradients(x, y, self.conn.pulled, sample_weight=weights[0] if weights else None,
                                  sparse_rule=self.conn.sparse_rule)

    def _after_step(self, step: int, version: int) -> None:
        """The chief's --eval-every scores (of the parameters pulled for ``step``: the model holds
        them) and --snapshot-steps files, outside the step's timing."""
        if self.config.eval_every and (step + 1) % self.config.eval_every == 0:
            start = time.monotonic()
            scores = self.task.evaluate(self.model)
            log.info("eval at step %d: %s (parameters at version %d)", step + 1, _scores_text(scores), version)
            self.evals.append({"step": step, "t": start - self.engine.t0, "version": version, **scores,
                               "eval_s": time.monotonic() - start})
            self.observer.evaluation(self.evals[-1])
        if step + 1 in set(self.config.snapshot_step_list):  # the server's values now; the next step loads them
            self.conn.pull(load=False)
            models.save_ordered_npz(self.model, self.conn.pulled,
                                    os.path.join(self.config.snapshot_dir, f"step{step + 1}.npz"))

    # -- finish
    def finish(self) -> dict:
        """Write the history; the chief evaluates the server's final parameters; leave."""
        config, reg = self.config, self.conn.registration
        train_s = time.monotonic() - self.engine.t0
        self.observer.end_progress()
        if config.history_json:
            write_atomically(config.history_json, json.dumps(
                {"worker_index": config.worker_index, "mode": reg.mode, "train_s": train_s,
                 "knobs": self.knobs.settings(), "eval_every": config.eval_every if config.is_chief else 0,
                 "steps": self.history, "evals": self.evals}, indent=2))
        log.info("worker %d finished %d steps in %.1f s", reg.worker_id, self.task.total_steps, train_s)
        result = self._finish_as_chief(train_s) if config.is_chief else {
            "worker_index": config.worker_index, "steps": self.task.total_steps, "train_s": train_s}
        self.observer.finish(result)  # ends the progress bar; the chief's final scores go to TensorBoard
        # The chief leaves last, after its final pull, with its lease renewed until then:
        # a server started with --exit-when-done stops once everyone left.
        self.conn.leave()
        return result

    def _finish_as_chief(self, train_s: float) -> dict:
        config, reg, model, task = self.config, self.conn.registration, self.model, self.task
        if reg.mode != "sync" and not config.elastic:  # async, ssp: nobody waits at a barrier, so wait for the others
            _wait_for_others(config, self.conn.client)
        version = self.conn.pull()
        values = self.conn.pulled
        scores = task.evaluate(model)
        train = task.train_scores(model)
        if "final_loss" not in train:  # your data: the mean loss of this worker's last steps
            last = [r["loss"] for r in self.history[-10:] if r["batch_size"]]
            train["final_loss"] = float(np.mean(last)) if last else float("nan")
        status = self.conn.client.status()
        test_acc = scores.get("test_accuracy", float("nan"))
        result = {
            "mode": reg.mode,
            "workers": reg.num_workers,
            "steps": task.total_steps,
            "version": version,
            **scores,
            "test_accuracy": test_acc,
            **train,
            "train_s": train_s,
            "examples": int(status.examples_applied),
            **({"epoch_examples": [int(n) for n in status.epoch_examples]} if status.epoch_examples else {}),
            "examples_per_s": status.examples_applied / train_s if train_s > 0 else 0.0,
            "mean_staleness": status.mean_staleness,
            "max_staleness": int(status.max_staleness_seen),
        }
        log.info("final: %s, training loss %.4f at version %d", _scores_text(scores), train["final_loss"], version)
        print(f"test_accuracy={test_acc:.4f}", flush=True)
        if config.result_json:
            write_atomically(config.result_json, json.dumps(result, indent=2))
        if config.save_weights:
            models.save_npz(config.save_weights, values)
        if config.save_model:  # the weights are the server's final ones (set above)
            model.save(config.save_model)
            log.info("saved the trained model to %s", config.save_model)
        if config.snapshot_dir:
            models.save_ordered_npz(model, values, os.path.join(config.snapshot_dir, "final.npz"))
        return result


def _scores_text(scores: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in scores.items()) or "no eval dataset"


def _wait_for_others(config: WorkerConfig, client) -> None:
    deadline = time.monotonic() + config.final_wait
    while True:
        status = client.status()
        others = [w for w in status.workers if w.worker_id != config.worker_index]
        running = [w.worker_id for w in others if not w.left and not w.dead]
        registered = {w.worker_id for w in status.workers}
        never = [i for i in range(status.num_workers) if i not in registered]
        if not running and not never:
            dead = [w.worker_id for w in others if w.dead and not w.left]
            if dead:
                log.warning("worker(s) %s were declared dead and did not finish: evaluating without them", dead)
            return
        if time.monotonic() > deadline:
            raise TrainingError(f"workers {running + never} did not finish within --final-wait {config.final_wait:g} s")
        time.sleep(0.2)


__all__ = ["train", "TrainingLoop", "TrainingError"]
