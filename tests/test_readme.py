"""The README's two commands stay true: CI runs exactly its test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
