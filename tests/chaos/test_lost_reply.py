"""A push whose reply is lost on the wire is re-sent and never applied twice.

The rule: "Pushes are idempotent per (worker id, step): a retried push after a
lost reply is never applied twice." The server is a real ps-server process; the
first push's caller gives up (its deadline passes while the push waits in the
barrier), so it never sees the reply, although the server goes on to apply the
round. The re-sent push is answered from the record.
"""

import grpc
import numpy as np
import pytest

from worker.client import PSClient, PSClientError

pytestmark = [pytest.mark.chaos, pytest.mark.cluster, pytest.mark.recovery]

W0 = {"w": np.zeros(4, np.float32)}
ONES = {"w": np.ones(4, np.float32)}
SGD = {"name": "sgd", "learning_rate": 1.0, "momentum": 0.0, "nesterov": False,
       "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}


def test_push_whose_reply_was_lost_is_replayed_when_resent_and_applied_once(procs):
    server, address = procs.server("sync", num_workers=2, barrier_timeout=60)
    with PSClient(address) as a, PSClient(address) as b:
        a.register(0, 2)
        b.register(1, 2)
        a.initialize(0, W0, SGD)
        # Worker 0's push waits for worker 1; its caller gives up after 0.5 s: the reply is lost.
        with pytest.raises(PSClientError) as lost:
            a.push(0, step=0, base_version=0, batch_size=1, gradients=ONES, timeout=0.5)
        assert lost.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert list(b.status().waiting_for) == [1]  # the server still holds worker 0's push
        reply = b.push(1, step=0, base_version=0, batch_size=1, gradients=ONES)
        assert reply.version == 1
        # Worker 0 re-sends the same (worker, step): answered from the record, not applied again.
        again = a.push(0, step=0, base_version=0, batch_size=1, gradients=ONES)
        assert again.replayed and again.version == 1 and again.next_step == 1
        version, values = a.pull()
        assert version == 1
        np.testing.assert_array_equal(values["w"], -np.ones(4, np.float32))  # one round: w - 1 * mean(1, 1)
        status = a.status()
        assert (status.pushes_applied, status.pushes_replayed) == (2, 1)
