"""The placement plan: balanced by bytes, large variables cut into row slices, exact round trips.

    python -m pytest -q tests/worker/test_sharding.py

The rule: "placement balanced by bytes, large variables split into
slices (like TensorFlow's MinSizePartitioner/FixedShardsPartitioner), small hot
scalars not all on one shard". Plain NumPy, no sockets.
"""

import math

import numpy as np
import pytest

from worker import sharding
from worker.sharding import ShardingError, learn, plan

KIB = 1024
# The tutorial CNN of worker/model.py, as the chief's model reports it.
CNN = {
    "cnn/conv2d/kernel": ((3, 3, 1, 32), "float32"),
    "cnn/conv2d/bias": ((32,), "float32"),
    "cnn/dense/kernel": ((21632, 10), "float32"),
    "cnn/dense/bias": ((10,), "float32"),
}


def random_specs(rng, n):
    specs = {}
    for i in range(n):
        ndim = int(rng.integers(0, 4))
        shape = tuple(int(d) for d in rng.integers(1, (1500, 160, 24)[:ndim])) if ndim else ()
        if ndim and rng.random() < 0.2:
            shape = (1,) + shape[1:]
        specs[f"layer{i}/w"] = (shape, str(rng.choice(["float16", "float32", "float64"])))
    return specs


def random_values(rng, specs):
    return {n: np.asarray(rng.standard_normal(shape)).astype(dtype) for n, (shape, dtype) in specs.items()}


def is_small(piece):
    return piece.parts == 1 and piece.nbytes <= sharding.DEFAULT_SMALL_BYTES


def test_largest_shard_stays_within_the_stated_bound():
    """Module docstring: at most total / M + largest piece + ceil(small pieces / M) * small_bytes."""
    rng = np.random.default_rng(5)
    for _ in range(400):
        m = int(rng.integers(1, 9))
        specs = random_specs(rng, int(rng.integers(1, 16)))
        placement = plan(specs, m, min_slice_bytes=int(rng.choice([1, 16 * KIB, 256 * KIB])))
        loads = placement.shard_bytes()
        largest = max((p.nbytes for p in placement.pieces if not is_small(p)), default=0)
        smalls = sum(is_small(p) for p in placement.pieces)
        bound = sum(loads) / m + largest + math.ceil(smalls / m) * sharding.DEFAULT_SMALL_BYTES
        assert max(loads) <= bound, (specs, m, loads, bound)


def test_the_cnn_over_two_shards_is_split_almost_evenly():
    placement = plan(CNN, 2)
    loads = placement.shard_bytes()
    assert sum(loads) == 4 * (288 + 32 + 216320 + 10)
    # The dense kernel (845 KiB) is cut in two; the rest moves the balance by at most its bytes.
    assert abs(loads[0] - loads[1]) <= 4 * (288 + 32 + 10) + 4 * 10
    names = {p.name for p in placement.pieces}
    assert {"cnn/dense/kernel/part_0_of_2", "cnn/dense/kernel/part_1_of_2", "cnn/conv2d/kernel"} <= names


def test_a_large_variable_is_cut_into_contiguous_near_equal_row_blocks_of_at_least_min_slice_bytes():
    specs = {"emb": ((1001, 256), "float32")}  # 1001 KiB: 3 slices of >= 256 KiB fit, 4 do not
    placement = plan(specs, 8)
    parts = placement.pieces
    assert [p.name for p in parts] == ["emb/part_0_of_3", "emb/part_1_of_3", "emb/part_2_of_3"]
    assert [(p.start, p.stop) for p in parts] == [(0, 334), (334, 668), (668, 1001)]
    assert all(p.nbytes >= 256 * KIB for p in parts)
    assert len({p.shard for p in parts}) == 3  # each slice on its own shard
    assert plan(specs, 2).pieces[0].parts == 2  # never more slices than shards


def test_min_slice_bytes_1_cuts_like_fixed_shards_partitioner():
    placement = plan({"w": ((10, 3), "float32"), "b": ((3,), "float32")}, 4, min_slice_bytes=1)
    w = [p for p in placement.pieces if p.variable == "w"]
    b = [p for p in placement.pieces if p.variable == "b"]
    assert [p.stop - p.start for p in w] == [3, 3, 2, 2]  # np.array_split's order
    assert [p.name for p in b] == ["b/part_0_of_3", "b/part_1_of_3", "b/part_2_of_3"]  # 3 rows: 3 slices at most


def test_split_then_join_gives_back_the_same_bits():
    rng = np.random.default_rng(7)
    for _ in range(100):
        specs = random_specs(rng, int(rng.integers(1, 10)))
        placement = plan(specs, int(rng.integers(1, 6)), min_slice_bytes=int(rng.choice([1, 4 * KIB])))
        values = random_values(rng, specs)
        back = placement.join(placement.split(values))
        assert list(back) == list(values)
        for name, value in values.items():
            assert back[name].dtype == value.dtype and back[name].shape == value.shape
            assert back[name].tobytes() == value.tobytes(), name


def test_split_hands_out_views_not_copies():
    values = {"w": np.arange(4 * 65536, dtype=np.float32).reshape(65536, 4), "b": np.zeros(4, np.float32)}
    placement = plan(sharding.specs_of(values), 2, min_slice_bytes=1)
    per_shard = placement.split(values)
    for pieces in per_shard:
        for name, array in pieces.items():
            assert np.shares_memory(array, values[name.split("/")[0]]), name


def test_join_needs_no_plan_the_piece_names_describe_the_placement():
    rng = np.random.default_rng(11)
    specs = random_specs(rng, 12)
    placement = plan(specs, 3, min_slice_bytes=1)
    values = random_values(rng, specs)
    per_shard = placement.split(values)
    learned = learn(per_shard)
    assert sorted(learned.pieces, key=lambda p: p.name) == sorted(placement.pieces, key=lambda p: p.name)
    assert learned.variables == {n: (shape, np.dtype(dtype)) for n, (shape, dtype) in specs.items()}
    back = learned.join(per_shard)
    assert all(back[n].tobytes() == values[n].tobytes() for n in values)


def test_the_plan_is_deterministic_and_ignores_the_order_of_the_specs():
    rng = np.random.default_rng(3)
    specs = random_specs(rng, 14)
    reordered = dict(reversed(list(specs.items())))
    a, b, c = plan(specs, 4), plan(specs, 4), plan(reordered, 4)
    assert a == b
    assert {p.name: p.shard for p in a.pieces} == {p.name: p.shard for p in c.pieces}


def test_small_variables_spread_over_the_shards():
    # One big matrix, then eight biases and scalars: by bytes alone, all would go
    # to whichever shard is lightest after the matrix's slices.
    specs = {"big": ((4096, 256), "float32"), **{f"bias{i}": ((16,), "float32") for i in range(6)},
             "step": ((), "float32"), "scale": ((), "float64")}
    placement = plan(specs, 4)
    per_shard = [sum(1 for p in placement.on_shard(s) if p.variable != "big") for s in range(4)]
    assert per_shard == [2, 2, 2, 2]
    cnn = plan(CNN, 2)  # the conv kernel and the two biases: not all three on one shard
    assert len({p.shard for p in cnn.pieces if is_small(p)}) == 2


def test_one_shard_keeps_every_variable_whole():
    placement = plan(CNN, 1)
    assert [p.name for p in placement.pieces] == list(CNN)
    assert {p.shard for p in placement.pieces} == {0}


def test_more_shards_than_pieces_leaves_shards_empty_and_still_round_trips():
    specs = {"w": ((3, 2), "float32"), "b": ((2,), "float32")}
    placement = plan(specs, 5)
    assert placement.empty_shards() == [2, 3, 4]
    values = {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    per_shard = placement.split(values)
    assert per_shard[2:] == [{}, {}, {}]
    assert all(np.array_equal(placement.join(per_shard)[n], values[n]) for n in values)
    assert placement.describe()[4] == "shard 4: 0 bytes (0.0%): nothing"


def test_one_row_variables_and_0d_scalars_are_never_cut():
    specs = {"row": ((1, 1_000_000), "float32"), "scalar": ((), "float64")}
    placement = plan(specs, 4, min_slice_bytes=1)
    assert [(p.name, p.parts) for p in placement.pieces] == [("row", 1), ("scalar", 1)]
    values = {"row": np.ones((1, 1_000_000), np.float32), "scalar": np.array(2.5)}
    back = placement.join(placement.split(values))
    assert back["scalar"].shape == () and back["scalar"] == 2.5 and back["row"].shape == (1, 1_000_000)


def test_describe_gives_each_shards_bytes():
    lines = plan(CNN, 2).describe(["h:1", "h:2"])
    assert len(lines) == 2 and lines[0].startswith("shard 0 (h:1): ") and "bytes" in lines[0]
    assert sum(int(line.split(": ")[1].split(" bytes")[0].replace(",", "")) for line in lines) == 866600


def test_a_variable_named_like_a_slice_is_refused():
    with pytest.raises(ShardingError, match="part_"):
        plan({"w/part_0_of_2": ((4,), "float32")}, 2)


def test_pieces_that_do_not_make_whole_variables_are_refused():
    a, b = np.zeros((2, 3), np.float32), np.zeros((1, 3), np.float32)
    with pytest.raises(ShardingError, match="incomplete"):
        learn([{"w/part_0_of_2": a}, {}])
    with pytest.raises(ShardingError, match="twice"):
        learn([{"w/part_0_of_2": a}, {"w/part_0_of_2": a, "w/part_1_of_2": b}])
    with pytest.raises(ShardingError, match="disagree"):
        learn([{"w/part_0_of_2": a}, {"w/part_1_of_2": np.zeros((1, 4), np.float32)}])


def test_values_that_do_not_fit_the_placement_are_refused():
    placement = plan({"w": ((4, 2), "float32")}, 2, min_slice_bytes=1)
    with pytest.raises(ShardingError, match="missing"):
        placement.split({})
    with pytest.raises(ShardingError, match="shape"):
        placement.split({"w": np.zeros((4, 3), np.float32)})
    with pytest.raises(ShardingError, match="belongs on shard"):
        placement.join([{"w/part_1_of_2": np.zeros((2, 2), np.float32)},
                        {"w/part_0_of_2": np.zeros((2, 2), np.float32)}])
    with pytest.raises(ShardingError, match="incomplete"):
        placement.join([{"w/part_0_of_2": np.zeros((2, 2), np.float32)}, {}])


def test_a_sparse_gradient_of_a_sliced_variable_reaches_each_shard_as_its_own_rows_renumbered():
    from ps_server.core.optim.sparse import SparseRows, densify

    specs = {"emb": ((10, 4), np.dtype(np.float32)), "b": ((4,), np.dtype(np.float32))}
    p = plan(specs, num_shards=2, min_slice_bytes=1)
    rows = np.array([9, 0, 5, 4, 9], np.int64)
    values = np.arange(20, dtype=np.float32).reshape(5, 4)
    per_shard = p.split({"emb": SparseRows(rows, values), "b": np.zeros(4, np.float32)})
    dense_parts = {name: densify(g, piece.shape, np.float32) if isinstance(g, SparseRows) else g
                   for shard in per_shard for name, g in shard.items()
                   for piece in p.pieces if piece.name == name}
    whole = densify(SparseRows(rows, values), (10, 4), np.float32)
    np.testing.assert_array_equal(p.join([{n: dense_parts[n] for n in shard} for shard in per_shard])["emb"], whole)


@pytest.mark.parametrize("optimizer, norms", [
    ({"name": "adamw", "global_clipnorm": 1.0}, ["global_clipnorm"]),
    ({"name": "adam", "global_clipnorm": 0}, []),  # the wire's "not set"
    ({"name": "sgd", "clipnorm": 1.0}, ["clipnorm"]),
    ({"name": "lamb"}, ["Lamb's per-variable norms"]),
    ({"name": "adafactor"}, ["Adafactor's per-variable norms"]),
    ({"name": "sgd", "clipvalue": 1.0}, []),  # elementwise: the same on any placement
])
def test_the_options_that_read_a_whole_variable_are_named_so_the_plan_keeps_every_variable_whole(optimizer, norms):
    """Each shard steps its own pieces: a per-variable norm of a slice would be the slice's, and
    global clipping's shards add their squares in one server's order only of whole variables,
    so with these options the chief's plan cuts nothing (``ShardedClient.initialize``)."""
    assert sharding.norms_of(optimizer) == norms
