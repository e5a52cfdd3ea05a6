"""The maths of one update: what a step computes from a value, a gradient and a state.

    from ps_server.core.optim.optimizers import OptimizerSpec
    from ps_server.core.optim.registry import make_optimizer

Owns:

- ``optimizers``, ``more_optimizers`` and ``muon``: the fourteen Keras optimizers with their
  options, Keras-exact but Muon's matrix products (``registry.make_optimizer`` makes one by
  name); ``schedules``: Keras' learning-rate schedules at the update count;
- ``kernels``: one-pass optimizer steps and a round's fold, with numba, NumPy otherwise,
  same bits;
- ``sparse``: embedding gradients as rows, stepped row-wise or made dense
  (``--sparse-updates``);
- ``hogwild``: the same steps written in place under no lock (``--async-apply hogwild``).

May import, of the core, ``ps_server.core.errors`` alone: it knows no store, no mode, no
worker and no round, so every other part of the core may use it
(``tests/test_layers.py`` holds the rule table).
"""
