"""The worker's loop in elastic sync: it computes what the server deals it.

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

SIGTERM (``ps-launch`` scaling a job down, an operator, a scheduler) makes a worker
leave the job at once, wherever it is: whatever it computes or waits for is
abandoned, it tells the server ``Leave`` (over a fresh channel: the interrupted
call's may be mid-use), and ``ps-worker`` exits with 143 (128 + SIGTERM). The server
moves the micro-batches it had not delivered to the live workers, so nothing is
lost or computed twice, and no round waits for its lease to run out. A push of
it still in flight either arrived first (delivered) or is refused (its micro-batch
went to another). This holds from the loop's start (a worker stopped before it
registered has nothing to leave) until its last round is done; in ``finish`` SIGTERM
ends it as usual. It writes no ``--history-json``. Only in the main thread (where
signals arrive); a loop run in another keeps SIGTERM as it is.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import grpc

from ps_common.batches import micro_batches
from worker.client import PSClientError
from worker.connection import connect, recoverable
from worker.trainer import TrainingLoop

log = logging.getLogger("worker")


class Stopped(BaseException):
    """SIGTERM while training: this worker left the job (module docstring). A BaseException,
    as KeyboardInterrupt is: raised wherever the signal lands, no ``except Exception`` on
    the way (TensorFlow's AutoGraph has some) may swallow it."""


_STOP = threading.Event()  # set by SIGTERM, and checked between micro-batches should the raise get lost


def _on_sigterm(signum, frame):
    _STOP.set()
    raise Stopped("SIGTERM")


def _stop_if_asked() -> None:
    if _STOP.is_set():
        raise Stopped("SIGTERM")


class ElasticLoop(TrainingLoop):
    """``TrainingLoop`` whose steps are the server's rounds, computed micro-batch by micro-batch."""

    def run(self) -> dict:
        task = self.task
        self.conn.data_plan = {"num_examples": len(task.data.y_train),
                               "global_batch_size": self.config.global_batch_size, "seed": self.config.seed}
        # Signals reach the main thread only; a loop run from another one keeps SIGTERM as it is.
        catch = threading.current_thread() is threading.main_thread()
        _STOP.clear()
        previous = signal.signal(signal.SIGTERM, _on_sigterm) if catch else None
        try:
            self.start()
            self.t0 = time.monotonic()
            self._rounds()
        except Stopped:
            if catch:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM does not cut the Leave short
            raise Stopped(self._leave_now()) from None
        finally:
            if catch:
                signal.signal(signal.SIGTERM, previous)
        self.conn.step = task.total_steps
        return self.finish()

    def _rounds(self) -> None:
        while True:
            try:
                if not self._one_round():
                    return
            except PSClientError as e:
                if _rejoin_for(e):  # this worker was declared dead (a lease missed), or the server restarted
                    self.conn.rejoin(e)
                elif not _ask_again(e):
                    raise

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
        _stop_if_asked()
        work = client.work(me, timeout=self.conn.registration.barrier_timeout + client.timeout)
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
            _stop_if_asked()
            m = todo.pop(0)
            batch = micro_batches(task._batches[work.round], work.parts)[m]
            computing = time.monotonic()
            loss, grads = self.compute(task.data.x_train[batch], task.data.y_train[batch], len(batch))
            compute_s += time.monotonic() - computing
            reply, more = client.push_micro(me, work.round, m, len(batch), grads, loss)
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


def _rejoin_for(e: PSClientError) -> bool:
    return recoverable(e) or any(d in e.details for d in ("was declared dead", "has not joined"))


def _ask_again(e: PSClientError) -> bool:
    """A round that ended without this push (a late one) or timed out: the next ``Work`` says what now."""
    return e.code in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.DEADLINE_EXCEEDED) \
        or "completed without it" in e.details
