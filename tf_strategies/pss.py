"""TensorFlow's ParameterServerStrategy, every task its own process on 127.0.0.1.

    python -m tf_strategies.pss --spec-json '{"model": "cnn", "steps": 23, "optimizer": "adam"}' --num-ps 2 --out DIR
    result = run(RunSpec(model="cnn", steps=23, optimizer="adam"), num_ps=2)

``run`` is a supervisor that never imports TensorFlow. It picks free ports,
starts ``num_ps`` ps tasks and ``spec.num_workers`` worker tasks (each
``python -m tf_strategies.pss --role ps|worker ...``, a ``tf.distribute.Server``
that joins forever), waits until every one accepts connections, then starts the
coordinator as one more child (``--role chief``, the ``chief`` task of the
cluster spec). The chief builds the model and the optimizer in
``strategy.scope()``, assigns the initial weights, schedules the steps on a
``ClusterCoordinator``, joins, and writes a ``RunResult``. Every wait is
bounded: servers must listen within ``START_TIMEOUT_S``, the chief must finish
within ``timeout_s``; any child that exits early fails the run at once. All
children are started with ``die_with_parent`` and are killed when ``run``
returns or raises, so nothing outlives it. TensorFlow's servers listen on all
interfaces: run the command under ``isolation.isolated`` (ps-parity does).

Semantics (what to compare with our async mode). PSS is asynchronous and
``num_replicas_in_sync`` is 1: each scheduled step is one batch, applied on its
own to the variables on the ps tasks. For every global batch of
``common.step_batches`` one step is scheduled per shard (shard 0, 1, ... of
batch 0, then of batch 1, ...), so there are ``spec.steps * num_workers``
scheduled steps, each with loss ``compute_average_loss(per_example,
global_batch_size=len(shard))`` = the shard's mean, like each of our workers
pushing the mean gradient over its shard. The coordinator hands the queued
steps, in that order, to whichever worker is free: shard i does not
necessarily run on worker i, and steps that overlap read parameters that lack
each other's update (staleness of up to ``num_workers - 1``). So runs are not
bitwise reproducible; ``weights_step1`` is None. ``losses`` are per scheduled
step, in schedule order. The shard data travels as arguments of ``schedule``
(coordinator to worker, per step). ``steps_per_s`` counts global steps
(scheduled steps / num_workers) per second of training, from the first
``schedule`` to the end of ``join``; ``wall_s`` is the whole run, process
start-up (~10 s on 2 cores: every task imports TensorFlow) and teardown included.

With 2 ps tasks the variables are sharded along axis 0 by
``FixedShardsPartitioner(2)``; gradients are taken with respect to the shards
(``tape.gradient`` on a ``ShardedVariable`` fails) and the Keras optimizer
keeps one set of slots per shard. Weights are reported whole, shards
concatenated, in ``trainable_variables`` order.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from tf_strategies import common, isolation

START_TIMEOUT_S = 60.0  # every server must accept connections by then
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this


class CannotStart(RuntimeError):
    """The run could not start or did not finish; the message is one line."""


def default_timeout(spec: common.RunSpec) -> float:
    """Seconds the chief may take: start-up plus a generous allowance per scheduled step."""
    return 180.0 + 2.0 * spec.steps * spec.num_workers


def make_cluster(num_workers: int, num_ps: int) -> dict[str, list[str]]:
    ports = isolation.free_ports(1 + num_workers + num_ps)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    return {"chief": addresses[:1], "worker": addresses[1 : 1 + num_workers], "ps": addresses[1 + num_workers :]}


# ---------------------------------------------------------------------------
# The supervisor (no TensorFlow here)


class _Child:
    def __init__(self, label: str, argv: list[str], log_path: str, env: dict[str, str]):
        self.label = label
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                isolation.dying_with_parent(argv), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env,
            )

    def why_dead(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return f"{self.label} {how}{_last_line(self.log_path, errors_only=True)}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_GRACE_S)


def _last_line(path: str, errors_only: bool = False) -> str:
    """': <last line that looks like an error, else the last line>' of a child's log, or ''."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    errors = [line for line in lines if "error" in line.lower()]
    pick = errors or ([] if errors_only else lines)
    return f": {pick[-1][:300]}" if pick else ""


def _wait_listening(children: list[_Child], addresses: list[str], deadline: float) -> None:
    for child, address in zip(children, addresses):
        host, port = address.rsplit(":", 1)
        while True:
            if why := child.why_dead():
                raise CannotStart(why)
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise CannotStart(f"{child.label} did not listen on {address} within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.1)


def run(spec: common.RunSpec, num_ps: int = 1, timeout_s: float | None = None,
        log_dir: str | None = None) -> common.RunResult:
    """Train ``spec`` under ParameterServerStrategy in separate processes; raises CannotStart on failure."""
    if num_ps not in (1, 2):
        raise CannotStart(f"num_ps must be 1 or 2, got {num_ps}")
    if spec.loss_scaling != "global":
        raise CannotStart(f"loss_scaling={spec.loss_scaling!r} has no meaning here: "
                          "each PSS step is its own batch (num_replicas_in_sync is 1)")
    if spec.num_workers < 1:
        raise CannotStart(f"num_workers must be >= 1, got {spec.num_workers}")
    if spec.initial_weights and not os.path.isfile(spec.initial_weights):
        raise CannotStart(f"initial weights {spec.initial_weights!r} not found")
    timeout_s = timeout_s or default_timeout(spec)
    started = time.monotonic()
    cluster = make_cluster(spec.num_workers, num_ps)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)  # the cluster is given explicitly
    if spec.deterministic:
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    base = [sys.executable, "-m", "tf_strategies.pss", "--cluster", json.dumps(cluster), "--spec-json", spec.to_json()]
    children: list[_Child] = []
    with tempfile.TemporaryDirectory(prefix="tfps-pss-") as tmp:
        logs = log_dir or tmp
        os.makedirs(logs, exist_ok=True)
        out = os.path.join(tmp, "result")
        try:
            servers = [(job, i) for job in ("ps", "worker") for i in range(len(cluster[job]))]
            for job, i in servers:
                children.append(_Child(f"{job} {i}", [*base, "--role", job, "--index", str(i)],
                                       os.path.join(logs, f"{job}{i}.log"), env))
            _wait_listening(children, [cluster[job][i] for job, i in servers], time.monotonic() + START_TIMEOUT_S)
            chief = _Child("chief", [*base, "--role", "chief", "--num-ps", str(num_ps), "--out", out],
                           os.path.join(logs, "chief.log"), env)
            children.append(chief)
            deadline = time.monotonic() + timeout_s
            while chief.proc.poll() is None:
                for child in children[:-1]:
                    if why := child.why_dead():
                        raise CannotStart(why)
                if time.monotonic() > deadline:
                    raise CannotStart(f"chief did not finish within {timeout_s:.0f} s{_last_line(chief.log_path)}")
                time.sleep(0.1)
            if chief.proc.returncode != 0:
                try:
                    with open(os.path.join(out, "error.txt")) as f:
                        why = f.read().strip().splitlines()[0]
                except (OSError, IndexError):
                    why = f"exited with status {chief.proc.returncode}{_last_line(chief.log_path, errors_only=True)}"
                raise CannotStart(f"chief: {why}")
        except OSError as e:  # cannot spawn a process or write a log
            raise CannotStart(f"{type(e).__name__}: {e}") from None
        finally:
            for child in reversed(children):
                child.stop()
        try:
            result = common.load_result(out)
        except (OSError, ValueError, KeyError) as e:
            raise CannotStart(f"chief finished but wrote no result ({e})") from None
    result.wall_s = time.monotonic() - started
    return result


# ---------------------------------------------------------------------------
# The tasks (TensorFlow from here on, each in its own process)


def _session_config(spec: common.RunSpec, job: str, num_workers: int):
    import tensorflow as tf

    # Measured: a worker server with inter_op_parallelism_threads=1 hangs at the
    # first step (likely the step's function holds the only thread while it waits
    # on its reads from the ps tasks); 2 suffice with one process per task, and ps
    # tasks are fine with 1. In one process, where all workers share a pool, it
    # takes num_workers + 1; we give that here too, idle threads are cheap.
    inter = max(2, num_workers + 1) if job == "worker" else 0
    return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=spec.intra_op_threads,
                                    inter_op_parallelism_threads=inter)


def serve(job: str, index: int, cluster: dict[str, list[str]], spec: common.RunSpec) -> None:
    """Run one ps or worker task until killed."""
    from worker.model import tf_setup

    tf = tf_setup(spec.deterministic, spec.intra_op_threads)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc",
        config=_session_config(spec, job, len(cluster["worker"])), start=True,
    )
    print(f"pss: {job} {index} serving at {cluster[job][index]}", flush=True)
    server.join()


def _parts(variable) -> list:
    """The tf.Variables behind a Keras variable: its shards (in axis-0 order) if partitioned, else itself."""
    import tensorflow as tf

    inner = variable.value  # Keras 3 (TensorFlow backend): the backing variable
    return list(inner.variables) if isinstance(inner, tf.__internal__.distribute.ShardedVariable) else [inner]


def coordinate(cluster: dict[str, list[str]], spec: common.RunSpec, num_ps: int) -> common.RunResult:
    """The chief: build, train and read back the model; returns the result."""
    import numpy as np

    from worker import model as models
    from worker.data import IMAGE_SHAPE, load_dataset

    t0 = time.monotonic()

    def say(what: str) -> None:  # progress in chief.log, for a run that hangs
        print(f"pss chief: {what} at {time.monotonic() - t0:.1f} s", flush=True)

    tf = models.tf_setup(spec.deterministic, spec.intra_op_threads)
    import keras

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps) if num_ps > 1 else None
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    say("connected")

    with strategy.scope():
        model = models.build_model(spec.model, spec.seed)
        variables = model.trainable_variables
        initial = common.load_initial_weights(spec.initial_weights) if spec.initial_weights else None
        if initial is not None:
            if len(initial) != len(variables):
                raise ValueError(f"{len(initial)} initial arrays for {len(variables)} variables")
            for v, a in zip(variables, initial):
                if tuple(v.shape) != a.shape:
                    raise ValueError(f"{v.path}: shape {tuple(v.shape)} != initial {a.shape}")
                offset = 0
                for part in _parts(v):  # shards split axis 0, in order
                    part.assign(a[offset : offset + part.shape[0]])
                    offset += part.shape[0]
        leaves = [part for v in variables for part in _parts(v)]
        optimizer = spec.keras_optimizer()
        optimizer.build(leaves)
    say(f"built {len(leaves)} variables")

    @tf.function(input_signature=[tf.TensorSpec((None, *IMAGE_SHAPE), tf.float32), tf.TensorSpec((None,), tf.int64)])
    def train_step(x, y):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                probs = model(x, training=True)
                per_example = keras.losses.sparse_categorical_crossentropy(y, probs)
                # This step's batch is the whole "global" batch: the shard's mean.
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=tf.shape(y)[0])
            optimizer.apply_gradients(zip(tape.gradient(loss, leaves), leaves))
            return loss

        return strategy.run(replica_fn, args=(x, y))

    data = load_dataset(spec.dataset)
    remote_losses, examples = [], 0
    train_started = time.monotonic()
    for _, shards in common.step_batches(spec, len(data.y_train)):
        for mine in shards:
            if len(mine):
                x, y = tf.constant(data.x_train[mine]), tf.constant(data.y_train[mine])
                remote_losses.append(coordinator.schedule(train_step, args=(x, y)))
                examples += len(mine)
    coordinator.join()
    train_s = time.monotonic() - train_started
    losses = [float(r.fetch()) for r in remote_losses]
    say(f"trained {len(losses)} steps")

    final = [np.concatenate([np.asarray(p.numpy()) for p in _parts(v)], axis=0) for v in variables]
    plain = models.build_model(spec.model, spec.seed)  # outside the scope: local, for evaluation
    common.assign_weights(plain.trainable_variables, final)
    _, accuracy = models.evaluate(plain, data.x_test, data.y_test)
    say(f"evaluated, test accuracy {accuracy:.4f}")
    sharding = f"{num_ps} PS, FixedShardsPartitioner({num_ps})" if num_ps > 1 else "1 PS, no partitioner"
    return common.RunResult(
        runner="pss", losses=losses, weights_step1=None, weights_final=final, test_accuracy=float(accuracy),
        steps_per_s=spec.steps / train_s, examples=examples, wall_s=train_s,
        notes=(f"{sharding}; {spec.num_workers} workers, async, {len(losses)} scheduled steps "
               f"(one per shard), training {train_s:.1f} s"),
    )


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tf_strategies.pss", description=__doc__.splitlines()[0])
    p.add_argument("--spec-json", required=True, help="a common.RunSpec as JSON")
    p.add_argument("--num-ps", type=int, choices=(1, 2), default=1)
    p.add_argument("--out", help="write the RunResult here (common.save_result), the tasks' logs in OUT/logs")
    p.add_argument("--timeout", type=float, default=None, help="seconds the training may take (default: by steps)")
    # Internal: one task of the cluster, started by run().
    p.add_argument("--role", choices=("chief", "worker", "ps"), help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cluster", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        spec = common.RunSpec.from_json(args.spec_json)
    except (ValueError, TypeError) as e:
        print(f"runner pss cannot start: bad --spec-json ({e})", file=sys.stderr)
        return 3

    if args.role in ("worker", "ps"):
        serve(args.role, args.index, json.loads(args.cluster), spec)
        return 0
    if args.role == "chief":
        os.makedirs(args.out, exist_ok=True)
        try:
            result = coordinate(json.loads(args.cluster), spec, args.num_ps)
        except BaseException as e:
            import traceback

            traceback.print_exc()
            with open(os.path.join(args.out, "error.txt"), "w") as f:
                f.write(f"{type(e).__name__}: {' '.join(str(e).split())[:500]}\n")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        common.save_result(args.out, result)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip tearing down the remote eager context: the supervisor kills the servers

    if not args.out:
        p.error("--out is required")
    try:
        result = run(spec, args.num_ps, args.timeout, log_dir=os.path.join(args.out, "logs"))
    except CannotStart as e:
        print(f"runner pss cannot start: {e}", file=sys.stderr)
        return 3
    common.save_result(args.out, result)
    print(f"pss: {len(result.losses)} steps, last loss {result.losses[-1]:.4f}, "
          f"test accuracy {result.test_accuracy:.4f}, {result.steps_per_s:.1f} steps/s, wall {result.wall_s:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
