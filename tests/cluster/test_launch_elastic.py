"""ps-launch scales an elastic job while it runs, and the result has the undisturbed bits.

    python -m pytest -q -m '' tests/cluster/test_launch_elastic.py

Two ps-launch runs of two epochs of digits, each round's batch cut into 4 micro-batches
(``--elastic 2:4``): once undisturbed with 3 workers; once scaled 2 -> 4 -> 3 workers by
``--scale-at 10:4 --scale-at 20:3``, then one worker stopped by SIGUSR2 and one added by
SIGUSR1. Pauses keep the job running while new workers start (the chief's at round 10,
worker 1's at round 24): they change no bit, only make sure a worker started is there
before the job ends. The rules: the scaled run exits 0 with the undisturbed run's final
weights, bit for bit; every example of both epochs counted once by the server; the
server's membership history (in ps-launch's metrics) shows each join and each graceful
leave (SIGTERM: ps-worker --elastic leaves, nobody is declared dead) at or after its
scheduled round, in order.
"""

from __future__ import annotations

import json
import signal
import sys
import time

import numpy as np
import pytest

from .conftest import read_log, wait_exit

pytestmark = [pytest.mark.cluster, pytest.mark.recovery]

EXAMPLES = 1437  # digits' training examples
STEPS = 46  # two epochs of global batches of 64
FLAGS = ("--dataset", "digits", "--model", "cnn", "--steps", str(STEPS), "--log-level", "WARNING")


def launch(procs, tmp_path, name: str, *flags: str):
    argv = [sys.executable, "-m", "ps_tools.launch", *FLAGS, "--save-weights", str(tmp_path / f"{name}.npz"),
            "--metrics-json", str(tmp_path / f"{name}.json"), *flags]
    return procs.start(argv, f"launch-{name}")


def wait_for_line(proc, text: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in read_log(proc):
        assert proc.poll() is None, f"ps-launch exited before printing {text!r}:\n{read_log(proc)[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} from ps-launch:\n{read_log(proc)[-3000:]}"
        time.sleep(0.1)


def stops(log: str) -> str:
    """The lines of a launch's log about its workers' starts and stops, wherever they are in it."""
    words = ("SIGTERM", "stopping", "started worker", "was stopped", "left", "registered", "rejoined", "dead",
             "error", "Fatal Python error", "Traceback")
    return "\n".join(line for line in log.splitlines() if any(w in line for w in words))


@pytest.mark.slow  # ~64 s; the default run keeps ps-launch's elastic scaling in the async and Keras tests
def test_a_job_scaled_2_4_3_by_schedule_and_by_signals_ends_with_the_undisturbed_weights(procs, tmp_path):
    plain = launch(procs, tmp_path, "plain", "--elastic", "2:4", "--workers", "3")
    assert wait_exit(plain, 600) == 0, read_log(plain)[-3000:]

    scaled = launch(procs, tmp_path, "scaled", "--elastic", "2:4", "--workers", "2",
                    "--scale-at", "10:4", "--scale-at", "20:3",
                    "--worker-args", "0", "--pause-at-step 10 --pause-for 20",
                    "--worker-args", "1", "--pause-at-step 24 --pause-for 20")
    wait_for_line(scaled, "workers: stopping worker 3")  # the schedule's last step
    # Worker 3 gone before the next stop: two Leaves sent together can arrive in either order
    # (a CI run on a loaded machine saw worker 2's first).
    wait_for_line(scaled, "worker 3: stopped by SIGTERM: left the job")
    scaled.send_signal(signal.SIGUSR2)  # stops the newest worker but the chief: worker 2
    wait_for_line(scaled, "3 -> 2 workers: stopping worker 2")
    scaled.send_signal(signal.SIGUSR1)  # starts one at the lowest free index
    wait_for_line(scaled, "2 -> 3 workers: started worker(s)")
    assert wait_exit(scaled, 600) == 0, read_log(scaled)[-3000:]
    assert read_log(scaled).count("stopped by SIGTERM: left the job") == 2, stops(read_log(scaled))

    want, got = np.load(tmp_path / "plain.npz"), np.load(tmp_path / "scaled.npz")
    assert sorted(want.keys()) == sorted(got.keys())
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    metrics = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "scaled")}
    for m in metrics.values():  # every example of both epochs, once, whoever computed it
        (shard,) = m["shards"]
        assert (shard["version"], shard["examples_applied"]) == (STEPS, 2 * EXAMPLES)
    assert metrics["scaled"]["elastic"] == {"min_workers": 2, "max_workers": 4, "micro_batches": 4,
                                            "scale_at": [[10, 4], [20, 3]]}

    events = [(e["event"], e["worker_id"], e["round"]) for e in metrics["scaled"]["membership"]]
    assert not [e for e in events if e[0] in ("dead", "rejoined")], events  # every stop was a clean leave
    joins = [(w, r) for kind, w, r in events if kind == "joined"]
    leaves = [(w, r) for kind, w, r in events if kind == "left"]
    assert sorted(joins[:2]) == [(0, 0), (1, 0)], events
    assert sorted(w for w, _ in joins[2:4]) == [2, 3] and all(r >= 10 for _, r in joins[2:4]), events
    added = joins[4:]
    assert len(added) == 1 and added[0][0] in (2, 3), events  # SIGUSR1's, on an index freed meanwhile
    # The stops, in order, at or after round 20 and after the joins they follow; then, at the
    # end, every worker still running leaves once it finished.
    (stop3, stop2), finished = leaves[:2], leaves[2:]
    assert (stop3[0], stop2[0]) == (3, 2) and 20 <= stop3[1] <= stop2[1] < STEPS, events
    assert events.index(("left", 3, stop3[1])) > max(events.index(("joined", w, r)) for w, r in joins[2:4])
    assert events.index(("joined", *added[0])) > events.index(("left", 2, stop2[1]))
    assert sorted(w for w, _ in finished) == sorted([0, 1, added[0][0]]), events
    assert all(r == STEPS for _, r in finished), events
