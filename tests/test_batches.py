"""ps_common.batches: the job's sequence of batches, the same in every process."""

import numpy as np
import pytest

from ps_common import batches
from worker import data


def test_global_batch_of_a_step_is_the_sequence_s_batch_at_that_step():
    n, b, seed = 103, 16, 7
    sequence = list(batches.global_batches(n, b, epochs=3, seed=seed))
    assert len(sequence) == 3 * batches.steps_per_epoch(n, b) == 21
    for step, batch in enumerate(sequence):
        np.testing.assert_array_equal(batches.global_batch(n, b, seed, step), batch)
    for epoch in range(3):  # every epoch visits every example once
        epoch_batches = sequence[epoch * 7:(epoch + 1) * 7]
        assert sorted(np.concatenate(epoch_batches).tolist()) == list(range(n))
        assert [len(x) for x in epoch_batches] == [16] * 6 + [7]


def test_the_workers_module_hands_out_the_same_functions():
    assert data.global_batches is batches.global_batches and data.shard is batches.shard
    assert data.steps_per_epoch is batches.steps_per_epoch


def test_micro_batches_are_contiguous_parts_of_the_batch_and_a_shard_is_one_of_them():
    batch = batches.global_batch(103, 16, 7, 6)  # the last, 7 examples
    parts = batches.micro_batches(batch, 4)
    assert [len(p) for p in parts] == [2, 2, 2, 1]
    np.testing.assert_array_equal(np.concatenate(parts), batch)
    for i in range(4):
        np.testing.assert_array_equal(batches.shard(batch, i, 4), parts[i])
    assert [len(p) for p in batches.micro_batches(batch, 9)] == [1] * 7 + [0, 0]


def test_bad_sizes_and_steps_are_refused():
    with pytest.raises(ValueError, match="global batch size"):
        batches.steps_per_epoch(10, 0)
    with pytest.raises(ValueError, match="at least 1 example"):
        batches.global_batch(0, 4, 0, 0)
    with pytest.raises(ValueError, match="step must be"):
        batches.global_batch(10, 4, 0, -1)
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        batches.micro_batches(np.arange(4), 0)
