"""The error of a configuration that cannot run, below every module that raises it.

    from ps_common.settings import ConfigError     # as most callers write it
    raise ConfigError("--port must be in 0..65535")

``settings`` (the resolver) raises it and offers the name to its importers; ``tf_config``
and ``slurm``, which ``settings`` reads, derive their own errors from it, so they take
it from here and nothing in ``ps_common`` imports in a circle. Plain Python.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run; the message is shown to the user as is."""
