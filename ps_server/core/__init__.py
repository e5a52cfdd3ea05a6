"""The parameter server's algorithm, free of network and TensorFlow.

    from ps_server.core.parameter_server import ParameterServer

Plain Python and NumPy only (``tests/core/test_core_imports.py`` proves it). By concern,
each part importing only those listed before it (``tests/test_layers.py``, ``CORE_RULES``):

- ``errors``: the exceptions the core raises;
- ``optim/``: the maths of one update: the optimizers, schedules, fused kernels, sparse
  rows and the hogwild in-place step;
- ``data/``: the data dealing: the data plan, elastic sync's micro-batches, leased tasks,
  the epoch ledger;
- ``membership``: registered workers, their leases and what each last did;
- ``settings``: the flags the core runs by, as one object (``Settings``);
- ``store``: the variables, their optimizer state and the version (copy-on-write);
- ``modes/``: the ``Mode`` interface and one module per consistency mode (sync, with its
  rounds, aggregation and overlap; async; ssp; elastic);
- ``broadcast``: the chief's decisions, posted once, awaited by the others;
- ``clip_group``: ``global_clipnorm`` over several shards: shard 0 gathers every shard's
  squares of an update and gives each the one factor;
- ``checkpoint``: the checkpoint file, written atomically, checked on restore;
- ``parameter_server``: the one object the gRPC service drives, over all of the above.

The gRPC layer lives in ``ps_server.service``; its one error table turns these
errors into status codes.
"""
