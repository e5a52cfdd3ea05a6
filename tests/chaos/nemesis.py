"""Seeded fault schedules against an elastic job, each checked against the undisturbed run.

    python -m tests.chaos.nemesis --mode async --seed 7                 # the schedule seed 7 draws
    python -m tests.chaos.nemesis --mode sync --seeds 0-49              # fifty of them, one after another
    python -m tests.chaos.nemesis --mode sync --schedule "term:1@4 term:2@8 server@20"   # a given one
    python -m tests.chaos.nemesis --mode async --seed 7 --print          # the schedule alone, nothing run

In the spirit of etcd raft's ``rafttest`` network and Jepsen's nemesis: one ``ps-server`` and
three ``ps-worker --elastic`` processes on loopback (cnn on digits, global batch 64; the server
``--num-workers 4 --lease-timeout 3 --checkpoint-interval 0.5``, in sync also
``--elastic-min-workers 2 --micro-batches 4``), and a schedule of faults, each fired once the
server's progress reaches its point: the round (sync) or the tasks done (async). The faults
(``KINDS``), each written ``KIND[:INDEX]@POINT``:

- ``kill:I`` SIGKILL the process that holds worker index I;
- ``restart:I`` SIGKILL it and start a new process on its own index (``--worker-index I``);
- ``stop:I`` SIGSTOP it until its lease ran out (declared dead), then SIGCONT;
- ``term:I`` SIGTERM it: it leaves the job (never the chief, I >= 1);
- ``add`` start one more worker with ``--worker-index auto``;
- ``server`` SIGKILL the server and start it again on its port and checkpoint directory.

A worker process is started warm: it imports TensorFlow first and waits (``warm``) until the
run hands it its flags, so that a worker added or restarted by a fault registers within a
second, not after the seconds TensorFlow takes to load, which on a busy machine outlasted a
short job. A spare is kept warm for the next fault that starts one.

A seed draws 4 to 8 faults at points spread over the job (``draw``), following the indexes a
live job would have, so that each names a process that exists when it fires (one that does
not, say after an earlier fault went otherwise, is skipped and reported). The check
(``Outcome.problems``): every process ends (a hang is a failure, with the server's status),
each as its fault says (or with the one line "superseded", if another process took its
index since: the newer process holds an index); the server applied every example exactly once per epoch; sync ends
with the undisturbed run's weights, bit for bit (read from the server), async with one
applied push per task. ``tests/chaos/test_nemesis.py`` runs a few seeds and the fixed cases
in the default run and many more marked ``slow``; RELIABILITY.md has the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ps_common.ports import free_port
from ps_common.procs import dying_with_parent
from worker.client import PSClient, PSClientError

ROOT = Path(__file__).resolve().parents[2]  # the checkout: a warm worker imports this module
EXAMPLES = 1437  # digits' training examples
GLOBAL_BATCH = 64
MAX_WORKERS = 4  # the server's --num-workers
STARTED = 3  # workers started with the job, indexes 0..2
LEASE_S = 3.0
KINDS = ("kill", "restart", "stop", "term", "add", "server")
WEIGHTS = {"kill": 2, "restart": 2, "stop": 2, "term": 1, "add": 2, "server": 2}


@dataclasses.dataclass(frozen=True)
class Job:
    """What trains: ``epochs`` of digits; ``latency_ms`` per call (``--added-latency-ms``)."""

    mode: str = "sync"
    epochs: int = 2
    latency_ms: int = 50

    @property
    def points(self) -> int:
        """How far progress goes: sync's rounds, async's tasks."""
        if self.mode == "sync":
            return self.epochs * -(-EXAMPLES // GLOBAL_BATCH)
        return self.epochs * -(-EXAMPLES // (GLOBAL_BATCH // MAX_WORKERS))


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    index: int  # the worker index it acts on; -1 for add and server
    at: int     # the round (sync) or tasks done (async) it fires at

    def __str__(self) -> str:
        return f"{self.kind}{'' if self.index < 0 else f':{self.index}'}@{self.at}"

    @classmethod
    def parse(cls, text: str) -> "Fault":
        m = re.fullmatch(r"(\w+)(?::(\d+))?@(\d+)", text.strip())
        if m is None or m.group(1) not in KINDS:
            raise ValueError(f"a fault is KIND[:INDEX]@POINT with KIND one of {KINDS}; got {text!r}")
        kind, index = m.group(1), int(m.group(2)) if m.group(2) else -1
        if (index < 0) != (kind in ("add", "server")) or not -1 <= index < MAX_WORKERS:
            raise ValueError(f"{text!r}: {kind} takes {'no index' if kind in ('add', 'server') else 'an index'}"
                             f" (0..{MAX_WORKERS - 1})")
        if kind == "term" and index == 0:
            raise ValueError(f"{text!r}: the chief is never sent SIGTERM (it writes the results)")
        return cls(kind, index, int(m.group(3)))


def parse_schedule(text: str) -> list[Fault]:
    return sorted((Fault.parse(t) for t in text.replace(",", " ").split()), key=lambda f: f.at)


def draw(job: Job, seed: int) -> list[Fault]:
    """4 to 8 faults from ``seed``, at points within the job's first 85 %, each on an index
    that is live at that point in a job that went as planned (lowest free index for ``add``,
    as the server hands them out; at least one worker always live)."""
    rng = random.Random(f"{job.mode}-{seed}")
    points = sorted(rng.sample(range(2, max(3, job.points * 85 // 100)), rng.randint(4, 8)))
    live, dead, left = set(range(STARTED)), set(), set()
    faults = []
    for at in points:
        kinds = [k for k in KINDS if _possible(k, live, dead, left)]
        kind = rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
        index = -1
        if kind in ("kill", "restart", "stop"):
            index = rng.choice(sorted(live))
        elif kind == "term":
            index = rng.choice(sorted(live - {0}))
        if kind == "add":
            fresh = [i for i in range(MAX_WORKERS) if i not in live | dead | left]
            index_taken = (fresh or sorted(dead))[0]
            live.add(index_taken), dead.discard(index_taken)
        elif kind == "kill":
            live.discard(index), dead.add(index)
        elif kind == "term":
            live.discard(index), left.add(index)
        faults.append(Fault(kind, index, at))
    return faults


def _possible(kind: str, live: set, dead: set, left: set) -> bool:
    if kind in ("kill", "term"):
        return len(live - ({0} if kind == "term" else set())) >= 1 and len(live) >= 2
    if kind == "add":
        return len(live) < MAX_WORKERS and len(left) + len(live) < MAX_WORKERS
    return True


@dataclasses.dataclass
class Outcome:
    job: Job
    schedule: list[Fault]
    fired: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    status: object = None
    seconds: float = 0.0
    logs: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def command(self) -> str:
        """The one command that runs this schedule again."""
        return (f"python -m tests.chaos.nemesis --mode {self.job.mode} --epochs {self.job.epochs} --latency-ms "
                f"{self.job.latency_ms} --schedule \"{' '.join(map(str, self.schedule))}\"")

    def summary(self) -> str:
        head = "ok" if self.ok else f"FAILED (again: {self.command}; logs in {self.logs})"
        text = (f"{head} {self.job.mode} [{' '.join(map(str, self.schedule))}] in {self.seconds:.0f} s; "
                f"fired {len(self.fired)}, skipped {self.skipped or 'none'}")
        return text + "".join(f"\n  - {p}" for p in self.problems)


class Run:
    """One job on loopback under a schedule (module docstring); every process it starts ends with it."""

    def __init__(self, job: Job, schedule: list[Fault], workdir: Path, cache: Path | None = None):
        self.job, self.schedule, self.dir = job, schedule, workdir
        self.cache = cache or workdir.parent  # where the undisturbed run's weights are kept
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.server: subprocess.Popen | None = None
        self.servers = 0
        self.workers: list[subprocess.Popen] = []
        self.spares: list[subprocess.Popen] = []  # warm, waiting for their flags (``warm``)
        self._started = -1  # worker processes started: their logs' and go files' numbers
        self.expected: dict[int, str] = {}  # process id -> how it should end: "done", "killed", "left", "stopped"
        self.outcome = Outcome(job, schedule, logs=workdir)
        self._timers: list[threading.Timer] = []

    # -- processes ---------------------------------------------------------------
    def _start(self, argv: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        log = open(self.dir / f"{name}.log", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        env.pop("TF_CONFIG", None)
        proc = subprocess.Popen(dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=self.dir, env=env)
        log.close()
        proc.name = name
        return proc

    def start_server(self) -> None:
        self.servers += 1
        flags = ["--mode", self.job.mode, "--num-workers", str(MAX_WORKERS), "--lease-timeout", str(LEASE_S),
                 "--checkpoint-interval", "0.5", "--checkpoint-dir", str(self.dir / "ckpt")]
        if self.job.mode == "sync":
            flags += ["--elastic-min-workers", "2", "--micro-batches", str(MAX_WORKERS)]
        self.server = self._start([sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port",
                                   str(self.port), *flags], f"ps{self.servers}")
        with PSClient(self.address) as client:
            client.wait_ready(60)

    def _spare(self) -> subprocess.Popen:
        """A worker process that loads TensorFlow now and starts training when ``start_worker``
        hands it its flags (``warm``)."""
        n = self._started = self._started + 1
        go = self.dir / f"go-{n}.json"
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2"}  # as worker.model sets them, first
        proc = self._start([sys.executable, "-m", "tests.chaos.nemesis", "--warm", str(go)], f"w{n}", env)
        proc.go = go
        return proc

    def start_worker(self, index: int | str) -> subprocess.Popen:
        """A warm spare trains as a worker on ``index`` (or ``auto``) from now; another spare
        starts loading for the next one."""
        proc = self.spares.pop(0) if self.spares else self._spare()
        argv = ["--ps", self.address, "--worker-index", str(index), "--num-workers", str(MAX_WORKERS),
                *self._flags()]
        tmp = proc.go.with_suffix(".tmp")
        tmp.write_text(json.dumps(argv))
        tmp.rename(proc.go)  # whole, at once
        self.workers.append(proc)
        self.expected[proc.pid] = "done"
        if not self.spares:
            self.spares.append(self._spare())
        return proc

    def _flags(self) -> list[str]:
        return ["--elastic", "--dataset", "digits", "--model", "cnn", "--epochs", str(self.job.epochs),
                 "--global-batch-size", str(GLOBAL_BATCH), "--added-latency-ms", str(self.job.latency_ms),
                "--reconnect-timeout", "60", "--connect-timeout", "60", "--log-level", "WARNING"]

    def holder(self, index: int, wait_s: float = 30.0) -> subprocess.Popen | None:
        """The process the server has on ``index`` (by the pid in its registered name), alive and
        not ended by a fault (paused, even declared dead, it still holds the index).
        While a process started here has not registered yet (it imports TensorFlow first),
        waits for it, up to ``wait_s``: it may be the one an auto index gives ``index``."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                records = self.status().workers
            except PSClientError:
                records = None
            if records is not None:
                pids = {}
                for r in records:  # a declared dead one too: a paused process holds its index until replaced
                    if not r.left and ":" in r.worker_name:
                        pids[int(r.worker_name.rsplit(":", 1)[-1])] = r.worker_id
                mine = next((p for p in self.workers if p.poll() is None and pids.get(p.pid) == index
                             and self.expected[p.pid] in ("done", "stopped")), None)  # not one a fault ended
                starting = [p for p in self.workers if p.poll() is None and p.pid not in pids
                            and self.expected[p.pid] == "done"]
                if mine is not None or not starting or time.monotonic() > deadline:
                    return mine
            elif time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def status(self):
        with PSClient(self.address, timeout=5) as client:
            return client.status()

    # -- faults ------------------------------------------------------------------
    def fire(self, fault: Fault) -> None:
        if fault.kind == "server":
            self.server.kill()
            self.server.wait(30)
            self.start_server()
        elif fault.kind == "add":
            self.start_worker("auto")
        else:
            proc = self.holder(fault.index)
            if proc is None:
                self.outcome.skipped.append(str(fault))
                return
            if fault.kind in ("kill", "restart"):
                proc.kill()
                proc.wait(30)
                self.expected[proc.pid] = "killed"
                if fault.kind == "restart":
                    self.start_worker(fault.index)
            elif fault.kind == "term":
                proc.send_signal(signal.SIGTERM)
                self.expected[proc.pid] = "left"
            else:
                proc.send_signal(signal.SIGSTOP)
                self.expected[proc.pid] = "stopped"
                timer = threading.Timer(LEASE_S + 2.0, _continue, (proc,))
                timer.daemon = True
                timer.start()
                self._timers.append(timer)
        self.outcome.fired.append(str(fault))

    def progress(self) -> int | None:
        try:
            s = self.status()
        except PSClientError:
            return None  # the server is restarting
        return s.round if self.job.mode == "sync" else s.tasks_done

    # -- the run -----------------------------------------------------------------
    def run(self, stall_s: float = 90.0) -> Outcome:
        started = time.monotonic()
        try:
            self.start_server()
            for i in range(STARTED):
                self.start_worker(i)
            todo = list(self.schedule)
            last, moved = -1, time.monotonic()
            while any(p.poll() is None for p in self.workers):
                now = self.progress()
                if now is not None and now != last:
                    last, moved = now, time.monotonic()
                while todo and now is not None and now >= todo[0].at:
                    self.fire(todo.pop(0))
                if time.monotonic() - moved > stall_s:
                    self.outcome.problems.append(f"hung: no progress for {stall_s:g} s at {last} "
                                                 f"({self._describe()})")
                    break
                time.sleep(0.05)
            for f in todo:
                self.outcome.skipped.append(f"{f} (the job ended first)")
            if not self.outcome.problems:
                self._check_ends()
                self._check_server()
        finally:
            self.outcome.seconds = time.monotonic() - started
            self.stop()
        return self.outcome

    def _describe(self) -> str:
        try:
            s = self.status()
        except PSClientError as e:
            return f"no status: {e}"
        alive = [f"{w.worker_id}{'(dead)' if w.dead else '(left)' if w.left else ''}" for w in s.workers]
        return (f"round {s.round}, version {s.version}, tasks done/held/queued {s.tasks_done}/{s.tasks_held}/"
                f"{s.tasks_queued}, waiting for {list(s.waiting_for)}, workers {alive}")

    def _check_ends(self) -> None:
        for p in self.workers:
            code, expected = p.wait(5), self.expected[p.pid]
            log = (self.dir / f"{p.name}.log").read_text()
            # Superseded: another process took its index since (a paused one declared dead and an auto
            # index handed its index; a restart:I racing an auto index for a dead I): it stops, in one line.
            superseded = code == 1 and "(superseded)" in log
            fine = {"done": code == 0 or superseded, "killed": code == -signal.SIGKILL, "left": code in (0, 143),
                    "stopped": code == 0 or superseded}[expected]
            if not fine:
                self.outcome.problems.append(f"{p.name} ({expected}) exited {code}: {log.strip()[-600:]}")

    def _check_server(self) -> None:
        s = self.outcome.status = self.status()
        if list(s.epoch_examples) != [EXAMPLES] * self.job.epochs:
            self.outcome.problems.append(f"epoch examples {list(s.epoch_examples)}, not {self.job.epochs} x {EXAMPLES}")
        if s.examples_applied != self.job.epochs * EXAMPLES:
            self.outcome.problems.append(f"{s.examples_applied} examples applied, not {self.job.epochs * EXAMPLES}")
        if self.job.mode == "sync":
            if s.version != self.job.points:
                self.outcome.problems.append(f"version {s.version}, not {self.job.points}")
            mine = self.values()
            theirs = undisturbed(self.job, self.cache)
            differ = sorted(n for n in theirs if n not in mine or not np.array_equal(mine[n], theirs[n]))
            if differ or mine.keys() != theirs.keys():
                self.outcome.problems.append(f"weights differ from the undisturbed run's: {differ[:5]}")
        else:
            if (s.tasks_done, s.tasks_held, s.tasks_queued) != (self.job.points, 0, 0):
                self.outcome.problems.append(f"tasks done/held/queued {s.tasks_done}/{s.tasks_held}/"
                                             f"{s.tasks_queued}, not {self.job.points}/0/0")
            if s.pushes_applied != self.job.points:
                self.outcome.problems.append(f"{s.pushes_applied} pushes applied for {self.job.points} tasks")

    def values(self) -> dict[str, np.ndarray]:
        with PSClient(self.address) as client:
            return client.pull()[1]

    def stop(self) -> None:
        for t in self._timers:
            t.cancel()
        for p in [*self.workers, *self.spares, self.server]:
            if p is not None and p.poll() is None:
                _continue(p)
                p.kill()
            if p is not None:
                p.wait(30)


_UNDISTURBED: dict[Job, dict] = {}


def undisturbed(job: Job, cache: Path) -> dict[str, np.ndarray]:
    """Sync: the final weights of the job with no fault (computed once, kept in ``cache``)."""
    if job not in _UNDISTURBED:
        path = cache / f"undisturbed-{job.epochs}-{job.latency_ms}.npz"
        if not path.exists():
            run = Run(job, [], cache / f"undisturbed-{job.epochs}-{job.latency_ms}")
            try:
                run.start_server()
                for i in range(STARTED):
                    run.start_worker(i)
                for p in run.workers:
                    if p.wait(600) != 0:
                        raise RuntimeError(f"the undisturbed run's {p.name} exited {p.returncode}")
                np.savez(path, **run.values())
            finally:
                run.stop()
        _UNDISTURBED[job] = dict(np.load(path))
    return _UNDISTURBED[job]


def run_schedule(job: Job, schedule: list[Fault], workdir: Path, cache: Path | None = None) -> Outcome:
    return Run(job, schedule, workdir, cache).run()


def _continue(proc: subprocess.Popen) -> None:
    try:
        proc.send_signal(signal.SIGCONT)
    except ProcessLookupError:
        pass


def _seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def warm(go: str) -> int:
    """A worker process that waits warm: TensorFlow loaded, then ``ps-worker``'s main with the
    flags the run writes to ``go`` (a JSON list), once it appears. Ends with its parent."""
    import tensorflow  # noqa: F401 -- the slow part, done before the flags come
    from worker.cli import main as worker_main

    path = Path(go)
    while not path.exists():
        if os.getppid() == 1:
            return 1
        time.sleep(0.02)
    return worker_main(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--warm"]:
        return warm(argv[1])
    p = argparse.ArgumentParser(prog="python -m tests.chaos.nemesis", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=int, help="the schedule this seed draws")
    which.add_argument("--seeds", help="several seeds: 0-49 or 1,4,7")
    which.add_argument("--schedule", help='a given schedule: "kill:0@40 server@20 add@30"')
    p.add_argument("--epochs", type=int, default=Job.epochs)
    p.add_argument("--latency-ms", type=int, default=Job.latency_ms)
    p.add_argument("--print", action="store_true", help="print the schedule(s), run nothing")
    p.add_argument("--dir", help="where the logs go (default: a new temporary directory, kept)")
    args = p.parse_args(argv)
    job = Job(args.mode, args.epochs, args.latency_ms)
    if args.schedule is not None:
        cases = [("given", parse_schedule(args.schedule))]
    else:
        cases = [(f"seed {s}", draw(job, s)) for s in ([args.seed] if args.seed is not None else _seeds(args.seeds))]
    if args.print:
        for name, schedule in cases:
            print(f"{name}: {' '.join(map(str, schedule))}")
        return 0
    root = Path(args.dir or tempfile.mkdtemp(prefix="nemesis-"))
    failed = 0
    for n, (name, schedule) in enumerate(cases):
        outcome = run_schedule(job, schedule, root / f"run{n}")
        failed += not outcome.ok
        print(f"{name}: {outcome.summary()}", flush=True)
    print(f"{len(cases) - failed} passed, {failed} failed (logs in {root})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
