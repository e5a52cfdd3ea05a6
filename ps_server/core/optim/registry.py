"""The optimizer a spec names: every class of ``optimizers``, ``more_optimizers`` and ``muon`` by name.

    from ps_server.core.optim.registry import make_optimizer
    opt = make_optimizer(OptimizerSpec("adam", learning_rate=1e-3))

Apart from the modules, which it imports: ``more_optimizers`` and ``muon`` build on
``optimizers``, so the table that names them all sits above them.
"""

from __future__ import annotations

from ps_server.core.errors import InvalidArgument
from ps_server.core.optim import more_optimizers as more
from ps_server.core.optim.muon import Muon
from ps_server.core.optim.optimizers import SGD, Adagrad, Adam, Optimizer, OptimizerSpec, RMSprop

OPTIMIZER_CLASSES: dict[str, type[Optimizer]] = {
    "sgd": SGD, "adam": Adam, "adamw": Adam, "adagrad": Adagrad, "rmsprop": RMSprop, "adamax": more.Adamax,
    "nadam": more.Nadam, "ftrl": more.Ftrl, "lion": more.Lion, "adadelta": more.Adadelta, "lamb": more.Lamb,
    "adafactor": more.Adafactor, "schedule_free_adamw": more.ScheduleFreeAdamW, "muon": Muon,
}


def make_optimizer(spec: OptimizerSpec) -> Optimizer:
    """The optimizer ``spec`` names; raises InvalidArgument for a bad spec. With groups,
    its ``of`` maps each group's variables to that group's optimizer (``Optimizer.of``)."""
    spec.validate()
    for s in spec.every():
        if s.name not in OPTIMIZER_CLASSES:
            raise InvalidArgument(f"optimizer {s.name} is not available on this server")
    optimizer = OPTIMIZER_CLASSES[spec.name](spec)
    # each group's variables to its optimizer: one an earlier group steps too, by its second name
    for stepped, (_, group) in zip(spec.stepped_names(), spec.groups or ()):
        optimizer.groups.update(dict.fromkeys(stepped, OPTIMIZER_CLASSES[group.name](group)))
    return optimizer
