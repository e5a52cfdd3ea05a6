"""Experiment knobs: make one worker slower, its network thinner, or pause it once.

    knobs = Knobs.from_config(config)     # --slowdown --bandwidth-mbps --added-latency-ms --pause-at-step --pause-for
    slept = knobs.before_step(step)       # the pause, once
    slept += knobs.before_pull()          # latency
    ...pull, then compute the gradients in c seconds...
    slept += knobs.after_compute(c)       # (slowdown - 1) * c
    slept += knobs.before_push(payload_nbytes(grads, config.grad_wire_dtype))   # latency + bytes / bandwidth
    ...push...

The knobs model a straggler (a slower machine, or one that stalls for a while) and a
slow link, to compare the modes under (docs/compare.md). They only sleep, so what they
add is exact and known: each method sleeps through the injected ``sleep`` and returns
the seconds it asked for, the step's ``knob_s``. The heartbeat thread renews the lease
meanwhile, so a pause is a straggler, not a death.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping

import numpy as np

from ps_common.sparse import SparseRows


@dataclasses.dataclass
class Knobs:
    slowdown: float = 1.0  # compute is this many times slower
    bandwidth_mbps: float = 0.0  # pushes go through a link this fast; 0: unlimited
    added_latency_ms: float = 0.0  # before every pull and push
    pause_at_step: int = 0  # before this step (from 0) ...
    pause_for: float = 0.0  # ... sleep this long, once; 0: never
    sleep: Callable[[float], None] = dataclasses.field(default=time.sleep, repr=False, compare=False)
    paused: bool = dataclasses.field(default=False, compare=False)
    warmed_up: bool = dataclasses.field(default=False, compare=False)

    @classmethod
    def from_config(cls, config) -> "Knobs":
        """From a validated ``WorkerConfig`` (its fields carry the same names)."""
        return cls(**{name: getattr(config, name) for name in cls().settings()})

    def settings(self) -> dict:
        """The knob values (the fields equality compares), as the history JSON records them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}

    @property
    def active(self) -> bool:
        return self.settings() != Knobs().settings()

    def describe(self) -> str:
        """One line for the log, naming only the knobs that are set."""
        parts = ((self.slowdown != 1.0, f"compute {self.slowdown:g}x slower"),
                 (self.bandwidth_mbps, f"pushes at {self.bandwidth_mbps:g} Mbit/s"),
                 (self.added_latency_ms, f"{self.added_latency_ms:g} ms added before every pull and push"),
                 (self.pause_for, f"a {self.pause_for:g} s pause before step {self.pause_at_step}"))
        return ", ".join(text for on, text in parts if on) or "none"

    def before_step(self, step: int) -> float:
        """The pause: once, before the first step numbered ``pause_at_step`` or more
        (a sync worker whose round was skipped still pauses, at the next one)."""
        if self.pause_for <= 0 or self.paused or step < self.pause_at_step:
            return 0.0
        self.paused = True
        return self._sleep(self.pause_for)

    def before_pull(self) -> float:
        """A pull request is tiny: only the latency."""
        return self._sleep(self.added_latency_ms / 1000.0)

    def after_compute(self, compute_s: float) -> float:
        """A machine ``slowdown`` times slower would have taken ``slowdown * compute_s``.
        Not on the first computation of the process: it carries TensorFlow's one-time
        tracing (0.4 s here against 0.01 s for a step), which is setup, not compute, and
        multiplied would make a short run's straggler mostly a slow starter."""
        if not self.warmed_up:
            self.warmed_up = True
            return 0.0
        return self._sleep((self.slowdown - 1.0) * compute_s)

    def before_push(self, nbytes: int) -> float:
        """Latency plus the time ``nbytes`` take at ``bandwidth_mbps`` (10^6 bits per second)."""
        transfer = nbytes / (self.bandwidth_mbps * 1e6 / 8) if self.bandwidth_mbps > 0 else 0.0
        return self._sleep(self.added_latency_ms / 1000.0 + transfer)

    def _sleep(self, seconds: float) -> float:
        if seconds <= 0:
            return 0.0
        self.sleep(seconds)
        return seconds


def payload_nbytes(gradients: Mapping[str, np.ndarray], wire_dtype: str = "float32") -> int:
    """Bytes of the gradients as a push sends them: float32 arrays take 2 bytes per
    element with ``--grad-wire-dtype`` float16 or bfloat16, everything else its own size
    (``protos.stream.to_wire``); a sparse gradient (``SparseRows``) its rows and their
    8-byte row numbers."""
    total = 0
    for g in gradients.values():
        if isinstance(g, SparseRows):
            total += g.rows.size * 8
            g = g.values
        g = np.asarray(g)
        total += g.size * 2 if wire_dtype != "float32" and g.dtype == np.float32 else g.nbytes
    return int(total)
