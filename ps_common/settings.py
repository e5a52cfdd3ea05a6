"""How every tfps process fills its configuration: flags, then environment.

    config = resolve(ServerConfig, args, os.environ, values_from_tf_config)

For each field of the frozen configuration dataclass, a flag given on the
command line wins, then ``TFPS_<FIELD>`` from the environment, then what
``TF_CONFIG`` said (passed in as ``values``), then the dataclass default.
Shared by ``ps_server.config`` and ``worker.config``; plain Python.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Mapping, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is shown to the user as is."""


def cast(name: str, raw: str, kind: type):
    """Turn the text of TFPS_<NAME> into the field's type, or say why not."""
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"TFPS_{name.upper()}={raw!r} is not a boolean")
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"TFPS_{name.upper()}={raw!r} is not a valid {kind.__name__}") from None


def resolve(cls: type[T], args: argparse.Namespace, environ: Mapping[str, str], values: dict | None = None) -> T:
    values = dict(values or {})
    for f in dataclasses.fields(cls):
        flag_value = getattr(args, f.name, None)
        env_value = environ.get("TFPS_" + f.name.upper())
        if flag_value is not None:
            values[f.name] = flag_value
        elif env_value not in (None, ""):
            values[f.name] = cast(f.name, env_value, type(f.default))
    return cls(**values)
