"""Who is in the cluster: registered workers and what each last did.

    members = Membership(num_workers=2)
    members.register(worker_index=0, claimed_num_workers=2, name="host:1234")
    members.require(0)            # raises UnknownWorker for an id never registered

Registering an index again (a restarted worker) replaces its record. Thread-safe:
one small lock guards the table and is never held while calling out.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from ps_server.core.errors import ConfigMismatch, InvalidArgument, UnknownWorker


@dataclasses.dataclass
class WorkerRecord:
    worker_id: int
    name: str
    registered_at: float
    last_seen: float
    last_step: int = -1
    pushes: int = 0
    left: bool = False


class Membership:
    def __init__(self, num_workers: int, clock: Callable[[], float] = time.monotonic):
        if num_workers < 1:
            raise InvalidArgument(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._clock = clock
        self._lock = threading.Lock()  # guards _workers; leaf lock, nothing is called under it
        self._workers: dict[int, WorkerRecord] = {}

    def register(self, worker_index: int, claimed_num_workers: int = 0, name: str = "") -> WorkerRecord:
        if claimed_num_workers and claimed_num_workers != self.num_workers:
            raise ConfigMismatch(
                f"worker {worker_index} was started with --num-workers {claimed_num_workers} "
                f"but the server runs with {self.num_workers}"
            )
        if not 0 <= worker_index < self.num_workers:
            raise InvalidArgument(
                f"worker index {worker_index} is outside 0..{self.num_workers - 1} "
                f"(the server runs with {self.num_workers} workers)"
            )
        now = self._clock()
        record = WorkerRecord(worker_id=worker_index, name=name, registered_at=now, last_seen=now)
        with self._lock:
            self._workers[worker_index] = record
        return dataclasses.replace(record)

    def require(self, worker_id: int) -> None:
        with self._lock:
            if worker_id not in self._workers:
                raise UnknownWorker(f"worker {worker_id} is not registered; call Register first")
            self._workers[worker_id].last_seen = self._clock()

    def record_push(self, worker_id: int, step: int) -> None:
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is not None:
                rec.last_step = max(rec.last_step, step)
                rec.pushes += 1
                rec.last_seen = self._clock()

    def leave(self, worker_id: int) -> None:
        self.require(worker_id)
        with self._lock:
            self._workers[worker_id].left = True

    def name_of(self, worker_id: int) -> str:
        with self._lock:
            rec = self._workers.get(worker_id)
        return rec.name if rec is not None and rec.name else ""

    def describe(self, worker_ids) -> str:
        """'1 (host:77)' style names for error messages."""
        parts = []
        for w in worker_ids:
            name = self.name_of(w)
            parts.append(f"{w} ({name})" if name else str(w))
        return ", ".join(parts)

    def snapshot(self) -> list[WorkerRecord]:
        with self._lock:
            return [dataclasses.replace(r) for _, r in sorted(self._workers.items())]
