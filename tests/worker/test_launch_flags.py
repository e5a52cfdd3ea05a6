"""ps-launch's server command lines with several shards (no processes started).

    python -m pytest -q tests/worker/test_launch_flags.py
"""

import os

import pytest

from ps_tools import launch


def argv_of(*flags, shard=0):
    return launch.server_argv(launch.parser().parse_args(list(flags)), shard, "/tmp/port")


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_every_shard_gets_the_same_mode_workers_and_flags():
    a = argv_of("--num-ps", "2", "--mode", "async", "--workers", "3", "--barrier-timeout", "9", shard=0)
    b = argv_of("--num-ps", "2", "--mode", "async", "--workers", "3", "--barrier-timeout", "9", shard=1)
    assert a == b
    assert (flag(a, "--mode"), flag(a, "--num-workers"), flag(a, "--barrier-timeout")) == ("async", "3", "9.0")


def test_a_checkpoint_dir_gets_one_subdirectory_per_shard():
    assert flag(argv_of("--num-ps", "2", "--checkpoint-dir", "ck", shard=1), "--checkpoint-dir") == \
        os.path.join("ck", "shard-1")
    assert flag(argv_of("--checkpoint-dir", "ck"), "--checkpoint-dir") == "ck"  # one server: the directory itself
    assert flag(argv_of(), "--checkpoint-dir") is None


def test_backup_workers_with_several_shards_are_refused():
    args = launch.parser().parse_args(["--num-ps", "2", "--replicas-to-aggregate", "1"])
    with pytest.raises(launch.LaunchError, match="--replicas-to-aggregate .* --num-ps 2"):
        launch.run(args)
    assert flag(argv_of("--replicas-to-aggregate", "1"), "--replicas-to-aggregate") == "1"
