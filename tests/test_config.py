"""Configuration: a flag beats TFPS_<FLAG>, which beats TF_CONFIG, which beats the default."""

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from ps_server.config import ServerConfig
from ps_common.settings import ConfigError, env_names
from worker.config import WorkerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TF_CONFIG = json.dumps({
    "cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "ps": ["ps0:2222"]},
    "task": {"type": "worker", "index": 1},
})


def test_flag_beats_environment_beats_default():
    assert ServerConfig.from_args([], environ={}).num_workers == 1
    assert ServerConfig.from_args([], environ={"TFPS_NUM_WORKERS": "3"}).num_workers == 3
    assert ServerConfig.from_args(["--num-workers", "4"], environ={"TFPS_NUM_WORKERS": "3"}).num_workers == 4


def test_tf_config_gives_the_worker_its_server_index_and_cluster_size():
    c = WorkerConfig.from_args([], environ={"TF_CONFIG": TF_CONFIG})
    assert (c.ps, c.worker_index, c.num_workers) == ("ps0:2222", 2, 3)  # the chief is worker 0
    c = WorkerConfig.from_args(["--worker-index", "0"], environ={"TF_CONFIG": TF_CONFIG})
    assert c.worker_index == 0


def test_tf_config_gives_the_server_its_port_and_worker_count():
    doc = json.loads(TF_CONFIG)
    doc["task"] = {"type": "ps", "index": 0}
    c = ServerConfig.from_args([], environ={"TF_CONFIG": json.dumps(doc)})
    assert (c.port, c.num_workers, c.host) == (2222, 3, "0.0.0.0")


def test_environment_booleans_are_parsed_strictly():
    assert WorkerConfig.from_args([], environ={"TFPS_DETERMINISTIC": "off"}).deterministic is False
    with pytest.raises(ConfigError, match="TFPS_DETERMINISTIC='maybe' is not a boolean"):
        WorkerConfig.from_args([], environ={"TFPS_DETERMINISTIC": "maybe"})


def test_invalid_tf_config_is_a_clear_error():
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        WorkerConfig.from_args([], environ={"TF_CONFIG": "{nope"})


def test_the_pool_is_sized_from_the_cpus_not_the_workers_and_takes_at_least_two_threads():
    # Waiting calls hold no thread (ps_server.aio): 8 workers and 1024 get the same pool.
    assert ServerConfig.from_args(["--num-workers", "8"], environ={}).pool_threads == \
        ServerConfig.from_args(["--num-workers", "1024"], environ={}).pool_threads >= 8
    assert ServerConfig.from_args(["--num-workers", "8", "--threads", "3"], environ={}).pool_threads == 3
    with pytest.raises(ConfigError, match=">= 2"):
        ServerConfig.from_args(["--num-workers", "8", "--threads", "1"], environ={})


def test_worker_index_auto_from_a_flag_or_the_environment():
    from worker.config import AUTO_INDEX

    assert WorkerConfig.from_args(["--worker-index", "auto", "--num-workers", "3"], environ={}).worker_index == AUTO_INDEX
    c = WorkerConfig.from_args([], environ={"TFPS_WORKER_INDEX": "auto", "TFPS_NUM_WORKERS": "3"})
    assert c.worker_index == AUTO_INDEX and not c.is_chief  # the chief is whoever the server makes worker 0
    with pytest.raises(SystemExit):
        WorkerConfig.from_args(["--worker-index", "first"], environ={})
    with pytest.raises(ConfigError, match="--worker-index must be in 0..1 or auto, got -2"):
        WorkerConfig.from_args(["--num-workers", "2"], environ={"TFPS_WORKER_INDEX": "-2"})


def test_server_exit_when_done_from_a_flag_or_the_environment():
    assert not ServerConfig.from_args([], environ={}).exit_when_done
    assert ServerConfig.from_args(["--exit-when-done"], environ={}).exit_when_done
    assert ServerConfig.from_args([], environ={"TFPS_EXIT_WHEN_DONE": "1"}).exit_when_done


# -- TF_CONFIG: every ps task is a shard ----------------------------------------------
TFJOB = {"cluster": {"ps": ["ps0:2222", "ps1:2223"], "chief": ["c0:2222"], "worker": ["w0:2222"]}}


def tfjob(task_type: str, index: int) -> dict:
    return {"TF_CONFIG": json.dumps({**TFJOB, "task": {"type": task_type, "index": index}})}


def test_tf_config_makes_every_ps_task_a_shard_in_order():
    """A Kubeflow TFJob with two PS replicas trains on both, not on cluster.ps[0] alone."""
    chief = WorkerConfig.from_args([], environ=tfjob("chief", 0))
    worker = WorkerConfig.from_args([], environ=tfjob("worker", 0))
    assert chief.ps_addresses == worker.ps_addresses == ["ps0:2222", "ps1:2223"]
    assert (chief.worker_index, worker.worker_index, chief.num_workers) == (0, 1, 2)
    assert WorkerConfig.from_args(["--ps", "elsewhere:1"], environ=tfjob("chief", 0)).ps == "elsewhere:1"


def test_tf_config_gives_each_ps_task_the_port_of_its_own_entry():
    ports = [ServerConfig.from_args([], environ=tfjob("ps", i)).port for i in (0, 1)]
    assert ports == [2222, 2223]
    assert ServerConfig.from_args([], environ=tfjob("ps", 1)).num_workers == 2  # chief and worker


@pytest.mark.parametrize("doc, message, configs", [
    ("{nope", "TF_CONFIG is not valid JSON", (ServerConfig, WorkerConfig)),
    (json.dumps({"cluster": {"ps": ["ps0"]}, "task": {"type": "ps"}}),
     "TF_CONFIG cluster.ps[0] must be HOST:PORT, got 'ps0'", (ServerConfig, WorkerConfig)),
    (json.dumps({"cluster": {"ps": ["a:1", "b:x"]}, "task": {"type": "worker"}}),
     "TF_CONFIG cluster.ps[1] must be HOST:PORT, got 'b:x'", (ServerConfig, WorkerConfig)),
    (json.dumps({**TFJOB, "task": {"type": "worker", "index": "one"}}), "TF_CONFIG task.index must be an integer",
     (ServerConfig, WorkerConfig)),
    (json.dumps({**TFJOB, "task": {"type": "ps", "index": 2}}),
     "TF_CONFIG task.index 2 has no entry in cluster.ps (2 entries)", (ServerConfig,)),
])
def test_a_bad_tf_config_is_a_configuration_error_like_any_other(doc, message, configs):
    for config in configs:
        with pytest.raises(ConfigError, match=re.escape(message)):
            config.from_args([], environ={"TF_CONFIG": doc})


# -- one name, one meaning --------------------------------------------------------------
def test_server_and_worker_read_their_own_variable_where_they_mean_different_things():
    env = {"TFPS_SERVER_SHM": "0", "TFPS_WORKER_SHM": "1", "TFPS_SERVER_METRICS_PORT": "9100",
           "TFPS_WORKER_METRICS_PORT": "9200", "TFPS_SERVER_TLS_CERT_FILE": "server.crt",
           "TFPS_SERVER_TLS_KEY_FILE": "server.key", "TFPS_WORKER_TLS_CERT_FILE": "client.crt",
           "TFPS_WORKER_TLS_KEY_FILE": "client.key", "TFPS_TLS_CA_FILE": "ca.crt"}
    s = ServerConfig.from_args([], environ=env)
    w = WorkerConfig.from_args([], environ=env)
    assert (s.shm, s.metrics_port, s.tls_cert_file, s.tls_key_file) == (False, 9100, "server.crt", "server.key")
    assert (w.shm, w.metrics_port, w.tls_cert_file, w.tls_key_file) == (True, 9200, "client.crt", "client.key")


def test_names_shared_by_server_and_worker_are_only_those_of_the_same_meaning():
    """Adding a field to both configurations forces the choice: the same meaning, or names of its own."""
    shared = set(env_names(ServerConfig).values()) & set(env_names(WorkerConfig).values())
    assert shared == {"TFPS_NUM_WORKERS", "TFPS_LOG_LEVEL", "TFPS_AUTH_TOKEN_FILE", "TFPS_MAX_MESSAGE_MB",
                      "TFPS_METRICS_HOST"}
    renamed = {"shm", "tls_cert_file", "tls_key_file", "metrics_port"}  # the fields both have, meaning apart
    for config, side in ((ServerConfig, "SERVER"), (WorkerConfig, "WORKER")):
        own = {f: name for f, name in env_names(config).items() if name != f"TFPS_{f.upper()}"}
        assert own == {f: f"TFPS_{side}_{f.upper()}" for f in renamed}
    both = {f.name for f in dataclasses.fields(ServerConfig)} & {f.name for f in dataclasses.fields(WorkerConfig)}
    assert both == renamed | {"num_workers", "log_level", "auth_token_file", "max_message_mb", "metrics_host"}


@pytest.mark.parametrize("env, field, value", [
    ({"TFPS_SHM": "0"}, "shm", False),
    ({"TFPS_SHM": "1"}, "shm", True),
    ({"TFPS_METRICS_PORT": "9300"}, "metrics_port", 9300),
    ({"TFPS_TLS_CERT_FILE": "x.crt", "TFPS_TLS_KEY_FILE": "x.key", "TFPS_TLS_CA_FILE": "ca.crt"}, "tls_key_file",
     "x.key"),
], ids=["shm_off", "shm_on", "metrics_port", "tls"])
def test_an_old_shared_name_still_works_in_a_process_alone_with_a_one_line_warning(env, field, value, caplog):
    for config, side in ((ServerConfig, "SERVER"), (WorkerConfig, "WORKER")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ps_common.settings"):
            assert getattr(config.from_args([], environ=env), field) == value
        old = [name for name in env if name != "TFPS_TLS_CA_FILE"]
        assert [r.getMessage() for r in caplog.records] == [
            f"{name} is deprecated: it meant different things to ps-server and ps-worker; this process reads it "
            f"as TFPS_{side}_{name.removeprefix('TFPS_')}" for name in old]


def test_the_new_name_wins_over_the_old_one_and_a_flag_over_both():
    env = {"TFPS_METRICS_PORT": "9300", "TFPS_SERVER_METRICS_PORT": "9301"}
    assert ServerConfig.from_args([], environ=env).metrics_port == 9301
    assert ServerConfig.from_args(["--metrics-port", "9302"], environ=env).metrics_port == 9302


# -- the message limit: a field of both, read through the resolver ---------------------
def test_max_message_mb_is_a_field_of_both_from_a_flag_or_the_environment():
    assert ServerConfig.from_args([], environ={}).max_message_bytes == 1024 * 2**20
    assert ServerConfig.from_args([], environ={"TFPS_MAX_MESSAGE_MB": "2"}).max_message_bytes == 2 * 2**20
    assert WorkerConfig.from_args(["--max-message-mb", "0.5"], environ={"TFPS_MAX_MESSAGE_MB": "2"}).max_message_bytes \
        == 2**19
    assert ServerConfig.from_args(["--max-message-mb", "4096"], environ={}).max_message_bytes == 2**31 - 1  # gRPC's cap
    for config in (ServerConfig, WorkerConfig):
        with pytest.raises(ConfigError, match="--max-message-mb .* must be a positive number of MiB, got 0"):
            config.from_args(["--max-message-mb", "0"], environ={})
        with pytest.raises(ConfigError, match="TFPS_MAX_MESSAGE_MB='lots' is not a valid float"):
            config.from_args([], environ={"TFPS_MAX_MESSAGE_MB": "lots"})


def test_wire_reads_no_environment_when_imported_and_the_setting_when_asked():
    code = ("from protos import wire\n"
            "print('imported')\n"
            "try:\n"
            "    wire.MAX_MESSAGE_BYTES\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TFPS_MAX_MESSAGE_MB": "lots"},
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert run.stdout.splitlines() == ["imported", "TFPS_MAX_MESSAGE_MB='lots' is not a valid float"], run.stderr


def test_wire_options_use_the_value_passed_then_the_process_setting_then_the_environment(monkeypatch):
    from protos import wire

    def limit(options):
        return dict(options)["grpc.max_receive_message_length"]

    monkeypatch.setenv("TFPS_MAX_MESSAGE_MB", "3")
    assert limit(wire.client_options()) == limit(wire.server_options()) == wire.MAX_MESSAGE_BYTES == 3 * 2**20
    try:
        wire.use_max_message_mb(5)
        assert limit(wire.channel_options()) == 5 * 2**20
        assert limit(wire.server_options(7 * 2**20)) == 7 * 2**20
    finally:
        wire.use_max_message_mb(None)
    assert limit(wire.client_options()) == 3 * 2**20


# -- --print-config -----------------------------------------------------------------------
@pytest.mark.parametrize("main, argv, expected", [
    ("ps_server.cli", ["--mode", "async"], {"mode": "async", "num_workers": 3, "max_message_mb": 8.0, "shm": False}),
    ("worker.cli", ["--dataset", "synthetic"], {"dataset": "synthetic", "num_workers": 3, "max_message_mb": 8.0,
                                                "shm": True}),
])
def test_print_config_prints_the_resolved_configuration_as_json_and_exits_0(main, argv, expected, capsys,
                                                                             monkeypatch):
    import importlib

    for name, value in {"TFPS_NUM_WORKERS": "3", "TFPS_MAX_MESSAGE_MB": "8", "TFPS_SERVER_SHM": "0",
                        "TFPS_WORKER_SHM": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(SystemExit) as exited:  # as argparse's --help exits
        importlib.import_module(main).main([*argv, "--print-config"])
    assert exited.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert {k: out[k] for k in expected} == expected
    config = ServerConfig if main == "ps_server.cli" else WorkerConfig
    assert list(out) == list(env_names(config))  # every field, in order


def test_a_server_for_many_workers_keeps_each_streams_window_small_so_waiting_pushes_stay_with_the_workers():
    from protos import wire

    few, many = dict(wire.server_options(workers=8)), dict(wire.server_options(workers=wire.MANY_WORKERS))
    assert "grpc.http2.lookahead_bytes" not in few and "grpc.http2.bdp_probe" not in few
    assert many["grpc.http2.lookahead_bytes"] == wire.STREAM_WINDOW_BYTES and many["grpc.http2.bdp_probe"] == 0


def test_async_apply_from_a_flag_or_the_environment_and_refused_in_sync_mode():
    assert ServerConfig.from_args([], environ={}).async_apply == "locked"
    assert ServerConfig.from_args(["--mode", "async", "--async-apply", "hogwild"], environ={}).async_apply == "hogwild"
    assert ServerConfig.from_args(["--mode", "ssp"], environ={"TFPS_ASYNC_APPLY": "hogwild"}).async_apply == "hogwild"
    with pytest.raises(ConfigError, match="--async-apply hogwild applies to --mode async and ssp"):
        ServerConfig.from_args(["--async-apply", "hogwild"], environ={})
    with pytest.raises(ConfigError, match="--async-apply must be one of locked, hogwild, got 'wild'"):
        ServerConfig.from_args(["--mode", "async"], environ={"TFPS_ASYNC_APPLY": "wild"})
