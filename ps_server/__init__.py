"""tfps parameter server: ``ps-server`` / ``python -m ps_server``.

Importing this package loads neither TensorFlow nor gRPC; ``ps_server.core`` is
the algorithm, ``ps_server.service`` the gRPC servicer, ``ps_server.server``
builds and runs the process.
"""

__version__ = "0.1.0"
