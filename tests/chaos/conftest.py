"""Chaos tests: real ps-server and ps-worker processes on loopback, with faults
injected (kills, pauses, cut connections, server restarts).

The processes come from the cluster tier's ``Procs``: every one is killed when
its test ends, and with PR_SET_PDEATHSIG when pytest itself dies.
"""

import pytest

from tests.cluster.conftest import Procs


@pytest.fixture
def procs(tmp_path):
    p = Procs(tmp_path)
    yield p
    p.stop_all()
