"""Arrays to wire tensors and back, for both ends.

    msg = codec.encode("dense/kernel", array)      # -> tfps_pb2.Tensor
    name, array = codec.decode(msg)               # checks dtype, shape, length

Bytes are little-endian whatever the host. ``decode`` is zero-copy: the array is
a read-only view of the message's bytes (``np.frombuffer``). It raises
``CodecError`` (a ``ValueError``) naming the tensor when the dtype is unknown, a
dimension is negative, the byte length does not match dtype and shape, or the
shape is too big for NumPy; a BFLOAT16 tensor (an optional gradient wire
format) is widened to a new float32 array. ``encode`` raises it, naming the tensor, for a dtype
that cannot travel.
"""

from __future__ import annotations

import math

import numpy as np

from protos import tfps_pb2 as pb
from ps_common.reasons import Reason
from ps_common.sparse import SparseRows


class CodecError(ValueError):
    """A tensor message that cannot be turned into an array."""

    reason = Reason.INVALID


# DType enum value -> little-endian numpy dtype.
_TO_NUMPY = {
    pb.FLOAT16: np.dtype("<f2"),
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT64: np.dtype("<f8"),
    pb.INT32: np.dtype("<i4"),
    pb.INT64: np.dtype("<i8"),
}
_FROM_NUMPY = {dt.newbyteorder("="): code for code, dt in _TO_NUMPY.items()}


def dtype_code(dtype: np.dtype) -> int:
    code = _FROM_NUMPY.get(np.dtype(dtype).newbyteorder("="))
    if code is None:
        supported = ", ".join(str(d) for d in _TO_NUMPY.values())
        raise CodecError(f"dtype {np.dtype(dtype)} cannot travel; supported: {supported}")
    return code


def numpy_dtype(code: int) -> np.dtype:
    try:
        return _TO_NUMPY[code]
    except KeyError:
        raise CodecError(f"unknown wire dtype {code}") from None


def encode(name: str, array: np.ndarray) -> pb.Tensor:
    array = np.asarray(array)
    try:
        code = dtype_code(array.dtype)
    except CodecError as e:
        raise CodecError(f"tensor {name!r}: {e}") from None
    little = array.astype(_TO_NUMPY[code], copy=False)
    # grpcio only takes bytes for a bytes field: this is the one unavoidable copy.
    return pb.Tensor(name=name, dtype=code, shape=array.shape, data=little.tobytes())


def decode(msg: pb.Tensor) -> tuple[str, np.ndarray]:
    bfloat16 = msg.dtype == pb.BFLOAT16  # float32 gradients sent in half the bytes: widened here
    try:
        dtype = np.dtype("<u2") if bfloat16 else numpy_dtype(msg.dtype)
    except CodecError as e:
        raise CodecError(f"tensor {msg.name!r}: {e}") from None
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"tensor {msg.name!r}: negative dimension in shape {list(shape)}")
    # Python ints: np.prod in int64 wraps around, and a shape such as
    # [2**32, 2**32] would then "match" zero bytes.
    expected = math.prod(shape) * dtype.itemsize
    if len(msg.data) != expected:
        raise CodecError(
            f"tensor {msg.name!r}: {len(msg.data)} bytes do not match "
            f"shape {list(shape)} of {dtype.newbyteorder('=')} ({expected} bytes)"
        )
    try:
        array = np.frombuffer(msg.data, dtype=dtype).reshape(shape)
    except ValueError as e:  # e.g. [0, 2**62]: zero bytes, yet a shape too big for NumPy
        raise CodecError(f"tensor {msg.name!r}: shape {list(shape)} cannot be represented: {e}") from None
    if bfloat16:
        array = from_bfloat16(array)
    return msg.name, array


def to_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    bits = np.asarray(a, dtype=np.float32, order="C").view(np.uint32)  # keeps 0-d 0-d
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def from_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_many(arrays: dict[str, np.ndarray]) -> list[pb.Tensor]:
    return [encode(name, a) for name, a in arrays.items()]


def decode_many(msgs) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for m in msgs:
        name, array = decode(m)
        if name in out:
            raise CodecError(f"tensor {name!r} appears twice in one message")
        out[name] = array
    return out


# -- a push's gradients, as the server's core takes them -------------------------------------
def sparse_names(metas) -> list[str]:
    """The names of the sparse gradients among ``metas`` (Tensor or TensorMeta); rows on a
    dense one are a CodecError."""
    for m in metas:
        if m.rows and not m.sparse:
            raise CodecError(f"tensor {m.name!r}: rows given but sparse is not set")
    return [m.name for m in metas if m.sparse]


def as_gradients(gradients: dict[str, np.ndarray], metas, specs) -> dict:
    """A push's decoded arrays as the core takes them: a float16 gradient of a float32
    variable widened (bfloat16 ones already are, by the decoders), a sparse one
    (``Tensor.sparse``) as ``SparseRows`` of its rows; every other as it came, for the store
    to check. ``specs()``: the store's name -> (dtype, shape), asked only for float16."""
    if any(g.dtype == np.float16 for g in gradients.values()):
        variables = specs()
        gradients = {name: g.astype(np.float32) if g.dtype == np.float16 and name in variables
                     and variables[name][0] == np.float32 else g for name, g in gradients.items()}
    names = sparse_names(metas)
    if not names:
        return gradients
    rows = {m.name: np.asarray(m.rows, dtype=np.int64) for m in metas if m.sparse}
    return {n: SparseRows(rows[n], g) if n in rows else g for n, g in gradients.items()}

