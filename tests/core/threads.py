"""Bounded thread helpers for the core tier: every wait has a limit."""

import threading
import time

JOIN = 60.0  # a thread still running after this long is hung


class Worker(threading.Thread):
    """Runs fn in a thread and keeps its result or its exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            self.error = e


def start(fn) -> Worker:
    w = Worker(fn)
    w.start()
    return w


def finish(*workers, timeout=JOIN):
    for w in workers:
        w.join(timeout)
        assert not w.is_alive(), "a thread never finished (a push never returned?)"


def ticking(ticket, tick, timeout=JOIN, every=0.005):
    """The ticket's result, calling ``tick()`` every few ms until it is settled: what the
    server's ticker does (``ParameterServer.tick``, a mode's ``expire_overdue``)."""
    deadline = time.monotonic() + timeout
    while not ticket.done():
        assert time.monotonic() < deadline, "a ticket was never settled"
        tick()
        time.sleep(every)
    return ticket.result()


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


class FakeClock:
    """A clock for membership and the barrier; it moves only when a test moves it."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self):
        return self.now
