"""Upper bounds of a push's step and batch size: every answer and counter stays an int64.

    python -m pytest tests/core/test_push_bounds.py -q

Rule (modes.Push.validate): steps are below MAX_STEP = 2**63 - 1, so the answer's
``next_step = step + 1`` fits the wire's int64; a batch size is at most
MAX_BATCH_SIZE = 2**32, so the ``examples_applied`` sum fits too. Found by the
service fuzz test: an async push of step 2**63 - 1 was applied and then its
answer could not be encoded (INTERNAL), after which every later push of that
worker was stale; two pushes of batch size 2**62 broke every Status call.
That pushes beyond the bounds are refused in every mode: test_push_checks.
"""

import numpy as np

from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.membership import Membership
from ps_server.core.modes.base import MAX_BATCH_SIZE, MAX_STEP, Push
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.store import VariableStore
from tests.core.threads import JOIN

INT64_MAX = 2**63 - 1
W0 = {"w": np.array([1.0, 2.0], np.float32)}
G = {"w": np.array([2.0, -2.0], np.float32)}


def store():
    s = VariableStore()
    s.initialize(W0, OptimizerSpec("sgd", learning_rate=0.5))
    return s


def state(s):
    version, values = s.read()
    return version, values["w"].tobytes()


def test_the_bounds_keep_next_step_and_the_examples_sum_inside_int64():
    assert MAX_STEP == INT64_MAX  # the largest step, MAX_STEP - 1, answers next_step MAX_STEP
    assert (2**31 - 1) * MAX_BATCH_SIZE <= INT64_MAX  # two billion pushes of the largest batch


def test_async_push_of_the_largest_step_is_applied_and_answers_an_int64_next_step():
    mode = AsyncMode(store(), Membership(1))
    result = mode.submit(Push(0, MAX_STEP - 1, 0, 1, G)).result(JOIN)
    assert (result.version, result.next_step) == (1, INT64_MAX)
