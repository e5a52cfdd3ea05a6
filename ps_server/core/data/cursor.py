"""The cluster's data cursor: what each sync round trains on, and who computes which part.

    cursor = Cursor(num_examples=1437, global_batch_size=64, seed=0, micro_batches=4)
    work = cursor.round(r, live=[0, 1, 2])   # RoundWork: round r's micro-batches, dealt out
    work.assigned(1)                         # (2,): the micro-batches worker 1 computes
    work.indices(2)                          # their examples (ps_common.batches)
    work.receive(1, 2)                       # worker 1's gradient of micro-batch 2 arrived
    work.lost(0)                             # worker 0 died: {2: (0, 1)}, who takes its rest
    work.complete                            # every micro-batch in
    ledger = EpochLedger(1437); ledger.fold(epoch, work.indices(m))   # each example once

Why: with a fixed number of workers each computes its own shard of every global
batch, so a dead worker's share is never trained on and a new one has nowhere
to fit. Here the sequence of global batches belongs to the cluster (the same
seeded sequence every worker computes, ``ps_common.batches``), and every global
batch is cut into ``micro_batches`` fixed, contiguous micro-batches. Who computes
a micro-batch changes nothing in its gradient (the same parameters, the same
examples), and the round's gradient is the exact weighted mean of the
micro-batches' gradients rounded once (``aggregation.RoundSum``, one contribution
per micro-batch, weighted by its examples), whatever the order or the grouping
they arrive in. So a round's result is a function of the parameters and the
batch alone: a run whose workers are killed and added ends with the same bits
as the undisturbed run. (Float64 gradients, which ``RoundSum`` sums in the order
of its contribution keys, are keyed by micro-batch, so the same holds.)

**Dealing.** Round ``r``'s micro-batches go to the workers live at its start,
in id order, as contiguous groups (``np.array_split``): with as many workers
as micro-batches each computes one, which is the shard it computes today. An
empty micro-batch (a last batch of an epoch smaller than ``micro_batches``) is
done from the start. A worker lost in the middle of the round gives back the
micro-batches it had not delivered: they are dealt, one by one, to the live
workers with the fewest outstanding (ties: the lower id); a round left with no
live worker keeps them unowned until one ``joins``. A worker that joins takes
part from the next round on, or at once when the round has unowned work.

**Counting.** ``EpochLedger`` marks every example folded into a completed
round, per epoch, and refuses one marked twice: "every example exactly once per
epoch" is checked by the server, not assumed.

Pure Python and NumPy: no gRPC, no TensorFlow. The modes wire it in.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Iterable, Sequence

import numpy as np

import ps_common.batches as batches
from ps_server.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class DataPlan:
    """What the server must know of the job's data to deal its rounds (the chief sends it).
    Async and ssp: ``global_batch_size`` is each task's batch (one push's examples) and
    ``epochs`` how many passes the job makes (``core.data.tasks``; with ``tasks``, its tasks, the
    last pass cut short: Keras' ``steps_per_epoch``); elastic sync's rounds go on while workers
    ask (``epochs`` 0), ``applies`` rounds each global batch (``Cursor``)."""

    num_examples: int
    global_batch_size: int
    seed: int
    epochs: int = 0
    tasks: int = 0
    applies: int = 1


@dataclasses.dataclass(frozen=True)
class Cursor:
    """The job's sequence of global batches, each cut into ``micro_batches`` parts, each the
    batch of ``applies`` rounds in a row: a step that makes that many updates, one a round
    (``tfps.keras``: a GAN's ``train_step`` applies two optimizers, the second on the first's
    update of the whole batch). A batch's examples count in its epoch at its last round."""

    num_examples: int
    global_batch_size: int
    seed: int
    micro_batches: int
    applies: int = 1

    def __post_init__(self) -> None:
        if self.num_examples < 1:
            raise InvalidArgument(f"the dataset needs at least 1 example, got {self.num_examples}")
        if self.global_batch_size < 1:
            raise InvalidArgument(f"the global batch size must be >= 1, got {self.global_batch_size}")
        if self.micro_batches < 1:
            raise InvalidArgument(f"a global batch is cut into at least 1 micro-batch, got {self.micro_batches}")
        if self.applies < 1:
            raise InvalidArgument(f"a global batch is at least 1 round, got {self.applies}")

    @property
    def steps_per_epoch(self) -> int:
        return batches.steps_per_epoch(self.num_examples, self.global_batch_size)

    def epoch_of(self, round_: int) -> int:
        return round_ // self.applies // self.steps_per_epoch

    def counts(self, round_: int) -> bool:
        """Whether round ``round_`` is its batch's last: its examples then count in the epoch."""
        return round_ % self.applies == self.applies - 1

    def parts(self, round_: int) -> list[np.ndarray]:
        """Round ``round_``'s micro-batches: example indices, in order; together its global batch."""
        batch = batches.global_batch(self.num_examples, self.global_batch_size, self.seed, round_ // self.applies)
        return batches.micro_batches(batch, self.micro_batches)

    def round(self, round_: int, live: Iterable[int]) -> "RoundWork":
        return RoundWork(self, round_, live)


class RoundWork:
    """One sync round's micro-batches: who computes each, and which have arrived.

    Thread-safe (one leaf lock); the mode calls it under its own lock anyway."""

    def __init__(self, cursor: Cursor, round_: int, live: Iterable[int]):
        if round_ < 0:
            raise InvalidArgument(f"round must be >= 0, got {round_}")
        self.cursor, self.round = cursor, round_
        self.epoch = cursor.epoch_of(round_)
        self._parts = cursor.parts(round_)
        self._lock = threading.Lock()
        self._live = sorted(set(live))
        self._owner: dict[int, int | None] = {}  # micro-batch -> worker computing it (None: unowned)
        self._received: set[int] = {m for m, p in enumerate(self._parts) if len(p) == 0}
        todo = [m for m in range(len(self._parts)) if m not in self._received]
        if self._live:
            for worker, group in zip(self._live, np.array_split(np.arange(len(self._parts)), len(self._live))):
                for m in group.tolist():
                    if m not in self._received:
                        self._owner[m] = worker
        else:
            self._owner = {m: None for m in todo}

    # -- what the workers are told -------------------------------------------------
    def indices(self, micro: int) -> np.ndarray:
        self._check_micro(micro)
        return self._parts[micro]

    def size(self, micro: int) -> int:
        return len(self.indices(micro))

    def assigned(self, worker_id: int) -> tuple[int, ...]:
        """The micro-batches ``worker_id`` is to compute and has not delivered, in order."""
        with self._lock:
            return tuple(sorted(m for m, w in self._owner.items() if w == worker_id and m not in self._received))

    def owner(self, micro: int) -> int | None:
        self._check_micro(micro)
        with self._lock:
            return self._owner.get(micro)

    @property
    def live(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._live)

    # -- what happens --------------------------------------------------------------
    def receive(self, worker_id: int, micro: int, dealt_elsewhere: bool = False) -> bool:
        """``worker_id`` delivered micro-batch ``micro``'s gradient: True when it is new (to
        fold), False when that micro-batch is already in (a repeat: answer it, fold nothing).
        A worker may deliver only what it was dealt; ``dealt_elsewhere`` (a shard that does
        not deal: another shard did) takes it from any worker."""
        self._check_micro(micro)
        with self._lock:
            if micro in self._received:
                return False
            owner = self._owner.get(micro)
            if owner != worker_id and not dealt_elsewhere:
                holder = "nobody yet" if owner is None else f"worker {owner}"
                raise InvalidArgument(f"round {self.round}: micro-batch {micro} was dealt to {holder}, "
                                      f"not to worker {worker_id}")
            self._received.add(micro)
            return True

    @property
    def complete(self) -> bool:
        with self._lock:
            return len(self._received) == len(self._parts)

    @property
    def outstanding(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(m for m in range(len(self._parts)) if m not in self._received)

    def lost(self, worker_id: int) -> dict[int, tuple[int, ...]]:
        """``worker_id`` is gone: what it had not delivered is dealt to the live workers with
        the fewest outstanding (ties: the lower id). Returns each receiver's new micro-batches
        (empty when nothing moved or nobody is left to take them)."""
        with self._lock:
            if worker_id not in self._live:
                return {}
            self._live.remove(worker_id)
            orphans = sorted(m for m, w in self._owner.items() if w == worker_id and m not in self._received)
            for m in orphans:
                self._owner[m] = None
            return self._deal(orphans)

    def join(self, worker_id: int) -> dict[int, tuple[int, ...]]:
        """``worker_id`` takes part: it computes unowned micro-batches of this round, if any
        (a round whose every worker was lost); otherwise it waits for the next round."""
        with self._lock:
            if worker_id not in self._live:
                self._live.append(worker_id)
                self._live.sort()
            orphans = sorted(m for m, w in self._owner.items() if w is None and m not in self._received)
            return self._deal(orphans)

    def _deal(self, orphans: Sequence[int]) -> dict[int, tuple[int, ...]]:
        if not orphans or not self._live:
            return {}
        load = {w: 0 for w in self._live}
        for m, w in self._owner.items():
            if w in load and m not in self._received:
                load[w] += 1
        given: dict[int, list[int]] = {}
        for m in orphans:
            w = min(self._live, key=lambda x: (load[x], x))
            self._owner[m] = w
            load[w] += 1
            given.setdefault(w, []).append(m)
        return {w: tuple(ms) for w, ms in given.items()}

    def _check_micro(self, micro: int) -> None:
        if not 0 <= micro < len(self._parts):
            raise InvalidArgument(f"round {self.round} has micro-batches 0..{len(self._parts) - 1}, "
                                  f"not {micro}")


class EpochLedger:
    """Which examples each epoch trained on, each at most once: elastic sync's completed
    rounds, and the task queue's applied tasks (``core.data.tasks``). An epoch's bitmap is kept
    while it is in progress; a complete one is only listed."""

    def __init__(self, num_examples: int):
        if num_examples < 1:
            raise InvalidArgument(f"the dataset needs at least 1 example, got {num_examples}")
        self.num_examples = num_examples
        self._lock = threading.Lock()
        self._seen: dict[int, np.ndarray] = {}  # epoch in progress -> one bool per example
        self._counts: dict[int, int] = {}  # epoch in progress -> its examples marked
        self._complete: set[int] = set()

    def fold(self, epoch: int, indices: np.ndarray) -> None:
        """Mark ``indices`` as trained on in ``epoch``; InvalidArgument (nothing marked) if
        any already was, or is not an example."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.num_examples):
            raise InvalidArgument(f"epoch {epoch}: example indices must lie in 0..{self.num_examples - 1}")
        with self._lock:
            if epoch in self._complete:
                seen = np.ones(self.num_examples, bool)
            else:
                seen = self._seen.get(epoch, None)
                if seen is None:
                    seen = np.zeros(self.num_examples, bool)
            if np.unique(indices).size != indices.size or seen[indices].any():
                twice = np.union1d(indices[seen[indices]], _repeated(indices))
                raise InvalidArgument(f"epoch {epoch}: example(s) {twice[:5].tolist()} would be trained on twice")
            seen[indices] = True
            count = self._counts.get(epoch, 0) + indices.size
            if count == self.num_examples:
                self._seen.pop(epoch, None)
                self._counts.pop(epoch, None)
                self._complete.add(epoch)
            else:
                self._seen[epoch], self._counts[epoch] = seen, count

    def count(self, epoch: int) -> int:
        """Examples trained on in ``epoch`` so far."""
        with self._lock:
            return self.num_examples if epoch in self._complete else self._counts.get(epoch, 0)

    def complete(self, epoch: int) -> bool:
        return self.count(epoch) == self.num_examples

    def epochs(self) -> list[int]:
        with self._lock:
            return sorted({*self._seen, *self._complete})

    def counts(self) -> tuple[int, ...]:
        """Each epoch's examples so far, from epoch 0 to the newest one with any: a later epoch
        complete while an earlier one is not (async's returned tasks) is shown too."""
        epochs = self.epochs()
        return tuple(self.count(e) for e in range(epochs[-1] + 1)) if epochs else ()

    # -- checkpoints -----------------------------------------------------------------
    def state(self) -> tuple[tuple[int, ...], dict[int, np.ndarray]]:
        """(complete epochs, {epoch in progress: its bitmap packed, ``np.packbits``}), for a
        checkpoint (``checkpoint.DataState``): one bit per example of an epoch in progress."""
        with self._lock:
            return tuple(sorted(self._complete)), {e: np.packbits(s) for e, s in sorted(self._seen.items())}

    @classmethod
    def restore(cls, num_examples: int, complete, seen) -> "EpochLedger":
        """The ledger ``state`` describes; InvalidArgument if it does not fit ``num_examples``."""
        ledger = cls(num_examples)
        ledger._complete = {int(e) for e in complete}
        for e, packed in seen.items():
            packed = np.asarray(packed, np.uint8).reshape(-1)
            if packed.size != -(-num_examples // 8) or int(e) in ledger._complete or int(e) < 0:
                raise InvalidArgument(f"epoch {e}'s bitmap holds {packed.size} bytes; {num_examples} examples "
                                      f"take {-(-num_examples // 8)} (or the epoch is also listed complete)")
            bits = np.unpackbits(packed, count=num_examples).astype(bool)
            if np.unpackbits(packed)[num_examples:].any():
                raise InvalidArgument(f"epoch {e}'s bitmap has bits set past example {num_examples - 1}")
            if bits.all():
                ledger._complete.add(int(e))
            elif bits.any():
                ledger._seen[int(e)], ledger._counts[int(e)] = bits, int(bits.sum())
        return ledger


def _repeated(indices: np.ndarray) -> np.ndarray:
    values, counts = np.unique(indices, return_counts=True)
    return values[counts > 1]
