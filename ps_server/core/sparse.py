"""Sparse gradients (``ps_common.sparse.SparseRows``) checked and made dense on arrival.

    g = SparseRows(rows=np.array([3, 7, 3]), values=np.ones((3, 16), np.float32))
    check("emb", g, shape=(1000, 16), dtype=np.float32)
    dense = densify(g, shape=(1000, 16), dtype=np.float32)   # rows 3 (twice, summed) and 7

An embedding lookup touches only the rows of the ids in the batch, and
TensorFlow gives their gradient as ``tf.IndexedSlices``; a worker pushes those
rows and their indices instead of the whole table (``PushRequest`` tensors with
``sparse`` set). The server scatters them into a dense gradient on arrival and
from then on treats it like any other: sync rounds weight it by batch share,
and the optimizer steps every row. That keeps the result exactly what a dense
push, and TensorFlow's own optimizers given ``IndexedSlices``, compute (Adam's
moments decay on untouched rows too); what is saved is wire bytes, which for an
embedding table is most of a push.

Plain NumPy, like the rest of ``ps_server.core``.
"""

from __future__ import annotations

import numpy as np

from ps_common.sparse import SparseRows
from ps_server.core.errors import InvalidArgument


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


def densify(g: SparseRows, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The dense gradient: zeros, with ``values`` added at ``rows`` (repeats summed).
    Call ``check`` first."""
    dense = np.zeros(shape, dtype=np.dtype(dtype).newbyteorder("="))
    rows = np.asarray(g.rows, dtype=np.intp)
    if len(rows):
        values = g.values.astype(dense.dtype, copy=False)
        if np.all(rows[1:] > rows[:-1]):  # strictly increasing, so no repeats (what workers send): a plain copy
            dense[rows] = values
        else:  # repeats add up; np.add.at is exact but several times slower
            np.add.at(dense, rows, values)
    return dense
