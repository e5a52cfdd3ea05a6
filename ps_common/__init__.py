"""What the server and the worker share, beside the wire contract in ``protos``.

    from ps_common.names import MODES
    from ps_common.settings import ConfigError, resolve

``names`` (modes, policies, optimizers and their defaults), ``settings`` (the
one resolver: flags, then ``TFPS_*``, then ``TF_CONFIG``), ``tf_config``,
``security`` (TLS and the bearer token), ``sparse`` (the sparse-rows type of an
embedding gradient) and ``procs`` (starting children that die with their parent).

This layer imports neither ``ps_server`` nor ``worker`` (``tests/test_layers.py``
holds every arrow one way), and nothing in it imports TensorFlow. ``names`` and
``sparse`` are plain Python and NumPy, so the server's pure core may use them.
"""
