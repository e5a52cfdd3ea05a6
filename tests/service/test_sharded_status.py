"""Two real shards (in-process ps-servers on port 0) behind one ShardedClient: the
combined Status carries every field by its rule, and ps-status and ps-advise show it.

    python -m pytest -q tests/service/test_sharded_status.py

The issue: "combine_statuses ... has already drifted: it drops staleness_bound,
max_ahead, stale_policy, drop_staleness_above, pushes_scaled and each worker's work_s
and wait_s, so ps-status and ps-advise on several shards show less than on one."
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_server.config import ServerConfig
from ps_server.server import build_server
from ps_tools import status as ps_status
from ps_tools.study import advise
from worker.client import PSClient
from worker.sharded_client import STATUS_RULES, WORKER_RULES, ShardedClient

VALUES = {"a": np.zeros(1000, np.float32), "b": np.ones(1000, np.float32)}  # one piece per shard
SGD = {"name": "sgd", "learning_rate": 0.1}
GRADS = {"a": np.full(1000, 0.5, np.float32), "b": np.full(1000, 0.25, np.float32)}


@pytest.fixture
def shards():
    """Two ssp servers (bound 3, policy scale, --max-staleness 5); their addresses."""
    running = [build_server(ServerConfig(host="127.0.0.1", port=0, mode="ssp", num_workers=2, staleness=3,
                                         stale_gradient_policy="scale", max_staleness=5,
                                         barrier_timeout=20.0)).start() for _ in range(2)]
    yield [r.address for r in running]
    for r in running:
        r.stop(grace=0.5)


@pytest.fixture
def trained(shards):
    """Worker 1 pushes step 0; worker 0 pushes steps 0 (stale by one: scaled) and 1, and
    a stale step 2 to shard 0 alone, so the shards' counters differ."""
    with ShardedClient(shards, timeout=30) as w0, ShardedClient(shards, timeout=30) as w1:
        w0.register(0, 2, "w0")
        w1.register(1, 2, "w1")
        w0.initialize(0, VALUES, SGD)
        base0, _ = w0.pull(0)
        base1, _ = w1.pull(1)
        w1.push(1, 0, base1, 8, GRADS)
        w0.push(0, 0, base0, 8, GRADS)
        version, _ = w0.pull(0)
        w0.push(0, 1, version, 8, GRADS)
        piece = {n: GRADS[n] for n in w0.placement.split(GRADS)[0]}
        with PSClient(shards[0], timeout=30) as direct:
            direct.push(0, 2, 0, 8, piece)
        yield w0.statuses(), w0.status()


def test_each_shard_reports_the_staleness_settings_and_counters(trained):
    per_shard, _ = trained
    for s in per_shard:
        assert (s.staleness, s.stale_gradient_policy, s.max_staleness) == (3, "scale", 5)
    assert [s.pushes_scaled for s in per_shard] == [2, 1]  # the direct push reached shard 0 alone
    assert per_shard[0].max_ahead >= 1


def test_the_combined_status_carries_every_field_the_drift_dropped_by_its_rule(trained):
    per_shard, combined = trained
    for name in ("staleness", "max_ahead", "stale_gradient_policy", "max_staleness", "pushes_scaled"):
        assert getattr(combined, name) == STATUS_RULES[name]([getattr(s, name) for s in per_shard]), name
    assert (combined.staleness, combined.stale_gradient_policy, combined.max_staleness) == (3, "scale", 5)
    assert combined.pushes_scaled == 2 and combined.max_ahead == max(s.max_ahead for s in per_shard) >= 1
    for w in combined.workers:
        records = [next(x for x in s.workers if x.worker_id == w.worker_id) for s in per_shard]
        for name in ("work_s", "wait_s"):
            assert getattr(w, name) == WORKER_RULES[name]([getattr(r, name) for r in records]), (w.worker_id, name)
        assert w.wait_s > 0, w.worker_id
    (worker0,) = [w for w in combined.workers if w.worker_id == 0]
    assert worker0.work_s > 0 and worker0.pushes == 2  # 3 pushes on shard 0, 2 on shard 1


def test_ps_status_on_two_shards_shows_the_cluster_block_with_the_combined_fields(shards, trained):
    _, combined = trained
    out = ps_status.snapshot(shards, None, 5.0)
    cluster = out.split("\n\n")[0]
    assert cluster.startswith("cluster of 2 shards  mode ssp"), out
    assert f"scaled {combined.pushes_scaled}" in cluster
    assert f"max ahead {combined.max_ahead} of bound 3" in cluster
    assert "stale policy scale" in cluster
    rows = {line.split()[0]: line.split() for line in cluster.splitlines()[4:]}
    w0 = next(w for w in combined.workers if w.worker_id == 0)
    assert rows["0"][5:7] == [f"{w0.work_s:.3f}", f"{w0.wait_s:.3f}"], cluster
    for address in shards:  # and each shard's own block after it
        assert f"\n\n{address}  mode ssp" in out


def test_ps_advise_on_two_shards_reads_each_worker_s_work_by_the_combine_rule(shards, trained):
    _, combined = trained
    m = advise.measure_cluster(shards, window=0.0, pulls=1)
    w0 = next(w for w in combined.workers if w.worker_id == 0)
    assert m.mode == "ssp"
    assert [(w.index, w.work_s) for w in m.workers] == [(0, w0.work_s)]  # worker 1 pushed once: left out
