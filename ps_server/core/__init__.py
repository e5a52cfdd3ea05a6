"""The parameter server's algorithm, free of network and TensorFlow.

    from ps_server.core.parameter_server import ParameterServer

Plain Python and NumPy only: ``store`` (variables, copy-on-write), ``optimizers``
(Keras-exact SGD and Adam), ``rounds`` (deterministic sync bookkeeping),
``sync_mode`` / ``async_mode`` (one module per consistency mode), ``membership``
and ``errors``. The gRPC layer lives in ``ps_server.service``.
"""
