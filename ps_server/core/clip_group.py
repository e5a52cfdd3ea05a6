"""``global_clipnorm`` over several server shards: one norm for the whole model.

    group = ClipGroup(shards=("10.0.0.1:50051", "10.0.0.2:50051"), shard=1, order=("dense/kernel", ...))
    board = NormBoard(group, store.clip_scale_of)   # on shard 0 only
    ticket = board.contribute("round 7", 1, {"dense/kernel": np.float32(3.5)})

Keras clips every gradient of an update by the norm of all of them. A shard holds
part of the model, so the norm of its own gradients is not that norm. With a
``ClipGroup`` (the chief sends it with ``Initialize`` when the optimizer clips
globally and the model lies on more than one shard) each shard, at the moment it
would compute the factor of an update, computes the sum of squares of each of its
trainable gradients (``ops.sum(ops.square(g))``, as one server would) and hands
them to shard 0's ``NormBoard`` under the update's key: ``"round R"`` in sync
mode, ``"push W:S"`` (worker W's step S) in async and ssp, the same on every shard
because every shard takes part in every round and every push. Once every shard's
squares for a key are in, the board stacks them in the model's variable order
(``order``, the order one server adds them in) and computes the factor as
``Optimizer.clip_scale_of`` does on one server: the same bits. Every shard then
steps its variables with that factor. A key answered is remembered for a while,
so a shard asking again (its reply was lost) gets the same factor.

A shard that never brings its squares (it refused the push, died or is cut off)
leaves the others waiting until their ``timeout``: they then fail the update
(``ClipTimeout``), which changes nothing (the round is discarded, the push
refused), as a sync round that does not fill.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Mapping

import numpy as np

from ps_server.core.errors import BarrierTimeout, InvalidArgument
from ps_server.core.modes.base import Ticket

ANSWERS_KEPT = 256  # keys answered, for a shard that asks again


class ClipTimeout(BarrierTimeout):
    """Not every shard brought its squares for an update in time: nothing applied."""


@dataclasses.dataclass(frozen=True)
class ClipGroup:
    """The shards that clip together: their addresses (shard order; shard 0 holds the
    ``NormBoard``), this shard's index, and every variable of the model in its order."""

    shards: tuple[str, ...]
    shard: int
    order: tuple[str, ...]

    def __post_init__(self):
        if len(self.shards) < 2:
            raise InvalidArgument(f"a clip group is of 2 or more shards, got {list(self.shards)}")
        if not 0 <= self.shard < len(self.shards):
            raise InvalidArgument(f"shard {self.shard} is not one of the clip group's {len(self.shards)}")
        if len(set(self.order)) != len(self.order):
            raise InvalidArgument("the clip group's variable order names a variable twice")

    def as_dict(self) -> dict:
        return {"shards": list(self.shards), "shard": self.shard, "order": list(self.order)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ClipGroup":
        return cls(tuple(d["shards"]), int(d["shard"]), tuple(d["order"]))


class NormBoard:
    """Shard 0's: the squares each shard brought per key, and the factor once all are in."""

    def __init__(self, group: ClipGroup, clip_scale_of):
        self.group = group
        self._clip_scale_of = clip_scale_of  # the store's: Optimizer.clip_scale_of
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[dict[int, Mapping], Ticket]] = {}
        self._answers: collections.OrderedDict[str, Ticket] = collections.OrderedDict()

    def contribute(self, key: str, shard: int, squares: Mapping[str, np.floating]) -> Ticket:
        """Shard ``shard``'s squares for update ``key``: the ticket settles with the factor
        (``Optimizer.clip_scale_of`` of every shard's squares, in the model's order) once
        every shard's are in, or with the error computing it raised."""
        if not 0 <= shard < len(self.group.shards):
            raise InvalidArgument(f"shard {shard} is not one of the clip group's {len(self.group.shards)}")
        unknown = sorted(set(squares) - set(self.group.order))
        if unknown:
            raise InvalidArgument(f"shard {shard} brings squares of {unknown[0]!r}, which the model does not have")
        with self._lock:
            answered = self._answers.get(key)
            if answered is not None:
                return answered
            brought, ticket = self._waiting.setdefault(key, ({}, Ticket()))
            brought[shard] = squares
            if len(brought) < len(self.group.shards):
                return ticket
            del self._waiting[key]
            self._answers[key] = ticket
            while len(self._answers) > ANSWERS_KEPT:
                self._answers.popitem(last=False)
        merged = {name: s for part in brought.values() for name, s in part.items()}
        try:
            ticket.settle(self._clip_scale_of([merged[name] for name in self.group.order if name in merged]))
        except InvalidArgument as e:
            ticket.settle(e)
        return ticket

    def forget(self, key: str, shard: int) -> None:
        """Shard ``shard`` gave up waiting for ``key``: its squares no longer count."""
        with self._lock:
            waiting = self._waiting.get(key)
            if waiting is not None:
                waiting[0].pop(shard, None)
                if not waiting[0]:
                    del self._waiting[key]
