"""The user's own ``model.fit``, run once under one strategy: the process ``ps-parity --model`` starts.

    python -m tf_strategies.user_fit --strategy mirrored --replicas 3 --model mymod:build --dataset mymod:data \\
        --epochs 3 --initial-weights init.npz --out DIR
    ps-launch --mode sync --workers 3 -- python -m tf_strategies.user_fit --strategy tfps --model mymod:build \\
        --dataset mymod:data --epochs 3 --initial-weights init.npz --out DIR

``--model module:function`` names a function that takes no arguments and returns a Keras
model, **compiled** with its optimizer, loss and metrics (``metrics=["accuracy"]`` gives
the validation accuracy). Build it with ``tf.keras`` (``from tensorflow import keras``):
that is Keras 3, or ``tf_keras`` (legacy Keras 2) where ``TF_USE_LEGACY_KERAS=1``, so the
same function serves both. ``--dataset module:function`` returns ``(train, validation)``,
two finite ``tf.data.Dataset`` of *global* batches (``(x, y)``); it is called in every
process, so it must give the same batches each time (no unseeded shuffle). A module is
imported by name (``PYTHONPATH``) or given as a path, ``path/to/file.py:function``.

What this process does, by ``--strategy``:

- ``init``: builds the model once (no strategy) and writes ``DIR/initial.npz`` (its
  trainable then non-trainable variables, in order) and ``DIR/dataset.json`` (every
  global batch's size, the optimizer's class and config, the metric names, and whether
  the rule for a sparse gradient's repeated rows changes the step: ``sparse_rule``).
- ``mirrored``: ``tf.distribute.MirroredStrategy`` over ``--replicas`` logical CPUs (the
  CPU is split before TensorFlow initialises; GPUs if there are that many).
- ``mwms``: ``MultiWorkerMirroredStrategy`` from ``TF_CONFIG`` (one process per worker,
  started by ``tf_strategies.user_parity``, each with its own ``--out``).
- ``pss``: the chief (coordinator) of a ``ParameterServerStrategy`` cluster from
  ``TF_CONFIG``; the ps and worker tasks are plain ``tf.distribute.Server`` processes.
  ``model.fit`` gets a ``DatasetCreator`` whose dataset splits each global batch into
  ``--replicas`` shards (as tfps' workers split it: the first shards take one more
  example) and reshuffles them with an unseeded shuffle, so each worker draws its own
  order, and ``steps_per_epoch`` = the number of shards per epoch: each scheduled step is
  one shard applied on its own, as each tfps async push is (Keras 3, which has no
  ``DatasetCreator``, gets that dataset itself). tf_keras documents
  ``validation_data`` as unsupported under this strategy, so it is not given.
- ``tfps``: ``tfps.keras.Strategy()``, under ``ps-launch`` (worker 0 is the chief).

In every case the model is built and compiled in ``strategy.scope()``, the initial
weights are assigned, and ``model.fit(train, epochs=E, validation_data=validation)``
runs as the user wrote it (``pss``: the dataset creator above). The chief writes
``DIR/result.json`` (``History.history``, per-epoch, and ``val_accuracy``/``val_loss``
from evaluating the final weights on the validation set in one process, with the same
code for every runner) and ``DIR/weights.npz`` (``final_<i>`` and, for sync strategies,
``step1_<i>``, after the first step: trainable variables in order). Exit 0; or 1 with
``DIR/error.txt``, the error's first line (``Type: message``).

Determinism: ``TF_ENABLE_ONEDNN_OPTS=0``, ``--intra-op-threads`` (default 1), the
flavour's ``set_random_seed(--seed)``, op determinism on (not for ``pss``, whose
per-worker shuffle must be unseeded; it is asynchronous anyway).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback

STRATEGIES = ("init", "mirrored", "mwms", "pss", "tfps")


def legacy() -> bool:
    """tf_keras (Keras 2) rather than Keras 3: what ``TF_USE_LEGACY_KERAS`` asks for."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes")


def load_function(ref: str):
    """``module:function`` or ``path/file.py:function`` -> the function."""
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"expected module:function or file.py:function, got {ref!r}")
    if where.endswith(".py"):
        path = os.path.abspath(where)
        module_name = "tfps_user_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{where} has no function {name!r}")
    return fn


def shard_sizes(n: int, num: int) -> list[int]:
    """How tfps (and this module's PSS dataset) splits a batch of n: the first take one more."""
    q, r = divmod(n, num)
    return [q + (1 if i < r else 0) for i in range(num)]


# --- TensorFlow from here on ------------------------------------------------------------


def _setup(args):
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if args.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    if args.strategy != "pss":
        tf.config.experimental.enable_op_determinism()
    return tf


def _keras():
    if legacy():
        import tf_keras as keras
    else:
        import keras
    return keras


def _check_flavour(keras, model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"the model function returned {type(model).__module__}.{type(model).__name__}, "
                        f"not a {keras.__name__}.Model: build it with tf.keras so that "
                        f"TF_USE_LEGACY_KERAS={'1' if legacy() else 'unset'} picks the Keras in use")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled_loss", True):
        raise ValueError("the model function must return a compiled model (optimizer, loss, metrics)")


def _load_initial(model, path: str) -> None:
    import numpy as np

    with np.load(path) as f:
        t = [f[k] for k in sorted((k for k in f.files if k.startswith("t")), key=lambda k: int(k[1:]))]
        n = [f[k] for k in sorted((k for k in f.files if k.startswith("n")), key=lambda k: int(k[1:]))]
    from tf_strategies.common import assign_weights

    assign_weights(model.trainable_variables, t)
    assign_weights(model.non_trainable_variables, n)


def _weights(model) -> list:
    import numpy as np

    return [np.array(v.numpy()) for v in model.trainable_variables]


def _first_step_recorder(keras, model, into: dict):
    class FirstStep(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if getattr(self, "epoch", 0) == 0 and batch == 0 and "step1" not in into:
                into["step1"] = _weights(model)

    return FirstStep()


def _accuracy_key(names) -> str | None:
    for key in names:
        if "acc" in key and not key.startswith("val_"):
            return key
    return None


def _evaluate(keras, model_fn, model, val) -> dict:
    """The final weights on the validation set, in one process, no strategy: the same for every runner."""
    plain = model_fn()
    plain.set_weights(model.get_weights())
    scores = plain.evaluate(val, verbose=0, return_dict=True)
    key = _accuracy_key(scores)
    return {"val_loss": float(scores.get("loss", float("nan"))),
            "val_accuracy": float(scores[key]) if key else None, "val_metrics": {k: float(v) for k, v in scores.items()}}


def _pss_dataset_creator(keras, tf, dataset_fn, num_shards: int, shards_per_epoch: int):
    def split(batch):
        n = tf.shape(tf.nest.flatten(batch)[0])[0]
        q, r = n // num_shards, n % num_shards

        def piece(i):
            i = tf.cast(i, tf.int32)
            start = i * q + tf.minimum(i, r)
            size = q + tf.cast(i < r, tf.int32)
            return tf.nest.map_structure(lambda t: t[start:start + size], batch)

        return (tf.data.Dataset.range(num_shards).map(piece)
                .filter(lambda *b: tf.shape(tf.nest.flatten(b)[0])[0] > 0))

    def make(input_context):
        del input_context  # PSS gives every worker the same function; the unseeded shuffle tells them apart
        train, _ = dataset_fn()
        shards = train.flat_map(lambda *b: split(b if len(b) > 1 else b[0]))
        return shards.repeat().shuffle(max(shards_per_epoch, 1), seed=None)

    experimental = getattr(keras.utils, "experimental", None)
    if experimental is None or not hasattr(experimental, "DatasetCreator"):
        # Keras 3 has no DatasetCreator: give its fit the dataset itself, as a Keras 3 user would.
        return make(None)
    return experimental.DatasetCreator(make)


def _batch_sizes(tf, ds) -> list[int]:
    card = int(ds.cardinality())
    if card == int(tf.data.INFINITE_CARDINALITY):
        raise ValueError("the training dataset is infinite: give one epoch of global batches (no .repeat())")
    return [int(tf.shape(tf.nest.flatten(b)[0])[0]) for b in ds]


def _write_initial(keras, tf, args, model_fn, dataset_fn) -> dict:
    """--strategy init: the model's initial weights and what the runs will need of the data."""
    model = model_fn()
    _check_flavour(keras, model)
    train, val = dataset_fn()
    import numpy as np

    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, "initial.npz"),
             **{f"t{i}": np.asarray(v.numpy()) for i, v in enumerate(model.trainable_variables)},
             **{f"n{i}": np.asarray(v.numpy()) for i, v in enumerate(model.non_trainable_variables)})
    opt = model.optimizer
    info = {"batch_sizes": _batch_sizes(tf, train), "val_batches": len(_batch_sizes(tf, val)),
            "optimizer": type(opt).__name__,
            "optimizer_config": json.loads(json.dumps(opt.get_config(), default=str)),
            "trainable_variables": len(model.trainable_variables),
            "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables))}
    info["sparse_rule"] = sparse_rule(keras, tf, model, next(iter(train)))
    with open(os.path.join(args.out, "dataset.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


RULE_MATTERS = 1e-3  # of the largest change a step makes: beyond rounding (Adam's is ~0.1-1 of it)


def sparse_rule(keras, tf, model, batch) -> dict | None:
    """Whether the two rules for repeated rows of a sparse gradient give this model and
    optimizer different steps: tfps sums a row's occurrences before the optimizer step (as
    TF1's optimizers and ElasticDL), Keras 3's TensorFlow backend applies the
    ``tf.IndexedSlices`` as it is (``square(g)`` of each occurrence, then scattered). Measured
    on ``batch``: one step of a fresh copy of the compiled optimizer on each variable whose
    gradient repeats a row, once as the slices and once summed (made dense). None when no
    gradient repeats a row or the two steps differ by at most ``RULE_MATTERS`` of the step
    (the order of a sum); else the variables and the largest difference (docs/sparse.md,
    "Repeated rows")."""
    import numpy as np

    x, y = batch[0], batch[1]
    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True), training=True)
    grads = tape.gradient(loss, model.trainable_variables)
    repeated = [(v, g) for v, g in zip(model.trainable_variables, grads) if isinstance(g, tf.IndexedSlices)
                and len(np.unique(g.indices.numpy())) < int(tf.size(g.indices))]
    if not repeated:
        return None
    steps = []
    for as_given in (True, False):
        optimizer = type(model.optimizer).from_config(model.optimizer.get_config())
        copies = [keras.Variable(np.asarray(v.numpy())) for v, _ in repeated]
        optimizer.apply([g if as_given else tf.convert_to_tensor(g) for _, g in repeated], copies)
        steps.append([np.asarray(c.numpy()) - np.asarray(v.numpy()) for c, (v, _) in zip(copies, repeated)])
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(*steps))
    if diff <= RULE_MATTERS * max(float(np.max(np.abs(a))) for a in steps[1]):
        return None  # the same step but for the order of a sum (SGD: ~1e-6 of it)
    return {"variables": [v.path for v, _ in repeated], "optimizer": type(model.optimizer).__name__,
            "step_difference": diff}


def _strategy(tf, args) -> tuple:
    """The ``--strategy`` to fit under, and a note saying what it is (None, "" for init)."""
    strategy, notes = None, ""
    if args.strategy == "mirrored":
        gpus = tf.config.list_physical_devices("GPU")
        if len(gpus) >= args.replicas:
            devices = [f"/gpu:{i}" for i in range(args.replicas)]
        else:
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas)
            devices = [f"/cpu:{i}" for i in range(args.replicas)]
        strategy = tf.distribute.MirroredStrategy(devices)
        notes = f"MirroredStrategy over {', '.join(devices)}"
    elif args.strategy == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()  # before any other op
        notes = f"MultiWorkerMirroredStrategy, {strategy.num_replicas_in_sync} worker processes"
    elif args.strategy == "pss":
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
        spec = resolver.cluster_spec().as_dict()
        notes = f"ParameterServerStrategy, {len(spec.get('ps', []))} ps, {len(spec.get('worker', []))} workers, chief coordinates"
    elif args.strategy == "tfps":
        import tfps.keras

        strategy = tfps.keras.Strategy()
        notes = f"tfps.keras.Strategy, {strategy.num_replicas_in_sync} workers"
    return strategy, notes


def run(args) -> dict:
    started = time.perf_counter()
    tf = _setup(args)
    strategy, notes = _strategy(tf, args)  # MWMS's before any other op
    keras = _keras()
    keras.utils.set_random_seed(args.seed)
    model_fn = load_function(args.model)
    dataset_fn = load_function(args.dataset)

    if args.strategy == "init":
        return _write_initial(keras, tf, args, model_fn, dataset_fn)

    with strategy.scope():
        model = model_fn()
        _check_flavour(keras, model)
        if args.initial_weights:
            _load_initial(model, args.initial_weights)
    train, val = dataset_fn()
    record: dict = {}
    callbacks = [] if args.strategy == "pss" else [_first_step_recorder(keras, model, record)]
    fit_started = time.perf_counter()
    if args.strategy == "pss":
        sizes = _batch_sizes(tf, train)
        shards = sum(1 for n in sizes for s in shard_sizes(n, args.replicas) if s > 0)
        creator = _pss_dataset_creator(keras, tf, dataset_fn, args.replicas, shards)
        tf.random.set_seed(None)  # no global seed: each worker's shuffle draws its own order
        history = model.fit(creator, epochs=args.epochs, steps_per_epoch=shards, callbacks=callbacks, verbose=0)
        notes += f"; {shards} shard steps per epoch, DatasetCreator, no validation_data (unsupported)"
    else:
        history = model.fit(train, epochs=args.epochs, validation_data=val, callbacks=callbacks, verbose=0)
    fit_s = time.perf_counter() - fit_started
    final = _weights(model)
    chief = True
    if args.strategy == "mwms":
        chief = strategy.cluster_resolver.task_id == 0
    elif args.strategy == "tfps":
        chief = strategy.is_chief
    scores = _evaluate(keras, model_fn, model, val)
    result = {
        "strategy": args.strategy, "keras": f"{keras.__name__} {keras.__version__}", "chief": chief,
        "epochs": args.epochs, "history": {k: [float(x) for x in v] for k, v in history.history.items()},
        **scores, "fit_s": fit_s, "wall_s": time.perf_counter() - started, "notes": notes,
    }
    out = args.out  # mwms: the supervisor gives each worker its own
    if args.strategy == "tfps" and not chief:
        out = os.path.join(args.out, f"worker{strategy.worker_index}")
    _write(out, result, final, record.get("step1"))
    return result


def _write(out: str, result: dict, final: list, step1: list | None) -> None:
    import numpy as np

    os.makedirs(out, exist_ok=True)
    arrays = {f"final_{i}": w for i, w in enumerate(final)}
    if step1 is not None:
        arrays.update({f"step1_{i}": w for i, w in enumerate(step1)})
    np.savez(os.path.join(out, "weights.npz"), **arrays)
    result = dict(result, num_weights=len(final), has_step1=step1 is not None)
    tmp = os.path.join(out, "result.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, os.path.join(out, "result.json"))


def load(out: str) -> tuple[dict, list | None, list]:
    """(result, step-1 weights or None, final weights) as ``run`` wrote them."""
    import numpy as np

    with open(os.path.join(out, "result.json")) as f:
        result = json.load(f)
    n = result["num_weights"]
    with np.load(os.path.join(out, "weights.npz")) as w:
        final = [w[f"final_{i}"] for i in range(n)]
        step1 = [w[f"step1_{i}"] for i in range(n)] if result["has_step1"] else None
    return result, step1, final


def _collapse_braces(text: str) -> str:
    """``PerReplica:{ 0: <tf.Tensor ... }`` -> ``PerReplica:{...}``: values, not the error."""
    out, depth = [], 0
    for ch in text:
        if ch == "{":
            if depth == 0:
                out.append("{...")
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                out.append("}")
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def first_line(e: BaseException, width: int = 240) -> str:
    """``Type: message``, the message's first line; when that line is cut short (a repr that
    spans lines), the following lines are joined on, ``{...}`` contents left out, up to ``width``
    characters."""
    lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
    text = lines[0] if lines else ""
    if len(text) < 80 and len(lines) > 1:
        text = _collapse_braces(" ".join(" ".join(lines).split()))
        text = text if len(text) <= width else text[: width - 3] + "..."
    return f"{type(e).__name__}: {text}".strip()


def _error_name(strategy: str) -> str:
    """error.txt; under ps-launch (every worker shares --out) error-worker<i>.txt but for the chief."""
    if strategy == "tfps":
        try:
            index = int(json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0))
        except (ValueError, TypeError, AttributeError):
            index = 0
        if index:
            return f"error-worker{index}.txt"
    return "error.txt"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tf_strategies.user_fit", description=__doc__.splitlines()[0])
    p.add_argument("--strategy", choices=STRATEGIES, required=True)
    p.add_argument("--model", required=True, help="module:function returning a compiled Keras model")
    p.add_argument("--dataset", required=True, help="module:function returning (train, validation) datasets")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2, help="mirrored: logical devices; pss: shards per global batch")
    p.add_argument("--initial-weights", default="", help=".npz written by --strategy init")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--intra-op-threads", type=int, default=1)
    p.add_argument("--out", required=True, help="directory for result.json and weights.npz")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        run(args)
    except BaseException as e:  # the supervisor reads the first line
        traceback.print_exc()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, _error_name(args.strategy)), "w") as f:
            f.write(first_line(e) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip tearing down TensorFlow's distributed runtime (PSS, MWMS): the supervisor stops the servers.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
