"""No two worker modules import each other, through any chain: each worker file can be read
(and changed) knowing only the ones it imports. The loop chooses its work by the
registration (``worker.trainer`` imports ``worker.elastic``), so elastic training is not a
subclass that ``trainer.train`` imports back. Every import statement counts, also one inside
a function (``tests/test_layers.py`` reads them the same way).
"""

from __future__ import annotations

from tests.test_layers import ROOT, imported_modules


def worker_imports() -> dict[str, set[str]]:
    """{worker module: the worker modules it imports}, by dotted name."""
    files = sorted((ROOT / "worker").glob("*.py"))
    modules = {f"worker.{f.stem}": f for f in files}
    return {m: {name for _, name in imported_modules(f) if name in modules and name != m}
            for m, f in modules.items()}


def cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports from ``start`` back to it, or None."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop()
        for name in sorted(graph[path[-1]]):
            if name == start:
                return path + [start]
            if name not in seen:
                seen.add(name)
                paths.append(path + [name])
    return None


def test_no_worker_module_imports_one_that_imports_it_back():
    graph = worker_imports()
    assert "worker.elastic" in graph["worker.trainer"]  # the loop takes its dealt work from there
    cycles = {m: cycle_from(m, graph) for m in graph}
    assert {m: c for m, c in cycles.items() if c} == {}


def test_a_circle_is_found_when_there_is_one():
    graph = {"worker.a": {"worker.b"}, "worker.b": {"worker.c"}, "worker.c": {"worker.a"}, "worker.d": set()}
    assert cycle_from("worker.a", graph) == ["worker.a", "worker.b", "worker.c", "worker.a"]
    assert cycle_from("worker.d", graph) is None
