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

Inside two packages the arrows point one way too (``CORE_RULES``, ``TOOLS_RULES``; each
sub-package's ``__init__`` docstring says the same in words):

    ps_server/core/   errors <- optim, data, membership, settings <- store <- modes <- broadcast,
                      clip_group <- checkpoint <- parameter_server
    ps_tools/         the operator's commands <- study

Between the files of ``ps_common`` and of ``ps_tools`` there is no import circle at all
(``NO_FILE_CIRCLES``): a name two files share lives in the one below both.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tomllib

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


# Inside the core: what each part (a sub-package, or a module beside them) may import of the
# others. A part always reads itself. A new module of the core must be given a row here.
CORE_RULES = {
    "errors": set(),
    "optim": {"errors"},  # the maths of one update: no store, no mode, no round
    "data": {"errors"},  # which examples a push trains on: indices, no gradient
    "membership": {"errors"},
    "settings": {"errors"},
    "store": {"errors", "optim"},
    "modes": {"errors", "optim", "store", "membership", "data"},
    "broadcast": {"errors", "modes"},  # its waits are the modes' tickets
    "clip_group": {"errors", "modes"},  # global_clipnorm over shards: its waits are tickets too
    "checkpoint": {"errors", "optim", "membership", "modes", "clip_group"},
    "parameter_server": {"errors", "optim", "data", "membership", "store", "modes", "broadcast", "clip_group",
                         "checkpoint", "settings"},
}
# Inside ps_tools: the study tools run the operator's commands; the commands do not know them.
TOOLS_RULES = {"operators": {"operators"}, "study": {"operators", "study"}}


def _core_part(parts: tuple[str, ...]) -> str:
    """The part of ``ps_server/core/`` that a path or a dotted module below it is in."""
    return parts[0].removesuffix(".py")


def _tools_part(parts: tuple[str, ...]) -> str:
    return "study" if parts[0] == "study" else "operators"


INNER = {("ps_server", "core"): (CORE_RULES, _core_part), ("ps_tools",): (TOOLS_RULES, _tools_part)}


def inner_wrong_arrows() -> list[str]:
    """Imports between the parts of the core, or of ps_tools, that their rule table forbids."""
    wrong = []
    for package, (rules, part_of) in INNER.items():
        folder = ROOT.joinpath(*package)
        for path in sorted(folder.rglob("*.py")):
            inner = path.relative_to(folder).parts
            if inner == ("__init__.py",) or "__pycache__" in inner:
                continue
            part = part_of(inner)
            if part not in rules:
                wrong.append(f"{path.relative_to(ROOT).as_posix()} is in no part of the rule table")
                continue
            for line, module in imported_modules(path):
                names = tuple(module.split("."))
                if names[: len(package)] != package or len(names) == len(package):
                    continue
                target = part_of(names[len(package):])
                if target != part and target not in rules[part]:
                    wrong.append(f"{path.relative_to(ROOT).as_posix()}:{line} imports {module}")
    return sorted(set(wrong))


def test_the_parts_of_the_core_and_of_ps_tools_import_only_what_their_rule_table_allows():
    assert inner_wrong_arrows() == []


@pytest.mark.parametrize("rules", [CORE_RULES, TOOLS_RULES], ids=["core", "ps_tools"])
def test_the_rule_tables_have_no_circle(rules):
    """Every part can be placed above all it may import: a circle has no such order."""
    placed: list[str] = []
    while len(placed) < len(rules):
        ready = [p for p in rules if p not in placed and rules[p] - {p} <= set(placed)]
        assert ready, f"a circle among {sorted(set(rules) - set(placed))}"
        placed += ready


def test_every_part_of_the_table_exists_and_each_sub_package_says_what_it_owns_and_may_import():
    core = ROOT / "ps_server" / "core"
    for part in CORE_RULES:
        assert (core / f"{part}.py").is_file() or (core / part / "__init__.py").is_file(), part
    for folder in [*(p for p in core.iterdir() if p.is_dir()), ROOT / "ps_tools" / "study"]:
        if folder.name == "__pycache__":
            continue
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        assert "Owns" in doc and "May import" in doc, folder.relative_to(ROOT).as_posix()


def test_every_console_script_names_a_function_that_exists():
    """pyproject's entry points follow the modules they name (ps-compare is ps_tools.study.compare)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    code = "import importlib\n" + "".join(
        f"assert callable(getattr(importlib.import_module({t.split(':')[0]!r}), {t.split(':')[1]!r})), {t!r}\n"
        for t in scripts.values())
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


# Between the files of these packages no import circle at all, not even through an import
# inside a function: each file's names come from files below it.
NO_FILE_CIRCLES = ("ps_common", "ps_tools", "ps_server", "worker", "protos", "tfps", "tf_strategies")


def _file_of(module: str) -> pathlib.Path | None:
    """The module file (not a package's ``__init__``) that a dotted import names, if ours."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:end]).with_suffix(".py")
        if path.is_file():
            return path
    return None


def file_circles() -> list[str]:
    """Each import circle between the files of a ``NO_FILE_CIRCLES`` package, as
    "a.py -> b.py -> a.py" (a package's ``__init__``, docstrings here, is left out)."""
    circles = []
    for top in NO_FILE_CIRCLES:
        files = sorted(p for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts and p.stem != "__init__")
        arrows = {p: sorted({f for _, m in imported_modules(p) if m.split(".")[0] == top
                             and (f := _file_of(m)) is not None and f != p}) for p in files}
        done: set = set()
        for start in files:  # a circle is reported once, from its first file in path order
            stack = [(start, [start])]
            while stack:
                here, path = stack.pop()
                for there in arrows.get(here, []):
                    if there == start:
                        circles.append(" -> ".join(q.relative_to(ROOT).as_posix() for q in [*path, start]))
                    elif there not in path and there not in done and there > start:
                        stack.append((there, [*path, there]))
            done.add(start)
    return circles


def test_no_import_circle_between_the_files_of_a_package():
    assert file_circles() == []


def test_the_circle_check_sees_a_circle_through_an_import_inside_a_function(tmp_path, monkeypatch):
    (tmp_path / "ps_common").mkdir()
    (tmp_path / "ps_common" / "a.py").write_text("from ps_common.b import B\n")
    (tmp_path / "ps_common" / "b.py").write_text("def f():\n    from ps_common import a\n")
    (tmp_path / "ps_common" / "c.py").write_text("from ps_common.a import A\n")  # into the circle, not in it
    (tmp_path / "ps_tools" / "study").mkdir(parents=True)
    (tmp_path / "ps_tools" / "study" / "x.py").write_text("from ps_tools.study import y\n")
    (tmp_path / "ps_tools" / "study" / "y.py").write_text("from ps_tools.launch import parser\n")
    (tmp_path / "ps_tools" / "launch.py").write_text("from ps_tools.study.x import X\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert file_circles() == ["ps_common/a.py -> ps_common/b.py -> ps_common/a.py",
                              "ps_tools/launch.py -> ps_tools/study/x.py -> ps_tools/study/y.py -> ps_tools/launch.py"]


def test_the_inner_check_sees_a_wrong_arrow(tmp_path, monkeypatch):
    """The inner rules can fail: the maths reading the store, a command reading a study
    tool, and a module the table does not place are each reported."""
    (tmp_path / "ps_server" / "core" / "optim").mkdir(parents=True)
    (tmp_path / "ps_server" / "core" / "optim" / "bad.py").write_text("from ps_server.core.store import VariableStore\n")
    (tmp_path / "ps_server" / "core" / "stray.py").write_text("")
    (tmp_path / "ps_server" / "core" / "modes").mkdir()
    (tmp_path / "ps_server" / "core" / "modes" / "fine.py").write_text(
        "from ps_server.core import store\nfrom ps_server.core.optim import kernels\n")
    (tmp_path / "ps_tools").mkdir()
    (tmp_path / "ps_tools" / "launch.py").write_text("def f():\n    from ps_tools.study import compare\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert inner_wrong_arrows() == [
        "ps_server/core/optim/bad.py:1 imports ps_server.core.store",
        "ps_server/core/optim/bad.py:1 imports ps_server.core.store.VariableStore",
        "ps_server/core/stray.py is in no part of the rule table",
        "ps_tools/launch.py:2 imports ps_tools.study",
        "ps_tools/launch.py:2 imports ps_tools.study.compare",
    ]


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
