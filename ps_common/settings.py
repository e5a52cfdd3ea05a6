"""How every tfps process fills its configuration: flags, then environment, then ``TF_CONFIG``.

    config = resolve(ServerConfig, args, os.environ, role="ps")       # ps_server.config
    config = resolve(WorkerConfig, args, os.environ, role="worker")   # worker.config

This module is the one place that maps a flag, an environment variable or a
``TF_CONFIG`` entry to a field. For each field of the frozen configuration
dataclass a flag given on the command line wins, then the field's environment
variable, then what ``TF_CONFIG`` says for the process's role, then the
dataclass default.

Environment names. A field's variable is ``TFPS_<FIELD>`` (``--num-workers``:
``TFPS_NUM_WORKERS``) unless the field is declared with ``setting(env=...)``.
Where the server and the worker have a field of the same name that means
different things (the server's certificate and the worker's client certificate,
the port each one's metrics endpoint binds, the server allowing shared memory
and the worker asking for it), each side has a variable of its own,
``TFPS_SERVER_<FIELD>`` and ``TFPS_WORKER_<FIELD>``, so that one environment
(``ps-launch`` hands the same one to every child) cannot configure both by
accident. The flags keep their names. The old shared name (``old_env``) is still
read by a process started alone, where it is unambiguous, with a one-line
deprecation warning; ``ps-launch`` refuses it (``deprecated_env``). Fields of
the same meaning on both sides (``TFPS_NUM_WORKERS``, ``TFPS_LOG_LEVEL``,
``TFPS_AUTH_TOKEN_FILE``, ``TFPS_MAX_MESSAGE_MB``, ``TFPS_METRICS_HOST``) share
one name on purpose.

``TF_CONFIG`` (``ps_common.tf_config``), by role:

* ``ps`` (task type ``ps``, index i): ``port`` is the port of ``cluster.ps[i]``,
  ``host`` 0.0.0.0 (the address the other tasks use names this host),
  ``num_workers`` the number of chief and worker tasks;
* ``worker`` (task type ``chief`` or ``worker``): ``ps`` is every ``cluster.ps``
  entry, in order, each one server shard; ``worker_index`` the task's position
  (the chief is worker 0); ``num_workers`` as above.

A ``TF_CONFIG`` that cannot be read raises ``ConfigError`` like any other bad
setting. ``ConfigError`` is defined in ``ps_common.errors``, below this module and
the two it reads the cluster from; import it from here or from there.

``TFPS_CLUSTER`` says where the cluster description comes from: unset, empty or
``tf_config``, from ``TF_CONFIG`` as above; ``slurm``, from the Slurm environment
of an ``srun`` task instead (``ps_common.slurm``: the first ``TFPS_SLURM_NUM_PS``
tasks serve, the others train), giving the same fields by role, and ``TF_CONFIG``
is not read. It is an explicit choice, not guessed from ``SLURM_PROCID``: a
process started by hand inside a Slurm allocation keeps today's defaults.
``ps-slurm`` (``ps_tools.slurm``) sets it for the processes it starts. Plain
Python: no gRPC, no TensorFlow.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, Callable, Mapping, Self, TypeVar

from ps_common.errors import ConfigError

T = TypeVar("T")

log = logging.getLogger("ps_common.settings")

PREFIX = "TFPS_"
ROLES = ("ps", "worker")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def setting(default: Any, *, env: str | None = None, old_env: str | None = None,
            parse: Callable[[str], Any] | None = None) -> Any:
    """A configuration field whose environment variable is ``env`` instead of
    ``TFPS_<FIELD>``; ``old_env``, its former name, is still read with a
    deprecation warning; ``parse`` turns the variable's text into the value
    (default: by the type of ``default``)."""
    metadata = {}
    if env:
        metadata["env"] = env
    if old_env:
        metadata["old_env"] = old_env
    if parse:
        metadata["parse"] = parse
    return dataclasses.field(default=default, metadata=metadata)


def env_name(f: dataclasses.Field) -> str:
    """The environment variable of field ``f``."""
    return f.metadata.get("env") or PREFIX + f.name.upper()


def env_names(cls: type) -> dict[str, str]:
    """{field: its environment variable} for a configuration class."""
    return {f.name: env_name(f) for f in dataclasses.fields(cls)}


def deprecated_env(cls: type) -> dict[str, str]:
    """{old variable: the one that replaced it} for a configuration class."""
    return {f.metadata["old_env"]: env_name(f) for f in dataclasses.fields(cls) if "old_env" in f.metadata}


def cast(source: str, raw: str, kind: type, parse: Callable[[str], Any] | None = None):
    """Turn the text ``raw`` of ``source`` (a variable's name) into a value of ``kind``, or say why not."""
    if parse is not None:
        try:
            return parse(raw)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{source}={raw!r}: {e}") from None
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"{source}={raw!r} is not a boolean")
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{source}={raw!r} is not a valid {kind.__name__}") from None


def _from_environment(f: dataclasses.Field, environ: Mapping[str, str]):
    """The field's value from the environment, or None if its variable (and its old name) is unset or empty."""
    name = env_name(f)
    raw = environ.get(name)
    if raw in (None, "") and "old_env" in f.metadata:
        old = f.metadata["old_env"]
        raw = environ.get(old)
        if raw not in (None, ""):
            log.warning("%s is deprecated: it meant different things to ps-server and ps-worker; "
                        "this process reads it as %s", old, name)
            name = old
    if raw in (None, ""):
        return None
    return cast(name, raw, type(f.default), f.metadata.get("parse"))


def tf_config_values(role: str, environ: Mapping[str, str]) -> dict:
    """The fields that ``TF_CONFIG`` in ``environ`` sets for a process of ``role`` (module docstring)."""
    from ps_common.tf_config import parse_tf_config, port_of

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    spec = parse_tf_config(environ.get("TF_CONFIG"))
    values: dict = {}
    if spec is None:
        return values
    if role == "ps" and spec.task_type == "ps" and spec.ps_addresses:
        if spec.task_index >= len(spec.ps_addresses):
            raise ConfigError(f"TF_CONFIG task.index {spec.task_index} has no entry in cluster.ps "
                              f"({len(spec.ps_addresses)} entries)")
        values["port"] = port_of(spec.ps_addresses[spec.task_index], f"cluster.ps[{spec.task_index}]")
        values["host"] = "0.0.0.0"  # the address other tasks use names this host
        if spec.num_workers:
            values["num_workers"] = spec.num_workers
    elif role == "worker" and spec.task_type in ("worker", "chief"):
        if spec.ps_addresses:
            values["ps"] = ",".join(spec.ps_addresses)  # every ps task is a shard, in order
        if spec.num_workers:
            values["num_workers"] = spec.num_workers
        values["worker_index"] = spec.task_index
    return values


CLUSTER_ENV = "TFPS_CLUSTER"
CLUSTER_SOURCES = ("tf_config", "slurm")


def cluster_values(role: str, environ: Mapping[str, str]) -> dict:
    """The fields the cluster description sets for ``role``: ``TF_CONFIG``, or with
    ``TFPS_CLUSTER=slurm`` the Slurm environment (module docstring)."""
    source = (environ.get(CLUSTER_ENV) or "tf_config").strip().lower()
    if source not in CLUSTER_SOURCES:
        raise ConfigError(f"{CLUSTER_ENV}={environ.get(CLUSTER_ENV)!r} must be one of {', '.join(CLUSTER_SOURCES)}")
    if source == "slurm":
        from ps_common import slurm

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        return slurm.cluster_values(role, environ)
    return tf_config_values(role, environ)


def resolve(cls: type[T], args: argparse.Namespace | None, environ: Mapping[str, str],
            role: str | None = None) -> T:
    """An instance of ``cls``: each field from its flag in ``args``, else its environment
    variable, else the cluster description for ``role`` ("ps" or "worker"; None: not read):
    ``TF_CONFIG``, or the Slurm environment with ``TFPS_CLUSTER=slurm``; else the default."""
    values = cluster_values(role, environ) if role else {}
    for f in dataclasses.fields(cls):
        flag_value = getattr(args, f.name, None)
        if flag_value is not None:
            values[f.name] = flag_value
            continue
        env_value = _from_environment(f, environ)
        if env_value is not None:
            values[f.name] = env_value
    return cls(**values)


class FromFlags:
    """``from_args`` and ``from_namespace`` of a configuration dataclass with ``parser()``,
    ``validate()`` and ``ROLE``, the role ``resolve`` reads the cluster for."""

    @classmethod
    def from_args(cls, argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> Self:
        """Parse ``argv`` and resolve; ``ConfigError`` for a configuration that cannot run."""
        return cls.from_namespace(cls.parser().parse_args(argv), environ)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Self:
        return resolve(cls, args, os.environ if environ is None else environ, role=cls.ROLE).validate()


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def check_shared_fields(config) -> None:
    """ConfigError unless the fields ps-server and ps-worker both have (--log-level,
    --metrics-port, --tls-cert-file with --tls-key-file) are valid: one rule for both."""
    if config.log_level.upper() not in LOG_LEVELS:
        raise ConfigError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {config.log_level!r}")
    if not 0 <= config.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be in 1..65535 (or 0 for no metrics), got {config.metrics_port}")
    if bool(config.tls_cert_file) != bool(config.tls_key_file):
        raise ConfigError("--tls-cert-file and --tls-key-file go together (a certificate and its key)")


def command_config(cls: type[T], argv: list[str] | None, prog: str) -> T:
    """The resolved configuration of command ``prog`` (``ps-server``, ``ps-worker``) from
    ``argv``: ``cls.parser()`` parses it, ``cls.from_namespace`` resolves it. A bad setting
    prints ``prog: error: ...`` and exits 2; ``--print-config`` prints the configuration
    as JSON and exits 0."""
    import sys

    args = cls.parser().parse_args(argv)
    try:
        config = cls.from_namespace(args)
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(to_json(config), flush=True)
        raise SystemExit(0)
    return config


def to_json(config, indent: int | None = 2) -> str:
    """The resolved configuration as JSON, field by field: what ``--print-config``
    prints, and (``indent=None``: one line) what the DEBUG log shows at start."""
    import json

    return json.dumps(dataclasses.asdict(config), indent=indent)
