"""What a parameter server runs by: one object, handed to the core whole.

    settings = Settings(mode="sync", num_workers=2, barrier_timeout=60.0)
    settings = Settings.of(config)          # ServerConfig holds them by the same names
    ParameterServer(**dataclasses.asdict(settings))

The flags ``ps-server`` takes that reach the core, each named as its flag (``docs/running.md``),
checked together once (``ps_common.defaults.server_settings_conflict``). Plain Python.
"""

from __future__ import annotations

import dataclasses

from ps_common.defaults import (BARRIER_TIMEOUT, LEASE_TIMEOUT, MAX_STALENESS, REPLACEMENT_TIMEOUT, STALENESS,
                                 server_settings_conflict, sparse_rule_conflict)
from ps_server.core.errors import InvalidArgument


@dataclasses.dataclass(frozen=True)
class Settings:
    mode: str = "sync"
    num_workers: int = 1
    barrier_timeout: float = BARRIER_TIMEOUT
    lease_timeout: float = LEASE_TIMEOUT
    dead_worker_policy: str = "abort"  # sync: abort | wait | shrink
    replacement_timeout: float = REPLACEMENT_TIMEOUT
    replicas_to_aggregate: int = 0  # sync backup workers: the first K pushes end a round (0: all)
    allow_nonfinite: bool = False
    staleness: int = STALENESS  # ssp's S (-1 in other modes)
    stale_gradient_policy: str = "none"
    max_staleness: int = MAX_STALENESS
    sparse_updates: str = "exact"
    sparse_rule: str = ""
    async_apply: str = "locked"
    elastic_min_workers: int = 0
    micro_batches: int = 0  # elastic sync: micro-batches of a global batch (0 elsewhere)

    def __post_init__(self) -> None:
        conflict = server_settings_conflict(self.mode, self.num_workers, self.stale_gradient_policy,
                                            self.async_apply, self.elastic_min_workers, self.micro_batches,
                                            self.replicas_to_aggregate)
        conflict = conflict or sparse_rule_conflict(self.sparse_rule, self.async_apply)
        if conflict:
            raise InvalidArgument(conflict)
        fix = object.__setattr__
        fix(self, "micro_batches", (self.micro_batches or self.num_workers) if self.elastic else 0)
        fix(self, "staleness", self.staleness if self.mode == "ssp" else -1)
        if self.async_apply == "hogwild":  # adds a push's rows up: the optimizer cannot ask for the keras rule
            fix(self, "sparse_rule", self.sparse_rule or "sum")

    @classmethod
    def of(cls, config) -> "Settings":
        """The core's share of ``config`` (a ``ServerConfig``, or anything with these names)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    @property
    def elastic(self) -> bool:
        """Elastic sync (``core.modes.elastic_mode``): from elastic_min_workers up to num_workers."""
        return self.elastic_min_workers > 0
