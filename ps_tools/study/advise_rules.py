"""The rules of ``ps-advise``: a measured step profile in, a recommended mode out.

    advice = decide(Measurements(source, mode, [WorkerTimes(...), ...], model_bytes, bandwidth))

``ps_tools.study.advise`` measures the profile (a running cluster or a probe launch) and
prints the advice; ``ps_tools.study.advise_predict`` (``ps-advise --predict``) simulates the
same profile at the user's N and weighs the rule's advice against it. Both read these
records and this ``decide``, and ``AdviseError`` is what either cannot do, in one line.
Plain Python.

The rules (``decide``), in order; the first that fires decides:

1. **Straggler**: the slowest worker's step work is at least ``STRAGGLER_RATIO``
   times the typical worker's (the median of the others). A sync barrier runs
   every step at its pace. Recommend ``async``: nobody waits. With 3 or more
   workers and a single straggler, sync with backup workers
   (``--replicas-to-aggregate N-1``) is the alternative that keeps sync's
   averaged updates. Not ``ssp``: against a straggler that is always slow, the
   fast workers reach the bound and then wait for it at every step, as in sync.
2. **Communication-bound**: moving the model (a pull and a push) takes at least
   ``COMM_FRACTION`` of a step's work. Recommend ``--grad-wire-dtype bfloat16``
   (half the bytes) and keep ``sync``: when every link is equally slow, async
   waits for no one but moves the same bytes, and reached the target no sooner.
3. Otherwise **balanced**: ``sync``: every step is one averaged update on the
   global batch, identical to one big batch on one machine, and no worker waits
   long at the barrier.

Calibrated on this project's ``ps-compare --scenario all --quick`` (docs/compare.md;
3 workers on 2 cores, digits, global batch 256). With one
worker 3x slower, sync took 2.0x async's time to 0.85 test accuracy (backup
workers 1.1x, ssp 1.5x to 1.7x), and the probe of that configuration measured
the straggler at 1.38x the typical step work: hence 1.25, above the 1.07 to
1.15 a balanced cluster shows here. With every link at 20 Mbit/s sync was the
fastest (async took 1.8x its time: it needs more, smaller updates, each paying
the same transfer). Balanced, every mode was within 20% of sync, which had the
highest throughput.
"""

from __future__ import annotations

import dataclasses
import statistics

STRAGGLER_RATIO = 1.25
COMM_FRACTION = 0.5


@dataclasses.dataclass
class WorkerTimes:
    index: int
    work_s: float  # a step's work: pull + compute + upload (no waiting for others)
    compute_s: float
    comm_s: float
    spread: float = 0.0  # its own step-to-step spread: p90 / median of per-step work (probes; 0: not measured)


@dataclasses.dataclass
class Measurements:
    source: str
    mode: str
    workers: list[WorkerTimes]
    model_bytes: int
    bandwidth: dict[str, float]  # shard address -> bytes/s of a whole-model pull from here

    @property
    def reference_work(self) -> float:
        """The typical worker's step work: the median of all but the slowest (with two
        workers, the faster one), so that a single straggler does not move it."""
        works = sorted(w.work_s for w in self.workers)
        return statistics.median(works[:-1] if len(works) > 1 else works)

    @property
    def straggler_ratio(self) -> float:
        ref = self.reference_work
        return max(w.work_s for w in self.workers) / ref if ref > 0 else 1.0

    @property
    def comm_fraction(self) -> float:
        work = statistics.median(w.work_s for w in self.workers)
        comm = statistics.median(w.comm_s for w in self.workers)
        return comm / work if work > 0 else 0.0


@dataclasses.dataclass
class Advice:
    mode: str
    flags: list[str]
    rule: str
    reason: str
    alternative: str = ""


def decide(m: Measurements) -> Advice:
    n = len(m.workers)
    ratio = m.straggler_ratio
    if n >= 2 and ratio >= STRAGGLER_RATIO:
        ref = m.reference_work
        slow = [w.index for w in m.workers if w.work_s >= STRAGGLER_RATIO * ref]
        alternative = ""
        if n >= 3 and len(slow) == 1:
            alternative = (f"sync with backup workers: --mode sync --replicas-to-aggregate {n - 1} (each round "
                           f"finishes without the slowest push; keeps averaged updates)")
        return Advice("async", ["--mode", "async"], "straggler",
                      f"worker(s) {slow} need {ratio:.2f}x the typical step work (>= {STRAGGLER_RATIO}): a sync "
                      f"barrier runs every step at their pace, and ssp would too once its bound is reached; "
                      f"async lets the others go on", alternative)
    if m.comm_fraction >= COMM_FRACTION:
        return Advice("sync", ["--mode", "sync", "--grad-wire-dtype", "bfloat16"], "communication-bound",
                      f"moving the model takes {m.comm_fraction:.0%} of a step's work (>= {COMM_FRACTION:.0%}): "
                      "bfloat16 gradients halve the bytes pushed; with equally slow links async moves as many "
                      "bytes and gains nothing, so sync's averaged updates stay",
                      "--grad-wire-dtype float16 (more mantissa, less range), or more shards (--ps a,b) "
                      "when the server's own link is the bottleneck")
    return Advice("sync", ["--mode", "sync"], "balanced",
                  f"the slowest worker needs {ratio:.2f}x the typical step work (< {STRAGGLER_RATIO}) and moving "
                  f"the model takes {m.comm_fraction:.0%} of it (< {COMM_FRACTION:.0%}): the barrier costs little, "
                  "and each step is one averaged update on the global batch")


class AdviseError(RuntimeError):
    """What ps-advise could not measure or simulate; the message is shown to the user as is."""
