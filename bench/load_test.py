"""Load test: many workers pushing at once against one real ``ps-server``.

    python bench/load_test.py --mode both --clients 64 --seconds 30 --json-out load.json
    python bench/load_test.py --mode async --async-apply locked,hogwild --clients 64 --seconds 30

Starts ``ps-server`` as a subprocess on 127.0.0.1 (port 0), then ``--clients``
workers, each registered under its own worker index with its own channel, run
as threads of ``--procs`` client processes (default 2; RELIABILITY.md has the
measurement behind it: a client spends most of a call in gRPC's C core, outside
the GIL, and on 2 cores more processes only take CPU from the server). Every worker pushes a
known gradient, all ones, for every variable (one of them 1 MiB of float32),
under SGD with learning rate 1 from zeros. What it checks:

- sync: workers pull and push in lockstep rounds. A round's gradient is the
  batch-weighted mean of ones, which is exactly 1 when the worker count is a
  power of two, so after R completed rounds every element is exactly -R and the
  server's version is R. (For other counts the expected value is a float32
  replay of the documented arithmetic, ``ps_server.core.modes.aggregation``.)
- async: every worker pulls and pushes as fast as it can with increasing steps.
  The async module promises that every accepted gradient is applied to every
  variable exactly once, so with A = the server's ``pushes_applied`` every
  element must be exactly -A. ``lost_element_updates`` = sum over elements of
  (actual - expected) = how many element updates the lock-free apply lost; it
  is measured and reported, and the promise is that it is 0.
- async with ``--async-apply hogwild`` (``ps-server --async-apply hogwild``: in
  place, no lock): updates may be lost, so ``lost_element_updates`` is measured
  but not held to 0. What is checked instead is what that apply promises: every
  element is an integer between -A and 0 (each landed update subtracts exactly
  1), the version and ``pushes_applied`` count every answered push.
  ``--async-apply locked,hogwild`` runs both, one after the other, side by side in
  the table.
- both: zero errors (every failed call counts, and is listed), the client-side
  count of answered pushes equals the server's count, and the server's
  resident memory (VmRSS, sampled from /proc) shows no growth trend after the
  warm-up.
- both, measured and reported, held to nothing: an operator's Status and Health every
  half second from the bench's own process (``ControlProbe``), each call's p50, p99,
  max and failures side by side, the probe's own wake-up lag, and the CPU seconds the
  server's threads ran and waited for a CPU meanwhile (``thread_times``): whether a slow
  answer is the server's or the machine's.

Exact in float32 up to 2**24 applied pushes per element; the run refuses
nothing, but flags a run that went past that. Exit status: 0 when every check
holds, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, ROOT)

from ps_common.procs import ServerStartError, die_with_parent, dying_with_parent, wait_for_port_file  # noqa: E402
from worker.client import PSClient, PSClientError  # noqa: E402

# The model: a few variables of different shapes, one of 1 MiB.
VARIABLES: dict[str, tuple[int, ...]] = {
    "big/kernel": (512, 512),  # 262144 float32 = 1 MiB
    "dense/kernel": (256, 128),
    "dense/bias": (128,),
    "scale": (),
}
SGD_LR1 = {"name": "sgd", "learning_rate": 1.0}
EXACT_LIMIT = 2**24  # float32 counts every integer up to here exactly
NEVER = 2**62

# A worker's calls get a generous deadline: errors here should mean something broke,
# not that a loaded 2-core machine was slow.
CALL_TIMEOUT = 120.0
BARRIER_TIMEOUT = 120.0


# -- the server under test ---------------------------------------------------------------
class Server:
    """One ``ps-server`` subprocess; its log goes to a file in ``workdir``."""

    def __init__(self, mode: str, num_workers: int, workdir: str, threads: int, async_apply: str = "locked"):
        label = mode if mode == "sync" else f"{mode}-{async_apply}"
        self.log_path = os.path.join(workdir, f"ps-{label}.log")
        port_file = os.path.join(workdir, f"port-{label}")
        if os.path.exists(port_file):  # an earlier run's (--repeat): never read its port
            os.remove(port_file)
        self.argv = [
            sys.executable, "-m", "ps_server", "--host", "127.0.0.1", "--port", "0", "--port-file", port_file,
            "--mode", mode, "--num-workers", str(num_workers), *(["--threads", str(threads)] if threads else []),
            "--lease-timeout", "3600", "--barrier-timeout", str(BARRIER_TIMEOUT), "--log-level", "WARNING",
        ] + (["--async-apply", async_apply] if mode != "sync" else [])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("TF_CONFIG", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(dying_with_parent(self.argv), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=workdir, env=env)
        try:
            self.address = f"127.0.0.1:{wait_for_port_file(port_file, self.proc, 60)}"
        except ServerStartError as e:
            self.kill()
            raise RuntimeError(f"{e}: {self.log_tail()}") from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> int:
        """SIGTERM (graceful), SIGKILL after 15 s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=30)


class RssSampler(threading.Thread):
    """Samples a process's VmRSS from /proc/<pid>/status every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 0.25):
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []  # (monotonic time, rss bytes)
        self.peak_threads = 0  # the most threads the process had at a sample
        self._halt = threading.Event()

    def sample(self) -> None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            rss = int(fields["VmRSS"].split()[0]) * 1024
            self.peak_threads = max(self.peak_threads, int(fields["Threads"]))
        except (OSError, KeyError, ValueError):
            return  # the process is gone
        self.samples.append((time.monotonic(), rss))

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class ControlProbe(threading.Thread):
    """Status and a health check every half second while the load runs, each with a 10 s
    deadline: the calls an operator makes while workers wait at a barrier. It runs in the
    bench's own process, apart from the client processes, on a channel of its own; each
    call's latency is kept by kind (Status runs a handler on the server's threads, Health
    is answered on its event loop), and so is how late this thread itself woke for each
    period (``wake_lag``): when that is as long as the calls, the machine's CPUs, not the
    server, are what the probe waited for."""

    CALLS = ("Status", "Health")

    def __init__(self, address: str, period: float = 0.5):
        super().__init__(name="control-probe", daemon=True)
        self.address, self.period = address, period
        self.times: dict[str, list[float]] = {name: [] for name in self.CALLS}
        self.failures: dict[str, list[str]] = {name: [] for name in self.CALLS}
        self.wake_lag: list[float] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with PSClient(self.address, timeout=10.0) as client:
            calls = {"Status": client.status, "Health": lambda: client.health(timeout=10.0)}
            due = time.perf_counter() + self.period
            while not self._halt.wait(max(0.0, due - time.perf_counter())):
                self.wake_lag.append(time.perf_counter() - due)
                for name, call in calls.items():
                    started = time.perf_counter()
                    try:
                        call()
                        self.times[name].append(time.perf_counter() - started)
                    except Exception as e:
                        self.failures[name].append(f"{type(e).__name__}: {e}"[:200])
                due = max(due + self.period, time.perf_counter())

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=25)

    def summary(self) -> dict:
        def figures(xs: list[float]) -> dict:
            return {"p50_ms": _percentile_ms(xs, 50), "p99_ms": _percentile_ms(xs, 99),
                    "max_ms": round(max(xs) * 1e3, 2) if xs else None}
        out = {name: {"calls": len(self.times[name]) + len(self.failures[name]),
                      "failed": len(self.failures[name]), **figures(self.times[name]),
                      "failure_samples": self.failures[name][:3]} for name in self.CALLS}
        out["wake_lag"] = figures(self.wake_lag)
        return out


def thread_times(pid: int, since: dict | None = None) -> dict:
    """Seconds a process's threads spent on a CPU, and runnable but waiting for one (summed
    over its threads, from /proc/<pid>/task/*/schedstat), ``since`` an earlier answer: the
    waiting is what the rest of the machine's load (here the client processes) costs it."""
    ran, waited = (-since["ran_s"], -since["waited_for_cpu_s"]) if since else (0.0, 0.0)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
            ran, waited = ran + int(fields[0]) / 1e9, waited + int(fields[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended
    return {"ran_s": round(ran, 2), "waited_for_cpu_s": round(waited, 2)}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# -- the workers -------------------------------------------------------------------------
def _gradients() -> dict[str, np.ndarray]:
    grads = {name: np.ones(shape, np.float32) for name, shape in VARIABLES.items()}
    for g in grads.values():
        g.flags.writeable = False
    return grads


class _Shared:
    """What the orchestrator and every client process share (created from one mp context)."""

    def __init__(self, ctx, parties: int):
        self.start = ctx.Barrier(parties)
        self.stop = ctx.Event()  # async: stop pushing
        # sync: rounds < stop_round are completed by every worker; set at the deadline.
        self.round_lock = ctx.Lock()
        self.max_started = ctx.Value("q", -1, lock=False)
        self.stop_round = ctx.Value("q", NEVER, lock=False)


class _Tally:
    """One client process's results, filled by its threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pushes = 0
        self.pulls = 0
        self.errors: list[str] = []
        self.push_latency: list[float] = []
        self.pull_latency: list[float] = []
        self.rounds: list[int] = []

    def error(self, worker: int, where: str, e: BaseException) -> None:
        with self.lock:
            self.errors.append(f"worker {worker} {where}: {type(e).__name__}: {e}")


def _worker(index: int, args: dict, shared: _Shared, tally: _Tally) -> None:
    mode, pull_every = args["mode"], args["pull_every"]
    grads = _gradients()
    push_lat: list[float] = []
    pull_lat: list[float] = []
    pushes = pulls = 0
    rounds = 0
    client = PSClient(args["address"], timeout=CALL_TIMEOUT)
    try:
        try:
            reg = client.register(index, args["clients"], name=f"load-{index}")
            version = reg.version
        except Exception as e:  # still meet the others at the start line, then leave
            tally.error(index, "register", e)
            shared.start.wait(timeout=300)
            return
        shared.start.wait(timeout=300)
        step = 0
        while True:
            if mode == "sync":
                with shared.round_lock:
                    if step >= shared.stop_round.value:
                        break
                    if step > shared.max_started.value:
                        shared.max_started.value = step
            elif shared.stop.is_set():
                break
            where = "pull"
            try:
                if mode == "sync" or step % pull_every == 0:
                    t = time.perf_counter()
                    version, values = client.pull(index)
                    pull_lat.append(time.perf_counter() - t)
                    pulls += 1
                    if mode == "sync" and version != step:
                        raise AssertionError(f"pulled version {version} before sync round {step}")
                where = f"push step {step}"
                t = time.perf_counter()
                reply = client.push(index, step, version, 1, grads)
                push_lat.append(time.perf_counter() - t)
                pushes += 1
                if reply.replayed or reply.dropped:
                    raise AssertionError(f"push answered replayed={reply.replayed} dropped={reply.dropped}")
                if mode == "sync" and (reply.version != step + 1 or reply.contributors != args["clients"]):
                    raise AssertionError(f"sync round {step} answered version {reply.version} "
                                         f"with {reply.contributors} contributors")
                version = reply.version
            except (PSClientError, AssertionError) as e:
                # A worker that fails stops: in sync mode the others then fail the barrier
                # (BARRIER_TIMEOUT), which is reported too.
                tally.error(index, where, e)
                break
            step += 1
            rounds = step
    finally:
        client.close()
        with tally.lock:
            tally.pushes += pushes
            tally.pulls += pulls
            tally.push_latency.extend(push_lat)
            tally.pull_latency.extend(pull_lat)
            tally.rounds.append(rounds)


def client_process(indices: list[int], args: dict, shared: _Shared, results) -> None:
    """One client process: a thread per worker index; puts its tally on ``results``."""
    die_with_parent()
    tally = _Tally()
    threads = [threading.Thread(target=_worker, args=(i, args, shared, tally), name=f"worker-{i}", daemon=True)
               for i in indices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put({
        "pid": os.getpid(), "pushes": tally.pushes, "pulls": tally.pulls, "errors": tally.errors,
        "push_latency": tally.push_latency, "pull_latency": tally.pull_latency, "rounds": tally.rounds,
        "cpu_s": sum(os.times()[:2]),
    })


# -- expected values ------------------------------------------------------------------
def sync_expected(rounds: int, n: int) -> float:
    """Each element after ``rounds`` sync rounds of n all-ones pushes, batch 1, SGD lr 1 from 0.

    -rounds exactly when n is a power of two; otherwise replays the server's float32
    arithmetic (weights 1/n cast to float32, summed in worker order; w - g*lr).
    """
    w32 = np.float32(1 / n)
    step = w32
    for _ in range(n - 1):
        step = np.float32(step + w32)
    if step == np.float32(1.0):
        return float(-rounds)
    v = np.float32(0.0)
    for _ in range(rounds):
        v = np.float32(v - step * np.float32(1.0))
    return float(v)


# -- one run -----------------------------------------------------------------------------
def _percentile_ms(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 2) if xs else None


def memory_summary(samples: list[tuple[float, int]], t_start: float, t_end: float,
                   warmup: float) -> dict:
    """Start, peak and end RSS, and whether it grew after the warm-up.

    Under load the RSS is a sawtooth, not a line: what is resident at an instant
    depends on how many 1 MiB requests and replies are in flight (a 64-worker run
    swings by +-50 MiB from one second to the next). So the levels compared are
    medians over windows, never single samples:

    - ``post_warmup_mib``: median over the 2 s after the warm-up;
    - ``end_mib``: median over the last 2 s of the load (``last_mib`` is the last sample);
    - "bounded": the median of the second half of the post-warm-up samples is no
      more than 20 % + 16 MiB above the median of the first half (no growth
      trend; short runs are still settling), and ``end_mib`` <= 1.5 x
      ``post_warmup_mib``. A slow leak hides in the swing of a 30 s run:
      ``slope_mib_per_min`` and ``series_mib`` are there to look at.
    """
    mib = 2**20
    load = [(t, r) for t, r in samples if t_start <= t <= t_end]
    before = [r for t, r in samples if t < t_start]
    after = [(t, r) for t, r in load if t >= t_start + warmup]

    def median(rows) -> float:
        return float(np.median([r for _, r in rows]))

    out = {
        "start_mib": round((before[-1] if before else load[0][1]) / mib, 1),
        "peak_mib": round(max(r for _, r in samples) / mib, 1),
        "end_mib": round(median([x for x in load if x[0] >= t_end - 2.0]) / mib, 1),
        "last_mib": round(load[-1][1] / mib, 1),
        "post_warmup_mib": None, "slope_mib_per_min": None, "bounded": None,
        "warmup_s": warmup, "samples": len(samples),
        # about one point a second, seconds since the load started: enough to see a trend
        "series_mib": [[round(t - t_start, 1), round(r / mib, 1)] for t, r in samples[::4]],
    }
    if len(after) >= 4:
        post = median([x for x in after if x[0] < after[0][0] + 2.0])
        half = len(after) // 2
        first, second = median(after[:half]), median(after[half:])
        ts = np.array([t for t, _ in after]) - after[0][0]
        rs = np.array([r for _, r in after], dtype=np.float64)
        slope = float(np.polyfit(ts, rs, 1)[0]) * 60 / mib
        out.update(
            post_warmup_mib=round(post / mib, 1),
            first_half_median_mib=round(first / mib, 1),
            second_half_median_mib=round(second / mib, 1),
            slope_mib_per_min=round(slope, 2),
            bounded=bool(second <= first * 1.20 + 16 * mib and out["end_mib"] * mib <= 1.5 * post),
        )
    return out


def _collect(results, procs: list, timeout: float) -> list[dict]:
    """One tally per client process; a process that died without one is an error, not a hang."""
    tallies: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(tallies) < len(procs):
        try:
            tallies.append(results.get(timeout=1.0))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RuntimeError(f"client processes gave no results within {timeout:g} s") from None
            if len(tallies) + sum(p.is_alive() for p in procs) < len(procs) and results.empty():
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"a client process died without results (exit codes {codes})") from None
    return tallies


def _checks(result: dict, errors: list[str], status, version: int, values: dict, stop_round: int | None,
            tallies: list[dict]) -> dict[str, bool]:
    """What a run must show, by mode (the module's docstring); adds the figures behind them to ``result``."""
    mode, n, async_apply, elements = result["mode"], result["clients"], result["async_apply"], result["elements"]
    pushes = result["pushes"]
    checks: dict[str, bool] = {
        "zero_errors": not errors,
        "client_pushes_equal_server_count": pushes == status.pushes_applied,
        "memory_bounded": bool(result["memory"]["bounded"]),
    }
    if mode == "sync":
        expected = sync_expected(stop_round, n)
        wrong = sum(int(np.count_nonzero(v != np.float32(expected))) for v in values.values())
        result.update(rounds=stop_round, rounds_per_s=round(stop_round / result["elapsed_s"], 2),
                      expected_value=expected, elements_wrong=wrong,
                      worker_rounds_min=min(r for t in tallies for r in t["rounds"]),
                      worker_rounds_max=max(r for t in tallies for r in t["rounds"]))
        checks["values_exact"] = wrong == 0
        checks["version_equals_rounds"] = version == stop_round
        checks["every_round_full"] = status.pushes_applied == stop_round * n
        checks["within_float32_exact_range"] = stop_round <= EXACT_LIMIT
    else:
        applied = status.pushes_applied
        expected = -float(applied)
        # actual = -(updates that landed); expected = -(pushes applied): the difference is what was lost.
        diff = np.concatenate([(v.astype(np.float64) - expected).ravel() for v in values.values()])
        lost = int(diff[diff > 0].sum())
        extra = int(-diff[diff < 0].sum())
        result.update(expected_value=expected, lost_element_updates=lost, extra_element_updates=extra,
                      elements_wrong=int(np.count_nonzero(diff)),
                      lost_fraction=float(f"{lost / (applied * elements):.3g}") if applied else 0.0)
        if async_apply == "hogwild":  # lost updates allowed: each element -(updates that landed)
            counts = np.concatenate([v.astype(np.float64).ravel() for v in values.values()])
            checks["elements_whole_counts_in_range"] = bool(
                np.all(counts == np.round(counts)) and np.all((counts >= expected) & (counts <= 0)))
        else:
            checks["zero_lost_updates"] = lost == 0 and extra == 0
        checks["version_counts_pushes"] = version == applied
        checks["within_float32_exact_range"] = applied <= EXACT_LIMIT
    return checks


def _start_clients(ctx, mode: str, address: str, opts: argparse.Namespace, shared: _Shared, results) -> list:
    """The client processes, started: ``--clients`` workers as threads of ``--procs`` processes."""
    n = opts.clients
    args = {"mode": mode, "address": address, "clients": n, "pull_every": opts.pull_every}
    nprocs = max(1, min(opts.procs, n))
    procs = [ctx.Process(target=client_process, args=(list(range(n))[p::nprocs], args, shared, results), daemon=True)
             for p in range(nprocs)]
    for p in procs:
        p.start()
    return procs


def _stop_load(mode: str, shared: _Shared) -> int | None:
    """Tell the workers to stop: sync, after the rounds already started (returned); async, now."""
    if mode != "sync":
        shared.stop.set()
        return None
    with shared.round_lock:
        shared.stop_round.value = shared.max_started.value + 1
        return shared.stop_round.value


def run_mode(mode: str, opts: argparse.Namespace, workdir: str, async_apply: str = "locked") -> dict:
    n = opts.clients
    threads = opts.threads  # 0: the server's default pool
    server = Server(mode, n, workdir, threads, async_apply)
    sampler = RssSampler(server.pid)
    sampler.start()
    ctx = mp.get_context("spawn")  # never fork a process that has grpc threads
    procs: list = []
    try:
        with PSClient(server.address, timeout=CALL_TIMEOUT) as admin:
            admin.wait_ready(60)
            # The chief's job: initialize. Worker 0 registers again below; that is allowed.
            admin.register(0, n, name="load-init")
            admin.initialize(0, {k: np.zeros(s, np.float32) for k, s in VARIABLES.items()}, SGD_LR1)
            time.sleep(0.5)  # let the start sample see the initialized server
            sampler.sample()

            shared, results = _Shared(ctx, n + 1), ctx.Queue()
            procs = _start_clients(ctx, mode, server.address, opts, shared, results)
            shared.start.wait(timeout=300)  # every worker registered
            t_start = time.monotonic()
            load_before = os.getloadavg()[0]
            cpu_start = cpu_seconds(server.pid)
            threads_start = thread_times(server.pid)
            probe = ControlProbe(server.address)  # Status and Health, answered while workers wait
            probe.start()
            time.sleep(opts.seconds)
            probe.stop()
            server_threads = thread_times(server.pid, since=threads_start)
            stop_round = _stop_load(mode, shared)
            tallies = _collect(results, procs, timeout=BARRIER_TIMEOUT + 2 * CALL_TIMEOUT)
            t_end = time.monotonic()
            cpu_end = cpu_seconds(server.pid)
            load_after = os.getloadavg()[0]
            for p in procs:
                p.join(timeout=30)
            time.sleep(1.0)
            sampler.sample()  # idle, after the load
            status = admin.status()
            version, values = admin.pull()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        sampler.stop()
        exit_code = server.stop()

    elapsed = t_end - t_start
    pushes = sum(t["pushes"] for t in tallies)
    pulls = sum(t["pulls"] for t in tallies)
    errors = [e for t in tallies for e in t["errors"]]
    push_lat, pull_lat = ([x for t in tallies for x in t[k]] for k in ("push_latency", "pull_latency"))
    elements = sum(int(np.prod(s, dtype=np.int64)) for s in VARIABLES.values())
    result = {
        "mode": mode, "async_apply": async_apply if mode != "sync" else None,
        "label": mode if mode == "sync" else f"{mode} {async_apply}", "clients": n, "client_procs": len(procs), "server_threads": threads,
        "seconds": opts.seconds, "elapsed_s": round(elapsed, 2), "pull_every": opts.pull_every,
        "variables": {k: list(s) for k, s in VARIABLES.items()}, "elements": elements,
        "pushes": pushes, "pulls": pulls, "pushes_per_s": round(pushes / elapsed, 1),
        "mib_pushed_per_s": round(pushes * elements * 4 / elapsed / 2**20, 1),
        "push_p50_ms": _percentile_ms(push_lat, 50), "push_p99_ms": _percentile_ms(push_lat, 99),
        "pull_p50_ms": _percentile_ms(pull_lat, 50), "pull_p99_ms": _percentile_ms(pull_lat, 99),
        "errors": len(errors), "error_samples": errors[:10],
        "server_cpu_percent": round(100 * (cpu_end - cpu_start) / elapsed, 1),
        "client_cpu_percent": round(100 * sum(t["cpu_s"] for t in tallies) / elapsed, 1),
        "loadavg_1m": [round(load_before, 2), round(load_after, 2)],  # other work on the machine skews figures
        "server_exit_code": exit_code, "server_cpu_s": round(cpu_end - cpu_start, 2),
        "server_version": version, "server_pushes_applied": status.pushes_applied,
        "server_pushes_replayed": status.pushes_replayed, "server_pushes_dropped": status.pushes_dropped,
        "server_max_staleness": status.max_staleness_seen, "server_mean_staleness": round(status.mean_staleness, 2),
        "memory": memory_summary(sampler.samples, t_start, t_end, min(max(2.0, 0.2 * opts.seconds), opts.seconds / 2)),
        "server_threads_peak": sampler.peak_threads,
        "control_calls": probe.summary(),
        "server_thread_times": server_threads,  # while the probe ran: on a CPU, and waiting for one
    }
    result["checks"] = _checks(result, errors, status, version, values, stop_round, tallies)
    result["ok"] = all(result["checks"].values())
    if not result["ok"]:
        result["server_log_tail"] = server.log_tail()
    return result


# -- reporting ---------------------------------------------------------------------------
def machine() -> dict:
    import grpc

    return {"nproc": os.cpu_count(), "python": platform.python_version(), "grpcio": grpc.__version__,
            "numpy": np.__version__, "platform": platform.platform(),
            "cpu": next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                         if line.startswith("model name")), platform.processor())}


def print_table(results: list[dict]) -> None:
    rows = [
        ("clients x procs", lambda r: f"{r['clients']} x {r['client_procs']}"),
        ("elapsed s", lambda r: r["elapsed_s"]),
        ("pushes", lambda r: r["pushes"]),
        ("pushes/s", lambda r: r["pushes_per_s"]),
        ("MiB pushed/s", lambda r: r["mib_pushed_per_s"]),
        ("rounds (sync)", lambda r: r.get("rounds", "-")),
        ("push p50 / p99 ms", lambda r: f"{r['push_p50_ms']} / {r['push_p99_ms']}"),
        ("pull p50 / p99 ms", lambda r: f"{r['pull_p50_ms']} / {r['pull_p99_ms']}"),
        ("errors", lambda r: r["errors"]),
        ("server / client CPU %", lambda r: f"{r['server_cpu_percent']} / {r['client_cpu_percent']}"),
        ("server CPU s", lambda r: r["server_cpu_s"]),
        ("server version", lambda r: r["server_version"]),
        ("expected value", lambda r: r["expected_value"]),
        ("elements wrong", lambda r: r["elements_wrong"]),
        ("lost element updates", lambda r: r.get("lost_element_updates", "-")),
        ("lost fraction", lambda r: r.get("lost_fraction", "-")),
        ("RSS start/peak/end MiB", lambda r: "{start_mib} / {peak_mib} / {end_mib}".format(**r["memory"])),
        ("server threads (peak)", lambda r: str(r.get("server_threads_peak", "-"))),
        *((f"{name} p50/p99/max ms, failed", lambda r, name=name: "{p50_ms} / {p99_ms} / {max_ms}, {failed} of {calls}"
           .format(**r["control_calls"][name])) for name in ControlProbe.CALLS),
        ("probe's wake-up lag p50/max ms", lambda r: "{p50_ms} / {max_ms}".format(**r["control_calls"]["wake_lag"])),
        ("server threads on / waiting for CPU s", lambda r: "{ran_s} / {waited_for_cpu_s}".format(
            **r["server_thread_times"])),
        ("RSS post-warm-up MiB", lambda r: r["memory"]["post_warmup_mib"]),
        ("RSS slope MiB/min", lambda r: r["memory"]["slope_mib_per_min"]),
        ("memory bounded", lambda r: r["memory"]["bounded"]),
        ("all checks", lambda r: "PASS" if r["ok"] else "FAIL: " + ", ".join(k for k, v in r["checks"].items() if not v)),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'':<{width}}  " + "  ".join(f"{r['label']:>22}" for r in results))
    for name, get in rows:
        print(f"{name:<{width}}  " + "  ".join(f"{str(get(r)):>22}" for r in results))
    for r in results:
        for e in r["error_samples"]:
            print(f"[{r['label']}] error: {e}")
        for name in ControlProbe.CALLS:
            for e in r["control_calls"][name]["failure_samples"]:
                print(f"[{r['label']}] {name} failed: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sync", "async", "both"), default="both")
    p.add_argument("--clients", type=int, default=64, help="concurrent workers (default 64)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the workers push (default 30)")
    p.add_argument("--procs", type=int, default=2,
                   help="client processes the workers are spread over, as threads (default 2)")
    p.add_argument("--threads", type=int, default=0, help="server pool threads (default: the server's own, which does not grow with the workers)")
    p.add_argument("--pull-every", type=int, default=1, help="async: pull before every Nth push (default 1)")
    p.add_argument("--async-apply", default="locked",
                   help="async: the server's --async-apply, or several comma-separated (locked,hogwild), each "
                   "a run of its own, side by side (default locked)")
    p.add_argument("--repeat", type=int, default=1, help="run every mode this many times, interleaved (default 1)")
    p.add_argument("--json-out", help="write the results here as JSON")
    opts = p.parse_args(argv)
    applies = [a for a in opts.async_apply.split(",") if a]
    if not applies or any(a not in ("locked", "hogwild") for a in applies):
        p.error(f"--async-apply takes locked, hogwild or both comma-separated, got {opts.async_apply!r}")
    if opts.repeat < 1:
        p.error("--repeat must be positive")
    if opts.clients < 1 or opts.seconds <= 0 or opts.procs < 1 or opts.pull_every < 1:
        p.error("--clients, --seconds, --procs and --pull-every must be positive")
    if opts.threads and opts.threads <= opts.clients:
        p.error("--threads must exceed --clients (workers blocked in a barrier hold a thread each)")
    modes = ["sync", "async"] if opts.mode == "both" else [opts.mode]
    runs = [(mode, apply) for mode in modes for apply in (applies if mode != "sync" else ["locked"])]
    results = []
    with tempfile.TemporaryDirectory(prefix="tfps-load-") as workdir:
        for _ in range(opts.repeat):
            for mode, apply in runs:
                label = mode if mode == "sync" else f"{mode} ({apply} apply)"
                print(f"running {label}: {opts.clients} workers in {min(opts.procs, opts.clients)} processes "
                      f"for {opts.seconds:g} s ...", file=sys.stderr, flush=True)
                results.append(run_mode(mode, opts, workdir, apply))
    report = {
        "command": " ".join([os.path.basename(sys.executable), "bench/load_test.py", *(argv or sys.argv[1:])]),
        "machine": machine(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": results,
    }
    print_table(results)
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
