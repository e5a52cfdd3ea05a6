"""Sparse gradients (``ps_common.sparse.SparseRows``): checked, and either stepped row by row
or made dense.

    g = SparseRows(rows=np.array([3, 7, 3]), values=np.ones((3, 16), np.float32))
    check("emb", g, shape=(1000, 16), dtype=np.float32)
    rows, values = combine(g)                                 # rows [3, 7], row 3 summed
    dense = densify(g, shape=(1000, 16), dtype=np.float32)    # the same, as the whole table
    row_wise(spec, "exact")                                   # None: step only touched rows
    mean = weighted_mean([(b0, grads0), (b1, grads1)])        # a sync round, sparse kept sparse

An embedding lookup touches only the rows of the ids in the batch, and
TensorFlow gives their gradient as ``tf.IndexedSlices``; a worker pushes those
rows and their indices instead of the whole table (``PushRequest`` tensors with
``sparse`` set). What the server does with them is ``--sparse-updates``
(``SPARSE_UPDATES``):

- ``exact`` (the default): where the optimizer leaves a row with a zero gradient
  bit for bit unchanged, only the touched rows are stepped (``row_wise`` says
  when: plain SGD, no momentum; Adagrad; neither with weight decay, clipnorm,
  global_clipnorm or use_ema). The result is the dense step's, bit for bit
  (``tests/core/test_row_sparse.py``; Keras itself: ``tests/parity``). Every other
  optimizer is stepped densely, as Keras does for the whole table: Adam's moments
  decay on untouched rows too.
- ``lazy``: every optimizer steps only the touched rows and their slots, the
  others keep their moments as they were (TF Addons' ``LazyAdam``: ``m``, ``v``
  of the touched rows updated, the bias correction at the variable's step count).
  Not what Keras computes; opt-in. ``weight_decay`` then decays the touched rows
  only (TF Addons' ``DecoupledWeightDecayExtension`` on a sparse gradient does
  the same). ``clipnorm``, ``global_clipnorm`` and ``use_ema`` need the whole
  variable, as do Lamb (its trust ratio), Adafactor (its RMS and factored moments) and
  Muon (its orthogonalized matrices): refused at initialization (``lazy_refusal``).
- ``dense``: every sparse gradient is made dense on arrival and stepped as the
  whole table (what tfps did before; for comparisons).

``--sparse-rule`` (``SPARSE_RULES``) says what a row that occurs several times in one
sparse gradient gets (an id looked up twice in a batch):

- ``sum`` (the default): its occurrences summed first (``combine``, in the order given,
  as ``densify`` sums them), then one step with the sum: the dense gradient's step, bit
  for bit; what TF1's optimizers and ElasticDL do.
- ``keras``: each occurrence as Keras 3's TensorFlow backend applies a ``tf.IndexedSlices``
  (``optimizers.Occurrences``; each optimizer's ``_slices_step``): an elementwise op such
  as Adam's ``square(g)`` per occurrence, then added up where it meets a dense slot, and
  ``assign_sub`` of slices occurrence after occurrence. So a repeated row's step is
  one-process ``model.fit``'s, bit for bit. The worker then pushes every occurrence as
  TensorFlow gave it (``worker.gradients``), and the whole variable is stepped unless
  ``row_wise`` says its rows alone may be (the optimizers whose untouched rows stay as
  they were: SGD without momentum, Adagrad; or ``lazy``). A sync round's gradient is the
  global batch's: every push's occurrences in worker-id order, each scaled by its batch
  weight (``aggregation.RoundSum``). ``optimizers.slices_refusal`` names what it refuses
  at initialization (Adadelta, Lamb, Adafactor).

In a sync round the batch-weighted mean of sparse gradients stays sparse
(``aggregation.RoundSum``): over the union of the workers' rows, exact and rounded
once as the dense mean is, so each of those rows gets the bits the dense mean
gives it (the other rows' mean is zero).

Plain NumPy, like the rest of ``ps_server.core``.
"""

from __future__ import annotations

import numpy as np

from ps_common.sparse import SparseRows
from ps_server.core.errors import InvalidArgument

# --sparse-updates: how a sparse gradient is applied (module docstring).
SPARSE_UPDATES = ("exact", "lazy", "dense")
# --sparse-rule: what a row that occurs several times in one sparse gradient gets (module docstring).
SPARSE_RULES = ("sum", "keras")


def check(name: str, g: SparseRows, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Raise ``InvalidArgument`` unless ``g`` fits a variable of ``shape`` and ``dtype``."""
    if len(shape) < 1:
        raise InvalidArgument(f"sparse gradient for {name!r}: the variable is a scalar; only a variable "
                              f"with rows can take a sparse gradient")
    rows = np.asarray(g.rows)
    if rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise InvalidArgument(f"sparse gradient for {name!r}: rows must be a 1-D integer array")
    if g.values.shape != (len(rows),) + tuple(shape[1:]):
        raise InvalidArgument(f"sparse gradient for {name!r} has shape {list(g.values.shape)} for {len(rows)} "
                              f"row(s); the variable is {list(shape)}, so it must be {[len(rows), *shape[1:]]}")
    if np.dtype(g.values.dtype).newbyteorder("=") != np.dtype(dtype).newbyteorder("="):
        raise InvalidArgument(f"gradient for {name!r} has dtype {np.dtype(g.values.dtype)}, variable has "
                              f"{np.dtype(dtype)}")
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= shape[0]):
        bad = int(rows.min()) if int(rows.min()) < 0 else int(rows.max())
        raise InvalidArgument(f"sparse gradient for {name!r} names row {bad}; the variable has rows 0..{shape[0] - 1}")


def _increasing(rows: np.ndarray) -> bool:
    return bool(np.all(rows[1:] > rows[:-1]))


def densify(g: SparseRows, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The dense gradient: zeros, with ``values`` added at ``rows`` (repeats summed).
    Call ``check`` first."""
    dense = np.zeros(shape, dtype=np.dtype(dtype).newbyteorder("="))
    rows = np.asarray(g.rows, dtype=np.intp)
    if len(rows):
        values = g.values.astype(dense.dtype, copy=False)
        if _increasing(rows):  # strictly increasing, so no repeats (what workers send): a plain copy
            dense[rows] = values
        else:  # repeats add up; np.add.at is exact but several times slower
            np.add.at(dense, rows, values)
    return dense


def combine(g: SparseRows) -> tuple[np.ndarray, np.ndarray]:
    """(rows, values): the distinct rows of ``g`` in increasing order and each one's
    gradient, bit for bit those rows of ``densify(g, ...)`` (a repeated row is summed from
    zero in the order given, as ``np.add.at`` sums it there). Call ``check`` first."""
    rows = np.asarray(g.rows, dtype=np.intp)
    values = g.values.astype(g.values.dtype.newbyteorder("="), copy=False)
    if _increasing(rows):
        return rows, values
    unique, inverse = np.unique(rows, return_inverse=True)
    summed = np.zeros((len(unique),) + values.shape[1:], values.dtype)
    np.add.at(summed, inverse.reshape(-1), values)  # as densify: 0 + v (+ v' ...), in the order given
    return unique, summed


def row_wise(spec, mode: str) -> str | None:
    """None when a sparse gradient of a variable under optimizer ``spec`` is stepped on its
    rows alone with ``--sparse-updates mode``; else why it is stepped densely (one line)."""
    if mode == "dense":
        return "--sparse-updates dense"
    whole = _needs_whole_variable(spec)
    if whole:
        return whole
    if mode == "lazy":
        return None
    if spec.weight_decay is not None:
        return "weight_decay shrinks every row, touched or not"
    if spec.name == "sgd" and not spec.momentum:
        return None
    if spec.name == "adagrad":
        if spec.epsilon == 0 and spec.initial_accumulator_value == 0:
            return "Adagrad with epsilon 0 and initial_accumulator_value 0 divides 0 by 0 on untouched rows"
        return None
    return (f"{spec.name}{' with momentum' if spec.name == 'sgd' else ''} moves rows whose gradient is zero "
            f"(--sparse-updates lazy steps only the touched ones)")


def _needs_whole_variable(spec) -> str | None:
    if spec.clipnorm is not None:
        return "clipnorm takes the norm of the whole variable's gradient"
    if spec.global_clipnorm is not None:
        return "global_clipnorm takes the norm of every gradient of the update"
    if spec.use_ema:
        return "use_ema averages every row of the variable"
    if spec.name == "lamb":
        return "lamb's trust ratio takes the norms of the whole variable and its update"
    if spec.name == "adafactor":
        return "adafactor scales by the RMS of the whole variable and factors its moments over rows and columns"
    if spec.name == "muon":
        return "muon orthogonalizes a matrix's whole update"
    return None


def lazy_refusal(spec) -> str | None:
    """Why ``--sparse-updates lazy`` cannot run optimizer ``spec`` (one line), or None."""
    whole = _needs_whole_variable(spec)
    if whole is None:
        return None
    drop = "choose another optimizer" if spec.name in ("lamb", "adafactor", "muon") else "drop that option"
    return (f"--sparse-updates lazy steps only the rows a push touches, but {whole}: {drop}, or run "
            f"the server with --sparse-updates exact")
