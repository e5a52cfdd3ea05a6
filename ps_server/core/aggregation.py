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

Speed: the sum runs block by block (``BLOCK_BYTES`` of the result at a time),
every worker's term added into one block before the next, into one fresh
output array and one block-sized scratch buffer. A block of the sum stays in
cache while the workers' gradients stream through it once, so a round reads
each gradient once and writes the result once, with no full-size temporaries.
Each element still sees exactly the operations above, in the same order, so
the result is bit-identical to the plain ``g0*w0 + g1*w1 + ...``
(``bench/server.py`` measures it against NumPy's own ``acc += g``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ps_server.core.errors import InvalidArgument

Contribution = tuple[int, Mapping[str, np.ndarray]]  # (batch_size, gradients by name)

# A block of the sum plus a block of scratch fit in a core's L2 cache (1 MiB on
# the machine of BENCHMARKS.md); 256 KiB was the fastest of 32 KiB .. 512 KiB there.
BLOCK_BYTES = 256 * 2**10


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
    return {name: _weighted_sum([grads[name] for _, grads in contributions], weights)
            for name in contributions[0][1]}


def _weighted_sum(grads: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """sum_i grads[i] * weights[i], each product and each sum rounded to the gradients' dtype."""
    dtype = grads[0].dtype.newbyteorder("=")  # results in native byte order, whatever the wire's
    scales = [np.asarray(w, dtype=dtype) for w in weights]
    out = np.empty(grads[0].shape, dtype)  # an ndarray even for 0-d variables
    acc = out.reshape(-1)  # a view: out is fresh and contiguous
    flat = [g.reshape(-1) for g in grads]
    block = max(1, BLOCK_BYTES // dtype.itemsize)
    scratch = np.empty(min(block, acc.size), dtype)
    for start in range(0, acc.size, block):
        stop = min(start + block, acc.size)
        a, term = acc[start:stop], scratch[: stop - start]
        np.multiply(flat[0][start:stop], scales[0], out=a)
        for g, scale in zip(flat[1:], scales[1:]):
            np.multiply(g[start:stop], scale, out=term)
            np.add(a, term, out=a)
    return out


def weighted_loss(losses: Sequence[float], batch_sizes: Sequence[int]) -> float:
    return float(sum(w * l for w, l in zip(batch_weights(batch_sizes), losses)))


# -- a round's metrics ---------------------------------------------------------------
#
# A push may carry small tensors besides its gradients: the change a Keras model's
# metric variables made during the worker's step. A sync round sums them, so that
# every participant can add the same round total to its own metric state.

MetricSpec = dict[str, tuple[np.dtype, tuple[int, ...]]]


def metric_spec(metrics: Mapping[str, np.ndarray]) -> MetricSpec:
    """name -> (native dtype, shape): what every push of a round must agree on."""
    return {name: (a.dtype.newbyteorder("="), tuple(a.shape)) for name, a in metrics.items()}


def metric_difference(mine: MetricSpec, theirs: MetricSpec) -> str | None:
    """One line naming how ``theirs`` differs from ``mine``; None when they are alike."""
    if mine == theirs:
        return None
    if not mine or not theirs:
        return "carries no metrics" if not theirs else f"carries metrics ({', '.join(sorted(theirs)[:4])})"
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing:
        return f"lacks metric(s) {', '.join(map(repr, missing[:4]))}"
    if extra:
        return f"has extra metric(s) {', '.join(map(repr, extra[:4]))}"
    name = next(n for n in sorted(mine) if mine[n] != theirs[n])
    return (f"has metric {name!r} as {theirs[name][0]}{list(theirs[name][1])}, "
            f"not {mine[name][0]}{list(mine[name][1])}")


def sum_metrics(metrics: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Element-wise sums, in the order given (worker-id order) and in each tensor's own
    dtype: the first push's tensor, plus the second's, plus the third's..., each sum
    rounded to the dtype. No float64 accumulation, so anyone can reproduce the bits.
    The results are fresh read-only arrays in native byte order. Every mapping must
    have the same names, shapes and dtypes (``metric_difference``)."""
    if not metrics or not metrics[0]:
        return {}
    out = {}
    for name in sorted(metrics[0]):
        first = metrics[0][name]
        acc = np.array(first, dtype=first.dtype.newbyteorder("="), copy=True)  # 0-d stays an array
        for m in metrics[1:]:
            np.add(acc, m[name], out=acc)
        acc.flags.writeable = False
        out[name] = acc
    return out
