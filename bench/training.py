"""Training benchmark: examples/s of ours against TensorFlow's own strategies,
2 workers, the same model and global batch, in one run.

    python bench/training.py --models cnn,mlp25m --steps cnn=600,mlp25m=60 --json-out training.json

For each model (``cnn``, the tutorial CNN, 0.2M parameters; ``mlp25m``, a
25.3M-parameter MLP, ``worker.model``) it trains with the runners of
``ps-parity`` (``tf_strategies``), each as fresh processes on 127.0.0.1:

- ``mwms``: ``tf.distribute.MultiWorkerMirroredStrategy``, 2 worker processes;
- ``ours-sync``: a ``ps-server --mode sync`` and 2 ``ps-worker`` processes;
- ``pss``: ``tf.distribute.ParameterServerStrategy``, 1 ps task, 2 workers and
  the coordinator (``tf_strategies.pss.run(spec, num_ps=1)``);
- ``ours-async``: a ``ps-server --mode async`` and 2 ``ps-worker`` processes;
- ``ours-sync-shm``, ``ours-async-shm``: the same with ``ps-worker --shm``, the
  same-host fast path (tensors through shared memory, gRPC for control); every
  process here is on one host, which is where that path applies.

All of them get the same ``RunSpec``: the ``digits`` data, ``--steps`` global
batches of ``--global-batch-size`` examples split into 2 shards, the optimizer
of ``--optimizer``, one intra-op thread per process, oneDNN off and op
determinism on (the parity settings), and every process is started with the
tuned allocator (``protos.wire.ALLOCATOR_ENV``, which ``ps-launch`` uses).
TensorFlow's runners run in a private network namespace where possible
(``tf_strategies.isolation``).

A TensorFlow runner that fails to start is retried once (its first failure is
kept in the JSON as ``retried_after``); ours never are.

examples/s = training examples consumed / training time, as each runner
measures it: from its first step (tracing included) to its last, without
process start-up and the final evaluation (``RunResult.steps_per_s``). It
prints them and the ratios ours-sync / mwms and ours-async / pss per model,
each pair from the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from protos import wire  # noqa: E402
from tf_strategies import parity  # noqa: E402
from tf_strategies.common import RunSpec  # noqa: E402
from worker.model import MODELS  # noqa: E402

RUNNERS = {"mwms": "mwms", "ours-sync": "ours-sync", "ours-sync-shm": "ours-sync-shm", "pss": "pss-1ps",
           "ours-async": "ours-async", "ours-async-shm": "ours-async-shm"}
PAIRS = (("ours-sync", "mwms"), ("ours-sync-shm", "mwms"), ("ours-async", "pss"), ("ours-async-shm", "pss"))
# Not in ps-parity's matrix: the fast path computes the same as the streams (tests/service/test_shm.py).
_SHM_RUNNERS = (
    parity.Runner("ours-sync-shm", "tf_strategies.ours", ("--mode", "sync", "--shm"), honours_loss_scaling=False),
    parity.Runner("ours-async-shm", "tf_strategies.ours", ("--mode", "async", "--shm"), sync=False,
                  honours_loss_scaling=False),
)
DEFAULT_STEPS = {"tiny": 600, "deepcnn": 600, "cnn": 600, "mlp": 200, "mlp25m": 60}


def parse_steps(text: str, models: list[str]) -> dict[str, int]:
    """``"40"`` (every model) or ``"cnn=200,mlp25m=30"`` (the rest keep their defaults)."""
    if "=" not in text:
        return {m: int(text) for m in models}
    steps = {m: DEFAULT_STEPS[m] for m in models}
    for item in text.split(","):
        model, _, n = item.partition("=")
        if model not in steps:
            raise ValueError(f"--steps names {model!r}, which is not in --models")
        steps[model] = int(n)
    return steps


def run_model(spec: RunSpec, workdir: str) -> dict:
    """Every runner on ``spec`` (examples/s, or the reason it failed) and the ratios."""
    by_name = {r.name: r for r in (*parity.RUNNERS, *_SHM_RUNNERS)}
    out: dict[str, dict] = {}
    for label, name in RUNNERS.items():
        runner = by_name[name]
        outcome = parity.run_one(runner, spec, os.path.join(workdir, f"{spec.model}-{label}"),
                                 timeout=900 + 30 * spec.steps)
        retried = ""
        if outcome.result is None and runner.tensorflow_servers:
            # TensorFlow's cluster start-up now and then fails on a loaded machine (seen once:
            # PSS's chief "Malformed device specification" in RunComponentFunction): once more.
            retried = f"{outcome.status}: {outcome.reason[:300]}"
            print(f"{spec.model}/{label}: retrying once after {retried}", file=sys.stderr)
            outcome = parity.run_one(runner, spec, os.path.join(workdir, f"{spec.model}-{label}-again"),
                                     timeout=900 + 30 * spec.steps)
        r = outcome.result
        if r is None:
            out[label] = {"status": outcome.status, "reason": outcome.reason}
            print(f"{spec.model}/{label}: {outcome.status}: {outcome.reason}", file=sys.stderr)
            continue
        train_s = spec.steps / r.steps_per_s
        out[label] = {"status": "ok", "examples": r.examples, "train_s": train_s,
                      "examples_per_s": r.examples / train_s, "wall_s": r.wall_s,
                      "test_accuracy": r.test_accuracy, "notes": r.notes, "retried_after": retried}
    ratios = {f"{ours}/{theirs}": out[ours]["examples_per_s"] / out[theirs]["examples_per_s"]
              for ours, theirs in PAIRS if out[ours]["status"] == out[theirs]["status"] == "ok"}
    return {"spec": json.loads(spec.to_json()), "runners": out, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,mlp25m", help=f"comma-separated, of {', '.join(MODELS)} (default cnn,mlp25m)")
    p.add_argument("--steps", default=",".join(f"{m}={n}" for m, n in DEFAULT_STEPS.items() if m in ("cnn", "mlp25m")),
                   help="global steps: N for every model, or MODEL=N,... (default cnn=600,mlp25m=60)")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="adam")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    models = args.models.split(",")
    if any(m not in MODELS for m in models):
        p.error(f"--models: choose from {', '.join(MODELS)}")
    try:
        steps = parse_steps(args.steps, models)
    except ValueError as e:
        p.error(f"--steps: {e}")
    if min(steps.values()) < 1 or args.global_batch_size < 2:
        p.error("--steps must be positive and --global-batch-size at least 2 (one example per worker)")
    os.environ.update(wire.ALLOCATOR_ENV)  # every runner's processes inherit it
    results: dict = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tfps-training-bench-") as workdir:
        for model in models:
            spec = RunSpec(model=model, steps=steps[model], global_batch_size=args.global_batch_size,
                           optimizer=args.optimizer, num_workers=2)
            results[model] = run_model(spec, workdir)
    print(f"training examples/s, 2 workers, global batch {args.global_batch_size}, {args.optimizer}, digits; "
          f"ratios from the same run ({time.monotonic() - started:.0f} s)")
    print(f"{'model':<7} {'steps':>5} " + " ".join(f"{k:>14}" for k in RUNNERS))
    for model, r in results.items():
        runners = r["runners"]
        speed = lambda k: f"{runners[k]['examples_per_s']:.0f}" if runners[k]["status"] == "ok" else "-"  # noqa: E731
        print(f"{model:<7} {steps[model]:>5} " + " ".join(f"{speed(k):>14}" for k in RUNNERS))
    print(f"{'model':<7} " + " ".join(f"{ours + '/' + theirs:>20}" for ours, theirs in PAIRS))
    for model, r in results.items():
        ratio = lambda k: f"{r['ratios'][k]:.2f}" if k in r["ratios"] else "-"  # noqa: E731
        print(f"{model:<7} " + " ".join(f"{ratio(ours + '/' + theirs):>20}" for ours, theirs in PAIRS))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"global_batch_size": args.global_batch_size, "optimizer": args.optimizer,
                       "steps": steps, "results": results}, f, indent=2)
    return 0 if all(v["status"] == "ok" for r in results.values() for v in r["runners"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
