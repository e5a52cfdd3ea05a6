"""The parameter server's algorithm, free of network and TensorFlow.

    from ps_server.core.parameter_server import ParameterServer

Plain Python and NumPy only (``tests/core/test_core_imports.py`` proves it):

- ``parameter_server``: the one object the gRPC service drives;
- ``store``: the variables, their optimizer state and the version (copy-on-write);
- ``optimizers``: server-side SGD and Adam, exactly what Keras 3 computes;
- ``modes``: the interface every consistency mode implements, and what a push returns;
- ``sync_mode``: one barrier per step, over ``rounds`` (the deterministic
  bookkeeping of sync rounds) and ``aggregation`` (how a round combines gradients);
- ``async_mode``: every push applied on arrival;
- ``ssp_mode``: applied on arrival, nobody more than S steps ahead of the slowest;
- ``membership``: registered workers, their leases and what each last did;
- ``sparse``: sparse embedding gradients checked, then stepped on their rows alone or made dense
  (``--sparse-updates``), and a sync round's mean of them;
- ``checkpoint``: the checkpoint file, written atomically, checked on restore;
- ``errors``: the exceptions the core raises.

The gRPC layer lives in ``ps_server.service``; its one error table turns these
errors into status codes.
"""
