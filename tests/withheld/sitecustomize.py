"""Every refusal's text withheld, in each Python process of a ``recovery`` test.

A test marked ``recovery`` (``tests/conftest.py``, ``messages_withheld``) puts this folder
first on PYTHONPATH and sets ``TFPS_TEST_WITHHOLD_MESSAGES=1``: the servers and workers it
starts import this module at start-up (``site``), and the test's own process calls
``withhold()``. Every error class the server refuses with (``ps_server.service.REFUSALS``)
then says ``WITHHELD`` for its message, on the wire and in the logs. The recovery tests pass
all the same: a worker decides by the refusal's reason (``ps_common.reasons``), never
by its words.
"""

import os

WITHHELD = "(message withheld by the test)"


def _withheld(self) -> str:
    return WITHHELD


def withhold(set_attribute=setattr) -> list[type]:
    """Replace the text of every refusal class (with ``set_attribute``: a test's
    ``monkeypatch.setattr`` undoes it); returns the classes it changed."""
    from protos import codec, shm
    from ps_server.core import errors

    classes = [errors.PSError, codec.CodecError, shm.ShmError]  # broadcast's errors are PSErrors
    for cls in classes:
        set_attribute(cls, "__str__", _withheld)
    return classes


if os.environ.get("TFPS_TEST_WITHHOLD_MESSAGES") == "1":
    withhold()
