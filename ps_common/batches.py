"""The sequence of batches a job trains on: plain NumPy, the same in every process.

    order = epoch_order(1437, seed=0, epoch=2)          # a seeded shuffle of the examples
    batch = global_batch(1437, 64, seed=0, step=30)     # the examples of global step 30
    for batch in global_batches(1437, 64, epochs=3, seed=0): ...
    mine = shard(batch, worker_index=1, num_workers=2)  # a worker's contiguous part
    parts = micro_batches(batch, 8)                     # the batch cut into 8 fixed parts

Every process computes the same index arrays from (number of examples, batch
size, seed): each epoch is a permutation drawn from ``default_rng([seed,
epoch])``, cut into consecutive global batches of ``global_batch_size`` (the
last one of an epoch smaller when the size does not divide). ``shard`` and
``micro_batches`` cut a batch into contiguous parts, the first ones one example
longer when it does not divide (``np.array_split``, as MirroredStrategy splits a
batch), so the parts in order are exactly the batch.

Shared by the workers (``worker.data``), which read their examples, and the
server's core (``ps_server.core.data.cursor``), which decides who computes which part
of a round when workers come and go.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    _check_size(global_batch_size)
    return math.ceil(num_examples / global_batch_size)


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The examples of ``epoch`` in the order its batches take them."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def global_batch(num_examples: int, global_batch_size: int, seed: int, step: int,
                 order: np.ndarray | None = None) -> np.ndarray:
    """The example indices of global ``step`` (counted from 0 over every epoch); ``order``:
    that step's ``epoch_order``, when the caller keeps it."""
    if num_examples < 1:
        raise ValueError(f"a dataset needs at least 1 example, got {num_examples}")
    per_epoch = steps_per_epoch(num_examples, global_batch_size)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    epoch, index = divmod(step, per_epoch)
    if order is None:
        order = epoch_order(num_examples, seed, epoch)
    return order[index * global_batch_size:(index + 1) * global_batch_size]


def global_batches(num_examples: int, global_batch_size: int, epochs: int, seed: int) -> Iterator[np.ndarray]:
    """Index arrays of every global batch, epoch after epoch; identical in every process."""
    _check_size(global_batch_size)
    for epoch in range(epochs):
        order = epoch_order(num_examples, seed, epoch)
        for start in range(0, num_examples, global_batch_size):
            yield order[start:start + global_batch_size]


def shard(batch: np.ndarray, worker_index: int, num_workers: int) -> np.ndarray:
    """This worker's contiguous part of a global batch (may be empty if the batch is tiny)."""
    return np.array_split(batch, num_workers)[worker_index]


def micro_batches(batch: np.ndarray, parts: int) -> list[np.ndarray]:
    """``batch`` cut into ``parts`` contiguous micro-batches (empty ones when it is smaller)."""
    if parts < 1:
        raise ValueError(f"a batch is cut into at least 1 micro-batch, got {parts}")
    return np.array_split(batch, parts)


def _check_size(global_batch_size: int) -> None:
    if global_batch_size < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
