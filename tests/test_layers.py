"""Every arrow of the import graph points one way: each side imports only the shared layer.

    shared:    protos, ps_common          import only each other
    server:    ps_server                  imports the shared layer
    worker:    worker                     imports the shared layer
    public:    tfps                       the user's names for the worker's API (tfps.keras)
    operators: ps_tools                   the top: may import all of the above
    parity:    tf_strategies              the worker, the operators and the shared layer;
                                          tf_strategies/reference.py alone reads ps_server.core
                                          (it is the server's math in one process, by design)

Every import statement counts, also one inside a function. Benchmarks (``bench/``)
and tests may import anything.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = ("protos", "ps_common", "ps_server", "worker", "tfps", "ps_tools", "tf_strategies", "examples")
SHARED = {"protos", "ps_common"}

ALLOWED = {
    "protos": SHARED,
    "ps_common": SHARED,
    "ps_server": SHARED | {"ps_server"},
    "worker": SHARED | {"worker"},
    "tfps": SHARED | {"worker", "tfps"},
    "ps_tools": SHARED | {"worker", "ps_server", "ps_tools"},
    "tf_strategies": SHARED | {"worker", "tfps", "ps_tools", "tf_strategies"},
    "examples": SHARED | {"worker", "tfps", "examples"},
}
# The one named exception, with its reason in the module docstring above.
EXCEPTIONS = {("tf_strategies/reference.py", "ps_server.core")}


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # ``from ps_tools import launch`` names a module too
            found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return found


def sources() -> list[pathlib.Path]:
    return sorted(p for top in PROJECT for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def wrong_arrows() -> list[str]:
    wrong = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        layer = rel.split("/")[0]
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top not in PROJECT or top in ALLOWED[layer]:
                continue
            if any(rel == f and (module == m or module.startswith(m + ".")) for f, m in EXCEPTIONS):
                continue
            wrong.append(f"{rel}:{line} imports {module}")
    return sorted(set(wrong))


def test_every_import_points_from_a_side_to_the_shared_layer_never_across():
    assert wrong_arrows() == []


# The server's core is plain Python and NumPy: of the shared layer it reads only the pure
# modules (no gRPC, protobuf or environment behind them).
CORE_MAY_USE = {"ps_common.batches", "ps_common.defaults", "ps_common.names", "ps_common.reasons", "ps_common.records",
                "ps_common.sparse"}


def test_the_core_uses_only_the_pure_shared_modules():
    wrong = []
    for path in sorted((ROOT / "ps_server" / "core").rglob("*.py")):
        for line, module in imported_modules(path):
            top = module.split(".")[0]
            if top in PROJECT and not module.startswith("ps_server.core") \
                    and not any(module == m or module.startswith(m + ".") for m in CORE_MAY_USE):
                wrong.append(f"{path.relative_to(ROOT).as_posix()}:{line} imports {module}")
    assert wrong == []


def test_the_check_sees_a_wrong_arrow(tmp_path, monkeypatch):
    """The rule can fail: a worker module that imports the server is reported."""
    fake = tmp_path / "worker"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from ps_server.core import store\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert wrong_arrows() == ["worker/bad.py:2 imports ps_server.core", "worker/bad.py:2 imports ps_server.core.store"]


@pytest.mark.parametrize("layer", sorted(SHARED))
def test_the_shared_layer_loads_neither_side(layer):
    """Importing every shared module pulls in no server, worker or TensorFlow module."""
    modules = [p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
               for p in (ROOT / layer).glob("*.py") if p.stem not in ("__init__", "generate")]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ps_server', 'worker', 'ps_tools', "
              "'tf_strategies', 'tensorflow', 'keras'))\nprint(bad)\nassert not bad\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
