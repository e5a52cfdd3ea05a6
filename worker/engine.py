"""The one worker engine: every front door trains through it.

    engine = Engine(config, model, compute)   # ps-worker's TrainingLoop, tfps.keras, api.Session
    engine.start()                            # register, join (chief: initialize the server)
    row, reply = engine(Work(engine.conn.step, n, (x, y)))   # pull, compute, push, one row
    engine.ride_out(fn)                       # fn again after each fault the worker can ride out

It owns the connection (``worker.connection``), the one step, the one rejoin loop, and
the dealt work that ``worker.elastic`` reads (``task``, ``stop``, ``pending``, ``batch``,
``record``); docs/architecture.md. A step pulls (unless ``pull=False``), computes
(``compute(work)``: (loss, payload) and optionally a dict of what the push carries
besides) and ``push``es the payload (None: zeros, of weight 0), timed, as one history
row. ``stop`` (--elastic): SIGTERM's flag, checked before the tape and watched while
anything may block.
"""

from __future__ import annotations

import dataclasses
import time

from worker.client import PSClientError, PushReply
from worker.connection import Connection, Work, recoverable
from worker.gradients import zeros
from worker.knobs import Knobs, payload_nbytes


class Engine:
    """One worker's connection, step, rejoin loop and dealt work (module docstring)."""

    def __init__(self, config, model, compute=None, *, knobs: Knobs | None = None, stop=None, task=None,
                 record=None, conn: Connection | None = None, **connection):
        self.conn = conn or Connection(config, model, **connection)
        self.compute, self.task = compute, task
        self.knobs = knobs or Knobs.from_config(self.conn.config)
        self.record = record or (lambda row: None)  # each step's history row (worker.elastic's rounds too)
        self.pending = None  # elastic: work dealt for a later round than the step asking (worker.elastic)
        self.batch = 0  # elastic async and ssp: a task's examples
        self.skipped_rounds: tuple = ()  # elastic sync: the job's rounds without an update, as far as known
        self.watch(stop)  # sets self.stop
        self.t0 = time.monotonic()  # what the rows' t counts from

    @property
    def config(self):
        """The configuration, with the index the server assigned (``--worker-index auto``)."""
        return self.conn.config

    def watch(self, stop) -> None:
        """From now on ``stop`` (SIGTERM's ``worker.elastic.SigtermFlag``) ends what may block."""
        self.stop = stop
        if stop:
            self.knobs.sleep = stop.sleep  # --pause-for ends at SIGTERM

    def call(self, call, *args, **kwargs):
        """``call(*args, **kwargs)``, ended by SIGTERM when watched."""
        return self.stop.wait_for(call, *args, **kwargs) if self.stop else call(*args, **kwargs)

    # -- the connection
    def start(self) -> None:
        """Register and join (chief: initialize the server; others: check against it)."""
        try:
            self.conn.register()
            self.join()
        except BaseException:
            self.conn.close()
            raise

    def join(self) -> None:
        self.ride_out(self.conn.join)  # declared dead while it waited (paused), the server restarting

    def ride_out(self, call, *args, passing=None, rejoined=None, rides=recoverable):
        """``call(*args)``; after a fault the worker can ride out (``rides(e)``, by default
        ``recoverable``: the server restarting, this worker declared dead) rejoin, run
        ``rejoined()`` and call again: the one rejoin loop. A refusal ``passing(e)`` lets
        pass (asked first) calls again at once."""
        while True:
            try:
                return call(*args)
            except PSClientError as e:
                if passing is not None and passing(e):
                    continue
                if not rides(e):
                    raise
                self.conn.rejoin(e)
                if rejoined is not None:
                    rejoined()

    # -- one step
    def __call__(self, work: Work, pull: bool = True) -> tuple[dict, PushReply]:
        # Each phase's wall time excludes the knobs' sleeps, which are counted in knob_s.
        knob_s = self.knobs.before_step(work.step) + (self.knobs.before_pull() if pull else 0.0)
        pull_start = time.monotonic()
        if pull:
            self.conn.pull()
        if self.stop:
            self.stop.check()  # a gradient under way is finished first, none is started (worker.elastic)
        compute_start, cpu_start = time.monotonic(), time.process_time()
        loss, payload, *carries = self.compute(work)
        compute_s, compute_cpu_s = time.monotonic() - compute_start, time.process_time() - cpu_start
        return self.push(work, loss, payload, **(carries[0] if carries else {}), pull_s=compute_start - pull_start,
                         compute_s=compute_s, compute_cpu_s=compute_cpu_s,
                         knob_s=knob_s + self.knobs.after_compute(compute_s))

    def push(self, work: Work, loss: float, payload: dict | None, *, metrics=None, set_learning_rates=(),
             knob_s: float = 0.0, **timing) -> tuple[dict, PushReply]:
        """Push ``payload`` of ``work`` (None: zeros, of weight 0); (its history row, the reply)."""
        if payload is None:
            payload, work = zeros(self.conn.pulled), dataclasses.replace(work, batch_size=0)
        push_bytes = payload_nbytes(payload, self.config.grad_wire_dtype)
        knob_s += self.knobs.before_push(push_bytes)
        version, push_start = self.conn.version, time.monotonic()
        reply = self.call(self.conn.push, payload, work, loss, metrics=metrics, set_learning_rates=set_learning_rates)
        end = time.monotonic()
        row = {"step": work.step, "loss": loss, "batch_size": work.batch_size, "base_version": version,
               "version": reply.version, "staleness": reply.staleness, "dropped": reply.dropped, "t": end - self.t0,
               **timing, "push_s": end - push_start, "knob_s": knob_s, "push_bytes": push_bytes}
        return ({**row, "task": work.task} if work.task >= 0 else row), reply


__all__ = ["Engine"]
