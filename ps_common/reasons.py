"""Why the server refused a call: one reason per refusal, beside the status code.

    from ps_common.reasons import Reason, REASON_KEY
    raise StaleRound("push for step 3 is late ...", reason=Reason.LATE)   # server's core
    if e.reason in REJOIN: conn.rejoin(e)                                  # worker

The status code says what kind of failure a call met (gRPC's dozen); the reason says
which refusal it was, for the worker to decide on. It travels as the trailing metadata
``tfps-reason: <value>`` of every refusal (``ps_server.service``), and ``worker``'s
``PSClientError.reason`` reads it back. The message text is for people: no code decides
anything by it (``tests/test_reasons.py``), so rewording a message changes nothing a worker
does. A reason a client does not know (a newer server) reads as ``UNSPECIFIED``.

Plain Python, no protobuf: the server's core raises with these.
"""

from __future__ import annotations

import enum

REASON_KEY = "tfps-reason"  # trailing-metadata key (gRPC keys are lower case)


class Reason(enum.Enum):
    """Each refusal's reason; the value is what the wire carries."""

    UNSPECIFIED = "unspecified"  # no reason sent: a bug (INTERNAL), a client-side failure, an old server
    INVALID = "invalid"  # the request itself is malformed: a shape, a dtype, a value, a spec
    NON_FINITE = "non-finite"  # a gradient holds NaN or Inf
    NOT_FOUND = "not-found"  # a variable this server does not hold
    NOT_INITIALIZED = "not-initialized"  # the chief has not initialized the variables yet
    SPEC_CONFLICT = "spec-conflict"  # an initialization that disagrees with the stored state
    CONFIG_MISMATCH = "config-mismatch"  # the worker's view of the cluster is not the server's
    NOT_REGISTERED = "not-registered"  # the server does not know this worker (it restarted, say)
    DECLARED_DEAD = "declared-dead"  # this worker missed its lease (or left) and was declared dead
    NOT_IN_ROUND = "not-in-round"  # sync: this worker was dropped from the rounds
    NOT_JOINED = "not-joined"  # elastic sync: this worker is not among the round's live workers
    NO_FREE_INDEX = "no-free-index"  # every worker index is taken
    SUPERSEDED = "superseded"  # another process took this worker's index since: this one must stop
    LATE = "late"  # the round this push is for completed without it
    EARLY = "early"  # the round this push is for has not started
    DUPLICATE = "duplicate"  # a second push of this worker for the same round
    PULL_FIRST = "pull-first"  # the gradient was computed on a version the round is not on
    BARRIER_TIMEOUT = "barrier-timeout"  # the round did not fill in time (or ssp's bound did not move)
    WORKER_DEAD = "worker-dead"  # the round cannot complete: another worker it needs died
    BUSY = "busy"  # the server could not take the push's bytes in time; send it again
    TASK_NOT_HELD = "task-not-held"  # a push of a task this worker does not hold (its lease ran out)
    TASK_DONE = "task-done"  # a push of a task another worker's push already applied
    SHM_REFUSED = "shm-refused"  # the same-host fast path cannot serve this call: stream it
    BROADCAST_CONFLICT = "broadcast-conflict"  # a key posted again with another value
    BROADCAST_TIMEOUT = "broadcast-timeout"  # the chief did not post the key in time

    @classmethod
    def of_wire(cls, value: str | bytes | None) -> "Reason":
        """The reason a trailing-metadata value names; UNSPECIFIED for none or an unknown one."""
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


def reason_of(error: BaseException) -> Reason:
    """The reason an error raised with (its ``reason``), UNSPECIFIED for any other."""
    reason = getattr(error, "reason", None)
    return reason if isinstance(reason, Reason) else Reason.UNSPECIFIED
