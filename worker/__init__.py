"""tfps worker: ``ps-worker`` / ``python -m worker``.

What each module holds: docs/architecture.md ("The worker"). ``worker.client`` holds
every gRPC call; ``worker.trainer`` is ``ps-worker``'s loop, ``worker.api`` the Python
API. Importing this package does not import TensorFlow.
"""
