"""The server's optimizer state in a Keras optimizer (``worker.keras_optimizer.load_state``):
what a model file written under tfps carries, so that ``fit`` resumes from it in one process
as from that process's own file.

For each of the fourteen optimizers: the server's optimizer steps three times, its state is
loaded into a fresh Keras optimizer, and the fourth step taken there gives the bits of a
Keras optimizer that took all four steps itself (values and every optimizer variable). Muon's
matrix, stepped by its Muon rule, is within the bound of its matrix products instead
(``ps_server.core.optim.muon``; its slots to the bit).
"""

import numpy as np
import pytest

from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.registry import make_optimizer

keras = pytest.importorskip("keras")

from worker.keras_optimizer import load_state  # noqa: E402

CASES = {
    "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05, l1_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "schedule_free_adamw": lambda: keras.optimizers.ScheduleFreeAdamW(0.01, warmup_steps=2),
    "adam_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=100),
    "muon": lambda: keras.optimizers.Muon(0.01),  # v0 by its Muon rule (momentum), v1 by AdamW (and velocity)
}
MUON_BOUND = 1e-6  # of the variable's largest element (tests/core/test_muon.py)
SHAPES = [(4, 3), (3,)]


def assert_like(ours: np.ndarray, theirs: np.ndarray, case: str) -> None:
    if case == "muon" and ours.ndim == 2:
        assert np.abs(ours - theirs).max() <= MUON_BOUND * np.abs(theirs).max()
    else:
        assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("case", list(CASES))
def test_the_server_s_state_loaded_into_keras_takes_the_next_step_as_keras_own_state_does(case):
    rng = np.random.default_rng(1)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[(0.1 * rng.standard_normal(s)).astype(np.float32) for s in SHAPES] for _ in range(4)]

    reference = CASES[case]()
    spec = OptimizerSpec.from_keras(type(reference).__name__, reference.get_config())
    server = make_optimizer(spec)
    values, states = list(init), [server.init_state(v) for v in init]
    for step in grads[:3]:
        for i, g in enumerate(step):
            values[i], states[i] = server.apply(values[i], g, states[i])

    ours = [keras.Variable(v, name=f"v{i}") for i, v in enumerate(values)]
    loaded = CASES[case]()
    assert load_state(loaded, ours, {v.path: s for v, s in zip(ours, states)}) == 3
    theirs = [keras.Variable(v, name=f"v{i}") for i, v in enumerate(init)]
    for step in grads[:3]:
        reference.apply([keras.ops.convert_to_tensor(g) for g in step], theirs)
    for i, v in enumerate(theirs):  # the server's three steps are Keras' own, to the bit
        assert_like(values[i], v.numpy(), case)
    reference.apply([keras.ops.convert_to_tensor(g) for g in grads[3]], theirs)
    loaded.apply([keras.ops.convert_to_tensor(g) for g in grads[3]], ours)
    for a, b in zip(ours, theirs):
        assert_like(a.numpy(), b.numpy(), case)
    assert len(loaded.variables) == len(reference.variables)
    for a, b in zip(loaded.variables, reference.variables):
        assert np.array_equal(np.asarray(a), np.asarray(b)), (a.path, b.path)
