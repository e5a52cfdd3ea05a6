"""The text of every refusal withheld, for the ``recovery`` tests (``sitecustomize.py``).

    with messages_withheld():   # this process, and every Python process started meanwhile
        ...

``tests/conftest.py`` applies it to each test marked ``recovery``; a module-scoped fixture
that starts the processes of such tests applies it itself, since it starts them first.
"""

from __future__ import annotations

import contextlib
import os
import pathlib

import pytest

from tests.withheld.sitecustomize import WITHHELD, withhold

HERE = str(pathlib.Path(__file__).parent)


@contextlib.contextmanager
def messages_withheld():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFPS_TEST_WITHHOLD_MESSAGES", "1")
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p))
        withhold(mp.setattr)
        yield


__all__ = ["WITHHELD", "messages_withheld"]
