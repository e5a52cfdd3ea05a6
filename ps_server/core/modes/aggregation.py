"""How a sync round combines the workers' gradients.

    total = RoundSum(hold=holds(push_bytes(grads), num_workers))
    total.add(worker_id, batch_size, grads)   # as each push arrives, in any order
    mean = total.mean()                       # {name: array}: the round's gradient
    mean = weighted_mean([(batch_size, grads), ...])   # the same, all at once

Each worker pushes the mean gradient over its own examples; the round's
gradient is the batch-weighted mean, sum_i b_i * g_i / B with B = sum_i b_i.
That equals the mean over the whole global batch, so uneven shards (the last
batch of an epoch) are weighted right. It is also what TensorFlow's
MirroredStrategy computes with ``tf.nn.compute_average_loss(global_batch_size=B)``
and summed replica gradients.

Either way a round's bits are a function of its pushes alone, not of the order
they arrive in (elastic training and restarts depend on it). Two rules, by
memory (``holds``):

- **Held** (the round's pushes take at most ``HELD_BYTES`` together: every model
  that fits one machine's memory many times over): every push is kept whole and
  the round's gradient is ``g_0*w_0 + g_1*w_1 + ...`` in key order (worker id),
  ``w_i = b_i / B`` rounded to the dtype, each
  product and sum rounded to the dtype: NumPy's own speed, two passes per push
  (``bench/server.py``). With two equal shards it is ``(g0 + g1) / 2`` rounded
  once (halving is exact), which is what MirroredStrategy's two replicas give:
  the parity gate's bit-identity holds.
- **Folded** (beyond ``HELD_BYTES``: a thousand workers, or tables of millions of
  rows), for float16 and float32 gradients: **the exact weighted mean, rounded
  once** to the gradients' dtype (round to nearest, ties to even). Each push is
  folded into it as it comes (``RoundSum.add``) and let go, so a round holds one
  accumulator per variable: memory does not grow with the number of workers. It
  costs about ten float64 operations per element and push (``_Exact``), 0.07-0.20
  of NumPy's ``acc += g`` (``bench/server.py``: a TwoSum pass is bound by its operations). Elastic sync always folds (keyed by micro-batch): its
  workers go on to their next micro-batch while the round still collects.

How it stays exact: every ``b_i * g_i`` is exact in float64 (a 24-bit significand
times a batch size below 2**29; a larger batch size is split into such pieces),
the accumulator is float64, and each addition's rounding error is recovered
exactly (Knuth's TwoSum) and added to a second float64 level, made only when
some element needs it, whose own errors go to a third, and so on (``_Exact``):
the levels add up to the exact sum. At the end the division by ``B`` and the
rounding are done in float64 and checked: only elements whose quotient lies
within a few units in the last place of a midpoint between two float32 values
can round wrong, and those are recomputed with exact rationals.

Float64 gradients cannot be made exact this way: a round always holds them (memory
grows with the workers) and sums them by the held rule.

Speed: the fold runs block by block (``BLOCK_BYTES`` of the accumulator at a
time, in cache while the ~10 operations of a TwoSum run over it);
``bench/server.py`` measures it against NumPy's own ``acc += g``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable, Mapping, Sequence

import numpy as np

from ps_server.core.optim import kernels
from ps_server.core.errors import InvalidArgument

Contribution = tuple[int, Mapping[str, np.ndarray]]  # (batch_size, gradients by name)

# A block of the accumulator plus its scratch fit in a core's L2 cache (1 MiB on
# the machine of BENCHMARKS.md).
BLOCK_BYTES = 256 * 2**10
_BLOCK = BLOCK_BYTES // 8  # float64 elements per block
_EXACT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
# A sync round holds its pushes whole while all of them take at most this many bytes, and
# sums them in key order at its end (``holds``); beyond, it folds them exactly on arrival.
HELD_BYTES = 256 << 20
# b * g is exact in float64 while b < 2**(53 - significand bits of g); float16 has 11, float32 24.
_PIECE_BITS = {np.dtype(np.float16): 42, np.dtype(np.float32): 29}


def batch_weights(batch_sizes: Sequence[int]) -> list[float]:
    total = sum(batch_sizes)
    if total <= 0:
        raise InvalidArgument(f"a round needs at least one example, got batch sizes {list(batch_sizes)}")
    return [b / total for b in batch_sizes]


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth's TwoSum), elementwise."""
    s = a + b
    bp = s - a
    e = (a - (s - bp)) + (b - bp)
    return s, e


def _approximate(terms: list[np.ndarray]):
    """(s, alone, magnitude): s the float64 sum of the levels ``terms`` (Neumaier's
    compensated sum: within a few units in the last place of the exact one unless they
    cancel), ``alone`` where every level but the first is zero (s is then exact), and
    ``magnitude`` the sum of their absolute values; None, None for one level.

    The lower levels are sparse (an element has a remainder only where its terms span
    more than ~29 bits), so the sum runs over the elements that have one (and the
    non-finite ones, which it turns to NaN); elsewhere s is the first level itself,
    the same bits the sum over every element gives there (adding zeros to a finite
    float64 that is never -0.0: the accumulator starts at +0.0)."""
    if len(terms) == 1:
        return terms[0], None, None
    first, lower = terms[0], terms[1:]
    some = ~np.isfinite(first)
    for t in lower:
        some |= t != 0
    idx = np.flatnonzero(some)
    s, magnitude = first.copy(), np.abs(first)
    alone = ~some
    if idx.size:
        part = first[idx]
        c = np.zeros_like(part)
        for t in lower:
            ti = t[idx]
            s2 = part + ti
            c += np.where(np.abs(part) >= np.abs(ti), (part - s2) + ti, (ti - s2) + part)
            part = s2
            magnitude[idx] += np.abs(ti)
        s[idx] = part + c
    return s, alone, magnitude


class _Exact:
    """The exact sum of ``b * g`` over the pushes of one variable (float16/float32).

    Levels of float64, each the sum of the exact remainders of the additions of the one
    above (TwoSum), made when first needed: ``levels[0]`` the sum itself, ``levels[1]``
    its remainders (only where terms of an element span more than ~29 bits), and so on.
    The exact sum is the sum of the levels, whatever the order of the pushes. Every term
    is a multiple of the same power of two and each level is at most half a unit in the
    last place of the one above, so a level below the seventh is never needed for float32
    products (a range of ~310 bits; 7 x 53 > 310)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape, self.dtype = shape, dtype
        size = int(np.prod(shape, dtype=np.int64))
        self.hi = np.zeros(size, np.float64)
        self.levels: list[np.ndarray] = [self.hi]
        self.fresh = True  # nothing folded yet: the first product is the sum itself

    def add(self, g: np.ndarray, b: int) -> None:
        flat = g.reshape(-1)
        bits = _PIECE_BITS[self.dtype]
        pieces, shift = [], 0
        while b:  # b = sum piece * 2**shift, each piece small enough for an exact product
            piece = b & ((1 << bits) - 1)
            if piece:
                pieces.append(float(piece) * 2.0 ** shift)
            b >>= bits
            shift += bits
        n = min(_BLOCK, self.hi.size)
        x, s, t = np.empty(n), np.empty(n), np.empty(n)
        with np.errstate(invalid="ignore", over="ignore"):  # inf and NaN stay what they are
            self._fold(flat, pieces, x, s, t)

    def _remainders(self, idx: np.ndarray, e: np.ndarray, level: int = 1) -> None:
        """Add the exact remainders ``e`` (finite, non-zero) of level ``level - 1``'s additions
        at flat ``idx`` (distinct) to level ``level``, and its own remainders further down."""
        if level == len(self.levels):
            self.levels.append(np.zeros(self.hi.size, np.float64))
        target = self.levels[level]
        s2, e2 = _two_sum(target[idx], e)
        target[idx] = s2
        nz = np.flatnonzero(e2)
        if nz.size:
            self._remainders(idx[nz], e2[nz], level + 1)

    def _fold(self, flat, pieces, x, s, t) -> None:
        if self.fresh and pieces:  # into zeros: every sum is exact, no remainder
            np.multiply(flat, pieces[0], out=self.hi, dtype=np.float64)
            self.hi += 0.0  # as 0.0 + x: -0.0 becomes +0.0
            pieces = pieces[1:]
        self.fresh = False
        for piece in pieces:
            for start in range(0, self.hi.size, _BLOCK):
                stop = min(start + _BLOCK, self.hi.size)
                m = stop - start
                h, xb, sb, tb = self.hi[start:stop], x[:m], s[:m], t[:m]
                count = kernels.fold_exact(flat[start:stop], piece, self.hi, start, tb)
                if count is not None:  # the fused pass (core.optim.kernels): the same operations
                    if count:
                        self._kept(tb, start)
                    continue
                np.multiply(flat[start:stop], piece, out=xb, dtype=np.float64)  # exact
                np.add(h, xb, out=sb)  # s = h + x, rounded
                # TwoSum: e = (h - (s - (s - h))) + (x - (s - h)), exactly h + x - s
                np.subtract(sb, h, out=tb)  # bp = s - h
                np.subtract(xb, tb, out=xb)  # x - bp
                np.subtract(sb, tb, out=tb)  # s - bp
                np.subtract(h, tb, out=tb)  # h - (s - bp)
                np.add(tb, xb, out=tb)  # e
                h[...] = sb
                self._kept(tb, start)

    def _kept(self, e: np.ndarray, start: int) -> None:
        """A block's remainders ``e`` (from flat index ``start``): the non-zero finite ones go
        to the next level (an inf or NaN sum carries no remainder worth keeping)."""
        nz = np.flatnonzero(e)
        if nz.size:
            kept = e[nz]
            finite = np.isfinite(kept)
            if finite.any():
                self._remainders(nz[finite] + start, kept[finite].copy())

    def mean(self, total: int) -> np.ndarray:
        """The exact sum / ``total``, rounded once to the dtype."""
        dtype = self.dtype.newbyteorder("=")
        out = np.empty(self.hi.size, dtype)
        divisor = float(total)  # exact: total < 2**53
        uint = np.uint64
        # The float64 quotient q of hi (+ lo) is within 2 units in its last place of the exact
        # quotient (0.5 without lo). A rounding to the dtype can differ from the exact one only
        # where a midpoint between two neighbours of the dtype lies that close to q: the low
        # bits of q's significand then read 1000..0 give or take 3 (normal results; subnormal
        # ones are all checked). Those elements are recomputed exactly, unless q is the exact
        # quotient of an exact sum (a true tie, which q's own rounding breaks to even).
        low = 52 - (np.finfo(dtype).nmant)
        mask, half = uint((1 << low) - 1), np.int64(1 << (low - 1))
        slack = 0 if len(self.levels) == 1 else 4
        tiny = np.finfo(dtype).tiny
        power_of_two = total & (total - 1) == 0
        suspect = []
        for start in range(0, self.hi.size, _BLOCK):
            stop = min(start + _BLOCK, self.hi.size)
            terms = [level[start:stop] for level in self.levels]
            with np.errstate(invalid="ignore", over="ignore"):
                total_sum, rest, magnitude = _approximate(terms)
                q = total_sum / divisor
                out[start:stop] = q  # rounds to nearest, ties to even (float16: inf beyond 65504)
                pick = None
                if power_of_two:  # q is total_sum's exact quotient: only an inexact sum can round wrong
                    if rest is None:
                        continue
                    pick = np.flatnonzero(~rest)  # the elements with a lower level
                    q, total_sum, magnitude, rest = q[pick], total_sum[pick], magnitude[pick], rest[pick]
                near = np.abs((q.view(uint) & mask).astype(np.int64) - half) <= slack
                near |= (np.abs(q) < tiny) & (q != 0)
                if magnitude is not None:  # levels that cancel leave q no closer than their size
                    near |= magnitude > np.abs(total_sum) * 2.0 ** 20
                near &= np.isfinite(q)
            where = np.flatnonzero(near)
            if where.size:
                exact = np.ones(where.size, bool) if power_of_two else \
                    _exact_quotients(q[where], divisor, total_sum[where])
                if rest is not None:
                    exact &= rest[where]
                where = where[~exact]
            if where.size:
                suspect.append((where if pick is None else pick[where]) + start)
        for where in suspect:
            for i in where.tolist():
                parts = [float(level[i]) for level in self.levels]
                if all(np.isfinite(parts)):  # non-finite sums keep their float64 rounding
                    out[i] = _round_exact(sum(map(Fraction, parts), Fraction(0)) / total, dtype)
        return out.reshape(self.shape)


def _exact_quotients(q: np.ndarray, divisor: float, dividend: np.ndarray) -> np.ndarray:
    """Where ``q * divisor == dividend`` exactly (Dekker's product, error-free): there ``q``
    is the exact quotient and a tie is a true one."""
    product = q * divisor
    split = 134217729.0  # 2**27 + 1: Veltkamp's split into 26-bit halves
    qq, dd = q * split, divisor * split
    q_hi = qq - (qq - q)
    q_lo = q - q_hi
    d_hi = dd - (dd - divisor)
    d_lo = divisor - d_hi
    error = ((q_hi * d_hi - product) + q_hi * d_lo + q_lo * d_hi) + q_lo * d_lo
    return (product == dividend) & (error == 0)


def _round_exact(value: Fraction, dtype: np.dtype):
    """``value`` rounded to the nearest ``dtype`` number, ties to even."""
    q = float(value)  # correctly rounded to float64
    r = np.array(q).astype(dtype)[()]
    if float(r) == q or value == Fraction(q):
        return r  # q exact, or representable in dtype (then nearest to value too)
    # q lies between two neighbours a < q < b of the dtype, one of them r
    a = r if float(r) < q else np.nextafter(r, np.array(-np.inf, dtype))
    b = r if float(r) > q else np.nextafter(r, np.array(np.inf, dtype))
    if Fraction(float(a)) + Fraction(float(b)) != 2 * Fraction(q):
        return r  # q is no midpoint: rounding to float64 cannot have crossed one
    return b if value > Fraction(q) else a  # q is the midpoint; value lies strictly beyond it


class RoundSum:
    """One sync round's gradient, folded as its pushes arrive (module docstring).

    ``add`` takes each push once (the caller keeps duplicates out); ``mean`` gives the
    batch-weighted mean by the rule above whatever order the pushes came in. Every push
    must carry the same names, shapes and dtypes (the store checks them first).
    Not thread-safe: the sync barrier's lock serializes it."""

    def __init__(self, sparse_rule: "str | Callable[[], str]" = "sum", hold: bool = False) -> None:
        """``sparse_rule`` (``--sparse-rule``; or a function that gives it when a round is
        folded, the store's, decided at initialization): "sum" folds sparse pushes into the
        mean of their summed rows; "keras" keeps every occurrence (``_concatenated``).
        ``hold``: keep every push and give their weighted sum in key order (``holds``); else
        fold float16 and float32 pushes exactly on arrival. Set before the first ``add``."""
        self._rule = sparse_rule
        self.hold = hold
        self._exact: dict[str, _Exact] = {}
        self._held: dict[str, list[tuple[int, int, np.ndarray]]] = {}  # float64: (worker, b, g)
        # Sparse gradients (ps_common.sparse.SparseRows, an embedding's rows stepped row-wise):
        # kept as they came, (worker, b, g), a push's few rows, and folded at ``mean``.
        self._rows: dict[str, list[tuple[int, int, object]]] = {}
        self._names: set[str] = set()
        self._sparse_means: dict = {}
        self.total = 0
        self.count = 0

    @property
    def sparse_rule(self) -> str:
        return self._rule() if callable(self._rule) else self._rule

    @property
    def names(self) -> frozenset[str]:
        """The variables the round's pushes carry (every push the same)."""
        return frozenset(self._names)

    def add(self, worker_id: int, batch_size: int, gradients: Mapping[str, np.ndarray]) -> None:
        if self.count and set(gradients) != self._names:
            raise InvalidArgument("every push of a round carries the same variables")
        self._names = set(gradients)
        for name, g in gradients.items():
            if not isinstance(g, np.ndarray):  # SparseRows
                self._rows.setdefault(name, []).append((worker_id, batch_size, g))
                continue
            dtype = g.dtype.newbyteorder("=")
            if dtype in _EXACT_DTYPES and not self.hold:
                acc = self._exact.get(name)
                if acc is None:
                    acc = self._exact[name] = _Exact(g.shape, dtype)
                if batch_size:
                    acc.add(g, batch_size)
                elif not np.isfinite(g).all():  # 0 * inf is NaN, as in the weighted sum
                    acc.add(np.where(np.isfinite(g), 0, np.nan).astype(dtype), 1)
            else:
                self._held.setdefault(name, []).append((worker_id, batch_size, g))
        self.total += batch_size
        self.count += 1

    def mean(self) -> dict[str, np.ndarray]:
        if not self.count:
            raise InvalidArgument("a round needs at least one contribution")
        if self.total <= 0:
            raise InvalidArgument(f"a round needs at least one example, got a total batch size of {self.total}")
        for name, held in self._rows.items():
            self._fold_rows(name, held)
        out = {name: acc.mean(self.total) for name, acc in self._exact.items()}
        out.update(self._sparse_means)
        for name, held in self._held.items():
            held = sorted(held, key=lambda x: x[0])
            out[name] = _weighted_sum([g for _, _, g in held], batch_weights([b for _, b, _ in held]))
        return out


    def _fold_rows(self, name: str, held: list) -> None:
        """Sparse pushes of ``name``: made dense into its accumulator when some push of the
        round was dense, else their exact mean over the union of their rows, a SparseRows
        whose rows hold the bits of the dense mean's (rows of zeros elsewhere)."""
        from ps_common.sparse import SparseRows
        from ps_server.core.optim import sparse

        if name in self._exact or name in self._held:
            like = self._exact[name] if name in self._exact else None
            for worker, b, g in held:
                shape = like.shape if like is not None else self._held[name][0][2].shape
                dtype = like.dtype if like is not None else self._held[name][0][2].dtype
                self.add_dense(worker, b, name, sparse.densify(g, shape, dtype))
            return
        if self.sparse_rule == "keras":
            self._sparse_means = {**self._sparse_means, name: self._concatenated(held)}
            return
        combined = [(worker, b, *sparse.combine(g)) for worker, b, g in held]
        union = np.unique(np.concatenate([rows for _, _, rows, _ in combined]))
        values = combined[0][3]
        dtype = values.dtype.newbyteorder("=")
        shape = (len(union),) + values.shape[1:]
        if dtype in _EXACT_DTYPES and not self.hold:
            acc = _Exact(shape, dtype)
            for _, b, rows, v in combined:
                full = np.zeros(shape, dtype)
                full[np.searchsorted(union, rows)] = v
                if b:
                    acc.add(full, b)
            mean = acc.mean(self.total)
        else:
            ordered = sorted(combined, key=lambda c: c[0])
            shaped = []
            for _, _, rows, v in ordered:
                full = np.zeros(shape, dtype)
                full[np.searchsorted(union, rows)] = v
                shaped.append(full)
            mean = _weighted_sum(shaped, batch_weights([b for _, b, _, _ in ordered]))
        self._sparse_means = {**self._sparse_means, name: SparseRows(union, mean)}

    def _concatenated(self, held: list):
        """``--sparse-rule keras``: the round's gradient as the ``IndexedSlices`` of one step on
        the global batch, whose examples are the workers' shards in worker-id order: every
        push's occurrences in worker-id order, each value scaled by its push's batch weight
        (``b * g / B``, exact and rounded once, as the dense mean; float64: ``g * (b / B)``).
        A push of no examples adds none."""
        from ps_common.sparse import SparseRows

        rows, values = [], []
        for _, b, g in sorted(held, key=lambda x: x[0]):
            if not b:
                continue
            v = g.values.astype(g.values.dtype.newbyteorder("="), copy=False)
            if v.dtype in _EXACT_DTYPES:
                acc = _Exact(v.shape, v.dtype)
                acc.add(v, b)
                v = acc.mean(self.total)
            else:
                v = _weighted_sum([v], [b / self.total])
            rows.append(np.asarray(g.rows, dtype=np.int64))
            values.append(v)
        g = held[0][2]
        if not rows:
            return SparseRows(np.zeros(0, np.int64), g.values[:0])
        return SparseRows(np.concatenate(rows), np.concatenate(values))

    def add_dense(self, worker_id: int, batch_size: int, name: str, g: np.ndarray) -> None:
        """One variable's dense gradient of a push already counted (``add``)."""
        dtype = g.dtype.newbyteorder("=")
        if dtype in _EXACT_DTYPES and not self.hold:
            if batch_size:
                self._exact[name].add(g, batch_size)
        else:
            self._held[name].append((worker_id, batch_size, g))


def weighted_mean(contributions: Sequence[Contribution]) -> dict[str, np.ndarray]:
    """Batch-weighted mean of per-worker mean gradients, as a sync round of these pushes gives
    it (``RoundSum``, held while they fit ``HELD_BYTES``; the order given is worker-id order)."""
    if not contributions:
        raise InvalidArgument("a round needs at least one contribution")
    if sum(b for b, _ in contributions) <= 0:
        raise InvalidArgument(f"a round needs at least one example, got batch sizes {[b for b, _ in contributions]}")
    total = RoundSum(hold=holds(push_bytes(contributions[0][1]), len(contributions)))
    for worker, (b, grads) in enumerate(contributions):
        total.add(worker, b, grads)
    return total.mean()


def holds(nbytes: int, pushes: int) -> bool:
    """Whether a round of ``pushes`` pushes of ``nbytes`` each is held whole and summed in key
    order (module docstring), rather than folded exactly on arrival."""
    return nbytes * pushes <= HELD_BYTES


def push_bytes(gradients: Mapping[str, object]) -> int:
    """The bytes of one push's gradients (a ``SparseRows``: its rows and values)."""
    return sum(g.nbytes if isinstance(g, np.ndarray) else g.values.nbytes + np.asarray(g.rows).nbytes
               for g in gradients.values())


def _weighted_sum(grads: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """sum_i grads[i] * weights[i], each product and each sum rounded to the gradients' dtype,
    block by block (float64 gradients: module docstring)."""
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
