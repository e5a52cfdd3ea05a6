"""The parameter server's core: the one object the gRPC service drives.

    ps = ParameterServer(mode="sync", num_workers=2, barrier_timeout=60.0)
    reg = ps.register(worker_index=0, claimed_num_workers=2)
    ps.initialize({"w": w0}, OptimizerSpec("sgd", learning_rate=0.1))
    version, values = ps.pull()
    ps.push(Push(worker_id=0, step=0, base_version=version, batch_size=32, gradients=g))

Plain Python and NumPy: no gRPC, no protobuf, no TensorFlow (a test imports it
in a fresh interpreter to hold that). Errors are ``core.errors`` classes; the
service module maps them to gRPC status codes. Every method is thread-safe.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Mapping

import numpy as np

from ps_server.core.async_mode import AsyncMode
from ps_server.core.errors import InvalidArgument
from ps_server.core.membership import Membership, WorkerRecord
from ps_server.core.modes import Push, PushResult, Stats
from ps_server.core.optimizers import OptimizerSpec
from ps_server.core.store import VariableStore
from ps_server.core.sync_mode import SyncMode

MODES = ("sync", "async")


@dataclasses.dataclass(frozen=True)
class Registration:
    worker_id: int
    mode: str
    num_workers: int
    initialized: bool
    version: int
    barrier_timeout: float


@dataclasses.dataclass(frozen=True)
class Status:
    mode: str
    num_workers: int
    initialized: bool
    version: int
    round: int
    waiting_for: tuple[int, ...]
    workers: list[WorkerRecord]
    pushes_applied: int
    examples_applied: int
    mean_staleness: float
    max_staleness: int
    optimizer: OptimizerSpec | None
    num_variables: int
    num_parameters: int
    uptime_s: float
    rounds_timed_out: int
    last_loss: float


class ParameterServer:
    def __init__(self, mode: str, num_workers: int, barrier_timeout: float = 60.0):
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
        self.mode_name = mode
        self.num_workers = num_workers
        self.barrier_timeout = barrier_timeout
        self.members = Membership(num_workers)
        self.store = VariableStore()
        self.stats = Stats()
        self._started = time.monotonic()
        if mode == "sync":
            self.mode = SyncMode(self.store, self.members, num_workers, barrier_timeout, self.stats)
        else:
            self.mode = AsyncMode(self.store, self.members, self.stats)

    def register(self, worker_index: int, claimed_num_workers: int = 0, name: str = "") -> Registration:
        rec = self.members.register(worker_index, claimed_num_workers, name)
        return Registration(
            worker_id=rec.worker_id,
            mode=self.mode_name,
            num_workers=self.num_workers,
            initialized=self.store.initialized,
            version=self.store.version,
            barrier_timeout=self.barrier_timeout,
        )

    def initialize(self, worker_id: int, variables: Mapping[str, np.ndarray], spec: OptimizerSpec) -> tuple[bool, int]:
        """(created, version). Repeating an identical initialization is harmless."""
        self.members.require(worker_id)
        created = self.store.initialize(variables, spec)
        return created, self.store.version

    def pull(self, worker_id: int | None = None, names: Iterable[str] | None = None) -> tuple[int, dict[str, np.ndarray]]:
        if worker_id is not None and worker_id >= 0:
            self.members.require(worker_id)
        return self.store.read(names)

    def push(self, push: Push) -> PushResult:
        self.members.require(push.worker_id)
        result = self.mode.push(push)
        self.members.record_push(push.worker_id, push.step)
        return result

    def leave(self, worker_id: int) -> None:
        self.members.leave(worker_id)

    def status(self) -> Status:
        mode_status = self.mode.status()
        mean_s, max_s = self.stats.staleness_summary()
        specs = self.store.specs()
        return Status(
            mode=self.mode_name,
            num_workers=self.num_workers,
            initialized=self.store.initialized,
            version=self.store.version,
            round=mode_status.round,
            waiting_for=mode_status.waiting_for,
            workers=self.members.snapshot(),
            pushes_applied=self.stats.pushes_applied,
            examples_applied=self.stats.examples_applied,
            mean_staleness=mean_s,
            max_staleness=max_s,
            optimizer=self.store.optimizer_spec,
            num_variables=len(specs),
            num_parameters=self.store.num_parameters(),
            uptime_s=time.monotonic() - self._started,
            rounds_timed_out=mode_status.rounds_timed_out,
            last_loss=self.stats.last_loss,
        )


__all__ = ["MODES", "ParameterServer", "Push", "PushResult", "Registration", "Status"]
