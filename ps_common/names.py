"""The names both sides agree on, each defined once.

    from ps_common.names import MODES, DEAD_WORKER_POLICIES, OPTIMIZER_DEFAULTS

The server's flags, its core and the wire conversion (``protos.wire.mode_to_wire``,
driven by ``MODES`` and the proto's ``Mode`` enum), the worker, and the operator
commands all read these tuples; nothing else spells them out. Plain Python.
"""

from __future__ import annotations

# How the server applies pushes: a barrier per step, on arrival, or on arrival
# within a staleness bound. The proto's Mode enum has one value per name, upper-cased.
MODES = ("sync", "async", "ssp")

# Async and ssp: what to do with a stale gradient (none, drop above a bound, scale the
# learning rate by 1 / (1 + staleness)).
STALE_POLICIES = ("none", "drop", "scale")

# Sync: what a round does when a worker it waits for is declared dead.
DEAD_WORKER_POLICIES = ("abort", "wait", "shrink")

# The server's optimizers and their Keras 3 defaults (keras.optimizers.SGD / Adam).
OPTIMIZER_DEFAULTS: dict[str, dict[str, float | bool]] = {
    "sgd": {"learning_rate": 0.01, "momentum": 0.0, "nesterov": False},
    "adam": {"learning_rate": 0.001, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
}
OPTIMIZERS = tuple(OPTIMIZER_DEFAULTS)


def optimizer_fields(name: str, **given) -> dict:
    """Every field of the wire's OptimizerConfig for optimizer ``name``: the values
    ``given``, else that optimizer's Keras default, else the other's (unused) default."""
    fields = {k: v for defaults in OPTIMIZER_DEFAULTS.values() for k, v in defaults.items()}
    fields.update(OPTIMIZER_DEFAULTS.get(name, {}))
    fields.update(given)
    return {"name": name, **fields}
