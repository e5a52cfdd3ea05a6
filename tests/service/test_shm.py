"""The same-host fast path (protos/shm.py, PSClient(shm=True), ps-server --no-shm).

    python -m pytest tests/service/test_shm.py -q

Claims under test, each a sentence of the docstrings of protos/shm.py,
worker/client.py or ps_server/service.py:
- "Only then do pushes put the gradients into the push segment and pulls have
  the server write the values into the pull segment": and the results are
  bit-identical to the streams', sync and async, whatever the wire dtype.
- the probe: "the server must read the token back and write a nonce into the
  other"; it succeeds on one host, and fails (the client streams) when the
  server cannot see the segments or does not answer.
- "A failed probe (..., one started with --no-shm, ...) or any 'shared memory:'
  refusal on a call makes the client log one line and stream from then on; a
  refused call is repeated over the stream, which is safe because a refusal
  changes nothing on the server."
- "Every refusal of that path (disabled, a bad name, a missing or foreign
  segment, an offset or size that does not fit) is FAILED_PRECONDITION
  'shared memory: ...', raised before anything is applied or written."
- security: only names with the prefix and without '/', no symbolic or hard
  links, only the server's own user's files; push segments mapped read-only.
- "The values a pull returns are copies, valid after the next pull."
- "close() unlinks the segments"; the server drops its mappings when the
  worker leaves; after a push that timed out the client takes a new segment,
  so the round still waiting for it reads what was pushed.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from protos import shm, stream, wire
from protos import tfps_pb2 as pb
from ps_server.config import ServerConfig
from ps_server.server import RunningServer, build_server
from worker.client import PSClient, PSClientError

from tests.service.conftest import CLIENT_TIMEOUT, DEFAULT_BARRIER_TIMEOUT

Code = grpc.StatusCode
ADAM = {"name": "adam", "learning_rate": 0.01, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}
SGD = {"name": "sgd", "learning_rate": 0.5}


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "dense/kernel": rng.standard_normal((300, 257)).astype(np.float32),  # ~300 KiB: a few stream chunks
        "dense/bias": rng.standard_normal(257).astype(np.float32),
        "scale": np.array(1.5, np.float32),  # 0-d
        "wide": rng.standard_normal(33).astype(np.float64),  # 8-byte items after odd-sized float32 ones
    }


def gradients(step: int, worker: int, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + worker)
    return {n: rng.standard_normal(a.shape).astype(a.dtype) for n, a in values.items()}


@pytest.fixture
def cluster(bg):
    """``cluster.server(mode, num_workers, shm=True) -> RunningServer``, ``cluster.client(running,
    shm=True, **kw) -> PSClient``; all stopped and closed at teardown (servers first, see conftest)."""

    class Cluster:
        def __init__(self):
            self.servers: list[RunningServer] = []
            self.clients: list[PSClient] = []

        def server(self, mode="async", num_workers=1, shm=True, barrier_timeout=DEFAULT_BARRIER_TIMEOUT):
            running = build_server(ServerConfig(host="127.0.0.1", port=0, mode=mode, num_workers=num_workers,
                                                barrier_timeout=barrier_timeout, shm=shm)).start()
            self.servers.append(running)
            return running

        def client(self, running, shm=True, **kw) -> PSClient:
            # small_bytes=0: these small models take the shared-memory path (or the streams),
            # not the unary calls a client uses for payloads under worker.client.SMALL_BYTES.
            c = PSClient(running.address, timeout=CLIENT_TIMEOUT, shm=shm, **{"small_bytes": 0, **kw})
            self.clients.append(c)
            return c

    c = Cluster()
    yield c
    for running in c.servers:
        running.stop(grace=0.5)
    for client in c.clients:
        client.close()


class Recorder:
    """Wraps a client's stream calls and keeps the headers that went out and came back
    (a sync push streamed as PushPull counts as a streamed push)."""

    def __init__(self, client: PSClient):
        self.push_headers: list[pb.PushHeader] = []
        self.pull_headers: list[pb.PullHeader] = []
        push, pull = client.streams.push_stream, client.streams.pull_stream
        push_pull = client.streams.push_pull_stream

        def push_stream(messages, **kw):
            messages = list(messages)
            self.push_headers.append(messages[0].header)
            return push(iter(messages), **kw)

        def push_pull_stream(messages, **kw):
            messages = list(messages)
            self.push_headers.append(messages[0].header)
            return push_pull(iter(messages), **kw)

        client.streams.push_pull_stream = push_pull_stream

        def pull_stream(request, **kw):
            replies = list(pull(request, **kw))
            self.pull_headers.append(replies[0].header)
            return iter(replies)

        client.streams.push_stream, client.streams.pull_stream = push_stream, pull_stream

    @property
    def shm_pushes(self) -> int:
        return sum(1 for h in self.push_headers if h.shm_name)

    @property
    def shm_pulls(self) -> int:
        return sum(1 for h in self.pull_headers if h.shm)


def _bytes(values: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple, bytes]]:
    return {n: (a.dtype.str, a.shape, a.tobytes()) for n, a in values.items()}


def _segments(client: PSClient) -> list[str]:
    shared = client.shared_memory
    return [s.segment.name for s in (shared.push_slot, shared.pull_slot) if s.segment is not None]


def _exists(name: str) -> bool:
    return os.path.lexists(os.path.join(shm.DIRECTORY, name))


# -- the probe ------------------------------------------------------------------------------------


def test_the_probe_succeeds_on_the_same_host_and_names_findable_segments(cluster):
    running = cluster.server()
    client = cluster.client(running)
    assert not client.shm_active  # nothing before register
    reg = client.register(0, 1)
    assert reg.shm and client.shm_active and client.shm_fallback_reason is None
    names = _segments(client)
    assert len(names) == 2 and all(n.startswith(f"tfps-{os.getpid()}-") and _exists(n) for n in names)
    assert sorted(running.servicer.segments.names().values()) == sorted(names)
    push_mapping = running.servicer.segments.get(0, "push", names[0], writable=False)
    assert not push_mapping.array.flags.writeable  # the server maps push segments read-only
    assert oct(os.stat(os.path.join(shm.DIRECTORY, names[0])).st_mode & 0o777) == "0o600"


def test_a_client_without_shm_sends_no_probe_and_the_server_maps_nothing(cluster):
    running = cluster.server()
    client = cluster.client(running, shm=False)
    assert client.register(0, 1).shm is False
    assert _segments(client) == [] and running.servicer.segments.names() == {}


def test_a_server_that_cannot_see_the_segments_makes_the_client_stream(cluster, monkeypatch, tmp_path, caplog):
    """Another host: the client's segments live in a /dev/shm the server does not see."""
    running = cluster.server()
    client = cluster.client(running)
    create, directory = shm.Segment.create, shm.DIRECTORY

    def elsewhere(size):
        monkeypatch.setattr(shm, "DIRECTORY", str(tmp_path))
        try:
            return create(size)
        finally:
            monkeypatch.setattr(shm, "DIRECTORY", directory)

    monkeypatch.setattr(shm.Segment, "create", staticmethod(elsewhere))
    with caplog.at_level(logging.WARNING, logger="worker.client"):
        assert client.register(0, 1).shm is False
    assert "no segment" in client.shm_fallback_reason and "another host" in client.shm_fallback_reason
    assert [r.getMessage() for r in caplog.records if r.name == "worker.client"] == [
        f"same-host shared memory off for {running.address}, streaming over gRPC from now on: "
        f"{client.shm_fallback_reason}"]
    assert _segments(client) == [] and running.servicer.segments.names() == {}


def test_a_server_that_does_not_answer_the_probe_makes_the_client_stream(cluster, monkeypatch):
    """An older server ignores the probe's fields: the answer is empty, not the token."""
    running = cluster.server()
    monkeypatch.setattr(running.servicer, "_probe", lambda *a: (b"", b""))
    client = cluster.client(running)
    assert client.register(0, 1).shm is False
    assert "does not see this client's segments" in client.shm_fallback_reason


# -- bit-identical to the streams -----------------------------------------------------------------


def _train(cluster, mode: str, use_shm: bool, steps: int, num_workers: int, bg, wire_dtype="float32",
           without=()):
    running = cluster.server(mode, num_workers)
    clients = [cluster.client(running, shm=use_shm, grad_wire_dtype=wire_dtype) for _ in range(num_workers)]
    recorders = [Recorder(c) for c in clients]
    for w, c in enumerate(clients):
        assert c.register(w, num_workers).shm is use_shm
    values0 = {n: a for n, a in model().items() if n not in without}
    clients[0].initialize(0, values0, ADAM)
    pulled = []
    for step in range(steps):
        calls = []
        for w, c in enumerate(clients):
            version, _ = c.pull(w)
            calls.append(bg(c.push, w, step, version, 3 + w, gradients(step, w, values0)))
        for call in calls:
            call.result(timeout=60)
        pulled.append(_bytes(clients[0].pull(0)[1]))
    return running, pulled, recorders


@pytest.mark.parametrize("mode, num_workers", [("sync", 2), ("async", 1)])
def test_shm_pushes_and_pulls_give_bit_identical_results_to_the_streams(cluster, bg, mode, num_workers):
    streamed, by_stream, _ = _train(cluster, mode, False, 4, num_workers, bg)
    shared, by_shm, recorders = _train(cluster, mode, True, 4, num_workers, bg)
    assert by_shm == by_stream
    assert _bytes(shared.core.pull()[1]) == _bytes(streamed.core.pull()[1])
    assert shared.core.status().pushes_applied == streamed.core.status().pushes_applied
    for r in recorders:  # and the fast path really carried them: every push, and every pull but the first
        assert r.shm_pushes == len(r.push_headers) == 4
        assert r.shm_pulls >= len(r.pull_headers) - 1 and r.pull_headers[0].shm_bytes_needed > 0
    assert streamed.servicer.segments.names() == {}
    assert shared.servicer.buffers.allocated == 0  # no gradient went through a receive buffer


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_half_precision_gradients_through_shm_are_applied_as_through_the_streams(cluster, bg, wire_dtype):
    # bfloat16 without the 0-d variable: stream.to_bfloat16 turns a 0-d array into shape [1]
    # (np.ascontiguousarray), which the server refuses on either path.
    without = ("scale",) if wire_dtype == "bfloat16" else ()
    _, by_stream, _ = _train(cluster, "async", False, 2, 1, bg, wire_dtype, without=without)
    _, by_shm, (recorder,) = _train(cluster, "async", True, 2, 1, bg, wire_dtype, without=without)
    assert by_shm == by_stream and recorder.shm_pushes == 2


def test_pulled_values_are_the_clients_own_and_stay_valid_after_the_next_pull(cluster):
    running = cluster.server()
    client = cluster.client(running)
    client.register(0, 1)
    client.initialize(0, model(), SGD)
    ones = {n: np.ones_like(a) for n, a in model().items()}
    recorder = Recorder(client)
    client.pull(0)  # streamed: the first pull sizes the segment
    client.push(0, 0, 0, 1, ones)
    _, first = client.pull(0)
    kept = _bytes(first)
    client.push(0, 1, 1, 1, ones)
    _, second = client.pull(0)
    assert recorder.shm_pulls == 2 and _bytes(first) == kept and _bytes(second) != kept
    segment = client.shared_memory.pull_slot.segment.array
    assert not any(np.shares_memory(a, segment) for a in (*first.values(), *second.values()))
    assert all(not a.flags.writeable for a in second.values())


def test_a_push_that_finds_the_segment_busy_streams_instead_of_waiting(cluster, bg):
    """Two workers' pushes through one client, in one sync round: the second must not wait
    for the segment the first holds at the barrier."""
    running = cluster.server("sync", 2)
    client = cluster.client(running)
    client.register(0, 2)
    client.register(1, 2)
    client.initialize(0, {"w": np.zeros(4, np.float32)}, SGD)
    recorder = Recorder(client)
    first = bg(client.push, 0, 0, 0, 1, {"w": np.full(4, 2.0, np.float32)})
    second = bg(client.push, 1, 0, 0, 1, {"w": np.full(4, 4.0, np.float32)})
    assert first.result(timeout=30).version == second.result(timeout=30).version == 1
    assert sorted(bool(h.shm_name) for h in recorder.push_headers) == [False, True]
    assert running.core.pull()[1]["w"].tolist() == [-1.5] * 4  # 0 - 0.5 * mean(2, 4)


# -- falling back --------------------------------------------------------------------------------


def test_a_server_started_with_no_shm_makes_the_client_fall_back_and_still_train(cluster, caplog):
    running = cluster.server(shm=False)
    client = cluster.client(running)
    with caplog.at_level(logging.WARNING, logger="worker.client"):
        reg = client.register(0, 1)
        client.initialize(0, {"w": np.array([1.0, 2.0], np.float32)}, SGD)
        for step in range(3):
            version, _ = client.pull(0)
            client.push(0, step, version, 1, {"w": np.array([1.0, -1.0], np.float32)})
        version, values = client.pull(0)
    assert not reg.shm and not client.shm_active
    assert client.shm_fallback_reason == ("the server refused the probe: shared memory: refused: "
                                          "this server was started with --no-shm")
    assert len([r for r in caplog.records if r.name == "worker.client"]) == 1  # said once
    assert version == 3 and values["w"].tolist() == [-0.5, 3.5]  # 3 SGD steps of lr 0.5, by hand
    assert _segments(client) == [] and running.servicer.segments.names() == {}


def test_a_push_refused_for_shared_memory_is_repeated_over_the_stream_and_applied_once(cluster, caplog):
    running = cluster.server()
    client = cluster.client(running)
    assert client.register(0, 1).shm
    client.initialize(0, {"w": np.array([1.0, 2.0], np.float32)}, SGD)
    recorder = Recorder(client)
    running.servicer.allow_shm = False  # from now on this server refuses the fast path
    with caplog.at_level(logging.WARNING, logger="worker.client"):
        reply = client.push(0, 0, 0, 1, {"w": np.array([1.0, 1.0], np.float32)})
        client.push(0, 1, 1, 1, {"w": np.array([1.0, 1.0], np.float32)})
    assert reply.version == 1 and not reply.replayed
    assert running.core.pull()[1]["w"].tolist() == [0.0, 1.0]  # two steps, each applied once
    assert [bool(h.shm_name) for h in recorder.push_headers] == [True, False, False]
    assert client.shm_fallback_reason.startswith("shared memory: refused")
    assert len([r for r in caplog.records if r.name == "worker.client"]) == 1
    assert _segments(client) == []


def test_a_pull_whose_segment_vanished_is_repeated_over_the_stream(cluster):
    running = cluster.server()
    client = cluster.client(running)
    client.register(0, 1)
    client.initialize(0, model(), SGD)
    client.pull(0)
    version, before = client.pull(0)
    client.push(0, 0, version, 1, {n: np.ones_like(a) for n, a in before.items()})
    os.unlink(client.shared_memory.pull_slot.segment.path)  # someone cleaned /dev/shm
    version, values = client.pull(0)
    assert version == 1 and client.shm_fallback_reason.startswith("shared memory: no segment")
    assert _bytes(values) == _bytes(running.core.pull()[1])


# -- refusals: precise, and nothing changes ------------------------------------------------------


def _push_call(client: PSClient):
    return client._channel.stream_unary(f"/{wire.SERVICE_NAME}/PushStream",
                                        response_deserializer=pb.PushResponse.FromString)


def _raw_push(client: PSClient, name: str, offsets: list[int], values: dict[str, np.ndarray], extra=()):
    wired = {n: stream.to_wire(np.ones_like(a)) for n, a in values.items()}
    header = pb.PushHeader(worker_id=0, step=0, base_version=0, batch_size=1, gradients=stream.metas(wired),
                           shm_name=name, shm_offsets=offsets)
    messages = [pb.PushChunk(header=header).SerializeToString(), *extra]
    return _push_call(client)(iter(messages), timeout=CLIENT_TIMEOUT)


@pytest.fixture
def refusing(cluster):
    """A server with a registered worker (no fast path of its own) and a segment with the
    gradients of its two variables at offsets 0 and 8192."""
    running = cluster.server()
    client = cluster.client(running, shm=False)
    client.register(0, 1)
    values = {"w": np.arange(1500, dtype=np.float32), "b": np.array([0.5, 0.25], np.float32)}
    client.initialize(0, values, SGD)
    segment = shm.Segment.create(16384)
    segment.array[:6000] = np.ones(1500, np.float32).view(np.uint8)
    segment.array[8192:8200] = np.ones(2, np.float32).view(np.uint8)
    before = _bytes(running.core.pull()[1])
    yield running, client, values, segment, before
    segment.close()


def _refused_precisely(call, running: RunningServer, before, match: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == Code.FAILED_PRECONDITION, e.value.details()
    assert e.value.details().startswith("shared memory: "), e.value.details()
    assert match in e.value.details(), e.value.details()
    assert running.core.store.version == 0 and _bytes(running.core.pull()[1]) == before
    assert running.core.status().pushes_applied == 0


def test_the_refusal_fixture_segment_is_accepted(refusing):
    running, client, values, segment, before = refusing
    assert _raw_push(client, segment.name, [0, 8192], values).version == 1
    assert running.core.pull()[1]["b"].tolist() == [0.0, -0.25]


@pytest.mark.parametrize("name, match", [
    ("evil-segment", "must start with 'tfps-'"),
    ("tfps-x/../../etc/passwd", "no '/'"),
    ("tfps-" + "a" * 300, "at most 255"),
    ("tfps-nul\x00x", "must start with"),
    ("tfps-1-doesnotexist", "no segment 'tfps-1-doesnotexist'"),
])
def test_a_segment_name_without_the_prefix_or_not_there_is_refused_and_changes_nothing(refusing, name, match):
    running, client, values, _, before = refusing
    _refused_precisely(lambda: _raw_push(client, name, [0, 8192], values), running, before, match)


@pytest.mark.parametrize("offsets, match", [
    ([0, 16384 - 4], "8 bytes at offset 16380 do not fit"),
    ([0, -8], "at offset -8 do not fit"),
    ([12000, 0], "6000 bytes at offset 12000 do not fit"),
    ([0], "1 offsets for 2 tensors"),
    ([], "0 offsets for 2 tensors"),
])
def test_a_segment_too_small_for_the_header_is_refused_and_changes_nothing(refusing, offsets, match):
    running, client, values, segment, before = refusing
    _refused_precisely(lambda: _raw_push(client, segment.name, offsets, values), running, before, match)


def test_a_segment_of_the_wrong_size_for_a_model_is_refused_and_changes_nothing(refusing):
    running, client, values, _, before = refusing
    small = shm.Segment.create(1)  # one page: too small for w's 6000 bytes
    try:
        _refused_precisely(lambda: _raw_push(client, small.name, [0, 8192], values), running, before,
                           f"tensor 'w': 6000 bytes at offset 0 do not fit in segment {small.name!r} of 4096 bytes")
    finally:
        small.close()


def test_links_and_other_users_segments_are_refused(refusing, tmp_path, monkeypatch):
    running, client, values, segment, before = refusing
    target = tmp_path / "secret"
    target.write_bytes(b"\x00" * 16384)
    link = shm.new_name()
    os.symlink(target, os.path.join(shm.DIRECTORY, link))
    hard = shm.new_name()
    os.link(segment.path, os.path.join(shm.DIRECTORY, hard))
    try:
        _refused_precisely(lambda: _raw_push(client, link, [0, 8192], values), running, before, "cannot be opened")
        _refused_precisely(lambda: _raw_push(client, hard, [0, 8192], values), running, before, "has 2 links")
    finally:
        os.unlink(os.path.join(shm.DIRECTORY, link))
        os.unlink(os.path.join(shm.DIRECTORY, hard))
    foreign = shm.Segment.create(16384)
    try:
        if os.geteuid() == 0:
            os.chown(foreign.path, 65534, -1)
        else:  # not root: cannot give a file away; let the server believe it runs as someone else
            monkeypatch.setattr(shm.os, "geteuid", lambda: os.getuid() + 1)
        _refused_precisely(lambda: _raw_push(client, foreign.name, [0, 8192], values), running, before,
                           "belongs to uid")
    finally:
        foreign.close()


def test_a_push_through_shared_memory_with_data_messages_is_refused(refusing):
    running, client, values, segment, before = refusing
    with pytest.raises(grpc.RpcError) as e:
        _raw_push(client, segment.name, [0, 8192], values, extra=[stream.frame([b"\x00" * 8])])
    assert e.value.code() == Code.INVALID_ARGUMENT and "carries no data messages" in e.value.details()
    assert running.core.store.version == 0 and _bytes(running.core.pull()[1]) == before


def test_a_server_with_shm_forbidden_refuses_a_push_naming_a_segment(refusing):
    running, client, values, segment, before = refusing
    running.servicer.allow_shm = False
    _refused_precisely(lambda: _raw_push(client, segment.name, [0, 8192], values), running, before, "--no-shm")


@pytest.mark.parametrize("worker_id, name, match", [
    (0, "nope", "must start with"),
    (0, "tfps-1-gone", "no segment"),
    (-1, None, "needs a registered worker id"),
])
def test_a_pull_naming_a_bad_segment_is_refused_and_writes_nothing(refusing, worker_id, name, match):
    running, client, _, segment, before = refusing
    segment.array[:] = 7
    request = pb.PullRequest(worker_id=worker_id, shm_name=name or segment.name)
    with pytest.raises(grpc.RpcError) as e:
        list(client.streams.pull_stream(request, timeout=CLIENT_TIMEOUT))
    assert e.value.code() == Code.FAILED_PRECONDITION and e.value.details().startswith("shared memory: ")
    assert match in e.value.details()
    assert (segment.array == 7).all()


def test_a_pull_into_a_segment_too_small_streams_and_says_how_big_it_should_be(refusing):
    running, client, values, segment, _ = refusing
    small = shm.Segment.create(1)
    try:
        replies = list(client.streams.pull_stream(pb.PullRequest(worker_id=0, shm_name=small.name), timeout=30))
    finally:
        small.close()
    header = replies[0].header
    assert not header.shm and header.shm_bytes_needed == shm.needed_bytes([6000, 8]) == 6016 + 8
    assert sum(len(r) for r in replies[1:]) == 6008  # the values came as data messages


# -- lifetime -------------------------------------------------------------------------------------


def test_segments_are_removed_after_close_and_the_server_unmaps_them_when_the_worker_leaves(cluster):
    running = cluster.server()
    client = cluster.client(running)
    client.register(0, 1)
    client.initialize(0, model(), SGD)
    for _ in range(2):
        version, values = client.pull(0)
    client.push(0, 0, version, 1, {n: np.ones_like(a) for n, a in values.items()})
    names = _segments(client)
    assert len(names) == 2 and all(_exists(n) for n in names)
    assert sorted(running.servicer.segments.names().values()) == sorted(names)
    client.leave(0)
    assert running.servicer.segments.names() == {}
    client.close()
    assert not any(_exists(n) for n in names)
    client.close()  # harmless to repeat


def test_a_segment_dropped_without_close_is_unlinked_by_the_garbage_collector():
    segment = shm.Segment.create(1)
    name = segment.name
    del segment
    gc.collect()
    assert not _exists(name)


def test_a_grown_segment_replaces_the_old_one_on_both_sides(cluster):
    running = cluster.server()
    client = cluster.client(running)
    client.register(0, 1)
    client.initialize(0, model(), SGD)
    old = _segments(client)
    client.pull(0)
    client.pull(0)
    new = _segments(client)
    assert new[0] == old[0] and new[1] != old[1] and not _exists(old[1])  # the pull segment grew
    assert running.servicer.segments.names()[(0, "pull")] == new[1]


def test_a_push_that_timed_out_leaves_its_segment_to_the_round_and_the_next_one_uses_a_new_one(cluster, bg):
    running = cluster.server("sync", 2)
    client = cluster.client(running)
    other = cluster.client(running, shm=False)
    client.register(0, 2)
    other.register(1, 2)
    client.initialize(0, {"w": np.zeros(4, np.float32)}, SGD)
    first = _segments(client)[0]
    with pytest.raises(PSClientError) as e:  # waits at the barrier for worker 1, gives up
        client.push(0, 0, 0, 1, {"w": np.full(4, 2.0, np.float32)}, timeout=0.5)
    assert e.value.code == Code.DEADLINE_EXCEEDED
    assert client.shared_memory.push_slot.segment is None and not _exists(first)  # unlinked; the server maps it
    assert other.push(1, 0, 0, 1, {"w": np.full(4, 4.0, np.float32)}).version == 1
    assert running.core.pull()[1]["w"].tolist() == [-1.5] * 4  # 0 - 0.5 * mean(2, 4): what worker 0 pushed
    assert client.shm_active  # a timeout is no reason to stop using shared memory
    mine = bg(client.push, 0, 1, 1, 1, {"w": np.full(4, 1.0, np.float32)})
    assert other.push(1, 1, 1, 1, {"w": np.full(4, 3.0, np.float32)}).version == 2
    assert mine.result(timeout=30).version == 2
    assert _segments(client)[0] != first and running.core.pull()[1]["w"].tolist() == [-2.5] * 4


_EXIT = r"""
import os, sys
from protos import shm
mine = shm.Segment.create(1)
child = os.fork()
if child == 0:  # a forked child that exits normally must not unlink its parent's segment
    sys.exit(0)
os.waitpid(child, 0)
print(os.getpid(), mine.name, os.path.exists(mine.path), flush=True)
"""


def test_segments_are_unlinked_at_interpreter_exit_by_their_creator_only():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", _EXIT], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    assert run.returncode == 0, run.stderr
    pid, name, existed_after_child_exit = run.stdout.split()
    assert existed_after_child_exit == "True" and name.startswith(f"tfps-{pid}-")
    assert not _exists(name)
