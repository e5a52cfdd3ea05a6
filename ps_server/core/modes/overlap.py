"""A sync round computed block by block while its pushes still arrive.

    spec = mode.overlap(worker_id, step, batch_size, names)       # a streamed push begins
    mode.offer(spec, worker_id, [(name, block, gradient), ...])   # the blocks that arrived
    rows = spec.peek(name, block, push_done)                      # its new values, None, or NOT_YET
    spec.confirmed                                                # after the round: kept?

Without it, a sync round moves the server's link one way at a time: every
worker's push comes in, then every pull goes out. With it, each variable is cut
into blocks of rows (``blocks``: about ``BLOCK_BYTES`` each; a 0-d or one-row
variable is one block), and as soon as every active worker's bytes for a block
have arrived (workers push the same variables in the same order), that block's
new values are computed: the weighted mean of its gradients by the round's own
rule (``aggregation.RoundSum``, held: elementwise, so a block's bits are the round's), then the
optimizer's step on those rows alone
(``VariableStore.step_rows``). They go back to the workers while the later
blocks still arrive: both directions of the link work at once.

Exact: every optimizer the server runs is elementwise once its scalars (update
count, learning rate) are fixed, so a step on some rows gives those rows' bits of
the step on the whole variable. The exceptions are the norms: with ``clipnorm``
each variable is one block, and ``global_clipnorm`` is not speculated at all.

It is a **speculation**, never a second way to compute a round. The round itself
is unchanged: it completes when every whole push is in (``RoundBook``), and
``SyncMode._complete`` then asks ``confirm`` whether every variable was computed
from exactly the round's pushes: the same workers in the same order, the very
same gradient arrays, the same batch sizes. Only then are the speculated values
published as the round (``VariableStore.publish``), the bits an apply of the
whole round gives; otherwise the round is applied whole as always and
``confirmed`` stays False, so a worker that got speculated values drops them and
pulls. One rule covers a participant whose push was refused or cut short, a round
that was aborted or timed out, a worker dropped meanwhile (shrink), and pushes
that came some other way (unary, shared memory) and offered nothing.

A speculated round keeps its pushes' gradients until it ends (the blocks and the
confirmation need them), as every round within ``aggregation.HELD_BYTES`` does: so
``SyncMode`` speculates only while every worker's push together stays within it.

Not speculated (``SyncMode.overlap`` says None): rounds with backup workers (which
pushes count is known only at the end), a push that sets the learning rate,
``global_clipnorm``, sparse gradients, gradients sent in another dtype than their
variable's (half precision on the wire). Plain Python and NumPy.
"""

from __future__ import annotations

import math
import threading
from typing import Mapping, Sequence

import numpy as np

from ps_common.defaults import MAX_OVERLAP_BLOCK_BYTES, MIN_OVERLAP_BLOCK_BYTES, OVERLAP_BLOCK_BYTES
from ps_server.core.modes.aggregation import RoundSum
from ps_server.core.errors import PSError

BLOCK_BYTES = OVERLAP_BLOCK_BYTES
# What a push may ask for instead (PushHeader.overlap_block_bytes): on a slow link a smaller
# block's values come back sooner; every block costs the server a step of its own.
MIN_BLOCK_BYTES, MAX_BLOCK_BYTES = MIN_OVERLAP_BLOCK_BYTES, MAX_OVERLAP_BLOCK_BYTES
_NO_COUNT = object()  # the state of a non-trainable variable has no update count
NOT_YET = object()  # Speculation.peek: the block is still to come


def blocks(shape: Sequence[int], itemsize: int, whole: bool = False,
           block_bytes: int = BLOCK_BYTES) -> list[tuple[int, int] | None]:
    """The row ranges a variable is speculated in: [(r0, r1), ...] covering its rows, each
    about ``block_bytes``; [None] (the whole variable) for a 0-d one or with ``whole``."""
    if whole or not shape or shape[0] <= 1:
        return [None]
    row_bytes = max(1, math.prod(shape[1:]) * itemsize)
    rows = max(1, block_bytes // row_bytes)
    return [(r, min(r + rows, shape[0])) for r in range(0, shape[0], rows)]


class Speculation:
    """One round's (one generation's) speculated blocks."""

    def __init__(self, generation: int, layout: Mapping[str, list]):
        self.generation = generation
        self.layout = dict(layout)  # name -> blocks(...)
        self.names = tuple(layout)
        self.sizes: dict[int, int] = {}  # worker -> batch size (from its push's header)
        self.arrays: dict[str, dict[int, np.ndarray]] = {n: {} for n in self.names}  # the pushes' gradients
        self.offered: dict[tuple[str, int], set[int]] = {}
        self.computing: set[tuple[str, int]] = set()
        self.done: dict[str, set[int]] = {n: set() for n in self.names}
        self.failed: set[str] = set()
        # name -> [value, {slot: array}, iterations, contributors, sizes], filled block by block
        self.partial: dict[str, list] = {}
        self.abandoned = False
        self.confirmed = False
        self._cond = threading.Condition()
        self._listeners: list = []  # called once at the next change (``listen``)

    def compute(self, name: str, block: int, store, contributions: Sequence[tuple[int, np.ndarray]],
                sizes: Sequence[int]) -> None:
        """Speculate one block: the weighted mean of the workers' rows (worker-id order), then
        the optimizer's step on them. Runs outside the barrier's lock (it changes nothing the
        round reads); a failure leaves the variable to the round's own apply."""
        rows = self.layout[name][block]
        picked = [g if rows is None else g[rows[0]:rows[1]] for _, g in contributions]
        try:
            # No checks here: only pushes the round took (checked whole: names, shapes, dtypes,
            # finite values) can confirm a speculation, by the identity of their arrays.
            block_sum = RoundSum(hold=True)  # a round within HELD_BYTES: the round's own rule
            for (worker, _), rows_of_worker, size in zip(contributions, picked, sizes):
                block_sum.add(worker, size, {name: rows_of_worker})
            mean = block_sum.mean()[name]
            with np.errstate(all="ignore"):  # a gradient the round will refuse may be anything
                value, state = store.step_rows(name, rows, mean)
        except (PSError, ValueError, TypeError, KeyError, ArithmeticError):
            with self._cond:
                self.failed.add(name)
                self._notify()
            return
        with self._cond:
            entry = self.partial.get(name)
            if entry is None:
                full_shape = contributions[0][1].shape
                entry = self.partial[name] = [
                    value if rows is None else np.empty(full_shape, value.dtype),
                    {k: (v if rows is None else np.empty(full_shape, v.dtype))
                     for k, v in state.items() if k != "iterations"},
                    state.get("iterations", _NO_COUNT), tuple(contributions), tuple(sizes)]
            if rows is not None:
                entry[0][rows[0]:rows[1]] = value
                for k, v in state.items():
                    if k != "iterations":
                        entry[1][k][rows[0]:rows[1]] = v
            same = entry[2] == state.get("iterations", _NO_COUNT) and len(entry[3]) == len(contributions) and all(
                a[0] == b[0] and a[1] is b[1] for a, b in zip(entry[3], contributions)) and entry[4] == tuple(sizes)
            if not same:
                self.failed.add(name)  # the blocks of one variable came from different pushes
            self.done[name].add(block)
            self._notify()

    def _notify(self) -> None:
        """Call the listeners (condition held)."""
        listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn()

    def listen(self, fn) -> None:
        """Call ``fn()`` (it must not block) at the next change of this speculation."""
        with self._cond:
            self._listeners.append(fn)

    def peek(self, name: str, block: int, push_done: bool):
        """The speculated new values of ``name``'s block once computed; None when they will
        not be (failed, abandoned, or this worker's push ended without them); else NOT_YET
        (``listen`` says when to look again)."""
        rows = self.layout[name][block]
        with self._cond:
            if name in self.failed:
                return None
            if block in self.done[name]:
                value = self.partial[name][0]
                return value if rows is None else value[rows[0]:rows[1]]
            if self.abandoned or (push_done and (name, block) not in self.computing):
                return None
            return NOT_YET

    def confirm(self, pushes: Sequence) -> dict[str, tuple[np.ndarray, dict]] | None:
        """{name: (value, state)} if every block of the round was speculated from exactly
        ``pushes`` (the round's, in worker-id order); else None."""
        if self.abandoned or not pushes:
            return None
        if any(set(p.gradients) != set(self.names) for p in pushes):
            return None
        sizes = tuple(p.batch_size for p in pushes)
        out = {}
        with self._cond:
            for name in self.names:
                entry = self.partial.get(name)
                if name in self.failed or entry is None or len(self.done[name]) != len(self.layout[name]):
                    return None
                value, slots, iterations, contributors, used_sizes = entry
                if used_sizes != sizes or len(contributors) != len(pushes) or any(
                        w != p.worker_id or g is not p.gradients[name] for (w, g), p in zip(contributors, pushes)):
                    return None
                out[name] = (value, slots if iterations is _NO_COUNT else {**slots, "iterations": iterations})
        return out

    def settle(self, confirmed: bool) -> None:
        """The round ended: kept (``confirmed``) or not; tell every listener."""
        with self._cond:
            self.confirmed = confirmed
            self.abandoned = not confirmed
            self._notify()

    def wake(self) -> None:
        with self._cond:
            self._notify()
