"""Receive buffers reused across pushes, so a streamed gradient lands in memory
that is already mapped instead of fresh pages every step.

    buf = pool.acquire(nbytes)       # uint8 array of exactly nbytes (a view)
    ...                              # fill it, hand views of it to the core
    pool.release(buf)                # once nothing refers to it any more

A buffer is lent to one push at a time: the core keeps no reference to a
push's gradients once it says so (a sync round folds a push into its sum on
arrival and calls ``consumed``; async applies them before it returns), so the
service releases the buffer then, or when its handler ends. A retried push that
arrives while the first is still waiting in a round gets a buffer of its own.

At most ``keep`` free buffers of each size are kept, and no more than
``keep_bytes`` of them; more (a burst of concurrent pushes) are dropped for the
garbage collector.

The bytes of pushes being received at once are bounded as well
(``ps_server.aio.AsyncBudget``): a push waits, holding no buffer yet, until the
pushes in flight leave room, so a burst of a thousand workers' pushes costs the
server that many bytes at most, not a thousand models. One push is always let
in, however large.
"""

from __future__ import annotations

import threading

import numpy as np


class BufferPool:
    def __init__(self, keep: int = 8, keep_bytes: int = 256 << 20):
        self.keep = keep
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()  # leaf lock
        self.allocated = 0  # buffers made so far (the pool's misses)

    def acquire(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            self.allocated += 1
        return np.empty(nbytes, np.uint8)

    def release(self, buffer: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.nbytes, [])
            if len(free) < min(self.keep, max(1, self.keep_bytes // max(1, buffer.nbytes))):
                free.append(buffer)
