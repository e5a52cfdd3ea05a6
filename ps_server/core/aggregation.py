"""How a sync round combines the workers' gradients.

    mean = weighted_mean([(batch_size, grads), ...])   # in worker-id order

Each worker pushes the mean gradient over its own examples; the round's
gradient is the batch-weighted mean, sum_i (b_i / B) * g_i with B = sum_i b_i.
That equals the mean over the whole global batch, so uneven shards (the last
batch of an epoch) are weighted right. It is also what TensorFlow's
MirroredStrategy computes with ``tf.nn.compute_average_loss(global_batch_size=B)``
and summed replica gradients.

The float operations are fixed so that anyone can reproduce them bit for bit:
weights are computed in float64 and cast to the gradient's dtype, each gradient is
multiplied by its weight in that dtype, and the products are added in
worker-id order starting from the first product. The reference runner in
``tf_strategies`` calls this same function.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ps_server.core.errors import InvalidArgument

Contribution = tuple[int, Mapping[str, np.ndarray]]  # (batch_size, gradients by name)


def batch_weights(batch_sizes: Sequence[int]) -> list[float]:
    total = sum(batch_sizes)
    if total <= 0:
        raise InvalidArgument(f"a round needs at least one example, got batch sizes {list(batch_sizes)}")
    return [b / total for b in batch_sizes]


def weighted_mean(contributions: Sequence[Contribution]) -> dict[str, np.ndarray]:
    """Batch-weighted mean of per-worker mean gradients, in the order given."""
    if not contributions:
        raise InvalidArgument("a round needs at least one contribution")
    weights = batch_weights([b for b, _ in contributions])
    names = list(contributions[0][1])
    out: dict[str, np.ndarray] = {}
    for name in names:
        acc = None
        for w, (_, grads) in zip(weights, contributions):
            g = grads[name]
            term = g * np.asarray(w, dtype=g.dtype)
            acc = term if acc is None else acc + term
        out[name] = np.asarray(acc)  # NumPy turns 0-d results into scalars; keep an ndarray
    return out


def weighted_loss(losses: Sequence[float], batch_sizes: Sequence[int]) -> float:
    return float(sum(w * l for w, l in zip(batch_weights(batch_sizes), losses)))
