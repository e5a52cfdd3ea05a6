"""ps-worker's ``main``, run once per point, each run sent SIGTERM at that point of its step
(for tests/cluster/test_elastic_sigterm.py).

    python tests/cluster/sigterm_worker.py tape,pause CHIEF_PID_FILE -- --ps HOST:PORT --elastic ...

One process, so TensorFlow starts once: each run is ``worker.cli.main`` with the flags
after ``--`` (and a point's own), from a fresh Keras session (layer names restart, as in
a new process). The signal is real, sent to this process by ``os.kill`` at the ``AT``-th
call of a function of the worker's step (a ``Trap``):

- ``tf`` (``tf:N``): from inside TensorFlow or Keras code under that call (the first (N-th)
  of their frames it enters: a profile hook, armed for that call only), where an
  exception from the handler would be TensorFlow's to wrap;
- ``now``: as the call starts;
- ``during``: ``DURING_S`` after it started, from a timer thread (the call is a wait).

For the waits on the chief, a SIGSTOP holds the chief (its pid in CHIEF_PID_FILE) from
a call of another function until the run ends: the wait cannot end meanwhile.

After each run one line: ``@@ NAME status S after_s T where W`` (T: seconds from the
signal to ``main``'s return; W: the file of the TensorFlow or Keras frame a ``tf`` trap
fired in, else the main thread's functions then, innermost first); before it,
``@@ start NAME``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import keras  # noqa: E402

from worker import cli, connection, gradients, knobs  # noqa: E402
from worker.client import PSClient  # noqa: E402

DURING_S = 0.2

# name: (owner, function, the call it fires at, how, the point's own flags, the function and
# the call that holds the chief, or None)
POINTS = {
    # the third try while waiting for the chief's Initialize (no chief yet)
    "join-wait": (PSClient, "pull", 3, "now", (), None),
    # waiting to be dealt its first micro-batch: the chief, held since before this worker
    # registered, never ends the round that was dealt without it
    "work-wait": (PSClient, "work", 1, "during", (), (PSClient, "register", 1)),
    "pull-load": (connection.Connection, "pull", 3, "tf", (), None),  # loading the pulled values into the model
    "tape": (gradients.Gradients, "__call__", 3, "tf", (), None),  # the tf.function of the GradientTape
    # deep in its first call, which traces it: TensorFlow's C++ calling back into Python
    "trace": (gradients.Gradients, "__call__", 1, "tf:3000", (), None),
    "to-numpy": (gradients, "to_pushable", 5, "tf", (), None),  # a gradient turned into NumPy
    "before-push": (PSClient, "push", 3, "now", (), None),
    # sent, waiting for the round's answer, which needs the micro-batch of the chief, held
    # as this worker pulls for the same round (as a rule before the chief delivered it)
    "push-wait": (PSClient, "push", 3, "during", (), (connection.Connection, "pull", 3)),
    "pause": (knobs.Knobs, "before_step", 1, "during", ("--pause-at-step", "1", "--pause-for", "600"), None),
}


class Trap:
    """Wraps ``owner.name`` so that its ``at``-th call sends this process SIGTERM, and the
    call ``hold`` names SIGSTOPs the chief until ``remove`` (module docstring)."""

    def __init__(self, owner, name: str, at: int, how: str, hold, chief_pid_file: str, address: str):
        self.how, self.chief_pid_file, self.address, self.held = how, chief_pid_file, address, None
        self.calls, self.sent_at, self.where = 0, None, ""
        self.restores = []
        if hold is not None:
            self._wrap(hold[0], hold[1], lambda n: n == hold[2] and self.hold())
        self._wrap(owner, name, lambda n: n == at and self.spring())

    def _wrap(self, owner, name: str, on_call) -> None:
        original, calls = getattr(owner, name), []

        def wrapped(*args, **kwargs):
            calls.append(None)
            on_call(len(calls))
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)
        self.restores.append(lambda: setattr(owner, name, original))

    def hold(self) -> None:
        """SIGSTOP the chief, once it trains (the server's first round is done)."""
        deadline = time.monotonic() + 300
        with PSClient(self.address) as client:
            while client.status().version < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        with open(self.chief_pid_file) as f:
            self.held = int(f.read())
        os.kill(self.held, signal.SIGSTOP)

    def spring(self) -> None:
        if self.how == "now":
            self.send()
        elif self.how == "during":
            threading.Timer(DURING_S, self.send).start()
        else:
            self.countdown = int(self.how.partition(":")[2] or 1)
            sys.setprofile(self.profile)  # this thread only

    def profile(self, frame, event, arg) -> None:
        where = frame.f_code.co_filename
        if event == "call" and ("/tensorflow/" in where or "/keras/" in where):
            self.countdown -= 1
            if self.countdown:
                return
            sys.setprofile(None)
            self.where = where
            self.send()

    def send(self) -> None:
        if not self.where:
            frame, names = sys._current_frames()[threading.main_thread().ident], []
            while frame is not None and len(names) < 8:
                names.append(frame.f_code.co_name)
                frame = frame.f_back
            self.where = "<".join(names)
        self.sent_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)

    def remove(self) -> None:
        sys.setprofile(None)
        for restore in reversed(self.restores):
            restore()
        if self.held is not None:
            os.kill(self.held, signal.SIGCONT)


def main() -> int:
    names, chief_pid_file, flags = sys.argv[1].split(","), sys.argv[2], sys.argv[sys.argv.index("--") + 1:]
    for name in names:
        owner, function, at, how, own, hold = POINTS[name]
        keras.backend.clear_session()
        print(f"@@ start {name}", flush=True)
        trap = Trap(owner, function, at, how, hold, chief_pid_file, flags[flags.index("--ps") + 1])
        try:
            status = cli.main([*flags, *own])
        finally:
            trap.remove()
        after = time.monotonic() - trap.sent_at if trap.sent_at is not None else -1.0
        print(f"@@ {name} status {status} after_s {after:.2f} where {trap.where or '-'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
