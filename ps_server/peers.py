"""A server shard's lines to the other shards of its job.

    peers = Peers(config, token)
    ask = peers.clip_norm("10.0.0.1:50051")
    scale = ask("round 7", 1, {"dense/kernel": np.float32(3.5)}, 60.0)
    commit = peers.commit_round("10.0.0.2:50051")
    version = commit(7, (0, 2), 60.0)   # a shard group: shard 0 commits round 7 there

With ``global_clipnorm`` and the model on several shards, every shard but 0 sends
its squares of each update to shard 0 (``ClipNorm``) and steps with the factor it
answers. The call carries this server's bearer token; under TLS it trusts this
server's own certificate (the shards of one job share a certificate or its
self-signed issuer) and presents it, for a shard 0 that asks clients for one.
A call that fails raises ``ClipTimeout``: the update is not applied.

In a shard group (``core.modes.base.ShardGroup``: elastic sync, sync with backup
workers) shard 0 commits each round it completed on every other shard (``CommitRound``),
with the same token and TLS; a call that fails raises ``ConfigMismatch`` naming the shard.
"""

from __future__ import annotations

import threading
from typing import Callable, Mapping

import grpc
import numpy as np

from ps_common import security
from protos import tfps_pb2 as pb
from protos import tfps_pb2_grpc as pb_grpc
from ps_server.core.clip_group import ClipTimeout
from ps_server.core.errors import ConfigMismatch, InvalidArgument

Ask = Callable[[str, int, Mapping[str, np.floating], float], np.floating]


class Peers:
    """One channel per peer address, made at first use."""

    def __init__(self, config, token: str | None):
        self.config, self.token = config, token
        self._lock, self._stubs = threading.Lock(), {}

    def stub(self, address: str) -> pb_grpc.ParameterServerStub:
        with self._lock:
            if address not in self._stubs:
                tls = self.config.tls_cert_file or None
                key = self.config.tls_key_file or None if tls else None
                channel = security.client_channel(address, ca_file=tls, cert_file=tls, key_file=key, token=self.token)
                self._stubs[address] = pb_grpc.ParameterServerStub(channel)
            return self._stubs[address]

    def clip_norm(self, address: str) -> Ask:
        """``ask(key, shard, squares, timeout) -> factor`` on shard 0 at ``address``."""
        stub = self.stub

        def ask(key: str, shard: int, squares: Mapping[str, np.floating], timeout: float) -> np.floating:
            request = pb.ClipNormRequest(key=key, shard=shard, names=list(squares), timeout_s=timeout,
                                         squares=[float(s) for s in squares.values()],
                                         dtypes=[np.asarray(s).dtype.str for s in squares.values()])
            try:
                reply = stub(address).ClipNorm(request, timeout=timeout + 5.0)
            except grpc.RpcError as e:
                raise ClipTimeout(f"global_clipnorm: shard 0 ({address}) gave no factor for {key}: "
                                  f"{e.code().name}: {e.details()}; nothing applied") from None
            return np.dtype(reply.dtype).type(reply.scale)
        return ask

    def commit_round(self, address: str) -> Callable[[int, tuple, float], int]:
        """``commit(round, contributors, timeout) -> version`` on the follower shard at ``address``."""
        def commit(round_: int, contributors: tuple, timeout: float) -> int:
            request = pb.CommitRoundRequest(round=round_, contributors=list(contributors), timeout_s=timeout)
            try:
                return self.stub(address).CommitRound(request, timeout=timeout + 5.0).version
            except grpc.RpcError as e:
                raise ConfigMismatch(f"shard {address} did not apply round {round_}: {e.code().name}: "
                                     f"{e.details()}") from None
        return commit


def squares_of(request) -> dict[str, np.floating]:
    """A ClipNormRequest's squares, each back in its own dtype (exact: a double holds it)."""
    if not len(request.names) == len(request.squares) == len(request.dtypes):
        raise InvalidArgument("ClipNorm: names, squares and dtypes differ in number")
    out = {}
    for name, value, dtype in zip(request.names, request.squares, request.dtypes):
        try:
            dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or dtype.kind != "f":
            raise InvalidArgument(f"ClipNorm: {name!r}'s squares come as {request.dtypes[len(out)]!r}, not a float")
        out[name] = dtype.type(value)
    return out
