"""The experiment knobs (worker.knobs) with a fake sleep, their flags, and ps-launch's
--worker-args and server pass-through flags (no processes started).

    python -m pytest -q tests/worker/test_knobs.py

The rules: "--slowdown F: after computing a step's gradients (wall time c), sleep
(F-1)*c"; "before each push, sleep L/1000 + bytes/(X*1e6/8) seconds ... before
each pull, sleep L/1000 only"; "before step K ... sleep S seconds once".
"""

import numpy as np
import pytest

from ps_common.settings import ConfigError
from ps_tools import launch
from worker.config import WorkerConfig
from worker.knobs import Knobs, payload_nbytes


class FakeSleep:
    def __init__(self):
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def knobs(**settings) -> tuple[Knobs, FakeSleep]:
    sleep = FakeSleep()
    return Knobs(**settings, sleep=sleep), sleep


def test_slowdown_sleeps_f_minus_one_times_the_compute_time_after_the_first_computation():
    k, sleep = knobs(slowdown=3.0)
    assert k.after_compute(0.5) == 0.0  # the first one carries TensorFlow's tracing: not slowed
    assert k.after_compute(0.2) == 0.4
    assert sleep.calls == [0.4]


def test_a_push_sleeps_the_latency_plus_its_bytes_at_the_bandwidth():
    k, sleep = knobs(bandwidth_mbps=8.0, added_latency_ms=5.0)
    assert k.before_push(1_000_000) == 1.005  # 1 MB at 8 Mbit/s is 1 s
    assert k.before_pull() == 0.005  # a pull request is tiny: latency only
    assert sleep.calls == [1.005, 0.005]


def test_unlimited_bandwidth_adds_only_the_latency_and_defaults_sleep_nothing():
    k, sleep = knobs(added_latency_ms=20.0)
    assert k.before_push(10**9) == 0.02
    k, sleep = knobs()
    assert (k.before_step(0), k.before_pull(), k.after_compute(1.0), k.before_push(10**9)) == (0, 0, 0, 0)
    assert sleep.calls == [] and not k.active


def test_the_pause_happens_once_before_its_step():
    k, sleep = knobs(pause_at_step=2, pause_for=0.5)
    assert [k.before_step(s) for s in (0, 1, 2, 2, 3)] == [0, 0, 0.5, 0, 0]  # a rejoin repeating step 2
    assert sleep.calls == [0.5]


def test_a_sync_worker_whose_pause_step_was_skipped_pauses_at_the_next_one():
    k, sleep = knobs(pause_at_step=2, pause_for=0.5)
    assert [k.before_step(s) for s in (1, 3, 4)] == [0, 0.5, 0]


def test_payload_bytes_follow_the_wire_dtype():
    grads = {"w": np.zeros((10, 10), np.float32), "b": np.zeros(5, np.float32), "i": np.zeros(3, np.int64)}
    assert payload_nbytes(grads) == 105 * 4 + 3 * 8
    assert payload_nbytes(grads, "float16") == payload_nbytes(grads, "bfloat16") == 105 * 2 + 3 * 8


def test_knobs_come_from_the_config_with_env_fallbacks():
    config = WorkerConfig.from_args(["--slowdown", "3", "--pause-at-step", "2", "--pause-for", "0.5"],
                                    environ={"TFPS_ADDED_LATENCY_MS": "20", "TFPS_BANDWIDTH_MBPS": "100"})
    k = Knobs.from_config(config)
    assert k.settings() == {"slowdown": 3.0, "bandwidth_mbps": 100.0, "added_latency_ms": 20.0,
                            "pause_at_step": 2, "pause_for": 0.5}
    assert k.active and "3x slower" in k.describe() and "before step 2" in k.describe()
    assert WorkerConfig.from_args([], environ={"TFPS_EVAL_EVERY": "4"}).eval_every == 4


@pytest.mark.parametrize("flags, message", [
    (["--slowdown", "0.5"], "--slowdown must be >= 1, got 0.5"),
    (["--slowdown", "nan"], "--slowdown must be >= 1, got nan"),
    (["--bandwidth-mbps", "-1"], "--bandwidth-mbps must be >= 0, got -1"),
    (["--added-latency-ms", "-5"], "--added-latency-ms must be >= 0, got -5"),
    (["--pause-at-step", "-1"], "--pause-at-step must be >= 0, got -1"),
    (["--pause-for", "-1", "--pause-at-step", "3"], "--pause-for must be >= 0, got -1"),
    (["--pause-for", "2"], "--pause-for needs --pause-at-step K >= 1 (the step to pause before, from 0)"),
    (["--pause-at-step", "3"], "--pause-at-step needs --pause-for S > 0 (seconds)"),
    (["--eval-every", "-1"], "--eval-every must be >= 0, got -1"),
])
def test_bad_knob_values_are_one_line_config_errors(flags, message):
    with pytest.raises(ConfigError) as e:
        WorkerConfig.from_args(flags, environ={})
    assert str(e.value) == message


def parse(*flags):
    return launch.parser().parse_args(list(flags))


def test_worker_args_reach_only_their_worker():
    args = parse("--workers", "3", "--dataset", "synthetic", "--worker-args", "1", "--slowdown 3 --pause-at-step 2",
                 "--worker-args", "1", "--pause-for 0.5", "--worker-args", "2", " --no-shm")
    extra = launch.worker_extra_args(args)
    assert extra == {1: ["--slowdown", "3", "--pause-at-step", "2", "--pause-for", "0.5"], 2: ["--no-shm"]}
    argv = {i: launch.worker_argv(args, i, ["127.0.0.1:1"], extra.get(i, [])) for i in range(3)}
    assert "--slowdown" not in argv[0] and "--no-shm" not in argv[1]
    assert argv[1][-6:] == extra[1] and argv[0][-2:] == ["--dataset", "synthetic"]  # common flags first
    config = WorkerConfig.from_args(argv[1][3:], environ={})
    assert (config.worker_index, config.slowdown, config.pause_for, config.dataset) == (1, 3.0, 0.5, "synthetic")


@pytest.mark.parametrize("flags, message", [
    (["--worker-args", "2", "--slowdown 2"], "--worker-args 2: the workers are 0..1"),
    (["--worker-args", "x", "--slowdown 2"], "--worker-args takes a worker index and a string, got index 'x'"),
    (["--worker-args", "1", "--bogus 1"], "--worker-args 1: unrecognized arguments: --bogus 1"),
    (["--worker-args", "1", "--worker-index 0 --ps h:1"],
     "--worker-args 1: ps-launch sets --ps, --worker-index itself"),
    (["--worker-args", "1", "--slowdown '3"], "--worker-args 1 \"--slowdown '3\": No closing quotation"),
    (["--worker-args", "1", "--slowdown 0.5"], "worker 1: --slowdown must be >= 1, got 0.5"),
])
def test_bad_worker_args_are_refused_before_anything_starts(flags, message):
    with pytest.raises(launch.LaunchError) as e:
        launch.run(parse("--workers", "2", *flags))
    assert str(e.value) == message


def test_staleness_flags_reach_every_server_only_when_given():
    argv = launch.server_argv(parse("--mode", "ssp", "--staleness", "2", "--stale-gradient-policy", "scale",
                                    "--max-staleness", "5"), 0, "/tmp/port")
    assert argv[argv.index("--staleness"):][:6] == ["--staleness", "2", "--stale-gradient-policy", "scale",
                                                     "--max-staleness", "5"]
    plain = launch.server_argv(parse("--mode", "ssp"), 0, "/tmp/port")
    assert not {"--staleness", "--stale-gradient-policy", "--max-staleness"} & set(plain)
    with pytest.raises(launch.LaunchError, match="ps-server: --staleness must be >= 0"):  # before anything starts
        launch.resolved(parse("--staleness", "-1"), {}, {}, workers=False)


@pytest.mark.parametrize("pull", [True, False])
def test_the_pause_before_a_step_is_slept_whether_or_not_the_step_pulls(pull):
    """``Engine(work, pull=False)`` (the Keras step, which loads the server's parameters after the
    push) sleeps --pause-at-step's pause too; only the pull's latency is the pull's."""
    import types

    from worker.connection import Work
    from worker.engine import Engine

    pushed = []
    conn = types.SimpleNamespace(config=types.SimpleNamespace(grad_wire_dtype="float32"), version=0, pulled={},
                                 pull=lambda: None, push=lambda *args, **kwargs: pushed.append(args) or
                                 types.SimpleNamespace(version=1, staleness=0, dropped=False))
    k, sleep = knobs(pause_at_step=2, pause_for=7.0, added_latency_ms=10.0)
    step = Engine(None, None, lambda work: (0.5, {"w": np.ones(2, np.float32)}), knobs=k, conn=conn)
    row, _ = step(Work(2, 4), pull=pull)
    assert sleep.calls[0] == 7.0 and row["knob_s"] == pytest.approx(sum(sleep.calls))
    assert sleep.calls == ([7.0, 0.01, 0.01] if pull else [7.0, 0.01]) and len(pushed) == 1
