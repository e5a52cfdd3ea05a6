"""The sparse gradient of an embedding: some rows of a variable.

    g = SparseRows(rows=np.array([3, 7, 3]), values=np.ones((3, 16), np.float32))

An embedding lookup touches only the rows of the ids in the batch, and
TensorFlow gives their gradient as ``tf.IndexedSlices``; a worker pushes those
rows and their indices instead of the whole table (``PushRequest`` tensors with
``sparse`` set). The type is shared: the worker builds it, the client sends it,
and the server's core checks it and steps only those rows, or makes it dense
(``ps_server.core.optim.sparse``, ``--sparse-updates``). Plain NumPy.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SparseRows:
    """Rows ``rows`` (int64, 1-D, may repeat: repeated rows add up) of a gradient;
    ``values[i]`` is row ``rows[i]``. Every other row is zero."""

    rows: np.ndarray
    values: np.ndarray

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.values.nbytes)
