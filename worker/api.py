"""The Python API: train your own Keras model and tf.data pipeline on a tfps parameter server.

    from worker import api

    result = api.train(build_model, make_dataset, ps="10.0.0.5:50051", worker_index=0, num_workers=2,
                       epochs=3, global_batch_size=128, optimizer="adam")

runs the same loop as ``ps-worker`` (``worker.trainer``) with your functions instead of
the built-in model and data (what they return and how the data is sharded:
docs/your-model.md, ``worker.task``). Every other keyword is a ``ps-worker`` flag with
``_`` for ``-``; unset ones come from ``TFPS_*`` and ``TF_CONFIG``, as for the command line.

A hand-written training step keeps its ``tf.GradientTape`` (docs/your-model.md shows the
loop): ``api.Session(model, **flags)`` registers, ``session.pull()`` loads the server's
parameters, and ``session.wrap(tape, batch_size=n).gradient(loss, variables)`` computes as the
tape does and pushes, as Horovod's ``DistributedGradientTape`` does. No local optimizer:
the server's applies, and the next ``pull`` brings its result. In sync mode ``gradient``
returns once the round is applied; in async and ssp once this push is.

A loop rides out a lost server (restarted from its checkpoint, a link cut, this
worker declared dead) as ``ps-worker`` and ``tfps.keras`` do: on an error that
``recoverable`` accepts, ``session.rejoin(error)`` registers again and loads the
server's parameters; compute that batch's gradients again on them::

        while True:
            try:
                session.pull()
                ...                                        # the tape and its push
                break
            except api.PSClientError as e:
                if not api.recoverable(e):
                    raise
                session.rejoin(e)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from worker import task as tasks
from worker.config import ConfigError, WorkerConfig

if TYPE_CHECKING:  # served by the module's __getattr__, on first use
    from worker.connection import PSClientError, recoverable

log = logging.getLogger("worker")


def make_config(**flags) -> WorkerConfig:
    """A validated ``WorkerConfig``: the given flags over ``TFPS_*`` and ``TF_CONFIG`` defaults."""
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    unknown = sorted(set(flags) - names)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; options are ps-worker's flags: "
                        f"{', '.join(sorted(names))}")
    return dataclasses.replace(WorkerConfig.from_args([], os.environ), **flags).validate()


def _label(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', 'user')}:{getattr(fn, '__qualname__', 'function')}"


def train(model_fn: Callable, dataset_fn: Callable, *, loss=None, metrics: Sequence | None = None, **flags) -> dict:
    """Train ``model_fn()``'s model on ``dataset_fn``'s data against the parameter server.

    Returns, on the chief, the final scores (``test_accuracy``, ``test_loss``, each
    metric as ``test_<name>``, ``final_loss``, ``examples_per_s``, staleness) after
    evaluating the server's final parameters on the eval dataset; on the others,
    their step count. Raises ``ConfigError`` for a bad option, model or dataset,
    and ``TrainingError`` / ``PSClientError`` when training cannot go on.
    """
    from worker.trainer import train as run

    config = make_config(model=_label(model_fn), dataset=_label(dataset_fn), **flags)
    return run(config, tasks.from_config(config, model_fn, dataset_fn, loss=loss, metrics=metrics))


class Session(contextlib.AbstractContextManager):
    """A worker's connection for a hand-written loop (module docstring): the ``ps-worker``
    loop's own pull and push (``worker.connection``), with the gradients a tape gave made
    into a push by the loop's own function (``worker.gradients.as_pushed``). It registers (the
    chief initializes the server from ``model``; the others check theirs matches), renews its
    lease from a thread, and leaves on ``close``."""

    def __init__(self, model, **flags):
        from worker.engine import Engine

        self.model = model
        self.engine = Engine(make_config(**flags), model)  # the one worker engine's push and rejoin
        self.connection = self.engine.conn
        self.engine.start()
        self.closed = False
        log.info("session: %s; starting at step %d", self.connection.describe(), self.step)

    # The connection's, read where they are kept.
    config = property(attrgetter("connection.config"))
    registration = property(attrgetter("connection.registration"))
    worker_index = property(attrgetter("connection.worker_id"))
    sync = property(attrgetter("connection.sync"))
    step = property(attrgetter("connection.step"), doc="The step the next push is for (sync: the server's round).")
    version = property(attrgetter("connection.version"),
                       doc="The version of the parameters the last ``pull`` loaded; -1 before the first.")

    def pull(self) -> int:
        """Load the server's parameters (and BatchNorm statistics) into the model; returns their version."""
        return self.connection.pull()

    def push(self, gradients: Mapping | Sequence, loss: float = 0.0, batch_size: int = 1):
        """Push gradients of the model's trainable variables (a list in
        ``model.trainable_variables`` order, or a dict by variable path; ``None`` or a
        missing variable counts as zero; ``tf.IndexedSlices`` travel as rows), with the
        change this step made to the non-trainable variables. Returns the server's reply."""
        from worker.connection import Work
        from worker.gradients import as_pushed, trainable

        if self.version < 0:
            raise RuntimeError("pull before the first push: the push says which version its gradients come from")
        if not isinstance(gradients, Mapping):
            variables, gradients = trainable(self.model), list(gradients)
            if len(gradients) > len(variables):
                raise ValueError(f"{len(gradients)} gradients for {len(variables)} trainable variables")
            gradients = {v.path: g for v, g in zip(variables, gradients)}
        payload = as_pushed(self.model, gradients, self.connection.pulled, self.connection.sparse_rule)
        return self.engine.push(Work(self.step, int(batch_size)), float(loss), payload)[1]

    def rejoin(self, error) -> int:
        """After ``recoverable(error)``: register again within ``reconnect_timeout`` (the chief
        re-initializes a server that restarted with no state) and load the server's parameters;
        their version. The next push is for ``step`` (sync: the server's round), as the
        ``tfps.keras`` step's ride-out (``worker.keras``): compute the batch again first."""
        self.connection.rejoin(error)
        return self.pull()

    def wrap(self, tape, batch_size: int) -> "PushingGradientTape":
        """``tape`` whose ``gradient(loss, sources)`` also pushes (module docstring)."""
        return PushingGradientTape(tape, self, batch_size)

    def close(self) -> None:
        """Leave the cluster (the server then knows this worker finished) and disconnect."""
        if self.closed:
            return
        self.closed = True
        try:
            self.connection.heartbeat.stop()
            self.connection.leave()
        finally:
            self.connection.close()

    def __exit__(self, *exc) -> None:
        self.close()


def __getattr__(name: str):
    """``PSClientError`` (what a Session's calls raise) and ``recoverable`` (whether
    ``Session.rejoin`` rides one out: ``worker.connection.recoverable``), imported on first
    use (grpc)."""
    if name in ("PSClientError", "recoverable"):
        from worker import connection

        return getattr(connection, name)
    raise AttributeError(name)


class PushingGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient`` computes as the tape does, pushes the
    result to the parameter server, and returns it. Everything else is the tape's."""

    def __init__(self, tape, session: Session, batch_size: int):
        self._tape, self._session, self._batch_size = tape, session, batch_size
        self.reply = None

    def gradient(self, target, sources, **kwargs):
        grads = self._tape.gradient(target, sources, **kwargs)
        flat_sources = list(sources) if isinstance(sources, (list, tuple)) else [sources]
        flat_grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
        self.reply = self._session.push({v.path: g for v, g in zip(flat_sources, flat_grads)},
                                        loss=float(np.asarray(target).mean()), batch_size=self._batch_size)
        return grads

    def __getattr__(self, name):
        return getattr(self._tape, name)


__all__ = ["train", "Session", "PushingGradientTape", "make_config", "recoverable", "PSClientError", "ConfigError"]
