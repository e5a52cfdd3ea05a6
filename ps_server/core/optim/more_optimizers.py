"""More server-side optimizers that compute exactly what Keras 3 computes.

``Adamax``, ``Nadam``, ``Ftrl``, ``Lion``, ``Adadelta``, ``Lamb`` and ``Adafactor`` are ``ps_server.core.optim.optimizers.Optimizer``
subclasses (``ps_server.core.optim.registry.make_optimizer`` makes them by name) and follow its method: each
step repeats the Keras 3.15 ``update_step`` (TensorFlow 2.21 CPU backend) operation by
operation, in Keras' order, every intermediate in the variable's dtype, and rounds
each hyperparameter the way Keras hands it to its op:

- ``ops.cast(python_float, dtype)`` (``_via_float32``) goes through float32, as does
  the learning rate (a float32 variable, then cast);
- a Python float that is an operand of an op (``_direct``: ``1 - self.beta_1``
  computed by Python, ``self.epsilon``, ``self.beta_2`` in Adamax, Nadam's
  ``self.beta_1`` and ``0.96`` in its ``u_product``, Ftrl's ``2 * l2_shrinkage``,
  ``l2``, ``beta`` and ``l1``) is converted to the dtype directly;
- ``1 - beta`` where ``beta`` is already a cast tensor (Nadam, Lion) is a subtraction
  in the dtype.

Guarantee, checked by ``tests/core/test_more_optimizers.py`` against eager Keras
(``opt.apply(grads, variables)``) after 20 updates: variables and slots bit-identical
for float32, float64 and float16, except Lamb's float16 variables: its trust ratio sums
float16 squares (``ops.sum``), which TensorFlow adds in an order and precision ``tf_sum``
does not reproduce, so they are within one unit in the last place of the variable's
largest element (measured). Lamb's norms and Adafactor's means are TensorFlow's sums in
Eigen's order (``tf_sum``, ``_tf_mean``), so both need the whole variable: a sparse
gradient is made dense for them (``core.optim.sparse``). Ftrl's ``ops.power`` is the one op NumPy has no twin
for: TensorFlow's CPU ``Pow`` is Eigen's polynomial pow on whole AVX packets and the
C library's on the tail, so ``_tf_pow`` reproduces both (for the x86-64 pip wheel of
TensorFlow, built for AVX without FMA; a build with FMA, or ARM, rounds Eigen's pow
differently, by a few ulp). The base module's limits hold here too (XLA's fused
multiply-adds; subnormals, which TensorFlow flushes to zero and NumPy keeps, except
in ``_tf_pow``, which flushes them as TensorFlow does).

Hyperparameters are read from the spec by Keras' own argument names:

- Adamax, Nadam: learning_rate, beta_1, beta_2, epsilon;
- Lion: learning_rate, beta_1, beta_2 (Keras' defaults 0.001, 0.9, 0.99);
- Ftrl: learning_rate, learning_rate_power, initial_accumulator_value,
  l1_regularization_strength, l2_regularization_strength,
  l2_shrinkage_regularization_strength, beta;
- Adadelta: learning_rate, rho, epsilon; Lamb: learning_rate, beta_1, beta_2, epsilon;
- Adafactor: learning_rate, beta_2_decay, epsilon_1, epsilon_2, clip_threshold,
  relative_step (its state holds ``r`` and ``c``, shaped as Keras', for a variable of
  two or more dimensions).

Nadam's ``u_product`` (one Keras variable for the whole optimizer, multiplied once per
``apply``, in the first variable's dtype) is kept per variable in the state as
``state["u_product"]``, a 0-d array of the variable's dtype: it equals Keras' when
every step updates every variable (as ``iterations`` does) and the variables share a
dtype.

Plain Python and NumPy only: the server process never imports TensorFlow.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from ps_server.core.optim import kernels
from ps_server.core.errors import InvalidArgument
from ps_server.core.optim.optimizers import FLOAT_DTYPES, Optimizer, _scalar_pow, tf_sum, tf_sum_range


def _via_float32(x, dtype):
    return np.float32(x).astype(dtype)


def _direct(x, dtype):
    return np.array(x, dtype=dtype)[()]


def _hyper(spec, name: str) -> float:
    """``spec.<name>`` as a finite Python number, else InvalidArgument naming it."""
    if not hasattr(spec, name):
        raise InvalidArgument(f"optimizer spec {spec.name!r} has no {name}")
    x = getattr(spec, name)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise InvalidArgument(f"{name} must be a finite number; got {x!r}")
    return float(x)


def _local_step(iterations: int, dtype) -> np.floating:
    with np.errstate(over="ignore"):  # float16 step > 65504 is inf, as in Keras
        return np.array(iterations).astype(dtype)[()]


def _moments(g, state, one_minus_beta_1, one_minus_beta_2, squared=None):
    """Nadam's and Lamb's new ``m`` and ``v``, as Keras writes them: ``assign_add(m, (g - m) *
    (1 - beta_1))`` and ``assign_add(v, (g^2 - v) * (1 - beta_2))``, into new arrays
    (``squared``, a new array: g^2 as given, for ``--sparse-rule keras``)."""
    m = np.subtract(g, state["m"])
    np.multiply(m, one_minus_beta_1, out=m)
    np.add(state["m"], m, out=m)
    v = np.square(g) if squared is None else squared
    np.subtract(v, state["v"], out=v)
    np.multiply(v, one_minus_beta_2, out=v)
    np.add(state["v"], v, out=v)
    return m, v


class _KerasOptimizer(Optimizer):
    """Base of the four: the base class' checks and constants, plus our own per dtype."""

    def __init__(self, spec):
        self._validate(spec)  # first: the base constants below need numbers
        super().__init__(spec)  # spec.validate(), the base constants (lr and one among them)
        self._constants = {
            dtype: {**self._constants[dtype], **self._more_constants(spec, dtype)}
            for dtype in FLOAT_DTYPES
        }

    def _validate(self, spec) -> None:
        raise NotImplementedError

    def _more_constants(self, spec, dtype) -> dict:
        raise NotImplementedError


def _check_adam_like(spec) -> None:
    """Adamax's and Nadam's rule (stricter than Keras, which checks none): betas in [0, 1), epsilon >= 0."""
    _check_unit_interval(spec, "beta_1")
    _check_unit_interval(spec, "beta_2")
    if _hyper(spec, "epsilon") < 0:
        raise InvalidArgument(f"epsilon must be >= 0; got {spec.epsilon!r}")


def _check_unit_interval(spec, name: str, closed_at_one: bool = False) -> float:
    x = _hyper(spec, name)
    if closed_at_one:
        if not 0 < x <= 1:
            raise InvalidArgument(f"{name} must be in (0, 1]; got {x!r}")
    elif not 0 <= x < 1:
        raise InvalidArgument(f"{name} must be in [0, 1); got {x!r}")
    return x


class Adamax(_KerasOptimizer):
    """``keras.optimizers.Adamax``: m += (g - m)(1 - b1); u = max(b2 u, |g|);
    w -= lr m / ((1 - b1^t)(u + eps))."""

    slot_names = ("m", "u")

    def _validate(self, spec):
        _check_adam_like(spec)

    def _more_constants(self, spec, dtype):
        return {
            "ax_beta_1": _via_float32(spec.beta_1, dtype),  # ops.cast(self.beta_1), for the power
            "ax_one_minus_beta_1": _direct(1 - spec.beta_1, dtype),  # (1 - self.beta_1), Python
            "ax_beta_2": _direct(spec.beta_2, dtype),  # ops.multiply(self.beta_2, u)
            "ax_epsilon": _direct(spec.epsilon, dtype),  # ops.add(u, self.epsilon)
        }

    def _step(self, w, g, state, iterations, c):
        beta_1_power = _scalar_pow(c["ax_beta_1"], _local_step(iterations + 1, w.dtype))
        fused = kernels.adamax(w, g, state["m"], state["u"], c["ax_one_minus_beta_1"], c["ax_beta_2"],
                               c["ax_epsilon"], c["one"] - beta_1_power, c["lr"])
        if fused is not None:  # the operations below, in one pass
            return fused[0], {"m": fused[1], "u": fused[2]}
        return self._moments_step(w, g, np.abs(g), state, beta_1_power, c)

    def _slices_step(self, w, occ, state, iterations, c):
        # g - m densifies the occurrences; maximum(beta_2 * u, abs(g)) densifies their |g|, summed
        beta_1_power = _scalar_pow(c["ax_beta_1"], _local_step(iterations + 1, w.dtype))
        return self._moments_step(w, occ.dense(), occ.dense(np.abs(occ.values)), state, beta_1_power, c)

    def _moments_step(self, w, g, magnitude, state, beta_1_power, c):
        m = np.subtract(g, state["m"])
        np.multiply(m, c["ax_one_minus_beta_1"], out=m)
        np.add(state["m"], m, out=m)  # assign_add(m, (g - m) * (1 - beta_1))
        u = np.multiply(state["u"], c["ax_beta_2"])
        np.maximum(u, magnitude, out=u)  # maximum(beta_2 * u, |g|)
        denominator = np.add(u, c["ax_epsilon"])
        np.multiply(denominator, c["one"] - beta_1_power, out=denominator)  # (1 - b1^t) * (u + eps)
        update = np.multiply(m, c["lr"])
        np.divide(update, denominator, out=update)
        return np.subtract(w, update, out=update), {"m": m, "u": u}


class Lion(_KerasOptimizer):
    """``keras.optimizers.Lion``: w -= lr sign(b1 m + (1 - b1) g); m = b2 m + (1 - b2) g."""

    slot_names = ("m",)

    def _validate(self, spec):
        # Keras accepts beta_1 in (0, 1] and does not check beta_2.
        _check_unit_interval(spec, "beta_1", closed_at_one=True)
        _hyper(spec, "beta_2")

    def _more_constants(self, spec, dtype):
        beta_1 = _via_float32(spec.beta_1, dtype)  # ops.cast(self.beta_1, dtype)
        beta_2 = _via_float32(spec.beta_2, dtype)
        one = _direct(1, dtype)
        return {
            "lion_beta_1": beta_1,
            "lion_beta_2": beta_2,
            "lion_one_minus_beta_1": one - beta_1,  # 1.0 - beta_1 with beta_1 a tensor
            "lion_one_minus_beta_2": one - beta_2,
        }

    def _step(self, w, g, state, iterations, c):
        fused = kernels.lion(w, g, state["m"], c["lion_beta_1"], c["lion_one_minus_beta_1"], c["lion_beta_2"],
                             c["lion_one_minus_beta_2"], c["lr"])
        if fused is not None:  # the operations below, in one pass
            return fused[0], {"m": fused[1]}
        return self._scaled_step(w, np.multiply(g, c["lion_one_minus_beta_1"]),
                                 np.multiply(g, c["lion_one_minus_beta_2"]), state, c)

    def _slices_step(self, w, occ, state, iterations, c):
        # g * (1 - beta) per occurrence, densified where added to the dense m * beta
        return self._scaled_step(w, occ.dense(np.multiply(occ.values, c["lion_one_minus_beta_1"])),
                                 occ.dense(np.multiply(occ.values, c["lion_one_minus_beta_2"])), state, c)

    def _scaled_step(self, w, scaled_1, scaled_2, state, c):
        """The step for ``g (1 - b1)`` and ``g (1 - b2)`` (new arrays, written into)."""
        direction = np.multiply(state["m"], c["lion_beta_1"])
        np.add(direction, scaled_1, out=direction)
        np.sign(direction, out=direction)
        np.multiply(direction, c["lr"], out=direction)  # lr * sign(m b1 + g (1 - b1))
        new_w = np.subtract(w, direction, out=direction)
        m = np.multiply(state["m"], c["lion_beta_2"])
        np.add(m, scaled_2, out=m)  # m b2 + g (1 - b2)
        return new_w, {"m": m}


class Nadam(_KerasOptimizer):
    """``keras.optimizers.Nadam``, with Keras' ``u_product`` kept per variable.

    State: slots ``m`` and ``v`` shaped like the variable, ``u_product`` (0-d, the
    variable's dtype, 1 before the first step) and ``iterations``.
    """

    slot_names = ("m", "v")

    def _validate(self, spec):
        _check_adam_like(spec)

    def _more_constants(self, spec, dtype):
        beta_1 = _via_float32(spec.beta_1, dtype)  # ops.cast(self.beta_1, var_dtype)
        beta_2 = _via_float32(spec.beta_2, dtype)
        one = _direct(1, dtype)
        return {
            "na_beta_1": beta_1,
            "na_beta_2": beta_2,
            "na_one_minus_beta_1": one - beta_1,  # (1 - beta_1) with beta_1 a tensor
            "na_one_minus_beta_2": one - beta_2,
            "na_decay": _via_float32(0.96, dtype),  # ops.cast(0.96, var_dtype)
            # _backend_update_step: u_product * self.beta_1 * (1.0 - 0.5 * ops.power(0.96, t)),
            # Python floats as operands, so converted directly.
            "na_u_beta_1": _direct(spec.beta_1, dtype),
            "na_u_decay": _direct(0.96, dtype),
            "na_half": _direct(0.5, dtype),
            "na_epsilon": _direct(spec.epsilon, dtype),
        }

    def init_state(self, value):
        state = super().init_state(value)
        state["u_product"] = np.ones((), value.dtype)  # backend.Variable(1.0, dtype)
        return state

    def apply(self, value, grad, state, *args, **kwargs):
        """The base ``apply``, with ``u_product`` carried around it.

        Overridden because the base ``apply`` hands ``_step`` only the slots when the
        variable is 0-d and reshapes everything ``_step`` returns to the variable's
        shape, which a 0-d ``u_product`` does not survive. Keras multiplies
        ``u_product`` before ``update_step``; so do we, here, and hand the new value to
        ``_step`` on a shallow copy of this optimizer (so concurrent applies on other
        variables never see it).
        """
        if not isinstance(value, np.ndarray) or value.dtype not in FLOAT_DTYPES:
            return Optimizer.apply(self, value, grad, state, *args, **kwargs)  # which says what is wrong
        missing = [k for k in ("u_product", "iterations") if k not in state]
        if missing:
            raise InvalidArgument(f"optimizer state lacks {', '.join(missing)}")
        u_product = state["u_product"]
        dtype = value.dtype
        if not isinstance(u_product, np.ndarray) or u_product.shape != () or u_product.dtype != dtype:
            got = (f"{u_product.dtype}{list(u_product.shape)}" if isinstance(u_product, np.ndarray)
                   else type(u_product).__name__)
            raise InvalidArgument(f"state 'u_product' must be a 0-d array of the variable's dtype; got {got}")
        c = self._constants[dtype]
        local_step = _local_step(int(state["iterations"]) + 1, dtype)
        with np.errstate(under="ignore"):
            decayed = c["one"] - c["na_half"] * _scalar_pow(c["na_u_decay"], local_step)
            new_u_product = np.array((u_product[()] * c["na_u_beta_1"]) * decayed, dtype)
        stepper = copy.copy(self)
        stepper._u_product_t = new_u_product[()]
        rest = {k: v for k, v in state.items() if k != "u_product"}
        new_value, new_state = Optimizer.apply(stepper, value, grad, rest, *args, **kwargs)
        new_state["u_product"] = new_u_product
        return new_value, new_state

    def _scalars(self, dtype, iterations, c) -> tuple:
        """(u_t, u_t_1, u_product_t, u_product_t_1, beta_2_power) of this step."""
        one, beta_1, half = c["one"], c["na_beta_1"], c["na_half"]
        with np.errstate(under="ignore"):
            u_t = beta_1 * (one - half * _scalar_pow(c["na_decay"], _local_step(iterations + 1, dtype)))
            u_t_1 = beta_1 * (one - half * _scalar_pow(c["na_decay"], _local_step(iterations + 2, dtype)))
            u_product_t = self._u_product_t
            u_product_t_1 = u_product_t * u_t_1
            beta_2_power = _scalar_pow(c["na_beta_2"], _local_step(iterations + 1, dtype))
        return u_t, u_t_1, u_product_t, u_product_t_1, beta_2_power

    def _step(self, w, g, state, iterations, c):
        one = c["one"]
        u_t, u_t_1, u_product_t, u_product_t_1, beta_2_power = scalars = self._scalars(w.dtype, iterations, c)
        fused = kernels.nadam(w, g, state["m"], state["v"], c["na_one_minus_beta_1"], c["na_one_minus_beta_2"],
                              u_t_1, one - u_product_t_1, one - u_t, one - u_product_t, one - beta_2_power,
                              c["na_epsilon"], c["lr"])
        if fused is not None:  # the operations below, in one pass
            return fused[0], {"m": fused[1], "v": fused[2]}
        m, v = _moments(g, state, c["na_one_minus_beta_1"], c["na_one_minus_beta_2"])
        current = np.multiply(g, one - u_t)  # ((1 - u_t) g) / (1 - u_product_t)
        np.divide(current, one - u_product_t, out=current)
        return self._moments_step(w, m, v, current, scalars, c)

    def _slices_step(self, w, occ, state, iterations, c):
        # g - m and square(g) - v densify (the occurrences, their squares, summed); ((1 - u_t) g) /
        # (1 - u_product_t) is taken per occurrence and densified where added to the dense m term.
        one = c["one"]
        u_t, _, u_product_t, _, _ = scalars = self._scalars(w.dtype, iterations, c)
        m, v = _moments(occ.dense(), state, c["na_one_minus_beta_1"], c["na_one_minus_beta_2"],
                        squared=occ.dense(np.square(occ.values)))
        current = np.multiply(occ.values, one - u_t)
        np.divide(current, one - u_product_t, out=current)
        return self._moments_step(w, m, v, occ.dense(current), scalars, c)

    def _moments_step(self, w, m, v, current, scalars, c):
        one = c["one"]
        _, u_t_1, _, u_product_t_1, beta_2_power = scalars
        # m_hat = (u_t_1 m) / (1 - u_product_t_1) + current
        m_hat = np.multiply(m, u_t_1)
        np.divide(m_hat, one - u_product_t_1, out=m_hat)
        np.add(m_hat, current, out=m_hat)
        # v_hat = v / (1 - beta_2^t); w -= (m_hat lr) / (sqrt(v_hat) + eps)
        denominator = np.divide(v, one - beta_2_power, out=current)
        np.sqrt(denominator, out=denominator)
        np.add(denominator, c["na_epsilon"], out=denominator)
        np.multiply(m_hat, c["lr"], out=m_hat)
        np.divide(m_hat, denominator, out=m_hat)
        return np.subtract(w, m_hat, out=m_hat), {"m": m, "v": v}


class Ftrl(_KerasOptimizer):
    """``keras.optimizers.Ftrl`` (the Keras 3 formulation, with ``beta`` and L2 shrinkage).

    Slots: ``accumulator`` (starting at initial_accumulator_value) and ``linear``.
    """

    slot_names = ("accumulator", "linear")

    def _validate(self, spec):
        # Keras' own checks, in Keras' order.
        if _hyper(spec, "initial_accumulator_value") < 0:
            raise InvalidArgument("initial_accumulator_value must be >= 0; "
                                  f"got {spec.initial_accumulator_value!r}")
        if _hyper(spec, "learning_rate_power") > 0:
            raise InvalidArgument(f"learning_rate_power must be <= 0; got {spec.learning_rate_power!r}")
        for name in ("l1_regularization_strength", "l2_regularization_strength",
                     "l2_shrinkage_regularization_strength"):
            if _hyper(spec, name) < 0:
                raise InvalidArgument(f"{name} must be >= 0; got {getattr(spec, name)!r}")
        _hyper(spec, "beta")  # Keras does not check its sign

    def _more_constants(self, spec, dtype):
        l1 = float(spec.l1_regularization_strength)
        return {
            # initializers.Constant: ops.cast(value, dtype) * ones
            "ftrl_initial_accumulator": _via_float32(spec.initial_accumulator_value, dtype),
            "ftrl_power": _direct(-float(spec.learning_rate_power), dtype),  # ops.power(x, -lr_power)
            "ftrl_l2": _direct(spec.l2_regularization_strength, dtype),
            "ftrl_beta": _direct(spec.beta, dtype),
            "ftrl_two": _direct(2.0, dtype),
            "ftrl_two_shrinkage": _direct(2 * float(spec.l2_shrinkage_regularization_strength), dtype),
            "ftrl_l1_low": _direct(-l1, dtype),  # ops.clip(linear, -l1, l1)
            "ftrl_l1_high": _direct(l1, dtype),
        }

    def init_state(self, value):
        state = super().init_state(value)
        state["accumulator"] = np.full_like(value, self._constants[value.dtype]["ftrl_initial_accumulator"])
        return state

    def _step(self, w, g, state, iterations, c):
        return self._squared_step(w, g, np.square(g), state, c)

    def _slices_step(self, w, occ, state, iterations, c):
        # g + shrinkage * w densifies the occurrences (summed); accum + square(g) their squares
        return self._squared_step(w, occ.dense(), occ.dense(np.square(occ.values)), state, c)

    def _squared_step(self, w, g, squared, state, c):
        """The step for ``g`` and ``g^2`` given (``squared``, a new array, written into)."""
        lr, power = c["lr"], c["ftrl_power"]
        # l2_reg = self.l2 + self.beta / (2.0 * lr), Python floats converted to lr's dtype
        l2_reg = c["ftrl_l2"] + c["ftrl_beta"] / (c["ftrl_two"] * lr)
        accum = state["accumulator"]
        grad_to_use = np.multiply(w, c["ftrl_two_shrinkage"])
        np.add(g, grad_to_use, out=grad_to_use)  # g + (2 * l2_shrinkage) * w
        new_accum = squared
        np.add(accum, new_accum, out=new_accum)  # accum + g^2
        new_accum_power = _tf_pow(new_accum, power)
        sigma = np.subtract(new_accum_power, _tf_pow(accum, power))
        np.divide(sigma, lr, out=sigma)
        np.multiply(sigma, w, out=sigma)
        np.subtract(grad_to_use, sigma, out=sigma)
        linear = np.add(state["linear"], sigma, out=sigma)  # assign_add(linear, g' - (...) / lr * w)
        quadratic = np.divide(new_accum_power, lr, out=new_accum_power)
        np.add(quadratic, c["ftrl_two"] * l2_reg, out=quadratic)  # pow(new_accum, -p) / lr + 2 * l2_reg
        clipped = np.minimum(linear, c["ftrl_l1_high"], out=grad_to_use)  # tf.clip_by_value: min, then max
        np.maximum(clipped, c["ftrl_l1_low"], out=clipped)
        np.subtract(clipped, linear, out=clipped)
        new_w = np.divide(clipped, quadratic, out=clipped)
        return new_w, {"accumulator": new_accum, "linear": linear}


def _tf_pow(x: np.ndarray, y: np.floating) -> np.ndarray:
    """``tf.pow(x, y)`` for an array ``x`` and a scalar ``y``, rounded as TensorFlow's CPU kernel rounds it.

    TensorFlow's ``Pow`` is Eigen's ``scalar_pow_op``: on whole packets (8 float32 or
    4 float64 lanes; the pip wheels are built for AVX without FMA) it is Eigen's
    ``generic_pow``, a polynomial pow about 1 ulp off the C library's, and on the
    elements after the last whole packet it is ``std::pow``. ``np.power`` is neither.
    So the first ``P * (n // P)`` elements (row-major) go through ``_eigen_pow`` and
    the rest through the C library's ``pow`` (as ``_scalar_pow``).
    """
    if x.dtype == np.float16:
        # Eigen has no half packet pow: every element is half(powf(float(x), float(y))).
        # powf equals the float64 pow rounded to float32 (see _scalar_pow); np.power in
        # float64 is within 1 ulp of that pow, which the rounding to float32 absorbs.
        # Zeros, negatives and non-finite x (C's special cases) go through the C library itself.
        y32 = np.float32(y)
        with np.errstate(all="ignore"):
            out = np.power(x.astype(np.float64), np.float64(y32)).astype(np.float32)
        special = np.flatnonzero(~(np.isfinite(x) & (x > 0)))
        out.reshape(-1)[special] = [_c_pow(v, y32) for v in x.reshape(-1)[special].astype(np.float32)]
        with np.errstate(over="ignore"):
            return out.astype(np.float16)
    if y == 1:  # both paths return x itself, subnormal or not
        return x.copy()
    # TensorFlow's kernels run with subnormals flushed to zero, in and out (FTZ, DAZ).
    tiny = np.finfo(x.dtype).tiny
    zero = x.dtype.type(0)
    flat = np.where(np.abs(x) < tiny, np.copysign(zero, x), x).reshape(-1)
    lanes = 8 if x.dtype == np.float32 else 4  # AVX: Packet8f, Packet4d
    whole = flat.size - flat.size % lanes
    out = np.empty_like(flat)
    if whole:
        out[:whole] = _eigen_pow(flat[:whole], y)
    for i in range(whole, flat.size):
        out[i] = _c_pow(flat[i], y)
    out = np.where(np.abs(out) < tiny, np.copysign(zero, out), out)
    return out.reshape(x.shape)


def _c_pow(base: np.floating, exponent: np.floating) -> np.floating:
    """``_scalar_pow`` (the C library's pow) with C's results where ``math.pow`` raises."""
    try:
        with np.errstate(over="ignore"):
            return _scalar_pow(base, exponent)
    except (OverflowError, ValueError) as e:
        y = float(exponent)
        odd = math.isfinite(y) and y == math.floor(y) and y % 2 == 1
        if isinstance(e, OverflowError):
            return base.dtype.type(-math.inf if base < 0 and odd else math.inf)
        if base == 0:  # pow(+-0, y < 0)
            return base.dtype.type(-math.inf if np.signbit(base) and odd else math.inf)
        return base.dtype.type(math.nan)  # negative base, non-integer exponent


def _veltkamp_split(x):
    """Eigen's ``veltkamp_splitting``: x = hi + lo, hi holding half the significand."""
    shift = 12 if x.dtype == np.float32 else 27
    gamma = x * x.dtype.type(2.0 ** shift + 1)
    hi = (x - gamma) + gamma
    return hi, x - hi


def _two_prod(x, y):
    """Eigen's ``twoprod`` without FMA (Dekker): x * y = hi + lo exactly."""
    x_hi, x_lo = _veltkamp_split(x)
    y_hi, y_lo = _veltkamp_split(y)
    p_hi = x * y
    p_lo = x_hi * y_hi + -p_hi  # pmadd is a multiply then an add: no FMA in the wheel
    p_lo = x_hi * y_lo + p_lo
    p_lo = x_lo * y_hi + p_lo
    p_lo = x_lo * y_lo + p_lo
    return p_hi, p_lo


def _fast_two_sum(x, y):
    s_hi = x + y
    return s_hi, y - (s_hi - x)


def _fast_two_sum_dw(x_hi, x_lo, y_hi, y_lo):
    """Double word + double word, |x| >= |y|."""
    r_hi, r_lo = _fast_two_sum(x_hi, y_hi)
    return _fast_two_sum(r_hi, (y_lo + r_lo) + x_lo)


def _fast_two_sum_fdw(x, y_hi, y_lo):
    """Float + double word, |x| >= |y|."""
    r_hi, r_lo = _fast_two_sum(x, y_hi)
    return _fast_two_sum(r_hi, y_lo + r_lo)


def _two_prod_dwf(x_hi, x_lo, y):
    """Double word * float."""
    c_hi, c_lo1 = _two_prod(x_hi, y)
    t_hi, t_lo1 = _fast_two_sum(c_hi, x_lo * y)
    return _fast_two_sum(t_hi, t_lo1 + c_lo1)


def _two_prod_dw(x_hi, x_lo, y_hi, y_lo):
    """Double word * double word."""
    hh, hl = _two_prod_dwf(x_hi, x_lo, y_hi)
    lh, ll = _two_prod_dwf(x_hi, x_lo, y_lo)
    return _fast_two_sum_dw(hh, hl, lh, ll)


def _accurate_log2(m):
    """Eigen's ``accurate_log2``: log2(m) as a double word, m in [1/sqrt(2), sqrt(2)]."""
    t = m.dtype.type
    one = t(1)
    if m.dtype == np.float32:
        k_c0 = 1.442695041742110273474963832995854318141937255859375e+00
        k_c1 = -7.2134751588268664068692714863573201000690460205078125e-01
        c0_hi, c1_hi = np.float32(k_c0), np.float32(k_c1)
        c0_lo, c1_lo = np.float32(k_c0 - float(c0_hi)), np.float32(k_c1 - float(c1_hi))
        coeffs = [9.7010828554630279541015625e-02, -1.6896486282348632812500000e-01,
                  1.7200836539268493652343750e-01, -1.7892272770404815673828125e-01,
                  2.0505344867706298828125000e-01, -2.4046677350997924804687500e-01,
                  2.8857553005218505859375000e-01, -3.6067414283752441406250000e-01,
                  4.8089790344238281250000000e-01]
        x = m - one
        p = np.full_like(x, coeffs[0])
        for k in coeffs[1:]:  # ppolevl: Horner, each step a multiply then an add
            p = p * x + np.float32(k)
        p_hi, p_lo = _two_prod(x, p)
        p_hi, p_lo = _fast_two_sum_dw(np.full_like(x, c1_hi), np.full_like(x, c1_lo), p_hi, p_lo)
        p_hi, p_lo = _two_prod_dwf(p_hi, p_lo, x)
        p_hi, p_lo = _fast_two_sum_dw(np.full_like(x, c0_hi), np.full_like(x, c0_lo), p_hi, p_lo)
        return _two_prod_dwf(p_hi, p_lo, x)
    q12, q10, q8, q6 = 2.87074255468000586e-9, 2.38957980901884082e-8, 2.31032094540014656e-7, 2.27279857398537278e-6
    q4, q2, q0 = 2.31271023278625638e-5, 2.47556738444535513e-4, 2.88543873228900172e-3
    c_hi, c_lo = 0.0400377511598501157, -4.77726582251425391e-19
    k_hi, k_lo = 2.88539008177792677, 4.07660016854549667e-17
    full = lambda v: np.full_like(m, v)  # noqa: E731
    t_hi, t_lo = _two_prod_dwf(full(k_hi), full(k_lo), m - one)  # c * (x - 1)
    # doubleword_div_fp(t, x + 1)
    y = m + one
    r_hi = t_hi / y
    pi_hi, pi_lo = _two_prod(r_hi, y)
    r_lo = (((t_hi - pi_hi) - pi_lo) + t_lo) / y
    r_hi, r_lo = _fast_two_sum(r_hi, r_lo)
    r2_hi, r2_lo = _two_prod_dw(r_hi, r_lo, r_hi, r_lo)
    r4_hi, _ = _two_prod_dw(r2_hi, r2_lo, r2_hi, r2_lo)
    q_even = q12 * r4_hi + q8
    q_odd = q10 * r4_hi + q6
    q_even = q_even * r4_hi + q4
    q_odd = q_odd * r4_hi + q2
    q_even = q_even * r4_hi + q0
    q = q_odd * r2_hi + q_even
    p_hi, p_lo = _two_prod_dwf(r2_hi, r2_lo, q)
    p1_hi, p1_lo = _fast_two_sum_dw(full(c_hi), full(c_lo), p_hi, p_lo)
    p2_hi, p2_lo = _two_prod_dw(r2_hi, r2_lo, p1_hi, p1_lo)
    p3_hi, p3_lo = _fast_two_sum_fdw(full(1.0), p2_hi, p2_lo)
    return _two_prod_dw(p3_hi, p3_lo, r_hi, r_lo)


def _pround(a):
    """Eigen's AVX ``pround``: trunc(a + copysign(0.5 - ulp/2, a)), the add rounded."""
    if a.dtype == np.float32:
        prev_half = np.array(0x3EFFFFFF, np.uint32).view(np.float32)[()]
    else:
        prev_half = np.array(0x3FDFFFFFFFFFFFFF, np.uint64).view(np.float64)[()]
    return np.trunc(np.copysign(prev_half, a) + a)


def _pldexp(a, e, lanes: int):
    """Eigen's ``a * 2**e`` in ``generic_pow_impl``: ``pldexp_fast`` (one multiply) when no lane
    of the packet has ``|e| > max_exponent - 2``, else ``pldexp`` (four multiplies)."""
    max_exponent = 128 if a.dtype == np.float32 else 1024
    unsafe = (np.abs(e) > max_exponent - 2).reshape(-1, lanes).any(axis=1).repeat(lanes)
    one = np.ones_like(a)
    if not unsafe.any():
        return a * np.ldexp(one, e.astype(np.int32))
    limit = 278 if a.dtype == np.float32 else 2099
    e_int = np.clip(e, -limit, limit).astype(np.int32)
    b = e_int >> 2  # floor(e / 4)
    c = np.ldexp(one, b)
    slow = ((a * c) * c) * c * np.ldexp(one, e_int - 3 * b)
    fast = a * np.ldexp(one, np.clip(e, -limit, limit).astype(np.int32))
    return np.where(unsafe, slow, fast)


def _pexp(x0):
    """Eigen's ``pexp_float`` / ``pexp_double`` (argument here within [-1, 1])."""
    t = x0.dtype.type
    if x0.dtype == np.float32:
        x = np.minimum(x0, t(88.723))
        m = np.floor(x * t(1.44269504088896341) + t(0.5))
        r = m * t(-0.693359375) + x
        r = m * t(2.12194440e-4) + r
        r2 = r * r
        p_even = r2 * t(1.37449637986719608306884765625e-3) + t(4.166965186595916748046875e-2)
        p_odd = r2 * t(8.36894474923610687255859375e-3) + t(0.16666518151760101318359375)
        p_even = r2 * p_even + t(0.49999988079071044921875)
        p_low = r + t(1)
        y = r * p_odd + p_even
        y = r2 * y + p_low
        return np.maximum(y * np.ldexp(np.ones_like(y), m.astype(np.int32)), x0)  # pldexp_fast: |x| <= 87
    x = np.minimum(x0, t(709.784))
    fx = np.floor(t(1.4426950408889634073599) * x + t(0.5))
    x = (x - fx * t(0.693145751953125)) - fx * t(1.42860682030941723212e-6)
    x2 = x * x
    px = t(1.26177193074810590878e-4) * x2 + t(3.02994407707441961300e-2)
    px = px * x2 + t(9.99999999999999999910e-1)
    px = px * x
    qx = t(3.00198505138664455042e-6) * x2 + t(2.52448340349684104192e-3)
    qx = qx * x2 + t(2.27265548208155028766e-1)
    qx = qx * x2 + t(2.00000000000000000009e0)
    x = px / (qx - px)
    x = t(2) * x + t(1)
    return np.maximum(x * np.ldexp(np.ones_like(x), fx.astype(np.int32)), x0)  # pldexp_fast: |x| <= 708


def _eigen_pow(x: np.ndarray, y: np.floating) -> np.ndarray:
    """Eigen's packet ``generic_pow(x, y)`` (AVX, no FMA) for float32/float64 ``x`` and scalar ``y``."""
    t = x.dtype.type
    y = t(y)
    with np.errstate(all="ignore"):
        x_abs = np.abs(x)
        # generic_pow_impl(|x|, y)
        m_x, e_int = np.frexp(x_abs)
        e_x = e_int.astype(x.dtype)
        scale = m_x < t(0.70710678118654752440)
        m_x = np.where(scale, t(2) * m_x, m_x)
        e_x = np.where(scale, e_x - t(1), e_x)
        rx_hi, rx_lo = _accurate_log2(m_x)
        f1_hi, f1_lo = _two_prod(e_x, np.full_like(e_x, y))
        f2_hi, f2_lo = _two_prod_dwf(rx_hi, rx_lo, np.full_like(e_x, y))
        f_hi, f_lo = _fast_two_sum_dw(f1_hi, f1_lo, f2_hi, f2_lo)
        n_z = _pround(f_hi)
        r_z = (f_hi - n_z) + f_lo
        n_r = _pround(r_z)
        r_z = r_z - n_r
        n_z = n_z + n_r
        # generic_exp2(r_z)
        digits, max_exp = (24, 128) if x.dtype == np.float32 else (53, 1024)
        r = np.maximum(np.minimum(r_z, t(max_exp + 1)), t(-(max_exp + digits - 1)))
        p_hi, p_lo = _two_prod(np.full_like(r, t(math.log(2))), r)
        e_r = _pexp(p_hi) * (t(1) + p_lo)
        result = _pldexp(e_r, n_z, 8 if x.dtype == np.float32 else 4)
        # The special cases of generic_pow, in its order.
        y_is_int = math.isfinite(y) and math.floor(y) == y
        y_is_odd_int = y_is_int and _pround(np.array([y * t(0.5)]))[0] != y * t(0.5)
        huge = (max_exp * math.log(2)) / float(np.finfo(x.dtype).eps)
        result = np.where((x < 0) & (not y_is_int), t(np.nan), result)
        result = np.where(x == 0, t(np.inf) if y < 0 else t(0), result)
        if y_is_odd_int:
            result = np.where(np.signbit(x), -result, result)
        if abs(y) >= huge:
            inf_y = np.where(((y < 0) & (x == 0)) | ((y < 0) ^ (x_abs > 1)), t(np.inf), t(0))
            result = np.where(x == -1, t(1), inf_y)
        pos_inf_value = t(0) if y < 0 else t(np.inf)
        neg_inf_value = -pos_inf_value if y_is_odd_int else pos_inf_value
        result = np.where(x_abs == np.inf, np.where(x < 0, neg_inf_value, pos_inf_value), result)
        result = np.where(np.isnan(x) | bool(np.isnan(y)), t(np.nan), result)
        if y == 1:
            return x.copy()
        return np.where((x == 1) | (y == 0), t(1), result).astype(x.dtype)


class Adadelta(_KerasOptimizer):
    """``keras.optimizers.Adadelta``: a = rho a + (1 - rho) g^2; d = -(sqrt(b + eps) g) / sqrt(a + eps);
    b = rho b + (1 - rho) d^2; w += lr d."""

    slot_names = ("accumulated_grad", "accumulated_delta_var")

    def _validate(self, spec):
        # Keras checks neither; OptimizerSpec.validate holds rho to [0, 1) and epsilon to >= 0.
        _hyper(spec, "rho")
        _hyper(spec, "epsilon")

    def _more_constants(self, spec, dtype):
        return {  # Python floats as operands of ops: converted directly
            "ad_rho": _direct(spec.rho, dtype),
            "ad_one_minus_rho": _direct(1 - spec.rho, dtype),  # 1 - rho, by Python
            "ad_epsilon": _direct(spec.epsilon, dtype),
        }

    def _step(self, w, g, state, iterations, c):
        rho, one_minus_rho, epsilon = c["ad_rho"], c["ad_one_minus_rho"], c["ad_epsilon"]
        accumulated_grad = np.multiply(state["accumulated_grad"], rho)
        np.add(accumulated_grad, np.multiply(np.square(g), one_minus_rho), out=accumulated_grad)
        rms_delta = np.add(state["accumulated_delta_var"], epsilon)  # rms(x) = sqrt(x + eps)
        np.sqrt(rms_delta, out=rms_delta)
        delta = np.multiply(rms_delta, g, out=rms_delta)
        rms_grad = np.add(accumulated_grad, epsilon)
        np.sqrt(rms_grad, out=rms_grad)
        np.divide(delta, rms_grad, out=delta)
        np.negative(delta, out=delta)
        accumulated_delta = np.multiply(state["accumulated_delta_var"], rho)
        np.add(accumulated_delta, np.multiply(np.square(delta), one_minus_rho, out=rms_grad), out=accumulated_delta)
        step = np.multiply(delta, c["lr"], out=delta)  # assign_add(w, lr * delta)
        return np.add(w, step, out=step), {"accumulated_grad": accumulated_grad,
                                          "accumulated_delta_var": accumulated_delta}


class Lamb(_KerasOptimizer):
    """``keras.optimizers.Lamb``: Adam's moments, update = m_hat / (sqrt(v_hat) + eps), and
    w -= (ratio lr) update, the trust ratio ||w|| / ||update|| of the whole variable (1 where
    either norm is 0)."""

    slot_names = ("m", "v")

    def _validate(self, spec):
        _check_adam_like(spec)

    def _more_constants(self, spec, dtype):
        return {
            "lamb_beta_1": _via_float32(spec.beta_1, dtype),  # ops.cast(self.beta_1, dtype), for the power
            "lamb_beta_2": _via_float32(spec.beta_2, dtype),
            "lamb_one_minus_beta_1": _direct(1 - spec.beta_1, dtype),  # 1 - self.beta_1, by Python
            "lamb_one_minus_beta_2": _direct(1 - spec.beta_2, dtype),
            "lamb_epsilon": _direct(spec.epsilon, dtype),
            "lamb_two": _direct(2, dtype),  # ops.power(x, 2)
        }

    def _step(self, w, g, state, iterations, c):
        one = c["one"]
        local_step = _local_step(iterations + 1, w.dtype)
        beta_1_power = _scalar_pow(c["lamb_beta_1"], local_step)
        beta_2_power = _scalar_pow(c["lamb_beta_2"], local_step)
        m, v = _moments(g, state, c["lamb_one_minus_beta_1"], c["lamb_one_minus_beta_2"])
        update = np.divide(m, one - beta_1_power)  # m_t_hat
        v_sqrt = np.divide(v, one - beta_2_power)
        np.sqrt(v_sqrt, out=v_sqrt)
        np.add(v_sqrt, c["lamb_epsilon"], out=v_sqrt)
        np.divide(update, v_sqrt, out=update)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            w_norm = np.sqrt(tf_sum(_tf_pow(w, c["lamb_two"]).ravel()))  # sqrt(sum(power(w, 2)))
            g_norm = np.sqrt(tf_sum(_tf_pow(update, c["lamb_two"]).ravel()))
            ratio = w_norm / g_norm if w_norm > 0 and g_norm > 0 else one
        np.multiply(update, ratio * c["lr"], out=update)  # ratio * lr * update
        return np.subtract(w, update, out=update), {"m": m, "v": v}


class Adafactor(_KerasOptimizer):
    """``keras.optimizers.Adafactor``: a variable of 2 or more dimensions keeps its second moment
    factored over its last two axes (``r``: the mean over the last, ``c``: over the one before,
    each a state entry of its own shape); one of fewer keeps it whole (slot ``v``). The step
    is scaled by max(epsilon_2, rms(w)) min(lr, 1 / sqrt(t)) and clipped by rms(update) /
    clip_threshold. ``relative_step`` changes nothing Keras computes: its min(lr, 1 / sqrt(t))
    is taken again in every step either way."""

    slot_names = ("v",)

    def _validate(self, spec):
        for name in ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold"):
            _hyper(spec, name)  # Keras checks none of them

    def _more_constants(self, spec, dtype):
        return {
            "af_epsilon_1": _direct(spec.epsilon_1, dtype),  # ops.add(square(g), self.epsilon_1)
            "af_epsilon_2": _via_float32(spec.epsilon_2, dtype),  # ops.cast(self.epsilon_2, dtype)
            "af_beta_2_decay": _direct(spec.beta_2_decay, dtype),  # ops.power(local_step, self.beta_2_decay)
            "af_clip_threshold": _direct(spec.clip_threshold, dtype),
        }

    def init_state(self, value):
        state = super().init_state(value)
        if value.ndim >= 2:  # Keras' add_variable: zeros
            state["r"] = np.zeros(value.shape[:-1], value.dtype)
            state["c"] = np.zeros(value.shape[:-2] + value.shape[-1:], value.dtype)
        return state

    def _step(self, w, g, state, iterations, c):
        one = c["one"]
        local_step = _local_step(iterations + 1, w.dtype)
        rho_t = np.minimum(c["lr"], one / np.sqrt(local_step))
        alpha_t = np.maximum(c["af_epsilon_2"], _rms(w)) * rho_t
        regulated_grad_square = np.square(g)
        np.add(regulated_grad_square, c["af_epsilon_1"], out=regulated_grad_square)
        beta_2_t = one - _scalar_pow(local_step, c["af_beta_2_decay"])
        slots = {}
        if w.ndim >= 2:
            for name, axis in (("r", -1), ("c", -2)):
                moment = state.get(name)
                want = w.shape[:-1] if axis == -1 else w.shape[:-2] + w.shape[-1:]
                if not isinstance(moment, np.ndarray) or moment.shape != want or moment.dtype != w.dtype:
                    raise InvalidArgument(f"state {name!r} of adafactor must be {w.dtype}{list(want)}")
                mean = _tf_mean(regulated_grad_square, axis).reshape(want)
                slots[name] = beta_2_t * moment + (one - beta_2_t) * mean
            r = slots["r"] / _tf_mean(slots["r"], -1)
            v = r[..., np.newaxis] * np.expand_dims(slots["c"], -2)
        else:
            v = np.multiply(state["v"], beta_2_t)
            np.add(v, np.multiply(regulated_grad_square, one - beta_2_t), out=v)
        u_t = np.divide(g, np.sqrt(v))
        np.divide(u_t, np.maximum(one, _rms(u_t) / c["af_clip_threshold"]), out=u_t)  # u_t_hat
        np.multiply(u_t, alpha_t, out=u_t)
        return np.subtract(w, u_t, out=u_t), {**slots, "v": v}


def _tf_mean(x: np.ndarray, axis: int | None) -> np.ndarray:
    """``ops.mean(x, axis, keepdims=True)`` (``axis`` None, -1 or -2) as Keras' TensorFlow backend
    computes it: float16 in float32 (Keras casts), TensorFlow's sum divided by the count, cast back.
    The sum over the last axis (or all) is Eigen's (``tf_sum_range``); over the one before,
    ``_tf_sum_columns``."""
    y = x.astype(np.float32) if x.dtype == np.float16 else x
    if axis == -2:
        sums = _tf_sum_columns(y)
        count = x.shape[-2]
    else:
        rows = y.reshape(-1, y.shape[-1] if axis == -1 and y.ndim else y.size)
        sums = np.array([tf_sum_range(row, 0, row.size) for row in rows], y.dtype)
        sums = sums.reshape(x.shape[:-1] + (1,) if axis == -1 else (1,) * x.ndim)
        count = rows.shape[1]
    return (sums / y.dtype.type(count)).astype(x.dtype)


def _tf_sum_columns(y: np.ndarray) -> np.ndarray:
    """``reduce_sum(y, axis=-2, keepdims=True)`` of a float32/float64 ``y`` (rows R, columns C) in
    Eigen's order. The outputs (batch, column), row-major, go by AVX packets (8 float32 or 4
    float64) from the first; a packet that lies within one batch's columns is summed as a packet,
    over R >= 16 rows with four accumulators (rows j, j+1, j+2, j+3) folded as ((a0 + a1) + a2) + a3,
    then the last R % 4 rows added in order (measured against TensorFlow 2.21); every other output (a packet across two batches, the
    last outputs after the last whole packet, or R < 16) adds its rows in order."""
    rows, columns = y.shape[-2], y.shape[-1]
    in_order = np.add.accumulate(y, axis=-2)[..., -1:, :]
    lanes = 32 // y.dtype.itemsize
    if rows < 16:
        return in_order
    whole = rows // 4 * 4
    a0, a1, a2, a3 = (np.add.accumulate(y[..., k:whole:4, :], axis=-2)[..., -1:, :] for k in range(4))
    packed = ((a0 + a1) + a2) + a3
    for j in range(whole, rows):
        packed = packed + y[..., j:j + 1, :]
    start = np.arange(in_order.size) // lanes * lanes  # each output's packet
    by_packet = (start + lanes <= in_order.size) & (start % columns + lanes - 1 < columns)
    return np.where(by_packet.reshape(in_order.shape), packed, in_order)


def _rms(x: np.ndarray) -> np.floating:
    """Adafactor's ``_rms``: ``sqrt(mean(square(x)))``, in x's dtype."""
    return np.sqrt(_tf_mean(np.square(x), None).reshape(()))[()]


class ScheduleFreeAdamW(_KerasOptimizer):
    """``keras.optimizers.ScheduleFreeAdamW``: an Adam step on the sequence ``momentum`` (which
    starts at the variable's initial value), the variable the interpolation of ``momentum`` and
    the average ``x`` it recovers from them (Defazio et al., 2024).

    As Keras 3.15 computes it: its ``momentum_old`` is the variable ``momentum`` itself, read
    after its update, so the ``x`` recovered is ``(y - (1 - b1) m_new) / b1``. Warmup scales the
    rate by ``min(t / warmup_steps, 1)`` while ``warmup_steps`` > 0."""

    slot_names = ("momentum", "velocity")

    def _validate(self, spec):
        _check_unit_interval(spec, "beta_1", closed_at_one=True)  # Keras divides by it
        _check_unit_interval(spec, "beta_2")
        if _hyper(spec, "epsilon") < 0:
            raise InvalidArgument(f"epsilon must be >= 0; got {spec.epsilon!r}")
        if isinstance(spec.warmup_steps, bool) or not isinstance(spec.warmup_steps, int):
            raise InvalidArgument(f"warmup_steps must be an integer; got {spec.warmup_steps!r}")

    def _more_constants(self, spec, dtype):
        beta_1, beta_2, one = _via_float32(spec.beta_1, dtype), _via_float32(spec.beta_2, dtype), _direct(1, dtype)
        return {
            "sf_beta_1": beta_1,  # ops.cast(self.beta_1, dtype)
            "sf_beta_2": beta_2,
            "sf_one_minus_beta_1": one - beta_1,  # 1 - beta_1 with beta_1 a tensor
            "sf_one_minus_beta_2": one - beta_2,
            "sf_epsilon": _via_float32(spec.epsilon, dtype),  # ops.cast(self.epsilon, dtype)
            "sf_warmup_steps": _via_float32(spec.warmup_steps, dtype),
        }

    def _initial_slots(self, value):
        return {"momentum": value.copy(), "velocity": np.zeros_like(value)}  # Keras: assign(momentum, copy(var))

    def _step(self, w, g, state, iterations, c):
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # float16's inf and NaN, as Keras'
            return self._interpolate(w, *self._moments_step(g, np.square(g), state, iterations, c), c)

    def _slices_step(self, w, occ, state, iterations, c):
        # square(g) - v densifies the occurrences' squares, summed; lr * g / denom is taken per
        # occurrence at its row's denominator, and assign_sub scatters it into momentum.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return self._interpolate(w, *self._moments_step(occ, occ.dense(np.square(occ.values)), state,
                                                            iterations, c), c)

    def _moments_step(self, g, squared, state, iterations, c):
        """(new momentum, new velocity, 1 / t) for gradient ``g`` (an array, or ``Occurrences``)."""
        one, lr = c["one"], c["lr"]
        local_step = _local_step(iterations + 1, squared.dtype)
        if self.spec.warmup_steps > 0:
            lr = lr * np.minimum(local_step / c["sf_warmup_steps"], one)
        with np.errstate(under="ignore"):
            bias_correction_2 = one - _scalar_pow(c["sf_beta_2"], local_step)
        v = np.subtract(squared, state["velocity"], out=squared)
        np.multiply(v, c["sf_one_minus_beta_2"], out=v)
        np.add(state["velocity"], v, out=v)  # assign_add(velocity, (g^2 - v) * (1 - beta_2))
        denominator = np.divide(v, bias_correction_2)
        np.sqrt(denominator, out=denominator)
        np.add(denominator, c["sf_epsilon"], out=denominator)
        if isinstance(g, np.ndarray):
            scaled = np.multiply(lr, g)
            momentum = np.subtract(state["momentum"], np.divide(scaled, denominator, out=scaled))
        else:
            scaled = np.divide(np.multiply(lr, g.values), g.gather(denominator))
            momentum = g.scatter_sub(state["momentum"], scaled)
        return momentum, v, one / local_step

    def _interpolate(self, y, momentum, v, weight, c):
        """y_new = (1 - b1) m + b1 ((1 - 1/t) x + m / t), x = (y - (1 - b1) m) / b1, as Keras writes it."""
        one_minus_beta_1, beta_1 = c["sf_one_minus_beta_1"], c["sf_beta_1"]
        x = np.multiply(one_minus_beta_1, momentum)
        np.subtract(y, x, out=x)
        np.divide(x, beta_1, out=x)
        np.multiply(c["one"] - weight, x, out=x)
        x += np.multiply(weight, momentum)  # x_new = (1 - weight) x_old + weight m
        new_y = np.multiply(one_minus_beta_1, momentum)
        np.multiply(beta_1, x, out=x)
        np.add(new_y, x, out=new_y)
        return new_y, {"momentum": momentum, "velocity": v}
