"""The sync shortcut and the pull cache (worker.transports) against a real server.

    python -m pytest -q tests/service/test_sync_shortcut.py

PullCache.receive: "Sync: a push asks for the new parameters with its reply; the server
grants it when they stay current until this worker pushes again, and the next full
pull is answered from them without a call."
"""

import numpy as np

from protos import tfps_pb2 as pb

from worker.transports import PullCache

SGD = {"name": "sgd", "learning_rate": 0.5}


def _recording(client) -> list[str]:
    """The one-message calls the client makes (unary, or on its session) from now on."""
    calls: list[str] = []
    for transport in (client.unary, client.calls):
        real = transport.call
        transport.call = lambda name, *a, _real=real, **k: (calls.append(name), _real(name, *a, **k))[1]
    return calls


def _pulled_once(ps, mode: str):
    """A one-worker server holding w = [0, 0, 0]; (server, client, version, its Unary calls from now on)."""
    running, client = ps(mode=mode, num_workers=1)
    client.register(0, 1)
    client.initialize(0, {"w": np.zeros(3, np.float32)}, SGD)
    version, _ = client.pull(0)
    return running, client, version, _recording(client)


def test_after_a_sync_push_the_next_full_pull_is_answered_from_the_reply_without_a_call(ps):
    running, client, version, calls = _pulled_once(ps, "sync")
    reply = client.push(0, 0, version, 1, {"w": np.ones(3, np.float32)})
    assert calls == ["Push"] and reply.version == 1
    version, values = client.pull(0)
    assert calls == ["Push"]  # no Pull, no PullStream: the reply brought them
    assert version == 1 and values["w"].tolist() == [-0.5] * 3 == running.core.pull()[1]["w"].tolist()
    assert not values["w"].flags.writeable
    client.pull(0)  # the shortcut serves one pull only
    assert calls == ["Push", "Pull"]


def test_an_async_push_reply_brings_no_values_and_the_next_pull_asks(ps):
    running, client, version, calls = _pulled_once(ps, "async")
    client.push(0, 0, version, 1, {"w": np.ones(3, np.float32)})
    version, values = client.pull(0)
    assert calls == ["Push", "Pull"] and version == 1 and values["w"].tolist() == [-0.5] * 3


def test_the_cache_keeps_unchanged_arrays_only_for_the_same_server_process():
    cache = PullCache()
    a, b = np.zeros(2), np.ones(2)
    assert cache.complete(pb.PullHeader(version=1, incarnation="x"), {"a": a, "b": b}) == {"a": a, "b": b}
    newer = np.full(2, 3.0)
    values = cache.complete(pb.PullHeader(version=2, incarnation="x"), {"a": newer})
    assert values["a"] is newer and values["b"] is b
    restarted = cache.complete(pb.PullHeader(version=0, incarnation="y"), {"a": a})
    assert list(restarted) == ["a"]  # another server process: nothing of the old one is kept
    request = pb.PullRequest()
    cache.ask(request)
    assert (request.known_incarnation, request.known_version) == ("y", 0)
