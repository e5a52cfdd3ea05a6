"""The core ring holds: importing ps_server or its core loads no TensorFlow, gRPC or protobuf.

    python -m pytest tests/core/test_core_imports.py -q

Each check runs in a fresh interpreter (the test process may have loaded
anything), the same way as the acceptance check
``python -c "import ps_server, sys; assert 'tensorflow' not in sys.modules"``.
"""

import subprocess
import sys

import pytest

FORBIDDEN = ("tensorflow", "grpc", "google.protobuf", "keras")

CHECK = """
import sys
{imports}
loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in {forbidden!r}))
assert not loaded, "loaded: " + ", ".join(loaded)
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import ps_server",
        "import ps_server, ps_server.core.parameter_server",
        "import ps_server.core.store, ps_server.core.modes.sync_mode, ps_server.core.modes.async_mode",
    ],
)
def test_importing_the_core_loads_neither_tensorflow_nor_grpc_nor_protobuf(imports):
    code = CHECK.format(imports=imports, forbidden=FORBIDDEN)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_acceptance_check_passes():
    proc = subprocess.run(
        [sys.executable, "-c", "import ps_server, sys; assert 'tensorflow' not in sys.modules"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
