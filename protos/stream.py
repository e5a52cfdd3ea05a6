"""Streaming tensors in ~2 MiB chunks: framing and reassembly, for both ends.

    # sender: a header message, then the tensors' bytes cut into chunks
    yield pb.PushChunk(header=...)
    for buffers in stream.chunk_buffers(arrays):      # lists of memoryviews
        yield buffers                                  # framed by stream.serializer(...)

    # receiver: metas from the header, then every chunk into one buffer
    layout = stream.Layout.of(header.gradients)        # checks dtypes and shapes
    assembler = stream.Assembler(layout, buffer)       # buffer: layout.nbytes, reusable
    for chunk in rest: assembler.feed(chunk)           # chunk: a zero-copy memoryview
    arrays = assembler.arrays()                        # views into buffer

Why by hand: a chunk as a protobuf message costs a parse that copies its
``bytes`` and an object per MiB. A data message (``PushChunk``/``PullChunk`` with
only field 2 set) is framed here as exactly protobuf's encoding, tag ``0x12``
and the varint length before the bytes, built with one ``bytes.join`` straight
from the arrays' memory (the one copy grpcio forces on the send side: it takes
only ``bytes``), and parsed as a ``memoryview`` into gRPC's own buffer (no copy).
Headers go through protobuf as usual. A peer written against the .proto in any
language reads and writes the same bytes.

Chunk size (``CHUNK_BYTES``): 2 MiB. Measured on a 2-core machine, push + pull
of 100 MiB, tuned allocator, median of 7: 256 KiB 1.2 GiB/s, 512 KiB 1.6,
1 MiB 2.1, 2 MiB 2.4-2.5, 3 MiB 2.3, 4 MiB 1.4. Small tensors share a chunk; a
large one is cut across chunks anywhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Iterator, Sequence

import numpy as np

from protos import codec
from protos import tfps_pb2 as pb
from protos.codec import from_bfloat16, to_bfloat16

CHUNK_BYTES = 2 << 20
_DATA_TAG = 0x12  # field 2, wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame(buffers: Sequence) -> bytes:
    """One data message holding the concatenation of ``buffers`` (bytes-like objects)."""
    n = sum(memoryview(b).nbytes for b in buffers)
    return b"".join([bytes([_DATA_TAG]), _varint(n), *buffers])


def unframe(data: bytes) -> memoryview | None:
    """The data of a data-only message as a zero-copy view, or None if ``data`` is
    anything else (a header, an empty message, several fields)."""
    if len(data) < 2 or data[0] != _DATA_TAG:
        return None
    n, shift, i = 0, 0, 1
    while i < len(data) and i < 11:
        byte = data[i]
        n |= (byte & 0x7F) << shift
        i += 1
        if not byte & 0x80:
            break
        shift += 7
    else:
        return None
    if i + n != len(data):
        return None
    return memoryview(data)[i:]


def serializer(message_class):
    """A request/response serializer: protobuf messages as usual, a list of
    buffers as one framed data message."""

    def serialize(msg) -> bytes:
        if isinstance(msg, message_class):
            return msg.SerializeToString()
        return frame(msg)

    return serialize


def deserializer(message_class):
    """Data-only messages become a ``memoryview``, anything else a ``message_class``.
    Raises protobuf's DecodeError on bytes that are neither."""

    def parse(data: bytes):
        view = unframe(data)
        if view is not None:
            return view
        return message_class.FromString(data)

    return parse


def chunk_buffers(arrays: Iterable[np.ndarray], chunk_bytes: int | None = None) -> Iterator[list[memoryview]]:
    """The arrays' bytes laid end to end, cut into lists of views of about ``chunk_bytes``.

    Each array must be C-contiguous and little-endian already (``to_wire``).
    """
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    pending: list[memoryview] = []
    size = 0
    for a in arrays:
        view = memoryview(np.asarray(a, order="C").reshape(-1).view(np.uint8))
        pos = 0
        while pos < view.nbytes:
            take = min(chunk_bytes - size, view.nbytes - pos)
            pending.append(view[pos:pos + take])
            size += take
            pos += take
            if size == chunk_bytes:
                yield pending
                pending, size = [], 0
    if pending:
        yield pending


# -- wire dtypes -------------------------------------------------------------------
WIRE_DTYPES = ("float32", "float16", "bfloat16")


def to_wire(array: np.ndarray, wire: str = "float32") -> tuple[int, np.ndarray]:
    """(DType code, little-endian contiguous array) of ``array`` sent as ``wire``.

    ``float16``/``bfloat16`` apply to float32 arrays only; other arrays travel as they are.
    """
    array = np.asarray(array)
    if wire != "float32" and array.dtype == np.float32:
        if wire == "float16":
            return pb.FLOAT16, np.asarray(array.astype("<f2"), order="C")
        if wire == "bfloat16":
            return pb.BFLOAT16, to_bfloat16(array).astype("<u2", copy=False)
        raise codec.CodecError(f"wire dtype must be one of {WIRE_DTYPES}, got {wire!r}")
    code = codec.dtype_code(array.dtype)
    return code, np.asarray(array.astype(codec.numpy_dtype(code), copy=False), order="C")  # keeps 0-d 0-d


_BFLOAT16_BITS = np.dtype("<u2")


def _itemsize(code: int) -> tuple[np.dtype, bool]:
    """(dtype of the bytes, is bfloat16)."""
    if code == pb.BFLOAT16:
        return _BFLOAT16_BITS, True
    return codec.numpy_dtype(code), False


# -- receiving ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    code: int  # wire DType
    dtype: np.dtype  # of the bytes (uint16 bit patterns for bfloat16)
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def bfloat16(self) -> bool:
        return self.code == pb.BFLOAT16


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each tensor of a stream lies in the concatenated bytes."""

    entries: tuple[Entry, ...]
    nbytes: int

    @classmethod
    def of(cls, metas: Iterable[pb.TensorMeta]) -> "Layout":
        """Check every meta (known dtype, non-negative shape, unique name) and lay them out.

        Raises ``codec.CodecError`` naming the tensor."""
        entries, offset, seen = [], 0, set()
        for m in metas:
            if m.name in seen:
                raise codec.CodecError(f"tensor {m.name!r} appears twice in one message")
            seen.add(m.name)
            try:
                dtype, _ = _itemsize(m.dtype)
            except codec.CodecError as e:
                raise codec.CodecError(f"tensor {m.name!r}: {e}") from None
            shape = tuple(int(d) for d in m.shape)
            if any(d < 0 for d in shape):
                raise codec.CodecError(f"tensor {m.name!r}: negative dimension in shape {list(shape)}")
            nbytes = math.prod(shape) * dtype.itemsize
            entries.append(Entry(m.name, m.dtype, dtype, shape, offset, nbytes))
            offset += nbytes
        return cls(tuple(entries), offset)


def widened(entries: Iterable[Entry], raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors of ``raw`` (as the bytes lie) with bfloat16 bit patterns widened to float32."""
    return {e.name: from_bfloat16(raw[e.name]) if e.bfloat16 else raw[e.name] for e in entries}


def arriving(entries: Iterable[Entry], specs: dict) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of a push's gradients as the store will see them
    (``codec.as_gradients``): bfloat16 always float32 (the decoders), float16 float32 for a
    float32 variable; ``specs``: the store's name -> (dtype, shape)."""
    widened = lambda e: e.bfloat16 or (e.code == pb.FLOAT16 and e.name in specs  # noqa: E731
                                       and specs[e.name][0] == np.float32)
    return {e.name: (np.dtype(np.float32) if widened(e) else e.dtype, e.shape) for e in entries}


def metas(arrays: dict[str, tuple[int, np.ndarray]], rows: dict[str, np.ndarray] | None = None) -> list[pb.TensorMeta]:
    """TensorMeta of each (code, wire array) in order; one named in ``rows`` is sparse, those its rows."""
    rows = rows or {}
    return [pb.TensorMeta(name=n, dtype=code, shape=a.shape, sparse=n in rows,
                          rows=rows[n].tolist() if n in rows else ()) for n, (code, a) in arrays.items()]


class Assembler:
    """Copies a stream's chunks into one buffer of ``layout.nbytes`` bytes, in order."""

    def __init__(self, layout: Layout, buffer: np.ndarray | None = None):
        if buffer is None:
            buffer = np.empty(layout.nbytes, np.uint8)
        if buffer.dtype != np.uint8 or buffer.ndim != 1 or buffer.nbytes < layout.nbytes:
            raise ValueError(f"buffer must be uint8 with at least {layout.nbytes} bytes")
        self.layout = layout
        self.buffer = buffer
        self.received = 0

    def feed(self, chunk: memoryview) -> None:
        n = chunk.nbytes
        if self.received + n > self.layout.nbytes:
            raise codec.CodecError(f"the stream sent more than the {self.layout.nbytes} bytes its header announced")
        self.buffer[self.received:self.received + n] = np.frombuffer(chunk, np.uint8)
        self.received += n

    def arrays(self) -> dict[str, np.ndarray]:
        """Every tensor, as a view into the buffer (bfloat16 widened to a new float32 array)."""
        if self.received != self.layout.nbytes:
            raise codec.CodecError(f"the stream ended after {self.received} of the {self.layout.nbytes} bytes "
                                   "its header announced")
        raw = {}
        for e in self.layout.entries:
            try:
                raw[e.name] = np.frombuffer(self.buffer, e.dtype, count=math.prod(e.shape),
                                            offset=e.offset).reshape(e.shape)
            except ValueError as err:
                raise codec.CodecError(f"tensor {e.name!r}: shape {list(e.shape)} cannot be represented: {err}") \
                    from None
        return widened(self.layout.entries, raw)
