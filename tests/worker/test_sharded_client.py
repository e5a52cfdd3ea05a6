"""ShardedClient against in-memory fake shards: how calls are split and replies combined.

    python -m pytest -q tests/worker/test_sharded_client.py

No sockets: each fake shard has PSClient's methods and keeps its variables in a
dict (a push applies SGD with learning rate 1). ``tests/cluster/test_shards.py``
runs the same with real ps-server processes.
"""

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest

from protos import tfps_pb2 as pb
from ps_common.reasons import Reason
from ps_common.settings import ConfigError
from worker.client import PSClientError, PushReply, Registration
from worker.sharded_client import (PUSH_RULES, REGISTRATION_RULES, STATUS_RULES, WORKER_RULES, ShardedClient,
                                   combine_records, combine_statuses)

VALUES = {
    "dense/kernel": np.arange(2 * 70000, dtype=np.float32).reshape(70000, 2),  # 547 KiB: cut in two
    "dense/bias": np.array([1.0, 2.0], np.float32),
    "out/kernel": np.ones((2, 3), np.float32),
}
SGD = {"name": "sgd", "learning_rate": 1.0}


class FakeShard:
    def __init__(self, address, mode="sync", num_workers=2, version=0, round=0, replicas_to_aggregate=0):
        self.address, self.mode, self.num_workers = address, mode, num_workers
        self.version, self.round, self.replicas_to_aggregate = version, round, replicas_to_aggregate
        self.incarnation = f"inc-{address}"
        self.values = None
        self.pushes, self.heartbeats = [], []
        self.reply = None  # a PushReply to answer instead of the computed one
        self.fail = None  # a PSClientError to raise from every data call
        self.block = None  # an Event a push waits for
        self.restored = False  # sync: restored from a checkpoint, no push taken since

    def register(self, worker_index, num_workers=0, name="", timeout=None):
        self.registered = getattr(self, "registered", []) + [worker_index]
        if worker_index == -1:  # auto: this fake hands out the highest index, to tell it apart from 0
            worker_index = self.num_workers - 1
        return Registration(worker_id=worker_index, mode=self.mode, num_workers=self.num_workers,
                            initialized=self.values is not None, version=self.version, barrier_timeout=60.0,
                            round=self.round, lease_timeout=10.0, incarnation=self.incarnation,
                            round_restored=self.restored)

    def initialize(self, worker_id, variables, optimizer, non_trainable=(), clip_group=None, data_plan=None,
                   shard_group=None):
        if self.values is not None:
            return False
        self.values = {n: np.array(a) for n, a in variables.items()}
        self.clip_group, self.data_plan, self.shard_group = clip_group, data_plan, shard_group
        return True

    def pull(self, worker_id=-1, names=()):
        if self.fail:
            raise self.fail
        if self.values is None:
            raise PSClientError("Pull", self.address, grpc.StatusCode.FAILED_PRECONDITION, "variables not initialized",
                                Reason.NOT_INITIALIZED)
        return self.version, {n: self.values[n].copy() for n in (names or self.values)}

    def push(self, worker_id, step, base_version, batch_size, gradients, loss=0.0, timeout=None, metrics=None,
             set_learning_rates=(), micro_batch=-1, task=-1):
        if self.block:
            self.block.wait(10)
        if self.fail:
            raise self.fail
        self.pushes.append({"step": step, "base_version": base_version, "gradients": dict(gradients),
                            "metrics": metrics, "set_learning_rates": set_learning_rates, "micro_batch": micro_batch,
                            "task": task, "at": time.monotonic()})
        if self.reply:
            return self.reply
        for n, g in gradients.items():
            self.values[n] = self.values[n] - g
        self.version += 1
        self.round = step + 1
        # A one-worker round: the sum of the metrics is this push's own.
        return PushReply(version=self.version, staleness=self.version - 1 - base_version, contributors=2,
                         next_step=step + 1, learning_rate=(set_learning_rates or [1.0])[0], metrics=dict(metrics or {}))

    def heartbeat(self, worker_id, step=-1, timeout=5.0):
        self.heartbeats.append(step)
        return self.incarnation

    def leave(self, worker_id):
        pass

    def status(self):
        return pb.StatusResponse(mode=pb.SYNC if self.mode == "sync" else pb.ASYNC, num_workers=self.num_workers,
                                 version=self.version, round=self.round,
                                 replicas_to_aggregate=self.replicas_to_aggregate)

    def close(self):
        pass


def cluster(n=2, **kwargs):
    shards = [FakeShard(f"h:{i}", **kwargs) for i in range(n)]
    return shards, ShardedClient([s.address for s in shards], clients=shards)


def test_initialize_sends_each_shard_its_pieces_and_pull_joins_them_bit_exactly():
    shards, client = cluster()
    client.register(0, 2)
    assert client.initialize(0, VALUES, SGD) is True
    held = [set(s.values) for s in shards]
    assert held[0] | held[1] == {"dense/kernel/part_0_of_2", "dense/kernel/part_1_of_2", "dense/bias", "out/kernel"}
    assert not held[0] & held[1]
    version, values = client.pull(0)
    assert version == 0 and list(values) == list(VALUES)
    assert all(values[n].tobytes() == VALUES[n].tobytes() for n in VALUES)
    assert client.initialize(0, VALUES, SGD) is False  # repeating it is harmless


@pytest.mark.parametrize("norm", [{"global_clipnorm": 1.0}, {"clipnorm": 1.0}, {"name": "lamb"}])
def test_an_optimizer_taking_a_variable_s_norm_gets_every_variable_whole(norm):
    """A variable cut in slices would give each shard its slice's norm (or add global_clipnorm's
    squares in another order): with such an optimizer the chief's plan cuts none."""
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    assert any(p.parts > 1 for p in client.placement.pieces)  # the same model is cut without one
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, {**SGD, **norm})
    assert all(p.parts == 1 for p in client.placement.pieces)
    assert sorted(n for s in shards for n in s.values) == sorted(VALUES)


def test_global_clipnorm_tells_every_shard_its_clip_group():
    """The shards take one norm together (ps_server/core/clip_group.py): each is told the
    shards, its own index and every piece in the model's order."""
    shards = [FakeShard(f"h:{i}") for i in range(2)]
    client = ShardedClient([s.address for s in shards], clients=shards)
    client.register(0, 2)
    client.initialize(0, VALUES, {**SGD, "global_clipnorm": 1.0})
    assert [s.clip_group for s in shards] == [{"shards": ["h:0", "h:1"], "shard": i, "order": list(VALUES)}
                                              for i in range(2)]


def test_a_worker_that_did_not_initialize_learns_the_placement_from_the_shards():
    shards, chief = cluster()
    chief.register(0, 2)
    chief.initialize(0, VALUES, SGD)
    other = ShardedClient([s.address for s in shards], clients=shards)
    other.register(1, 2)
    assert other.placement is None
    _, values = other.pull(1)
    assert {p.name: p.shard for p in other.placement.pieces} == {p.name: p.shard for p in chief.placement.pieces}
    assert all(values[n].tobytes() == VALUES[n].tobytes() for n in VALUES)
    _, some = other.pull(1, ["dense/bias"])
    assert list(some) == ["dense/bias"]


def test_wait_initialized_waits_until_every_shard_is_initialized():
    shards, client = cluster()
    client.register(1, 2)
    with pytest.raises(PSClientError, match="still not initialized after 0.2 s"):
        client.wait_initialized(1, 0.2)
    ShardedClient([s.address for s in shards], clients=shards).initialize(0, VALUES, SGD)
    _, values = client.wait_initialized(1, 5)
    assert set(values) == set(VALUES)


def test_pull_returns_the_smallest_version_and_push_sends_each_shard_its_own():
    shards, client = cluster(mode="async")
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    shards[0].version, shards[1].version = 7, 5
    version, _ = client.pull(0)
    assert version == 5
    grads = {n: np.ones_like(a) for n, a in VALUES.items()}
    reply = client.push(0, 3, version, 32, grads)
    assert [s.pushes[-1]["base_version"] for s in shards] == [7, 5]
    assert reply.version == 6 and reply.staleness == 0  # min of (8, 6); max staleness of (0, 0)
    _, values = client.pull(0)
    assert all(np.array_equal(values[n], VALUES[n] - 1) for n in VALUES)


def test_push_replies_combine_as_documented():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    version, _ = client.pull(0)
    shards[0].reply = PushReply(version=9, staleness=0, contributors=2, next_step=1, replayed=True)
    shards[1].reply = PushReply(version=8, staleness=2, contributors=1, next_step=1, replayed=False)
    reply = client.push(0, 0, version, 32, {n: np.zeros_like(a) for n, a in VALUES.items()})
    assert reply == PushReply(version=8, staleness=2, contributors=1, dropped=False, next_step=1, replayed=False)


def test_set_learning_rates_go_to_every_shard_and_metrics_to_shard_0_whose_sum_is_the_reply_s():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    version, _ = client.pull(0)
    metrics = {"acc/total": np.array([3.0], np.float32)}
    reply = client.push(0, 0, version, 32, {n: np.zeros_like(a) for n, a in VALUES.items()}, metrics=metrics,
                        set_learning_rates=(0.25, 0.5))
    assert [p["set_learning_rates"] for p in (shards[0].pushes[-1], shards[1].pushes[-1])] == [(0.25, 0.5)] * 2
    assert shards[0].pushes[-1]["metrics"] is metrics and shards[1].pushes[-1]["metrics"] is None
    assert reply.learning_rate == 0.25 and list(reply.metrics) == ["acc/total"]
    assert reply.metrics["acc/total"] is metrics["acc/total"]


def test_the_reply_s_learning_rate_and_metrics_are_shard_0_s():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    version, _ = client.pull(0)
    m = {"m": np.array(1.0)}
    shards[0].reply = PushReply(version=1, staleness=0, next_step=1, learning_rate=0.5, metrics=m)
    shards[1].reply = PushReply(version=1, staleness=0, next_step=1, learning_rate=0.75)
    reply = client.push(0, 0, version, 32, {n: np.zeros_like(a) for n, a in VALUES.items()})
    assert (reply.learning_rate, reply.metrics) == (0.5, m)


def test_broadcast_asks_shard_0_alone():
    shards, client = cluster()
    asked = []
    for i, s in enumerate(shards):
        s.broadcast = lambda worker_id, key, value, timeout, i=i: asked.append((i, worker_id, key, value, timeout)) \
            or b"chief's"
    assert client.broadcast(1, "epoch-1", None, 5.0) == b"chief's"
    assert asked == [(0, 1, "epoch-1", None, 5.0)]


def test_registration_combines_the_shards_and_joins_their_incarnations():
    shards, client = cluster()
    shards[0].version, shards[1].version = 4, 3
    shards[0].values = {}
    reg = client.register(1, 2)
    assert (reg.worker_id, reg.mode, reg.num_workers, reg.version) == (1, "sync", 2, 3)
    assert reg.initialized is False  # one shard is not
    assert reg.incarnation == "inc-h:0,inc-h:1"
    assert client.heartbeat(1, 0) == "inc-h:0,inc-h:1"


def test_auto_index_is_assigned_by_the_first_shard_and_registered_as_such_on_the_others():
    shards, client = cluster(3, num_workers=4)
    assert client.register(-1, 4).worker_id == 3
    assert [s.registered for s in shards] == [[-1], [3], [3]]


def test_a_sync_worker_resumes_at_the_round_of_the_shards_that_kept_theirs_and_pushes_every_shard_that_round():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    # Shard 1 restarted from an older checkpoint: it collects round 7, shard 0 round 10.
    shards[0].round, shards[0].version = 10, 10
    shards[1].round, shards[1].version, shards[1].restored = 7, 7, True
    reg = client.register(0, 2)
    assert reg.round == 10 and reg.round_restored
    version, _ = client.pull(0)
    grads = {n: np.zeros_like(a) for n, a in VALUES.items()}
    reply = client.push(0, reg.round, version, 32, grads)
    # The restored shard's first push sets its round: both shards count rounds alike.
    assert [s.pushes[-1]["step"] for s in shards] == [10, 10]
    assert [s.pushes[-1]["base_version"] for s in shards] == [10, 7]
    assert reply.next_step == 11


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_kept_shard_one_round_ahead_does_not_move_the_resume_round(ahead):
    """Worker A's last push (round 10) was taken by one kept shard, whose round then
    completed with worker B's (it is at 11), but not by the restored shard 2: A resumes at
    10 as B did, so both push the restored shard the same rounds; the shard at 11 answers
    A's push of 10 from its record."""
    shards, client = cluster(3)
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    shards[ahead].round, shards[1 - ahead].round = 11, 10
    shards[2].round, shards[2].restored = 3, True
    assert client.register(0, 2).round == 10
    shards[2].round, shards[2].restored = 10, False  # B's first push set its round
    assert client.register(0, 2).round == 10


def test_when_every_shard_was_restored_the_newest_round_is_the_cluster_s():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    shards[0].round, shards[0].restored = 5, True
    shards[1].round, shards[1].restored = 7, True
    assert client.register(0, 2).round == 7


def test_shards_that_disagree_on_mode_or_worker_count_are_refused_naming_them():
    shards = [FakeShard("h:0"), FakeShard("h:1", mode="async")]
    client = ShardedClient(["h:0", "h:1"], clients=shards)
    with pytest.raises(PSClientError) as e:
        client.register(0, 2)
    assert "h:0 runs sync with 2 workers" in str(e.value) and "h:1 runs async with 2 workers" in str(e.value)


def test_shards_with_different_backup_workers_are_refused_and_alike_ones_follow_shard_0():
    shards = [FakeShard("h:0"), FakeShard("h:1", replicas_to_aggregate=1)]
    client = ShardedClient(["h:0", "h:1"], clients=shards)
    with pytest.raises(PSClientError, match=r"different --replicas-to-aggregate \(h:0: 0, h:1: 1\)"):
        client.register(0, 2)
    shards, client = cluster(replicas_to_aggregate=1)
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)  # shard 0 picks each round's contributors: the others follow it
    assert [s.shard_group for s in shards] == [{"shards": ["h:0", "h:1"], "shard": i} for i in (0, 1)]
    shards[0].block = threading.Event()
    threading.Timer(0.2, shards[0].block.set).start()
    client.push(0, 0, 0, 8, {n: np.ones_like(v) for n, v in VALUES.items()}, metrics={"m": np.ones(1)})
    (first,), (last,) = shards[1].pushes, shards[0].pushes
    assert first["at"] < last["at"] and first["metrics"] is None and last["metrics"] is not None


def test_shards_that_disagree_on_dropped_raise():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    version, _ = client.pull(0)
    shards[0].reply = PushReply(version=1, staleness=0, contributors=1, dropped=True, next_step=1)
    with pytest.raises(PSClientError, match="disagree.*h:0: dropped, h:1: applied"):
        client.push(0, 0, version, 32, {n: np.zeros_like(a) for n, a in VALUES.items()})


def test_an_error_from_one_shard_propagates_naming_that_shard():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    shards[1].fail = PSClientError("Pull", "h:1", grpc.StatusCode.UNAVAILABLE, "connection refused")
    with pytest.raises(PSClientError) as e:
        client.pull(0)
    assert (e.value.call, e.value.address, e.value.code) == ("Pull", "h:1", grpc.StatusCode.UNAVAILABLE)


def test_more_shards_than_pieces_is_a_clear_error():
    shards, client = cluster(4)
    client.register(0, 2)
    with pytest.raises(ConfigError, match="h:3 would hold nothing"):
        client.initialize(0, {"w": np.zeros(3, np.float32), "b": np.zeros(1, np.float32)}, SGD)
    assert all(s.values is None for s in shards)  # nothing was sent


def test_heartbeats_reach_the_shards_while_a_push_waits_in_their_barriers():
    shards, client = cluster()
    client.register(0, 2)
    client.initialize(0, VALUES, SGD)
    version, _ = client.pull(0)
    release = threading.Event()
    for s in shards:
        s.block = release
    pusher = threading.Thread(target=client.push, args=(0, 0, version, 32, {n: np.zeros_like(a) for n, a in
                                                                           VALUES.items()}))
    pusher.start()
    try:
        assert client.heartbeat(0, 0) == "inc-h:0,inc-h:1"  # not queued behind the push
        assert all(s.heartbeats == [0] for s in shards) and all(s.pushes == [] for s in shards)
    finally:
        release.set()
        pusher.join(10)
    assert all(len(s.pushes) == 1 for s in shards)


def test_combined_status_counts_a_worker_as_left_only_when_it_left_every_shard():
    a = pb.StatusResponse(version=5, round=5, examples_applied=320, num_parameters=10, incarnation="a",
                          workers=[pb.WorkerStatus(worker_id=0, left=True, pushes=5),
                                   pb.WorkerStatus(worker_id=1, left=True, pushes=5)])
    b = pb.StatusResponse(version=4, round=4, examples_applied=256, num_parameters=7, incarnation="b",
                          workers=[pb.WorkerStatus(worker_id=0, left=True, pushes=4),
                                   pb.WorkerStatus(worker_id=1, left=False, pushes=4)])
    s = combine_statuses([a, b])
    assert (s.version, s.round, s.examples_applied, s.num_parameters, s.incarnation) == (4, 5, 256, 17, "a,b")
    assert [(w.worker_id, w.left, w.pushes) for w in s.workers] == [(0, True, 4), (1, False, 4)]


@pytest.mark.parametrize("message, rules", [(pb.StatusResponse, STATUS_RULES), (pb.WorkerStatus, WORKER_RULES)],
                         ids=["StatusResponse", "WorkerStatus"])
def test_every_status_field_has_exactly_one_combine_rule(message, rules):
    fields = [f.name for f in message.DESCRIPTOR.fields]
    assert [n for n in fields if n not in rules] == [], "fields without a rule"
    assert [n for n in rules if n not in fields] == [], "rules for no field"


@pytest.mark.parametrize("record, rules", [(Registration, REGISTRATION_RULES), (PushReply, PUSH_RULES)],
                         ids=["Registration", "PushReply"])
def test_every_registration_and_push_reply_field_has_exactly_one_combine_rule(record, rules):
    assert sorted(f.name for f in dataclasses.fields(record)) == sorted(rules)


def test_combined_status_keeps_the_staleness_settings_and_takes_the_largest_counters_and_times():
    a = pb.StatusResponse(mode=pb.SSP, staleness=3, max_ahead=2, stale_gradient_policy="drop", max_staleness=5,
                          pushes_scaled=4, workers=[pb.WorkerStatus(worker_id=0, work_s=0.5, wait_s=0.1, pushes=3)])
    b = pb.StatusResponse(mode=pb.SSP, staleness=3, max_ahead=1, stale_gradient_policy="drop", max_staleness=5,
                          pushes_scaled=6, workers=[pb.WorkerStatus(worker_id=0, work_s=0.2, wait_s=0.3, pushes=3)])
    s = combine_statuses([a, b])
    assert (s.staleness, s.max_ahead, s.stale_gradient_policy, s.max_staleness, s.pushes_scaled) \
        == (3, 2, "drop", 5, 6)
    assert [(w.work_s, w.wait_s) for w in s.workers] == [(0.5, 0.3)]


def test_a_worker_one_shard_never_saw_has_not_left_and_has_no_pushes_there():
    a = pb.StatusResponse(workers=[pb.WorkerStatus(worker_id=0, left=True, pushes=5, last_step=4, worker_name="w0")])
    b = pb.StatusResponse()
    (w,) = combine_statuses([a, b]).workers
    assert (w.worker_id, w.left, w.pushes, w.last_step, w.worker_name) == (0, False, 0, 4, "w0")


def test_combined_registration_takes_all_shards_shm_and_the_shortest_lease():
    regs = [Registration(worker_id=0, mode="sync", num_workers=2, initialized=True, version=1, barrier_timeout=t,
                         lease_timeout=lease, incarnation=f"i{k}", shm=shm)
            for k, (t, lease, shm) in enumerate([(30.0, 10.0, True), (60.0, 4.0, False)])]
    reg = combine_records(regs, REGISTRATION_RULES)
    assert (reg.barrier_timeout, reg.lease_timeout, reg.shm, reg.incarnation) == (60.0, 4.0, False, "i0,i1")


def test_dealt_work_goes_to_the_other_shards_first_and_shard_0_answers():
    """Elastic sync over shards: shard 0 never holds a micro-batch another shard lacks
    (ps_server/core/modes/elastic_mode.py), so the others take it first."""
    shards, client = cluster()
    plan = {"num_examples": 90, "global_batch_size": 16, "seed": 5}
    client.initialize(0, VALUES, SGD, data_plan=plan)
    assert [s.data_plan for s in shards] == [plan, plan]
    assert [s.shard_group for s in shards] == [{"shards": ["h:0", "h:1"], "shard": i} for i in (0, 1)]
    shards[0].block = threading.Event()
    threading.Timer(0.2, shards[0].block.set).start()
    grads = {n: np.ones_like(v) for n, v in VALUES.items()}
    reply = client.push(0, 0, 0, 8, grads, micro_batch=2)
    assert reply.version == shards[0].version == 1
    (first,), (last,) = shards[1].pushes, shards[0].pushes
    assert first["micro_batch"] == last["micro_batch"] == 2 and first["at"] < last["at"]
    shards[1].fail = PSClientError("Push", "h:1", grpc.StatusCode.FAILED_PRECONDITION, "no")
    with pytest.raises(PSClientError, match="no"):
        client.push(0, 1, 1, 8, grads, task=3)
    assert len(shards[0].pushes) == 1  # refused by a follower: shard 0 never saw it


@pytest.mark.parametrize("rounds, ok", [((5, 5), True), ((5, 6), True), ((5, 4), False), ((5, 7), False)])
def test_a_led_job_s_shards_at_parted_rounds_are_refused_at_registration(rounds, ok):
    """A follower may be one round ahead of shard 0 while shard 0 commits; any other
    difference means a shard restarted from an older checkpoint."""
    shards, client = cluster()
    client.initialize(0, VALUES, SGD, data_plan={"num_examples": 90, "global_batch_size": 16, "seed": 5})
    for s, r in zip(shards, rounds):
        s.round = r
    if ok:
        client.register(0, 2)
    else:
        with pytest.raises(PSClientError, match="restarted from an older checkpoint"):
            client.register(0, 2)
