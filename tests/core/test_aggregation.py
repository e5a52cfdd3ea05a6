"""Tests of ps_server.core.aggregation: the batch-weighted mean of a sync round.

    python -m pytest tests/core/test_aggregation.py -q

Expected values are computed by hand; the numbers are chosen so that every
weight and product is exact in binary floating point.
"""

import numpy as np
import pytest

from ps_server.core.aggregation import batch_weights, weighted_loss, weighted_mean
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


def test_weights_are_float64_fractions_cast_to_the_gradient_dtype():
    # 1/3 and 2/3 are not exact: the rule fixes how they are rounded.
    rng = np.random.default_rng(1)
    g0, g1 = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    out = weighted_mean([(1, {"w": g0}), (2, {"w": g1})])["w"]
    expected = g0 * np.float32(1 / 3) + g1 * np.float32(2 / 3)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    assert batch_weights([1, 2]) == [1 / 3, 2 / 3]


def test_products_are_added_in_the_order_given_starting_from_the_first():
    # Weights 1/4, 1/4, 1/2 turn these into products 2**22, 1/4, -2**22. In float32,
    # 2**22 + 1/4 rounds back to 2**22 (spacing 0.5 there), so the order shows:
    # ((2**22 + 1/4) - 2**22) = 0, while (-2**22 + 1/4) + 2**22 = 1/4.
    c0, c1, c2 = (1, {"w": f32(2**24)}), (1, {"w": f32(1)}), (2, {"w": f32(-(2**23))})
    assert weighted_mean([c0, c1, c2])["w"][0] == 0.0
    assert weighted_mean([c2, c1, c0])["w"][0] == 0.25


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
