"""The gpu tier: workers computing on a GPU. Skipped where TensorFlow sees none.

    python -m pytest tests/gpu -q                                # on a machine with a GPU
    TFPS_GPU_TIER_ON_CPU=1 python -m pytest tests/gpu -q        # the same tests on the CPU

The second form runs the tests here, where no GPU is, to keep them right between the
sessions that have one; what they measure on a GPU goes to BENCHMARKS.md.
"""

import os

import pytest

from tests.cluster.conftest import procs  # noqa: F401  (the tier's real processes)


def _gpus() -> list:
    import tensorflow as tf

    return tf.config.list_physical_devices("GPU")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    mine = [item for item in items if str(item.fspath).startswith(here)]
    if not mine:
        return
    for item in mine:
        item.add_marker(pytest.mark.gpu)
    if os.environ.get("TFPS_GPU_TIER_ON_CPU") == "1" or _gpus():
        return
    skip = pytest.mark.skip(reason="TensorFlow sees no GPU (TFPS_GPU_TIER_ON_CPU=1 runs the tier on the CPU)")
    for item in mine:
        item.add_marker(skip)
