"""tfps worker: ``ps-worker`` / ``python -m worker``.

``worker.client`` holds every gRPC call (NumPy only) over the transports of
``worker.transports`` (unary, streams, shared memory), ``worker.sharded_client``
the same interface over several server shards, ``worker.connection`` a
worker's place in the cluster (register, join, pull, push, rejoin, leave),
``worker.gradients`` the one gradient path (loss, gradients as pushed, sparse
rows, non-trainable changes), ``worker.trainer`` the training loop
(``TrainingLoop``), ``worker.task`` what it trains (the built-in model and data,
or a user's Keras model and tf.data pipeline), ``worker.api`` the Python API
(``train``, ``Session`` and its wrapped GradientTape), ``worker.observe`` the
progress bar, TensorBoard and worker metrics, ``worker.model`` the built-in Keras
models and their loss, ``worker.data`` the datasets and sharding. The operator
commands (``ps-launch`` and the others) live in ``ps_tools``. Importing this
package does not import TensorFlow.
"""
