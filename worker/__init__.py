"""tfps worker: ``ps-worker`` / ``python -m worker``, and ``ps-launch``.

``worker.client`` holds every gRPC call (NumPy only), ``worker.trainer`` the
training loop, ``worker.model`` the Keras models and the shared gradient
function, ``worker.data`` the datasets and sharding, ``worker.launch`` the local
cluster launcher. Importing this package does not import TensorFlow.
"""
