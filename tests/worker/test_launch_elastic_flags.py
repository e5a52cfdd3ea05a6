"""ps-launch --elastic MIN:MAX and --scale-at ROUND:N: the command lines, the refusals and
when the worker count changes (no processes started).

    python -m pytest -q tests/worker/test_launch_elastic_flags.py
"""

import pytest

from ps_tools import launch


def parse(*flags):
    return launch.parser().parse_args(list(flags))


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_elastic_starts_the_server_with_min_and_max_and_every_worker_with_elastic_and_max():
    args = parse("--elastic", "2:4", "--workers", "3", "--micro-batches", "4")
    server = launch.server_argv(args, 0, "/tmp/port")
    assert (flag(server, "--num-workers"), flag(server, "--elastic-min-workers"), flag(server, "--micro-batches")) \
        == ("4", "2", "4")
    for index in (0, 3):  # 3: a worker started later, on an index above the start count
        worker = launch.worker_argv(args, index, ["127.0.0.1:1"])
        assert "--elastic" in worker and flag(worker, "--num-workers") == "4"
        assert flag(worker, "--worker-index") == str(index)


def test_without_elastic_nothing_changes():
    args = parse("--workers", "3")
    assert flag(launch.server_argv(args, 0, "/tmp/port"), "--elastic-min-workers") is None
    assert "--elastic" not in launch.worker_argv(args, 0, ["127.0.0.1:1"])
    assert flag(launch.worker_argv(args, 0, ["127.0.0.1:1"]), "--num-workers") == "3"


@pytest.mark.parametrize("raw, message", [
    ("4:2", "needs 1 <= MIN <= MAX, got '4:2'"),
    ("0:2", "needs 1 <= MIN <= MAX"),
    ("2", "takes MIN:MAX"),
    ("a:b", "takes MIN:MAX"),
])
def test_a_bad_elastic_range_is_refused_by_the_parser(raw, message, capsys):
    with pytest.raises(SystemExit):
        parse("--elastic", raw)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("raw, message", [("5", "takes ROUND:N"), ("-1:3", "ROUND must be >= 0")])
def test_a_bad_scale_step_is_refused_by_the_parser(raw, message, capsys):
    with pytest.raises(SystemExit):
        parse("--elastic", "2:4", f"--scale-at={raw}")  # -1:3 alone would read as a flag
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--scale-at", "3:2"], "--scale-at changes the worker count of an elastic job: add --elastic MIN:MAX"),
    (["--elastic", "2:4", "--workers", "5"], r"--workers 5 \(the workers started\) must lie in 2\.\.4"),
    (["--elastic", "3:4"], r"--workers 2 \(the workers started\) must lie in 3\.\.4"),  # the default, 2
    (["--elastic", "2:4", "--scale-at", "10:5"], r"--scale-at 10:5: N must lie in 2\.\.4"),
    (["--elastic", "2:4", "--scale-at", "10:1"], r"--scale-at 10:1: N must lie in 2\.\.4"),
    (["--elastic", "2:4", "--scale-at", "10:3", "--scale-at", "10:4"], "two steps at the same round"),
    (["--elastic", "2:4", "--mode", "async", "--steps", "30"], "hands out whole epochs as tasks; say --epochs"),
    (["--elastic", "2:4", "--mode", "ssp", "--steps", "30"], "hands out whole epochs as tasks; say --epochs"),
    (["--elastic", "2:4", "--worker-args", "4", "--slowdown 2"], r"--worker-args 4: the workers are 0\.\.3"),
])
def test_what_an_elastic_launch_cannot_do_is_refused_in_one_line(flags, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.run(parse(*flags))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_elastic_command_gets_tf_config_for_every_index_and_the_elastic_setting(mode):
    """A tfps.keras command then trains on the data the server deals (tests/cluster/test_launch_elastic_keras.py)."""
    import json

    args = parse("--elastic", "2:3", "--mode", mode)
    args.command = ["python", "train.py"]
    env = launch.script_environment(args, 2, ["127.0.0.1:5"], ["127.0.0.1:7", "127.0.0.1:8", "127.0.0.1:9"], {})
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 2}
    assert env["TFPS_ELASTIC"] == "true" and env["TF_ENABLE_ONEDNN_OPTS"] == "0"
    _, workers = launch.resolved_for_script(args, {})
    assert [(w.worker_index, w.num_workers, w.elastic) for w in workers] == [(0, 3, True), (1, 3, True), (2, 3, True)]


def test_worker_args_may_name_an_index_started_later():
    args = parse("--elastic", "2:4", "--worker-args", "3", "--slowdown 2")
    assert launch.worker_extra_args(args) == {3: ["--slowdown", "2"]}


def test_the_server_s_elastic_min_workers_is_set_through_elastic(capsys):
    assert launch.main(["--elastic-min-workers", "2"]) == 2
    assert "give --elastic MIN:MAX" in capsys.readouterr().err


def test_print_config_shows_the_elastic_settings_and_every_index_a_worker_may_take(capsys):
    import json

    assert launch.main(["--print-config", "--elastic", "2:4", "--scale-at", "5:4", "--dataset", "synthetic"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["launch"]["elastic_workers"], doc["launch"]["scale_at"]) == ([2, 4], [[5, 4]])
    assert (doc["servers"][0]["elastic_min_workers"], doc["servers"][0]["num_workers"]) == (2, 4)
    assert [(w["worker_index"], w["elastic"], w["num_workers"]) for w in doc["workers"]] == \
        [(i, True, 4) for i in range(4)]


# -- when the count changes (Scaler) ------------------------------------------------------------


def test_the_schedule_applies_in_round_order_once_each_round_is_reached():
    scaler = launch.Scaler(2, 4, [(20, 3), (10, 4)])
    assert scaler.due(round=9, running=2) is None
    assert scaler.due(round=10, running=2) == 4
    assert scaler.due(round=15, running=4) is None
    assert scaler.due(round=25, running=4) == 3  # reached late (a busy poll): still applied
    assert scaler.due(round=30, running=3) is None


def test_two_steps_passed_at_once_apply_one_after_the_other():
    scaler = launch.Scaler(1, 4, [(5, 4), (6, 1)])
    assert [scaler.due(round=9, running=2), scaler.due(round=9, running=4), scaler.due(9, 1)] == [4, 1, None]


def test_signals_add_or_remove_one_worker_within_min_and_max_and_say_why_not():
    scaler = launch.Scaler(2, 3)
    scaler.request(+1)
    assert scaler.due(round=0, running=2) == 3
    scaler.request(+1)  # already at MAX
    scaler.request(-1)
    assert scaler.due(round=0, running=3) == 2
    assert scaler.refused == ["SIGUSR1 (add a worker) ignored: 3 run, and --elastic is 2:3"]
    scaler.request(-1)  # already at MIN
    assert scaler.due(round=0, running=2) is None
    assert scaler.refused[-1] == "SIGUSR2 (stop a worker) ignored: 2 run, and --elastic is 2:3"


def test_a_due_schedule_step_comes_before_a_pending_signal():
    scaler = launch.Scaler(2, 4, [(3, 4)])
    scaler.request(-1)
    assert scaler.due(round=3, running=3) == 4
    assert scaler.due(round=3, running=4) == 3


def test_a_change_that_needs_more_free_indices_than_there_are_waits_first_in_line():
    # Every index still has a process (one stopped on purpose is busy until it exited).
    scaler = launch.Scaler(2, 4, [(5, 4)])
    assert scaler.due(round=5, running=3, free=0) is None
    assert scaler.due(round=6, running=3, free=1) == 4
    scaler.request(+1)
    assert scaler.due(round=7, running=3, free=0) is None and scaler.requests == [+1]
    assert scaler.due(round=7, running=3, free=1) == 4


def test_sigusr1_and_sigusr2_are_queued_as_requests_while_the_launch_runs():
    import os
    import signal

    scaler = launch.Scaler(1, 4)
    before = signal.getsignal(signal.SIGUSR1)
    with launch.scale_signals(scaler):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
    assert scaler.requests == [+1, -1, +1]
    assert signal.getsignal(signal.SIGUSR1) is before  # given back


def test_an_async_elastic_launch_starts_a_plain_async_server_of_max_workers_and_elastic_workers(capsys):
    import json

    assert launch.main(["--print-config", "--mode", "async", "--elastic", "2:4", "--scale-at", "50:4",
                        "--dataset", "synthetic", "--epochs", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    server = doc["servers"][0]
    assert (server["mode"], server["elastic_min_workers"], server["num_workers"]) == ("async", 0, 4)
    assert [(w["elastic"], w["num_workers"], w["epochs"]) for w in doc["workers"]] == [(True, 4, 2)] * 4


def test_the_schedule_counts_rounds_in_sync_and_versions_in_async_and_ssp():
    from protos import tfps_pb2 as pb

    assert launch.position(pb.StatusResponse(mode=pb.SYNC, round=7, version=7)) == 7
    assert launch.position(pb.StatusResponse(mode=pb.ASYNC, round=2, version=40)) == 40
    assert launch.position(pb.StatusResponse(mode=pb.SSP, round=3, version=41)) == 41
