"""Virtual time: N simulated workers against the real server core, in one process.

    sim = Simulation(SimConfig(mode="async", workers=64, profile="straggler", model="tiny"))
    run = sim.run()          # {"evals": [...], "time_to_target": 1.8, "staleness": {...}, ...}

Two cores cannot run 64 real workers, and the effects that decide between sync and async
grow with N: an async gradient's staleness, a sync round's wait for the slowest of N, the
server's one link shared by all. This module drives the real core
(``ps_server.core.ParameterServer``: the same sync, async, ssp and backup-worker code the
gRPC server runs, through its non-blocking ``submit``) with real TensorFlow gradients
(``worker.gradients.Gradients``, the workers' own path, on the built-in models and data),
but takes time from a model instead of the clock:

- **compute**: each worker's time for a step's gradient is ``compute_s`` (measured here,
  the median of timed gradient calls of this model and batch) times the profile's factor
  for that worker and step (``PROFILES``): ``balanced`` (every worker jitters by a
  lognormal of sigma 0.05), ``straggler`` (the last worker 3x slower), ``tail`` (every
  step's factor lognormal with sigma 0.5: a long tail), ``pause`` (the last worker stops
  ``pause_steps`` steps' worth of time once, at its step 10); plus ``step_overhead_s``, a
  worker's own time per step besides pull, compute and push (0 unless measured: the
  validation measures it from real histories);
- **links**: every message pays the one-way ``latency_s``, and its bytes cross the
  worker's own link (``worker_mbps``) and the server's (``server_mbps``), which all
  workers share in each direction (pushes in, pulls out; full duplex), split max-min fair
  among the transfers in flight in proportion to ``window_bytes`` plus the bytes each has
  sent (``SharedLink``: what TCP flows through one bottleneck approach, the flow under way
  with its window open). The bytes are the real messages': the protobuf tensors of a whole-model
  pull and of a push of this model's gradients (``protos.codec``). ``shards`` servers
  each carry an equal part of every message over a link of their own;
- **cores** (``cores`` > 0): every worker's compute and the server's work share that many
  cores, processor-shared, one core at most each: N processes on one machine, as the
  validation's real runs are; 0 (the default) gives each a machine of its own;
- **the server**: one queue, first come first served (one interpreter's CPU); each push
  occupies it for the times measured here: parsing and decoding its message, then the
  apply (async and ssp: one optimizer step; sync: folding the push, plus the round's
  optimizer step for the push that fills it); each pull for encoding the model into its
  reply. The values a pull returns are read when the server takes it up.

A worker's step is what a real one does: pull (request, then the whole model back), compute
the gradient of its part of global batch ``step`` (``worker.data.shard``, as every tfps
worker) on the values it pulled, push, and wait for the reply (a sync round, the ssp
bound), then pull again; in sync without backup workers, for a model of at most
``worker.client.SMALL_BYTES``, the reply carries the round's values (encoded for each
reply) and the next step starts from them without a pull, as the real client's sync
shortcut does. Events run in virtual-time order, ties broken by the order they were
scheduled in, and every random draw comes from the seed: a run is a deterministic
function of its configuration, so each mode's staleness is the one the modelled cluster
would give. The server's parameters are evaluated on the test set each time the examples
applied cross a multiple of one sync round's (``workers * batch``; at least 1/400 of the
job's), at that virtual time.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import time
from typing import Callable

import numpy as np

PROFILES = ("balanced", "straggler", "tail", "pause")
MODES = ("sync", "async", "ssp1", "ssp4", "backup")


class VirtualError(ValueError):
    """A configuration the simulation cannot run; the message says why."""


@dataclasses.dataclass(frozen=True)
class SimConfig:
    mode: str = "sync"  # one of MODES (sspS: any bound S; backup: sync taking the first N-1 pushes, backupK N-K)
    workers: int = 4
    profile: str = "balanced"
    model: str = "tiny"
    dataset: str = "digits"
    train_examples: int = 0  # 0: the whole training set
    batch: int = 16  # each worker's examples per step: a sync round is workers * batch
    epochs: float = 3.0  # the job: this many passes over the training set, in examples applied
    optimizer: str = "sgd"
    learning_rate: float = 0.0  # 0: the optimizer's Keras default
    seed: int = 0
    latency_s: float = 0.0005  # one way, every message
    worker_mbps: float = 10_000.0  # each worker's link; 0: unlimited
    server_mbps: float = 10_000.0  # the server's link, shared by all workers (each shard's); 0: unlimited
    shards: int = 1
    slowdown: float = 3.0  # the straggler's factor
    # profile "measured" (``ps-advise --predict``): each worker's mean compute factor and its
    # step-to-step lognormal sigma, measured on a real cluster and repeated in order up to
    # ``workers`` (a straggler among 3 measured stays one worker in 3)
    factors: tuple = ()
    sigmas: tuple = ()
    pause_steps: float = 50.0  # the pause: this many mean step computes
    target_accuracy: float = 0.85
    # The job's examples rounded down to whole sync rounds (N x batch): no mode's last update
    # is a short batch at the full learning rate. False: as a real job (ps-launch) runs.
    whole_rounds: bool = False
    compute_s: float = 0.0  # 0: measured here (``measure``)
    step_overhead_s: float = 0.0  # a worker's own seconds per step besides pull, compute and push
    # > 0: every worker's compute and the server's work share this many cores (processor
    # sharing, one core at most each), as N processes on one machine do; 0: a machine each.
    cores: float = 0.0
    # Seconds a worker's first step of a second batch size costs beyond the step (its
    # tf.function traces again, then for every size: the short last batch of an epoch);
    # 0: not charged (``Workload.measure_retrace`` measures it on a fresh model).
    retrace_s: float = 0.0
    # A transfer's share of a shared link is in proportion to this plus the bytes it has
    # sent (TCP: a flow under way has its window open, one just started does not), so
    # transfers started apart drift apart, as on real links; 0: equal shares.
    window_bytes: float = 65536.0
    # The job ends when every worker has done the real job's steps (ps-launch's: epochs x
    # steps of an epoch of N x batch), as a real run ends; a backup worker's dropped push is
    # a step too, so backup applies fewer examples. False: when ``epochs`` of examples are
    # applied, in every mode (the study's rule).
    job_in_steps: bool = False
    # > 0: evaluate as a real chief with ``--eval-every K`` does: the values it pulled for its
    # steps K-1, 2K-1, ... (in sync, versions K-1, 2K-1, ...; in the other modes, as many
    # examples applied); 0: every round (at most 400 times a run). With SGD at 0.1 on the
    # CNN, the accuracy passed 0.85 for one round at 28 s where the chief, every second
    # step, first saw it at 51 s: on its grid the twin sees what the chief does.
    eval_every_rounds: int = 0
    apply_s: float = -1.0  # server seconds per async apply; < 0: measured
    fold_s: float = -1.0  # server seconds to fold one sync push; < 0: measured
    round_apply_s: float = -1.0  # server seconds of a sync round's optimizer step; < 0: measured

    def check(self) -> None:
        mode_options(self.mode, self.workers)
        if self.profile == "measured":
            if not self.factors or any(not (math.isfinite(f) and f > 0) for f in self.factors):
                raise VirtualError(f"profile 'measured' needs factors > 0, one per measured worker, got "
                                   f"{self.factors!r}")
            if self.sigmas and (len(self.sigmas) != len(self.factors)
                                or any(not (math.isfinite(s) and s >= 0) for s in self.sigmas)):
                raise VirtualError(f"sigmas must be >= 0, one per factor, got {self.sigmas!r}")
        elif self.profile not in PROFILES:
            raise VirtualError(f"profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if self.workers < 1:
            raise VirtualError(f"workers must be >= 1, got {self.workers}")
        if self.batch < 1:
            raise VirtualError(f"batch must be >= 1, got {self.batch}")
        if not self.epochs > 0:
            raise VirtualError(f"epochs must be > 0, got {self.epochs}")
        if self.shards < 1:
            raise VirtualError(f"shards must be >= 1, got {self.shards}")
        for name in ("latency_s", "worker_mbps", "server_mbps", "compute_s", "pause_steps", "step_overhead_s",
                     "cores"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise VirtualError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.slowdown >= 1:
            raise VirtualError(f"slowdown must be >= 1, got {self.slowdown!r}")


def mode_options(mode: str, workers: int) -> dict:
    """The ParameterServer arguments of a compared mode (``ps-compare``'s names)."""
    if mode == "sync":
        return {"mode": "sync"}
    if mode == "async":
        return {"mode": "async"}
    if mode.startswith("ssp") and mode[3:].isdigit():
        return {"mode": "ssp", "staleness": int(mode[3:])}
    if mode == "backup" or (mode.startswith("backup") and mode[6:].isdigit() and int(mode[6:]) > 0):
        spare = int(mode[6:] or 1)  # backupK: each round takes the first N - K pushes
        if workers <= spare:
            raise VirtualError(f"{mode} needs at least {spare + 1} workers (backup workers need at least 2)")
        return {"mode": "sync", "replicas_to_aggregate": workers - spare}
    raise VirtualError(f"unknown mode {mode!r}: use sync, async, sspS (S an integer), backup or backupK "
                       "(K backup workers)")


def fits(mode: str, n: int) -> bool:
    """Whether ``mode`` can run with ``n`` workers (backup needs more than its K)."""
    try:
        mode_options(mode, n)
    except VirtualError:
        return False
    return True


# -- the event queue and the links --------------------------------------------------------
class Events:
    """Callbacks in virtual-time order; equal times in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        if when < self.now:
            raise AssertionError(f"an event scheduled in the past: {when} < {self.now}")
        heapq.heappush(self._heap, (when, self._seq, fn))
        self._seq += 1

    def run(self, until: Callable[[], bool]) -> None:
        while self._heap and not until():
            when, _, fn = heapq.heappop(self._heap)
            self.now = when
            fn()

    def pending(self) -> int:
        return len(self._heap)


def fair_rates(capacity: float, caps: list[float], weights: list[float] | None = None) -> list[float]:
    """Max-min fair rates of flows with their own ``caps`` through one link of ``capacity``
    (``math.inf``: unlimited): the slowest-capped flows take their cap, the rest share
    (in proportion to ``weights``, if given)."""
    weights = weights or [1.0] * len(caps)
    order = sorted(range(len(caps)), key=lambda i: caps[i] / weights[i])
    rates = [0.0] * len(caps)
    left, total = capacity, sum(weights)
    for i in order:
        share = left * weights[i] / total if total > 0 else left
        rates[i] = min(caps[i], share)
        left -= rates[i]
        total -= weights[i]
    return rates


class SharedLink:
    """One direction of a link that all transfers share (processor sharing, each transfer
    also capped by its own worker's link): ``send(bytes, cap, done)`` calls ``done()``
    when the last byte is across. ``window`` > 0: shares in proportion to ``window`` plus
    each transfer's bytes sent so far (recomputed each time a transfer at its share has
    sent another window): TCP flows through one bottleneck, where the flow under way
    has its congestion window open and a new one starts small. Transfers that start
    together share equally throughout; one that started earlier stays ahead, so two
    async workers fall into turns (one pulls while the other pushes), as measured on
    emulated hosts, instead of the lockstep equal shares would keep forever."""

    def __init__(self, events: Events, bytes_per_s: float, window: float = 0.0):
        self.events, self.capacity, self.window = events, bytes_per_s, window
        self._flows: dict[int, list] = {}  # id -> [bytes left, cap, done, rate]
        self._next_id = 0
        self._last = 0.0
        self._generation = 0
        self.busy_s = 0.0  # virtual seconds with at least one transfer in flight

    def send(self, nbytes: float, cap: float, done: Callable[[], None]) -> None:
        if nbytes <= 0 or (math.isinf(cap) and math.isinf(self.capacity)):
            self.events.at(self.events.now, done)
            return
        self._advance()
        self._flows[self._next_id] = [float(nbytes), cap, done, 0.0, 0.0]  # + bytes sent
        self._next_id += 1
        self._reschedule()

    def _advance(self) -> None:
        dt = self.events.now - self._last
        if dt > 0 and self._flows:
            self.busy_s += dt
            for flow in self._flows.values():
                flow[0] -= flow[3] * dt
                flow[4] += flow[3] * dt
        self._last = self.events.now

    def _reschedule(self) -> None:
        ids = list(self._flows)
        if self.window > 0:
            rates = fair_rates(self.capacity, [self._flows[i][1] for i in ids],
                               [self.window + self._flows[i][4] for i in ids])
        else:
            rates = fair_rates(self.capacity, [self._flows[i][1] for i in ids])
        for i, rate in zip(ids, rates):
            self._flows[i][3] = rate
        self._generation += 1
        if not ids:
            return
        generation = self._generation
        first = min(self._flows[i][0] / self._flows[i][3] for i in ids if self._flows[i][3] > 0)
        if self.window > 0 and len(ids) > 1 and math.isfinite(self.capacity):
            # the shares follow the bytes sent: again once a flow at its share sent a window
            first = min(first, self.window * len(ids) / self.capacity)
        self.events.at(self.events.now + max(first, 0.0), lambda: self._wake(generation))

    def _wake(self, generation: int) -> None:
        if generation != self._generation:
            return  # the flows changed since: a later wake-up stands
        self._advance()
        # Done: less than a nanosecond's worth left (float residue), or nothing at all.
        finished = [i for i, f in self._flows.items() if f[3] > 0 and f[0] <= max(f[3] * 1e-9, 1e-6)]
        callbacks = [self._flows.pop(i)[2] for i in finished]
        self._reschedule()
        for fn in callbacks:
            fn()


def _rate(mbps: float) -> float:
    return math.inf if mbps <= 0 else mbps * 1e6 / 8


# -- the workload: model, data, measured costs ----------------------------------------------
class Workload:
    """The model, its data and what is measured of them here: one per (model, dataset,
    train examples, batch, workers, seed), shared by every mode of a comparison."""

    def __init__(self, cfg: SimConfig):
        from worker.config import WorkerConfig
        from worker.gradients import Gradients, get_values
        from worker.model import tf_setup
        from worker.task import BuiltinTask

        tf_setup(deterministic=True)
        self.cfg = cfg
        self.worker_config = WorkerConfig(model=cfg.model, dataset=cfg.dataset, train_examples=cfg.train_examples,
                                          global_batch_size=cfg.workers * cfg.batch,
                                          epochs=max(1, math.ceil(cfg.epochs)) + 1, seed=cfg.seed,
                                          optimizer=cfg.optimizer, learning_rate=cfg.learning_rate,
                                          num_workers=cfg.workers)
        self.task = BuiltinTask(self.worker_config)
        # Names as a worker process's, which builds its model once: Keras numbers layers per
        # process (dense, then dense_1 ...), and the names' bytes are on the wire.
        import keras

        keras.backend.clear_session()
        self.model = self.task.build_model()
        self.gradients = Gradients(self.model, self.task.loss)
        self.initial = get_values(self.model)
        self.params = sum(int(a.size) for a in self.initial.values())
        self.pull_bytes, self.push_bytes = message_bytes(self.initial)
        self.budget = int(round(cfg.epochs * self.task.num_examples))
        if cfg.whole_rounds:
            per_round = cfg.workers * cfg.batch
            self.budget = max(per_round, self.budget // per_round * per_round)

    def batch_of(self, step: int, worker: int) -> tuple[np.ndarray, np.ndarray, int]:
        from worker.data import shard

        steps = self.task.total_steps
        mine = shard(self.task.global_batch(step % steps), worker, self.cfg.workers)
        x, y = self.task.examples(mine)
        return x, y, len(mine)

    def batch_size_of(self, step: int, worker: int) -> int:
        from worker.data import shard

        return len(shard(self.task.global_batch(step % self.task.total_steps), worker, self.cfg.workers))

    def measure_retrace(self) -> float:
        """Seconds a gradient call on a batch of a new size costs beyond a traced one's."""
        x, y, n = self.batch_of(0, 0)
        self.gradient(self.initial, x, y)
        t0 = time.perf_counter()
        self.gradient(self.initial, x, y)
        t1 = time.perf_counter()
        self.gradient(self.initial, x[: max(1, n - 1)], y[: max(1, n - 1)])
        return max(0.0, (time.perf_counter() - t1) - (t1 - t0))

    def gradient(self, values: dict, x, y) -> tuple[float, dict]:
        from worker.gradients import set_values

        set_values(self.model, values)
        return self.gradients(x, y, values)

    def evaluate(self, values: dict) -> dict:
        from worker.gradients import set_values

        set_values(self.model, values)
        return self.task.evaluate(self.model)

    def measure_compute(self, repeats: int = 7) -> float:
        """Median seconds of one worker's gradient (after a warm-up call that traces)."""
        x, y, _ = self.batch_of(0, 0)
        self.gradient(self.initial, x, y)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.gradient(self.initial, x, y)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def measure_server(self, repeats: int = 5) -> tuple[float, float, float]:
        """(async apply, sync fold, sync round's optimizer step) in seconds, medians, timed on
        scratch servers of the real core with this model's gradients."""
        from ps_server.core.modes.base import Push
        from ps_server.core.optim.optimizers import OptimizerSpec
        from ps_server.core.parameter_server import ParameterServer

        x, y, n = self.batch_of(0, 0)
        _, grads = self.gradient(self.initial, x, y)
        spec = OptimizerSpec(**self.worker_config.optimizer_spec())
        applies, folds, rounds = [], [], []
        ps = ParameterServer("async", 1)
        ps.register(0)
        ps.initialize(0, self.initial, spec)
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            ps.submit(Push(0, step, ps.store.version, n, grads)).result()
            applies.append(time.perf_counter() - t0)
        ps = ParameterServer("sync", 2)
        ps.register(0), ps.register(1)
        ps.initialize(0, self.initial, spec)
        for step in range(repeats + 1):
            t0 = time.perf_counter()
            first = ps.submit(Push(0, step, step, n, grads))
            t1 = time.perf_counter()
            ps.submit(Push(1, step, step, n, grads)).result()
            t2 = time.perf_counter()
            first.result()
            folds.append(t1 - t0)
            rounds.append(max(0.0, (t2 - t1) - (t1 - t0)))
        return tuple(float(np.median(v[1:])) for v in (applies, folds, rounds))

    def measure_wire(self, repeats: int = 5) -> tuple[float, float]:
        """(a push's, a pull's) server seconds on the wire's side, medians: parsing a real
        PushRequest of this model's gradients and decoding its tensors; encoding the whole
        model into a PullResponse and serializing it (``protos.codec``)."""
        from protos import codec
        from protos import tfps_pb2 as pb

        x, y, _ = self.batch_of(0, 0)
        _, grads = self.gradient(self.initial, x, y)
        data = pb.PushRequest(gradients=codec.encode_many(grads)).SerializeToString()
        pushes, pulls = [], []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            codec.decode_many(pb.PushRequest.FromString(data).gradients)
            t1 = time.perf_counter()
            pb.PullResponse(variables=codec.encode_many(self.initial)).SerializeToString()
            pulls.append(time.perf_counter() - t1)
            pushes.append(t1 - t0)
        return float(np.median(pushes[1:])), float(np.median(pulls[1:]))


def message_bytes(values: dict) -> tuple[int, int]:
    """(a whole-model pull's bytes, a push's bytes): the protobuf tensors that carry them
    (``protos.codec``); a push carries a gradient shaped like every variable."""
    from protos import codec

    tensors = sum(t.ByteSize() for t in codec.encode_many(values))
    return tensors + 16, tensors + 64  # plus the messages' own fields (versions, step, batch size)


# -- one simulated run -----------------------------------------------------------------------
class Simulation:
    """One mode's run of the modelled cluster (module docstring)."""

    def __init__(self, cfg: SimConfig, workload: Workload | None = None, costs: dict | None = None):
        cfg.check()
        self.cfg = cfg
        self.w = workload or Workload(cfg)
        c = dict(costs or {})
        if cfg.compute_s > 0:
            c["compute_s"] = cfg.compute_s
        if "compute_s" not in c:
            c["compute_s"] = self.w.measure_compute()
        if not {"apply_s", "fold_s", "round_apply_s"} <= set(c):
            c["apply_s"], c["fold_s"], c["round_apply_s"] = self.w.measure_server()
        if not {"decode_s", "encode_s"} <= set(c):
            c["decode_s"], c["encode_s"] = self.w.measure_wire()
        for name in ("apply_s", "fold_s", "round_apply_s"):
            if getattr(cfg, name) >= 0:
                c[name] = getattr(cfg, name)
        self.costs = c

    def _factors(self, worker: int):
        """The profile's compute factor for each of a worker's steps (deterministic per seed)."""
        rng = np.random.default_rng([self.cfg.seed, worker, 7])
        last = worker == self.cfg.workers - 1
        profile = self.cfg.profile
        step = 0
        while True:
            if profile == "measured":
                k = worker % len(self.cfg.factors)
                sigma = self.cfg.sigmas[k] if self.cfg.sigmas else 0.05
                f = self.cfg.factors[k] * float(rng.lognormal(0.0, sigma))
            elif profile == "tail":
                f = float(rng.lognormal(0.0, 0.5))
            else:
                f = float(rng.lognormal(0.0, 0.05))
                if profile == "straggler" and last:
                    f *= self.cfg.slowdown
            extra = self.cfg.pause_steps if (profile == "pause" and last and step == 10) else 0.0
            yield f, extra
            step += 1

    def run(self) -> dict:
        return _Run(self).go()


class _Run:
    """One ``Simulation.run``: the real core driven on virtual time by events, its state
    and the handlers each event calls (a worker's pull, compute and push; the server's
    queue of pulls, pushes and replies)."""

    def __init__(self, sim: Simulation):
        from ps_server.core.optim.optimizers import OptimizerSpec
        from ps_server.core.parameter_server import ParameterServer
        from worker.client import SMALL_BYTES

        self.sim = sim
        cfg, w = self.cfg, self.w = sim.cfg, sim.w
        self.costs = sim.costs
        self.ev = Events()
        n = self.n = cfg.workers
        ps = self.ps = ParameterServer(num_workers=n, barrier_timeout=1e9, lease_timeout=1e9,
                                       clock=lambda: self.ev.now, **mode_options(cfg.mode, n))
        for i in range(n):
            ps.register(i, n)
        ps.initialize(0, w.initial, OptimizerSpec(**w.worker_config.optimizer_spec()))
        self.syncish = ps.mode.rounds
        # The sync shortcut (worker.transports.PullCache.receive): without backup workers, a push
        # of a model that fits one message asks for the round's values with its reply, and
        # the next step starts from them without a pull.
        self.shortcut = (self.syncish and mode_options(cfg.mode, n).get("replicas_to_aggregate", n) == n
                         and w.pull_bytes <= SMALL_BYTES)
        # Each shard's link carries 1/shards of every message; the shards' links in parallel
        # are one link of shards x the rate for equal parts.
        self.server_in = SharedLink(self.ev, _rate(cfg.server_mbps) * cfg.shards, window=cfg.window_bytes)
        self.server_out = SharedLink(self.ev, _rate(cfg.server_mbps) * cfg.shards, window=cfg.window_bytes)
        self.worker_cap = _rate(cfg.worker_mbps)
        self.cpu = SharedLink(self.ev, cfg.cores) if cfg.cores > 0 else None
        self.latency = cfg.latency_s
        self.factors = [sim._factors(i) for i in range(n)]
        self.traced: list[set] = [set() for _ in range(n)]  # batch sizes each worker has traced for
        self.queue: collections.deque = collections.deque()
        self.server = {"busy": False, "busy_s": 0.0}
        self.replies: list = []  # (worker, ticket) settled during the submit being processed
        self.evals: list[dict] = []
        # One sync round's examples apart, but at most about 400 evaluations in a run.
        self.round_examples = max(n * cfg.batch, math.ceil(w.budget / 400))
        self.first_eval = self.round_examples
        if cfg.eval_every_rounds > 0:  # the real chief's grid: versions K-1, 2K-1, ... (its pulls)
            self.round_examples = cfg.eval_every_rounds * n * cfg.batch
            self.first_eval = (cfg.eval_every_rounds - 1) * n * cfg.batch or self.round_examples
        self.state = {"next_eval": 0, "done": False, "active": n}
        self.step_of = [0] * n
        self.computes = [0.0] * n
        self.waits = [0.0] * n
        self.pushed_at = [0.0] * n
        self.job_steps = round(cfg.epochs * math.ceil(w.task.num_examples / (n * cfg.batch)))

    def busy(self, seconds: float, done: Callable[[], None]) -> None:
        """``seconds`` of one core's work, then ``done``: on a machine of its own, or
        sharing ``cfg.cores`` with every other process's work in flight."""
        if self.cpu is None:
            self.ev.at(self.ev.now + seconds, done)
        else:
            self.cpu.send(seconds, 1.0, done)

    def evaluate(self) -> None:
        version, values = self.ps.pull()
        scores = self.w.evaluate(values)
        self.evals.append({"t": self.ev.now, "version": version, "examples": self.ps.stats.examples_applied,
                           "test_accuracy": scores["test_accuracy"], "test_loss": scores["test_loss"]})

    def maybe_evaluate(self) -> None:
        while self.ps.stats.examples_applied >= self.state["next_eval"]:
            self.evaluate()
            self.state["next_eval"] += self.round_examples
        if self.ps.stats.examples_applied >= self.w.budget and not self.cfg.job_in_steps:
            self.state["done"] = True

    # -- a worker: pull, compute, push ---------------------------------------------------
    def start_step(self, i: int, fresh: tuple | None = None) -> None:
        state = self.state
        if (self.step_of[i] >= self.job_steps if self.cfg.job_in_steps else
                state["done"] or self.ps.stats.examples_applied >= self.w.budget):
            state["active"] -= 1
            state["done"] = state["done"] or state["active"] == 0
            return
        if fresh is not None:  # the push's reply brought the values: no pull (the sync shortcut)
            self.pulled(i, *fresh)
            return
        self.ev.at(self.ev.now + self.latency, lambda: self.pull_arrives(i))  # the pull request

    def pull_arrives(self, i: int) -> None:
        self.queue.append(("pull", i))
        if not self.server["busy"]:
            self.process()

    def pulled(self, i: int, version: int, values: dict) -> None:
        factor, extra = next(self.factors[i])
        seconds = self.costs["compute_s"] * (factor + extra) + self.cfg.step_overhead_s
        size = self.w.batch_size_of(self.step_of[i], i)
        if size not in self.traced[i]:
            if len(self.traced[i]) == 1:  # the second size traces once more, for any size (reduce_retracing)
                seconds += self.cfg.retrace_s
            self.traced[i].add(size)
        self.computes[i] += seconds
        self.busy(seconds, lambda: self.computed(i, version, values))

    def computed(self, i: int, version: int, values: dict) -> None:
        from ps_server.core.modes.base import Push
        from worker.gradients import zeros

        w, step_of = self.w, self.step_of
        x, y, count = w.batch_of(step_of[i], i)
        while not count and not self.syncish:  # async and ssp: an empty share of a short last batch is skipped
            step_of[i] += 1
            x, y, count = w.batch_of(step_of[i], i)
        if count:
            loss, grads = w.gradient(values, x, y)
        else:  # sync: an empty share is pushed with weight 0, as a real worker does
            loss, grads = 0.0, zeros(values)
        push = Push(worker_id=i, step=step_of[i], base_version=version, batch_size=count, gradients=grads,
                    loss=loss)
        self.ev.at(self.ev.now + self.latency,
                   lambda: self.server_in.send(w.push_bytes, self.worker_cap, lambda: self.arrive(push)))

    def arrive(self, push) -> None:
        self.queue.append(("push", push))
        if not self.server["busy"]:
            self.process()

    def replied(self, i: int, ticket, fresh: tuple | None = None) -> None:
        from ps_server.core.errors import NonFinite

        state = self.state
        try:
            result = ticket.result()  # any other refused push is a defect of the simulation: raise
        except NonFinite as e:
            # The training diverged: the server refused the gradient and applied nothing,
            # and a real worker would stop with this error. The run ends here.
            state["diverged"] = state.get("diverged") or f"worker {i} at step {self.step_of[i]}: {e}"
            state["done"] = True
            state["active"] -= 1
            return
        self.waits[i] += self.ev.now - self.pushed_at[i]
        self.step_of[i] = result.next_step if self.syncish else self.step_of[i] + 1
        self.start_step(i, fresh)

    # -- the server: one queue, one item at a time -----------------------------------------
    def process(self) -> None:
        kind, item = self.queue.popleft()
        self.server["busy"] = True
        if kind == "pull":
            self.serve_pull(item)
        elif kind == "reply":
            self.serve_reply(*item)
        else:
            self.serve_push(item)

    def _served(self) -> None:
        self.server["busy"] = False
        if self.queue:
            self.process()

    def serve_pull(self, i: int) -> None:
        self._send_values(i, lambda version, values: self.pulled(i, version, values))

    def serve_reply(self, i: int, ticket) -> None:
        """The sync shortcut: a push's reply carrying the round's values, encoded for it."""
        self._send_values(i, lambda version, values: self.replied(i, ticket, (version, values)))

    def _send_values(self, i: int, then: Callable[[int, dict], None]) -> None:
        """The values encoded for worker ``i`` and sent; ``then(version, values)`` once there."""
        version, values = self.ps.pull(i)
        cost = self.costs.get("encode_s", 0.0)
        self.server["busy_s"] += cost

        def end() -> None:
            self.server_out.send(self.w.pull_bytes, self.worker_cap,
                                 lambda: self.ev.at(self.ev.now + self.latency, lambda: then(version, values)))
            self._served()
        self.busy(cost, end)

    def serve_push(self, push) -> None:
        costs, replies = self.costs, self.replies
        self.pushed_at[push.worker_id] = self.ev.now
        ticket = self.ps.submit(push)
        ticket.add_done_callback(lambda t, i=push.worker_id: replies.append((i, t)))
        if self.syncish:
            cost = costs["fold_s"] + (costs["round_apply_s"] if ticket.done() else 0.0)
        else:
            cost = costs["apply_s"]
        cost += costs.get("decode_s", 0.0)
        self.server["busy_s"] += cost
        settled, replies[:] = list(replies), []

        def end() -> None:
            self.maybe_evaluate()
            for i, t in settled:
                if self.shortcut:
                    self.queue.append(("reply", (i, t)))
                else:
                    self.ev.at(self.ev.now + self.latency, lambda i=i, t=t: self.replied(i, t))
            self._served()
        self.busy(cost, end)

    # -- the run -----------------------------------------------------------------------
    def go(self) -> dict:
        ev, ps, state = self.ev, self.ps, self.state
        wall0 = time.perf_counter()
        self.evaluate()
        state["next_eval"] = self.first_eval
        for i in range(self.n):
            ev.at(0.0, lambda i=i: self.start_step(i))
        ev.run(until=lambda: state["done"] and ev.pending() == 0)
        if not self.evals or self.evals[-1]["examples"] != ps.stats.examples_applied:
            self.evaluate()
        self.sim.final_values = ps.pull()[1]
        self.sim.max_ahead = ps.mode.status().max_ahead
        return self.summary(time.perf_counter() - wall0)

    def summary(self, wall_s: float) -> dict:
        cfg, w, ps, evals, n = self.cfg, self.w, self.ps, self.evals, self.n
        status = ps.status()
        reached = next((e for e in evals if e["test_accuracy"] >= cfg.target_accuracy), None)
        duration = max(e["t"] for e in evals)
        share = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
        return {
            "mode": cfg.mode, "workers": n, "profile": cfg.profile, "seed": cfg.seed, "model": cfg.model,
            "dataset": cfg.dataset, "train_examples": w.task.num_examples, "batch": cfg.batch,
            "virtual_s": duration, "wall_s": wall_s,
            "evals": evals, "final_accuracy": evals[-1]["test_accuracy"], "final_loss": evals[-1]["test_loss"],
            # The mean of the last 10 evaluations: small-batch SGD moves the test accuracy by
            # points from one evaluation to the next; the comparisons read this one.
            "end_accuracy": float(np.mean([e["test_accuracy"] for e in evals[-10:]])),
            "time_to_target": reached["t"] if reached else None,
            "updates_to_target": reached["version"] if reached else None,
            "updates": status.version, "pushes": status.pushes_applied,
            "examples": status.examples_applied,
            "examples_per_s": share(status.examples_applied),
            "staleness": {str(k): v for k, v in sorted(ps.stats.staleness_histogram().items())},
            "mean_staleness": status.mean_staleness, "max_staleness": status.max_staleness_seen,
            "dropped": ps.stats.dropped, "max_ahead": self.sim.max_ahead,
            "diverged": self.state.get("diverged"),  # None, or the refused push that ended the run
            "server_busy": share(self.server["busy_s"]),
            "link_in_busy": share(self.server_in.busy_s),
            "link_out_busy": share(self.server_out.busy_s),
            "compute_share": share(sum(self.computes) / n),
            "costs": dict(self.costs), "params": w.params, "pull_bytes": w.pull_bytes, "push_bytes": w.push_bytes,
        }


__all__ = ["SimConfig", "Simulation", "Workload", "Events", "SharedLink", "fair_rates", "message_bytes",
           "mode_options", "PROFILES", "MODES", "VirtualError"]
