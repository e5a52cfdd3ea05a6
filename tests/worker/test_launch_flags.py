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


def test_backup_workers_go_to_every_shard_alike():
    """Shard 0 picks each round's contributors and the others follow it (core.modes.sync_mode)."""
    for shard in (0, 1):
        assert flag(argv_of("--num-ps", "2", "--replicas-to-aggregate", "1", shard=shard),
                    "--replicas-to-aggregate") == "1"


# -- the server flags are ps-server's own -------------------------------------------------
def test_server_flags_are_the_servers_own_with_its_defaults():
    """ps-launch re-declares none: each ps-server flag it passes on has the server's
    names, choices and help, and no default of its own (the server's applies)."""
    from ps_server.config import ServerConfig

    launch_actions = {a.dest: a for a in launch.parser()._actions}
    passed = launch.server_flag_dests()
    assert {"mode", "barrier_timeout", "lease_timeout", "dead_worker_policy", "checkpoint_interval", "reflection",
            "max_message_mb", "threads", "allow_nonfinite"} <= set(passed)
    for action in ServerConfig.parser()._actions:
        if action.dest not in passed:
            continue
        mine = launch_actions[action.dest]
        assert (mine.option_strings, mine.choices, mine.default) == (action.option_strings, action.choices, None)
        if action.dest not in launch._FOR_BOTH:  # those are the workers' flag of the same name and meaning
            assert mine.help == action.help, action.dest
    argv = argv_of()
    assert argv[3:] == ["--host", "127.0.0.1", "--port", "0", "--port-file", "/tmp/port", "--num-workers", "2",
                        "--no-exit-when-done"]  # nothing given: nothing but what ps-launch sets


def test_every_server_flag_given_reaches_every_shard_and_the_shared_ones_the_workers_too():
    flags = ["--num-ps", "2", "--lease-timeout", "3", "--dead-worker-policy", "shrink", "--no-reflection",
             "--checkpoint-interval", "5", "--max-message-mb", "8", "--log-level", "DEBUG", "--no-shm"]
    args = launch.parser().parse_args(flags)
    for shard in (0, 1):
        argv = launch.server_argv(args, shard, "/tmp/port")
        assert (flag(argv, "--lease-timeout"), flag(argv, "--dead-worker-policy"), flag(argv, "--checkpoint-interval"),
                flag(argv, "--max-message-mb"), flag(argv, "--log-level")) == ("3.0", "shrink", "5.0", "8.0", "DEBUG")
        assert "--no-reflection" in argv
        assert "--no-shm" not in argv and "--shm" not in argv  # the workers' flag: servers accept shm by default
    worker = launch.worker_argv(args, 1, ["127.0.0.1:1", "127.0.0.1:2"])
    assert (flag(worker, "--max-message-mb"), flag(worker, "--log-level")) == ("8.0", "DEBUG")
    assert "--no-shm" in worker and "--lease-timeout" not in worker


def test_save_weights_and_save_model_go_to_the_chief_only():
    args = launch.parser().parse_args(["--save-weights", "w.npz", "--save-model", "m.keras"])
    chief, other = (launch.worker_argv(args, i, ["127.0.0.1:1"]) for i in (0, 1))
    assert (flag(chief, "--save-weights"), flag(chief, "--save-model")) == ("w.npz", "m.keras")
    assert flag(other, "--save-weights") is None and flag(other, "--save-model") is None


@pytest.mark.parametrize("old, new", [
    ("TFPS_SHM", "TFPS_SERVER_SHM or TFPS_WORKER_SHM"),
    ("TFPS_METRICS_PORT", "TFPS_SERVER_METRICS_PORT or TFPS_WORKER_METRICS_PORT"),
    ("TFPS_TLS_CERT_FILE", "TFPS_SERVER_TLS_CERT_FILE or TFPS_WORKER_TLS_CERT_FILE"),
])
def test_an_old_variable_server_and_worker_read_differently_is_refused(monkeypatch, old, new):
    """ps-launch hands one environment to every child: there the old name is ambiguous."""
    monkeypatch.setenv(old, "1")
    with pytest.raises(launch.LaunchError) as e:
        launch.run(launch.parser().parse_args([]))
    assert str(e.value) == (f"{old} means different things to ps-server and ps-worker, and ps-launch starts both: "
                            f"set {new} instead")


def test_tls_in_the_environment_is_refused_like_the_tls_flags(monkeypatch):
    monkeypatch.setenv("TFPS_SERVER_TLS_CERT_FILE", "server.crt")
    monkeypatch.setenv("TFPS_SERVER_TLS_KEY_FILE", "server.key")
    with pytest.raises(launch.LaunchError, match="without TLS.*set in the environment"):
        launch.run(launch.parser().parse_args([]))


def test_a_bad_server_setting_is_refused_with_the_servers_own_message_before_anything_starts(monkeypatch):
    monkeypatch.setenv("TFPS_LEASE_TIMEOUT", "0")
    with pytest.raises(launch.LaunchError) as e:
        launch.run(launch.parser().parse_args([]))
    assert str(e.value) == "ps-server: --lease-timeout must be > 0 seconds, got 0.0"


def test_print_config_shows_every_child_and_starts_nothing(capsys, monkeypatch):
    import json

    monkeypatch.setenv("TFPS_MODE", "async")  # the children's environment counts, as it will for them
    assert launch.main(["--print-config", "--num-ps", "2", "--workers", "3", "--metrics-port", "9400",
                        "--dataset", "synthetic", "--save-weights", "w.npz"]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert [(s["mode"], s["num_workers"], s["metrics_port"]) for s in doc["servers"]] == \
        [("async", 3, 9400), ("async", 3, 9401)]
    assert [(w["worker_index"], w["num_workers"], w["metrics_port"], w["dataset"], w["save_weights"])
            for w in doc["workers"]] == [(0, 3, 9402, "synthetic", "w.npz"), (1, 3, 9403, "synthetic", ""),
                                         (2, 3, 9404, "synthetic", "")]
    assert doc["workers"][0]["ps"] == "127.0.0.1:<port of server 0>,127.0.0.1:<port of server 1>"
    assert "ps-launch:" not in out  # no start line: nothing was started
