"""``ps-parity``: the same training under TensorFlow's strategies and ours, compared number by number.

    ps-parity --steps 20 --optimizer adam --json-out p.json --plot p.png

For each model (the tutorial ``cnn`` and a ~1M-parameter ``mlp``), it writes one
set of initial weights and runs every runner from it on the same global batches:

- sync runners, ``--steps`` global steps: ``oracle`` (one process, no strategy:
  hand-written per-replica GradientTape steps and a Keras optimizer),
  ``mirrored`` (MirroredStrategy over 2 logical CPUs), ``mwms``
  (MultiWorkerMirroredStrategy, 2 processes) and ``ours-sync``;
- async runners, ``--async-epochs`` epochs (training quality is what they are
  compared on): ``pss-1ps`` / ``pss-2ps`` (ParameterServerStrategy with a
  ClusterCoordinator, 2 workers, 1 or 2 PS tasks, variables sharded by a
  partitioner with 2) and ``ours-async``.

It prints a table (final loss, test accuracy, steps/s; for each sync runner the
max abs weight difference from the oracle and from MirroredStrategy after step 1
and after the last step), writes the numbers as JSON and the loss curves as one
PNG, and exits 1 when a bound is violated or a runner needed for one failed:

- ours-sync vs mirrored and vs mwms: SGD bit-identical (0.0) after step 1 and
  step K; Adam <= 1e-6 after step 1 and <= 2e-4 after step K;
- ours-async vs each PSS run: test accuracy within 0.03, both >= 0.85 (digits).

``--inject-wrong-scaling`` makes TensorFlow's runners average per-replica means
(the classic scaling bug) so a user can see the check fail. TensorFlow's
multi-process runners run in a private network namespace where possible
(``tf_strategies.isolation``): their servers listen on all interfaces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time

from tf_strategies.common import RunResult, RunSpec, load_result, max_abs_diff
from tf_strategies.isolation import dying_with_parent, isolated
from worker.data import load_dataset, steps_per_epoch

MODELS = ("cnn", "mlp")


@dataclasses.dataclass(frozen=True)
class Runner:
    name: str
    module: str
    extra: tuple[str, ...] = ()
    sync: bool = True
    tensorflow_servers: bool = False  # TensorFlow gRPC servers: isolate the network
    honours_loss_scaling: bool = True  # --inject-wrong-scaling applies to it


RUNNERS = (
    Runner("oracle", "tf_strategies.oracle"),
    Runner("mirrored", "tf_strategies.mirrored"),
    Runner("mwms", "tf_strategies.mwms", tensorflow_servers=True),
    Runner("ours-sync", "tf_strategies.ours", ("--mode", "sync"), honours_loss_scaling=False),
    # --inject-wrong-scaling is a check of the sync comparison; the async runners keep the right rule.
    Runner("pss-1ps", "tf_strategies.pss", ("--num-ps", "1"), sync=False, tensorflow_servers=True,
           honours_loss_scaling=False),
    Runner("pss-2ps", "tf_strategies.pss", ("--num-ps", "2"), sync=False, tensorflow_servers=True,
           honours_loss_scaling=False),
    Runner("ours-async", "tf_strategies.ours", ("--mode", "async"), sync=False, honours_loss_scaling=False),
)
RUNNER_NAMES = tuple(r.name for r in RUNNERS)

SYNC_BOUNDS = {"sgd": (0.0, 0.0), "adam": (1e-6, 2e-4)}  # (after step 1, after step K)
ACCURACY_GAP = 0.03
ACCURACY_FLOOR = 0.85


@dataclasses.dataclass
class Outcome:
    runner: str
    result: RunResult | None = None
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""


@dataclasses.dataclass
class Check:
    name: str
    value: float | None
    limit: float
    ok: bool
    detail: str = ""


def run_one(runner: Runner, spec: RunSpec, out_dir: str, timeout: float) -> Outcome:
    argv = [sys.executable, "-m", runner.module, "--spec-json", spec.to_json(), "--out", out_dir, *runner.extra]
    note = ""
    if runner.tensorflow_servers:
        argv, note = isolated(argv)
    try:
        run = subprocess.run(dying_with_parent(argv), capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Outcome(runner.name, status="failed", reason=f"timed out after {timeout:g} s")
    if run.returncode == 3:
        lines = [l for l in run.stderr.splitlines() if "cannot start" in l] or run.stderr.splitlines()[-1:]
        return Outcome(runner.name, status="unavailable", reason=lines[-1] if lines else "cannot start")
    if run.returncode != 0:
        tail = " | ".join(run.stderr.strip().splitlines()[-4:])
        return Outcome(runner.name, status="failed", reason=f"exit {run.returncode}: {tail}")
    result = load_result(out_dir)
    if note and runner.tensorflow_servers:
        result.notes = (result.notes + "; " if result.notes else "") + note
    return Outcome(runner.name, result=result)


def compare(model: str, spec: RunSpec, outcomes: dict[str, Outcome]) -> tuple[dict, list[Check]]:
    """Weight differences between sync runners, and every bound as a Check."""
    diffs: dict[str, dict] = {}
    res = {k: o.result for k, o in outcomes.items() if o.result is not None}
    for name, r in res.items():
        if r.weights_step1 is None:
            continue
        row = {}
        for ref in ("oracle", "mirrored"):
            if ref in res and res[ref].weights_step1 is not None and ref != name:
                row[f"vs_{ref}"] = {
                    "step1": max_abs_diff(r.weights_step1, res[ref].weights_step1),
                    "final": max_abs_diff(r.weights_final, res[ref].weights_final),
                }
        diffs[name] = row

    checks: list[Check] = []
    for name, o in outcomes.items():
        if o.status == "failed":  # crashed or hung: never a pass ("unavailable" only says why it cannot run here)
            checks.append(Check(f"{model}: {name} finished", None, 0.0, False, o.reason))
    step1_limit, final_limit = SYNC_BOUNDS[spec.optimizer]
    for ref in ("mirrored", "mwms"):
        if ref not in outcomes or "ours-sync" not in outcomes:
            continue  # the user did not ask for this pair
        label = f"{model}: ours-sync vs {ref}"
        if ref not in res or "ours-sync" not in res:
            missing = [n for n in (ref, "ours-sync") if n not in res]
            checks.append(Check(label, None, 0.0, False, f"runner(s) {', '.join(missing)} did not finish"))
            continue
        d1 = max_abs_diff(res["ours-sync"].weights_step1, res[ref].weights_step1)
        dk = max_abs_diff(res["ours-sync"].weights_final, res[ref].weights_final)
        checks.append(Check(f"{label}, step 1", d1, step1_limit, d1 <= step1_limit))
        checks.append(Check(f"{label}, step {spec.steps}", dk, final_limit, dk <= final_limit))
    for pss in ("pss-1ps", "pss-2ps"):
        if pss not in outcomes or "ours-async" not in outcomes:
            continue
        label = f"{model}: ours-async vs {pss} test accuracy"
        if pss not in res or "ours-async" not in res:
            missing = [n for n in (pss, "ours-async") if n not in res]
            checks.append(Check(label, None, ACCURACY_GAP, False, f"runner(s) {', '.join(missing)} did not finish"))
            continue
        a, b = res["ours-async"].test_accuracy, res[pss].test_accuracy
        checks.append(Check(f"{label} gap", abs(a - b), ACCURACY_GAP, abs(a - b) <= ACCURACY_GAP))
        if spec.dataset == "digits":
            for who, acc in (("ours-async", a), (pss, b)):
                label = f"{model}: {who} test accuracy floor"
                if not any(c.name == label for c in checks):
                    checks.append(Check(label, acc, ACCURACY_FLOOR, acc >= ACCURACY_FLOOR,
                                        "value is the accuracy; it must be at least the limit"))
    return diffs, checks


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0.0"
    return f"{x:.2e}" if abs(x) < 1e-2 else f"{x:.4f}"


def print_table(model: str, spec: RunSpec, async_steps: int, outcomes: dict[str, Outcome], diffs: dict) -> None:
    print(f"\n== {model}: {spec.optimizer} lr {spec.lr:g}, global batch {spec.global_batch_size}, "
          f"{spec.num_workers} workers, {spec.dataset}; sync runners {spec.steps} steps, "
          f"async runners {async_steps} steps ==")
    header = f"{'runner':<11} {'final loss':>10} {'test acc':>8} {'steps/s':>8}  {'vs oracle 1 / K':>21}  {'vs mirrored 1 / K':>21}"
    print(header)
    print("-" * len(header))
    for name, o in outcomes.items():
        if o.result is None:
            print(f"{name:<11} {o.status}: {o.reason}")
            continue
        r = o.result
        d = diffs.get(name, {})
        cols = []
        for ref in ("vs_oracle", "vs_mirrored"):
            if ref in d:
                cols.append(f"{_fmt(d[ref]['step1'])} / {_fmt(d[ref]['final'])}")
            else:
                cols.append("-")
        loss = r.losses[-1] if r.losses else float("nan")
        print(f"{name:<11} {loss:>10.4f} {r.test_accuracy:>8.4f} {r.steps_per_s:>8.1f}  {cols[0]:>21}  {cols[1]:>21}")


def plot(path: str, curves: dict[str, dict[str, tuple[list[int], list[float]]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(7 * len(curves), 4.5), squeeze=False)
    for ax, (model, lines) in zip(axes[0], curves.items()):
        for name, (xs, ys) in lines.items():
            style = "-" if not name.startswith(("pss", "ours-async")) else "--"
            ax.plot(xs, ys, style, label=name, linewidth=1.4, alpha=0.85)
        ax.set_title(f"{model}: training loss per step (identical sync runners overlap)")
        ax.set_xlabel("training examples consumed")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _curve(r: RunResult, spec: RunSpec, sync: bool) -> tuple[list[int], list[float]]:
    per_update = spec.global_batch_size if sync else spec.global_batch_size / spec.num_workers
    xs = [int(round((i + 1) * per_update)) for i in range(len(r.losses))]
    return xs, list(r.losses)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ps-parity", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="global steps of the sync runners (default 20)")
    p.add_argument("--optimizer", choices=tuple(SYNC_BOUNDS), default="adam", help="default adam")
    p.add_argument("--learning-rate", type=float, default=0.0, help="default: Keras' (0.01 sgd, 0.001 adam)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: cnn, mlp (default both)")
    p.add_argument("--runners", default=None, help=f"comma-separated subset of {', '.join(RUNNER_NAMES)} "
                   "(default all; with --model: of tf_strategies.user_parity.RUNNER_NAMES)")
    p.add_argument("--dataset", default=None,
                   help="digits (default), mnist or synthetic; with --model, module:function of your datasets")
    p.add_argument("--model", help="module:function returning your compiled Keras model: parity of your own "
                   "model.fit (tf_strategies.user_parity; --dataset, --workers, --epochs, --runners apply)")
    p.add_argument("--workers", type=int, default=2, help="with --model: workers/replicas, 2 to 4 (default 2)")
    p.add_argument("--epochs", type=int, default=3, help="with --model: epochs of model.fit (default 3)")
    p.add_argument("--sparse-rule", choices=("sum", "keras"), default=os.environ.get("TFPS_SPARSE_RULE") or "sum",
                   help="with --model: the tfps runners' ps-server --sparse-rule (docs/sparse.md; default "
                   "TFPS_SPARSE_RULE, else sum)")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--async-epochs", type=int, default=3, help="epochs of the async runners (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--intra-op-threads", type=int, default=1,
                   help="TensorFlow intra-op threads in every process (bits depend on it; default 1)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per runner (default 1200)")
    p.add_argument("--inject-wrong-scaling", action="store_true",
                   help="TensorFlow's runners average per-replica means (a scaling bug): the check must fail")
    p.add_argument("--json-out", help="write every number here")
    p.add_argument("--plot", help="write the loss curves of every runner here (PNG)")
    return p


def _runner_report(o: Outcome, diffs: dict) -> dict:
    """One runner's entry in the report: how it ended, its figures, its differences."""
    figures = {} if o.result is None else {
        "final_loss": o.result.losses[-1] if o.result.losses else None,
        "test_accuracy": o.result.test_accuracy,
        "steps_per_s": o.result.steps_per_s,
        "examples": o.result.examples,
        "wall_s": o.result.wall_s,
        "steps": len(o.result.losses),
        "notes": o.result.notes,
        "losses": o.result.losses,
    }
    return {"status": o.status, "reason": o.reason, **figures, **diffs}


def _print_checks(checks: list[dict]) -> None:
    print("\nchecks:")
    for c in checks:
        verdict = "PASS" if c["ok"] else "FAIL"
        value = _fmt(c["value"])
        print(f"  {verdict}  {c['name']}: {value} (limit {_fmt(c['limit'])})"
              + (f" {c['detail']}" if c["detail"] and not c["ok"] else ""))
    if not checks:
        print("  (no bound applies to the runners chosen)")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.model:
        from tf_strategies.user_parity import main_user

        return main_user(args)
    args.dataset = args.dataset or "digits"
    args.runners = args.runners or ",".join(RUNNER_NAMES)
    if args.dataset not in ("digits", "mnist", "synthetic"):
        print(f"ps-parity: error: --dataset must be digits, mnist or synthetic without --model, got {args.dataset!r}",
              file=sys.stderr)
        return 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    names = [r.strip() for r in args.runners.split(",") if r.strip()]
    bad = [m for m in models if m not in MODELS] + [n for n in names if n not in RUNNER_NAMES]
    if bad or not models or not names:
        print(f"ps-parity: error: unknown model or runner: {', '.join(bad) or 'none given'}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.async_epochs < 1:
        print("ps-parity: error: --steps and --async-epochs must be >= 1", file=sys.stderr)
        return 2
    runners = [r for r in RUNNERS if r.name in names]
    n_train = len(load_dataset(args.dataset).y_train)
    async_steps = args.async_epochs * steps_per_epoch(n_train, args.global_batch_size)

    report = {"config": {k: v for k, v in vars(args).items()}, "models": {}, "checks": [], "ok": True}
    curves: dict[str, dict] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ps-parity-") as tmp:
        for model in models:
            init = os.path.join(tmp, f"{model}-initial.npz")
            base = RunSpec(model=model, dataset=args.dataset, steps=args.steps, global_batch_size=args.global_batch_size,
                           optimizer=args.optimizer, learning_rate=args.learning_rate, seed=args.seed,
                           intra_op_threads=args.intra_op_threads, initial_weights=init)
            made = subprocess.run(
                [sys.executable, "-c", "import sys; from tf_strategies.common import RunSpec, write_initial_weights; "
                 "write_initial_weights(RunSpec.from_json(sys.argv[1]), sys.argv[2])", base.to_json(), init],
                capture_output=True, text=True, timeout=300)
            if made.returncode != 0:
                print(f"ps-parity: error: cannot build the {model} model: {made.stderr.strip().splitlines()[-1:]}",
                      file=sys.stderr)
                return 1
            outcomes: dict[str, Outcome] = {}
            for runner in runners:
                spec = base
                if not runner.sync:
                    spec = dataclasses.replace(spec, steps=async_steps)
                if args.inject_wrong_scaling and runner.honours_loss_scaling:
                    spec = dataclasses.replace(spec, loss_scaling="wrong-local-mean")
                t = time.monotonic()
                print(f"ps-parity: {model}: running {runner.name} ...", file=sys.stderr, flush=True)
                outcomes[runner.name] = o = run_one(runner, spec, os.path.join(tmp, f"{model}-{runner.name}"), args.timeout)
                print(f"ps-parity: {model}: {runner.name} {o.status} in {time.monotonic() - t:.1f} s"
                      + (f": {o.reason}" if o.reason else ""), file=sys.stderr, flush=True)
            diffs, checks = compare(model, base, outcomes)
            print_table(model, base, async_steps, outcomes, diffs)
            curves[model] = {n: _curve(o.result, base, r.sync) for r in runners
                             for n, o in [(r.name, outcomes[r.name])] if o.result is not None}
            report["models"][model] = {"runners": {n: _runner_report(o, diffs.get(n, {}))
                                                   for n, o in outcomes.items()}}
            report["checks"] += [dataclasses.asdict(c) for c in checks]
    report["ok"] = all(c["ok"] for c in report["checks"])
    report["wall_s"] = time.monotonic() - started
    _print_checks(report["checks"])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    if args.plot:
        plot(args.plot, curves)
    print(f"\nps-parity: {'all bounds hold' if report['ok'] else 'PARITY VIOLATED'} ({report['wall_s']:.0f} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
