"""Errors the parameter-server core raises.

    from ps_server.core.errors import PSError

Every refusal of the core is one of these classes. The core never knows about
gRPC: the service module holds the one table that turns each class into a status
code (``ps_server.service.STATUS_OF``). A rejected call never changes stored
state: each raising site checks before it mutates.
"""


class PSError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidArgument(PSError):
    """The request itself is malformed: bad shape, dtype, value or spec."""


class NonFinite(InvalidArgument):
    """A gradient holds NaN or Inf: the training diverged (or the worker has a bug). Nothing
    was applied; to a client it is INVALID_ARGUMENT like any bad value, and a caller that
    drives the core itself (virtual time) can tell a diverged run by this class."""


class NotFound(PSError):
    """A named variable does not exist on this server."""


class NotInitialized(PSError):
    """Variables were requested before the chief initialized them."""


class SpecConflict(PSError):
    """An initialization disagrees with the state already stored."""


class ConfigMismatch(PSError):
    """A worker's view of the cluster disagrees with the server's."""


class UnknownWorker(PSError):
    """A call names a worker id that never registered."""


class NoFreeIndex(PSError):
    """An auto-index registration found every worker index taken by a live or finished worker."""


class StaleRound(PSError):
    """A sync push for a round that has already completed."""


class FutureRound(PSError):
    """A sync push for a round that has not started yet."""


class DuplicatePush(PSError):
    """A worker pushed twice for the same round."""


class BarrierTimeout(PSError):
    """A sync round did not fill before the barrier timeout.

    ``missing`` lists the worker ids that had not pushed.
    """

    def __init__(self, message: str, missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.missing = missing


class WorkerDead(PSError):
    """A sync round cannot complete: a worker it needs is dead (policy abort, or
    policy wait with no replacement in time). ``dead`` lists them."""

    def __init__(self, message: str, dead: tuple[int, ...] = ()):
        super().__init__(message)
        self.dead = dead


class Busy(PSError):
    """The server could not take a push's bytes in time: the pushes it was receiving
    already filled its receive budget (``ps_server.aio.AsyncBudget``). Nothing
    was applied; the push may be sent again."""
