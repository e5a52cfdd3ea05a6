"""The work when the server deals the data: elastic sync's micro-batches, async and ssp's tasks.

    ps-server --mode sync --num-workers 4 --elastic-min-workers 2 --micro-batches 4
    ps-worker --elastic --worker-index 0 --num-workers 4 ...     # any number of these, at any time

What the server does and why the bits stay the same: docs/elastic.md. Elastic sync
(``ps_server/core/elastic_mode.py``): each round a worker asks for its work (``Work``),
pulls that round's version and takes each micro-batch dealt to it through the engine's
one step (``worker.engine.Engine``), pushed naming the micro-batch; the reply names more
work or is the round's answer, and the round makes one history row. Async and ssp
(``ps_server/core/tasks.py``): each step a worker asks for a task, pulls, computes the
plan's batch at the task's id and pushes it naming the task. The chief sends the data
plan (``set_data_plan``). A ``tfps.keras`` fit runs one round (``round_at``) or one task
(``task_at``) per Keras step.

SIGTERM makes a worker leave the job at once (``Leave`` over a fresh channel: a call it
abandoned may still be using the old one; ``ps-worker`` exits 143). The handler only sets
a flag (``SigtermFlag``, why: docs/elastic.md), which the engine checks between calls: a
gradient under way is finished first, what may block ends within 50 ms. Only in the main
thread (where signals arrive); it writes no ``--history-json``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Iterator

import grpc

from ps_common.batches import global_batch, micro_batches
from ps_common.names import asks_skip
from ps_common.reasons import Reason
from worker.client import PSClientError
from worker.config import ConfigError
from worker.connection import Work, connect, recoverable

log = logging.getLogger("worker")


class Stopped(Exception):
    """SIGTERM while training: this worker left the job (module docstring). Raised by the
    engine itself, where it checks the flag, never by the signal handler."""


class SigtermFlag:
    """SIGTERM's handler (``signal.signal(SIGTERM, flag)``) sets ``asked``, and nothing else:
    no exception (module docstring), no lock (the main thread may hold the one it would
    take). ``check`` raises ``Stopped`` once it is set; ``sleep`` and ``wait_for`` end within
    ``POLL_S`` of it."""

    POLL_S = 0.05

    def __init__(self):
        self.asked = False

    def __call__(self, signum, frame) -> None:
        self.asked = True

    def check(self) -> None:
        if self.asked:
            raise Stopped("SIGTERM")

    def sleep(self, seconds: float) -> None:
        """``time.sleep(seconds)``, cut short by SIGTERM (the knobs' sleep: a pause)."""
        deadline = time.monotonic() + seconds
        while not self.asked and time.monotonic() < deadline:
            time.sleep(min(self.POLL_S, max(0.0, deadline - time.monotonic())))

    def wait_for(self, call, *args, **kwargs):
        """``call(*args, **kwargs)``'s result (or its exception), computed in a daemon thread
        while this one watches the flag: ``Stopped`` as soon as it is set. The call is then
        abandoned; closing the connection (``train`` does) cancels its RPC."""
        self.check()
        outcome = {}

        def run() -> None:
            try:
                outcome["result"] = call(*args, **kwargs)
            except BaseException as e:  # handed to the caller's thread
                outcome["error"] = e

        thread = threading.Thread(target=run, name="elastic-call", daemon=True)
        thread.start()
        while thread.is_alive():
            self.check()
            thread.join(self.POLL_S)
        if "error" in outcome:
            raise outcome.pop("error")
        return outcome["result"]


WAIT_S = 0.2  # async and ssp: every task handed out, some not done: ask again after this


@contextlib.contextmanager
def leaving_at_sigterm(stop: SigtermFlag, engine) -> Iterator[None]:
    """SIGTERM sets ``stop`` while the body trains (only in the main thread, where signals
    arrive); ``Stopped`` leaves the job at once (``leave_now(engine())``)."""
    catch = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if catch else None
    try:
        yield
    except Stopped:
        raise Stopped(leave_now(engine())) from None
    finally:
        if catch:
            signal.signal(signal.SIGTERM, previous)


def set_data_plan(engine, registration) -> None:
    """The chief's data plan, which the server deals from: sync, the global batches of
    the job; async and ssp, tasks of ``--global-batch-size / --num-workers`` examples for
    ``--epochs`` epochs (``tasks``)."""
    config, task, conn = engine.config, engine.task, engine.conn
    engine.stop.check()  # stopped while it registered: it leaves without joining
    conn.data_plan = {"num_examples": task.num_examples, "global_batch_size": config.global_batch_size,
                      "seed": config.seed}
    if registration.mode == "sync":
        return
    if config.steps:
        raise ConfigError(f"--steps {config.steps}: async and ssp with --elastic train on the server's "
                          f"tasks for whole epochs; say --epochs")
    engine.batch = max(1, config.global_batch_size // config.num_workers)
    conn.step = max(conn.step, registration.round)  # ssp: the slowest live worker's clock
    conn.data_plan = {**conn.data_plan, "global_batch_size": engine.batch, "epochs": config.epochs}


def same_data(engine) -> None:
    """Your dataset read once (``worker.task.UserTask.dealt``, with ``elastic``): the chief posts a
    digest of its examples, and any other worker whose own differ (an unseeded shuffle, data
    that depends on the worker) stops with one line: the server deals indices into them."""
    conn = engine.conn
    mine = engine.task.dealt.fingerprint()
    timeout = max(60.0, conn.registration.barrier_timeout)
    chief = engine.call(conn.broadcast, "elastic/data", mine.encode() if engine.config.is_chief else None, timeout)
    if chief.decode() != mine:
        raise ConfigError(f"this worker's training examples (digest {mine}) differ from the chief's "
                          f"({chief.decode()}); the server deals example indices, so every worker's dataset "
                          "function must give the same examples in the same order (seed any shuffle)")


# The refusals after which the work goes on (``_take``'s ``passing``), as after a call that timed out:
TASK_TAKEN_AWAY = (Reason.TASK_NOT_HELD, Reason.TASK_DONE)  # its lease ran out, another does it: the next task
ASK_AGAIN = (Reason.LATE, Reason.EARLY)  # a round that ended without this push, or has not started: ask ``Work``


def _take(engine, one, passing: tuple[Reason, ...]) -> None:
    """``one(engine)`` until it says the job is done. After a timeout (ssp's wait for the bound,
    its push applied; a round's) or a refusal for a reason in ``passing`` it goes on, asked before a
    rejoin (a sync worker rejoins for a late or early push, an elastic one only asks again); after
    one the worker can ride out (this worker declared dead, a lease missed, the server restarted)
    it rejoins first (``Engine.ride_out``)."""
    timed_out = grpc.StatusCode.DEADLINE_EXCEEDED
    while engine.ride_out(one, engine, passing=lambda e: e.reason in passing or e.code == timed_out,
                          rides=lambda e: recoverable(e) or e.reason is Reason.NOT_JOINED):
        pass


def task_at(engine, epoch: int | None = None) -> None:
    """Async and ssp: the job's batches as tasks (``core.tasks``), until every one is applied;
    a push of a task taken away meanwhile (its lease ran out) is refused and dropped. With
    ``epoch`` (``tfps.keras``, one Keras step): the next task the server hands out, computed and
    pushed, if it is of ``epoch`` or an earlier one; one of a later epoch is kept in
    ``engine.pending`` for that epoch's steps (this worker's share of an epoch is what it is
    handed, so its other steps do nothing). Once every task is handed out, a step waits for
    the job to finish (a task may come back to it); from then on steps do nothing."""

    def one(engine) -> bool:
        offer, engine.pending = engine.pending or _work(engine), None
        if not offer.sizes:
            if offer.finished:
                engine.pending = offer  # the job is done: every later step does nothing
                return False
            engine.stop.sleep(WAIT_S)  # the last tasks are held by others; one may come back
            return True
        batch = offer.round // _applies(engine)  # a step of n applies: n tasks a batch (``TaskQueue.applies``)
        if epoch is not None and batch // engine.task.steps_per_epoch > epoch:
            engine.pending = offer
            return False
        # Task offer.round: its batch of the plan (engine.batch examples), through the one step.
        indices = global_batch(engine.task.num_examples, engine.batch, engine.config.seed, batch)
        engine.record(engine(Work(engine.conn.step, len(indices), engine.task.examples(indices), task=offer.round))[0])
        return epoch is None

    _take(engine, one, TASK_TAKEN_AWAY)


def task_epoch(engine) -> int:
    """Async and ssp (``tfps.keras``, at its fit's start): the job's epoch of the task this worker
    is handed first (kept in ``engine.pending``): a worker that joins late starts there. The job's
    last epoch when every task is held by others, its epochs once it is finished (a later fit's
    plan goes on to more: ``conn.data_plan``, which its Initialize gave the server, first)."""

    def one(engine) -> bool:
        engine.pending = engine.pending or _work(engine)
        return False

    if engine.pending is not None and not engine.pending.sizes:
        engine.pending = None  # an earlier fit's end: ask again
    _take(engine, one, TASK_TAKEN_AWAY)
    offer, task = engine.pending, engine.task
    epochs = -(-task.job_tasks(engine.conn.data_plan) // task.steps_per_epoch)  # the fits' so far
    if offer.sizes:
        return offer.round // _applies(engine) // task.steps_per_epoch
    if not offer.finished:
        engine.pending = None  # nothing to hand out now: the first step asks again
    return epochs if offer.finished else epochs - 1


def leave_now(engine) -> str:
    """After SIGTERM: Leave over a fresh connection; what happened, in words."""
    conn = None if engine is None else engine.conn  # tfps.keras: no engine until its fit connects
    reg = None if conn is None else conn.registration
    if reg is None:
        return "stopped by SIGTERM before it registered"
    step, me = conn.step, reg.worker_id
    try:
        with connect(engine.config) as client:
            client.leave(me)
    except PSClientError as e:
        log.warning("stopped by SIGTERM; Leave failed (%s): the server declares worker %d dead once its "
                    "lease runs out", e, me)
        return f"stopped by SIGTERM at step {step}; Leave failed: {e}"
    log.info("stopped by SIGTERM: left the job at step %d; the server deals the rest to the others", step)
    return f"stopped by SIGTERM: left the job at step {step}"


def round_at(engine, r: int | None = None) -> None:
    """Elastic sync: the server's rounds, each computed micro-batch by micro-batch, until a
    worker is dealt a round at or past the last step. With ``r`` (``tfps.keras``: a Keras step
    is round ``r``): this worker's part of round ``r``, if the server deals it some; returns
    once it is done, or at once when the cluster is past ``r`` (a worker that joined late
    skips to the cluster's round). Work dealt for a later round is kept in ``engine.pending``
    for that round's call."""

    def one(engine) -> bool:
        if r is not None and engine.conn.step > r:
            return False
        work, engine.pending = engine.pending or _work(engine, wait=True), None
        if r is None and work.round >= engine.task.total_steps:
            return False
        if r is not None and work.round > r:
            engine.pending = work
            return False
        if engine.conn.pull() == work.round:  # else it was dealt for a round that ended meanwhile
            _compute_round(engine, work)
        return True

    _take(engine, one, ASK_AGAIN)
    if r is None:
        engine.conn.step = engine.task.total_steps


def _work(engine, wait: bool = False):
    """The server's next work for this worker (``Work``): elastic sync's micro-batches, waiting
    until it deals some (``wait``), or at once a task (none when every task is held)."""
    conn = engine.conn
    conn.check()
    if wait:
        return engine.call(conn.client.work, conn.worker_id,
                           timeout=conn.registration.barrier_timeout + conn.client.timeout)
    engine.stop.check()
    return conn.client.work(conn.worker_id)


def _compute_round(engine, work) -> None:
    """Each micro-batch dealt (and any the replies add) through the engine's one step; one
    history row for the round."""
    task = engine.task
    engine.skipped_rounds = tuple(work.skipped_rounds)  # those before it (tfps.keras: its loss scale)
    knob_s = engine.knobs.before_step(work.round)  # --pause-at-step: this round waits for us meanwhile
    started, todo, rows = time.monotonic(), list(work.micro_batches), []
    while todo:
        m = todo.pop(0)
        batch = micro_batches(task.global_batch(work.round // _applies(engine)), work.parts)[m]
        row, reply = engine(Work(work.round, len(batch), task.examples(batch), micro_batch=m), pull=False)
        rows.append(row)
        if reply.more is not None and reply.more.round == work.round:
            todo = list(reply.more.micro_batches)  # the rest of ours, or a dead worker's part
    if asks_skip(reply.metrics):  # the round completed without an update
        engine.skipped_rounds += (work.round,)
    total = {k: sum(r[k] for r in rows) for k in ("batch_size", "compute_s", "compute_cpu_s", "knob_s", "push_bytes")}
    loss = sum(r["loss"] * r["batch_size"] for r in rows) / max(total["batch_size"], 1)
    engine.record({**rows[-1], **total, "loss": loss, "micro_batches": len(rows), "staleness": 0, "dropped": False,
                 "pull_s": 0.0, "push_s": time.monotonic() - started - total["compute_s"],
                 "knob_s": knob_s + total["knob_s"]})
    engine.conn.step = work.round + 1


def _applies(engine) -> int:
    """The rounds (sync) or tasks (async, ssp) each batch is: the applies of a ``tfps.keras`` step."""
    return (engine.conn.data_plan or {}).get("applies", 1)
