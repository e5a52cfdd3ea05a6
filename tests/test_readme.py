"""The README and the pages of docs/ stay true.

    .venv/bin/python -m pytest -q tests/test_readme.py

Rules checked:
- the README's two commands: CI runs exactly its test command, and its train
  command is the acceptance command;
- every relative link of README.md, docs/*.md, RELIABILITY.md and BENCHMARKS.md
  points to a file that exists (and to a heading of it, for ``page.md#heading``);
- every repository path those pages name in backticks exists, and every test they
  name as ``path::test_name`` is defined in that file;
- every ``ps-*`` command line of a ``sh`` block parses with that command's own
  argparse parser, with no flag it does not know (``ps-launch --worker-args I "ARGS"``
  and ``ps-advise --launch ARGS`` are parsed as ps-worker's and ps-launch's);
- every ``--flag`` a table row lists for a ``ps-*`` command is one its parser knows;
- every ``python`` block compiles.
Each check is also run on a made-up page it must refuse.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shlex
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "RELIABILITY.md", ROOT / "BENCHMARKS.md",
                *(ROOT / "docs").glob("*.md")])


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(python3 -m venv .*)\n```", text)


def test_ci_runs_exactly_the_readme_test_command():
    commands = _readme_commands()
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests[0] in ci, "the .ci/run command differs from README's test command"


def test_readme_train_command_is_the_issue_acceptance_command():
    train = [c for c in _readme_commands() if "ps-launch" in c]
    assert len(train) == 1
    assert "--mode sync --workers 2 --dataset digits --epochs 3 --metrics-json m.json" in train[0]


# -- links and paths ------------------------------------------------------------------
def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def _prose(text: str) -> str:
    """The page without its fenced blocks (a diagram or an output is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", _prose(page.read_text()), re.M)}


def broken_links(page: pathlib.Path, text: str) -> list[str]:
    wrong = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            wrong.append(f"{page.name}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            wrong.append(f"{page.name}: {target}: no such heading")
    return wrong


TOPS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def missing_paths(page_name: str, text: str) -> list[str]:
    """Backticked paths under a top-level folder of the repository, and ``::test`` names."""
    wrong = []
    for line in text.splitlines():
        last = None
        for token in re.findall(r"`([^`\s]+)`", line):
            path, _, test = token.partition("::")
            if path:
                if "/" not in path or path.split("/")[0] not in TOPS or re.search(r"[*<>{}$]", path):
                    continue
                last = path
                if not (ROOT / path).exists():
                    wrong.append(f"{page_name}: {path}: no such file")
                    continue
            if test and last and (ROOT / last).is_file():
                name = re.sub(r"\[.*$", "", test)
                if not re.search(rf"^\s*def {re.escape(name)}\(", (ROOT / last).read_text(), re.M):
                    wrong.append(f"{page_name}: {last}::{name}: no such test")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    assert broken_links(page, page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_and_test_a_page_names_exists(page):
    assert missing_paths(page.name, page.read_text()) == []


def test_the_link_and_path_checks_see_what_is_wrong():
    page = ROOT / "docs" / "made-up.md"
    text = ("[a](modes.md) [b](nowhere.md) [c](modes.md#no-such-heading) [d](https://example.com)\n"
            "`ps_tools/launch.py` `worker/launch.py` `tests/test_readme.py::test_no_such_test`\n"
            "`tests/test_readme.py::test_ci_runs_exactly_the_readme_test_command`, `::test_missing_too`\n")
    assert broken_links(page, text) == ["made-up.md: nowhere.md: no such file",
                                        "made-up.md: modes.md#no-such-heading: no such heading"]
    assert missing_paths("made-up.md", text) == [
        "made-up.md: worker/launch.py: no such file",
        "made-up.md: tests/test_readme.py::test_no_such_test: no such test",
        "made-up.md: tests/test_readme.py::test_missing_too: no such test",
    ]


# -- command lines ----------------------------------------------------------------------
class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _parser_built_in(main) -> argparse.ArgumentParser:
    """The parser a ``main`` builds for itself: stop it at its first parse."""
    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = stop
    try:
        main([])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise AssertionError(f"{main} parsed no arguments")


def _parsers() -> dict:
    from ps_server.config import ServerConfig
    from ps_tools import export, launch, slurm, status
    from ps_tools.study import advise, compare
    from tf_strategies import parity
    from worker.config import WorkerConfig

    return {
        "ps-server": ServerConfig.parser,
        "ps-worker": WorkerConfig.parser,
        "ps-launch": launch.parser,
        "ps-compare": compare.parser,
        "ps-export": export.parser,
        "ps-parity": parity.parser,
        "ps-advise": lambda: _parser_built_in(advise.main),
        "ps-status": lambda: _parser_built_in(status.main),
        "ps-slurm": slurm.parser,
    }


def test_every_installed_command_has_its_parser_here():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(scripts) == sorted(_parsers())


def _commands(block: str) -> list[list[str]]:
    """The ``ps-*`` command lines of a sh block, as argv (comments, pipes, ``&&`` split off)."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in (";", "&&", "||", "|", "&", ">", ">>"):
                if command and os.path.basename(command[0]).startswith("ps-"):
                    found.append([os.path.basename(command[0]), *command[1:]])
                command = [] if token not in (">", ">>") else None
            elif command is not None:
                command.append(token)
    return found


def bad_command_lines(text: str) -> list[str]:
    parsers = _parsers()
    wrong = []

    def check(argv: list[str], shown: str) -> None:
        name, args = argv[0], argv[1:]
        if name not in parsers:
            wrong.append(f"{shown}: no command {name}")
            return
        p = parsers[name]()
        if name == "ps-compare" and "--virtual" in args:  # its own parser (ps_tools.study.virtual_compare)
            from ps_tools.study import virtual_compare

            p = virtual_compare.parser()

        def error(message):
            raise ValueError(message)

        p.error = error
        try:
            known, rest = p.parse_known_args(args)
        except ValueError as e:
            wrong.append(f"{shown}: {e}")
            return
        if rest:
            wrong.append(f"{shown}: {name} does not know {' '.join(rest)}")
        for _, worker_args in getattr(known, "worker_args", None) or []:
            check(["ps-worker", *shlex.split(worker_args)], shown)
        if name == "ps-advise" and known.launch:
            check(["ps-launch", *[a for a in known.launch if a != "--"]], shown)

    for block in _blocks(text, "sh"):
        for argv in _commands(block):
            check(argv, " ".join(argv))
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_line_uses_only_flags_its_command_knows(page):
    assert bad_command_lines(page.read_text()) == []


def test_the_command_check_sees_an_unknown_flag_a_wrong_choice_and_a_bad_nested_flag():
    text = ("```sh\n"
            "ps-server --mode sync --made-up-flag 3   # a comment --not-a-flag\n"
            "ps-worker --ps 127.0.0.1:50051 \\\n  --dataset digits --epochs 3 && ps-status a:1 --wach\n"
            "ps-launch --mode lockstep\n"
            "ps-launch --workers 3 --worker-args 2 \"--slowdown 3 --slowness 4\"\n"
            "ps-advise --launch --workers 3 --no-such-launch-flag\n"
            "```\n")
    wrong = bad_command_lines(text)
    assert len(wrong) == 5, wrong
    assert "ps-server does not know --made-up-flag 3" in wrong[0]
    assert "ps-status does not know --wach" in wrong[1]
    assert "invalid choice: 'lockstep'" in wrong[2]
    assert "ps-worker does not know --slowness 4" in wrong[3]
    assert "ps-launch does not know --no-such-launch-flag" in wrong[4]


def bad_table_flags(text: str) -> list[str]:
    """The ``--flags`` a table row ``| `ps-x` | ... |`` lists that ps-x's parser does not know."""
    parsers = _parsers()
    wrong = []
    for name, cells in re.findall(r"^\| `(ps-[a-z]+)` \| (.*) \|$", text, re.M):
        if name not in parsers:
            wrong.append(f"no command {name}")
            continue
        known = set(parsers[name]()._option_string_actions)
        wrong += [f"{name} does not know {flag}" for flag in re.findall(r"--[a-z][a-z0-9-]*", cells)
                  if flag not in known]
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_flag_a_table_lists_for_a_command_is_that_commands(page):
    assert bad_table_flags(page.read_text()) == []


def test_the_table_check_sees_a_flag_of_another_command():
    text = "| command | flags |\n| --- | --- |\n| `ps-status` | `H:P --watch [N] --timeout S --workers N` |\n"
    assert bad_table_flags(text) == ["ps-status does not know --workers"]


# -- python blocks ----------------------------------------------------------------------
def python_errors(page_name: str, text: str) -> list[str]:
    wrong = []
    for number, block in enumerate(_blocks(text, "python")):
        try:
            compile(block, f"{page_name} python block {number}", "exec")
        except SyntaxError as e:
            wrong.append(f"{page_name} python block {number}: {e.msg}")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_block_compiles(page):
    assert python_errors(page.name, page.read_text()) == []


def test_the_python_check_sees_a_syntax_error():
    text = "```python\nx = 1\n```\n\n```python\ndef f(:\n    pass\n```\n"
    assert python_errors("made-up.md", text) == ["made-up.md python block 1: invalid syntax"]
