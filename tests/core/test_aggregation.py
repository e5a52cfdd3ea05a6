"""Tests of ps_server.core.modes.aggregation: the batch-weighted mean of a sync round.

    python -m pytest tests/core/test_aggregation.py -q

Expected values are computed by hand (the numbers chosen so that every weight
and product is exact in binary floating point) or, for the rule itself (the exact
weighted mean rounded once), with rationals.
"""

import itertools
from fractions import Fraction

import numpy as np
import pytest

from ps_server.core.modes.aggregation import RoundSum, _round_exact, batch_weights, weighted_loss, weighted_mean
from ps_server.core.errors import InvalidArgument


def f32(*xs):
    return np.array(xs, dtype=np.float32)


def test_equal_batches_give_the_plain_mean():
    out = weighted_mean([(8, {"w": f32(1, 2)}), (8, {"w": f32(3, 6)})])
    np.testing.assert_array_equal(out["w"], f32(2, 4))


def test_uneven_batches_are_weighted_by_their_share_of_the_global_batch():
    # B = 1 + 3 = 4: 1/4 * 4 + 3/4 * 8 = 7 and 1/4 * (-8) + 3/4 * 0 = -2
    out = weighted_mean([(1, {"w": f32(4, -8)}), (3, {"w": f32(8, 0)})])
    np.testing.assert_array_equal(out["w"], f32(7, -2))


def test_three_workers_by_hand_sum_of_b_i_over_b_times_g_i():
    # B = 1 + 1 + 2 = 4, weights 0.25, 0.25, 0.5
    out = weighted_mean([
        (1, {"a": f32(4), "b": f32(0, 8)}),
        (1, {"a": f32(8), "b": f32(4, 4)}),
        (2, {"a": f32(2), "b": f32(2, -2)}),
    ])
    np.testing.assert_array_equal(out["a"], f32(0.25 * 4 + 0.25 * 8 + 0.5 * 2))
    np.testing.assert_array_equal(out["b"], f32(0 + 1 + 1, 2 + 1 - 1))
    assert set(out) == {"a", "b"}


def test_a_worker_with_an_empty_batch_has_weight_zero():
    out = weighted_mean([(0, {"w": f32(1000)}), (5, {"w": f32(3)})])
    np.testing.assert_array_equal(out["w"], f32(3))


@pytest.mark.parametrize("sizes", [[0], [0, 0, 0]])
def test_a_round_without_examples_raises_invalid_argument(sizes):
    with pytest.raises(InvalidArgument, match=r"at least one example, got batch sizes \[0"):
        weighted_mean([(b, {"w": f32(1)}) for b in sizes])


def test_a_round_without_contributions_raises_invalid_argument():
    with pytest.raises(InvalidArgument, match="at least one contribution"):
        weighted_mean([])


def test_equal_halves_give_exactly_g1_plus_g2_over_2_for_float32():
    rng = np.random.default_rng(0)
    g1 = rng.standard_normal(10_000).astype(np.float32)
    g2 = rng.standard_normal(10_000).astype(np.float32)
    out = weighted_mean([(16, {"w": g1}), (16, {"w": g2})])["w"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out.view(np.uint32), ((g1 + g2) / np.float32(2)).view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_result_keeps_the_gradient_dtype(dtype):
    out = weighted_mean([(1, {"w": np.ones(3, dtype)}), (2, {"w": np.ones(3, dtype)})])
    assert out["w"].dtype == dtype


def _exact_mean(contributions):
    """The exact weighted mean, element by element in rationals, rounded once (the rule)."""
    total = sum(b for b, _ in contributions)
    first = contributions[0][1]["w"]
    out = np.empty(first.size, first.dtype)
    for i in range(first.size):
        value = sum(Fraction(b) * Fraction(float(g["w"].reshape(-1)[i])) for b, g in contributions) / total
        out[i] = _round_exact(value, first.dtype)
    return out.reshape(first.shape)


def folded(contributions):
    """The exact rule: a round folded push by push on arrival (beyond ``HELD_BYTES``)."""
    total = RoundSum()
    for worker, (b, g) in enumerate(contributions):
        total.add(worker, b, g)
    return total.mean()


def _bits(a):
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def test_uneven_weights_give_the_exact_weighted_mean_rounded_once():
    # 1/3 and 2/3 are not exact in binary: the rule rounds the exact mean once, not each product.
    rng = np.random.default_rng(1)
    g0, g1 = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    out = folded([(1, {"w": g0}), (2, {"w": g1})])["w"]
    np.testing.assert_array_equal(_bits(out), _bits(_exact_mean([(1, {"w": g0}), (2, {"w": g1})])))


def test_cancelling_products_give_the_exact_result_in_any_order():
    # Products 2**22, 1/4, -2**22 (weights 1/4, 1/4, 1/2): a float32 fold in order loses the 1/4
    # one way round and keeps it the other; the exact sum keeps it both ways.
    c0, c1, c2 = (1, {"w": f32(2**24)}), (1, {"w": f32(1)}), (2, {"w": f32(-(2**23))})
    for order in itertools.permutations([c0, c1, c2]):
        assert folded(list(order))["w"][0] == np.float32(0.25)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_the_mean_does_not_depend_on_the_order_of_arrival_and_is_exactly_rounded(dtype):
    # Magnitudes spread over 60 decades (float32) make float64 sums round: the kept
    # remainders and the tie check must still give the exact mean, in every order.
    rng = np.random.default_rng(7)
    span = 30 if dtype == np.float32 else 4
    for trial in range(40):
        n = int(rng.integers(2, 5))
        contributions = []
        for k in range(n):
            g = rng.standard_normal(9) * 10.0 ** rng.integers(-span, span, size=9)
            if trial % 4 == 0:
                g = np.round(g)  # integers: exact sums, many exact ties
            contributions.append((int(rng.integers(1, 6)), {"w": g.astype(dtype)}))
        expected = _bits(_exact_mean(contributions))
        for order in itertools.permutations(contributions):
            np.testing.assert_array_equal(_bits(folded(list(order))["w"]), expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_power_of_two_global_batch_with_remainders_is_exactly_rounded(dtype):
    # A global batch of 2**k divides exactly: only the elements whose sum kept a remainder
    # (a lower level) are checked against a midpoint, and those must still round exactly.
    rng = np.random.default_rng(11)
    span = 30 if dtype == np.float32 else 4
    for trial in range(40):
        n = int(rng.integers(2, 5))
        cuts = sorted(rng.choice(np.arange(1, 16), n - 1, replace=False).tolist())
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, 16])]  # n positive sizes summing to 16
        contributions = []
        for b in sizes:
            g = rng.standard_normal(64) * 10.0 ** rng.integers(-span, span, size=64)
            g[::7] = np.round(g[::7] * 3) / 4  # quarters: midpoints for some sums
            contributions.append((b, {"w": g.astype(dtype)}))
        expected = _bits(_exact_mean(contributions))
        for order in (contributions, contributions[::-1]):
            np.testing.assert_array_equal(_bits(folded(list(order))["w"]), expected)


def test_negative_zeros_sum_to_positive_zero_as_zero_plus_them_does():
    out = folded([(1, {"w": f32(-0.0, -0.0, 1.0)}), (3, {"w": f32(-0.0, 0.0, -0.0)})])["w"]
    assert _bits(out).tolist() == _bits(f32(0.0, 0.0, 0.25)).tolist()


def test_a_float64_quotient_on_a_float32_midpoint_is_rounded_from_the_exact_value():
    # (1 + 2**-23) + 2**-24 + 1e-30, over 3: the float64 quotient may land on a midpoint that
    # the tiny third term decides; the exact mean is rounded once.
    gs = [f32(1 + 2**-23), f32(2**-24), f32(1e-30)]
    out = folded([(1, {"w": g}) for g in gs])["w"]
    np.testing.assert_array_equal(_bits(out), _bits(_exact_mean([(1, {"w": g}) for g in gs])))
    two = [(1, {"w": f32(1.0)}), (1, {"w": f32(2**-23)})]  # (1 + 2**-23) / 2: halving is exact
    np.testing.assert_array_equal(_bits(folded(two)["w"]), _bits(f32(1) * f32(0.5) + f32(2**-23) * f32(0.5)))


def test_batch_sizes_beyond_2_to_the_29_stay_exact():
    g0, g1 = f32(1 + 2**-23, 3), f32(-1, 1e-20)
    sizes = (2**31 + 12345, 3)
    contributions = [(sizes[0], {"w": g0}), (sizes[1], {"w": g1})]
    np.testing.assert_array_equal(_bits(folded(contributions)["w"]), _bits(_exact_mean(contributions)))


def test_a_round_sum_folded_push_by_push_equals_the_weighted_mean_and_keeps_no_push():
    rng = np.random.default_rng(3)
    pushes = [(w, int(rng.integers(1, 9)), {"w": rng.standard_normal((30, 7)).astype(np.float32),
                                            "b": rng.standard_normal(7).astype(np.float32)}) for w in range(6)]
    total = RoundSum()
    for w, b, g in reversed(pushes):
        total.add(w, b, g)
    mean = total.mean()
    expected = folded([(b, g) for _, b, g in pushes])
    for name in ("w", "b"):
        np.testing.assert_array_equal(_bits(mean[name]), _bits(expected[name]))
    assert not total._held  # float32: one accumulator per variable, no push kept


def test_float64_gradients_keep_the_worker_order_rule():
    # Not exact in float64: products rounded to float64, added in worker-id order.
    rng = np.random.default_rng(1)
    g0, g1 = (rng.standard_normal(1000) for _ in range(2))
    total = RoundSum()
    total.add(1, 2, {"w": g1})
    total.add(0, 1, {"w": g0})
    expected = g0 * (1 / 3) + g1 * (2 / 3)
    np.testing.assert_array_equal(total.mean()["w"], expected)


def test_non_finite_gradients_give_non_finite_means():
    out = weighted_mean([(1, {"w": f32(np.inf, 1, np.nan)}), (1, {"w": f32(1, 2, 3)})])["w"]
    assert out[0] == np.inf and out[1] == np.float32(1.5) and np.isnan(out[2])
    out = weighted_mean([(0, {"w": f32(np.inf)}), (1, {"w": f32(1)})])["w"]
    assert np.isnan(out[0])  # 0 * inf, as in any weighted sum


def test_inputs_are_not_modified():
    g0, g1 = f32(1, 2), f32(3, 4)
    weighted_mean([(1, {"w": g0}), (3, {"w": g1})])
    np.testing.assert_array_equal(g0, f32(1, 2))
    np.testing.assert_array_equal(g1, f32(3, 4))


def test_weighted_loss_is_the_batch_weighted_mean_of_the_losses():
    assert weighted_loss([1.0, 3.0], [1, 3]) == 0.25 * 1.0 + 0.75 * 3.0
    with pytest.raises(InvalidArgument):
        weighted_loss([1.0], [0])


def test_scalar_variables_stay_arrays_so_the_optimizer_accepts_them():
    # NumPy turns 0-d arithmetic results into scalars; a round must still hand the
    # optimizer ndarrays (found by the load test: every round with a () variable failed).
    mean = weighted_mean([(1, {"s": np.array(2.0, np.float32)}), (3, {"s": np.array(6.0, np.float32)})])
    assert isinstance(mean["s"], np.ndarray) and mean["s"].shape == () and mean["s"] == np.float32(5.0)


# -- a round held whole (within HELD_BYTES): the weighted sum in worker-id order ------------

def _worker_order_sum(contributions):
    """sum_i g_i * w_i in float32, w_i = b_i / B rounded to float32, in the order given."""
    weights = [np.float32(w) for w in batch_weights([b for b, _ in contributions])]
    out = contributions[0][1]["w"] * weights[0]
    for (_, g), w in zip(contributions[1:], weights[1:]):
        out = out + g["w"] * w
    return out


def test_a_held_round_is_the_worker_order_weighted_sum_whatever_the_order_of_arrival():
    rng = np.random.default_rng(5)
    contributions = [(int(rng.integers(1, 9)), {"w": rng.standard_normal(500).astype(np.float32)}) for _ in range(4)]
    expected = _bits(_worker_order_sum(contributions))
    assert (expected != _bits(folded(contributions)["w"])).any()  # the two rules differ here
    for order in itertools.permutations(range(4)):
        total = RoundSum(hold=True)
        for worker in order:
            total.add(worker, *contributions[worker])
        np.testing.assert_array_equal(_bits(total.mean()["w"]), expected)
        assert total._held and not total._exact  # every push kept, nothing folded


def test_a_held_round_of_two_equal_batches_is_the_exact_mean_as_mirrored_strategy_gives():
    # Halving is exact and the one sum rounds once: (g0 + g1) / 2 rounded once, the fold's bits.
    rng = np.random.default_rng(9)
    g0, g1 = (rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 4000) for _ in range(2))
    two = [(32, {"w": g0.astype(np.float32)}), (32, {"w": g1.astype(np.float32)})]
    np.testing.assert_array_equal(_bits(weighted_mean(two)["w"]), _bits(folded(two)["w"]))


def test_weighted_mean_holds_the_pushes_within_held_bytes_and_folds_them_exactly_beyond(monkeypatch):
    from ps_server.core.modes import aggregation

    rng = np.random.default_rng(6)
    contributions = [(b, {"w": rng.standard_normal(256).astype(np.float32)}) for b in (1, 2, 4)]
    held, exact = _bits(_worker_order_sum(contributions)), _bits(folded(contributions)["w"])
    assert (held != exact).any()
    np.testing.assert_array_equal(_bits(weighted_mean(contributions)["w"]), held)
    assert aggregation.holds(3 * 1024, 3) and not aggregation.holds(3 * 1024, 2**20)
    monkeypatch.setattr(aggregation, "HELD_BYTES", 3 * 1024 - 1)  # three pushes of 1 KiB: one byte short
    np.testing.assert_array_equal(_bits(weighted_mean(contributions)["w"]), exact)
