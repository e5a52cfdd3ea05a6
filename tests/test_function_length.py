"""No function longer than 80 lines: a function that does not fit a screen does several
things, and each deserves a name (issue 27).

    python -m pytest tests/test_function_length.py -q

Read from every module of the project and of bench/, generated code aside. The one
exception: the numba kernels (``kernels.py``'s ``_define_loops``), one block of loops that
must be compiled together.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("protos", "ps_common", "ps_server", "worker", "tfps", "ps_tools", "tf_strategies", "examples", "bench")
LIMIT = 80
EXCEPTIONS = {("kernels.py", "_define_loops")}


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int]]:
    """(name, lines) of each function in ``source`` over ``limit`` lines, decorators aside."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_longer_than_80_lines():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found += [f"{path.relative_to(ROOT)}: {name} has {lines} lines"
                      for name, lines in long_functions(path.read_text()) if (path.name, name) not in EXCEPTIONS]
    assert found == []


def test_the_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    assert long_functions(f"def f():\n{body}\n") == [("f", LIMIT + 1)]
    assert long_functions("def g():\n    return 1\n") == []
