"""The worker's loop when the server deals the data: elastic sync's rounds, async and ssp's tasks.

    ps-server --mode sync --num-workers 4 --elastic-min-workers 2 --micro-batches 4
    ps-worker --elastic --worker-index 0 --num-workers 4 ...     # any number of these, at any time

Against ``ps-server --elastic-min-workers`` (``ps_server/core/elastic_mode.py``) the
data cursor is the server's: every round it deals the fixed micro-batches of that
round's global batch (``ps_common.batches``) to the workers live at its start. So a
worker does not own a shard. Each round it asks for its work (``Work``), pulls the
parameters of that round's version, and for each micro-batch dealt to it computes the
mean loss and gradient of those examples alone (one ``GradientTape`` per micro-batch,
``worker.gradients``) and pushes it (``PSClient.push_micro``). The reply either names
the work to do next (its own rest, or the part of a worker that died) or is the round's
answer. A worker may join at any time and may die at any time: its undelivered part is
computed by another, and the round's result has the same bits (``core.cursor``).

The chief (worker 0) sends the data plan (examples, global batch size, seed) with its
Initialize. The job ends at the last step: a worker dealt work of a round at or past
``total_steps`` stops. Built-in models and datasets only for now (their examples are
drawn by index); one server.

Against an async or ssp server (``ps-worker --elastic`` there too) the chief's data plan
carries ``--epochs``, and the server hands out the job's batches as tasks
(``ps_server/core/tasks.py``): each epoch's shuffled examples cut into batches of
``--global-batch-size / --num-workers`` (the examples one async push trains on without
tasks too). Each step a worker asks for a task, pulls, computes that batch
(``ps_common.batches.global_batch`` of the plan at the task's id) and pushes it naming
the task. A dead worker's tasks, an expired lease's, a refused push's go back to the
queue; only the holder's push of a task is applied, a retry is answered from the
record: every example is applied exactly once per epoch. The job ends when the server
says every task is applied; the chief then evaluates at once.

SIGTERM (``ps-launch`` scaling a job down, an operator, a scheduler) makes a worker
leave the job at once: it tells the server ``Leave`` (over a fresh channel: a call it
abandoned may still be using the old one), and ``ps-worker`` exits with 143 (128 +
SIGTERM, ``ps_common.procs.LEFT_JOB_STATUS``). The server moves the micro-batches it
had not delivered to the live workers, so nothing is lost or computed twice, and no
round waits for its lease to run out. A push of it still in flight either arrived
first (delivered) or is refused (its micro-batch went to another).

The handler only sets a flag (``SigtermFlag``), which the loop checks between calls: an
exception raised from a handler surfaces wherever the main thread is, and inside
TensorFlow that was a failure (a worker stopped in its gradient step exited 1 through
``traceback_utils`` and was declared dead). A gradient under way is finished first;
what may block (registering and joining, ``Work``, a push waiting for its round or
ssp's bound, a ``--pause-for``) ends within 50 ms. This holds from the loop's start
until its last round is done (a worker stopped before it registered has nothing to
leave); a rejoin runs to its end first (``--reconnect-timeout``); in ``finish`` SIGTERM
ends it as usual. It writes no ``--history-json``. Only in the main thread (where
signals arrive); a loop run in another keeps SIGTERM as it is.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import grpc

from ps_common.batches import global_batch, micro_batches
from ps_common.reasons import Reason
from worker.client import PSClientError
from worker.config import ConfigError
from worker.connection import connect, recoverable
from worker.trainer import TrainingLoop

log = logging.getLogger("worker")


class Stopped(Exception):
    """SIGTERM while training: this worker left the job (module docstring). Raised by the
    loop itself, where it checks the flag, never by the signal handler."""


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


class ElasticLoop(TrainingLoop):
    """``TrainingLoop`` whose steps are the server's rounds, computed micro-batch by micro-batch."""

    dealt = True  # the server deals the data: the chief waits for nobody before evaluating
    WAIT_S = 0.2  # async and ssp: every task handed out, some not done: ask again after this

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop = SigtermFlag()  # SIGTERM's, while run trains (module docstring)
        self.knobs.sleep = self.stop.sleep  # --pause-for ends at SIGTERM

    def run(self) -> dict:
        task = self.task
        # Signals reach the main thread only; a loop run from another one keeps SIGTERM as it is.
        catch = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self.stop) if catch else None
        try:
            self.stop.wait_for(self.start)  # registers, then (_before_join) sets the data plan; joins
            self.t0 = time.monotonic()
            if self.conn.registration.mode == "sync":
                self._rounds()
            else:
                self._tasks()
        except Stopped:
            raise Stopped(self._leave_now()) from None
        finally:
            if catch:
                signal.signal(signal.SIGTERM, previous)
        if self.conn.registration.mode == "sync":
            self.conn.step = task.total_steps
        return self.finish()

    def _before_join(self, registration) -> None:
        """The chief's data plan, which the server deals from: sync, the global batches of
        the job; async and ssp, tasks of ``--global-batch-size / --num-workers`` examples for
        ``--epochs`` epochs (``_tasks``)."""
        config, task = self.config, self.task
        self.stop.check()  # stopped while it registered: it leaves without joining
        if registration.mode == "sync":
            self.conn.data_plan = {"num_examples": task.num_examples,
                                   "global_batch_size": config.global_batch_size, "seed": config.seed}
            return
        if config.steps:
            raise ConfigError(f"--steps {config.steps}: async and ssp with --elastic train on the server's "
                              f"tasks for whole epochs; say --epochs")
        self.batch = max(1, config.global_batch_size // config.num_workers)
        self.conn.step = max(self.conn.step, registration.round)  # ssp: the slowest live worker's clock
        self.conn.data_plan = {"num_examples": task.num_examples, "global_batch_size": self.batch,
                               "seed": config.seed, "epochs": config.epochs}

    def _rounds(self) -> None:
        while True:
            try:
                if not self._one_round():
                    return
            except PSClientError as e:
                if _ask_again(e):
                    continue
                if not _rejoin_for(e):  # this worker was declared dead (a lease missed), or the server restarted
                    raise
                self.conn.rejoin(e)

    def _tasks(self) -> None:
        """Async and ssp: the server hands out the job's batches as tasks (``core.tasks``);
        each is applied exactly once, whoever dies or joins. A push of a task taken away
        meanwhile (its lease ran out) is refused and dropped; the job ends when the server
        says every task is applied."""
        while True:
            try:
                if not self._one_task():
                    return
            except PSClientError as e:
                if _rejoin_for(e):
                    self.conn.rejoin(e)
                elif not _task_taken_away(e):
                    raise

    def _one_task(self) -> bool:
        task, client, me = self.task, self.conn.client, self.conn.worker_id
        self.stop.check()
        offer = client.work(me)  # at once
        if not offer.sizes:
            if offer.finished:
                return False
            self.stop.sleep(self.WAIT_S)  # the last tasks are held by others; one may come back
            return True
        knob_s = self.knobs.before_step(self.conn.step) + self.knobs.before_pull()
        started = time.monotonic()
        version = self.conn.pull()
        self.stop.check()
        indices = global_batch(task.num_examples, self.batch, self.config.seed, offer.round)
        computing = time.monotonic()
        loss, grads = self.compute(*task.examples(indices), len(indices))
        compute_s = time.monotonic() - computing
        step = self.conn.step
        self.conn.step += 1  # never the same step twice: the mode answers a repeated step from its record
        pushing = time.monotonic()
        reply = self.stop.wait_for(client.push_task, me, step, version, offer.round, len(indices), grads, loss)
        record = {"step": step, "task": offer.round, "loss": loss, "batch_size": len(indices),
                  "base_version": version, "version": reply.version, "staleness": reply.staleness,
                  "dropped": reply.dropped, "t": time.monotonic() - self.t0, "pull_s": computing - started,
                  "compute_s": compute_s, "push_s": time.monotonic() - pushing, "knob_s": knob_s}
        self.history.append(record)
        self.observer.step(record)
        return True

    def _leave_now(self) -> str:
        """After SIGTERM: Leave over a fresh connection; what happened, in words."""
        reg = self.conn.registration
        if reg is None:
            return "stopped by SIGTERM before it registered"
        me = reg.worker_id
        try:
            with connect(self.config) as client:
                client.leave(me)
        except PSClientError as e:
            log.warning("stopped by SIGTERM; Leave failed (%s): the server declares worker %d dead once its "
                        "lease runs out", e, me)
            return f"stopped by SIGTERM at step {self.conn.step}; Leave failed: {e}"
        log.info("stopped by SIGTERM: left the job at step %d; the server deals the rest to the others",
                 self.conn.step)
        return f"stopped by SIGTERM: left the job at step {self.conn.step}"

    def _one_round(self) -> bool:
        """Ask for work, compute and push it micro-batch by micro-batch; False once the job is done."""
        task, client, me = self.task, self.conn.client, self.conn.worker_id
        work = self.stop.wait_for(client.work, me, timeout=self.conn.registration.barrier_timeout + client.timeout)
        if work.round >= task.total_steps:
            return False
        version = self.conn.pull()
        if version == work.round:  # else: dealt for a round that ended meanwhile: ask again
            self._compute_round(work, version)
        return True

    def _compute_round(self, work, version: int) -> None:
        task, client, me = self.task, self.conn.client, self.conn.worker_id
        knob_s = self.knobs.before_step(work.round)  # --pause-at-step: this round waits for us meanwhile
        started, compute_s = time.monotonic(), 0.0
        todo, sizes, losses = list(work.micro_batches), [], []
        reply = None
        while todo:
            self.stop.check()
            m = todo.pop(0)
            batch = micro_batches(task.global_batch(work.round), work.parts)[m]
            computing = time.monotonic()
            loss, grads = self.compute(*task.examples(batch), len(batch))
            compute_s += time.monotonic() - computing
            reply, more = self.stop.wait_for(client.push_micro, me, work.round, m, len(batch), grads, loss)
            sizes.append(len(batch))
            losses.append(loss)
            if more is not None and more.round == work.round:
                todo = list(more.micro_batches)  # the rest of ours, or a dead worker's part
        push_s = time.monotonic() - started - compute_s
        record = {"step": work.round, "loss": sum(l * n for l, n in zip(losses, sizes)) / max(sum(sizes), 1),
                  "batch_size": sum(sizes), "micro_batches": len(sizes), "base_version": version,
                  "version": reply.version, "staleness": 0, "dropped": False, "t": time.monotonic() - self.t0,
                  "pull_s": 0.0, "compute_s": compute_s, "push_s": push_s, "knob_s": knob_s}
        self.history.append(record)
        self.observer.step(record)
        self.conn.step = work.round + 1


def _task_taken_away(e: PSClientError) -> bool:
    """A push of a task this worker no longer holds (its lease ran out; another does it),
    or ssp's wait for the bound timed out after the push was applied: take the next one."""
    return e.code == grpc.StatusCode.DEADLINE_EXCEEDED or e.reason in (Reason.TASK_NOT_HELD, Reason.TASK_DONE)


def _rejoin_for(e: PSClientError) -> bool:
    return recoverable(e) or e.reason is Reason.NOT_JOINED


def _ask_again(e: PSClientError) -> bool:
    """A round that ended without this push (a late one), has not started (an early one) or
    timed out: the next ``Work`` says what now. Asked before ``_rejoin_for``: a sync worker
    rejoins for a late or early push, an elastic one only asks again."""
    return e.code == grpc.StatusCode.DEADLINE_EXCEEDED or e.reason in (Reason.LATE, Reason.EARLY)
