"""Configuration: a flag beats TFPS_<FLAG>, which beats TF_CONFIG, which beats the default."""

import json

import pytest

from ps_server.config import ServerConfig
from ps_common.settings import ConfigError
from worker.config import WorkerConfig

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


def test_pool_must_exceed_the_workers_that_can_block_in_a_barrier():
    with pytest.raises(ConfigError, match="starve"):
        ServerConfig.from_args(["--num-workers", "8", "--threads", "8"], environ={})
    assert ServerConfig.from_args(["--num-workers", "8"], environ={}).pool_threads == 24


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
