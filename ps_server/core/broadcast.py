"""The chief's decisions, posted under a key and read by every other worker.

    board = Broadcasts(timeout_limit=60.0)
    board.post("epoch-3", b"stop")                          # the chief (worker 0): returns at once
    value = board.submit_wait("epoch-3", 30.0).result(30)   # any other worker: settled once posted

What a Keras ``model.fit`` on several workers agrees on at each epoch's end:
whether to stop (an ``EarlyStopping`` on the chief) and the next learning rate
(a ``LearningRateScheduler`` or ``ReduceLROnPlateau`` on the chief), so that
every worker stops at the same epoch and trains with the chief's choice.
``ParameterServer.submit_broadcast`` decides who posts: worker 0 posts, the others wait.

Guarantees:
- a key holds one value for good: posting it again with the same value is
  harmless (a retried post), with another value it is refused
  (``BroadcastConflict``) and the first value stays;
- a reader gets exactly the bytes the chief posted, however long before or after
  its own call the post came (within the keys kept, below);
- every wait is bounded: at most ``timeout_limit`` seconds (the server's barrier
  timeout), after which ``expire_overdue`` (the server's ticker) settles it with
  ``BroadcastTimeout``, which says which key was not posted;
- the last ``KEYS_KEPT`` keys are kept, the oldest posted dropped first: a worker
  that asks for a key dropped long ago waits (and times out) as for one never
  posted.

Threading: ``Board`` is the deterministic core (no threads, no clock);
``Broadcasts`` owns the one lock around it and the tickets waiting for a key, as
``sync_mode.SyncMode`` wraps ``rounds.RoundBook``. Nothing here blocks or does network I/O.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import Callable

from ps_common.reasons import Reason
from ps_server.core.errors import InvalidArgument, PSError
from ps_server.core.modes.base import Ticket

KEYS_KEPT = 1000
MAX_KEY_CHARS = 256
MAX_VALUE_BYTES = 2**20  # a decision, not a payload: a flag or a learning rate is a few bytes


class BroadcastConflict(PSError):
    """A key the chief already posted was posted again with another value."""

    reason = Reason.BROADCAST_CONFLICT


class BroadcastTimeout(PSError):
    """The chief did not post the key within the wait's timeout."""

    reason = Reason.BROADCAST_TIMEOUT


def _check_key(key: str) -> None:
    if not key:
        raise InvalidArgument("a broadcast key must be non-empty")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidArgument(f"a broadcast key has at most {MAX_KEY_CHARS} characters, got {len(key)}")


class Board:
    """Posted values by key, the newest ``keep`` keys; plain and single-threaded."""

    def __init__(self, keep: int = KEYS_KEPT):
        if keep < 1:
            raise InvalidArgument(f"a board keeps at least one key, got {keep}")
        self.keep = keep
        self._values: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    def post(self, key: str, value: bytes) -> bool:
        """Hold ``value`` under ``key``; True when the key is new, False when it already
        held this value. ``BroadcastConflict`` (nothing changed) when it held another."""
        _check_key(key)
        value = bytes(value)
        if len(value) > MAX_VALUE_BYTES:
            raise InvalidArgument(f"a broadcast value holds at most {MAX_VALUE_BYTES} bytes, got {len(value)}")
        held = self._values.get(key)
        if held is not None:
            if held != value:
                raise BroadcastConflict(
                    f"broadcast key {key!r} was already posted with another value ({len(held)} bytes, now "
                    f"{len(value)}); a key is posted once: use a new key for a new decision")
            return False
        self._values[key] = value
        while len(self._values) > self.keep:
            self._values.popitem(last=False)  # the oldest posted
        return True

    def get(self, key: str) -> bytes | None:
        """The value posted under ``key``, or None (never posted, or dropped as too old)."""
        _check_key(key)
        return self._values.get(key)

    def __len__(self) -> int:
        return len(self._values)


class Broadcasts:
    """The board behind one lock, with waits for a key bounded by ``timeout_limit``."""

    def __init__(self, timeout_limit: float, keep: int = KEYS_KEPT, clock: Callable[[], float] = time.monotonic):
        if not timeout_limit > 0:
            raise InvalidArgument(f"the broadcast timeout limit must be > 0, got {timeout_limit}")
        self.timeout_limit = timeout_limit
        self._clock = clock
        self._board = Board(keep)
        self._lock = threading.Lock()  # guards _board and _tickets; leaf lock, nothing is called under it
        self._tickets: list[tuple[str, float, float, Ticket]] = []  # (key, deadline, timeout, ticket)

    def post(self, key: str, value: bytes) -> bytes:
        """Post (the chief); returns the value, at once."""
        with self._lock:
            self._board.post(key, value)
            ready = [t for t in self._tickets if self._board.get(t[0]) is not None]
            self._tickets = [t for t in self._tickets if t not in ready]
            values = [self._board.get(t[0]) for t in ready]
        for (_, _, _, ticket), got in zip(ready, values):
            ticket.settle(got)
        return bytes(value)

    def submit_wait(self, key: str, timeout: float) -> Ticket:
        """A ticket settled with the value posted under ``key`` (at once if it is), or with
        ``BroadcastTimeout`` by ``expire_overdue`` once ``timeout`` seconds (at most
        ``timeout_limit``; 0: do not wait) have passed."""
        ticket = Ticket()
        try:
            timeout = self._checked(timeout)
            with self._lock:
                value = self._board.get(key)
                if value is None and timeout > 0:
                    self._tickets.append((key, self._clock() + timeout, timeout, ticket))
                    return ticket
            ticket.settle(value if value is not None else self._timeout(key, timeout))
        except InvalidArgument as e:
            ticket.settle(e)
        return ticket

    def expire_overdue(self) -> None:
        now = self._clock()
        with self._lock:
            late = [t for t in self._tickets if t[1] <= now]
            self._tickets = [t for t in self._tickets if t[1] > now]
        for key, _, timeout, ticket in late:
            ticket.settle(self._timeout(key, timeout))

    def _checked(self, timeout) -> float:
        if not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0:
            raise InvalidArgument(f"a broadcast timeout must be a number of seconds >= 0, got {timeout!r}")
        return min(float(timeout), self.timeout_limit)

    def _timeout(self, key: str, timeout: float) -> "BroadcastTimeout":
        return BroadcastTimeout(
            f"broadcast key {key!r} was not posted by the chief (worker 0) within {timeout:g} s "
            f"(the server waits at most its barrier timeout, {self.timeout_limit:g} s): is the "
            "chief still running, and does it post this key?")

    def __len__(self) -> int:
        with self._lock:
            return len(self._board)


__all__ = ["Board", "BroadcastConflict", "BroadcastTimeout", "Broadcasts", "KEYS_KEPT"]
