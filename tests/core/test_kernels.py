"""The fused optimizer steps compute the NumPy steps' bits, and the NumPy steps stay when they cannot run.

    python -m pytest tests/core/test_kernels.py -q

Each fused-path test runs ``Optimizer.apply`` twice on the same data (random, or NaN,
inf and overflowing values), once with ``ps_server.core.optim.kernels`` and once with
``kernels.ENABLED = False`` (the NumPy ufuncs, which ``test_optimizers.py`` and
``test_more_optimizers.py`` check against Keras), and compares every value and slot
bit for bit. They are skipped where numba is not installed (the ``fast`` extra, part
of ``test``); the fallback tests run everywhere. Arrays must be C-contiguous for the
fused path (a strided one takes the NumPy step, tested too).
"""

import platform
import re
import subprocess
import sys

import numpy as np
import pytest

from ps_server.core.optim import kernels
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.registry import make_optimizer

try:
    import numba  # noqa: F401
    HAVE_NUMBA = True
except ImportError:
    HAVE_NUMBA = False

needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="numba (the fast extra) not installed")

SPECS = {
    "sgd": OptimizerSpec("sgd", 0.1),
    "sgd_momentum": OptimizerSpec("sgd", 0.1, momentum=0.9),
    "sgd_nesterov": OptimizerSpec("sgd", 0.1, momentum=0.9, nesterov=True),
    "adam": OptimizerSpec("adam", 1e-3),
    "adam_amsgrad": OptimizerSpec("adam", 1e-3, amsgrad=True),
    "adam_unusual": OptimizerSpec("adam", 0.3, beta_1=0.5, beta_2=0.75, epsilon=1e-3),
    "adamw": OptimizerSpec("adamw", 1e-3, weight_decay=0.004),
    "adamw_amsgrad": OptimizerSpec("adamw", 1e-3, weight_decay=0.01, amsgrad=True),
    "adagrad": OptimizerSpec("adagrad", 0.1),
    "rmsprop": OptimizerSpec("rmsprop", 0.01),
    "rmsprop_momentum": OptimizerSpec("rmsprop", 0.01, momentum=0.5),
    "rmsprop_centered": OptimizerSpec("rmsprop", 0.01, centered=True),
    "rmsprop_momentum_centered": OptimizerSpec("rmsprop", 0.01, momentum=0.5, centered=True),
    "adamax": OptimizerSpec("adamax", 1e-2),
    "nadam": OptimizerSpec("nadam", 1e-2),
    "lion": OptimizerSpec("lion", 1e-3),
}
SHAPES = [(), (1,), (7,), (3, 5, 2), (1031,)]
STEPS = 4


def _bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32 if x.dtype == np.float32 else np.uint64)


def _gradients(shape, dtype, seed: int) -> list[np.ndarray]:
    """Gradients of mixed scales, with zeros and signed zeros among them (and, for
    float32, subnormals), so that rounding, 0/0-free paths and signs all get exercised."""
    rng = np.random.default_rng(seed)
    grads = []
    for k in range(STEPS):
        g = np.array(rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 3, size=shape), dtype)
        flat = g.reshape(-1)
        flat[::5] = 0
        flat[1::7] = -0.0
        if dtype == np.float32 and flat.size > 3:
            flat[3::11] = np.float32(1e-40) * (k + 1)  # subnormal
        grads.append(g)
    return grads


def _run(spec, shape, dtype, seed=0):
    """(value, state) after STEPS applies, and the arrays handed in, for a check that they are untouched."""
    opt = make_optimizer(spec)
    rng = np.random.default_rng(seed + 1)
    value = np.array(rng.standard_normal(shape), dtype)
    state = opt.init_state(value)
    handed_in = []
    for g in _gradients(shape, dtype, seed):
        handed_in.append((value, g, dict(state), value.copy(), g.copy(),
                          {k: v.copy() for k, v in state.items() if isinstance(v, np.ndarray)}))
        value, state = opt.apply(value, g, state)
    return value, state, handed_in


def _assert_same_bits(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert np.array_equal(_bits(a), _bits(b)), f"{what}: {a!r} != {b!r}"


@pytest.fixture(autouse=True)
def every_size_fused(monkeypatch):
    """These tests compare the fused path on small arrays: no size threshold here."""
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 0)


def test_small_variables_take_the_numpy_step_so_a_small_model_never_imports_numba(monkeypatch):
    monkeypatch.setattr(kernels, "MIN_ELEMENTS", 1 << 20)
    w = np.ones(1000, np.float32)
    assert kernels.sgd(w, w, np.float32(0.1)) is None


@needs_numba
def test_the_fused_path_runs_where_numba_is_installed():
    assert kernels.available()
    w = np.ones(3, np.float32)
    assert kernels.sgd(w, w, np.float32(0.5)) is not None


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", SPECS)
def test_fused_step_is_bit_identical_to_the_numpy_step(name, shape, dtype, monkeypatch):
    fused_value, fused_state, _ = _run(SPECS[name], shape, dtype)
    monkeypatch.setattr(kernels, "ENABLED", False)
    numpy_value, numpy_state, _ = _run(SPECS[name], shape, dtype)
    _assert_same_bits(fused_value, numpy_value, "value")
    assert fused_state.keys() == numpy_state.keys()
    for k, v in numpy_state.items():
        if isinstance(v, np.ndarray):
            _assert_same_bits(fused_state[k], v, f"slot {k}")
        else:
            assert fused_state[k] == v, k


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", SPECS)
def test_nan_inf_and_overflow_give_the_numpy_steps_bits_nan_payloads_included(name, dtype, monkeypatch):
    big = np.finfo(dtype).max / 4
    value = np.array([1, -1, 0, 2, np.inf, -np.inf, np.nan, 3, big, -1e-30, 5, 6, 7, 8, 9, 10, 11], dtype)
    grads = [np.array([np.nan, np.inf, -np.inf, 0, 1, -1, 2, np.nan, big, -0.0, 0, 1, 2, 3, -4, np.inf, np.nan],
                      dtype), np.full(value.shape, 0.5, dtype)]

    def steps():
        opt = make_optimizer(SPECS[name])
        w, state = value, opt.init_state(value)
        with np.errstate(all="ignore"):
            for g in grads:
                w, state = opt.apply(w, g, state)
        return w, state

    fused_value, fused_state = steps()
    monkeypatch.setattr(kernels, "ENABLED", False)
    numpy_value, numpy_state = steps()
    _assert_same_bits(fused_value, numpy_value, "value")
    for k, v in numpy_state.items():
        if isinstance(v, np.ndarray):
            _assert_same_bits(fused_state[k], v, f"slot {k}")


@needs_numba
@pytest.mark.parametrize("name", ["sgd_nesterov", "adam_amsgrad", "rmsprop_momentum_centered", "lion"])
def test_a_step_split_across_threads_has_the_bits_of_one_pass(name, monkeypatch):
    # Elementwise loops: each thread's share computes what the whole loop computes there.
    one_thread, one_state, _ = _run(SPECS[name], (1000, 3), np.float32)
    monkeypatch.setattr(kernels, "THREADS", 3)
    monkeypatch.setattr(kernels, "THREAD_MIN_ELEMENTS", 1)
    split, split_state, _ = _run(SPECS[name], (1000, 3), np.float32)
    _assert_same_bits(split, one_thread, "value")
    for k, v in one_state.items():
        if isinstance(v, np.ndarray):
            _assert_same_bits(split_state[k], v, f"slot {k}")


@needs_numba
@pytest.mark.parametrize("name", SPECS)
def test_a_fused_step_writes_into_no_input_and_returns_fresh_arrays(name):
    value, state, handed_in = _run(SPECS[name], (5, 4), np.float32)
    outputs = [value] + [v for v in state.values() if isinstance(v, np.ndarray)]
    for w, g, slots, w_copy, g_copy, slot_copies in handed_in:
        _assert_same_bits(w, w_copy, "value handed in")
        _assert_same_bits(g, g_copy, "gradient handed in")
        for k, v in slot_copies.items():
            _assert_same_bits(slots[k], v, f"slot {k} handed in")
        for out in outputs:
            assert not any(np.shares_memory(out, x) for x in (w, g, *slots.values()) if isinstance(x, np.ndarray))


def test_a_strided_or_float16_array_takes_the_numpy_step():
    w = np.ones((4, 6), np.float32)
    assert kernels.sgd(w[:, ::2], w[:, ::2], np.float32(0.1)) is None  # not C-contiguous
    h = np.ones(4, np.float16)
    assert kernels.sgd(h, h, np.float16(0.1)) is None  # numba has no float16 arithmetic
    opt = make_optimizer(SPECS["adam"])
    value, _ = opt.apply(w[:, ::2], w[:, ::2], opt.init_state(np.ones((4, 3), np.float32)))
    assert value.shape == (4, 3)


def test_switched_off_the_kernels_return_none_and_apply_still_steps(monkeypatch):
    monkeypatch.setattr(kernels, "ENABLED", False)
    assert not kernels.available()
    w = np.ones(3, np.float32)
    assert kernels.adam(w, w, w, w, None, 0.1, 0.001, 1e-3, 1e-7) is None
    value, state, _ = _run(SPECS["sgd"], (3,), np.float32)
    assert value.shape == (3,) and state["iterations"] == STEPS


FALLBACK = """
import sys
{setup}
import numpy as np
from ps_server.core.optim import kernels
from ps_server.core.optim.optimizers import OptimizerSpec
from ps_server.core.optim.registry import make_optimizer
assert not kernels.available()
opt = make_optimizer(OptimizerSpec("adam", 1e-3, amsgrad=True))
w = np.linspace(-1, 1, 11, dtype=np.float32)
value, state = opt.apply(w, w[::-1].copy(), opt.init_state(w))
sys.stdout.write(value.tobytes().hex() + state["v_hat"].tobytes().hex())
"""


@pytest.mark.parametrize("how", ["env", "no_numba"])
def test_without_numba_or_with_tfps_kernels_numpy_the_step_has_the_same_bits(how, monkeypatch):
    # In a fresh interpreter: the module reads TFPS_KERNELS, and imports numba, once.
    setup = "sys.modules['numba'] = None  # as if not installed" if how == "no_numba" else ""
    env = {"TFPS_KERNELS": "numpy"} if how == "env" else {}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run = subprocess.run([sys.executable, "-c", FALLBACK.format(setup=setup)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    opt = make_optimizer(OptimizerSpec("adam", 1e-3, amsgrad=True))
    w = np.linspace(-1, 1, 11, dtype=np.float32)
    value, state = opt.apply(w, w[::-1].copy(), opt.init_state(w))  # here: fused where numba is installed
    assert run.stdout == value.tobytes().hex() + state["v_hat"].tobytes().hex()


@needs_numba
def test_where_numba_can_cache_nothing_the_kernels_compile_uncached(monkeypatch):
    define = kernels._define_loops

    def no_cache_directory(cache):
        if cache:
            raise RuntimeError("cannot cache function 'sgd': no locator available for file 'kernels.py'")
        return define(cache)

    monkeypatch.setattr(kernels, "_define_loops", no_cache_directory)
    monkeypatch.setattr(kernels, "_compiled", None)
    w = np.ones(3, np.float32)
    (value,) = kernels.sgd(w, w, np.float32(0.5))
    assert value.tolist() == [0.5, 0.5, 0.5]


@needs_numba
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="reads x86 assembly")
def test_no_loop_is_compiled_with_a_fused_multiply_add(monkeypatch):
    # The guarantee's premise, read from the machine code rather than inferred from
    # random data: an FMA rounds a*b + c once, NumPy rounds it twice. Compiled afresh
    # (numba shows no assembly for cached code), for both dtypes.
    monkeypatch.setattr(kernels, "_compiled", kernels._define_loops(cache=False))
    for name in SPECS:
        for dtype in (np.float32, np.float64):
            _run(SPECS[name], (37,), dtype)
    kernels.fold_exact(np.ones(37, np.float32), 3.0, np.zeros(37), 0, np.empty(37))
    for name, loop in kernels._compiled.items():
        listings = loop.inspect_asm().values()
        assert listings, f"{name} was not compiled"
        for asm in listings:
            assert "vmov" in asm, name  # real code, not a placeholder
            fmas = re.findall(r"\bvfn?m(?:add|sub)\w*", asm)
            assert not fmas, f"{name}: {sorted(set(fmas))}"


@needs_numba
def test_the_fused_fold_of_a_round_sum_gives_the_numpy_folds_levels_and_mean(monkeypatch):
    from ps_server.core.modes.aggregation import _Exact

    rng = np.random.default_rng(5)
    pushes = [(rng.standard_normal(5000) * 10.0 ** rng.integers(-25, 25, size=5000)).astype(np.float32)
              for _ in range(4)]
    pushes[1][:10] = np.inf
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", enabled)
        acc = _Exact((5000,), np.dtype(np.float32))
        for b, g in zip((3, 1, 7, 2**31 + 5), pushes):
            acc.add(g, b)
        results.append(([level.copy() for level in acc.levels], acc.mean(3 + 1 + 7 + 2**31 + 5)))
    (fused_levels, fused_mean), (numpy_levels, numpy_mean) = results
    assert len(fused_levels) == len(numpy_levels) > 1  # the spread reaches the lower levels
    for a, b in zip(fused_levels, numpy_levels):
        np.testing.assert_array_equal(a.view(np.uint64), b.view(np.uint64))
    np.testing.assert_array_equal(fused_mean.view(np.uint32), numpy_mean.view(np.uint32))
