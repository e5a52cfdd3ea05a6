"""The one gradient path: what a worker pushes for a model and a batch, and what it pulls.

    grads = Gradients(model, loss)                 # loss(y_true, y_pred) -> per-example losses
    loss, payload = grads(x, y, pulled)            # a float, and {variable path: as pushed}
    payload = as_pushed(model, tape_grads, pulled) # the same, for gradients a tape gave by hand
    set_values(model, pulled); get_values(model)   # what the server holds of the model, by path

Every runner goes through here: the built-in models (``worker.task.BuiltinTask``,
loss ``worker.model.loss``), your Keras model (``worker.task.UserTask``, its
compiled loss), the ``Session``'s wrapped ``GradientTape`` (``worker.api``), and
the one-process reference the sync mode is compared with bit for bit
(``tf_strategies.reference``).

**The loss** is the mean of ``loss`` over this worker's examples (each scaled by its
``sample_weight`` where given, Keras' sum over the batch size) plus the model's
regularization losses (``model.losses``); the server takes the batch-weighted
mean of the workers' gradients, which equals MirroredStrategy's
``compute_average_loss`` over the global batch with summed replica gradients.

**What a push carries** (``as_pushed``), by variable path: each trainable variable's
gradient as a NumPy array (``None``, a variable the loss does not reach, as zeros), an
embedding lookup's as ``SparseRows`` (``to_pushable``; the callers' ``sparse_rule`` is the
server's ``--sparse-rule``, ``Registration.sparse_rule``), and each floating non-trainable
variable's (BatchNorm's moving statistics) change since ``pulled``, which the server adds.
Integer state (a dropout seed) stays in the worker.
"""

from __future__ import annotations

from typing import Callable, Mapping

import numpy as np

from ps_common.sparse import SparseRows


def trainable(model) -> list:
    return list(model.trainable_variables)


def non_trainable(model) -> list:
    """Floating non-trainable variables (BatchNorm statistics): kept on the server."""
    return [v for v in model.non_trainable_variables if np.dtype(v.dtype).kind == "f"]


def get_values(model) -> dict[str, np.ndarray]:
    """What the server holds of ``model``: its trainable and floating non-trainable values by path."""
    return {v.path: np.array(v.numpy()) for v in trainable(model) + non_trainable(model)}


def set_values(model, values: Mapping[str, np.ndarray]) -> None:
    for v in trainable(model) + non_trainable(model):
        v.assign(values[v.path])


class Gradients:
    """The mean loss and its gradients of ``model`` on a batch, as pushed (module docstring):
    ``loss(y_true, y_pred)`` gives the per-example losses.

    The tape runs in one ``tf.function``, traced on the first call; the same inputs
    give the same bits in every process with the same TensorFlow settings."""

    def __init__(self, model, loss: Callable):
        import tensorflow as tf

        self.model, self.loss = model, loss
        self.variables = trainable(model)

        @tf.function(reduce_retracing=True)
        def tape(x, y, sample_weight=None):
            with tf.GradientTape() as t:  # Keras' sum over the batch size: sum(loss * weight) / examples
                per = loss(y, model(x, training=True))
                if sample_weight is not None:
                    per = per * tf.reshape(tf.cast(sample_weight, per.dtype), tf.shape(per))
                mean = tf.reduce_mean(per)
                if model.losses:  # regularization; known when tracing
                    mean += tf.add_n(model.losses)
            return mean, t.gradient(mean, self.variables)

        self.tape = tape

    def __call__(self, x, y, pulled: Mapping[str, np.ndarray], sample_weight=None,
                 sparse_rule: str = "sum") -> tuple[float, dict]:
        """(mean loss, ``{path: as pushed}``) on ``x, y``; ``pulled`` are the values the model
        held before this forward pass (what the non-trainable changes are measured from);
        ``sparse_rule``: the server's (module docstring)."""
        loss, grads = self.tape(x, y, sample_weight)
        return float(loss), as_pushed(self.model, dict(zip((v.path for v in self.variables), grads)), pulled,
                                      sparse_rule)


def as_pushed(model, grads: Mapping, pulled: Mapping[str, np.ndarray], sparse_rule: str = "sum",
              now: Mapping[str, np.ndarray] | None = None) -> dict:
    """``{path: as pushed}`` of every trainable variable of ``model`` (``grads`` by path; a
    missing one or ``None`` counts as zero) and every floating non-trainable one (its change
    since ``pulled``, to its value ``now`` where given, else the model's); ``sparse_rule``:
    the server's (module docstring)."""
    out = {v.path: np.zeros(v.shape, np.dtype(v.dtype)) if grads.get(v.path) is None
           else to_pushable(grads[v.path], tuple(v.shape), sparse_rule == "keras") for v in trainable(model)}
    out.update(changes(model, pulled, now))
    return out


def zeros(pulled: Mapping[str, np.ndarray]) -> dict:
    """A push of nothing (a worker whose share of a tiny last batch is empty: weight 0)."""
    return {name: np.zeros_like(v) for name, v in pulled.items()}


def changes(model, pulled: Mapping[str, np.ndarray], now: Mapping[str, np.ndarray] | None = None) -> dict:
    """``{path: value now - value pulled}`` of the floating non-trainable variables."""
    return {v.path: (np.asarray(v.numpy()) if now is None else now[v.path]) - pulled[v.path]
            for v in non_trainable(model)}


def to_pushable(g, shape: tuple[int, ...], occurrences: bool = False):
    """One gradient of a variable of ``shape`` as pushed: a NumPy array, or for an
    ``IndexedSlices`` touching fewer than half the rows, ``SparseRows`` of the rows it
    touched in increasing order, each once (repeats summed in their original order).
    ``occurrences`` (``--sparse-rule keras``): an ``IndexedSlices`` as ``SparseRows`` of its
    indices and values as they are, whatever it touches."""
    import tensorflow as tf

    if not isinstance(g, tf.IndexedSlices):
        return np.asarray(g)
    indices, values = g.indices.numpy().astype(np.int64), g.values.numpy()
    if occurrences:
        return SparseRows(indices, values)
    order = np.argsort(indices, kind="stable")
    rows, starts = np.unique(indices[order], return_index=True)
    summed = np.add.reduceat(values[order], starts, axis=0) if len(rows) else values[:0]
    if 2 * len(rows) < shape[0]:
        return SparseRows(rows, summed)
    dense = np.zeros(tuple(shape), values.dtype)
    dense[rows] = summed
    return dense


__all__ = ["Gradients", "as_pushed", "zeros", "changes", "to_pushable", "trainable", "non_trainable", "get_values",
           "set_values"]
