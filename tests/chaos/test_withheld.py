"""The premise of the ``recovery`` modules, checked on a real server process: there, a
refusal reaches the worker with its reason and without its text (tests/withheld), so the
recovery tests beside this one pass on reasons alone (tests/test_reasons.py).

    python -m pytest tests/chaos/test_withheld.py -q
"""

import numpy as np
import pytest

from ps_common.reasons import Reason
from tests.cluster.conftest import read_log
from tests.withheld import WITHHELD
from worker.client import PSClient, PSClientError

pytestmark = [pytest.mark.chaos, pytest.mark.cluster, pytest.mark.recovery]


def _refusal(fn, *args) -> PSClientError:
    with pytest.raises(PSClientError) as caught:
        fn(*args)
    return caught.value


def test_a_server_process_refuses_with_the_reason_and_without_the_text(procs):
    server, address = procs.server(mode="sync", num_workers=2)
    with PSClient(address) as client:
        client.register(0, 2)
        early = _refusal(client.pull, 0)
        assert (early.reason, early.details) == (Reason.NOT_INITIALIZED, WITHHELD)
        stranger = _refusal(client.heartbeat, 1)
        assert (stranger.reason, stranger.details) == (Reason.NOT_REGISTERED, WITHHELD)
        client.initialize(0, {"w": np.zeros(3, np.float32)}, {"name": "sgd", "learning_rate": 0.1})
        ahead = _refusal(client.push, 0, 5, 0, 1, {"w": np.ones(3, np.float32)})
        assert (ahead.reason, ahead.details) == (Reason.EARLY, WITHHELD)
    assert server.poll() is None
    assert "worker 1 is not registered" not in read_log(server)  # withheld in its log too
