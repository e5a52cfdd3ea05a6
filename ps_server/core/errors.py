"""Errors the parameter-server core raises.

    from ps_server.core.errors import PSError

Every refusal of the core is one of these classes. The core never knows about
gRPC: the service module holds the one table that turns each class into a status
code (``ps_server.service.STATUS_OF``), and sends the error's ``reason``
(``ps_common.reasons``) beside it: what a worker decides on, where the message is
for people. Each class has a reason; a raise site whose refusal is a more particular
one says so (``raise InvalidArgument(..., reason=Reason.PULL_FIRST)``). A rejected
call never changes stored state: each raising site checks before it mutates.
"""

from ps_common.reasons import Reason


class PSError(Exception):
    """Base class of every error the core raises on purpose."""

    reason = Reason.UNSPECIFIED

    def __init__(self, message: str = "", *, reason: Reason | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class InvalidArgument(PSError):
    """The request itself is malformed: bad shape, dtype, value or spec."""

    reason = Reason.INVALID


class NonFinite(InvalidArgument):
    """A gradient holds NaN or Inf: the training diverged (or the worker has a bug). Nothing
    was applied; to a client it is INVALID_ARGUMENT like any bad value, and a caller that
    drives the core itself (virtual time) can tell a diverged run by this class."""

    reason = Reason.NON_FINITE


class NotFound(PSError):
    """A named variable does not exist on this server."""

    reason = Reason.NOT_FOUND


class NotInitialized(PSError):
    """Variables were requested before the chief initialized them."""

    reason = Reason.NOT_INITIALIZED


class SpecConflict(PSError):
    """An initialization disagrees with the state already stored."""

    reason = Reason.SPEC_CONFLICT


class ConfigMismatch(PSError):
    """A worker's view of the cluster disagrees with the server's."""

    reason = Reason.CONFIG_MISMATCH


class UnknownWorker(PSError):
    """A call names a worker id that never registered."""

    reason = Reason.NOT_REGISTERED


class Superseded(PSError):
    """A worker process registers again for an index that another process has taken since
    (``core.membership``: incarnations)."""

    reason = Reason.SUPERSEDED


class NoFreeIndex(PSError):
    """An auto-index registration found every worker index taken by a live or finished worker."""

    reason = Reason.NO_FREE_INDEX


class StaleRound(PSError):
    """A sync push for a round that has already completed."""

    reason = Reason.LATE


class FutureRound(PSError):
    """A sync push for a round that has not started yet."""

    reason = Reason.EARLY


class DuplicatePush(PSError):
    """A worker pushed twice for the same round."""

    reason = Reason.DUPLICATE


class BarrierTimeout(PSError):
    """A sync round did not fill before the barrier timeout.

    ``missing`` lists the worker ids that had not pushed.
    """

    reason = Reason.BARRIER_TIMEOUT

    def __init__(self, message: str, missing: tuple[int, ...] = (), *, reason: Reason | None = None):
        super().__init__(message, reason=reason)
        self.missing = missing


class WorkerDead(PSError):
    """A sync round cannot complete: a worker it needs is dead (policy abort, or
    policy wait with no replacement in time). ``dead`` lists them."""

    reason = Reason.WORKER_DEAD

    def __init__(self, message: str, dead: tuple[int, ...] = (), *, reason: Reason | None = None):
        super().__init__(message, reason=reason)
        self.dead = dead


class Busy(PSError):
    """The server could not take a push's bytes in time: the pushes it was receiving
    already filled its receive budget (``ps_server.aio.AsyncBudget``). Nothing
    was applied; the push may be sent again."""

    reason = Reason.BUSY
