"""TensorFlow's MultiWorkerMirroredStrategy: ``spec.num_workers`` processes on 127.0.0.1.

    python -m tf_strategies.mwms --spec-json '{"model": "cnn", "steps": 3}' --out DIR [--timeout S]
    result = tf_strategies.mwms.run(RunSpec(...))      # launches the worker processes

``run`` (the launcher; it never imports TensorFlow) picks free loopback ports,
starts one worker process per ``spec.num_workers``
(``python -m tf_strategies.mwms --role worker --index i ...``, ``TF_CONFIG``
with only a ``worker`` list), waits for all of them and returns the chief's
(worker 0's) result, after checking that every worker ended with bit-identical
weights. Guarantees: every wait is bounded (``timeout_s``); if any worker fails
or the deadline passes, every worker is killed and ``run`` raises (CannotStart
if a worker reported that the environment cannot run it); workers die with
the launcher (PR_SET_PDEATHSIG with SIGKILL: TensorFlow catches SIGTERM), so
nothing outlives it. ``wall_s`` is the
launcher's, from spawning to the last exit.

Each worker creates the strategy before any other TensorFlow op ("Collective
ops must be configured at program startup"), builds the model in its scope
with the spec's initial weights, and runs a custom ``GradientTape`` loop
(Keras 3.15's ``model.fit`` is broken under this strategy) in which worker i
uses shard i of every global batch, the oracle's ``replica_loss``, and the
Keras optimizer's cross-worker all-reduce SUM. A collective that waits for a
dead or hung peer fails after ``COLLECTIVE_TIMEOUT_S``.

TensorFlow's servers listen on 0.0.0.0: run this command inside
``isolation.isolated`` (``ps-parity`` does) so they never face the network.
The CLI exits 0 after writing the result, or 3 with one line
``runner mwms cannot start: <why>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


from tf_strategies import common, isolation
from tf_strategies.oracle import (
    EXIT_CANNOT_START, CannotStart, build_and_load, cli, finish, per_example_loss, replica_loss, setup_tf, train,
)

COLLECTIVE_TIMEOUT_S = 120.0
POLL_S = 0.1
KILL_WAIT_S = 30.0
LAUNCHER_PID_ENV = "TFPS_MWMS_LAUNCHER_PID"


def default_timeout_s(spec: common.RunSpec) -> float:
    return 180.0 + 5.0 * spec.steps


def tf_config(ports: list[int], index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


# --- the launcher -----------------------------------------------------------

def _kill_all(procs: list[subprocess.Popen]) -> None:
    # SIGKILL, not SIGTERM: a worker that has joined the cluster catches SIGTERM
    # (TensorFlow's coordination agent treats it as a preemption notice) and runs on.
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(timeout=KILL_WAIT_S)


def _tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def _cannot_start_line(log: str) -> str | None:
    for line in log.splitlines():
        if line.startswith("runner mwms cannot start: "):
            return line.removeprefix("runner mwms cannot start: ")
    return None


def run(spec: common.RunSpec, timeout_s: float | None = None) -> common.RunResult:
    started = time.perf_counter()
    timeout_s = default_timeout_s(spec) if timeout_s is None else timeout_s
    work = tempfile.mkdtemp(prefix="tfps-mwms-")
    ports = isolation.free_ports(spec.num_workers)
    procs, logs = [], []
    ok = False
    try:
        for i in range(spec.num_workers):
            env = dict(os.environ, TF_CONFIG=tf_config(ports, i), PYTHONUNBUFFERED="1",
                       **{LAUNCHER_PID_ENV: str(os.getpid())})
            logs.append(os.path.join(work, f"worker{i}.log"))
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(
                    isolation.dying_with_parent(
                        [sys.executable, "-m", "tf_strategies.mwms", "--role", "worker", "--index", str(i),
                         "--spec-json", spec.to_json(), "--out", os.path.join(work, f"worker{i}")]),
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                ))
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i = failed[0]
                _kill_all(procs)
                reason = _cannot_start_line(_tail(logs[i], 100_000))
                if codes[i] == EXIT_CANNOT_START and reason:
                    raise CannotStart(f"worker {i}: {reason}")
                how = f"was killed by signal {-codes[i]}" if codes[i] < 0 else f"exited with {codes[i]}"
                raise RuntimeError(f"mwms worker {i} {how} (logs in {work}):\n{_tail(logs[i])}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                _kill_all(procs)
                raise RuntimeError(f"mwms workers did not finish within {timeout_s:.0f} s (logs in {work}):\n"
                                   + "\n".join(f"--- worker {i}\n{_tail(log)}" for i, log in enumerate(logs)))
            time.sleep(POLL_S)
        wall_s = time.perf_counter() - started
        results = [common.load_result(os.path.join(work, f"worker{i}")) for i in range(spec.num_workers)]
        for i, r in enumerate(results[1:], 1):
            if common.max_abs_diff(results[0].weights_final, r.weights_final) != 0.0:
                raise RuntimeError(f"mwms worker {i}'s final weights differ from worker 0's (logs in {work})")
        ok = True
    finally:
        _kill_all(procs)  # no-op when all exited; on any error, nothing survives
        if ok:
            shutil.rmtree(work, ignore_errors=True)
    chief = results[0]
    chief.wall_s = wall_s
    chief.notes = f"{chief.notes}; launcher wall time includes process start; all workers' weights identical"
    return chief


# --- one worker process -----------------------------------------------------

def run_worker(spec: common.RunSpec, index: int) -> common.RunResult:
    started = time.perf_counter()
    tf = setup_tf(spec)  # configuration only: no op has run yet
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=COLLECTIVE_TIMEOUT_S,
    )
    if spec.heartbeat_timeout_s:  # configured before the strategy, which then keeps it
        from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
        from tensorflow.python.eager import context

        context.context().configure_coordination_service(
            service_type="standalone", service_leader="/job:worker/replica:0/task:0",
            heartbeat_timeout_in_ms=int(1000 * spec.heartbeat_timeout_s),
            coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name="worker", num_tasks=spec.num_workers)])
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    except (ValueError, RuntimeError, tf.errors.OpError) as e:
        raise CannotStart(f"MultiWorkerMirroredStrategy failed ({type(e).__name__}: {e})") from None
    task_id = strategy.cluster_resolver.task_id
    if strategy.num_replicas_in_sync != spec.num_workers or task_id != index:
        raise CannotStart(f"TF_CONFIG gives replica {task_id} of {strategy.num_replicas_in_sync}; "
                          f"expected {index} of {spec.num_workers}")
    from worker.data import load_dataset

    data = load_dataset(spec.dataset)
    with strategy.scope():
        model = build_and_load(spec)
        opt = spec.keras_optimizer()
        opt.build(model.trainable_variables)
    variables = model.trainable_variables

    def replica_step(x, y, global_batch_size):
        with tf.GradientTape() as tape:
            loss = replica_loss(per_example_loss(model, x, y), global_batch_size, spec.loss_scaling)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))  # cross-worker all-reduce SUM
        return loss

    @tf.function(reduce_retracing=True)
    def apply(x, y, global_batch_size):
        losses = strategy.run(replica_step, args=(x, y, global_batch_size))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    def step(batch, shards):
        def shard_of(array):
            # One replica per worker: its global replica id is this worker's index.
            return strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.constant(array[shards[ctx.replica_id_in_sync_group]]))

        return apply(shard_of(data.x_train), shard_of(data.y_train), tf.constant(len(batch), tf.int32))

    trained = train(spec, data, model, step)
    return finish("mwms", data, model, trained, started,
                  notes=f"MultiWorkerMirroredStrategy, {spec.num_workers} worker processes on 127.0.0.1")


def _die_with_launcher() -> None:
    """Re-arm PR_SET_PDEATHSIG with SIGKILL: TensorFlow's coordination agent catches
    the SIGTERM that ``isolation.die_with_parent`` asks for, and the worker would
    outlive its launcher."""
    from ps_common.procs import die_with_parent

    die_with_parent()
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and os.getppid() != int(launcher):  # it died before we asked
        os._exit(1)


def worker_main(argv: list[str]) -> int:
    _die_with_launcher()
    p = argparse.ArgumentParser(prog="python -m tf_strategies.mwms --role worker")
    p.add_argument("--role", choices=["worker"], required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--spec-json", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    spec = common.RunSpec.from_json(args.spec_json)
    try:
        result = run_worker(spec, args.index)
    except CannotStart as e:
        print(f"runner mwms cannot start: {e}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_START
    common.save_result(args.out, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--role" in argv:
        return worker_main(argv)

    def add_timeout(p: argparse.ArgumentParser) -> None:
        p.add_argument("--timeout", type=float, default=None,
                       help="seconds before every worker is killed (default 180 + 5 per step)")

    return cli("mwms", lambda spec, args: run(spec, args.timeout), argv, __doc__, add_timeout)


if __name__ == "__main__":
    sys.exit(main())
