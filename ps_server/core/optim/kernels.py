"""Fused optimizer steps: one pass over memory, the same bits as the NumPy steps.

    from ps_server.core.optim import kernels
    fused = kernels.adam(w, g, m, v, None, one_minus_beta_1, one_minus_beta_2, alpha, epsilon)
    if fused is None:  # no numba, float16, a strided array, or TFPS_KERNELS=numpy
        ...  # the NumPy step
    else:
        new_w, new_m, new_v, new_v_hat = fused

The ``_step`` methods of ``ps_server.core.optim.optimizers`` (SGD, Adam/AdamW, Adagrad,
RMSprop) and ``ps_server.core.optim.more_optimizers`` (Adamax, Nadam, Lion; not Ftrl,
whose power has no exact twin here, nor Adadelta, Lamb and Adafactor, not fused yet) call these first
and run their NumPy ufuncs only when the answer is None. A NumPy step is one
ufunc per operation, each a full pass over memory (an Adam step is ten); a
kernel here reads each input once and writes each output once, in one loop
compiled by numba.

Guarantees:
- Bit-identical to the NumPy step for float32 and float64. Each loop body does
  the NumPy step's IEEE operations in its order, on scalars of the variable's
  dtype (every constant is passed in that dtype; the loops hold no Python float
  literal, which would promote to float64). numba compiles without fastmath, so
  LLVM neither reassociates nor contracts ``a*b + c`` into an FMA, and leaves
  subnormals alone, as NumPy does; ``error_model="numpy"`` gives IEEE inf/NaN
  on a division by zero instead of an exception. ``tests/core/test_kernels.py``
  compares both paths bit for bit.
- Pure, like ``Optimizer.apply``: the outputs are freshly allocated arrays;
  nothing is written into an input (the store hands old arrays to readers).
- None, never an error, where a kernel does not apply: a variable of fewer than
  ``MIN_ELEMENTS`` elements (numba is then never imported), numba not installed (it
  is the optional ``fast`` extra), ``TFPS_KERNELS=numpy`` in the environment or
  ``kernels.ENABLED = False``, a dtype other than float32/float64 (numba has no
  float16 arithmetic on CPU), or an array that is not C-contiguous. The NumPy
  step then computes the same bits, more slowly.

numba is imported, and each kernel compiled for a dtype, on first use, so
importing the server stays quick; the process' first fused step pays for it once
(0.8-1.3 s measured on 2 busy cores: numba's import, ~0.3 s, and its typing
registries; a kernel's compiled code is cached beside this file, or in numba's
user cache where that is read-only, so later processes skip the ~0.2 s compile
of each). The loops
release the GIL. With ``THREADS`` > 1 (``TFPS_KERNEL_THREADS``; off by default),
a call above ``THREAD_MIN_ELEMENTS`` elements (16 MiB of float32) is cut into
contiguous chunks that the calling thread and ``THREADS - 1`` helper threads take
in turn: elementwise, so the bits do not depend on the cut. The caller takes
chunks too, so where the helpers are busy or not scheduled (other work on a
shared machine) it does them all itself instead of waiting.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import numpy as np

# Read on every call, so a test (or an operator) can switch the fused path off.
ENABLED = os.environ.get("TFPS_KERNELS", "").lower() not in ("numpy", "0", "off")
# Threads per kernel call for large arrays (TFPS_KERNEL_THREADS; default 1: none). On 2
# shared cores (BENCHMARKS.md) a second thread gained nothing consistent at 64 and 256 MiB,
# where the step is bound by memory traffic (+15 % in one set of runs, -20 % in another),
# and lost below 16 MiB, where its hand-off (tens of microseconds, more when the other
# core is busy) costs more than it saves; so it is there for machines with idle cores.
THREADS = max(1, int(os.environ.get("TFPS_KERNEL_THREADS", "1")))
THREAD_MIN_ELEMENTS = 1 << 22  # 16 MiB of float32
# Variables smaller than this take the NumPy step (TFPS_KERNEL_MIN_ELEMENTS; default 2**20
# elements, 4 MiB of float32): numba's import and LLVM cost the server process ~120 MB of
# resident memory (bench/load_test.py, 64 workers of a 136 KB model: 228 MB against 110 MB
# peak RSS), which a model of small variables should not pay for a step that is already short.
MIN_ELEMENTS = int(os.environ.get("TFPS_KERNEL_MIN_ELEMENTS", str(1 << 20)))
CHUNK_MIN_ELEMENTS = 1 << 18  # a split call's chunks: at most 4 per thread, none smaller than this

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_lock = threading.Lock()
_compiled: dict | None = None  # name -> numba dispatcher, once numba imported
_unavailable = False
_queues: list = []  # the helper threads' (see _helpers)


def available() -> bool:
    """Whether the fused path runs (numba importable and not switched off)."""
    return ENABLED and _loops() is not None


def _loops() -> dict | None:
    global _compiled, _unavailable
    if _compiled is None and not _unavailable:
        with _lock:
            if _compiled is None and not _unavailable:
                try:
                    try:
                        _compiled = _define_loops(cache=True)
                    except ImportError:
                        raise
                    except Exception:  # numba finds no writable cache directory: compile in each process
                        _compiled = _define_loops(cache=False)
                except ImportError as e:  # not installed (silently), or not for this NumPy (said)
                    _unavailable = True
                    if getattr(e, "name", None) != "numba":
                        _disable(str(e))
                except Exception as e:
                    _disable(f"{type(e).__name__}: {e}")
    return None if _unavailable else _compiled


def _run(name: str, inputs: tuple, scalars: tuple, outputs: int):
    """``outputs`` fresh arrays shaped like ``inputs[0]``, filled by loop ``name``;
    None where the fused path does not apply (see the module docstring)."""
    if not ENABLED:
        return None
    first = inputs[0]
    if first.size < MIN_ELEMENTS or first.dtype not in _DTYPES or not all(x.flags.c_contiguous for x in inputs):
        return None
    loops = _loops()
    if loops is None:
        return None
    flat = [x.reshape(-1) for x in inputs]
    outs = [np.empty(first.size, first.dtype) for _ in range(outputs)]
    try:
        _fill(loops[name], flat, scalars, outs)
    except Exception as e:  # numba failed to compile (a numba release it does not suit): NumPy from now on
        if type(e).__module__.split(".")[0] != "numba":
            raise
        _disable(f"{type(e).__name__}: {e}")
        return None
    return tuple(o.reshape(first.shape) for o in outs)


def _disable(why: str) -> None:
    global _unavailable
    _unavailable = True
    logging.getLogger(__name__).warning("fused optimizer kernels off, NumPy steps instead: %s", why)


def _fill(loop, flat: list, scalars: tuple, outs: list) -> None:
    n = flat[0].size
    if THREADS < 2 or n < THREAD_MIN_ELEMENTS:
        loop(*flat, *scalars, *outs)
        return
    chunks = max(THREADS, min(4 * THREADS, n // CHUNK_MIN_ELEMENTS))
    bounds = [n * k // chunks for k in range(chunks + 1)]
    split = _Split(lambda lo, hi: loop(*(x[lo:hi] for x in flat), *scalars, *(o[lo:hi] for o in outs)),
                   list(zip(bounds, bounds[1:])))
    for q in _helpers():
        q.put(split)
    split.work(helper=False)
    split.wait()


class _Split:
    """One call's chunks, taken in turn by the caller and the helper threads.

    The caller works too and takes whatever chunk is next, so where the helpers are
    busy or not scheduled (a shared machine) it does every chunk itself and waits for
    none; it waits only for chunks a helper has taken and not finished."""

    def __init__(self, run, chunks: list[tuple[int, int]]):
        self.run, self.chunks = run, chunks
        self.lock = threading.Lock()  # guards next, running; held for no loop
        self.next = 0
        self.running = 0  # helpers inside work() that have taken a chunk
        self.finished = threading.Condition(self.lock)
        self.error: BaseException | None = None

    def work(self, helper: bool) -> None:
        took = False
        try:
            while True:
                with self.lock:
                    k = self.next
                    if k >= len(self.chunks):
                        return
                    self.next += 1
                    if helper and not took:
                        took = True
                        self.running += 1
                try:
                    self.run(*self.chunks[k])
                except BaseException as e:  # raised in the caller by wait()
                    self.error = e
        finally:
            if took:
                with self.lock:
                    self.running -= 1
                    self.finished.notify_all()

    def wait(self) -> None:
        with self.lock:  # next is past the last chunk: no helper takes one from now on
            while self.running:
                self.finished.wait()
        if self.error is not None:
            raise self.error


def _helpers() -> list:
    """The queues of THREADS - 1 daemon threads, each running ``split.work`` for what it is handed."""
    if len(_queues) != THREADS - 1:
        with _lock:
            while len(_queues) < THREADS - 1:
                q: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=_helper, args=(q,), name=f"tfps-kernel-{len(_queues)}", daemon=True).start()
                _queues.append(q)
    return _queues[:THREADS - 1]


def _helper(q: queue.SimpleQueue) -> None:
    while True:
        q.get().work(helper=True)


def _scalars(dtype, *values) -> tuple:
    # Each constant as a scalar of the variable's dtype: numba then types the loop's
    # arithmetic in that dtype, as NumPy's array-scalar ufuncs compute.
    return tuple(x if type(x) is dtype.type else np.asarray(x).astype(dtype)[()] for x in values)


# -- the steps, each the NumPy _step's operations in its order ------------------------------
def sgd(w, g, lr):
    """``w - g*lr`` -> (new_w,)."""
    return _run("sgd", (w, g), _scalars(w.dtype, lr), 1)


def sgd_momentum(w, g, m, lr, momentum, nesterov: bool):
    """``m = m*mu - g*lr``; ``w + m``, or with Nesterov ``w + (m*mu - g*lr)`` -> (new_w, new_m)."""
    name = "sgd_nesterov" if nesterov else "sgd_momentum"
    return _run(name, (w, g, m), _scalars(w.dtype, lr, momentum), 2)


def adam(w, g, m, v, v_hat, one_minus_beta_1, one_minus_beta_2, alpha, epsilon):
    """``m + (g - m)*(1-b1)``, ``v + (g*g - v)*(1-b2)``, with amsgrad (``v_hat`` not None)
    ``max(v_hat, v)``; ``w - (m*alpha) / (sqrt(v or v_hat) + eps)`` -> (new_w, m, v, v_hat or None)."""
    scalars = _scalars(w.dtype, one_minus_beta_1, one_minus_beta_2, alpha, epsilon)
    if v_hat is None:
        out = _run("adam", (w, g, m, v), scalars, 3)
        return None if out is None else (*out, None)
    return _run("amsgrad", (w, g, m, v, v_hat), scalars, 4)


def adagrad(w, g, accumulator, lr, epsilon):
    """``acc + g*g``; ``w - (g*lr) / sqrt(acc + eps)`` -> (new_w, new_acc)."""
    return _run("adagrad", (w, g, accumulator), _scalars(w.dtype, lr, epsilon), 2)


def rmsprop(w, g, velocity, momentum, average, lr, rho, one_minus_rho, rms_momentum, epsilon):
    """``v*rho + (g*g)*(1-rho)``; centered (``average`` not None) ``a*rho + g*(1-rho)`` and
    ``v - a*a + eps``, else ``v + eps``; ``inc = (g*lr) / sqrt(that)``; with momentum
    (``momentum`` not None) ``m*mu + inc``, ``w - m``, else ``w - inc``
    -> (new_w, velocity, momentum or None, average or None)."""
    scalars = _scalars(w.dtype, lr, rho, one_minus_rho, rms_momentum, epsilon)
    name = "rmsprop" + ("_momentum" if momentum is not None else "") + ("_centered" if average is not None else "")
    inputs = (w, g, velocity) + ((momentum,) if momentum is not None else ()) + \
        ((average,) if average is not None else ())
    out = _run(name, inputs, scalars, len(inputs) - 1)
    if out is None:
        return None
    new_w, velocity, *rest = out
    new_m = rest.pop(0) if momentum is not None else None
    new_a = rest.pop(0) if average is not None else None
    return new_w, velocity, new_m, new_a


def adamax(w, g, m, u, one_minus_beta_1, beta_2, epsilon, one_minus_beta_1_power, lr):
    """``m + (g - m)*(1-b1)``; ``u = max(u*b2, |g|)``; ``w - (m*lr) / ((u + eps)*(1 - b1^t))``
    -> (new_w, new_m, new_u)."""
    scalars = _scalars(w.dtype, one_minus_beta_1, beta_2, epsilon, one_minus_beta_1_power, lr)
    return _run("adamax", (w, g, m, u), scalars, 3)


def nadam(w, g, m, v, one_minus_beta_1, one_minus_beta_2, u_t_1, one_minus_u_product_t_1, one_minus_u_t,
          one_minus_u_product_t, one_minus_beta_2_power, epsilon, lr):
    """``m + (g - m)*(1-b1)``, ``v + (g*g - v)*(1-b2)``;
    ``m_hat = (m*u_t_1) / (1 - u_prod_t_1) + (g*(1 - u_t)) / (1 - u_prod_t)``;
    ``w - (m_hat*lr) / (sqrt(v / (1 - b2^t)) + eps)`` -> (new_w, new_m, new_v)."""
    scalars = _scalars(w.dtype, one_minus_beta_1, one_minus_beta_2, u_t_1, one_minus_u_product_t_1, one_minus_u_t,
                       one_minus_u_product_t, one_minus_beta_2_power, epsilon, lr)
    return _run("nadam", (w, g, m, v), scalars, 3)


def lion(w, g, m, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2, lr):
    """``w - sign(m*b1 + g*(1-b1))*lr``; ``m*b2 + g*(1-b2)`` -> (new_w, new_m)."""
    scalars = _scalars(w.dtype, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2, lr, 1, 0)
    return _run("lion", (w, g, m), scalars, 2)


def _define_loops(cache: bool) -> dict:
    """The loops, one per variant (no branch on an option inside a loop, so LLVM
    vectorizes each). Arguments: the inputs, the scalars, then the outputs, all 1-D."""
    import numba

    njit = numba.njit(nogil=True, cache=cache, error_model="numpy", fastmath=False)

    def maximum(a, b):  # np.maximum's scalar rule: a NaN on either side wins
        return a if (a >= b or a != a) else b

    maximum = njit(maximum)

    @njit
    def nadam(w, g, m, v, b1, b2, u_t_1, a, b, c, d, eps, lr, wo, mo, vo):
        for i in range(w.size):
            gi, mi, vi = g[i], m[i], v[i]
            mi = mi + (gi - mi) * b1
            vi = vi + (gi * gi - vi) * b2
            mo[i] = mi
            vo[i] = vi
            m_hat = (mi * u_t_1) / a + (gi * b) / c
            wo[i] = w[i] - (m_hat * lr) / (np.sqrt(vi / d) + eps)

    @njit
    def sign(x, one, zero):  # np.sign's rule: 1, -1, 0 for either zero, NaN for NaN
        return one if x > 0 else (-one if x < 0 else (zero if x == 0 else x))

    @njit
    def sgd(w, g, lr, wo):
        for i in range(w.size):
            wo[i] = w[i] - g[i] * lr

    @njit
    def sgd_momentum(w, g, m, lr, mu, wo, mo):
        for i in range(w.size):
            mi = m[i] * mu - g[i] * lr
            mo[i] = mi
            wo[i] = w[i] + mi

    @njit
    def sgd_nesterov(w, g, m, lr, mu, wo, mo):
        for i in range(w.size):
            step = g[i] * lr
            mi = m[i] * mu - step
            mo[i] = mi
            wo[i] = w[i] + (mi * mu - step)

    @njit
    def adam(w, g, m, v, b1, b2, alpha, eps, wo, mo, vo):
        for i in range(w.size):
            gi, mi, vi = g[i], m[i], v[i]
            mi = mi + (gi - mi) * b1
            vi = vi + (gi * gi - vi) * b2
            mo[i] = mi
            vo[i] = vi
            wo[i] = w[i] - (mi * alpha) / (np.sqrt(vi) + eps)

    @njit
    def amsgrad(w, g, m, v, vh, b1, b2, alpha, eps, wo, mo, vo, vho):
        for i in range(w.size):
            gi, mi, vi = g[i], m[i], v[i]
            mi = mi + (gi - mi) * b1
            vi = vi + (gi * gi - vi) * b2
            hi = maximum(vh[i], vi)
            mo[i] = mi
            vo[i] = vi
            vho[i] = hi
            wo[i] = w[i] - (mi * alpha) / (np.sqrt(hi) + eps)

    @njit
    def adagrad(w, g, a, lr, eps, wo, ao):
        for i in range(w.size):
            gi = g[i]
            ai = a[i] + gi * gi
            ao[i] = ai
            wo[i] = w[i] - (gi * lr) / np.sqrt(ai + eps)

    def rmsprop_variant(momentum: bool, centered: bool):
        # Four small loops generated from one body; the flags are compile-time constants.
        @njit
        def loop(w, g, v, m, a, lr, rho, omr, mu, eps, wo, vo, mo, ao):
            for i in range(w.size):
                gi = g[i]
                vi = v[i] * rho + (gi * gi) * omr
                vo[i] = vi
                if centered:
                    ai = a[i] * rho + gi * omr
                    ao[i] = ai
                    d = (vi - ai * ai) + eps
                else:
                    d = vi + eps
                inc = (gi * lr) / np.sqrt(d)
                if momentum:
                    mi = m[i] * mu + inc
                    mo[i] = mi
                    wo[i] = w[i] - mi
                else:
                    wo[i] = w[i] - inc
        return loop

    plain, with_m = rmsprop_variant(False, False), rmsprop_variant(True, False)
    centered, both = rmsprop_variant(False, True), rmsprop_variant(True, True)

    # The generic loop takes every array; each variant's entry point passes the
    # inputs it has and stand-ins (its own velocity arrays, never written) for the rest.
    @njit
    def rmsprop(w, g, v, lr, rho, omr, mu, eps, wo, vo):
        plain(w, g, v, v, v, lr, rho, omr, mu, eps, wo, vo, vo, vo)

    @njit
    def rmsprop_momentum(w, g, v, m, lr, rho, omr, mu, eps, wo, vo, mo):
        with_m(w, g, v, m, v, lr, rho, omr, mu, eps, wo, vo, mo, vo)

    @njit
    def rmsprop_centered(w, g, v, a, lr, rho, omr, mu, eps, wo, vo, ao):
        centered(w, g, v, v, a, lr, rho, omr, mu, eps, wo, vo, vo, ao)

    @njit
    def rmsprop_momentum_centered(w, g, v, m, a, lr, rho, omr, mu, eps, wo, vo, mo, ao):
        both(w, g, v, m, a, lr, rho, omr, mu, eps, wo, vo, mo, ao)

    @njit
    def adamax(w, g, m, u, b1, b2, eps, bias, lr, wo, mo, uo):
        for i in range(w.size):
            gi, mi = g[i], m[i]
            mi = mi + (gi - mi) * b1
            ui = maximum(u[i] * b2, np.abs(gi))
            mo[i] = mi
            uo[i] = ui
            wo[i] = w[i] - (mi * lr) / ((ui + eps) * bias)

    @njit
    def lion(w, g, m, b1, omb1, b2, omb2, lr, one, zero, wo, mo):
        for i in range(w.size):
            gi, mi = g[i], m[i]
            wo[i] = w[i] - sign(mi * b1 + gi * omb1, one, zero) * lr
            mo[i] = mi * b2 + gi * omb2

    @njit
    def fold_exact(g, piece, hi, start, err):
        # hi[start + i] += g[i] * piece in float64, each addition's exact remainder (TwoSum)
        # written to err[i]: aggregation._Exact.add's operations, in one branch-free pass
        # (it vectorizes); the count of non-zero remainders, NaN ones included.
        count = 0
        for i in range(g.size):
            x = np.float64(g[i]) * piece
            h = hi[start + i]
            s = h + x
            bp = s - h
            e = (h - (s - bp)) + (x - bp)
            hi[start + i] = s
            err[i] = e
            count += e != 0.0
        return count

    return {name: f for name, f in locals().items() if name in _NAMES}


_NAMES = ("sgd", "sgd_momentum", "sgd_nesterov", "adam", "amsgrad", "adagrad", "rmsprop", "rmsprop_momentum",
          "rmsprop_centered", "rmsprop_momentum_centered", "adamax", "nadam", "lion", "fold_exact")


def fold_exact(g: np.ndarray, piece: float, hi: np.ndarray, start: int, err: np.ndarray):
    """``aggregation._Exact``'s fold of one block in one pass: ``hi[start:start+len(g)]``
    += ``g * piece`` (float64), each remainder written to ``err[:len(g)]``; the count of
    non-zero ones, or None where the fused path does not apply (then NumPy folds the same bits)."""
    if not ENABLED or hi.size < MIN_ELEMENTS or g.dtype not in (np.dtype(np.float32), np.dtype(np.float16)) \
            or not g.flags.c_contiguous:
        return None
    if g.dtype == np.float16:
        return None  # numba has no float16 arithmetic on CPU
    loops = _loops()
    if loops is None:
        return None
    try:
        return int(loops["fold_exact"](g, float(piece), hi, start, err))
    except Exception as e:
        if type(e).__module__.split(".")[0] != "numba":
            raise
        _disable(f"{type(e).__name__}: {e}")
        return None
