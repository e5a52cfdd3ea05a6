"""The answers both sides agree on, each defined once: a registration and a push's reply.

    from ps_common.records import Registration, PushReply
    reg = Registration(worker_id=0, mode="sync", num_workers=2, initialized=False, version=0,
                       barrier_timeout=60.0)

The server's core returns these records (``ParameterServer.register``, every mode's
``push``), ``ps_server.service`` sends them as ``RegisterResponse`` and
``PushResponse``, and ``worker.client`` reads them back, both through the one
field-driven conversion in ``protos.convert``. ``worker.sharded_client`` combines
several shards' records with one rule per field. A field added here travels, or a
test (``tests/service/test_records.py``) fails.

Plain frozen dataclasses: no protobuf, so the server's pure core imports them.
"""

from __future__ import annotations

import dataclasses

from ps_common.defaults import LEASE_TIMEOUT


@dataclasses.dataclass(frozen=True)
class Registration:
    """What a worker learns when it joins (``RegisterResponse``)."""

    worker_id: int
    mode: str  # one of ps_common.names.MODES
    num_workers: int
    initialized: bool
    version: int
    barrier_timeout: float  # sync: how long a push may wait at the barrier (s)
    round: int = 0  # sync: the round the server is collecting; a (re)joining worker starts there
    lease_timeout: float = LEASE_TIMEOUT  # a worker silent this long is declared dead (s)
    incarnation: str = ""  # changes every time a server process starts
    # Sync: restored from a checkpoint, no push taken since: the first push sets the round
    round_restored: bool = False
    # The rule repeated rows follow: "keras" wants every occurrence of an embedding's rows pushed
    # as TensorFlow gave them (worker.gradients), "sum" them summed; "": the server has no
    # --sparse-rule and no optimizer yet, so the initializing optimizer's ask decides
    # (worker.connection.Connection.sparse_rule)
    sparse_rule: str = "sum"
    # The worker's own: the same-host fast path is on for this registration (its probe
    # succeeded). Never on the wire: the server's core leaves it False.
    shm: bool = False


@dataclasses.dataclass(frozen=True)
class PushReply:
    """What a push is answered (``PushResponse``, less the values of the sync shortcut)."""

    version: int  # the version after this gradient was applied
    staleness: int  # server version at apply time minus base_version
    contributors: int = 1  # sync: how many workers contributed to the round
    dropped: bool = False  # sync with backup workers: the round completed without it
    next_step: int = 0  # the step this worker should push next
    replayed: bool = False  # already applied before: this is the recorded answer
    # The learning rate the optimizer used for this update (a schedule's value at the
    # update count, or the constant or last set one; with stale policy "scale", before
    # scaling); 0.0 when nothing was applied (dropped). A replay carries the recorded one.
    learning_rate: float = 0.0
    # Sync: the round's sum of the pushed metrics, name -> read-only array, the same bits
    # for every participant; {} in async and ssp, for a dropped push, and when none were
    # pushed. Left out of ==: arrays compare element by element, not as one truth value.
    metrics: dict = dataclasses.field(default_factory=dict, compare=False)


__all__ = ["PushReply", "Registration"]
