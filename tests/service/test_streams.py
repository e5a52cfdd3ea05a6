"""The streamed data path (protos/stream.py, PushStream and PullStream).

Claims under test:
- stream.py: data messages are "byte-identical to protobuf's encoding", parsed
  as a zero-copy view; chunks are about ``CHUNK_BYTES`` and "may cut a tensor anywhere".
- PushStream applies exactly what the unary Push applies, whatever the chunking,
  and refuses a bad stream (no header, a second header, bytes missing or extra,
  a wrong shape before any data) with INVALID_ARGUMENT or the core's code,
  changing nothing.
- buffers.py: a streamed gradient lands in a reused buffer, not a fresh one
  every step.
- "A full pull ... gets back only the variables that changed since", and the
  client's values are those of a plain pull.
- float16 / bfloat16 on the wire: the server applies exactly the rounded
  gradient, widened to float32.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos import codec, stream, wire
from protos import tfps_pb2 as pb
from worker.client import PSClient, PSClientError

SGD = {"name": "sgd", "learning_rate": 0.5}


# -- framing and chunking ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 127, 128, 300, 16383, 16384, (1 << 20) + 3])
def test_a_framed_data_message_is_protobufs_own_encoding_and_parses_back_as_a_view(n):
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    framed = stream.frame([data[: n // 2], memoryview(data)[n // 2:]])
    assert framed == pb.PushChunk(data=data).SerializeToString()
    view = stream.deserializer(pb.PushChunk)(framed)
    assert isinstance(view, memoryview) and view.obj is framed and bytes(view) == data


def test_a_header_or_a_message_with_more_fields_is_parsed_by_protobuf():
    header = pb.PushChunk(header=pb.PushHeader(worker_id=3), data=b"xy").SerializeToString()
    parsed = stream.deserializer(pb.PushChunk)(header)
    assert isinstance(parsed, pb.PushChunk) and parsed.header.worker_id == 3 and parsed.data == b"xy"
    assert stream.unframe(b"\x12\x05abc") is None  # announced length does not match


def test_chunks_are_about_chunk_bytes_cut_anywhere_and_lay_the_tensors_end_to_end():
    arrays = [np.arange(n, dtype=np.float32) for n in (3, 70_000, 1, 300_000, 5)]
    chunks = list(stream.chunk_buffers(arrays, chunk_bytes=100_000))
    sizes = [sum(v.nbytes for v in c) for c in chunks]
    assert all(s == 100_000 for s in sizes[:-1]) and 0 < sizes[-1] <= 100_000
    joined = b"".join(b"".join(bytes(v) for v in c) for c in chunks)
    assert joined == b"".join(a.tobytes() for a in arrays)


def test_assembler_rebuilds_every_tensor_and_refuses_too_few_or_too_many_bytes():
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array(2.5), "c": np.zeros((0, 4))}
    wired = {n: stream.to_wire(a) for n, a in arrays.items()}
    layout = stream.Layout.of(stream.metas(wired))
    asm = stream.Assembler(layout)
    chunks = list(stream.chunk_buffers([a for _, a in wired.values()], chunk_bytes=5))
    for c in chunks[:-1]:
        asm.feed(memoryview(stream.frame(c))[2:])
    with pytest.raises(codec.CodecError, match="ended after"):
        asm.arrays()
    asm.feed(memoryview(b"".join(bytes(v) for v in chunks[-1])))
    out = asm.arrays()
    for n, a in arrays.items():
        assert out[n].shape == a.shape and np.array_equal(out[n], a)
    with pytest.raises(codec.CodecError, match="more than the"):
        asm.feed(memoryview(b"x"))


def test_layout_refuses_unknown_dtypes_negative_dimensions_and_repeated_names():
    with pytest.raises(codec.CodecError, match="'x'"):
        stream.Layout.of([pb.TensorMeta(name="x", dtype=99, shape=[1])])
    with pytest.raises(codec.CodecError, match="negative"):
        stream.Layout.of([pb.TensorMeta(name="x", dtype=pb.FLOAT32, shape=[-1])])
    with pytest.raises(codec.CodecError, match="twice"):
        stream.Layout.of([pb.TensorMeta(name="x", dtype=pb.FLOAT32)] * 2)


# -- bfloat16 -------------------------------------------------------------------------------------


def test_bfloat16_rounds_to_nearest_even_and_widens_exactly():
    tiny = np.array([1 << 16], np.uint32).view(np.float32)[0]  # the smallest bfloat16 subnormal
    x = np.array([1.0, -2.5, 2.0**100, tiny, np.inf, -np.inf, 0.0, -0.0], np.float32)
    assert np.array_equal(stream.from_bfloat16(stream.to_bfloat16(x)), x)  # representable: exact
    one = np.float32(1.0).view(np.uint32)
    halfway_even = np.array([one + 0x8000], np.uint32).view(np.float32)  # ties to 1.0 (even)
    halfway_odd = np.array([one + 0x18000], np.uint32).view(np.float32)  # ties up to the even neighbour
    above = np.array([one + 0x8001], np.uint32).view(np.float32)
    assert stream.to_bfloat16(halfway_even)[0] == 0x3F80
    assert stream.to_bfloat16(halfway_odd)[0] == 0x3F82
    assert stream.to_bfloat16(above)[0] == 0x3F81
    nan = stream.from_bfloat16(stream.to_bfloat16(np.array([np.nan, -np.nan], np.float32)))
    assert np.isnan(nan).all()
    scalar = stream.to_bfloat16(np.float32(1.5))
    assert scalar.shape == () and stream.from_bfloat16(scalar) == 1.5
    big = np.array([3.4028235e38], np.float32)  # rounds up past the largest bfloat16: inf, as IEEE says
    assert np.isinf(stream.from_bfloat16(stream.to_bfloat16(big)))[0]


# -- through a real server -------------------------------------------------------------------------


def _start(ps, mode="async", num_workers=1, value=None):
    running, client = ps(mode=mode, num_workers=num_workers)
    for w in range(num_workers):
        client.register(w, num_workers)
    values = value if value is not None else {"w": np.linspace(-1, 1, 300_000, dtype=np.float32),
                                              "b": np.array([0.5, 0.25], np.float32)}
    client.initialize(0, values, SGD)
    return running, client, values


def test_a_push_in_many_small_chunks_applies_exactly_what_a_unary_push_applies(ps, raw_stub):
    running_a, client_a, values = _start(ps)
    running_b, _, _ = _start(ps)
    rng = np.random.default_rng(0)
    g = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in values.items()}
    # streamed, cut into 3 KiB chunks by hand
    wired = {n: stream.to_wire(a) for n, a in g.items()}
    header = pb.PushHeader(worker_id=0, step=0, base_version=0, batch_size=4, gradients=stream.metas(wired))
    messages = [pb.PushChunk(header=header).SerializeToString()] + [
        stream.frame(c) for c in stream.chunk_buffers([a for _, a in wired.values()], chunk_bytes=3000)]
    call = client_a._channel.stream_unary(f"/{wire.SERVICE_NAME}/PushStream")
    reply = pb.PushResponse.FromString(call(iter(messages), timeout=30))
    assert reply.version == 1
    # unary, on the other server
    raw_stub(running_b).Push(pb.PushRequest(worker_id=0, step=0, base_version=0, batch_size=4,
                                            gradients=codec.encode_many(g)), timeout=30)
    a = running_a.core.pull()[1]
    b = running_b.core.pull()[1]
    for n in values:
        assert a[n].tobytes() == b[n].tobytes() == (values[n] - np.float32(0.5) * g[n]).tobytes()


def test_streamed_gradients_land_in_reused_buffers_not_fresh_ones_every_step(ps):
    running, client, values = _start(ps)
    g = {n: np.full_like(a, 1e-3) for n, a in values.items()}
    for step in range(12):
        version, _ = client.pull(0)
        client.push(0, step, version, 1, g)
    assert running.servicer.buffers.allocated == 1


@pytest.mark.parametrize("case, code, match", [
    ("headless", grpc.StatusCode.INVALID_ARGUMENT, "first message must carry the header"),
    ("second header", grpc.StatusCode.INVALID_ARGUMENT, "a second header"),
    ("short", grpc.StatusCode.INVALID_ARGUMENT, "ended after"),
    ("long", grpc.StatusCode.INVALID_ARGUMENT, "more than the"),
    ("wrong shape", grpc.StatusCode.INVALID_ARGUMENT, "has shape \\[3\\], variable has \\[300000\\]"),
    ("unknown variable", grpc.StatusCode.NOT_FOUND, "unknown variable"),
    ("unregistered", grpc.StatusCode.FAILED_PRECONDITION, "not registered"),
    ("nan", grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
])
def test_a_bad_stream_is_refused_with_a_precise_status_and_changes_nothing(ps, case, code, match):
    running, client, values = _start(ps)
    before = {n: a.tobytes() for n, a in running.core.pull()[1].items()}
    g = {n: np.ones_like(a) for n, a in values.items()}
    if case == "nan":
        g["b"] = np.array([np.nan, 0], np.float32)
    wired = {n: stream.to_wire(a) for n, a in g.items()}
    metas = stream.metas(wired)
    if case == "wrong shape":
        metas[0] = pb.TensorMeta(name="w", dtype=pb.FLOAT32, shape=[3])
    if case == "unknown variable":
        metas[1] = pb.TensorMeta(name="nope", dtype=pb.FLOAT32, shape=[2])
    header = pb.PushHeader(worker_id=7 if case == "unregistered" else 0, step=0, base_version=0, batch_size=1,
                           gradients=metas)
    head = pb.PushChunk(header=header).SerializeToString()
    data = [stream.frame(c) for c in stream.chunk_buffers([a for _, a in wired.values()], chunk_bytes=65536)]
    messages = {"headless": data, "second header": [head, data[0], head, *data[1:]],
                "short": [head, *data[:-1]], "long": [head, *data, stream.frame([b"\x00"])]}.get(case, [head, *data])
    call = client._channel.stream_unary(f"/{wire.SERVICE_NAME}/PushStream")
    with pytest.raises(grpc.RpcError) as e:
        call(iter(messages), timeout=30)
    assert e.value.code() == code, e.value.details()
    assert __import__("re").search(match, e.value.details()), e.value.details()
    assert running.core.store.version == 0
    assert {n: a.tobytes() for n, a in running.core.pull()[1].items()} == before
    # and the server goes on: the same client pushes properly
    assert client.push(0, 0, 0, 1, {n: np.zeros_like(a) for n, a in values.items()}).version == 1


def _pulled_names(client: PSClient, **known) -> list[str]:
    replies = list(client.streams.pull_stream(pb.PullRequest(worker_id=0, **known), timeout=30))
    return [m.name for m in replies[0].header.variables]


def test_a_pull_skips_the_variables_unchanged_since_the_version_the_client_holds(ps):
    running, client, values = _start(ps, mode="async")
    inc = running.core.incarnation
    assert _pulled_names(client) == ["w", "b"]
    assert _pulled_names(client, known_version=0, known_incarnation=inc) == []  # nothing changed
    assert _pulled_names(client, known_version=0, known_incarnation="other") == ["w", "b"]  # not our copies
    client.push(0, 0, 0, 1, {n: np.ones_like(a) for n, a in values.items()})
    assert _pulled_names(client, known_version=0, known_incarnation=inc) == ["w", "b"]
    assert _pulled_names(client, known_version=1, known_incarnation=inc) == []
    # one variable updated alone (as an async push does, variable after variable)
    running.core.store.apply_one("b", np.ones(2, np.float32))
    assert _pulled_names(client, known_version=1, known_incarnation=inc) == ["b"]


def test_the_clients_values_after_skipped_pulls_equal_a_plain_pull(ps, raw_stub):
    running, client, values = _start(ps, mode="sync")
    stub = raw_stub(running)
    first_version, first = client.pull(0)
    again_version, again = client.pull(0)
    assert again_version == first_version and all(again[n] is first[n] for n in first)  # from the cache
    rng = np.random.default_rng(1)
    for step in range(3):
        version, _ = client.pull(0)
        client.push(0, step, version, 2, {n: rng.standard_normal(a.shape).astype(np.float32)
                                          for n, a in values.items()})
        version, mine = client.pull(0)
        plain = codec.decode_many(stub.Pull(pb.PullRequest(worker_id=0), timeout=30).variables)
        assert version == step + 1
        assert {n: a.tobytes() for n, a in mine.items()} == {n: a.tobytes() for n, a in plain.items()}
        assert all(not a.flags.writeable for a in mine.values())


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_half_precision_gradients_are_applied_as_the_rounded_values_widened_to_float32(ps, wire_dtype):
    running, _, values = _start(ps, mode="async")
    client = PSClient(running.address, timeout=30, grad_wire_dtype=wire_dtype)
    try:
        g = {n: np.random.default_rng(2).standard_normal(a.shape).astype(np.float32) * 1e-2
             for n, a in values.items()}
        client.push(0, 0, 0, 1, g)
        _, after = running.core.pull()
        for n, a in values.items():
            rounded = g[n].astype(np.float16).astype(np.float32) if wire_dtype == "float16" \
                else stream.from_bfloat16(stream.to_bfloat16(g[n]))
            assert not np.array_equal(rounded, g[n])  # the wire really was narrower
            assert after[n].tobytes() == (a - np.float32(0.5) * rounded).tobytes()
    finally:
        client.close()


def test_an_unknown_wire_dtype_is_refused_when_the_client_is_made():
    with pytest.raises(ValueError, match="grad_wire_dtype"):
        PSClient("127.0.0.1:1", grad_wire_dtype="int8")


def test_a_pull_error_names_the_call_and_keeps_the_servers_explanation(ps):
    running, client = ps(mode="async", num_workers=1)
    client.register(0, 1)
    said = r"Pull to .* FAILED_PRECONDITION \(not-initialized\): variables are not initialized"  # code (reason): text
    with pytest.raises(PSClientError, match=said):
        client.pull(0)


def test_a_small_model_goes_unary_with_the_same_skipping_and_the_same_values(ps, raw_stub):
    """Under SMALL_BYTES a push and a pull are one message each; a pull still skips what
    the client holds, and the values equal a plain pull's."""
    running, client, values = _start(ps, mode="async", value={"w": np.arange(10, dtype=np.float32),
                                                              "b": np.array(0.5, np.float32)})
    calls = []
    for transport in (client.unary, client.calls):  # one message: on the session, or unary
        real = transport.call
        transport.call = lambda name, *a, _real=real, **k: (calls.append(name), _real(name, *a, **k))[1]
    v0, first = client.pull(0)  # no cache yet: streamed, learns the size
    v1, again = client.pull(0)
    assert calls == ["Pull"] and (v0, v1) == (0, 0) and all(again[n] is first[n] for n in first)
    client.push(0, 0, 0, 1, {"w": np.ones(10, np.float32), "b": np.array(1.0, np.float32)})
    version, mine = client.pull(0)
    assert calls == ["Pull", "Push", "Pull"] and version == 1
    plain = codec.decode_many(raw_stub(running).Pull(pb.PullRequest(worker_id=0), timeout=30).variables)
    assert {n: a.tobytes() for n, a in mine.items()} == {n: a.tobytes() for n, a in plain.items()}
    assert mine["b"].shape == () and not mine["w"].flags.writeable
