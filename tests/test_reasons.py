"""No code decides by a message's text: a refusal's reason (ps_common.reasons) is what a
worker acts on, and rewording a message changes nothing it does.

    python -m pytest tests/test_reasons.py -q

The rule, read from every module of the project (tests, bench and generated code aside):
no comparison and no string test (``in``, ``==``, ``startswith``, ...) takes an error's
``details`` or ``str(error)``. The modules marked ``recovery`` run with every message of
the server withheld (tests/withheld) and pass: the rule, shown to hold where it matters.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from ps_common.reasons import Reason, reason_of
from ps_server.core import errors
from ps_server.service import REFUSALS, STATUS_OF

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("protos", "ps_common", "ps_server", "worker", "tfps", "ps_tools", "tf_strategies", "examples")
STRING_TESTS = {"startswith", "endswith", "find", "rfind", "index", "count", "search", "match", "fullmatch"}


def _reads_text(node: ast.AST) -> bool:
    """Whether ``node`` reads an error's text: ``x.details``, ``x.details()``, ``str(x)`` of a name."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr == "details":
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "str" \
                and len(sub.args) == 1 and isinstance(sub.args[0], ast.Name) and sub.args[0].id in ("e", "exc", "err", "error"):
            return True
    return False


def decisions_by_text(source: str) -> list[int]:
    """The lines of ``source`` that test an error's text."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_reads_text(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in STRING_TESTS and (_reads_text(node.func.value) or any(map(_reads_text, node.args))):
            lines.append(node.lineno)
    return lines


def test_no_code_decides_by_the_text_of_an_error():
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            found += [f"{path.relative_to(ROOT)}:{line}" for line in decisions_by_text(path.read_text())]
    assert found == []


@pytest.mark.parametrize("source", [
    'if "is late" in e.details:\n    pass',
    'ok = e.details.startswith("shared memory:")',
    'ok = "pull first" not in str(e)',
    'ok = any(d in e.details for d in ("declared dead",))',
    'ok = e.details() == "not initialized"',
])
def test_the_check_sees_a_decision_by_text(source):
    assert decisions_by_text(source) == [1]


def test_a_decision_by_reason_passes_the_check():
    assert decisions_by_text("ok = e.reason in REJOIN or e.code == 14\nlog.info('%s', e.details)") == []


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_error_class_the_table_gives_a_status_code_has_a_reason():
    """The classes with no code in the table (PSError itself, CheckpointError: a file, never a
    call, is refused) leave as INTERNAL, a bug, with no reason."""
    classes = [c for base in REFUSALS for c in (base, *_subclasses(base))
               if any(k in STATUS_OF for k in c.__mro__)]
    assert len(classes) >= 17
    for cls in classes:
        assert isinstance(cls.reason, Reason) and cls.reason is not Reason.UNSPECIFIED, cls


def test_a_raise_site_can_name_a_more_particular_reason_and_no_other_error_has_one():
    assert reason_of(errors.InvalidArgument("x", reason=Reason.PULL_FIRST)) is Reason.PULL_FIRST
    assert reason_of(errors.InvalidArgument("x")) is Reason.INVALID
    assert reason_of(ValueError("x")) is Reason.UNSPECIFIED


def test_a_reason_a_client_does_not_know_reads_as_unspecified():
    assert Reason.of_wire(b"late") is Reason.LATE
    assert Reason.of_wire("from-a-newer-server") is Reason.UNSPECIFIED
    assert Reason.of_wire(None) is Reason.UNSPECIFIED
