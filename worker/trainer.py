"""The worker's training loop against a parameter server.

    result = train(WorkerConfig(ps="127.0.0.1:50051", worker_index=0, num_workers=2))

Per step: pull the parameters (and the server's version), compute the mean
loss and its gradients with ``tf.GradientTape`` on this worker's shard of the
global batch, push them with the step, the version they were computed from and
the shard size. In sync mode the push returns when the whole round is applied;
in async mode as soon as this gradient is; in ssp mode (bounded staleness) the
same, unless this worker is too far ahead of the slowest, when the reply waits.
The experiment knobs (``worker.knobs``: slowdown, bandwidth, latency, a pause)
sleep around those phases.

With ``--history-json`` every step is recorded: loss, batch size, the version
pulled and the one after the push, staleness, whether it was dropped, and its
timing: ``t`` (seconds since training started, at the end of the step) and the
wall time of each phase: ``pull_s`` (the pull and loading the parameters into
the model), ``compute_s`` (the gradients) and ``push_s`` (with any barrier or
staleness wait). None of them counts the knobs' sleeps: those are ``knob_s``.
With ``--eval-every K`` the chief also records, every K steps, the test accuracy
and loss of the parameters it pulled for that step, timed on their own
(``eval_s``) and outside every step's phases.

The chief (worker 0) initializes the server from its freshly built model; the
others wait for that, pull, and check that their model and optimizer match
what the server holds. At the end the chief (after the other workers have left,
in async and ssp modes) evaluates the final parameters: test accuracy and loss,
and the loss on the whole training set.

With several servers in ``--ps`` (shards), the loop is the same: a
``ShardedClient`` splits every initialize, pull and push over them
(``worker.sharded_client``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time

import grpc
import numpy as np

from ps_common import security
from worker.client import PSClient, PSClientError
from worker import task as tasks
from worker.config import AUTO_INDEX, ConfigError, WorkerConfig
from worker.knobs import Knobs, payload_nbytes
from worker.observe import Observer
from worker.sharded_client import ShardedClient
from worker.task import Task

log = logging.getLogger("worker")


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why."""


class WorkerLogTag(logging.Filter):
    """Adds ``%(worker)s`` ("worker1") to log records. ps-worker's log format uses it:
    with --worker-index auto the index is known only once the server assigned it."""

    def __init__(self, index: int | None = None):
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = f"worker{self.index}" if self.index is not None and self.index >= 0 else "worker?"
        return True


LOG_TAG = WorkerLogTag()


def train(config: WorkerConfig, task: Task | None = None) -> dict:
    """Train ``task`` (default: the one ``config`` names, ``worker.task.from_config``) against
    the parameter server; returns the chief's final scores (the others: their step count)."""
    from worker import model as models

    tf = models.tf_setup(config.deterministic, config.intra_op_threads)
    device = models.device_name()
    log.info("computes on %s (TensorFlow %s)", device, tf.__version__)

    try:
        task = task or tasks.from_config(config)
    except tasks.TaskError as e:
        raise ConfigError(str(e)) from None
    total_steps = task.total_steps
    with tf.device(device):
        try:
            model = task.build_model()
        except tasks.TaskError as e:
            raise ConfigError(str(e)) from None
    log.info("training %s: %d steps, %d trainable and %d non-trainable variables", task.name, total_steps,
             len(tasks.trainable(model)), len(tasks.non_trainable(model)))
    if config.initial_weights:
        try:
            models.load_ordered_npz(model, config.initial_weights)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"--initial-weights: {e}") from None
    observer = Observer(worker_index=config.worker_index, total_steps=total_steps, log_every=config.log_every,
                        progress=config.progress, logdir=config.logdir,
                        metrics_port=config.metrics_port or None,
                        metrics_host=config.metrics_host)
    if observer.metrics_port:
        log.info("serving Prometheus metrics on http://%s:%d/metrics", config.metrics_host, observer.metrics_port)
    client = _client(config)
    try:
        return _train(config, task, model, models, tf, device, client, observer)
    finally:
        observer.close()
        client.close()


def _train(config: WorkerConfig, task: Task, model, models, tf, device, client, observer) -> dict:
    total_steps = task.total_steps
    reg = _register_first(config, client)
    auto = config.worker_index == AUTO_INDEX
    if auto:  # from now on this worker is the index the server gave it, also when it rejoins
        config = dataclasses.replace(config, worker_index=reg.worker_id)
        LOG_TAG.index = reg.worker_id
        observer.set_index(reg.worker_id)
        task.rebind(reg.worker_id, config.num_workers)
    log.info("registered as worker %d of %d%s; server mode %s, version %d, round %d",
             reg.worker_id, reg.num_workers, " (index assigned by the server)" if auto else "",
             reg.mode, reg.version, reg.round)
    _join(config, client, reg.worker_id, model)
    heartbeat = _Heartbeat(client, reg, config.heartbeat_interval)
    sync = reg.mode == "sync"  # async and ssp both apply pushes on arrival
    knobs = Knobs.from_config(config)
    if knobs.active:
        log.info("experiment knobs: %s", knobs.describe())

    batches = task.batches(config.worker_index, config.num_workers)
    t0 = time.monotonic()
    history: list[dict] = []
    evals: list[dict] = []
    eval_every = config.eval_every if config.is_chief else 0
    snapshots = set(config.snapshot_step_list) if config.is_chief else set()
    step = reg.round if sync else 0  # a (re)joining sync worker starts at the server's round
    seen = reg.version  # the newest server version this worker saw: after a restart, what was lost
    try:
        while step < total_steps:
            heartbeat.step = step
            x, y, n = batches.get(step)
            # Each phase's wall time excludes the knobs' sleeps, which are counted in knob_s.
            knob_s = knobs.before_step(step)
            try:
                knob_s += knobs.before_pull()
                pull_start = time.monotonic()
                version, values = client.pull(reg.worker_id)
                seen = max(seen, version)
                tasks.set_values(model, values)
                compute_start = time.monotonic()
                if n:
                    with tf.device(device):
                        loss, grads = task.gradients(model, x, y)
                    grads.update(tasks.changes(model, values))  # non-trainable variables: this step's change
                else:  # a tiny last batch left this worker nothing: weight 0 in the round
                    loss, grads = 0.0, {name: np.zeros_like(v) for name, v in values.items()}
                compute_s = time.monotonic() - compute_start
                knob_s += knobs.after_compute(compute_s)
                push_bytes = payload_nbytes(grads, config.grad_wire_dtype)
                knob_s += knobs.before_push(push_bytes)
                push_start = time.monotonic()
                push_timeout = reg.barrier_timeout + 30.0 if sync else 120.0
                reply = client.push(reg.worker_id, step, version, n, grads, loss, timeout=push_timeout)
                step_end = time.monotonic()
            except PSClientError as e:
                if not _recoverable(e):
                    raise
                reg, step = _rejoin(config, client, reg, step, e, model, seen)
                seen = reg.version
                heartbeat.reg = reg
                continue
            seen = max(seen, reply.version)
            record = {"step": step, "loss": loss, "batch_size": n, "base_version": version,
                      "version": reply.version, "staleness": reply.staleness, "dropped": reply.dropped,
                      "t": step_end - t0, "pull_s": compute_start - pull_start, "compute_s": compute_s,
                      "push_s": step_end - push_start, "knob_s": knob_s, "push_bytes": push_bytes}
            history.append(record)
            observer.step(record)
            if eval_every and (step + 1) % eval_every == 0:
                evals.append(_evaluate(model, task, step, version, t0))
                observer.evaluation(evals[-1])
            if step + 1 in snapshots:
                _, now_values = client.pull(reg.worker_id)
                models.save_ordered_npz(model, now_values,
                                        os.path.join(config.snapshot_dir, f"step{step + 1}.npz"))
            # Sync: the server says which round is next (a dropped push skips ahead).
            step = max(reply.next_step, step + 1) if sync else step + 1
        train_s = time.monotonic() - t0
        observer.end_progress()
        if config.history_json:
            _write_json(config.history_json, {"worker_index": config.worker_index, "mode": reg.mode,
                                              "train_s": train_s, "knobs": knobs.settings(),
                                              "eval_every": eval_every, "steps": history, "evals": evals})
        log.info("worker %d finished %d steps in %.1f s", reg.worker_id, total_steps, train_s)
        if config.is_chief:
            result = _finish_as_chief(config, client, reg, model, task, models, total_steps, train_s, history)
        else:
            result = {"worker_index": config.worker_index, "steps": total_steps, "train_s": train_s}
        observer.finish(result)  # ends the progress bar; the chief's final scores go to TensorBoard
        # The chief leaves last, after its final pull, with its lease renewed until then:
        # a server started with --exit-when-done stops once everyone left.
        client.leave(reg.worker_id)
        return result
    finally:
        heartbeat.stop()


def _client(config: WorkerConfig) -> PSClient | ShardedClient:
    """One server: a PSClient. Several shards in --ps: a ShardedClient, with the same methods."""
    kwargs = dict(
        timeout=max(30.0, config.connect_timeout),
        tls_ca_file=config.tls_ca_file or None, tls_cert_file=config.tls_cert_file or None,
        tls_key_file=config.tls_key_file or None, tls_server_name=config.tls_server_name or None,
        token=security.load_token(config.auth_token_file, os.environ),
        grad_wire_dtype=config.grad_wire_dtype,
        shm=config.shm,
    )
    addresses = config.ps_addresses
    return ShardedClient(addresses, **kwargs) if len(addresses) > 1 else PSClient(config.ps, **kwargs)


def _register_first(config: WorkerConfig, client: PSClient | ShardedClient):
    """Register within --connect-timeout. An auto-index worker that finds every index
    taken retries meanwhile: a dead worker's index frees once its lease runs out."""
    deadline = time.monotonic() + config.connect_timeout
    while True:
        try:
            return _register(config, client, max(1.0, deadline - time.monotonic()))
        except PSClientError as e:
            if e.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                hint = " (or does its certificate not match --tls-ca-file?)" if config.tls_ca_file else ""
                raise TrainingError(f"cannot reach the parameter server at {e.address} within "  # that shard
                                    f"--connect-timeout {config.connect_timeout:g} s: is ps-server running there?"
                                    f"{hint}") from None
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() + 1.0 > deadline:
                raise
            log.info("no free worker index yet (%s); retrying", e.details)
            time.sleep(1.0)


def _register(config: WorkerConfig, client: PSClient, timeout: float):
    return client.register(config.worker_index, config.num_workers, f"{socket.gethostname()}:{os.getpid()}",
                           timeout=timeout)


# Failures a worker rides out by reconnecting and registering again: the server is
# down or restarting, it restarted without knowing us, or it declared us dead (a
# pause longer than the lease) or out of step.
_REJOIN_DETAILS = ("not registered", "declared dead", "not initialized", "is late", "is early",
                   "not part of sync round", "pull first")


def _recoverable(e: PSClientError) -> bool:
    if e.code == grpc.StatusCode.UNAVAILABLE:
        return True
    if e.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
                  grpc.StatusCode.INVALID_ARGUMENT):
        return any(d in e.details for d in _REJOIN_DETAILS)
    return False


def _rejoin(config: WorkerConfig, client: PSClient, reg, step: int, error: PSClientError, model,
            seen: int = 0):
    """Reconnect within --reconnect-timeout, register again, and say where to resume."""
    log.warning("worker %d lost its place at step %d (%s); reconnecting for up to %g s",
                config.worker_index, step, error, config.reconnect_timeout)
    deadline = time.monotonic() + config.reconnect_timeout
    delay = 0.2
    while True:
        try:
            new = _register(config, client, timeout=min(5.0, max(0.5, deadline - time.monotonic())))
            if not new.initialized and config.is_chief:
                # A server restarted with no checkpoint: carry on from our last parameters.
                created = client.initialize(new.worker_id, tasks.get_values(model), config.optimizer_spec(),
                                            non_trainable=[v.path for v in tasks.non_trainable(model)])
                log.warning("server at %s had no state; re-initialized it from this worker's last parameters "
                            "(created=%s)", config.ps, created)
            elif not new.initialized:
                client.wait_initialized(new.worker_id, max(1.0, deadline - time.monotonic()))
            break
        except PSClientError as e:
            if not _recoverable(e) and e.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            if time.monotonic() + delay > deadline:
                raise TrainingError(f"lost the parameter server at {config.ps} and could not rejoin within "
                                    f"--reconnect-timeout {config.reconnect_timeout:g} s ({e})") from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    if new.incarnation != reg.incarnation:
        # Sync: rounds this worker had seen completed that the restored state lacks. Async: the
        # versions it saw beyond the restored one (others' pushes it never saw may be lost too).
        if new.mode == "sync":
            lost = f": resuming at round {new.round}, {max(0, step - new.round)} step(s) of updates were lost"
        else:
            lost = f": at least {max(0, seen - new.version)} update(s) were lost (this worker had seen version {seen})"
        log.warning("the server restarted (incarnation %s -> %s) at version %d%s", reg.incarnation,
                    new.incarnation, new.version, lost)
    resume = new.round if new.mode == "sync" else step
    log.info("worker %d rejoined: resuming at step %d", new.worker_id, resume)
    return new, resume


class _Heartbeat:
    """Renews the worker's lease from a thread, so a long barrier wait or a slow
    step never looks like a death. Errors are left to the training loop."""

    def __init__(self, client: PSClient, reg, interval: float):
        self.client, self.reg, self.step = client, reg, 0
        self.interval = interval or max(0.1, reg.lease_timeout / 3)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.client.heartbeat(self.reg.worker_id, self.step, timeout=max(1.0, self.interval))
            except PSClientError as e:
                log.debug("heartbeat failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _join(config: WorkerConfig, client: PSClient, worker_id: int, model) -> None:
    """Chief: initialize the server. Others: wait for it and check the spec matches."""
    if config.is_chief:
        created = client.initialize(worker_id, tasks.get_values(model), config.optimizer_spec(),
                                    non_trainable=[v.path for v in tasks.non_trainable(model)])
        log.info("%s the server's variables (%d tensors)",
                 "initialized" if created else "found identical state on", len(tasks.get_values(model)))
        return
    _, values = client.wait_initialized(worker_id, config.init_timeout)
    mine = {path: tuple(a.shape) for path, a in tasks.get_values(model).items()}
    theirs = {n: tuple(a.shape) for n, a in values.items()}
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:4]
        raise ConfigError(f"this worker's model does not match the server's variables (differences: {diff}); "
                          "start every worker with the same --model")
    server_opt = client.status().optimizer
    wanted = config.optimizer_spec()
    got = {k: getattr(server_opt, k) for k in wanted}
    if got != wanted:
        raise ConfigError(f"the server trains with optimizer {got}, this worker was started with {wanted}")


def _evaluate(model, task: Task, step: int, version: int, t0: float) -> dict:
    """--eval-every: test scores of the parameters pulled for ``step`` (the model holds them)."""
    start = time.monotonic()
    scores = task.evaluate(model)
    log.info("eval at step %d: %s (parameters at version %d)", step + 1, _scores_text(scores), version)
    return {"step": step, "t": start - t0, "version": version, **scores, "eval_s": time.monotonic() - start}


def _scores_text(scores: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.4f}" for k, v in scores.items()) or "no eval dataset"


def _finish_as_chief(config, client, reg, model, task: Task, models, total_steps, train_s, history) -> dict:
    if reg.mode != "sync":  # async, ssp: nobody waits at a barrier, so wait for the others here
        _wait_for_others(config, client)
    version, values = client.pull(reg.worker_id)
    tasks.set_values(model, values)
    scores = task.evaluate(model)
    train = task.train_scores(model)
    if "final_loss" not in train:  # your data: the mean loss of this worker's last steps
        last = [r["loss"] for r in history[-10:] if r["batch_size"]]
        train["final_loss"] = float(np.mean(last)) if last else float("nan")
    status = client.status()
    test_acc = scores.get("test_accuracy", float("nan"))
    result = {
        "mode": reg.mode,
        "workers": reg.num_workers,
        "steps": total_steps,
        "version": version,
        **scores,
        "test_accuracy": test_acc,
        **train,
        "train_s": train_s,
        "examples": int(status.examples_applied),
        "examples_per_s": status.examples_applied / train_s if train_s > 0 else 0.0,
        "mean_staleness": status.mean_staleness,
        "max_staleness": int(status.max_staleness),
    }
    log.info("final: %s, training loss %.4f at version %d", _scores_text(scores), train["final_loss"], version)
    print(f"test_accuracy={test_acc:.4f}", flush=True)
    if config.result_json:
        _write_json(config.result_json, result)
    if config.save_weights:
        models.save_npz(config.save_weights, values)
    if config.save_model:  # the weights are the server's final ones (set above)
        model.save(config.save_model)
        log.info("saved the trained model to %s", config.save_model)
    if config.snapshot_dir:
        models.save_ordered_npz(model, values, os.path.join(config.snapshot_dir, "final.npz"))
    return result


def _wait_for_others(config: WorkerConfig, client: PSClient) -> None:
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


def _write_json(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


__all__ = ["train", "TrainingError", "PSClientError"]
