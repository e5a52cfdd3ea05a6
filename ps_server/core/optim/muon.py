"""Keras 3's ``Muon`` on the server: a matrix's momentum orthogonalized (Newton-Schulz), an AdamW
step for every other variable.

    spec = OptimizerSpec.from_keras("Muon", keras.optimizers.Muon(exclude_layers=["head"]).get_config())
    opt = make_optimizer(spec)                      # ps_server.core.optim.registry
    state = opt.of("dense/kernel").init_state(value)
    value, state = opt.of("dense/kernel").apply(value, grad, state)

Which rule steps a variable is Keras' ``Muon._should_use_adamw``: the AdamW rule for a variable
that is not 2-D, or whose name holds "embedding" (in any case) with ``exclude_embeddings``, or in
which ``re.search`` finds a pattern of ``exclude_layers``; the Muon rule for every other. Keras
reads the variable's path, and the server's name of a variable is that path (every front door
of tfps names a variable by ``v.path``), so ``of(name)`` chooses as Keras does, and the rank
at ``init_state``. As in Keras, the state then says which rule a variable takes: a
``velocity`` slot beside ``momentum`` is the AdamW rule's. The two rules are two ``Optimizer``
objects, so where a Muon is one group of several (``OptimizerSpec.groups``) the store refuses
its ``global_clipnorm`` as it refuses one across optimizers.

The Muon rule, Keras' ``_muon_update_step`` in its order: ``m += g + m * (momentum - 1)``;
``u = g + momentum * m`` (``nesterov``; else ``m``); ``X = u / (||u||_F + 1e-7)`` (a tall ``u``
transposed, and ``X`` back at the end), then ``ns_steps`` times ``A = X X^T``,
``X = a X + (b A + (c A) A) X`` (``muon_a``, ``muon_b``, ``muon_c``); ``w -= ((lr X) *
sqrt(max(rows, cols))) * rms_rate`` (``rms_rate`` None: ``w -= lr X``), ``w`` decayed first by
``weight_decay``. The AdamW rule: Adam's step (``adam_beta_1``, ``adam_beta_2``, ``epsilon``)
at the learning rate times ``adam_lr_ratio``, ``w`` decayed first by ``adam_weight_decay`` at
the learning rate itself. The options (clipping, EMA, schedules) are ``Optimizer.apply``'s.

Guarantee, against eager Keras 3.15 on TensorFlow 2.21 CPU, float32: the AdamW rule's variables
and every slot are bit-identical (the momentum does not depend on the variable), and so is
every operation of the Muon rule but its matrix products (the Frobenius norm is TensorFlow's
sum, ``tf_sum``): TensorFlow's CPU MatMul (blocked kernels with fused multiply-adds, chosen
by shape and CPU) and NumPy's BLAS add a product's terms in other orders, each product a few units in the last place
apart, and no NumPy order reproduces TensorFlow's for every shape. The variable moves by ``lr``
times that, so a Muon-rule variable ends within 1e-6 of Keras' relative to its largest element
after 20 updates (``tests/core/test_muon.py``; measured: at most 2e-7, a few units in the last
place). Keras' Muon rule fails on float64 (it multiplies by a float32 ``sqrt(max(rows, cols))``)
and takes float16 through float32; here both run in the variable's dtype, not compared.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from ps_server.core.errors import InvalidArgument
from ps_server.core.optim.more_optimizers import _KerasOptimizer, _check_unit_interval, _direct, _hyper
from ps_server.core.optim.optimizers import Adam, Optimizer, OptimizerSpec, _check_float_array, tf_sum


class Muon(_KerasOptimizer):
    """``keras.optimizers.Muon``: the Muon rule here (``slot_names``), the AdamW rule ``adamw``'s."""

    slot_names = ("momentum",)

    def __init__(self, spec: OptimizerSpec):
        super().__init__(spec)
        try:
            self._patterns = [re.compile(p) for p in spec.exclude_layers]
        except re.error as e:
            raise InvalidArgument(f"exclude_layers holds a pattern that is not a regular expression ({e})") from None
        # 0 is None (no decay) in a spec, where None would be Muon's default
        self.adamw = MuonAdamW(dataclasses.replace(spec, weight_decay=spec.adam_weight_decay or 0))

    def _validate(self, spec):
        # Keras checks none of them; betas as Adam's, and the counts and decays Keras can run.
        _check_unit_interval(spec, "adam_beta_1")
        _check_unit_interval(spec, "adam_beta_2")
        if _hyper(spec, "epsilon") < 0:
            raise InvalidArgument(f"epsilon must be >= 0; got {spec.epsilon!r}")
        if spec.adam_weight_decay is not None and _hyper(spec, "adam_weight_decay") < 0:
            raise InvalidArgument(f"adam_weight_decay must be >= 0; got {spec.adam_weight_decay!r}")
        if isinstance(spec.ns_steps, bool) or not isinstance(spec.ns_steps, int) or spec.ns_steps < 0:
            raise InvalidArgument(f"ns_steps must be an integer >= 0; got {spec.ns_steps!r}")

    def _more_constants(self, spec, dtype):
        return {  # Python floats as operands of ops: converted directly
            "mu_minus_one": _direct(spec.momentum - 1, dtype),  # m * (self.momentum - 1), Python's difference
            "mu": _direct(spec.momentum, dtype),  # self.momentum * m
            "ns_a": _direct(spec.muon_a, dtype),
            "ns_b": _direct(spec.muon_b, dtype),
            "ns_c": _direct(spec.muon_c, dtype),
            "ns_epsilon": _direct(1e-7, dtype),  # norm + 1e-7
            "rms_rate": None if spec.rms_rate is None else _direct(spec.rms_rate, dtype),
        }

    def of(self, name: str) -> Optimizer:
        """``adamw`` for a variable Keras steps by AdamW by its name, else as ``Optimizer.of``."""
        stepper = super().of(name)
        if stepper is self and ((self.spec.exclude_embeddings and "embedding" in name.lower())
                                or any(p.search(name) for p in self._patterns)):
            return self.adamw
        return stepper

    def init_state(self, value: np.ndarray) -> dict:
        """The Muon rule's ``momentum`` for a matrix; the AdamW rule's slots for any other rank."""
        _check_float_array("variable", value)
        if value.ndim != 2:
            return self.adamw.init_state(value)
        return super().init_state(value)

    def apply(self, value, grad, state, *args, **kwargs):
        """``Optimizer.apply``, by the AdamW rule where ``state`` has its ``velocity`` (as Keras decides)."""
        if isinstance(state, dict) and "velocity" in state:
            return self.adamw.apply(value, grad, state, *args, **kwargs)
        return super().apply(value, grad, state, *args, **kwargs)

    def _step(self, w, g, state, iterations, c):
        if w.ndim != 2:
            raise InvalidArgument(f"muon's Muon rule steps a matrix; a variable of shape {list(w.shape)} takes its "
                                  "AdamW rule (a 'velocity' slot)")
        m = np.multiply(state["momentum"], c["mu_minus_one"])
        np.add(g, m, out=m)
        np.add(state["momentum"], m, out=m)  # assign_add(m, g + m * (momentum - 1))
        u = np.add(g, np.multiply(m, c["mu"])) if self.spec.nesterov else m
        update = np.multiply(self._orthogonalized(u, c), c["lr"])
        if c["rms_rate"] is not None:  # lr_adjust: sqrt of the larger side, a float32 in Keras
            np.multiply(update, np.sqrt(np.float32(max(w.shape))).astype(w.dtype), out=update)
            np.multiply(update, c["rms_rate"], out=update)
        return np.subtract(w, update, out=update), {"momentum": m}

    def _slices_step(self, w, occ, state, iterations, c):
        # g + m * (momentum - 1) densifies the occurrences, summed; so does g + momentum * m
        return self._step(w, occ.dense(), state, iterations, c)

    def _orthogonalized(self, x: np.ndarray, c: dict) -> np.ndarray:
        """Keras' ``zeropower_via_newtonschulz5`` of matrix ``x``: a new C-ordered array."""
        tall = x.shape[0] > x.shape[1]
        if tall:
            x = x.T
        x = x / (np.sqrt(tf_sum(np.square(x).ravel())) + c["ns_epsilon"])  # the Frobenius norm, TensorFlow's sum
        for _ in range(self.spec.ns_steps):
            gram = x @ x.T
            x = c["ns_a"] * x + (c["ns_b"] * gram + (c["ns_c"] * gram) @ gram) @ x
        return np.ascontiguousarray(x.T) if tall else x


class MuonAdamW(Optimizer):
    """Muon's AdamW rule: Adam's step, its ``m`` and ``v`` kept as Keras' ``momentum`` and
    ``velocity``; ``spec.weight_decay`` is the Muon spec's ``adam_weight_decay``."""

    slot_names = ("momentum", "velocity")

    def __init__(self, spec: OptimizerSpec):
        super().__init__(spec)
        self._adam = Adam(OptimizerSpec("adam", learning_rate=spec.learning_rate, beta_1=spec.adam_beta_1,
                                        beta_2=spec.adam_beta_2, epsilon=spec.epsilon))

    def _step(self, w, g, state, iterations, c):
        return self._adam_rule(self._adam._step, w, g, state, iterations, c)

    def _slices_step(self, w, occ, state, iterations, c):
        return self._adam_rule(self._adam._slices_step, w, occ, state, iterations, c)

    def _adam_rule(self, step, w, g, state, iterations, c):
        # learning_rate * self.adam_lr_ratio: the float32 rate times the ratio, then cast to the variable's dtype
        lr = (np.float32(c["lr"]) * np.float32(self.spec.adam_lr_ratio)).astype(w.dtype)
        new_w, slots = step(w, g, {"m": state["momentum"], "v": state["velocity"]}, iterations,
                            {**self._adam._constants[w.dtype], "lr": lr})
        return new_w, {"momentum": slots["m"], "velocity": slots["v"]}
