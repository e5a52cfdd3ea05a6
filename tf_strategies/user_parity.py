"""``ps-parity --model M --dataset D``: the user's own ``model.fit`` under TensorFlow's strategies and tfps.

    ps-parity --model mymod:build --dataset mymod:data --workers 3 --epochs 3 --json-out p.json --plot p.png

``M`` returns a compiled Keras model, ``D`` ``(train, validation)`` datasets of global
batches (``tf_strategies.user_fit`` says exactly what they must be). One ``init`` process
builds the model once and writes its initial weights; every runner then runs
``tf_strategies.user_fit`` (the same ``model.fit``, same initial weights, same batches,
same epochs) in fresh processes:

- ``mirrored``: Keras 3 ``MirroredStrategy`` over N logical CPUs, one process (the reference);
- ``tfk-mwms``, ``tfk-pss``: ``tf_keras`` 2.21 (legacy Keras) ``MultiWorkerMirroredStrategy``
  (N worker processes) and ``ParameterServerStrategy`` (1 ps, N workers, the chief as
  coordinator), how TensorFlow users run ``model.fit`` on several machines today.
  ``tf_keras`` is installed on first use with ``pip install --no-deps --target
  ~/.cache/tfps/tf_keras-2.21.0 tf_keras==2.21.0`` (``TFPS_CACHE_DIR`` moves the cache)
  and put on those processes' ``PYTHONPATH`` only, with ``TF_USE_LEGACY_KERAS=1``; if
  the install fails the runner fails with pip's reason;
- ``keras-mwms``, ``keras-pss``: the same two strategies with Keras 3, run for real.
  Their ``model.fit`` fails today (keras-team/keras#20585): each is reported as failing
  with its error's first line, and does not fail the run; if one finishes, its numbers
  are reported like any other's;
- ``tfps-sync``, ``tfps-async``: ``ps-launch --mode sync|async --workers N -- python -m
  tf_strategies.user_fit --strategy tfps ...``: the program with the strategy line
  changed to ``tfps.keras.Strategy()``.

The multi-process TensorFlow runners run in a private network namespace
(``tf_strategies.isolation``): TensorFlow's servers listen on all interfaces.

Bounds (exit 1 when one is violated, or when a runner other than the two known Keras 3
failures fails):

- ``tfps-sync`` vs ``mirrored``, max abs weight difference (trainable variables): the
  ``ps-parity`` gate, by the compiled optimizer: SGD 0.0 after step 1 and after the last
  step; Adam (and any other optimizer) <= 1e-6 after step 1 and <= 2e-4 after the last.
  The uneven last batch: MirroredStrategy splits every global batch, the partial one
  too, into N contiguous parts, and Keras 3 scales each replica's mean loss by 1/N
  (``scale_loss_for_distribution``), so its step is the mean of the replicas' means;
  tfps weighs each worker's mean by its share, the global batch's mean. The two are the
  same step when every batch divides by N (the check's ``detail`` says so). When some
  batch does not divide, they are different steps by design and the last-step
  difference is reported, not gated (step 1 still is, if the first batch divides).
- ``tfps-async`` vs ``tfk-pss``: validation accuracy (final weights, evaluated the same
  way for every runner) within 0.03.

A sparse gradient (an ``Embedding``'s) that repeats a row within a batch, under an
optimizer for which the two rules give different steps (Adam and its family; measured by
the ``init`` process, ``user_fit.sparse_rule``), makes ``tfps-sync`` vs ``mirrored`` a
difference by design under ``ps-server --sparse-rule sum`` (the default): tfps sums the
occurrences first, Keras 3 applies each. Those checks are then reported, not gated, and
their detail names the rule, the variables and the difference of one step. ``ps-parity
--sparse-rule keras`` (default ``TFPS_SPARSE_RULE``) runs the tfps servers with Keras' rule:
the checks are then gated as for any model, their detail naming the rule tfps ran; the
report's title and ``model.tfps_sparse_rule`` name it either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tf_strategies import isolation
from tf_strategies.common import max_abs_diff

TF_KERAS_VERSION = "2.21.0"
KNOWN_ISSUE = "keras-team/keras#20585"
ACCURACY_GAP = 0.03
SYNC_BOUNDS = {"sgd": (0.0, 0.0), "adam": (1e-6, 2e-4)}  # as ps-parity's gate (tf_strategies.parity)
START_TIMEOUT_S = 60.0
POLL_S = 0.1


@dataclasses.dataclass(frozen=True)
class Runner:
    name: str
    strategy: str  # user_fit --strategy
    legacy: bool = False  # tf_keras
    sync: bool = True
    known_failing: bool = False  # Keras 3 model.fit under this strategy fails upstream
    mode: str = ""  # tfps


RUNNERS = (
    Runner("mirrored", "mirrored"),
    Runner("tfk-mwms", "mwms", legacy=True),
    Runner("tfk-pss", "pss", legacy=True, sync=False),
    Runner("keras-mwms", "mwms", known_failing=True),
    Runner("keras-pss", "pss", sync=False, known_failing=True),
    Runner("tfps-sync", "tfps", mode="sync"),
    Runner("tfps-async", "tfps", sync=False, mode="async"),
)
RUNNER_NAMES = tuple(r.name for r in RUNNERS)


@dataclasses.dataclass
class Outcome:
    runner: str
    status: str = "ok"  # ok | failed | known-failing
    reason: str = ""
    result: dict | None = None
    step1: list | None = None
    final: list | None = None
    seconds: float = 0.0


@dataclasses.dataclass
class Check:
    name: str
    value: float | None
    limit: float | None
    ok: bool
    gated: bool = True
    detail: str = ""


class RunnerFailed(RuntimeError):
    """One line: why the runner did not produce a result."""


# --- tf_keras, installed at run time ------------------------------------------------------


def tf_keras_dir() -> str:
    base = os.environ.get("TFPS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tfps")
    return os.path.join(base, f"tf_keras-{TF_KERAS_VERSION}")


def ensure_tf_keras(timeout: float = 600.0) -> str:
    """The directory to put on PYTHONPATH for tf_keras; installs it once (``--no-deps``). RunnerFailed if pip fails."""
    target = tf_keras_dir()
    marker = os.path.join(target, f"tf_keras-{TF_KERAS_VERSION}.dist-info")
    if os.path.isdir(marker) and os.path.isfile(os.path.join(target, "tf_keras", "__init__.py")):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time; the others reuse its result
        if os.path.isdir(marker):
            return target
        staging = tempfile.mkdtemp(prefix="tf_keras-", dir=os.path.dirname(target))
        try:
            run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-input",
                                  "--disable-pip-version-check", "--target", staging, f"tf_keras=={TF_KERAS_VERSION}"],
                                 capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise RunnerFailed(f"cannot install tf_keras=={TF_KERAS_VERSION}: {type(e).__name__}: {e}") from None
        if run.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            lines = [l for l in (run.stderr + run.stdout).strip().splitlines() if l.strip()]
            raise RunnerFailed(f"cannot install tf_keras=={TF_KERAS_VERSION} (pip exit {run.returncode}): "
                               f"{lines[-1] if lines else 'no output'}")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
    return target


# --- the processes --------------------------------------------------------------------------


def child_env(runner: Runner, tf_keras: str | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_ENABLE_ONEDNN_OPTS="0")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.pop("TF_CONFIG", None)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    paths.append(os.getcwd())  # the user's modules, named as they would be from here
    if runner.legacy:
        env["TF_USE_LEGACY_KERAS"] = "1"
        paths.insert(0, tf_keras)
    else:
        env.pop("TF_USE_LEGACY_KERAS", None)
        paths = [p for p in paths if os.path.abspath(p) != os.path.abspath(tf_keras_dir())]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _tail(path: str, n: int = 8) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip() for l in f if l.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])


def _error_line(out: str, log: str) -> str:
    for name in ("error.txt",):
        path = os.path.join(out, name)
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                text = f.read().strip()
            if text:
                return text.splitlines()[0]
    return _tail(log, 3) or "no output"


class _Procs:
    """Children started here, every one stopped (SIGKILL: TensorFlow's servers catch SIGTERM) on exit."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen, str]] = []

    def start(self, label: str, argv: list[str], env: dict) -> subprocess.Popen:
        log = os.path.join(self.log_dir, label.replace(" ", "") + ".log")
        with open(log, "w") as f:
            p = subprocess.Popen(isolation.dying_with_parent(argv), stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env)
        self.procs.append((label, p, log))
        return p

    def dead(self) -> tuple[str, int, str] | None:
        for label, p, log in self.procs:
            if p.poll() is not None and p.returncode != 0:
                return label, p.returncode, log
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.kill()
        for _, p, _ in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass


def _fit_argv(cfg: dict, strategy: str, out: str, replicas: int) -> list[str]:
    return [sys.executable, "-m", "tf_strategies.user_fit", "--strategy", strategy, "--model", cfg["model"],
            "--dataset", cfg["dataset"], "--epochs", str(cfg["epochs"]), "--replicas", str(replicas),
            "--initial-weights", cfg["initial_weights"], "--seed", str(cfg["seed"]),
            "--intra-op-threads", str(cfg["intra_op_threads"]), "--out", out]


def launch_mwms(cfg: dict, out: str, timeout: float) -> None:
    """N MultiWorkerMirroredStrategy workers on 127.0.0.1 (run inside the namespace)."""
    n = cfg["workers"]
    ports = isolation.free_ports(n)
    env = dict(os.environ)  # child_env, set by run_runner
    deadline = time.monotonic() + timeout
    with _Procs(out) as procs:
        workers = []
        for i in range(n):
            tf_config = {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": i}}
            workers.append(procs.start(f"worker {i}", _fit_argv(cfg, "mwms", os.path.join(out, f"worker{i}"), n),
                                       dict(env, TF_CONFIG=json.dumps(tf_config))))
        while any(p.poll() is None for p in workers):
            failed = [i for i, p in enumerate(workers) if p.poll() not in (None, 0)]
            if failed:
                i = failed[0]
                raise RunnerFailed(f"worker {i}: {_error_line(os.path.join(out, f'worker{i}'), procs.procs[i][2])}")
            if time.monotonic() > deadline:
                raise RunnerFailed(f"MWMS workers did not finish within {timeout:.0f} s: {_tail(procs.procs[0][2], 2)}")
            time.sleep(POLL_S)
        failed = [i for i, p in enumerate(workers) if p.returncode != 0]
        if failed:
            i = failed[0]
            raise RunnerFailed(f"worker {i}: {_error_line(os.path.join(out, f'worker{i}'), procs.procs[i][2])}")


def launch_pss(cfg: dict, out: str, timeout: float) -> None:
    """1 ps and N worker servers, then the chief (coordinator) running model.fit (inside the namespace)."""
    import socket

    n = cfg["workers"]
    ports = isolation.free_ports(2 + n)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"],
               "worker": [f"127.0.0.1:{p}" for p in ports[2:]]}
    env = dict(os.environ)  # child_env, set by run_runner
    spec = json.dumps({"intra_op_threads": cfg["intra_op_threads"], "deterministic": True})
    with _Procs(out) as procs:
        servers = [(job, i) for job in ("ps", "worker") for i in range(len(cluster[job]))]
        for job, i in servers:  # plain tf.distribute.Server tasks: no Keras in them
            procs.start(f"{job} {i}", [sys.executable, "-m", "tf_strategies.pss", "--role", job, "--index", str(i),
                                       "--cluster", json.dumps(cluster), "--spec-json", spec], env)
        deadline = time.monotonic() + START_TIMEOUT_S
        for (job, i), (label, p, log) in zip(servers, procs.procs):
            port = int(cluster[job][i].rsplit(":", 1)[1])
            while True:
                if p.poll() is not None:
                    raise RunnerFailed(f"{label} exited with {p.returncode} before serving: {_tail(log, 2)}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                    break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RunnerFailed(f"{label} did not listen within {START_TIMEOUT_S:.0f} s")
                time.sleep(POLL_S)
        tf_config = {"cluster": cluster, "task": {"type": "chief", "index": 0}}
        chief = procs.start("chief", _fit_argv(cfg, "pss", os.path.join(out, "chief"), n),
                            dict(env, TF_CONFIG=json.dumps(tf_config)))
        deadline = time.monotonic() + timeout
        while chief.poll() is None:
            for label, p, log in procs.procs[:-1]:
                if p.poll() is not None:
                    raise RunnerFailed(f"{label} exited with {p.returncode}: {_tail(log, 2)}")
            if time.monotonic() > deadline:
                raise RunnerFailed(f"the chief did not finish within {timeout:.0f} s: {_tail(procs.procs[-1][2], 2)}")
            time.sleep(POLL_S)
        if chief.returncode != 0:
            raise RunnerFailed(f"chief: {_error_line(os.path.join(out, 'chief'), procs.procs[-1][2])}")


def _launcher_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tf_strategies.user_parity --launch")
    p.add_argument("--launch", choices=("mwms", "pss"), required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    try:
        (launch_mwms if args.launch == "mwms" else launch_pss)(json.loads(args.config), args.out, args.timeout)
    except RunnerFailed as e:
        with open(os.path.join(args.out, "launch-error.txt"), "w") as f:
            f.write(str(e) + "\n")
        print(f"user_parity: {e}", file=sys.stderr)
        return 1
    return 0


def run_runner(runner: Runner, cfg: dict, work: str, timeout: float) -> Outcome:
    from tf_strategies import user_fit

    started = time.monotonic()
    out = os.path.join(work, runner.name)
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "runner.log")
    try:
        env = child_env(runner, ensure_tf_keras() if runner.legacy else None)
        if runner.strategy == "mirrored":
            argv, chief_dir = _fit_argv(cfg, "mirrored", out, cfg["workers"]), out
        elif runner.strategy in ("mwms", "pss"):
            argv, _ = isolation.isolated([sys.executable, "-m", "tf_strategies.user_parity", "--launch",
                                          runner.strategy, "--config", json.dumps(cfg), "--out", out,
                                          "--timeout", str(timeout)])
            chief_dir = os.path.join(out, "worker0" if runner.strategy == "mwms" else "chief")
        else:
            import importlib.util

            try:
                found = importlib.util.find_spec("tfps.keras") is not None
            except ImportError:
                found = False
            if not found:
                raise RunnerFailed("tfps.keras is not importable here (the Keras integration is not installed)")
            argv = [sys.executable, "-m", "ps_tools.launch", "--mode", runner.mode, "--workers", str(cfg["workers"]),
                    "--", *_fit_argv(cfg, "tfps", out, cfg["workers"])]
            env["TFPS_SPARSE_RULE"] = cfg.get("sparse_rule", "sum")  # the server's (ps-launch passes it on)
            chief_dir = out
        with open(log, "w") as f:
            try:
                done = subprocess.run(isolation.dying_with_parent(argv), stdout=f, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, timeout=timeout + 60)
            except subprocess.TimeoutExpired:
                raise RunnerFailed(f"timed out after {timeout + 60:.0f} s") from None
        if done.returncode != 0:
            launch_error = os.path.join(out, "launch-error.txt")
            if os.path.isfile(launch_error):
                with open(launch_error) as f:
                    raise RunnerFailed(f.read().strip())
            raise RunnerFailed(f"exit {done.returncode}: {_error_line(chief_dir, log)}")
        result, step1, final = user_fit.load(chief_dir)
        if runner.strategy == "mwms":  # every worker must end where the chief did
            for i in range(1, cfg["workers"]):
                _, _, other = user_fit.load(os.path.join(out, f"worker{i}"))
                if max_abs_diff(final, other) != 0.0:
                    raise RunnerFailed(f"worker {i}'s final weights differ from the chief's")
            result["notes"] += "; every worker's final weights identical"
        if not runner.sync:
            step1 = None  # asynchronous: no step to compare
    except RunnerFailed as e:
        status = "known-failing" if runner.known_failing else "failed"
        return Outcome(runner.name, status=status, reason=str(e), seconds=time.monotonic() - started)
    return Outcome(runner.name, result=result, step1=step1, final=final, seconds=time.monotonic() - started)


# --- comparing ------------------------------------------------------------------------------


def bounds_for(optimizer: str) -> tuple[tuple[float, float], str]:
    key = optimizer.lower()
    if key in SYNC_BOUNDS:
        return SYNC_BOUNDS[key], key
    return SYNC_BOUNDS["adam"], f"{optimizer}: Adam's bounds (the gate has none of its own)"


def compare(info: dict, workers: int, outcomes: dict[str, Outcome]) -> tuple[dict, list[Check]]:
    diffs: dict[str, dict] = {}
    ref = outcomes.get("mirrored")
    for name, o in outcomes.items():
        if name == "mirrored" or o.final is None or o.step1 is None or ref is None or ref.final is None:
            continue
        diffs[name] = {"step1": max_abs_diff(o.step1, ref.step1) if ref.step1 is not None else None,
                       "final": max_abs_diff(o.final, ref.final)}
    checks: list[Check] = []
    for name, o in outcomes.items():
        if o.status == "failed":
            checks.append(Check(f"{name} finished", None, None, False, detail=o.reason))
    (step1_limit, final_limit), which = bounds_for(info["optimizer"])
    sizes = info["batch_sizes"]
    uneven = [i for i, n in enumerate(sizes) if n % workers]
    steps = len(sizes) * info["epochs"]
    if "tfps-sync" in outcomes and "mirrored" in outcomes:
        label = "tfps-sync vs mirrored"
        if "tfps-sync" not in diffs:
            missing = [n for n in ("mirrored", "tfps-sync") if outcomes[n].result is None]
            checks.append(Check(label, None, None, False, detail=f"runner(s) {', '.join(missing)} did not finish"))
        else:
            d = diffs["tfps-sync"]
            first_even = sizes[0] % workers == 0
            checks.append(Check(f"{label}, step 1", d["step1"], step1_limit,
                                d["step1"] <= step1_limit if first_even else True, gated=first_even,
                                detail=which if first_even else "the first batch does not divide by N: not gated"))
            if not uneven:
                detail = (f"{which}; every global batch (the last, {sizes[-1]} examples, too) divides into {workers} "
                          "equal shards, so MirroredStrategy's mean of replica means is the global mean")
                checks.append(Check(f"{label}, step {steps}", d["final"], final_limit, d["final"] <= final_limit,
                                    detail=detail))
            else:
                detail = (f"batch(es) {', '.join(str(i) for i in uneven[:5])} of each epoch ({sizes[uneven[0]]} "
                          f"examples) do not divide by {workers}: MirroredStrategy averages the replicas' means with "
                          "weight 1/N, tfps weighs them by shard size; reported, not gated")
                checks.append(Check(f"{label}, step {steps}", d["final"], final_limit, True, gated=False,
                                    detail=detail))
    checks = _sparse_rule_checks(info, checks)
    if "tfps-async" in outcomes and "tfk-pss" in outcomes:
        label = "tfps-async vs tfk-pss val accuracy gap"
        a, b = outcomes["tfps-async"].result, outcomes["tfk-pss"].result
        if a is None or b is None:
            missing = [n for n, r in (("tfps-async", a), ("tfk-pss", b)) if r is None]
            checks.append(Check(label, None, ACCURACY_GAP, False, detail=f"runner(s) {', '.join(missing)} did not finish"))
        elif a["val_accuracy"] is None or b["val_accuracy"] is None:
            checks.append(Check(label, None, ACCURACY_GAP, False, detail="the model has no accuracy metric"))
        else:
            gap = abs(a["val_accuracy"] - b["val_accuracy"])
            checks.append(Check(label, gap, ACCURACY_GAP, gap <= ACCURACY_GAP))
    return diffs, checks


def _sparse_rule_checks(info: dict, checks: list[Check]) -> list[Check]:
    """The ``tfps-sync vs`` checks where a sparse gradient repeats rows (``info["sparse_rule"]``,
    measured by the init process): with ``--sparse-rule sum`` an expected difference, named,
    not gated; with ``keras`` tfps ran Keras' own rule, so the gate holds as for any model,
    and the detail says so."""
    rule, ran = info.get("sparse_rule"), info.get("tfps_sparse_rule", "sum")
    if not rule:
        return checks
    variables = ", ".join(rule["variables"])
    if ran == "keras":
        note = (f"the sparse rule: {variables} repeat rows in a batch; tfps ran --sparse-rule keras, applying "
                "each occurrence as Keras 3 does: gated (docs/sparse.md)")
        return [dataclasses.replace(c, detail=f"{c.detail}; {note}" if c.detail else note)
                if c.name.startswith("tfps-sync vs") else c for c in checks]
    note = (f"the sparse rule: {variables} repeat rows in a batch; tfps ran --sparse-rule sum, summing a row's "
            f"occurrences before the optimizer step (TF1, ElasticDL), Keras 3 applies each occurrence "
            f"({rule['optimizer']}: one step differs by {_fmt(rule['step_difference'])}); reported, not gated; "
            "ps-parity --sparse-rule keras runs Keras' rule (docs/sparse.md)")
    return [dataclasses.replace(c, ok=True, gated=False, detail=note) if c.name.startswith("tfps-sync vs")
            else c for c in checks]


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if x == 0:
        return "0.0"
    return f"{x:.2e}" if abs(x) < 1e-2 else f"{x:.4f}"


def table(outcomes: dict[str, Outcome], diffs: dict) -> str:
    header = (f"{'runner':<11} {'final loss':>10} {'val acc':>8} {'vs mirrored step 1':>19} "
              f"{'vs mirrored last':>17} {'wall s':>7}  notes")
    rows = [header, "-" * len(header)]
    for name, o in outcomes.items():
        if o.result is None:
            rows.append(f"{name:<11} {o.status.upper()}: {o.reason}")
            continue
        r, d = o.result, diffs.get(name, {})
        loss = r["history"].get("loss", [float("nan")])[-1]
        rows.append(f"{name:<11} {loss:>10.4f} {_fmt(r['val_accuracy']):>8} {_fmt(d.get('step1')):>19} "
                    f"{_fmt(d.get('final')):>17} {o.seconds:>7.1f}  {r['keras']}; {r['notes']}")
    return "\n".join(rows)


def plot(path: str, outcomes: dict[str, Outcome], title: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, o in outcomes.items():
        if o.result is None:
            continue
        losses = o.result["history"].get("loss", [])
        style = "-" if RUNNERS[RUNNER_NAMES.index(name)].sync else "--"
        ax.plot(range(1, len(losses) + 1), losses, style, marker="o", label=name, linewidth=1.4, alpha=0.85)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("epoch (identical sync runners overlap)")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("training loss (History, epoch mean)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(args: argparse.Namespace, info: dict, workers: int) -> str:
    sizes = info["batch_sizes"]
    return (f"{args.model}: {info['optimizer']}, {info['parameters']} parameters, {workers} workers, "
            f"{len(sizes)} global batches/epoch (last {sizes[-1]} of {sizes[0]}), {args.epochs} epochs, "
            f"tfps --sparse-rule {args.sparse_rule}")


def main_user(args: argparse.Namespace) -> int:
    """``ps-parity --model M --dataset D --workers N [--epochs E] [--runners ...]`` (parity.py's flags)."""
    if not args.dataset or ":" not in args.dataset:
        print("ps-parity: error: with --model, --dataset must be module:function too", file=sys.stderr)
        return 2
    workers = args.workers
    if not 2 <= workers <= 4:
        print(f"ps-parity: error: --workers must be 2 to 4 with --model, got {workers}", file=sys.stderr)
        return 2
    if args.epochs < 1:
        print("ps-parity: error: --epochs must be >= 1", file=sys.stderr)
        return 2
    names = [n.strip() for n in (args.runners or ",".join(RUNNER_NAMES)).split(",") if n.strip()]
    bad = [n for n in names if n not in RUNNER_NAMES]
    if bad or not names:
        print(f"ps-parity: error: unknown runner: {', '.join(bad) or 'none given'} "
              f"(with --model: {', '.join(RUNNER_NAMES)})", file=sys.stderr)
        return 2
    runners = [r for r in RUNNERS if r.name in names]
    started = time.monotonic()
    report: dict = {"config": {k: v for k, v in vars(args).items()}, "runners": {}, "checks": [], "ok": False}
    with tempfile.TemporaryDirectory(prefix="ps-parity-user-") as work:
        cfg = {"model": args.model, "dataset": args.dataset, "epochs": args.epochs, "workers": workers,
               "seed": args.seed, "intra_op_threads": args.intra_op_threads, "sparse_rule": args.sparse_rule,
               "initial_weights": os.path.join(work, "init", "initial.npz")}
        init_out = os.path.join(work, "init")
        argv = _fit_argv(cfg, "init", init_out, workers)
        print("ps-parity: building the model and reading the dataset once ...", file=sys.stderr, flush=True)
        made = subprocess.run(isolation.dying_with_parent(argv), capture_output=True, text=True, timeout=args.timeout,
                              env=child_env(RUNNERS[0]), stdin=subprocess.DEVNULL)
        if made.returncode != 0:
            print(f"ps-parity: error: cannot build the model or the dataset: "
                  f"{_error_line(init_out, '') or made.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        with open(os.path.join(init_out, "dataset.json")) as f:
            info = json.load(f)
        info["epochs"] = args.epochs
        info["tfps_sparse_rule"] = args.sparse_rule
        sizes = info["batch_sizes"]
        outcomes: dict[str, Outcome] = {}
        for runner in runners:
            print(f"ps-parity: running {runner.name} ...", file=sys.stderr, flush=True)
            outcomes[runner.name] = o = run_runner(runner, cfg, work, args.timeout)
            print(f"ps-parity: {runner.name} {o.status} in {o.seconds:.1f} s" + (f": {o.reason}" if o.reason else ""),
                  file=sys.stderr, flush=True)
    diffs, checks = compare(info, workers, outcomes)
    title = _title(args, info, workers)
    print(f"\n== {title} ==")
    print(table(outcomes, diffs))
    report.update(
        model={"optimizer": info["optimizer"], "optimizer_config": info["optimizer_config"],
               "parameters": info["parameters"], "batch_sizes": sizes, "epochs": args.epochs, "workers": workers,
               "tfps_sparse_rule": args.sparse_rule, "repeated_rows": info.get("sparse_rule")},
        runners={n: {"status": o.status, "reason": o.reason, "seconds": o.seconds,
                     **({"final_loss": o.result["history"].get("loss", [None])[-1],
                         "val_accuracy": o.result["val_accuracy"], "val_loss": o.result["val_loss"],
                         "history": o.result["history"], "keras": o.result["keras"], "notes": o.result["notes"],
                         "fit_s": o.result["fit_s"]} if o.result else {}),
                     **({"vs_mirrored": diffs[n]} if n in diffs else {})}
                 for n, o in outcomes.items()},
        checks=[dataclasses.asdict(c) for c in checks],
    )
    report["ok"] = all(c.ok for c in checks)
    report["wall_s"] = time.monotonic() - started
    print("\nchecks:")
    for c in checks:
        verdict = ("PASS" if c.ok else "FAIL") if c.gated else "INFO"
        print(f"  {verdict}  {c.name}: {_fmt(c.value)} (limit {_fmt(c.limit)})" + (f"; {c.detail}" if c.detail else ""))
    if not checks:
        print("  (no bound applies to the runners chosen)")
    for n, o in outcomes.items():
        if o.status == "known-failing":
            print(f"  KNOWN  {n}: Keras 3 model.fit under this strategy fails ({KNOWN_ISSUE}): {o.reason}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    if args.plot:
        plot(args.plot, outcomes, title)
    print(f"\nps-parity: {'all bounds hold' if report['ok'] else 'PARITY VIOLATED'} ({report['wall_s']:.0f} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(_launcher_main(sys.argv[1:]))
