"""What a worker trains: a model, its data, its loss and metrics (the built-in ones or yours).

    task = from_config(config)                           # --model cnn --dataset digits: a BuiltinTask
    task = UserTask(model_fn, dataset_fn, global_batch_size=128, loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"])                # worker.api.train, --model/--dataset M:F
    model = task.build_model()
    batches = task.batches(worker_index, num_workers)
    x, y, n = batches.get(step)                          # this worker's part of global batch `step`
    per_example = task.loss(y, model(x))                 # what worker.gradients.Gradients differentiates
    scores = task.evaluate(model)                        # {"test_loss", "test_accuracy", other metrics}

The training loop (``worker.trainer``) sees only this interface, so the CLI and
the Python API (``worker.api``) run the same loop, and the gradient of every
task goes through one function (``worker.gradients``).

What the model and dataset functions may return, the two ``--dataset-sharding`` ways
(``batch``: every worker keeps its contiguous part of each global batch; ``none``: the
function made this worker's own, and every worker must make the same number of batches, or
sync rounds wait for the missing ones), the step count, ``--elastic`` (the train dataset read
once, ``read_once``, and dealt by index as ``DealtArrays``) and where the variables live:
docs/your-model.md. The loss is the mean over this worker's examples plus the model's
regularization losses; the server weights workers by batch share.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import os
import sys
from typing import Any, Callable

import numpy as np

from ps_common import batches as ps_batches
from ps_common.errors import ConfigError
from worker import model as models
from worker.data import load_dataset, train_subset

SHARDINGS = ("batch", "none")


class TaskError(ConfigError):
    """The model or data cannot be used as given: a ``ConfigError`` whose message says why."""


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a ``dataset_fn(ctx)`` may use to make this worker's data."""

    worker_index: int
    num_workers: int
    global_batch_size: int
    seed: int = 0

    @property
    def per_worker_batch_size(self) -> int:
        """This worker's share of the global batch (the first workers take one more when it does not divide)."""
        return len(np.array_split(np.arange(self.global_batch_size), self.num_workers)[self.worker_index])


def load_function(spec: str, what: str) -> Callable:
    """``module:function`` (``module.sub:obj.attr``) -> the function; ``TaskError`` says what is wrong.
    The current directory is searched too, as ``python -m`` does."""
    if not is_function_spec(spec):
        raise TaskError(f"{what} must be module:function, got {spec!r}")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` would: modules of the current directory
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise TaskError(f"{what} {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TaskError(f"{what} {spec!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TaskError(f"{what} {spec!r} is not callable")
    return obj


def is_function_spec(spec: str) -> bool:
    """``module:function``: a model or dataset function of the user's."""
    module, sep, attr = spec.partition(":")
    return bool(sep and module and attr)


def shard_bounds(n: int, worker_index: int, num_workers: int) -> tuple[int, int]:
    """[lo, hi) of this worker's contiguous part of n examples (``np.array_split``'s cut)."""
    base, extra = divmod(n, num_workers)
    lo = worker_index * base + min(worker_index, extra)
    return lo, lo + base + (1 if worker_index < extra else 0)


class Task:
    """The interface the training loop uses (module docstring)."""

    name: str = "task"
    total_steps: int = 0

    def build_model(self):
        raise NotImplementedError

    def batches(self, worker_index: int, num_workers: int):
        raise NotImplementedError

    def rebind(self, worker_index: int, num_workers: int) -> None:
        """The worker learned its index (``--worker-index auto``); nothing to do unless the
        data depends on it."""

    def loss(self, y_true, y_pred):
        """Per-example losses; the loop differentiates their mean (``worker.gradients``)."""
        raise NotImplementedError

    def evaluate(self, model) -> dict[str, float]:
        raise NotImplementedError

    def train_scores(self, model) -> dict[str, float]:
        """Scores on the training data, when the task can afford them (built-in data)."""
        return {}


# -- the built-in models and datasets -------------------------------------------------
class BuiltinTask(Task):
    """``--model tiny|deepcnn|cnn|mlp|mlp25m`` on ``--dataset digits|digits-large|mnist|synthetic``: NumPy arrays in
    memory, batches drawn by index (``worker.data``); the loss of ``worker.model``. With
    ``--train-examples N`` the training set is ``worker.data.train_subset``'s N examples,
    and an epoch is N examples."""

    def __init__(self, config):
        self.config = config
        self.name = f"{config.model} on {config.dataset}"
        self.data = load_dataset(config.dataset)
        if config.train_examples:
            try:
                self.data = train_subset(self.data, config.train_examples)
            except ValueError as e:
                raise TaskError(str(e)) from None
            self.name += f" ({config.train_examples} training examples)"
        per_epoch = ps_batches.steps_per_epoch(self.num_examples, config.global_batch_size)
        self.total_steps = config.steps or config.epochs * per_epoch

    def build_model(self):
        return models.build_model(self.config.model, self.config.seed)

    def batches(self, worker_index: int, num_workers: int) -> "_Indexed":
        return _Indexed(self, worker_index, num_workers)

    def global_batch(self, step: int) -> np.ndarray:
        """The examples (indices) of global batch ``step``: the data plan the server deals from."""
        return ps_batches.global_batch(self.num_examples, self.config.global_batch_size, self.config.seed, step)

    def examples(self, indices: np.ndarray):
        """(x, y) of the training examples at ``indices``."""
        return self.data.x_train[indices], self.data.y_train[indices]

    @property
    def num_examples(self) -> int:
        return len(self.data.y_train)

    def loss(self, y_true, y_pred):
        return models.loss(y_true, y_pred)

    def evaluate(self, model) -> dict[str, float]:
        loss, acc = models.evaluate(model, self.data.x_test, self.data.y_test)
        return {"test_loss": loss, "test_accuracy": acc}

    def train_scores(self, model) -> dict[str, float]:
        loss, acc = models.evaluate(model, self.data.x_train, self.data.y_train)
        return {"final_loss": loss, "train_accuracy": acc}


# -- your model and data --------------------------------------------------------------
class UserTask(Task):
    """A model function and a ``tf.data`` function of the user's (module docstring)."""

    def __init__(self, model_fn: Callable, dataset_fn: Callable, *, global_batch_size: int, epochs: int = 1,
                 steps: int = 0, seed: int = 0, loss=None, metrics=None, sharding: str = "batch",
                 worker_index: int = 0, num_workers: int = 1, name: str = "", elastic: bool = False):
        if sharding not in SHARDINGS:
            raise TaskError(f"dataset sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
        if elastic:  # every worker reads the whole data, as one worker of one: the server deals its examples
            worker_index, num_workers = 0, 1
        self.model_fn, self.dataset_fn = model_fn, dataset_fn
        self.global_batch_size, self.seed = global_batch_size, seed
        self.loss_spec, self.metric_specs, self.sharding = loss, metrics, sharding
        self.name = name or f"{getattr(model_fn, '__name__', 'model')} on {getattr(dataset_fn, '__name__', 'data')}"
        self._bind(worker_index, num_workers)
        self.dealt: DealtArrays | None = None  # elastic: the train dataset read once, dealt by index
        if elastic:
            x, y, sample_weight, _ = read_once(self._train)
            if y is None:
                raise TaskError("the train dataset's elements must be (features, labels) or (features, labels, "
                                "sample_weight) batches; they have no labels")
            self.dealt = DealtArrays(x, y, sample_weight, global_batch_size=global_batch_size, seed=seed,
                                     epochs=max(1, epochs))
            self.total_steps = steps or self.dealt.total_steps
        elif steps:
            self.total_steps = steps
        else:
            n = int(self._train.cardinality())
            if n < 0:  # tf.data.INFINITE_CARDINALITY (-1) or UNKNOWN_CARDINALITY (-2)
                raise TaskError("the train dataset's length is unknown (or infinite): give --steps (steps=)")
            if n == 0:
                raise TaskError("the train dataset is empty")
            self.total_steps = n * max(1, epochs)
        self._loss_fn = None
        self._metric_list: list | None = None

    def _bind(self, worker_index: int, num_workers: int) -> None:
        import tensorflow as tf

        try:
            takes_context = len(inspect.signature(self.dataset_fn).parameters) > 0
        except (TypeError, ValueError):
            takes_context = False
        ctx = InputContext(max(worker_index, 0), num_workers, self.global_batch_size, self.seed)
        out = self.dataset_fn(ctx) if takes_context else self.dataset_fn()
        train, evaluation = (out if isinstance(out, tuple) and len(out) == 2
                             and all(isinstance(d, tf.data.Dataset) for d in out) else (out, None))
        if not isinstance(train, tf.data.Dataset):
            raise TaskError(f"the dataset function must return a tf.data.Dataset or a (train, eval) pair of them, "
                            f"got {type(out).__name__}")
        self._worker_index, self._num_workers = worker_index, num_workers
        self._train, self._eval = train, evaluation

    def rebind(self, worker_index: int, num_workers: int) -> None:
        """The worker learned its index (``--worker-index auto``): a context-taking
        dataset function is asked again with it (not when elastic: every worker reads it all)."""
        if self.dealt is None and (worker_index, num_workers) != (self._worker_index, self._num_workers):
            self._bind(worker_index, num_workers)

    # -- the model, the loss and the metrics
    def build_model(self):
        import keras

        keras.utils.set_random_seed(self.seed)
        model = self.model_fn()
        if not isinstance(model, keras.Model):
            raise TaskError(f"the model function must return a keras.Model, got {type(model).__name__}")
        compiled = getattr(model, "_compile_config", None)
        compiled = compiled.config if compiled is not None else {}
        loss = self.loss_spec if self.loss_spec is not None else compiled.get("loss")
        if loss is None:
            raise TaskError("no loss: compile the model with one (model.compile(loss=...)) or pass loss=")
        if isinstance(loss, (dict, list, tuple)):
            raise TaskError("one loss for the model's output is supported, not a list or dict of losses")
        self._loss_fn = _per_example(loss)
        metrics = self.metric_specs if self.metric_specs is not None else (compiled.get("metrics") or [])
        self._metric_list = [_metric(m, loss) for m in metrics]
        return model

    def loss(self, y_true, y_pred):
        """The model's compiled loss (or ``loss=``), per example."""
        if self._loss_fn is None:
            raise TaskError("build the model first: its loss is read from it")
        return self._loss_fn(y_true, y_pred)

    # -- data
    def batches(self, worker_index: int, num_workers: int):
        return _Sequential(self, worker_index, num_workers)

    # elastic (``worker.elastic``): the examples the server deals, by index into ``dealt`` (``examples(indices)``:
    # x, y and sample_weight at ``indices`` of the train dataset read once, ``read_once``)
    num_examples = property(lambda self: self._elastic().num_examples)
    global_batch = property(lambda self: self._elastic().global_batch)
    examples = property(lambda self: self._elastic().examples)

    def _elastic(self) -> "DealtArrays":
        if self.dealt is None:
            raise TaskError("the examples are dealt by index only with elastic=True (--elastic)")
        return self.dealt

    def evaluate(self, model) -> dict[str, float]:
        if self._eval is None:
            return {}
        import tensorflow as tf

        for m in self._metric_list:
            m.reset_state()
        total, count = 0.0, 0
        for element in self._eval:
            x, y = element[0], element[1]  # a sample weight, if any, is not applied to the test scores
            pred = model(x, training=False)
            per = self._loss_fn(y, pred)
            total += float(tf.reduce_sum(per))
            count += int(tf.size(per))
            for m in self._metric_list:
                m.update_state(_same_rank(y, pred), pred)
        scores = {"test_loss": total / max(count, 1)}
        scores.update({f"test_{m.name}": float(m.result()) for m in self._metric_list})
        accuracy = [k for k in scores if k.endswith("accuracy")]
        if accuracy and "test_accuracy" not in scores:
            scores["test_accuracy"] = scores[accuracy[0]]
        return scores


class _Indexed:
    """This worker's part of each global batch of the built-in data, by step (any order)."""

    def __init__(self, task: BuiltinTask, worker_index: int, num_workers: int):
        self.task, self.worker_index, self.num_workers = task, worker_index, num_workers

    def get(self, step: int):
        mine = ps_batches.shard(self.task.global_batch(step), self.worker_index, self.num_workers)
        return (*self.task.examples(mine), len(mine))


class _Sequential:
    """Batches of a ``tf.data`` dataset, step by step; a step out of order (a rejoining
    sync worker resumes at the server's round) restarts the iterator there."""

    def __init__(self, task: UserTask, worker_index: int, num_workers: int):
        self.task, self.worker_index, self.num_workers = task, worker_index, num_workers
        self._it, self._next = None, -1

    def get(self, step: int):
        import tensorflow as tf

        if self._it is None or step != self._next:
            self._it = iter(self.task._train.repeat().skip(step))
        self._next = step + 1
        x, y = next(self._it)
        n = int(tf.shape(tf.nest.flatten(y)[0])[0])
        if self.task.sharding == "none":
            return x, y, n
        lo, hi = shard_bounds(n, self.worker_index, self.num_workers)
        return (*tf.nest.map_structure(lambda t: t[lo:hi], (x, y)), hi - lo)


class DealtArrays:
    """Your arrays when the server deals their examples (``tfps.keras`` elastic, ``UserTask``
    with ``elastic``): global batch ``step`` is ``ps_common.batches.global_batch`` of the plan
    (with ``tasks``, async and ssp: task ``step``'s batch), and ``examples`` reads the rows at
    given indices of every array (``x``, ``y`` and ``sample_weight``: an array, a tuple, list or
    dict of them; ``y`` and ``sample_weight`` may be None). ``total_steps``: ``epochs`` of
    ``steps_per_epoch`` batches (by default a pass of the data; given, the rounds go on across
    passes as the plan's global batches do)."""

    def __init__(self, x, y, sample_weight, *, global_batch_size: int, seed: int, epochs: int,
                 tasks: bool = False, steps_per_epoch: int | None = None):
        self.x, self.y, self.sample_weight = x, y, sample_weight
        sizes = {len(a) for a in _leaves((x, y, sample_weight))}
        if len(sizes) != 1:
            raise TaskError(f"x, y and sample_weight must have the same number of examples; got sizes {sorted(sizes)}")
        if global_batch_size < 1:
            raise TaskError(f"batch_size must be >= 1, got {global_batch_size}")
        (self.num_examples,) = sizes
        if self.num_examples < 1:
            raise TaskError("the training arrays are empty")
        self.global_batch_size, self.seed, self.epochs, self.tasks = global_batch_size, seed, epochs, tasks
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise TaskError(f"steps_per_epoch must be an integer >= 1, got {steps_per_epoch!r}")
        self.per_pass = ps_batches.steps_per_epoch(self.num_examples, global_batch_size)
        self.steps_per_epoch = steps_per_epoch or self.per_pass
        self.total_steps = epochs * self.steps_per_epoch
        self.applies = 1  # the rounds or tasks each batch is (tfps.keras: the applies of its step; ``Cursor.applies``)

    def plan(self, tasks: int | None = None) -> dict:
        """The data plan the chief sends with its Initialize (``ps_server.core.data.cursor.DataPlan``).
        With ``tasks`` (async and ssp) also the passes of the job's ``tasks`` (by default this fit's
        ``total_steps``; a later fit's: the job's with them), and their count where they stop
        within a pass (epochs that are not passes)."""
        plan = {"num_examples": self.num_examples, "global_batch_size": self.global_batch_size, "seed": self.seed,
                **({"applies": self.applies} if self.applies > 1 else {})}
        if not self.tasks:
            return plan
        tasks = self.total_steps if tasks is None else tasks
        passes = -(-tasks // self.per_pass)
        return {**plan, "epochs": passes, **({"tasks": tasks} if tasks != passes * self.per_pass else {})}

    def job_tasks(self, plan: dict) -> int:
        """The tasks of a job whose data plan is ``plan`` (``plan``'s, read back)."""
        return plan.get("tasks") or plan.get("epochs", 0) * self.per_pass

    def global_batch(self, step: int) -> np.ndarray:
        return ps_batches.global_batch(self.num_examples, self.global_batch_size, self.seed, step)

    def examples(self, indices: np.ndarray) -> tuple:
        """(x, y, sample_weight) at ``indices``, each in the structure given."""
        return tuple(_rows(a, indices) for a in (self.x, self.y, self.sample_weight))

    def fingerprint(self) -> str:
        """A digest of every array's bytes, shapes and dtypes: every worker must deal from the same data."""
        digest = hashlib.sha256()
        for a in _leaves((self.x, self.y, self.sample_weight)):
            digest.update(f"{a.dtype}{a.shape}".encode())
            digest.update(np.ascontiguousarray(a).tobytes())
        return digest.hexdigest()[:16]


def _leaves(structure) -> list[np.ndarray]:
    if isinstance(structure, dict):
        return [a for k in sorted(structure) for a in _leaves(structure[k])]
    if isinstance(structure, (list, tuple)):
        return [a for item in structure for a in _leaves(item)]
    return [] if structure is None else [np.asarray(structure)]


def _rows(structure, indices: np.ndarray):
    if isinstance(structure, dict):
        return {k: _rows(v, indices) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_rows(v, indices) for v in structure)
    return None if structure is None else np.asarray(structure)[indices]


def read_once(dataset) -> tuple:
    """A finite ``tf.data.Dataset`` of batches, read once (``tfps.keras``'s elastic fit, and
    ``UserTask`` with ``elastic``): (x, y, sample_weight) of every example in that pass's order,
    as NumPy arrays in the elements' structure (``keras.utils.unpack_x_y_sample_weight`` reads
    an element; y and sample_weight None where the elements have none), and the batch size
    (its first batch's). An endless dataset (``repeat()``) and a tuple of more than three
    are refused (``TaskError``)."""
    import keras
    import tensorflow as tf
    from keras.src import tree

    if int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY:
        raise TaskError("an infinite dataset (repeat()) has no epoch of examples to deal; give a finite one "
                        "(no repeat())")
    parts = []
    for element in dataset.as_numpy_iterator():
        if isinstance(element, (tuple, list)) and len(element) > 3:  # Keras' own refusal prints the arrays
            raise TaskError(f"the dataset's elements must be x, (x, y) or (x, y, sample_weight); got a tuple of "
                            f"{len(element)}")
        parts.append(keras.utils.unpack_x_y_sample_weight(element))
    if not parts:
        raise TaskError("the dataset is empty")
    joined = tuple(None if parts[0][i] is None else tree.map_structure(lambda *a: np.concatenate(a),
                                                                        *[p[i] for p in parts])
                   for i in range(3))
    first = next(a for a in tree.flatten(parts[0][0]) if a is not None)
    return (*joined, int(first.shape[0]))


def _per_example(loss) -> Callable:
    """A loss name, function or ``keras.losses.Loss`` as fn(y_true, y_pred) -> per-example losses.
    Labels of shape (n,) meet predictions of shape (n, 1) as ``model.fit`` lets them."""
    import keras

    fn = loss if isinstance(loss, keras.losses.Loss) else keras.losses.get(loss)
    if isinstance(fn, keras.losses.Loss):
        fn = fn.call
    if not callable(fn):
        raise TaskError(f"unknown loss {loss!r}")
    return lambda y_true, y_pred: fn(_same_rank(y_true, y_pred), y_pred)


def _same_rank(y_true, y_pred):
    """``y_true`` with a trailing axis of 1 added (or removed) to match ``y_pred``'s rank."""
    import tensorflow as tf

    if len(y_true.shape) == len(y_pred.shape) - 1 and y_pred.shape[-1] == 1:
        return tf.expand_dims(y_true, -1)
    if len(y_true.shape) == len(y_pred.shape) + 1 and y_true.shape[-1] == 1:
        return tf.squeeze(y_true, -1)
    return y_true


def _metric(spec, loss):
    """A metric name or object; "accuracy" resolved by the loss, as ``model.compile`` does."""
    import keras

    if isinstance(spec, str) and spec in ("accuracy", "acc"):
        name = loss if isinstance(loss, str) else getattr(loss, "name", "") or getattr(loss, "__name__", "")
        kinds = {"sparse_categorical": "SparseCategoricalAccuracy", "categorical": "CategoricalAccuracy",
                 "binary": "BinaryAccuracy"}  # the first that the loss's name contains
        kind = next((k for part, k in kinds.items() if part in name), "Accuracy")
        return getattr(keras.metrics, kind)(name="accuracy")
    metric = keras.metrics.get(spec)
    if isinstance(metric, keras.metrics.Metric):
        return metric
    return keras.metrics.MeanMetricWrapper(metric, name=getattr(metric, "__name__", str(spec)))


# -- from a configuration ---------------------------------------------------------------
def from_config(config, model_fn: Callable | None = None, dataset_fn: Callable | None = None,
                loss=None, metrics=None) -> Task:
    """The task a ``WorkerConfig`` names: built-in names, ``module:function`` specs, or functions given."""
    user_model = model_fn is not None or is_function_spec(config.model)
    user_data = dataset_fn is not None or is_function_spec(config.dataset)
    if not user_model and not user_data:
        return BuiltinTask(config)
    if not (user_model and user_data):
        raise TaskError("a model function goes with a dataset function: give both --model module:function and "
                        "--dataset module:function (the built-in models fit only the built-in datasets)")
    model_fn = model_fn or load_function(config.model, "--model")
    dataset_fn = dataset_fn or load_function(config.dataset, "--dataset")
    return UserTask(model_fn, dataset_fn, global_batch_size=config.global_batch_size, epochs=config.epochs,
                    steps=config.steps, seed=config.seed, loss=loss, metrics=metrics,
                    sharding=config.dataset_sharding, worker_index=config.worker_index,
                    num_workers=config.num_workers, elastic=config.elastic)


__all__ = ["InputContext", "Task", "TaskError", "BuiltinTask", "UserTask", "DealtArrays", "from_config", "load_function",
           "read_once"]
