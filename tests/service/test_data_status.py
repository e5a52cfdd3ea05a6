"""The data plan's progress (async and ssp tasks, the epoch counts) from the core's Status
to the wire and to ps-status's line."""

import time

from ps_server import service
from ps_server.core.parameter_server import ParameterServer
from ps_tools import status as ps_status
from tests.core.test_cursor import EXAMPLES
from tests.core.test_elastic_mode import Clock
from tests.core.test_tasks_server import push_of, started, take
from tests.core.threads import JOIN


def test_the_tasks_and_the_epoch_counts_reach_the_wire_and_ps_status():
    clock = Clock()
    ps = started(clock)
    ps.submit(push_of(ps, 0, take(ps, 0))).result(JOIN)
    take(ps, 1)
    msg = service.status_to_wire(ps.status(), time.monotonic())
    assert list(msg.epoch_examples) == [16] and msg.num_examples == EXAMPLES
    assert (msg.tasks_total, msg.tasks_done, msg.tasks_held, msg.tasks_queued) == (ps.tasks.total_tasks, 1, 1, 0)
    text = ps_status.render("127.0.0.1:1", msg)
    assert f"examples applied once per epoch: 0: 16/{EXAMPLES}; tasks 1/{ps.tasks.total_tasks} done, 1 held, " \
           "0 given back and waiting" in text
    plain = ParameterServer("async", 2)
    assert "examples applied" not in ps_status.render("x", service.status_to_wire(plain.status(), 0.0))
