"""The codec both ends use: arrays to wire tensors and back.

    python -m pytest tests/service/test_codec.py -q

Rules from protos/codec.py: "Bytes are little-endian whatever the host.
``decode`` is zero-copy: the array is a read-only view of the message's bytes.
It raises ``CodecError`` naming the tensor when the dtype is unknown, a dimension
is negative, the byte length does not match dtype and shape, or the shape is too
big for NumPy."
"""

import numpy as np
import pytest

from protos import codec
from protos import tfps_pb2 as pb

SUPPORTED = {
    np.float16: pb.FLOAT16,
    np.float32: pb.FLOAT32,
    np.float64: pb.FLOAT64,
    np.int32: pb.INT32,
    np.int64: pb.INT64,
}


@pytest.mark.parametrize("dtype", list(SUPPORTED), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4)], ids=str)
def test_round_trip_is_exact_for_every_supported_dtype(dtype, shape):
    rng = np.random.default_rng(0)
    if np.issubdtype(dtype, np.floating):
        array = rng.standard_normal(shape).astype(dtype)
    else:
        info = np.iinfo(dtype)
        array = rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    msg = codec.encode("layer/w", array)
    assert msg.name == "layer/w"
    assert msg.dtype == SUPPORTED[dtype]
    assert tuple(msg.shape) == shape
    assert len(msg.data) == array.size * array.itemsize
    name, back = codec.decode(msg)
    assert name == "layer/w"
    assert back.dtype == np.dtype(dtype)
    assert back.shape == shape
    assert back.tobytes() == array.tobytes()  # bit-identical, NaN patterns and -0.0 included


def test_round_trip_keeps_special_float_values_bit_for_bit():
    array = np.array([np.nan, np.inf, -np.inf, -0.0, np.finfo(np.float32).tiny / 2], dtype=np.float32)
    _, back = codec.decode(codec.encode("special", array))
    assert back.tobytes() == array.tobytes()


@pytest.mark.parametrize("dtype", [">f2", ">f4", ">f8", ">i4", ">i8"])
def test_big_endian_input_travels_as_little_endian_and_decodes_to_same_values(dtype):
    native = np.arange(-3, 9, dtype=np.dtype(dtype).newbyteorder("=")).reshape(3, 4)
    big = native.astype(dtype)
    assert big.dtype.byteorder == ">"
    msg = codec.encode("big", big)
    # The wire always carries little-endian bytes.
    assert msg.data == native.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    _, back = codec.decode(msg)
    np.testing.assert_array_equal(back, native)
    assert back.dtype == np.dtype(dtype).newbyteorder("<")


def test_non_contiguous_input_is_encoded_in_logical_order():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[::2, 1::2].T  # strided, transposed
    _, back = codec.decode(codec.encode("view", view))
    np.testing.assert_array_equal(back, view)


def test_decode_is_zero_copy_and_read_only():
    msg = codec.encode("w", np.arange(1000, dtype=np.float32))
    _, array = codec.decode(msg)
    assert not array.flags.owndata  # a view...
    root = array
    while isinstance(root, np.ndarray):
        root = root.base
    assert isinstance(root, bytes)  # ...of the message's bytes object...
    assert array.ctypes.data == np.frombuffer(root, np.uint8).ctypes.data  # ...at its first byte: no copy
    assert not array.flags.writeable
    with pytest.raises(ValueError):
        array[0] = 1.0


def test_decode_many_returns_every_tensor_by_name():
    arrays = {"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.float64)}
    back = codec.decode_many(codec.encode_many(arrays))
    assert list(back) == ["a", "b"]
    for name in arrays:
        np.testing.assert_array_equal(back[name], arrays[name])
        assert back[name].dtype == arrays[name].dtype


def test_decode_many_rejects_a_name_that_appears_twice():
    msgs = [codec.encode("w", np.ones(2, np.float32)), codec.encode("w", np.zeros(2, np.float32))]
    with pytest.raises(codec.CodecError, match="'w' appears twice"):
        codec.decode_many(msgs)


@pytest.mark.parametrize("cut", [lambda d: d[:-1], lambda d: d + b"\0", lambda d: d[:-8], lambda d: b""],
                         ids=["one_short", "one_extra", "one_element_short", "empty"])
def test_wrong_byte_length_is_rejected_naming_the_tensor(cut):
    good = codec.encode("dense/kernel", np.ones((2, 3), np.float64))
    bad = pb.Tensor(name=good.name, dtype=good.dtype, shape=good.shape, data=cut(good.data))
    with pytest.raises(codec.CodecError, match=r"'dense/kernel'.*do not match shape \[2, 3\]"):
        codec.decode(bad)


def test_negative_dimension_is_rejected_naming_the_tensor():
    bad = pb.Tensor(name="bias", dtype=pb.FLOAT32, shape=[-1], data=b"")
    with pytest.raises(codec.CodecError, match=r"'bias'.*negative dimension"):
        codec.decode(bad)


@pytest.mark.parametrize("code", [pb.DTYPE_UNSPECIFIED, 99])
def test_unknown_wire_dtype_is_rejected_naming_the_tensor(code):
    bad = pb.Tensor(name="emb", dtype=code, shape=[1], data=b"\0\0\0\0")
    with pytest.raises(codec.CodecError, match=rf"'emb'.*unknown wire dtype {code}"):
        codec.decode(bad)


@pytest.mark.parametrize(
    "shape",
    [[2**32, 2**32], [2**62, 4], [3, 2**62, 4], [0, 2**62]],
    ids=["wraps_to_zero", "wraps_to_zero_bytes", "three_dims", "zero_elements_too_big"],
)
def test_shape_whose_size_overflows_is_rejected_naming_the_tensor(shape):
    # int64 products of these shapes wrap to 0, so zero bytes must not "match" them,
    # and the refusal must be a CodecError (INVALID_ARGUMENT), not a bare ValueError.
    bad = pb.Tensor(name="huge", dtype=pb.FLOAT32, shape=shape, data=b"")
    with pytest.raises(codec.CodecError, match="'huge'"):
        codec.decode(bad)


@pytest.mark.parametrize("dtype", [np.bool_, np.uint8, np.complex64, np.object_])
def test_dtype_that_cannot_travel_is_rejected_naming_the_tensor(dtype):
    with pytest.raises(codec.CodecError, match=r"'mask'.*cannot travel"):
        codec.encode("mask", np.zeros(2, dtype=dtype))


def test_codec_error_is_a_value_error():
    assert issubclass(codec.CodecError, ValueError)
