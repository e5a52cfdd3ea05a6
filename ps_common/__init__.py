"""What the server and the worker share, beside the wire contract in ``protos``.

    from ps_common.names import MODES
    from ps_common.settings import ConfigError, resolve

``names`` (modes, policies, optimizers and their defaults), ``records`` (the
registration and the push reply, as both sides hold them), ``settings`` (the one
resolver: flags, then ``TFPS_*``, then ``TF_CONFIG``; its ``ConfigError`` is defined in
``errors``, below it and the ``tf_config`` and ``slurm`` it reads), ``tf_config``, ``security``
(TLS and the bearer token), ``sparse`` (the sparse-rows type of an embedding
gradient), ``procs`` (starting children that die with their parent) and ``logs``
(one logging set-up: tfps at its level, other libraries from WARNING).

This layer imports neither ``ps_server`` nor ``worker`` (``tests/test_layers.py``
holds every arrow one way), and nothing in it imports TensorFlow. ``names`` and
``sparse`` are plain Python and NumPy, so the server's pure core may use them.
"""
