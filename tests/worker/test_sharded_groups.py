"""Optimizer groups over server shards (``OptimizerSpec.groups``, ``worker.sharded_client``):
real ps-servers on loopback, one ``ShardedClient`` against two of them, against one ``PSClient``
of one server. A variable cut in row slices is stepped on each shard by its group's optimizer."""

import numpy as np
import pytest

from worker.client import PSClient
from worker.sharded_client import ShardedClient

ADAM = {"name": "adam", "learning_rate": 0.01}
SGD = {"name": "sgd", "learning_rate": 0.5, "momentum": 0.9}


def values():
    rng = np.random.default_rng(0)
    return {"d/kernel": rng.normal(size=(4, 3)).astype(np.float32),
            "g/kernel": rng.normal(size=(70000, 2)).astype(np.float32),  # 547 KiB: cut in two over two shards
            "g/bias": np.zeros(2, np.float32)}


def pushes(shared: bool):
    """The step's applies in turn: Adam's on ``d``, then SGD's on ``g`` (and on ``d`` too where ``shared``)."""
    from ps_common.names import shared_name

    rng = np.random.default_rng(1)
    out = []
    for _ in range(3):
        out.append({"d/kernel": rng.normal(size=(4, 3)).astype(np.float32)})
        second = {"g/kernel": rng.normal(size=(70000, 2)).astype(np.float32),
                  "g/bias": rng.normal(size=2).astype(np.float32)}
        if shared:
            second[shared_name("d/kernel", 1)] = rng.normal(size=(4, 3)).astype(np.float32)
        out.append(second)
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_each_group_steps_its_variables_on_every_shard_as_one_server_does(server_config, shared):
    """Two groups, Adam over ``d`` and SGD with momentum over ``g`` (``shared``: and over ``d`` as
    well, by its second name): six pushes, one group's each, end at one server's bits over two
    shards, ``g/kernel`` cut in row slices; each group's optimizer state (``optimizer_state``) too."""
    groups = [{"variables": ["d/kernel"], "optimizer": ADAM},
              {"variables": ["g/kernel", "g/bias"] + (["d/kernel"] if shared else []), "optimizer": SGD}]
    spec = {**ADAM, "groups": groups}
    ends = []
    for shards in (1, 2):
        addresses = [server_config(mode="sync", num_workers=1).address for _ in range(shards)]
        client = PSClient(addresses[0]) if shards == 1 else ShardedClient(addresses)
        with client:
            reg = client.register(0, 1)
            client.initialize(reg.worker_id, values(), spec)
            if shards == 2:
                assert any(p.parts == 2 for p in client.placement.pieces)  # g/kernel is sliced
            for step, push in enumerate(pushes(shared)):
                version, _ = client.pull(reg.worker_id)
                client.push(reg.worker_id, step, version, 8, push)
            ends.append(client.optimizer_state(reg.worker_id))
            if shards == 1:  # a second name is no variable of the model's
                assert (client.status().num_variables, client.status().num_parameters) == (3, 12 + 140002)
    (_, one, one_states), (_, two, two_states) = ends
    assert sorted(one) == sorted(two) == sorted(values())
    for name in one:
        assert one[name].tobytes() == two[name].tobytes(), name
    assert sorted(one_states) == sorted(two_states)
    for name, state in one_states.items():
        assert {k: np.asarray(a).tobytes() for k, a in state.items()} == \
            {k: np.asarray(a).tobytes() for k, a in two_states[name].items()}, name
