"""Records to protobuf messages and back, driven by the records' fields.

    reply = convert.REGISTRATION.to_wire(reg)               # ps_server.service
    reg = convert.REGISTRATION.from_wire(reply, shm=True)    # worker.client

A ``Conversion`` pairs a dataclass with a message. Every field of the record goes
to the message field of the same name, unless the table renames it (the wire
spells units: ``lease_timeout`` is ``lease_timeout_s``), converts it (the mode
name is the ``Mode`` enum), or names it local (it never travels). Message fields
no record field fills are named ``wire_only``: the caller sets them (the
shared-memory probe's answer, the values of the sync shortcut). ``problems()``
lists every field that is none of these, so a field added on either side without
a way across fails ``tests/service/test_records.py``; ``to_wire`` of a record
whose field the message lacks raises ValueError at once.

The records both sides share (``ps_common.records``) have their conversions here;
the server's status (``ps_server.core``) has its own in ``ps_server.service``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

from protos import codec, wire
from protos import tfps_pb2 as pb
from ps_common.records import PushReply, Registration


class Conversion:
    def __init__(self, record: type, message: type, *, rename: Mapping[str, str] = (),
                 to_wire: Mapping[str, Callable] = (), from_wire: Mapping[str, Callable] = (),
                 local: Iterable[str] = (), wire_only: Iterable[str] = ()):
        self.record, self.message = record, message
        self.rename = dict(rename)
        self._to, self._from = dict(to_wire), dict(from_wire)
        self.local, self.wire_only = frozenset(local), frozenset(wire_only)

    def _travelling(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.record) if f.name not in self.local]

    def to_wire(self, record, **convert: Callable):
        """The message of ``record``; ``convert`` adds converters for this call (a
        value that depends on the moment, such as an age)."""
        how = {**self._to, **convert}
        values = {}
        for name in self._travelling():
            value = getattr(record, name)
            values[self.rename.get(name, name)] = how[name](value) if name in how else value
        return self.message(**values)

    def from_wire(self, message, **local):
        """The record of ``message``; ``local`` gives the fields that do not travel."""
        values = {}
        for name in self._travelling():
            value = getattr(message, self.rename.get(name, name))
            values[name] = self._from[name](value) if name in self._from else value
        return self.record(**values, **local)

    def problems(self) -> list[str]:
        """Every field with no way across, as a sentence; [] when the two sides match."""
        record_fields = {f.name for f in dataclasses.fields(self.record)}
        message_fields = {f.name for f in self.message.DESCRIPTOR.fields}
        out = [f"{self.record.__name__}.{name} is listed as local or renamed but is no field"
               for name in sorted((self.local | set(self.rename)) - record_fields)]
        out += [f"{self.message.__name__}.{name} is listed as wire-only but is no field"
                for name in sorted(self.wire_only - message_fields)]
        carried = {self.rename.get(name, name) for name in self._travelling()}
        out += [f"{self.record.__name__}.{name} has no field {self.rename.get(name, name)!r} in "
                f"{self.message.__name__}: rename it, or list it as local"
                for name in self._travelling() if self.rename.get(name, name) not in message_fields]
        out += [f"{self.message.__name__}.{name} is filled by no field of {self.record.__name__}: add one, "
                "or list it as wire-only" for name in sorted(message_fields - carried - self.wire_only)]
        return out


REGISTRATION = Conversion(
    Registration, pb.RegisterResponse,
    rename={"barrier_timeout": "barrier_timeout_s", "lease_timeout": "lease_timeout_s"},
    to_wire={"mode": wire.mode_to_wire}, from_wire={"mode": wire.mode_from_wire},
    local={"shm"},  # the client's own conclusion from the probe's answer below
    wire_only={"shm_token", "shm_nonce", "shm_error"},  # the probe's answer (ps_server.service)
)

def metrics_to_wire(metrics: Mapping[str, "np.ndarray"]) -> list:
    """A push reply's metric sums as Tensors (``protos.codec``), in name order."""
    return [codec.encode(name, metrics[name]) for name in sorted(metrics)]


def metrics_from_wire(tensors) -> dict:
    """Tensors back to {name: read-only array}; ``codec.CodecError`` for a malformed one."""
    return codec.decode_many(tensors)


PUSH_REPLY = Conversion(
    PushReply, pb.PushResponse,
    to_wire={"metrics": metrics_to_wire}, from_wire={"metrics": metrics_from_wire},
    # the sync shortcut's values (PushRequest.return_values); elastic sync's next work, set by the
    # service while a round goes on (ps_server.core.modes.elastic_mode.ElasticReply)
    wire_only={"variables", "incarnation", "assignment"},
)

CONVERSIONS = (REGISTRATION, PUSH_REPLY)
