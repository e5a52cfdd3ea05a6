"""Your Keras program on tfps: ``model.compile`` + ``model.fit`` as written, with the strategy line changed.

    import tfps.keras
    strategy = tfps.keras.Strategy()        # was: tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(train_dataset, epochs=5, validation_data=test_dataset)

started once per worker, by ``ps-launch --mode sync --workers 2 -- python train.py``
(which sets ``TF_CONFIG``) or by hand with ``TF_CONFIG`` / ``TFPS_WORKER_*`` set. Any
``ps-worker`` flag may be given to ``Strategy(...)`` with ``_`` for ``-``. What it does,
logs and refuses: docs/keras.md. Where each part lives here:

- Keras' own loop and train step, with the optimizer's ``apply`` taken over (``_Wrap``, as
  Horovod's ``DistributedOptimizer``), each step on this worker's part of the global batch
  (``_part``); the optimizer runs on the server (``worker.keras_optimizer``).
- The same batches on every worker: unseeded shuffles seeded (``Strategy.__init__``), each
  worker's batches checked (``BatchDigests``, ``DataMismatch``).
- Sync's logged metrics are the global batch's: each push carries its step's change to every
  metric's state, combined as the variable's ``aggregation`` says (``_metric_share``).
- The chief's decisions at each epoch's end (``stop_training``, learning rate, ``initial_epoch``)
  reach every worker through the server's ``Broadcast`` (``_agreement``); the callbacks that
  write files run on the chief alone (``CHIEF_ONLY``).
- ``evaluate``, ``predict`` and validation load the server's parameters first; model files hold
  its parameters and optimizer state (``_Attached._load_with_state``).
- Elastic (``Strategy(elastic=True)``): the server deals ``fit``'s arrays (``_dealt``), each
  Keras step one round of the job (``_Attached.round_step``, ``_Wrap.capture``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import inspect
import itertools
import json
import logging
import sys
import threading
from typing import Iterator

import numpy as np

from ps_common.names import SKIP_UPDATE, asks_skip, stepped_names
from ps_common.procs import LEFT_JOB_STATUS
from ps_common.sparse import SparseRows
from worker.gradients import as_pushed, changes, non_trainable, set_values, trainable, zeros
from worker.keras_optimizer import load_state, spec_fields
from worker.task import DealtArrays, TaskError, read_once, shard_bounds

log = logging.getLogger("worker.keras")

# Callbacks that write files: the chief's alone.
CHIEF_ONLY = ("ModelCheckpoint", "TensorBoard", "CSVLogger", "BackupAndRestore")
BATCHES = ("global", "per_worker")


@dataclasses.dataclass(frozen=True)
class ClusterResolver:
    task_type: str
    task_id: int
    num_workers: int


class Strategy:
    """tfps as a Keras distribution strategy (module docstring).

    ``batches``: "global" (each dataset element is a global batch; this worker computes its
    part) or "per_worker" (each element is already this worker's batch). Other keywords are
    ``ps-worker`` flags (``ps="10.0.0.5:50051"``, ``worker_index=0``, ``num_workers=2``);
    unset ones come from ``TFPS_WORKER_*`` and ``TF_CONFIG``."""

    def __init__(self, *, batches: str = "global", **flags):
        from worker.api import make_config

        if batches not in BATCHES:
            raise ValueError(f"batches must be one of {', '.join(BATCHES)}; got {batches!r}")
        self.batches = batches
        self.config = make_config(**flags)
        if self.config.elastic:
            if batches != "global":
                raise ValueError("elastic=True: the server deals the examples of your arrays; batches="
                                 f"{batches!r} (a dataset of this worker's own batches) cannot be dealt")
            import keras
            import tensorflow as tf

            # A micro-batch's gradient the same bits in every worker and every run: the initial weights
            # seeded and TensorFlow's ops deterministic (oneDNN is TF_ENABLE_ONEDNN_OPTS's, read when
            # TensorFlow loads: ps-launch --elastic sets it to 0).
            keras.utils.set_random_seed(self.config.seed)
            if self.config.deterministic:
                tf.config.experimental.enable_op_determinism()
        elif batches == "global":  # every worker's unseeded shuffles the same order (seeded ops are unchanged)
            import tensorflow as tf
            from tensorflow.python.eager import context

            if context.global_seed() is None:  # a seed the program sets later is the same on every worker too
                tf.random.set_seed(self.config.seed)
                log.info("tfps.keras: TensorFlow's global seed set to %d (--seed), so that every worker's "
                         "unseeded shuffles read the same order", self.config.seed)
        self.engine = None  # the one worker engine (worker.engine), once the first fit connects
        self.models: list = []
        self._lock = threading.Lock()
        self._fits = 0

    @property
    def connection(self):
        """The engine's connection (``worker.connection``); None before the first fit."""
        return self.engine.conn if self.engine is not None else None

    # -- what a strategy tells its user: its configuration's, under TensorFlow's names
    num_replicas_in_sync = property(lambda self: self.config.num_workers)
    worker_index = property(lambda self: self.config.worker_index)
    is_chief = property(lambda self: self.config.is_chief)

    @property
    def cluster_resolver(self) -> "ClusterResolver":
        """``task_type`` and ``task_id`` as TensorFlow's strategies give them (worker 0 is the chief)."""
        return ClusterResolver("worker", self.config.worker_index, self.config.num_workers)

    @property
    def server_learning_rates(self) -> list[float]:
        """The learning rate the server's optimizer used for each of this worker's updates, in order."""
        return [rate for attached in self.models for rate in attached.learning_rates]

    @property
    def mode(self) -> str | None:
        """The server's mode once connected ("sync", "async", "ssp"); None before the first fit."""
        return self.connection.registration.mode if self.connection else None

    def server_mode(self) -> str:
        """The server's mode, asked (its ``Status``) before this worker registers: how an elastic
        fit's data are dealt depends on it (``_dealt``)."""
        from protos import wire
        from worker.connection import connect

        with connect(self.config) as client:
            client.wait_ready(self.config.connect_timeout)
            return wire.mode_from_wire(client.status().mode)

    # -- attaching models
    @contextlib.contextmanager
    def scope(self) -> Iterator["Strategy"]:
        """Inside, every ``model.compile`` also attaches the model (``attach``)."""
        import keras

        had_own = "compile" in keras.Model.__dict__
        original = keras.Model.compile

        def compile(model, *args, **kwargs):
            original(model, *args, **kwargs)
            self.attach(model)

        keras.Model.compile = compile
        try:
            yield self
        finally:
            if had_own:
                keras.Model.compile = original
            else:
                del keras.Model.compile

    def attach(self, model) -> None:
        """Train ``model`` (compiled) on the parameter server from its next ``fit`` on."""
        if model.optimizer is None:
            raise ValueError("attach a compiled model: call model.compile(optimizer=..., loss=...) first")
        if any(a.model is model for a in self.models):
            return
        if self.models:
            raise ValueError("a tfps.keras.Strategy trains one model; make a Strategy per model")
        # refuses what the server cannot run, before any training (a MultiOptimizer's: each it holds yet)
        inner = _inner(model.optimizer)
        for optimizer in inner.optimizers if _is_multi(inner) else [inner]:
            spec_fields(optimizer)
        self.models.append(_Attached(self, model))

    # -- the cluster
    def connect(self, model, data_plan: dict | None, spec: dict) -> None:
        """Register, initialize (chief: with ``data_plan`` when the server deals the data, and the
        optimizer ``spec``) or check (others) the server, and load its parameters."""
        from worker.engine import Engine

        with self._lock:
            if self.engine is not None:
                return
            engine = Engine(self.config, model, optimizer_spec=spec)
            conn = engine.conn
            conn.data_plan = data_plan
            try:
                reg = conn.register()
                if self.config.elastic and reg.mode != "sync":  # ssp: a worker that joins starts at the slowest's clock
                    conn.step = max(conn.step, reg.round)
                engine.join()
                conn.pull()
            except BaseException:
                conn.close()
                raise
            self.engine = engine
            atexit.register(self.close)
        log.info("tfps.keras: %s", conn.describe())
        if not conn.sync and self.is_chief:  # said where the progress bar shows, whatever the logging set-up
            print(f"tfps.keras: {conn.registration.mode} mode: the loss and metrics each worker logs are its own "
                  "examples', not the cluster's", file=sys.stderr, flush=True)

    def agree(self, key: str, value: dict) -> dict:
        """The chief's ``value`` under ``key``, on every worker (the server's ``Broadcast``)."""
        conn = self.connection
        timeout = max(60.0, conn.registration.barrier_timeout)
        raw = self.engine.ride_out(conn.broadcast, key, json.dumps(value).encode() if self.is_chief else None, timeout)
        return json.loads(raw.decode())

    def gather(self, key: str, value: bytes) -> list[bytes]:
        """Every worker's ``value`` under ``key`` (this one's first): each posts its own ``key@w<i>``
        and reads the others' (``broadcast_poster``). Not ridden out: a lost server fails the caller."""
        conn, me = self.connection, self.connection.worker_id  # the index the server knows (auto: it assigned)
        timeout = max(60.0, conn.registration.barrier_timeout)
        said = [conn.broadcast(f"{key}@w{me}", value, timeout)]  # its own first: none waits on it
        others = [i for i in range(self.num_replicas_in_sync) if i != me]
        return said + [conn.broadcast(f"{key}@w{i}", None, timeout) for i in others]

    def vote(self, key: str, yes: bool) -> bool:
        """Whether any worker says yes under ``key`` (``gather``)."""
        return b"1" in self.gather(key, b"1" if yes else b"0")

    def close(self, leave: bool = True) -> None:
        """Leave the cluster (unless it has: ``leave=False``) and disconnect (also at the process's exit)."""
        conn, self.engine = self.connection, None
        if conn is None:
            return
        try:
            if leave:
                conn.leave()
        except Exception as e:  # the server may be gone at exit; leaving is a courtesy
            log.debug("leave failed: %s", e)
        finally:
            conn.close()


def _build(model, args, kwargs):
    """What gives the shapes of fit's data (a dataset's ``element_spec``, the arrays), or None (a
    generator). A model whose variables do not exist yet (a subclassed one: Keras makes them when
    it first traces the step) is built from them, as Keras builds it under a strategy, without
    reading a batch (which would move a shuffle's order on): the chief initializes the server
    from its variables before the first step."""
    import keras

    built = all(layer.built for layer in model._flatten_layers(include_self=False))  # a GAN: its parts
    given = inspect.signature(keras.Model.fit).bind_partial(model, *args, **kwargs).arguments
    x = given.get("x")
    if hasattr(x, "element_spec"):  # a tf.data.Dataset
        batch = x.element_spec
    elif isinstance(x, keras.utils.PyDataset):
        batch = x[0]
    elif x is not None and not callable(getattr(x, "__next__", None)):  # arrays
        batch = tuple(a for a in (x, given.get("y"), given.get("sample_weight")) if a is not None)
    elif built:
        return None
    else:
        raise ValueError(f"{type(model).__name__} is not built and fit's data is a generator: build the model "
                         "before fit (call it on a batch, or model.build(shape)) so that tfps can initialize "
                         "the server from its variables")
    if not built:
        model._symbolic_build(data_batch=batch)
    return batch


def _inner(optimizer):
    """The optimizer the server runs for ``optimizer``: a ``LossScaleOptimizer``'s inner one, else itself."""
    return optimizer.inner_optimizer if _scaled(optimizer) else optimizer


def _scaled(optimizer) -> bool:
    """Whether ``optimizer`` is a Keras ``LossScaleOptimizer`` (``mixed_float16``'s dynamic loss scale)."""
    return type(optimizer).__name__ == "LossScaleOptimizer"


def _overwriting(optimizer) -> bool:
    """Whether ``optimizer``'s window now under way overwrites the variables with their averages at
    each of its batches (``use_ema`` with ``ema_overwrite_frequency`` and accumulation: Keras counts
    the overwrites in updates, ``iterations``), and takes its later gradients there."""
    frequency = optimizer.ema_overwrite_frequency if optimizer.use_ema else None
    return bool(frequency) and (int(optimizer.iterations) + 1) % frequency == 0


def _grown(scale, counter: int, steps: int, growth: int) -> tuple:
    """A ``LossScaleOptimizer``'s float32 scale and step counter after ``steps`` finite steps: it
    doubles the scale at every ``growth``-th (times 2 and halving: exact)."""
    grows, counter = divmod(counter + steps, growth)
    return np.ldexp(scale, grows), counter


def _scale_variables(optimizer) -> list:
    """A ``LossScaleOptimizer``'s scale and step counter; [] for another optimizer."""
    return [optimizer.dynamic_scale, optimizer.step_counter] if _scaled(optimizer) else []


def _is_multi(optimizer) -> bool:
    return type(optimizer).__name__ == "MultiOptimizer"


def _parts(optimizer, variables: list) -> list:
    """(optimizer, its variables) of each optimizer the server runs for ``optimizer`` applied
    to ``variables``: a ``MultiOptimizer``'s choice for each variable (each a group of the
    server's spec), else the optimizer itself (the inner one under a loss scale)."""
    inner = _inner(optimizer)
    if not _is_multi(inner):
        return [(inner, list(variables))]
    inner.build(list(variables))  # its choice of optimizer for each variable, made as Keras makes it
    parts: dict = {}
    for v in variables:
        chosen = inner._inner_optimizers[inner._var_to_optimizer_idx[inner._var_key(v)]]
        parts.setdefault(id(chosen), (chosen, []))[1].append(v)
    return list(parts.values())


class _Attached:
    """The hooks on one attached model: its train function, fit, evaluate and predict."""

    def __init__(self, strategy: Strategy, model):
        self.strategy, self.model = strategy, model
        self.metrics_before: dict = {}  # every metric's state before this step
        self.tag = ""  # the fit's keys on the server's broadcast board (``_agreement``)
        # the chief's learning rate of each optimizer (id): read before its steps, and last sent
        self.rates, self.sent_rates = {}, {}
        self.epoch_rates: tuple = ()  # elastic: each optimizer's rate the chief agreed for this epoch
        self.dealt = None  # elastic: the fit's data, dealt by the server (worker.task.DealtArrays)
        self.first_epoch = 0  # elastic async and ssp: the job's epoch this fit's first one is (``_go_on``)
        self.next_round = 0  # elastic: the round the next Keras step is
        self.stop = None  # elastic: SIGTERM's flag (worker.elastic.SigtermFlag), while fit runs
        self.learning_rates: list[float] = []  # what the server used for each of this worker's updates
        self.read = BatchDigests()  # the global batches this worker read
        self.said_own = False  # the note on metrics of aggregation "none"
        self.per_update = _inner(model.optimizer).gradient_accumulation_steps or 1  # Keras' batches an update counts
        # gradient accumulation; elastic: the server's (sync) or each task's (async, ssp: ``_dealt``)
        self.window = Window(1 if strategy.config.elastic else self.per_update)
        self.wrap = _Wrap(self)  # Keras' train_step, wrapped
        self.original_fit = model.fit
        model.optimizer.finalize_variable_values = lambda var_list: self._take_averages()
        model.make_train_function, model.fit, model.train_function = self.make_train_function, self.fit, None
        # evaluate and predict on the server's parameters; model files with its optimizer state too
        for name, load in (("evaluate", self._load), ("predict", self._load), ("save", self._load_with_state),
                           ("save_weights", self._load_with_state)):
            setattr(model, name, _after(load, getattr(model, name)))

    # -- fit
    @property
    def optimizers(self) -> list:
        """The optimizers the server runs, each a group of its spec: the compiled one, or each a
        wrapped step applies (a GAN's ``d_optimizer`` and ``g_optimizer``; ``super().compile()``
        left ``model.optimizer`` unused; a ``MultiOptimizer``'s each)."""
        return [o for o, _ in self.wrap.parts] or [_inner(self.model.optimizer)]

    def fit(self, *args, callbacks=None, verbose="auto", **kwargs):
        strategy = self.strategy
        callbacks = list(callbacks or [])
        if not strategy.is_chief:
            left = [type(c).__name__ for c in callbacks if type(c).__name__ in CHIEF_ONLY]
            callbacks = [c for c in callbacks if type(c).__name__ not in CHIEF_ONLY]
            if left:
                log.debug("worker %d leaves %s to the chief", strategy.worker_index, ", ".join(left))
            verbose = 0
        fits = strategy._fits + 1  # a fit refused here does not count
        if strategy.config.elastic:  # the fit's data as the server deals them (``_dealt``)
            given = inspect.signature(self.original_fit).bind_partial(*args, **kwargs).arguments
            args, (self.dealt, kwargs) = (), _dealt(given, strategy.config, strategy.server_mode, self.per_update)
        self.model.train_function = None  # ours is made again by make_train_function
        self.wrap.prepare(_build(self.model, args, kwargs))
        if self.dealt is not None:  # a round (sync) or task (async, ssp) for each apply of the step (a GAN's: two)
            self.dealt.applies = self.wrap.learned
            if fits > 1 and strategy.connection is not None:
                self._go_on(strategy.connection, int(kwargs.get("initial_epoch") or 0))
        strategy._fits = fits
        callbacks.append(_agreement(strategy, fits, self))
        if self.dealt is None:
            return self.original_fit(*args, callbacks=callbacks, verbose=verbose, **kwargs)
        from worker import elastic

        # elastic: SIGTERM makes this worker leave the job at once and exit 143, as ps-worker --elastic does
        self.stop = elastic.SigtermFlag()
        try:
            with elastic.leaving_at_sigterm(self.stop, lambda: strategy.engine):
                history = self.original_fit(callbacks=callbacks, verbose=verbose, **kwargs)
        except elastic.Stopped as e:
            print(f"tfps.keras: worker {strategy.worker_index} {e}", file=sys.stderr, flush=True)
            strategy.close(leave=False)  # it left: no second Leave at exit
            raise SystemExit(LEFT_JOB_STATUS) from None
        self._load()
        return history

    def _go_on(self, conn, initial_epoch: int) -> None:
        """Elastic, a later fit: the server deals it from the job's data plan, the first fit's. In
        async and ssp its epochs go on after the job's (``first_epoch``): the plan grows by them,
        and the chief's Initialize at the fit's start extends the server's tasks (``Agreement``)."""
        dealt, plan, job = self.dealt, self.dealt.plan(), conn.data_plan
        data = {k: job[k] for k in ("num_examples", "global_batch_size", "seed")}
        if plan != job and (conn.sync or {k: plan[k] for k in data} != data):
            raise ValueError(f"elastic=True: the server deals every fit's rounds from the job's data plan, the "
                             f"first fit's ({job}); this fit's is {plan}: give it as many examples in batches "
                             "of the same size")
        if conn.sync:
            return
        done, per_epoch = dealt.job_tasks(job), dealt.steps_per_epoch
        if done % per_epoch:
            raise ValueError(f"elastic=True: this fit's epochs of {per_epoch} tasks cannot go on after the job's "
                             f"{done}: give every fit the same steps_per_epoch")
        self.first_epoch = done // per_epoch
        conn.data_plan = dealt.plan(done + max(0, dealt.epochs - initial_epoch) * per_epoch)

    def make_train_function(self, force: bool = False):
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        self.strategy.connect(model, self.dealt.plan() if self.dealt is not None else None, self.wrap.spec())
        engine = self.strategy.engine
        if self.dealt is not None:  # elastic: each dealt micro-batch through the wrapped step (``compute``)
            engine.compute, engine.task, engine.batch = self.compute, self.dealt, self.dealt.global_batch_size
            engine.watch(self.stop)
        model.train_function = self.train_function
        return model.train_function

    def train_function(self, iterator):
        """Up to ``steps_per_execution`` steps, as Keras' own: fewer where the epoch's data end
        (its last execution), none (``StopIteration``) when they had ended."""
        logs = None
        # the chief's learning rates, read here, not in the step's graph: pushes send changes (``_new_learning_rates``)
        if self.strategy.is_chief:
            self.rates = {id(o): _rate(o) for o in self.optimizers}
        for data in itertools.islice(iterator, max(1, int(self.model.steps_per_execution))):
            # elastic: Keras' batch is only counted; the server deals the examples
            logs = self.round_step() if self.dealt is not None else self.wrap.step(data)
        if logs is None:
            raise StopIteration
        return logs

    def round_step(self) -> dict:
        """Elastic: one Keras step is round ``next_round`` of the job (sync, a step of n applies: the
        n rounds from n x ``next_round``, one each, ``compute``): this worker's micro-batches of it,
        if the server deals it some (``worker.elastic.round_at``: a worker that joined
        late skips the rounds the cluster is past), then the server's parameters. Async and
        ssp: the next task the server hands out, if it is of this epoch (``task_at``; a step of n
        applies: the next n, each an apply of its batch, ``TaskQueue.applies``)."""
        from worker import elastic

        r, self.next_round = self.next_round, self.next_round + 1
        for phase in range(self.dealt.applies):  # a round (a task) for each of the step's applies, in turn
            if self.strategy.connection.sync:
                elastic.round_at(self.strategy.engine, r * self.dealt.applies + phase)
            else:
                elastic.task_at(self.strategy.engine, r // self.dealt.steps_per_epoch)
        self._pull()
        if not all(getattr(m, "built", True) for m in self.model.metrics):
            return {}  # a worker that joined late and skipped its first steps has updated no metric yet
        return self.model.get_metrics_result()

    def _answered(self, pushed: tuple | None) -> None:
        """After a step: where it pushed (``pushed``: row, reply, scale), the round's metric state (sync: the
        global batch's, and whether every worker read the same batch); the server's parameters."""
        row, reply, _ = pushed or (None, None, None)
        if reply is not None and self.strategy.connection.sync and reply.metrics:
            self.read.check_round(reply.metrics, row["step"])
            pushes = int(reply.metrics[BatchDigests.KEY][0])
            for v in _metric_variables(self.model):
                if v.path in reply.metrics:
                    v.assign(_metric_combined(v, self.metrics_before[v.path], reply.metrics[v.path], pushes))
        self._pull()

    def _pull(self) -> None:
        """The server's parameters into the model (riding out a lost server); the local
        optimizer's ``iterations`` follow the server's version (elastic under a loss scale: less the
        rounds that skipped, and the scale theirs, as far as this worker knows them); ``_averaged``."""
        conn, seen = self.strategy.connection, self.strategy.connection.registration.incarnation
        self.strategy.engine.ride_out(conn.pull, rejoined=lambda: self._rejoined(seen, self.wrap.position + 1))
        version, elastic_sync = max(0, int(conn.version)), self.dealt is not None and conn.sync
        # elastic sync: a round is a batch, as Keras counts them (the server holds a window), or one apply of it
        self.model.optimizer._iterations.assign(version // self.dealt.applies if elastic_sync else
                                                version * self.per_update)
        self._averaged()
        for optimizer in {id(o): o for o in self.wrap._sites()}.values() if elastic_sync else ():
            self._count_to(version, optimizer)

    def _count_to(self, round_: int, optimizer) -> None:
        """Elastic sync: ``optimizer``'s updates before round ``round_`` and, under a loss scale, its
        scale then, from the job's rounds before it that skipped (the server's
        ``Assignment.skipped_rounds``), the same on every worker. A step of n applies is n rounds a
        batch: the optimizer's own are those of its applies' places (``_Wrap._sites``)."""
        n, sites = self.dealt.applies, self.wrap._sites()
        places = [p for p in range(n) if n == 1 or sites[p] is optimizer]

        def own(r: int) -> int:  # the optimizer's rounds before round r
            return sum(-(-(r - p) // n) for p in places)

        skipped = [own(r) for r in self.strategy.engine.skipped_rounds if r < round_ and r % n in places]
        _inner(optimizer)._iterations.assign(own(round_) - len(skipped))
        if not _scaled(optimizer):
            return
        scale, counter, at, growth = np.float32(optimizer.initial_scale), 0, 0, optimizer.dynamic_growth_steps
        for r in skipped:  # LossScaleOptimizer's arithmetic: the good rounds before each, then its halving
            scale, counter, at = _grown(scale, counter, r - at, growth)[0] / 2, 0, r + 1
        for v, value in zip(_scale_variables(optimizer), _grown(scale, counter, own(round_) - at, growth)):
            v.assign(value)

    def _rejoined(self, seen: str | None = None, position: int = 0) -> bool:
        """After a rejoin: the chief's next push sends its learning rate again (a restarted
        server holds its checkpoint's). Sync, the server restarted (not incarnation ``seen``):
        whether this worker is behind another (``position``: the step whose batch it pushes
        next), one round's reply lost to it in the restart and not to the other: it then drops
        its batch, so that every worker's next push is of the same global batch."""
        self.sent_rates = {}
        strategy, conn = self.strategy, self.strategy.connection
        if seen in (None, conn.registration.incarnation) or not conn.sync or self.dealt is not None \
                or strategy.num_replicas_in_sync == 1:
            return False
        said = strategy.gather(f"{self.tag}/restart-{conn.registration.incarnation}", str(position).encode())
        if position < max(int(p) for p in said):
            log.warning("worker %d: the restart lost the reply of the round the others saw complete; this "
                        "worker drops its batch of that round, the others' next push being of the next one",
                        strategy.worker_index)
            return True
        return False

    def compute(self, work) -> tuple[float, dict | None, dict]:
        """Elastic: a dealt micro-batch through Keras' step, wrapped (``_Wrap.capture``; in sync the
        round's apply of it, ``_Wrap.phase``): its logged loss and payload (none where not finite:
        weight 0), its push's learning rate, and no metrics (each worker logs its own) but a loss
        scale's ``SKIP_UPDATE``."""
        sync, metrics = self.strategy.connection.sync, None
        phase = (work.step if sync else work.task) % self.dealt.applies  # the step's apply this round (task) pushes
        optimizer = self.wrap._sites()[phase] if self.dealt.applies > 1 else self.model.optimizer
        if _scaled(optimizer) and sync:  # the round's scale, every worker's
            self._count_to(work.step, optimizer)
        loss, payload = self.wrap.capture(work.examples, phase) if work.batch_size else (0.0, None)
        if work.batch_size and payload is None:
            self._not_finite()
            loss = 0.0
        if _scaled(optimizer):  # the round skips its update (sync), or the task its own (async and ssp)
            metrics = {SKIP_UPDATE: np.array([1.0 if self.wrap.skip else 0.0])}
            if not sync:  # async and ssp: this worker's own scale, as without elastic=True
                self.wrap._rescale(optimizer, self.wrap.skip)
        return loss, payload, {"metrics": metrics, "set_learning_rates": self._new_learning_rates(self.optimizers)}

    def _not_finite(self) -> None:
        """Logged, so that TerminateOnNaN sees it (in sync on every worker, through the round's sum)."""
        log.warning("worker %d: a loss or gradient that is not finite at step %d; not pushed",
                    self.strategy.worker_index, self.strategy.connection.step)

    def _metric_changes(self) -> dict | None:
        """What a sync push carries of the metrics (``_metric_share``) and of the batch read."""
        if not self.strategy.connection.sync:  # (elastic pushes carry none: ``compute``)
            return None
        # Keras builds the compiled metrics' state at their first update: from zeros, as ours start.
        before, variables = self.metrics_before, _metric_variables(self.model)
        before.update({v.path: np.zeros(v.shape, v.dtype) for v in variables if v.path not in before})
        changes = {v.path: _metric_share(v, before[v.path], self.strategy.is_chief)
                   for v in variables if _aggregation(v) != "none"}
        own = sorted(v.path for v in variables if _aggregation(v) == "none")
        if own and not self.said_own and self.strategy.is_chief:
            self.said_own = True
            print(f"tfps.keras: {', '.join(own)} declare aggregation='none': each worker logs its own state "
                  "of them, not the global batch's", file=sys.stderr, flush=True)
        changes[BatchDigests.KEY] = self.read.last
        return changes

    def _new_learning_rates(self, optimizers: list) -> tuple[float, ...]:
        """What a push of ``optimizers``' variables (what it steps) sends: entry i the chief's rate
        of the server's group i (``self.optimizers[i]``) where it is one of them and callbacks
        changed its rate since its pushes last sent it, else 0; () for none. Elastic: the
        epoch's rates (``epoch_rates``), sent by every worker with every push, so that a round's
        rate is the same whoever computes its micro-batches (or tasks)."""
        if self.dealt is not None:
            rates = tuple(_rate(o) or 0.0 for o in self.optimizers)
            if rates != self.epoch_rates:
                raise ValueError(f"elastic=True: a callback changed the learning rate within an epoch "
                                 f"({self.epoch_rates} to {rates}); where the server deals the data the chief's rate "
                                 "is agreed at each epoch's start (LearningRateScheduler, ReduceLROnPlateau change it "
                                 "there), or compile a keras.optimizers.schedules.LearningRateSchedule")
            return rates if any(rates) else ()
        stepped, rates = {id(o) for o in optimizers}, [0.0] * len(self.optimizers)
        for i, optimizer in enumerate(self.optimizers):
            key = id(optimizer)
            lr = self.rates.get(key)
            # The first push of each optimizer always sends it: a callback may have set it before the first
            # step (LearningRateScheduler at epoch 0), and a server that outlived a job may hold another.
            if key in stepped and lr is not None and lr != self.sent_rates.get(key):
                rates[i] = self.sent_rates[key] = lr
                log.debug("tfps.keras: learning rate %g of %s from the chief's update at step %d", lr,
                          type(optimizer).__name__, self.strategy.connection.step)
        while rates and not rates[-1]:
            rates.pop()
        return tuple(rates)

    def _load(self) -> None:
        if self.strategy.connection is not None:
            self.strategy.connection.pull()
            self._averaged()

    def _averaged(self) -> None:
        """After a pull: within a window that overwrites (``_overwriting``; a validation at an
        epoch's end may fall in it) the variables are the averages, as this worker moved them."""
        optimizer = _inner(self.model.optimizer)
        if self.window.batches and _overwriting(optimizer):
            optimizer._overwrite_model_variables_with_average_value(optimizer._trainable_variables)

    def _load_with_state(self) -> None:
        """The server's parameters into the model and its optimizer state (slots, step count)
        into the Keras optimizer (``worker.keras_optimizer.load_state``), all of one version:
        what ``model.save``, ``ModelCheckpoint`` and ``BackupAndRestore`` then write, so the
        file resumes in one process as that process's own file does."""
        conn = self.strategy.connection
        if conn is None:  # before the first fit: the model as built
            return
        _, values, states = conn.client.optimizer_state(conn.worker_id)
        set_values(self.model, values)
        for optimizer, _ in self.wrap.served:  # set by the first fit, before it connected
            named = {v.path: states[self.wrap.pushed_as.get((id(optimizer), v.path), v.path)]
                     for _, held in self.wrap.owned[id(optimizer)] for v in held}  # its own state of each
            steps = [load_state(o, held, named, self.per_update) for o, held in self.wrap.owned[id(optimizer)]]
            if _is_multi(_inner(optimizer)):
                _inner(optimizer)._iterations.assign(max(steps))

    def _take_averages(self) -> None:
        """The end of ``fit`` with ``use_ema``: the compiled optimizer's variables take their
        moving averages on the server (every worker asks; the second ask changes nothing), and
        this worker's model the server's values, as Keras' ``finalize_variable_values`` does.
        A ``gradient_accumulation_steps`` window under way: Keras moved the averages at each of
        its batches, so the server moves them first (``Window.batches``)."""
        conn, optimizer = self.strategy.connection, self.model.optimizer
        # none before a fit, nor where a step of its own never applies the compiled optimizer
        parts = self.wrap.owned.get(id(optimizer), []) if conn is not None else []
        key = id(optimizer)  # a variable another optimizer steps first: this one's average by its second name
        names = [self.wrap.pushed_as.get((key, v.path), v.path) for o, part in parts if o.use_ema for v in part]
        if names:
            _, values, _ = conn.client.optimizer_state(conn.worker_id, averages=names,
                                                       window_batches=self.window.batches)
            set_values(self.model, values)


def _after(load, original):
    """``original`` (a model's bound method), called once ``load()`` has run."""
    def call(*args, **kwargs):
        load()
        return original(*args, **kwargs)

    return call


class _Wrap:
    """Keras' train step (the default or a model's own), run as Keras runs it, in one
    ``tf.function``, with the optimizer's ``apply`` taken over (docs/keras.md): each ``apply``
    hands its gradients to the server through a ``tf.py_function``. The step's last one is
    pushed when the step has returned, with its metric changes (``_Attached._metric_changes``);
    one with another after it (counted when the step is traced; eager, in the step before) is
    pushed at once and the server's values assigned in the step's graph, for what follows."""

    def __init__(self, attached: "_Attached"):
        self.attached = attached
        self.traced = self.function = None  # the step; traced on its first call (``model.run_eagerly``: not)
        self.specs: set = set()  # the input structures it was traced on (``_run``)
        self.learned = 1  # the ``apply`` calls of the last eager step
        self.position = 0  # the steps this worker has begun: the batch it pushes next
        self.examples = 0  # this worker's part of the step's batch: the push's weight
        self.batch_examples = 0  # the step's global batch (``batches="per_worker"``: this worker's)
        self._begin({})
        self.plan: list = []  # (optimizer, variables) of each apply of the traced step (eager: the step so far)
        self.served: list | None = None  # (optimizer, variables) of each optimizer the step applies
        self.parts: list = []  # (optimizer, variables) of each the server runs (a MultiOptimizer's each)
        self.owned: dict = {}  # id of each optimizer the step applies: its ``parts`` (what its push steps)
        self.pushed_as: dict = {}  # (id of such an optimizer, a variable's path): its second name (``_check_served``)
        self.grouped = False  # served as groups: several optimizers, or one to some variables
        self.skipped: dict = {}  # id of each optimizer under a loss scale: its skipped updates (sync: every worker's)
        self.patch(attached.model.optimizer)

    def patch(self, optimizer) -> None:
        optimizer.apply = lambda grads, trainable_variables=None: self.apply(grads, trainable_variables, optimizer)

    def prepare(self, batch) -> None:
        """Before ``fit``: every optimizer the model holds (a GAN's ``d_optimizer`` and
        ``g_optimizer``, set after ``compile``) applies through here, and the step is traced
        on ``batch``'s shapes, so that the optimizers it applies, and to which variables, are
        known before the chief initializes the server (``served``, ``spec``)."""
        import keras
        import tensorflow as tf

        model = self.attached.model
        for optimizer in {id(o): o for o in [model.optimizer, *vars(model).values()]
                          if isinstance(o, keras.optimizers.Optimizer)}.values():
            self.patch(optimizer)
            if _scaled(optimizer) and not optimizer.built:  # its scale, read in the step's graph
                optimizer.build(trainable(model))
                optimizer.built = True
        if self.function is None:
            def traced(data):
                self.plan = []
                return model.train_step(data)

            self.traced = tf.autograph.experimental.do_not_convert(traced)
            self.function = self.traced if model.run_eagerly else tf.function(self.traced, reduce_retracing=True)
        if self.served is not None:
            return
        if batch is not None and (type(model).train_step is not keras.Model.train_step or not model.run_eagerly):
            # traced as ``_run`` traces it; run eagerly, traced apart only to see which optimizers it applies
            spec = _relaxed(keras.utils.pack_x_y_sample_weight(*keras.utils.unpack_x_y_sample_weight(batch)))
            (tf.function(self.traced) if model.run_eagerly else self.function).get_concrete_function(spec)
            self.learned = max(1, len(self.plan))  # an eager step's first apply is pushed at once too
        served: dict = {}
        for optimizer, variables in self.plan:
            served.setdefault(id(optimizer), (optimizer, {}))[1].update({v.path: v for v in variables})
        everything = trainable(model)
        self.served = [(o, [v for v in everything if v.path in held]) for o, held in served.values()] \
            or [(model.optimizer, everything)]
        try:
            self._check_served(everything)
        except ValueError:
            self.served = None  # a fit tried again is traced and checked again
            raise

    def _check_served(self, everything: list) -> None:
        """Refuse, in one line, what the server cannot serve of the optimizers the step applies."""
        name = type(self.attached.model).__name__
        paths = [v.path for _, variables in self.served for v in variables]
        # Each optimizer its variables (a group of the server's spec), unless one steps them all.
        self.owned = {id(o): _parts(o, variables) for o, variables in self.served}
        self.parts = [part for parts in self.owned.values() for part in parts]
        self.grouped = len(self.parts) > 1 or len(paths) != len(everything)
        # A variable an earlier group steps too (two optimizers applied to it): pushed by its second name
        keyed = [(key, variables) for key, parts in self.owned.items() for _, variables in parts]
        self.pushed_as = {(key, v.path): name for (key, variables), names in
                          zip(keyed, stepped_names([[v.path for v in vs] for _, vs in keyed]))
                          for v, name in zip(variables, names) if name != v.path}
        specs = [spec_fields(o) for o, _ in self.parts]
        accumulates = self.attached.window.steps > 1 or any(s.get("gradient_accumulation_steps") for s in specs)
        if self.grouped and accumulates:
            raise ValueError(f"{name}: gradient_accumulation_steps is served with one optimizer")

    def spec(self) -> dict:
        """The server's optimizer: the one the step applies, or each with its variables (``groups``)."""
        specs = [spec_fields(o) for o, _ in self.parts]
        if not self.grouped:
            return specs[0]
        return {**specs[0], "groups": [{"variables": [v.path for v in variables], "optimizer": spec}
                                       for (_, variables), spec in zip(self.parts, specs)]}

    def step(self, data) -> dict:
        """One call of the model's ``train_step`` on this worker's part of the global batch
        (``batches="per_worker"``: the batch), then the held push, the server's values and the
        round's metric state (``_Attached._answered``). A lost server (the server restarting,
        this worker declared dead: ``worker.connection.recoverable``) is ridden out while
        nothing of the step has been pushed yet: rejoin, undo the step's metric updates and
        run it again on the same batch at the step the server gives."""
        import keras

        from worker.connection import recoverable

        a = self.attached
        strategy, model = a.strategy, a.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.batch_examples = _batch_size(x)  # the global batch's, or this worker's own (batches="per_worker")
        if strategy.batches == "global":
            a.read.add((x, y, sample_weight))
            x, y, sample_weight = _part((x, y, sample_weight), strategy.worker_index, strategy.num_replicas_in_sync)
            data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        self.examples = _batch_size(x)
        # sync, the global batch's parts: this worker's part weighs as its share (gradient_accumulation_steps)
        parts = strategy.connection.sync and strategy.batches == "global"
        a.window.share = self.examples * strategy.num_replicas_in_sync / self.batch_examples \
            if parts and self.batch_examples else 1.0
        before = {v.path: np.array(v.numpy()) for v in _metric_variables(model)}
        self.position, seen, behind = self.position + 1, strategy.connection.registration.incarnation, []

        def attempt():
            if behind:  # a batch the others are past, after a restart: dropped (``_Attached._rejoined``)
                return model.get_metrics_result(), None
            if not a.window.batches:  # sync: the metric changes of a whole window go with its push
                a.metrics_before = dict(before)
            self._begin(strategy.connection.pulled)
            logs = self._run(data) if self.examples else {}
            if parts and self.examples:
                _weigh_output_losses(model, before, self.examples / self.batch_examples)
            if not self.examples:  # a tiny last batch left this worker nothing: pushes of weight 0, each apply's
                sites = self._sites()
                for i in range(self.learned - 1):
                    self._push(None, sites[i] if i < len(sites) else None, False)
                self._keep(None if a.window.last() else {}, sites[-1])  # {}: nothing added to the window
            if self.held or self.deferred is None:  # in a window (``_keep``), or no apply: nothing to push
                return logs, None
            deferred, self.deferred = self.deferred, None  # the step's last apply, with its metric changes
            return logs, self._push(*deferred, metrics=a._metric_changes(), loss=_logged_loss(logs))

        def undo() -> None:  # after a rejoin: the step's metric updates, on the server's parameters
            for v in _metric_variables(model):
                v.assign(before.get(v.path, np.zeros(v.shape, v.dtype)))
            strategy.connection.pull()
            behind[:] = [True] if a._rejoined(seen, self.position) else []

        logs, pushed = strategy.engine.ride_out(attempt, rejoined=undo,
                                                rides=lambda e: recoverable(e) and not self.immediate)
        if self.held:  # gradient_accumulation_steps: the window goes on; Keras counts the batch, unless its loss
            self._rescale(self.served[0][0], self.skip)  # scale skipped it (not in the window)
            if not self.skip:
                self._overwrite(_inner(model.optimizer), self.served[0][1])
            _inner(model.optimizer)._iterations.assign_add(0 if self.skip else 1)
            return model.get_metrics_result()
        if self.examples:
            self.learned = max(1, self.applies) if model.run_eagerly else len(self.plan)
        a.window.clear()
        a._answered(pushed)
        # Each optimizer's own steps: its applies of the server's updates, less those its loss scale skipped
        # (the inner optimizer's, as LossScaleOptimizer's counts only the updates made).
        sites, version = self._sites(), max(0, int(strategy.connection.version))
        for optimizer, _ in self.served:
            made = version * sites.count(optimizer) // len(sites) * a.per_update - self.skipped.get(id(optimizer), 0)
            _inner(optimizer)._iterations.assign(max(0, made))
        fresh = model.get_metrics_result()
        return {k: fresh.get(k, v) for k, v in logs.items()} if logs else fresh

    def _overwrite(self, optimizer, variables: list) -> None:
        """After a batch held in a window that overwrites (``_overwriting``): Keras moves the
        averages and overwrites the variables with them. Its own code does that here, on the
        server's averages as of the window's start (read at its first batch); the server's update
        then steps from the same averages (``ps_server.core.optim.optimizers``)."""
        if not _overwriting(optimizer):
            return
        if self.attached.window.batches == 1:
            if not optimizer.built:  # where the server steps, the local optimizer is built for this alone
                optimizer.build(variables)
            conn = self.attached.strategy.connection
            _, _, states = self.attached.strategy.engine.ride_out(conn.client.optimizer_state, conn.worker_id)
            for v, average in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average):
                average.assign(states[v.path]["ema"])
        optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
        optimizer._overwrite_model_variables_with_average_value(optimizer._trainable_variables)

    def _begin(self, pulled: dict, phase: int | None = None) -> None:
        """A step's state before its first ``apply``, its non-trainable changes measured from
        ``pulled``; ``phase``: the one apply it pushes (elastic sync, ``capture``)."""
        self.phase = phase
        self.applies = self.immediate = 0  # this step's applies: all, and those pushed at once
        self.deferred: list | None = None  # [payload (None: not finite), optimizer, skip] of the step's last apply
        self.held = False  # the step's gradients went into a gradient_accumulation_steps window
        self.skip = False  # the apply now exchanged asks to skip its update
        self.base = dict(pulled)  # the non-trainable values the next push's changes are measured from

    def _run(self, data):
        """The step on ``data``, traced (once per structure) on its shapes with the batch dimension
        unknown, as Keras' own train function sees a dataset's elements (CompileLoss weighs each
        output's loss by the static batch size: unknown, each batch counts once)."""
        if self.function is not self.traced:
            spec = _relaxed(data)
            if repr(spec) not in self.specs:
                self.specs.add(repr(spec))
                self.function.get_concrete_function(spec)
        return self.function(data)

    def capture(self, examples, phase: int = 0) -> tuple[float, dict | None]:
        """Elastic: Keras' step on a dealt micro-batch (x, y, sample weight) against the
        parameters pulled for its round: its logged loss, and the payload of its ``apply``
        number ``phase`` (None: not finite), which the engine pushes naming the micro-batch. A
        step of several applies is as many rounds (``Cursor.applies``): the applies before
        ``phase`` push nothing and take the pulled values (their rounds' updates made, with the
        non-trainable state they left), those after it are not exchanged."""
        import keras

        self.examples = self.batch_examples = _batch_size(examples[0])
        self._begin(self.attached.strategy.connection.pulled, phase)
        logs = self._run(keras.utils.pack_x_y_sample_weight(*examples[:3]))
        (payload, _, _), self.deferred = self.deferred or [None, None, False], None
        return _logged_loss(logs), payload

    def apply(self, grads, trainable_variables, optimizer) -> None:
        """``optimizer``'s ``apply`` in the step's graph (class docstring): its gradients through ``_exchange``."""
        import tensorflow as tf

        model = self.attached.model
        variables = list(optimizer._trainable_variables if trainable_variables is None else trainable_variables)
        self.plan.append((optimizer, variables))
        if self.served is not None:  # traced again, or eager: the optimizers the server was set up with
            group = next((held for o, held in self.served if o is optimizer), None)
            if group is None or sorted(v.path for v in variables) != sorted(v.path for v in group):
                raise ValueError(f"{type(model).__name__}.train_step applies {type(optimizer).__name__} to "
                                 f"{len(variables)} variables, not as its first step did (the server serves "
                                 f"{len(self.served)} optimizer(s) of fixed variables)")
        kinds, inputs = [], []
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                kinds.append("slices")
                inputs += [g.values, g.indices]
            else:
                kinds.append("none" if g is None else "dense")
                inputs += [] if g is None else [g]
        # a loss scale's state too, stepped on the push's reply: what the step reads of it after this apply is that
        held = trainable(model) + non_trainable(model) + _scale_variables(optimizer)
        inputs += [tf.identity(v.value) for v in non_trainable(model)]  # read after the forward pass's updates
        graph = not tf.executing_eagerly()
        out = tf.py_function(lambda *t: self._exchange(variables, kinds, t, graph, optimizer, held), inputs,
                             Tout=[tf.bool] + [tf.as_dtype(v.dtype) for v in held])

        def load():
            for v, value in zip(held, out[1:]):
                v.assign(tf.reshape(value, v.shape))
            return tf.constant(True)

        tf.cond(tf.reshape(out[0], []), load, lambda: tf.constant(False))

    def _exchange(self, variables, kinds, tensors, graph: bool, optimizer, held: list) -> list:
        """One ``apply``'s gradients as pushed (``as_pushed``; a non-finite one: a push of
        weight 0; under a ``LossScaleOptimizer``, unscaled as it unscales them, and a
        non-finite one asks the server to skip the update, ``SKIP_UPDATE``); returns [pushed
        at once, the server's values of ``held``]."""
        import tensorflow as tf

        a = self.attached
        model, conn = a.model, a.strategy.connection
        self.applies += 1
        if self.phase is not None and self.applies - 1 != self.phase:  # another round's apply (``capture``)
            if self.applies - 1 < self.phase:  # (a loss scale's as it is: each round's is set by ``compute``)
                return [True] + [conn.pulled[v.path] for v in trainable(model) + non_trainable(model)] + \
                    [v.numpy() for v in _scale_variables(optimizer)]
            return [False] + [np.zeros((), np.dtype(v.dtype)) for v in held]
        grads, given = {}, iter(tensors)
        for v, kind in zip(variables, kinds):
            if kind == "dense":
                grads[v.path] = next(given)
            elif kind == "slices":  # its values, then its indices
                grads[v.path] = tf.IndexedSlices(next(given), next(given), tf.constant(v.shape, tf.int64))
        now = {v.path: next(given).numpy() for v in non_trainable(model)}
        self.skip = False
        if _scaled(optimizer):  # LossScaleOptimizer._stateful_handle_finite_grads' arithmetic
            dense = {p: tf.convert_to_tensor(g) for p, g in grads.items()}
            self.skip = not all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in dense.values())
            if a.window.steps > 1 and conn.sync:  # a window's batch: skipped where any worker's part overflows
                self.skip = a.strategy.vote(f"{a.tag}/skip{conn.step}.{a.window.batches}.{a.window.skipped}", self.skip)
            grads = {p: tf.divide(g, optimizer.dynamic_scale) for p, g in dense.items()}
        factor = _inner(optimizer).loss_scale_factor  # a static scale: unscaled as Keras' apply unscales it
        if factor is not None:
            grads = {p: tf.IndexedSlices(g.values / factor, g.indices, g.dense_shape)
                     if isinstance(g, tf.IndexedSlices) else g / factor for p, g in grads.items()}
        payload = as_pushed(model, grads, self.base, conn.sparse_rule, now)
        if self.grouped:  # this optimizer's variables alone (OptimizerSpec.groups), each by its name for it
            mine = {v.path for v in variables} | set(now)
            payload = {self.pushed_as.get((id(optimizer), p), p): g for p, g in payload.items() if p in mine}
        if self.skip:  # zeros, which the server skips; its examples weigh as any push's (async refuses none)
            payload = zeros(payload)
        elif not all(np.isfinite(g.values if hasattr(g, "rows") else g).all() for g in payload.values()):
            payload = None
        if self.deferred is not None:  # an apply after the one held (an eager step's first): it goes first
            deferred, self.deferred = self.deferred, None
            self._push(*deferred, now=now)
        if a.window.last() and self.applies < (len(self.plan) if graph else self.learned) and self.phase is None:
            self.immediate += 1
            _, reply, scale = self._push(payload, optimizer, self.skip, now, graph=True)
            conn.pull(load=False)
            self.base = {v.path: conn.pulled[v.path] for v in non_trainable(model)}
            return [True] + [conn.pulled[v.path] for v in trainable(model) + non_trainable(model)] + scale
        self._keep(payload, optimizer)
        # not loaded (the cond's other branch takes nothing): a scalar of each dtype, not a copy of the model
        return [False] + [np.zeros((), np.dtype(v.dtype)) for v in held]

    def _keep(self, payload, optimizer=None) -> None:
        """A payload not pushed at once: a batch of a ``gradient_accumulation_steps`` window before
        its last, into the window (``Window.add``), nothing pushed; else the step's last apply,
        pushed when the step has returned (``step``), the last batch of a window pushing the
        window's mean (``Window.mean``; an empty part: zeros, which adds nothing to it)."""
        a = self.attached
        if not a.window.last() or (self.skip and a.window.steps > 1):  # a loss scale's skip: not in the window
            if not self.skip:
                a.window.add(payload, self.examples, self.batch_examples, trainable(a.model))
            a.window.skipped += self.skip
            self.held = True
            return
        if a.window.steps > 1 and payload is None and not self.examples:
            payload = zeros(a.strategy.connection.pulled)
        self.deferred = [a.window.mean(payload, trainable(a.model)), optimizer, self.skip]

    def _push(self, payload, optimizer, skip: bool, now: dict | None = None, metrics=None, loss: float = 0.0,
              graph: bool = False) -> tuple:
        """Push ``payload`` of this step (None: weight 0) of ``optimizer``'s apply (None: a tiny last
        batch's zeros), its non-trainable changes measured to ``now``, with the chief's new learning
        rate of the one optimizer the server steps it with (several optimizers: that apply's own).
        Under a loss scale it carries ``SKIP_UPDATE`` (``skip``: 1, else 0), whatever else it carries:
        every push of a sync round alike, whose sum decides the round; then the scale steps
        (``_rescale``, ``graph`` as there). Returns (row, reply, the scale's values)."""
        from worker.connection import Work

        a = self.attached
        strategy, conn = a.strategy, a.strategy.connection
        if _scaled(optimizer):
            metrics = {**(metrics or {}), SKIP_UPDATE: np.array([1.0 if skip else 0.0])}
        if payload is None and self.examples:
            a._not_finite()
        elif payload is not None:
            payload.update(changes(a.model, self.base, now))
            if now is not None:
                self.base = dict(now)
        weight = a.window.weight(self.examples, self.batch_examples, conn.sync, strategy.num_replicas_in_sync)
        rates = a._new_learning_rates([p for p, _ in self.owned.get(id(optimizer), self.parts)])  # the ones it steps
        row, reply = strategy.engine.push(Work(conn.step, weight), loss, payload, metrics=metrics,
                                          set_learning_rates=rates)
        a.learning_rates.append(float(reply.learning_rate))
        return row, reply, self._rescale(optimizer, skip, reply, graph)

    def _sites(self) -> list:
        """The optimizer of each ``apply`` of the step, in order (as traced, or as the last eager step ran)."""
        return [o for o, _ in self.plan] or [o for o, _ in self.served]

    def _rescale(self, optimizer, skip: bool, reply=None, graph: bool = False) -> list:
        """``optimizer``'s loss scale stepped after one of its applies as ``LossScaleOptimizer`` steps it:
        a skip halves it (a push's counted in ``skipped``), else every ``dynamic_growth_steps``-th doubles
        it. The skip is the round's summed ``SKIP_UPDATE`` where the ``reply`` carries it (sync), else
        ``skip``, this worker's own (async and ssp; a batch held in a window: no ``reply``). Returns
        [scale, counter] ([] without a loss scale), assigned here unless ``graph`` (then in the step's
        graph after the py_function, so that what the step reads of them is ordered after the ``apply``)."""
        if not _scaled(optimizer):
            return []
        if reply is not None:
            skip = asks_skip(reply.metrics) if SKIP_UPDATE in (reply.metrics or {}) else skip
            self.skipped[id(optimizer)] = self.skipped.get(id(optimizer), 0) + skip
        scale, counter = optimizer.dynamic_scale.numpy(), int(optimizer.step_counter.numpy())
        scale, counter = (scale / 2, 0) if skip else _grown(scale, counter, 1, optimizer.dynamic_growth_steps)
        values = [np.asarray(scale), np.asarray(counter, np.dtype(optimizer.step_counter.dtype))]
        for v, value in zip([] if graph else _scale_variables(optimizer), values):
            v.assign(value)
        return values


class Window:
    """``gradient_accumulation_steps`` (``steps``), as Keras' optimizer accumulates: the
    window's last batch pushes ``(g + accumulated) / steps``, sparse gradients made dense, as
    Keras' accumulators are; the others push nothing. A batch not finite: a push of weight 0.

    Sync with global batches: a round's update must be the mean over the window of each
    global batch's gradient, whose parts weigh by their examples (a last batch of 29 is
    15 + 14). So each part's gradient is scaled by its ``share``, ``part * workers /
    batch`` (exactly 1 where the parts are equal), and every worker's push weighs the same
    (``weight``): the server's mean over the round's pushes is then that mean."""

    def __init__(self, steps: int):
        self.steps, self.share = steps, 1.0  # share: the last batch's
        self.clear()

    def weight(self, examples: int, batch_examples: int, even: bool, workers: int) -> int:
        """The window's push's batch size: this worker's examples (``examples`` the last batch's),
        or in sync, where the pushes weigh alike (``even``), the window's batches' examples
        over the workers, rounded up."""
        if self.steps == 1:
            return examples
        return -(-(self.batch_examples + batch_examples) // workers) if even else self.examples + examples

    def last(self) -> bool:
        """Whether the batch now begun ends the window."""
        return self.batches + 1 >= self.steps

    def add(self, payload: dict | None, examples: int, batch_examples: int, trainable: list) -> None:
        """One batch's gradients (``payload`` as ``worker.gradients`` gives it, of this worker's
        ``examples`` of the batch's ``batch_examples``; weighed by ``share``) into the sums."""
        self.batches += 1
        self.examples += examples
        self.batch_examples += batch_examples
        if payload is None:
            self.finite = False
            return
        for v in (v for v in trainable if v.path in payload):  # none: an empty part of a tiny last batch
            dense = self._shared(payload[v.path], v)
            self.sums[v.path] = self.sums[v.path] + dense if v.path in self.sums else np.zeros_like(dense) + dense

    def mean(self, payload: dict | None, trainable: list) -> dict | None:
        """The window's last payload with each trainable gradient ``(g + accumulated) / steps``."""
        if self.steps == 1 or payload is None:
            return payload
        if not self.finite:
            return None
        out = dict(payload)
        for v in (v for v in trainable if v.path in self.sums):
            g = self._shared(payload[v.path], v)
            out[v.path] = np.divide(g + self.sums[v.path], np.asarray(self.steps, g.dtype))
        return out

    def clear(self) -> None:
        self.sums, self.batches, self.examples, self.batch_examples, self.finite = {}, 0, 0, 0, True
        self.skipped = 0  # batches a loss scale skipped (not in the window)

    def _shared(self, g, variable) -> np.ndarray:
        """A batch's pushed gradient of ``variable``, dense (sparse rows added into zeros, in
        order), times the batch's ``share``."""
        if isinstance(g, SparseRows):
            dense = np.zeros(tuple(variable.shape), g.values.dtype)
            np.add.at(dense, np.asarray(g.rows, np.intp), g.values)
            g = dense
        g = np.asarray(g)
        return g if self.share == 1.0 else np.multiply(g, np.asarray(self.share, g.dtype))


def _logged_loss(logs) -> float:
    """The step's logged ``loss`` as a float; 0.0 where it logs none, or not one number."""
    loss = logs.get("loss") if isinstance(logs, dict) else None
    return float(np.asarray(loss)) if loss is not None and np.asarray(loss).size == 1 else 0.0


def _relaxed(structure):
    """TensorSpecs of ``structure``'s arrays, tensors or specs, the batch dimension unknown."""
    import tensorflow as tf
    from keras.src import tree

    return tree.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), a.dtype), structure)


class BatchDigests:
    """A digest of each global batch this worker read (docs/keras.md). Sync: each push's metrics
    carry its batch's as ``KEY``: 1 and four 16-bit chunks of the digest and their squares, as
    float64 (exact: the server sums the round's in worker order). Every worker reads the round's
    sums in its reply: ``n`` pushes, ``S`` the sum of a chunk and ``Q`` of its square; the
    chunks were all equal exactly when ``n * Q == S * S`` (Cauchy-Schwarz), so every worker
    stops at the same round. Async and ssp: each epoch's digest, against the chief's (``_agreement``)."""

    KEY = "tfps/global_batch_digest"
    SAMPLED = 4096  # elements of a large tensor hashed, evenly spaced

    def __init__(self):
        self.new_epoch()
        self.last = np.array([1.0] + [0.0] * 8)  # with batches="per_worker": the push's count alone

    def add(self, batch) -> None:
        """Digest one global batch (before this worker takes its part)."""
        sampled = b"".join(_sampled_bytes(t, self.SAMPLED) for t in _flat(batch))
        raw = hashlib.blake2b(sampled, digest_size=8).digest()
        self.epoch.update(raw)
        chunks = [float(int.from_bytes(raw[2 * i:2 * i + 2], "little")) for i in range(4)]
        self.last = np.array([1.0, *chunks, *(c * c for c in chunks)], np.float64)

    def check_round(self, summed, step: int) -> None:
        """Raise ``DataMismatch`` unless every push of the round read the same batch."""
        got = summed.get(self.KEY)
        if got is None:
            return
        n, sums, squares = int(got[0]), [int(v) for v in got[1:5]], [int(v) for v in got[5:9]]
        if any(n * q != s * s for s, q in zip(sums, squares)):
            raise DataMismatch(f"the {n} workers of step {step} read different global batches")

    def new_epoch(self) -> None:
        self.epoch = hashlib.blake2b(digest_size=8)


class DataMismatch(ValueError):
    """Workers read different global batches (``BatchDigests``): the job stops, saying why and how to fix."""

    def __init__(self, what: str):
        super().__init__(
            f"tfps.keras: {what}: every worker must read the same dataset in the same order, and each takes "
            "its part of every batch. Seed the shuffles (dataset.shuffle(n, seed=...), or "
            "keras.utils.set_random_seed(s) with the same s on every worker before the data are built), or "
            "give Strategy(batches=\"per_worker\") a dataset of this worker's own batches")


def _sampled_bytes(t, count: int) -> bytes:
    """The dtype, shape and (at most ``count`` evenly spaced) elements of tensor ``t`` as bytes."""
    import tensorflow as tf

    if isinstance(t, (tf.RaggedTensor, tf.SparseTensor)):
        t = t.values
    shape = tuple(int(d) for d in t.shape)
    flat = tf.reshape(t, [-1]) if tf.is_tensor(t) else np.reshape(np.asarray(t), -1)
    stride = max(1, int(flat.shape[0]) // count)
    a = np.asarray(flat[::stride] if stride > 1 else flat)
    head = f"{a.dtype}{shape}".encode()
    if a.dtype == object:  # strings
        return head + b"\0".join(bytes(v) if isinstance(v, (bytes, bytearray)) else str(v).encode() for v in a)
    return head + np.ascontiguousarray(a).tobytes()


def _aggregation(v) -> str:
    return getattr(v, "aggregation", None) or "none"


def _metric_share(v, before: np.ndarray, chief: bool) -> np.ndarray:
    """What a sync push carries of metric variable ``v``, as its ``aggregation`` declares
    (Keras' metrics: "sum"): "sum", the change this step made to it; "mean", its value;
    "only_first_replica", the chief's value (the others' zeros). "none" is not pushed: each
    worker keeps its own (``_Attached._metric_changes`` says so once)."""
    now, kind = np.asarray(v.numpy()), _aggregation(v)
    if kind == "sum":
        return now - before
    return now if kind == "mean" or chief else np.zeros_like(now)


def _metric_combined(v, before: np.ndarray, summed: np.ndarray, pushes: int) -> np.ndarray:
    """``v``'s state after a sync round from the round's sum of ``_metric_share``s over ``pushes`` pushes."""
    kind = _aggregation(v)
    if kind == "sum":
        return before + summed
    return summed / np.asarray(pushes, summed.dtype) if kind == "mean" else summed


def _weigh_output_losses(model, before: dict, share: float) -> None:
    """Keras counts each output's loss tracker once a step (``_Wrap._run``), and a worker's step
    is its part of the global batch, so its change to those trackers is scaled by its ``share``
    of the examples: the round's sum is then one step of the global batch's mean, as in one
    process, however the batch divides."""
    compile_loss = getattr(model, "_compile_loss", None)
    for v in [v for m in (compile_loss.metrics if compile_loss is not None else ()) for v in m.variables]:
        start = before.get(v.path, np.zeros(v.shape, v.dtype))
        v.assign(start + (np.asarray(v.numpy()) - start) * np.asarray(share, v.dtype))


def _metric_variables(model) -> list:
    """The floating state of every metric (``loss`` included): totals and counts."""
    return [v for v in model.metrics_variables if np.dtype(v.dtype).kind == "f"]


def _rate(optimizer) -> float | None:
    """``optimizer``'s learning rate; None where it is a schedule (which the server runs)."""
    import keras

    if isinstance(getattr(optimizer, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
        return None
    return float(np.asarray(optimizer.learning_rate))


def _agreement(strategy: Strategy, fit: int, attached: "_Attached"):
    """The last callback: every worker takes the chief's decisions (module docstring)."""
    import keras

    class Agreement(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            # Keys name the fit and, in sync mode, the server's round it starts at (the same on every worker,
            # as no round completes before all have pushed): a job restarted on a running server does not read
            # the decisions of the one before. Elastic: a worker may join at any round, so the fit alone; a
            # later fit's rounds go on from the round the chief began it at (``self.base``), which joiners read.
            conn, dealt = strategy.connection, attached.dealt
            self.tag = f"fit{fit}@" + ("dealt" if dealt is not None else str(conn.step if conn.sync else 0))
            attached.tag = self.tag
            model = self.model
            initial = int(getattr(model, "_initial_epoch", None) or 0)
            # a later fit's first round: sync, the chief's; async and ssp, its first epoch's in the job (``_go_on``)
            base = 0 if fit == 1 else conn.step // (dealt.applies if dealt else 1) if conn.sync or dealt is None \
                else (attached.first_epoch - initial) * dealt.steps_per_epoch
            if fit > 1 and dealt is not None and not conn.sync and strategy.is_chief:
                strategy.engine.join()  # Initialize: the server's tasks go on to this fit's epochs
            chief = {"initial_epoch": initial, "data": None if dealt is None else dealt.fingerprint(), "base": base}
            got = strategy.agree(f"{self.tag}/begin", chief)
            if not strategy.is_chief and got["initial_epoch"]:
                model._initial_epoch = got["initial_epoch"]
            if dealt is not None:
                from worker import elastic

                # elastic: on the chief's data (the server deals indices into them), from the epoch of the
                # cluster's round (sync: one that joins late skips the rounds it is past) or of its first task
                self.base = got["base"]
                start = (max(0, conn.step // dealt.applies - self.base) if conn.sync
                         else elastic.task_epoch(strategy.engine) * dealt.steps_per_epoch - self.base)
                start //= dealt.steps_per_epoch
                if got["data"] != chief["data"]:
                    raise ValueError(f"elastic=True: this worker's training data (digest {chief['data']}) differ "
                                     f"from the chief's ({got['data']}); the server deals example indices, so every "
                                     "worker must give model.fit the same examples in the same order (seed any "
                                     "shuffle)")
                model._initial_epoch = max(int(getattr(model, "_initial_epoch", None) or 0), start)
            conn.pull()  # the server's state, whatever a callback restored locally

        def on_epoch_begin(self, epoch, logs=None):
            attached.read.new_epoch()
            attached.metrics_before = {}  # Keras reset the metrics: a window under way goes on from zeros
            if attached.dealt is not None:  # elastic: the epoch's rounds, at the chief's rate for it
                attached.next_round = self.base + epoch * attached.dealt.steps_per_epoch
                got = strategy.agree(f"{self.tag}/epoch{epoch}/begin", {"lr": [_rate(o) for o in attached.optimizers]})
                for optimizer, lr in zip(attached.optimizers, got["lr"]):
                    if lr is not None:
                        optimizer.learning_rate = lr
                attached.epoch_rates = tuple(_rate(o) or 0.0 for o in attached.optimizers)

        def on_epoch_end(self, epoch, logs=None):
            # Async and ssp: what each worker read this epoch, against the chief's (sync checks each round).
            read = attached.read.epoch.hexdigest() if not strategy.connection.sync and strategy.batches == "global" \
                and attached.dealt is None else None
            got = strategy.agree(f"{self.tag}/epoch{epoch}", {"stop": bool(self.model.stop_training), "read": read,
                                                              "lr": [_rate(o) for o in attached.optimizers]})
            if got.get("read") != read:
                raise DataMismatch(f"worker {strategy.worker_index} read other global batches in epoch {epoch} "
                                   "than the chief")
            self.model.stop_training = got["stop"]
            for optimizer, lr in zip(attached.optimizers, got["lr"]):
                if lr is not None and not strategy.is_chief:
                    optimizer.learning_rate = lr

    return Agreement()


def _dealt(given: dict, config, server_mode, per_update: int = 1) -> tuple:
    """Elastic: ``fit``'s data as the server deals it (``worker.task.DealtArrays``: NumPy arrays,
    or a finite ``tf.data.Dataset`` read once), and the arguments Keras' loop gets: the same
    examples in unshuffled batches of the global batch size (async and ssp: of a task's size,
    ``batch_size / num_workers`` as for ``ps-worker --elastic``), whose count makes each
    epoch's steps (each step trains on what the server deals, not on Keras' batch). Sync with
    ``steps_per_epoch``: each epoch is that many rounds, going on across passes of the data
    as one process's iterator goes on, and Keras' loop counts as many batches (async and ssp:
    that many times ``num_workers`` tasks, as many examples, across passes too). With
    ``gradient_accumulation_steps`` (``per_update``) k, sync: a round is a batch, as in one
    process, the server holding the window (``VariableStore.accumulate_all``); async and ssp: a
    task is k batches' examples, one update, counted one step (``steps_per_epoch``: of k
    batches too, rounded up). The arguments are checked before ``server_mode()`` asks the server."""
    import tensorflow as tf

    from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

    x, y, sample_weight, batch_size = (given.get(k) for k in ("x", "y", "sample_weight", "batch_size"))
    split = given.get("validation_split") if given.get("validation_data") is None else 0.0
    try:  # what worker.task refuses (TaskError), refused as elastic=True's
        if isinstance(x, tf.data.Dataset):
            if y is not None or sample_weight is not None or split:
                raise ValueError("a tf.data.Dataset x carries its own y and sample_weight and takes no "
                                 "validation_split (Keras' rule); give neither")
            # read once, as ``ps-worker --elastic`` reads your dataset function's: every example in order
            x, y, sample_weight, batch_size = read_once(x)
        elif not all(isinstance(a, np.ndarray) for a in _flat((x, y, sample_weight))) or x is None:
            raise ValueError(f"elastic=True deals the examples of NumPy arrays or of a finite tf.data.Dataset; "
                             f"got x of type {type(x).__name__}")
        if split:  # as Keras' fit splits them: the last part validates, the rest is dealt
            (x, y, sample_weight), validation = array_slicing.train_validation_split((x, y, sample_weight), split)
            given = {**given, "validation_split": 0.0, "validation_data": validation}
        if given.get("class_weight"):  # as Keras' data adapters weigh the dealt examples
            if sample_weight is not None or not isinstance(y, np.ndarray):
                raise ValueError("class_weight goes with neither sample_weight nor several outputs (Keras' rule)")
            sample_weight = data_adapter_utils.class_weight_to_sample_weights(y, given["class_weight"])
            given = {**given, "class_weight": None}
        steps = given.get("steps_per_epoch")
        data = DealtArrays(x, y, sample_weight, global_batch_size=int(batch_size or 32),
                           seed=config.seed, epochs=int(given.get("epochs", 1)), steps_per_epoch=steps)
    except TaskError as e:
        raise ValueError(f"elastic=True: {e}") from None
    if server_mode() != "sync":  # the server's tasks, each batch_size / num_workers examples (steps: as many)
        tasks = -(-steps // per_update) * config.num_workers if isinstance(steps, int) else None
        data = DealtArrays(x, y, sample_weight, seed=config.seed, epochs=data.epochs, tasks=True,
                           global_batch_size=max(1, per_update * data.global_batch_size // config.num_workers),
                           steps_per_epoch=tasks)
    if steps:  # Keras counts exactly that many batches an epoch (their examples unused)
        x, y, sample_weight = data.examples(np.arange(data.steps_per_epoch * data.global_batch_size) % data.num_examples)
    return data, {**given, "x": x, "y": y, "sample_weight": sample_weight, "batch_size": data.global_batch_size,
                  "shuffle": False, "steps_per_epoch": None}


def _flat(structure) -> list:
    from keras.src import tree

    return [a for a in tree.flatten(structure) if a is not None]


def _batch_size(x) -> int:
    return int(_flat(x)[0].shape[0])


def _part(structure, index: int, count: int):
    """This worker's contiguous rows of every tensor in ``structure`` (``shard_bounds``)."""
    from keras.src import tree

    lo, hi = shard_bounds(_batch_size(structure[0]), index, count)
    return tree.map_structure(lambda t: None if t is None else t[lo:hi], structure)


__all__ = ["Strategy"]
