"""The base install (``pip install .``) holds only what a server needs.

    .venv/bin/python -m pytest -q tests/test_base_install.py

Rules checked:
- "The base install holds only what a server needs": the server's modules and the
  shared layer, imported in a fresh interpreter, load no TensorFlow, Keras,
  scikit-learn, SciPy or matplotlib;
- every third-party module the server side imports (``ps_server``, ``protos``,
  ``ps_common``, any import statement, one inside a function too) comes from the
  base dependencies or what they require, except in the modules of
  ``OPTIONAL_EXTRAS``, which fall back to the base without their extra (numba for
  ``ps_server/core/optim/kernels.py``, tested by ``tests/core/test_kernels.py``);
  scikit-learn, TensorFlow and matplotlib are not among them;
- scikit-learn, which only the workers' built-in data uses, comes with the ``cpu``
  and the ``gpu`` extra alike, and every third-party module the worker imports comes
  from the base dependencies plus the ``cpu`` extra.
Each rule is also run on an input it must refuse.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
WORKER_ONLY = ("tensorflow", "keras", "sklearn", "scipy", "matplotlib")
# protos/generate.py regenerates the wire code with grpc_tools, from the test extra:
# a developer's tool, never imported by a server.
NOT_RUN_BY_A_SERVER = {"protos/generate.py"}
# Server modules that import an optional extra's packages and run without them.
OPTIONAL_EXTRAS = {"ps_server/core/optim/kernels.py": "fast"}

CHECK = """
import importlib, pkgutil, sys
import ps_server, ps_server.cli, ps_server.config, ps_server.server, ps_server.service, ps_server.metrics
for package in ("ps_common", "protos"):
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if info.name != "generate":
            importlib.import_module(package + "." + info.name)
{extra}
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
assert not loaded, "loaded: " + ", ".join(loaded)
"""


def _fresh_interpreter(extra: str = "") -> subprocess.CompletedProcess:
    code = CHECK.format(extra=extra, forbidden=WORKER_ONLY)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_server_and_the_shared_layer_load_no_worker_only_package():
    done = _fresh_interpreter()
    assert done.returncode == 0, done.stderr


def test_the_import_check_sees_a_worker_package():
    done = _fresh_interpreter("import worker.data; worker.data.load_dataset('digits')")
    assert done.returncode != 0 and "loaded: " in done.stderr and "sklearn" in done.stderr, done.stderr


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install: themselves and what they require
    (installed ones only; requirements behind an extra or another platform's marker left out)."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        name = _name(str(req))
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            pass
    return seen


def third_party_imports(folders: list[str]) -> dict[str, str]:
    """{top-level module: where it is first imported} for every non-project, non-stdlib import."""
    project = {"protos", "ps_common", "ps_server", "worker", "tfps", "ps_tools", "tf_strategies", "examples"}
    found: dict[str, str] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in NOT_RUN_BY_A_SERVER or "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
                for name in names:
                    top = name.split(".")[0]
                    if top not in project and top not in sys.stdlib_module_names:
                        found.setdefault(top, f"{rel}:{node.lineno}")
    return found


def unprovided(modules: dict[str, str], requirements: list[str]) -> list[str]:
    """The modules no distribution installed by ``requirements`` provides."""
    provided = closure(requirements)
    providers = metadata.packages_distributions()
    return sorted(f"{where} imports {module}" for module, where in modules.items()
                  if not {_name(d) for d in providers.get(module, [])} & provided)


def test_every_module_the_server_side_imports_comes_with_the_base_dependencies():
    modules = third_party_imports(["ps_server", "protos", "ps_common"])
    assert "grpc" in modules and "numpy" in modules, modules  # the walk sees imports at all
    optional = {m: where for m, where in modules.items() if where.split(":")[0] in OPTIONAL_EXTRAS}
    for module, where in optional.items():
        extra = OPTIONAL_EXTRAS[where.split(":")[0]]
        assert unprovided({module: where}, [*PROJECT["dependencies"], *PROJECT["optional-dependencies"][extra]]) == []
    assert unprovided({m: w for m, w in modules.items() if m not in optional}, PROJECT["dependencies"]) == []


def test_the_base_dependencies_bring_no_scikit_learn_tensorflow_or_matplotlib():
    installed = closure(PROJECT["dependencies"])
    assert not installed & {"scikit-learn", "scipy", "tensorflow", "tensorflow-cpu", "keras", "matplotlib"}, installed


def test_the_dependency_check_sees_a_module_the_base_does_not_bring():
    assert unprovided({"sklearn": "worker/data.py:63", "numpy": "ps_server/x.py:1"}, PROJECT["dependencies"]) == [
        "worker/data.py:63 imports sklearn"]
    assert unprovided({"sklearn": "worker/data.py:63"}, [*PROJECT["dependencies"], "scikit-learn>=1.3"]) == []


@pytest.mark.parametrize("extra", ["cpu", "gpu"])
def test_scikit_learn_comes_with_each_worker_extra(extra):
    assert "scikit-learn" in {_name(r) for r in PROJECT["optional-dependencies"][extra]}


def test_the_gpu_extra_differs_from_the_cpu_extra_only_in_its_tensorflow():
    def others(extra):
        return sorted(r for r in PROJECT["optional-dependencies"][extra] if not _name(r).startswith("tensorflow"))

    assert others("cpu") == others("gpu")


def test_every_module_the_worker_imports_comes_with_the_base_and_the_cpu_extra():
    modules = third_party_imports(["worker"])
    assert "sklearn" in modules and "tensorflow" in modules, modules
    assert unprovided(modules, [*PROJECT["dependencies"], *PROJECT["optional-dependencies"]["cpu"]]) == []
