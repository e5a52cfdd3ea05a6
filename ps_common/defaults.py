"""Every default a setting has, and the rules between the server's settings, each written once.

    from ps_common.defaults import BARRIER_TIMEOUT, server_settings_conflict

``ps_server.config.ServerConfig`` and ``worker.config.WorkerConfig`` take their field
defaults from here and so does their ``--help`` (which prints the constant, not a
number of its own); the core's constructors (``ParameterServer``, ``Membership``, the
modes), the records (``Registration``) and the wire's message limit read the same
constants. ``tests/test_defaults.py`` fails when a default is written anywhere else
differently. Plain Python: the core imports it.
"""

from __future__ import annotations

from ps_common.names import MODES

HOST = "127.0.0.1"
PORT = 50051
PS_ADDRESS = f"{HOST}:{PORT}"

# The server.
BARRIER_TIMEOUT = 60.0  # s a sync round (and a broadcast) may wait for its last push
LEASE_TIMEOUT = 10.0  # s without a call or heartbeat before a worker is declared dead
HEARTBEATS_PER_LEASE = 3  # a worker's heartbeat interval, unless set: the lease / this
REPLACEMENT_TIMEOUT = 60.0  # policy wait: s a dead worker's index may stay empty
STALENESS = 3  # ssp: how many steps a worker may run ahead of the slowest
MAX_STALENESS = 8  # policy drop: pushes staler than this many versions are dropped
CHECKPOINT_INTERVAL = 30.0  # s between checkpoints
CHECKPOINT_KEEP = 3  # checkpoints kept
MIN_THREADS, THREADS_PER_CPU = 8, 4  # the call pool: max(MIN_THREADS, THREADS_PER_CPU x CPUs)
MAX_MESSAGE_MB = 1024.0  # the largest message either way, both sides (protos.wire)
# Sync PushPull: the server's speculation block, and the sizes a push may ask for instead
# (the worker's --overlap-block-kib; core.modes.overlap).
OVERLAP_BLOCK_BYTES = 512 << 10
MIN_OVERLAP_BLOCK_BYTES, MAX_OVERLAP_BLOCK_BYTES = 4 << 10, 64 << 20

# The worker.
CONNECT_TIMEOUT = 60.0  # s to wait for a server that is still starting
INIT_TIMEOUT = 120.0  # s to wait for the chief's initialization
RECONNECT_TIMEOUT = 120.0  # s to keep retrying a lost server
FINAL_WAIT = 600.0  # async and ssp chief: s to wait for the others to finish
EPOCHS = 3
GLOBAL_BATCH_SIZE = 64
LOG_EVERY = 10


def server_settings_conflict(mode: str, num_workers: int, stale_gradient_policy: str, async_apply: str,
                             elastic_min_workers: int, micro_batches: int, replicas_to_aggregate: int) -> str | None:
    """Why these server settings cannot go together (one line, in the flags' names, which
    are the core's too), or None. ``ServerConfig.validate`` raises it as a ConfigError,
    ``ParameterServer`` as an InvalidArgument: the one statement of each rule."""
    if mode not in MODES:
        return f"--mode must be one of {', '.join(MODES)}, got {mode!r}"
    if stale_gradient_policy != "none" and mode == "sync":
        return "--stale-gradient-policy applies to --mode async and ssp; sync has no stale gradients"
    if async_apply != "locked" and mode == "sync":
        return f"--async-apply {async_apply} applies to --mode async and ssp; sync applies each round at once"
    if not elastic_min_workers:
        return "--micro-batches applies to elastic sync only (--elastic-min-workers)" if micro_batches else None
    if mode != "sync":
        return "--elastic-min-workers is a sync mode's (async and ssp take workers as they come)"
    if elastic_min_workers > num_workers:
        return (f"--elastic-min-workers {elastic_min_workers} is above --num-workers {num_workers} "
                "(the most workers the job takes)")
    if replicas_to_aggregate:
        return ("--elastic-min-workers trains every round on its whole batch: no backup workers "
                "(--replicas-to-aggregate)")
    return None


def sparse_rule_conflict(sparse_rule: str, async_apply: str) -> str | None:
    """Why ``--sparse-rule`` cannot go with these settings (one line), or None; raised as
    ``server_settings_conflict``'s are."""
    if sparse_rule not in ("", "sum", "keras"):  # "": the optimizer's (the Keras front door asks keras), else sum
        return f"--sparse-rule must be one of sum, keras, got {sparse_rule!r}"
    if sparse_rule != "keras":
        return None
    if async_apply == "hogwild":
        return ("--sparse-rule keras steps each occurrence of a row, but --async-apply hogwild adds a push's "
                "rows up into a dense step; use --async-apply locked or --sparse-rule sum")
    return None
