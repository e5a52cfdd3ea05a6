"""Seeded fault schedules against elastic jobs (``tests/chaos/nemesis.py``), checked against
the undisturbed run: sync, the weights bit for bit and every example once per epoch; async,
every task applied exactly once.

    python -m pytest -q tests/chaos/test_nemesis.py              # the fixed cases and a seed of each mode
    python -m pytest -q -m slow tests/chaos/test_nemesis.py      # 50 sync and 30 async seeds
    python -m tests.chaos.nemesis --mode sync --seed 12          # any one seed, or --schedule "..."

A failure prints the one command that runs its schedule again, and where the logs are.
"""

from __future__ import annotations

import pytest

from tests.chaos.nemesis import Job, draw, parse_schedule, run_schedule

pytestmark = [pytest.mark.chaos, pytest.mark.cluster, pytest.mark.recovery]

# The two hangs issue 40 found, each the schedule that showed it (one epoch here).
FIXED = {
    # SIGKILL the chief at task 40 and start it again with --worker-index 0: the new process was
    # answered from the old one's record and its task never came back (270 tasks, 1 held, for ever).
    "a chief restarted on its own index (async)": (Job("async", 1, 250), "restart:0@40"),
    # Two workers leave, the server is killed and restored at round 19 with one worker of a
    # minimum of two: the minimum gated the restored round, and nothing moved.
    "a server restored below the minimum of workers (sync)": (Job("sync", 1, 20), "term:1@4 term:2@8 server@20"),
}
# each: an auto index, a pause past the lease, a kill, a server restart. Sync's seed 3 (~65 s) is
# slow with the other seeds: sync's schedule that hung a job stays (FIXED), and so do the kills,
# pauses and restarts of elastic sync one by one (tests/cluster/test_elastic_*.py, tests/chaos).
DEFAULT_SEEDS = [("async", 4)]
SLOW_SEEDS = [("sync", s) for s in range(50)] + [("async", s) for s in range(30)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The undisturbed runs' weights, computed once for the module."""
    return tmp_path_factory.mktemp("undisturbed")


def check(job: Job, schedule, tmp_path, cache, every_fault: bool = True) -> None:
    """The run ends right; with ``every_fault``, each of the schedule's faults fired (none found
    its process gone, none came after the job's end)."""
    outcome = run_schedule(job, schedule, tmp_path / "run", cache)
    assert outcome.ok, outcome.summary()
    assert not every_fault or not outcome.skipped, outcome.summary()


@pytest.mark.parametrize("case", list(FIXED))
def test_the_faults_that_hung_jobs_end_right(case, tmp_path, cache):
    job, schedule = FIXED[case]
    check(job, parse_schedule(schedule), tmp_path, cache)


@pytest.mark.parametrize("mode,seed", DEFAULT_SEEDS)
def test_a_seeded_fault_schedule_ends_with_the_undisturbed_result(mode, seed, tmp_path, cache):
    job = Job(mode, 1)
    check(job, draw(job, seed), tmp_path, cache)


@pytest.mark.slow
@pytest.mark.parametrize("mode,seed", SLOW_SEEDS)
def test_many_seeded_fault_schedules_end_with_the_undisturbed_result(mode, seed, tmp_path, cache):
    job = Job(mode)
    check(job, draw(job, seed), tmp_path, cache, every_fault=False)  # a drawn fault may find its process gone


def test_a_schedule_is_drawn_the_same_from_its_seed_and_reads_back_from_its_text():
    job = Job("sync")
    faults = draw(job, 7)
    assert faults == draw(job, 7) and 4 <= len(faults) <= 8
    assert parse_schedule(" ".join(map(str, faults))) == faults
    with pytest.raises(ValueError, match="never sent SIGTERM"):
        parse_schedule("term:0@3")
