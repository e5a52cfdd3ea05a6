"""A push is checked once, by ``ParameterServer.submit``, before any mode sees it: its
bounds (``Push.validate``), its metrics' limits, and every gradient's name, shape, dtype
and finiteness (``VariableStore.check_gradients``). A refused push changes nothing, in
every mode, and the worker goes on.

    python -m pytest tests/core/test_push_checks.py -q
"""

import re

import numpy as np
import pytest

from ps_server.core.data.cursor import DataPlan
from ps_server.core.errors import InvalidArgument, NonFinite, NotFound, PSError
from ps_server.core.modes.base import MAX_BATCH_SIZE, MAX_METRIC_BYTES, MAX_METRICS, MAX_STEP, Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.parameter_server import ParameterServer
from tests.core.threads import JOIN

VARIABLES = {"a": np.full((2, 3), 1.0, np.float32), "c": np.full(17, 2.0, np.float64)}
SGD = OptimizerSpec("sgd", learning_rate=0.5)
MODES = {  # name: ParameterServer keywords
    "sync": dict(mode="sync"),
    "async": dict(mode="async"),
    "ssp": dict(mode="ssp", staleness=1),
    "hogwild": dict(mode="async", async_apply="hogwild"),
    "elastic": dict(mode="sync", elastic_min_workers=1, micro_batches=1),
}


def grads(**over):
    g = {"a": np.full((2, 3), 0.5, np.float32), "c": np.full(17, 0.25, np.float64), **over}
    return {n: v for n, v in g.items() if v is not None}


def f32(*v):
    return np.array(v, np.float32)


BAD = {  # id: (push keywords, error, message)
    "nan": (dict(gradients=grads(c=np.full(17, np.nan))), NonFinite, "gradient for 'c' contains NaN or Inf"),
    "inf": (dict(gradients=grads(a=np.full((2, 3), -np.inf, np.float32))), NonFinite, "'a' contains NaN or Inf"),
    "unknown": (dict(gradients=grads(z=np.ones(1))), NotFound, "gradient for unknown variable(s): 'z'"),
    "missing": (dict(gradients=grads(c=None)), InvalidArgument, "missing gradient(s) for: 'c'"),
    "shape": (dict(gradients=grads(c=np.ones(16))), InvalidArgument, "gradient for 'c' has shape [16], variable has [17]"),
    "dtype": (dict(gradients=grads(c=np.ones(17, np.float32))), InvalidArgument, "gradient for 'c' has dtype float32"),
    "negative_step": (dict(step=-1), InvalidArgument, "step must be >= 0"),
    "step_bound": (dict(step=MAX_STEP), InvalidArgument, f"step must be < {MAX_STEP}, got {MAX_STEP}"),
    "negative_base": (dict(base_version=-1), InvalidArgument, "base_version must be >= 0"),
    "negative_batch": (dict(batch_size=-5), InvalidArgument, "batch_size must be >= 0"),
    "batch_bound": (dict(batch_size=MAX_BATCH_SIZE + 1), InvalidArgument,
                    f"batch_size must be <= {MAX_BATCH_SIZE}, got {MAX_BATCH_SIZE + 1}"),
    "metrics_count": (dict(metrics={f"m{i}": f32(0) for i in range(MAX_METRICS + 1)}), InvalidArgument,
                      f"at most {MAX_METRICS} metric tensors"),
    "metrics_bytes": (dict(metrics={"big": np.zeros(MAX_METRIC_BYTES // 4 + 1, np.float32)}), InvalidArgument,
                      f"at most {MAX_METRIC_BYTES} bytes"),
    "metric_name": (dict(metrics={"": f32(1)}), InvalidArgument, "metric names must be non-empty"),
    "metric_dtype": (dict(metrics={"flag": np.array([True])}), InvalidArgument, "must be a float or integer array"),
}


def server(mode: str, num_workers: int = 1, **kwargs) -> ParameterServer:
    ps = ParameterServer(num_workers=num_workers, **MODES[mode], **kwargs)
    for w in range(num_workers):
        ps.register(w, num_workers)
    plan = DataPlan(num_examples=8, global_batch_size=8, seed=1) if mode == "elastic" else None
    ps.initialize(0, {n: v.copy() for n, v in VARIABLES.items()}, SGD, data_plan=plan)
    return ps


def good(ps: ParameterServer, **over) -> Push:
    if ps.settings.elastic:
        work = ps.work(0).result(JOIN)
        over = {"step": work.round, "base_version": work.round, "batch_size": work.sizes[0],
                "micro_batch": work.micro_batches[0], **over}
    return Push(**{"worker_id": 0, "step": 0, "base_version": 0, "batch_size": 8, "gradients": grads(), **over})


def state(ps: ParameterServer):
    version, values = ps.pull()
    s = ps.status()
    return version, {n: v.tobytes() for n, v in values.items()}, s.pushes_applied, s.round


# Elastic sync sums no metrics and refuses any (test_elastic_mode).
@pytest.mark.parametrize("mode, bad", [(m, b) for m in MODES for b in BAD
                                       if not (m == "elastic" and "metrics" in BAD[b][0])])
def test_a_bad_push_is_refused_before_its_mode_and_changes_nothing(mode, bad):
    ps = server(mode)
    over, error, message = BAD[bad]
    before = state(ps)
    refused = ps.submit(good(ps, **over))
    assert refused.done()  # settled at once: no mode saw it
    with pytest.raises(error, match=re.escape(message)):
        refused.result()
    assert state(ps) == before
    reply = ps.submit(good(ps)).result(JOIN)  # the worker goes on
    assert (reply.result if ps.settings.elastic else reply).version == 1


@pytest.mark.parametrize("mode", MODES)
def test_nan_is_applied_where_allowed(mode):
    ps = server(mode, allow_nonfinite=True)
    ps.submit(good(ps, gradients=grads(c=np.full(17, np.nan)))).result(JOIN)
    assert np.isnan(ps.pull()[1]["c"]).all()


def test_a_refused_push_leaves_its_sync_round_waiting_for_it():
    ps = server("sync", num_workers=2)
    first = ps.submit(good(ps))
    assert not first.done() and ps.mode.status().waiting_for == (1,)
    with pytest.raises(NonFinite):
        ps.submit(good(ps, worker_id=1, gradients=grads(c=np.full(17, np.nan)))).result()
    assert ps.mode.status().waiting_for == (1,) and ps.store.version == 0
    assert ps.submit(good(ps, worker_id=1)).result(JOIN).version == first.result(JOIN).version == 1


def test_a_push_before_initialization_is_refused():
    ps = ParameterServer("sync", 1)
    ps.register(0, 1)
    with pytest.raises(PSError, match="not initialized"):
        ps.submit(Push(0, 0, 0, 1, grads())).result(JOIN)
