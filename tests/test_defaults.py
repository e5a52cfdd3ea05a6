"""Each default is written once (``ps_common.defaults``): the configurations, their ``--help``,
the core's constructors and the records agree, and a rule between the server's settings is
stated once, so ``ps-server`` and the core refuse alike."""

import dataclasses
import inspect
import re
import time

import pytest

from ps_common import defaults
from ps_common.records import Registration
from ps_common.settings import ConfigError
from protos import wire
from ps_server.config import ServerConfig
from ps_server.core import checkpoint
from ps_server.core.modes.async_mode import AsyncMode
from ps_server.core.errors import InvalidArgument
from ps_server.core.membership import Membership
from ps_server.core.parameter_server import ParameterServer
from ps_server.core.settings import Settings
from ps_server.core.modes.ssp_mode import SSPMode
from ps_server.core.modes.sync_mode import SyncMode
from worker.config import WorkerConfig

# "(default 60)", "default 0: off", "(default cnn)"; not "(default: all)", which describes.
_STATED = re.compile(r"\bdefault (\S+?)(?:[;),]|: )")


def _stated_equals(text: str, value) -> bool:
    if isinstance(value, bool):
        return text == ("on" if value else "off")
    if isinstance(value, (int, float)):
        return float(text) == value
    return text == value


@pytest.mark.parametrize("cls", [ServerConfig, WorkerConfig])
def test_every_default_a_help_text_states_is_the_configurations_own(cls):
    defaults_of = {f.name: f.default for f in dataclasses.fields(cls)}
    checked = 0
    for action in cls.parser()._actions:
        stated = _STATED.findall(action.help or "")
        if action.dest not in defaults_of or not stated or action.dest == "threads":
            continue
        assert _stated_equals(stated[0], defaults_of[action.dest]), \
            f"{action.option_strings[0]} says default {stated[0]}, the field is {defaults_of[action.dest]!r}"
        checked += 1
    assert checked >= 10  # the pattern still finds the help texts' defaults


def test_the_thread_pool_help_states_the_pools_formula():
    help_text = next(a.help for a in ServerConfig.parser()._actions if a.dest == "threads")
    assert f"max({defaults.MIN_THREADS}, {defaults.THREADS_PER_CPU} x CPUs)" in help_text
    assert ServerConfig(threads=0).pool_threads >= defaults.MIN_THREADS


def _parameters(function) -> dict:
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_the_cores_defaults_are_the_server_configurations():
    # Every setting of the core is a flag of ps-server, by the same name and default.
    config = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    core = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert {"barrier_timeout", "lease_timeout", "replacement_timeout", "max_staleness"} <= set(core) <= set(config)
    assert core == {name: config[name] for name in core}
    assert _parameters(ParameterServer.__init__) == {"mode": core["mode"], "num_workers": core["num_workers"],
                                                     "clock": time.monotonic}
    assert Settings.of(ServerConfig()) == Settings()


def test_each_constructor_and_record_takes_the_one_constant():
    assert ServerConfig().barrier_timeout == defaults.BARRIER_TIMEOUT
    assert ServerConfig().lease_timeout == Registration.__dataclass_fields__["lease_timeout"].default \
        == _parameters(Membership.__init__)["lease_timeout"] == defaults.LEASE_TIMEOUT
    assert _parameters(SyncMode.__init__)["replacement_timeout"] == defaults.REPLACEMENT_TIMEOUT
    assert _parameters(SSPMode.__init__)["barrier_timeout"] == defaults.BARRIER_TIMEOUT
    assert _parameters(SSPMode.__init__)["max_staleness"] == _parameters(AsyncMode.__init__)["max_staleness"] \
        == ServerConfig().max_staleness == defaults.MAX_STALENESS
    assert _parameters(checkpoint.write_checkpoint)["keep"] == ServerConfig().checkpoint_keep \
        == defaults.CHECKPOINT_KEEP
    assert ServerConfig().max_message_mb == WorkerConfig().max_message_mb \
        == wire._TransportSetting().max_message_mb == defaults.MAX_MESSAGE_MB
    assert WorkerConfig().ps == f"{ServerConfig().host}:{ServerConfig().port}" == defaults.PS_ADDRESS


@pytest.mark.parametrize("settings", [
    dict(mode="sync", stale_gradient_policy="drop"),
    dict(mode="sync", async_apply="hogwild"),
    dict(mode="async", elastic_min_workers=2),
    dict(mode="sync", elastic_min_workers=5),
    dict(mode="sync", elastic_min_workers=2, replicas_to_aggregate=1),
    dict(mode="sync", micro_batches=4),
])
def test_a_rule_between_server_settings_refuses_alike_in_the_config_and_the_core(settings):
    with pytest.raises(ConfigError) as refused_by_config:
        ServerConfig(num_workers=4, **settings).validate()
    with pytest.raises(InvalidArgument) as refused_by_core:
        ParameterServer(num_workers=4, **settings)
    assert str(refused_by_config.value) == str(refused_by_core.value)


def test_a_default_the_docs_state_for_a_flag_is_the_configurations():
    """``--checkpoint-interval`` seconds (default 30), as docs/checkpoints.md says it."""
    from pathlib import Path

    fields = {f.name: f.default for cls in (ServerConfig, WorkerConfig) for f in dataclasses.fields(cls)}
    stated = re.compile(r"`--([a-z-]+)(?: [A-Z]+)?`[^`(.]*?\(default ([^)\s,;:]+)")
    root = Path(__file__).resolve().parents[1]
    found = [(path.name, flag.replace("-", "_"), value) for path in [root / "README.md", *(root / "docs").glob("*.md")]
             for flag, value in stated.findall(path.read_text())]
    checked = [(doc, name, value) for doc, name, value in found if name in fields]
    assert len(checked) >= 3
    assert [(doc, name, value) for doc, name, value in checked if not _stated_equals(value, fields[name])] == []


@pytest.mark.parametrize("settings", [dict(log_level="LOUD"), dict(metrics_port=70000),
                                      dict(tls_cert_file="c.pem"), dict(tls_key_file="k.pem")])
def test_a_field_both_processes_have_is_refused_alike_by_each(settings):
    with pytest.raises(ConfigError) as refused_by_server:
        ServerConfig(**settings).validate()
    with pytest.raises(ConfigError) as refused_by_worker:
        WorkerConfig(**({"tls_ca_file": "ca.pem"} if "tls_cert_file" in settings else {}), **settings).validate()
    assert str(refused_by_server.value) == str(refused_by_worker.value)
