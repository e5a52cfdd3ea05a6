"""Elastic sync over gRPC: a real in-process ps-server with --elastic-min-workers.

The server's side of elastic training end to end through the wire: the chief's data plan
with Initialize, Work, one Push per micro-batch (unary and streamed), the round's answer,
a leaving worker's part moved to the one waiting, and the refusals, made with the
generated stub (ps-worker --elastic makes them in tests/cluster/test_elastic.py).
"""

import grpc
import numpy as np
import pytest

from protos import codec
from protos import tfps_pb2 as pb
from ps_server.config import ServerConfig
from ps_server.server import build_server
from worker.client import PSClient
from tests.core.test_cursor import CLASSES, EXAMPLES, FEATURES, gradient

PLAN = {"num_examples": EXAMPLES, "global_batch_size": 16, "seed": 5}
ADAM = {"name": "adam", "learning_rate": 0.05}


@pytest.fixture
def elastic(raw_stub):
    started = []

    def start(num_workers=3, min_workers=2, micro_batches=4):
        config = ServerConfig(host="127.0.0.1", port=0, mode="sync", num_workers=num_workers,
                              elastic_min_workers=min_workers, micro_batches=micro_batches, barrier_timeout=20.0)
        running = build_server(config).start()
        client = PSClient(running.address, timeout=20.0)
        started.append((running, client))
        return running, client, raw_stub(running)

    yield start
    for running, client in started:
        client.close()
        running.stop(grace=0.5)


def zeros():
    return {"w": np.zeros((FEATURES, CLASSES), np.float32), "b": np.zeros(CLASSES, np.float32)}


def push_request(running, client, worker, work, i=0):
    version, params = client.pull(worker)
    assert version == work.round
    m = work.micro_batches[i]
    indices = running.core.mode.cursor.round(work.round, [worker]).indices(m)
    return pb.PushRequest(worker_id=worker, step=work.round, base_version=work.round, batch_size=work.sizes[i],
                          gradients=codec.encode_many(gradient(params, indices)), micro_batch=m)


def test_a_round_over_the_wire_with_a_worker_leaving_mid_round(elastic, bg):
    running, client, stub = elastic()
    for w in (0, 1):
        client.register(w, 3)
    assert client.initialize(0, zeros(), ADAM, data_plan=PLAN)
    w0, w1 = stub.Work(pb.WorkRequest(worker_id=0)), stub.Work(pb.WorkRequest(worker_id=1))
    assert (list(w0.micro_batches), list(w1.micro_batches), list(w0.sizes)) == ([0, 1], [2, 3], [4, 4])
    first = stub.Push(push_request(running, client, 0, w0, 0))
    assert list(first.assignment.micro_batches) == [1] and first.version == 0
    waiting = bg(stub.Push, push_request(running, client, 0, w0, 1))
    stub.Push(push_request(running, client, 1, w1, 0))
    last = push_request(running, client, 1, w1, 1)
    last.return_values = True  # the round's new parameters come with its answer
    done = stub.Push(last)
    assert not done.HasField("assignment") and done.version == 1 and done.contributors == 2
    assert {t.name for t in done.variables} == {"w", "b"} and done.incarnation
    assert waiting.result(10).version == 1
    # Round 1: worker 1 delivers one micro-batch and leaves; worker 0, waiting, is given the other.
    w0, w1 = stub.Work(pb.WorkRequest(worker_id=0)), stub.Work(pb.WorkRequest(worker_id=1))
    stub.Push(push_request(running, client, 0, w0, 0))
    waiting = bg(stub.Push, push_request(running, client, 0, w0, 1))
    stub.Push(push_request(running, client, 1, w1, 0))
    client.leave(1)
    moved = waiting.result(10)
    assert list(moved.assignment.micro_batches) == [3] and moved.assignment.round == 1
    assert stub.Push(push_request(running, client, 0, moved.assignment)).version == 2
    status = client.status()
    assert status.round == 2 and list(status.active_workers) == [0]
    assert running.core.mode.ledger.count(0) == 32


def test_what_elastic_sync_cannot_take_is_refused_and_changes_nothing(elastic):
    running, client, stub = elastic()
    for w in (0, 1):
        client.register(w, 3)
    with pytest.raises(Exception, match="needs the job's data plan"):
        client.initialize(0, zeros(), ADAM)
    assert client.initialize(0, zeros(), ADAM, data_plan=PLAN)
    work = stub.Work(pb.WorkRequest(worker_id=0))
    request = push_request(running, client, 0, work)
    request.ClearField("micro_batch")
    with pytest.raises(grpc.RpcError) as e:
        stub.Push(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "names its micro-batch" in e.value.details()
    request.micro_batch = 2
    with pytest.raises(grpc.RpcError) as e:
        stub.Push(request)
    assert "dealt to worker 1, not to worker 0" in e.value.details()
    assert running.core.store.version == 0 and stub.Work(pb.WorkRequest(worker_id=0)) == work


def test_a_server_that_is_not_elastic_refuses_a_data_plan_and_work(ps):
    running, client = ps("sync", 1)
    client.register(0, 1)
    with pytest.raises(Exception, match="for elastic sync"):
        client.initialize(0, zeros(), ADAM, data_plan=PLAN)
    assert not running.core.store.initialized


def test_micro_batches_pushed_as_streams_are_folded_like_unary_ones(elastic):
    from protos import stream, wire

    running, client, stub = elastic(num_workers=2, min_workers=1, micro_batches=2)
    client.register(0, 2)
    client.initialize(0, zeros(), ADAM, data_plan=PLAN)
    work = stub.Work(pb.WorkRequest(worker_id=0))
    channel = grpc.insecure_channel(running.address, options=wire.channel_options())
    try:
        call = channel.stream_unary(f"/{wire.SERVICE_NAME}/PushStream", request_serializer=None,
                                    response_deserializer=pb.PushResponse.FromString)
        replies = []
        for i, m in enumerate(work.micro_batches):
            unary = push_request(running, client, 0, work, i)
            arrays = {n: stream.to_wire(g) for n, g in codec.decode_many(unary.gradients).items()}
            header = pb.PushHeader(worker_id=0, step=work.round, base_version=work.round,
                                   batch_size=work.sizes[i], gradients=stream.metas(arrays), micro_batch=m)
            frames = [pb.PushChunk(header=header).SerializeToString()]
            frames += [stream.frame(views) for views in stream.chunk_buffers([a for _, a in arrays.values()])]
            replies.append(call(iter(frames), timeout=20))
    finally:
        channel.close()
    assert list(replies[0].assignment.micro_batches) == [1]
    assert not replies[1].HasField("assignment") and replies[1].version == 1
    assert running.core.mode.ledger.count(0) == 16
