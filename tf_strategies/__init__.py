"""The parity layer: the same training under other runners, to compare with ours.

``tf_strategies.reference`` holds the one-process oracles: the sharded
reference (one process computes every worker's shard gradient with the same
tape and combines them exactly as the server does) and the full-batch
reference (one gradient on the whole global batch per step).
"""
