"""Logging of a tfps command: our own records at the configured level, other libraries' from WARNING.

    configure_logging(config.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")

Called once by ``ps-server`` and ``ps-worker`` after their configuration is
resolved. The root logger writes to stderr at WARNING, so a library's INFO and
DEBUG chatter (matplotlib's "generated new fontManager", which Keras's import of
matplotlib triggers on a fresh machine) never reaches the user; the tfps
packages log at ``level``. matplotlib's own warnings at start (it is building
its font cache, its cache directory is not writable) are about plots a trainer
never draws, so they are dropped too. Plain Python.
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

# The packages of this project: their loggers get the configured level.
OWN = ("protos", "ps_common", "ps_server", "worker", "ps_tools", "tf_strategies", "examples")
# Third-party loggers quieter than WARNING, with the reason above.
QUIET = {"matplotlib": logging.ERROR}


def configure_logging(level: str, fmt: str, filters: Sequence[logging.Filter] = ()) -> None:
    """Root handler on stderr with ``fmt`` (and ``filters``), root at WARNING, tfps at ``level``."""
    logging.basicConfig(level=logging.WARNING, format=fmt, stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        for f in filters:
            handler.addFilter(f)
    for name in OWN:
        logging.getLogger(name).setLevel(level.upper())
    for name, quiet in QUIET.items():
        logging.getLogger(name).setLevel(quiet)
