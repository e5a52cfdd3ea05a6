"""Which ps-server shard holds which variable, or which slice of it.

    placement = plan({"dense/kernel": ((21632, 10), "float32"), ...}, num_shards=2)
    per_shard = placement.split(values)        # one {piece: array} per shard, views where possible
    values = placement.join(per_shard)         # back to {variable: array}, bit-exact
    placement = learn([{piece: (shape, dtype)}, ...])   # the same placement, read back from the shards

Plain NumPy: no gRPC, no TensorFlow (``worker.sharded_client`` does the talking).

**Pieces.** A variable is either placed whole, under its own name
(``dense/kernel``), or cut along axis 0 into contiguous row blocks, each a
piece named ``<variable>/part_<k>_of_<n>`` (``dense/kernel/part_0_of_2``). The
names say everything needed to put the variable back together, so ``learn``
rebuilds a placement from what the shards hold, with no plan at hand.

**Slicing** follows TensorFlow's ``MinSizePartitioner``: a variable with at
least 2 rows is cut into ``n = min(num_shards, rows, nbytes // min_slice_bytes)``
blocks when that is 2 or more, so every slice holds at least ``min_slice_bytes``
(default 256 KiB) and no variable has more slices than there are shards. Row
counts differ by at most one, the larger blocks first (``np.array_split``).
(``min_slice_bytes=1`` is ``FixedShardsPartitioner``.) A 0-d scalar or a 1-row
variable is never cut.

**Balance.** Pieces larger than ``small_bytes`` (default 16 KiB) are placed
largest first, each onto the shard holding the fewest bytes (ties: fewer
pieces, then the lower index); the ``n`` slices of one variable go to the
``n`` least-loaded shards, one each, the largest slice onto the least loaded.
Then the small pieces (biases, scalars) are dealt out one by one to the shard
holding the fewest small pieces (ties: fewer bytes, then the lower index), so
they spread over the shards instead of all landing on the least-loaded one:
each costs a tensor on every pull and push, not bandwidth. The largest shard
holds at most ``total / num_shards + largest piece + ceil(small pieces /
num_shards) * small_bytes`` bytes (``tests/worker/test_sharding.py`` checks
it). ``plan`` is deterministic: every worker that builds the same model computes the
same placement without talking to the others.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Mapping, Sequence

import numpy as np

from ps_common.names import unshared
from ps_common.sparse import SparseRows

DEFAULT_MIN_SLICE_BYTES = 256 * 1024
DEFAULT_SMALL_BYTES = 16 * 1024

_PART = re.compile(r"^(?P<variable>.+)/part_(?P<k>\d+)_of_(?P<n>\d+)$")

Spec = tuple[tuple[int, ...], np.dtype]


class ShardingError(ValueError):
    """Values or shard contents that do not fit the placement; the message says which."""


def piece_name(variable: str, part: int, parts: int) -> str:
    return variable if parts == 1 else f"{variable}/part_{part}_of_{parts}"


@dataclasses.dataclass(frozen=True)
class Piece:
    """A whole variable (``parts == 1``) or rows ``start:stop`` of it, on one shard."""

    name: str
    variable: str
    shard: int
    part: int
    parts: int
    start: int  # first row (0 for a whole variable)
    stop: int  # one past the last row (a whole variable: its rows, 0 for a 0-d scalar)
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every piece lives. Build it with ``plan`` or ``learn``, not by hand."""

    num_shards: int
    variables: dict[str, Spec]  # in the order join returns them
    pieces: tuple[Piece, ...]  # variable order, then part order

    # -- queries ---------------------------------------------------------------------
    def on_shard(self, shard: int) -> list[Piece]:
        return [p for p in self.pieces if p.shard == shard]

    def shard_bytes(self) -> list[int]:
        return [sum(p.nbytes for p in self.on_shard(s)) for s in range(self.num_shards)]

    def empty_shards(self) -> list[int]:
        return [s for s in range(self.num_shards) if not self.on_shard(s)]

    def shards_of(self, names: Sequence[str]) -> dict[int, list[str]]:
        """Shard -> the piece names that hold the given variables (unknown names raise)."""
        unknown = [n for n in names if n not in self.variables]
        if unknown:
            raise ShardingError(f"unknown variable(s) {unknown[:4]}")
        wanted = set(names)
        out: dict[int, list[str]] = {}
        for p in self.pieces:
            if p.variable in wanted:
                out.setdefault(p.shard, []).append(p.name)
        return out

    def describe(self, addresses: Sequence[str] | None = None) -> list[str]:
        """One line per shard for logs: bytes, share, and its pieces."""
        sizes = self.shard_bytes()
        total = sum(sizes) or 1
        lines = []
        for s in range(self.num_shards):
            where = f" ({addresses[s]})" if addresses else ""
            names = ", ".join(sorted(p.name for p in self.on_shard(s))) or "nothing"
            lines.append(f"shard {s}{where}: {sizes[s]:,} bytes ({100 * sizes[s] / total:.1f}%): {names}")
        return lines

    # -- moving arrays ---------------------------------------------------------------
    def split(self, values: Mapping[str, np.ndarray], partial: bool = False) -> list[dict[str, np.ndarray]]:
        """One ``{piece: array}`` per shard: whole variables as they are, slices as row views. A
        ``SparseRows`` of a sliced variable goes to each slice's shard as the rows in the slice,
        renumbered from its first row. ``partial``: a variable not in ``values`` is left out
        (a push of one optimizer's variables: each shard refuses it unless its spec allows). A
        variable's second name (``ps_common.names.shared_name``: a later optimizer group's) goes
        as its pieces' second names."""
        named: dict[str, list[tuple[str, str]]] = {}  # variable -> (key, suffix) of each of its names in values
        for key in values:
            variable = key if key in self.variables else unshared(key)[0]
            named.setdefault(variable, []).append((key, key[len(variable):]))
        missing = [n for n in self.variables if n not in values and not partial]
        extra = [k for v, keys in named.items() if v not in self.variables for k, _ in keys]
        if missing or extra:
            raise ShardingError(f"values do not match the placement: missing {missing[:4]}, unknown {extra[:4]}")
        out: list[dict[str, np.ndarray]] = [{} for _ in range(self.num_shards)]
        for p, (key, suffix) in ((p, k) for p in self.pieces for k in named.get(p.variable, ())):
            shape = self.variables[p.variable][0]
            value = values[key]
            if isinstance(value, SparseRows):
                if value.values.shape[1:] != shape[1:]:
                    raise ShardingError(f"sparse {p.variable!r} has rows of shape {list(value.values.shape[1:])}, "
                                        f"the placement says {list(shape[1:])}")
                if p.parts == 1:
                    out[p.shard][p.name + suffix] = value
                else:
                    mine = (value.rows >= p.start) & (value.rows < p.stop)
                    out[p.shard][p.name + suffix] = SparseRows(value.rows[mine] - p.start, value.values[mine])
                continue
            array = np.asarray(value)
            if array.shape != shape:
                raise ShardingError(f"{p.variable!r} has shape {list(array.shape)}, the placement says {list(shape)}")
            out[p.shard][p.name + suffix] = array if p.parts == 1 else array[p.start : p.stop]
        return out

    def join(self, per_shard: Sequence[Mapping[str, np.ndarray]], partial: bool = False) -> dict[str, np.ndarray]:
        """``{variable: array}`` from one ``{piece: array}`` per shard: slices concatenated in row
        order (a copy), whole variables as they are. ``ShardingError`` for a piece on the wrong
        shard, of the wrong shape or dtype, unknown, or missing (but with ``partial`` a variable
        none of whose pieces is present is left out: a pull of some variables)."""
        if len(per_shard) != self.num_shards:
            raise ShardingError(f"{len(per_shard)} shard replies for {self.num_shards} shards")
        expected = {p.name: p for p in self.pieces}
        got: dict[str, np.ndarray] = {}
        for shard, pieces in enumerate(per_shard):
            for name, array in pieces.items():
                p = expected.get(name)
                if p is None or p.shard != shard:
                    where = "is not part of the placement" if p is None else f"belongs on shard {p.shard}"
                    raise ShardingError(f"shard {shard} holds piece {name!r}, which {where}")
                if array.shape != p.shape or array.dtype.newbyteorder("=") != p.dtype.newbyteorder("="):
                    raise ShardingError(f"shard {shard} holds {name!r} as {array.dtype}{list(array.shape)}, "
                                        f"the placement says {p.dtype}{list(p.shape)}")
                got[name] = array
        out: dict[str, np.ndarray] = {}
        for variable in self.variables:
            parts = [p for p in self.pieces if p.variable == variable]
            lacking = [p.name for p in parts if p.name not in got]
            if partial and len(lacking) == len(parts):
                continue
            if lacking:
                raise ShardingError(f"{variable!r} is incomplete: no {lacking[:4]}")
            out[variable] = got[parts[0].name] if len(parts) == 1 else np.concatenate([got[p.name] for p in parts])
        return out


def specs_of(values: Mapping[str, np.ndarray]) -> dict[str, Spec]:
    """``{name: (shape, dtype)}`` of arrays, in their order."""
    return {n: (tuple(np.shape(a)), np.asarray(a).dtype) for n, a in values.items()}


def plan(specs: Mapping[str, tuple], num_shards: int, min_slice_bytes: int = DEFAULT_MIN_SLICE_BYTES,
         small_bytes: int = DEFAULT_SMALL_BYTES) -> Placement:
    """The placement of ``specs`` (``{name: (shape, dtype)}``) over ``num_shards`` shards.

    The same names, shapes and dtypes give the same placement, whatever the order of
    ``specs``. A shard may come out empty when there are fewer pieces than shards."""
    if num_shards < 1:
        raise ShardingError(f"num_shards must be >= 1, got {num_shards}")
    if min_slice_bytes < 1 or small_bytes < 0:
        raise ShardingError("min_slice_bytes must be >= 1 and small_bytes >= 0")

    # Each variable's pieces, the largest first (np.array_split's order), on shard 0 until placed below.
    variables: dict[str, Spec] = {}
    groups: dict[str, list[Piece]] = {}
    for name, (shape, dtype) in specs.items():
        if not name or _PART.match(name):
            raise ShardingError(f"variable name {name!r} cannot be sharded: it is empty or ends like a slice "
                                "name (/part_<k>_of_<n>)")
        shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        if any(d < 0 for d in shape):
            raise ShardingError(f"variable {name!r} has a negative dimension: {list(shape)}")
        variables[name] = (shape, dtype)
        # Slicing (module docstring): a 0-d scalar stays whole, and so does a 1-row variable (min <= 1).
        n = max(1, min(num_shards, shape[0], math.prod(shape) * dtype.itemsize // min_slice_bytes)) if shape else 1
        rows = [shape[0] // n + (k < shape[0] % n) for k in range(n)] if shape else [0]  # np.array_split's sizes
        starts = [0, *itertools.accumulate(rows)]
        groups[name] = [Piece(piece_name(name, k, n), name, 0, k, n, starts[k], starts[k + 1],
                              (rows[k], *shape[1:]) if shape else (), dtype) for k in range(n)]

    load = [0] * num_shards
    count = [0] * num_shards
    small_count = [0] * num_shards
    # Largest first; the name breaks ties so the order of specs does not matter. The large
    # pieces go first, by load; then the small ones, by how many small pieces a shard holds.
    order = sorted(variables, key=lambda n: (-groups[n][0].nbytes, n))
    small = {n for n in order if groups[n][0].nbytes <= small_bytes and len(groups[n]) == 1}
    for name in sorted(order, key=lambda n: n in small):  # stable: the large first, each largest first
        fewest = (lambda s: (small_count[s], load[s], s)) if name in small else (lambda s: (load[s], count[s], s))
        shards = sorted(range(num_shards), key=fewest)
        groups[name] = [dataclasses.replace(p, shard=s) for p, s in zip(groups[name], shards)]
        for p in groups[name]:
            load[p.shard] += p.nbytes
            count[p.shard] += 1
            small_count[p.shard] += name in small
    return Placement(num_shards, variables, tuple(p for name in variables for p in groups[name]))


def norms_of(optimizer: Mapping) -> list[str]:
    """The options of ``optimizer`` (the server's fields) that take a norm of a whole variable
    (``clipnorm``, ``global_clipnorm``, Lamb's trust ratio, Adafactor's row and column means):
    with them the planner keeps every variable whole (``ShardedClient.initialize``)."""
    norms = [option for option in ("clipnorm", "global_clipnorm") if optimizer.get(option)]
    return norms + [f"{name}'s per-variable norms" for name in ("Lamb", "Adafactor")
                    if optimizer.get("name") == name.lower()]


def grouped(optimizer: Mapping, placement: Placement) -> Mapping:
    """``optimizer`` (the server's fields) with each of its ``groups`` naming its variables'
    pieces, as a shard holds them: a slice is stepped by its variable's group's optimizer."""
    if not optimizer.get("groups"):
        return optimizer
    pieces: dict[str, list[str]] = {}
    for p in placement.pieces:
        pieces.setdefault(p.variable, []).append(p.name)
    return {**optimizer, "groups": [{**g, "variables": [n for v in g["variables"] for n in pieces.get(v, [v])]}
                                    for g in optimizer["groups"]]}


def learn(per_shard: Sequence[Mapping[str, tuple]]) -> Placement:
    """The placement that the shards' contents describe: ``per_shard[s]`` is ``{piece: (shape,
    dtype)}`` (or ``{piece: array}``) of shard ``s``. Variables come out in the order their first
    piece appears, shard by shard. ``ShardingError`` when the pieces do not make whole variables
    (a part missing or doubled, or parts that disagree on dtype or trailing shape)."""
    found: dict[str, dict[int, tuple[int, tuple[int, ...], np.dtype]]] = {}  # variable -> part -> (shard, ...)
    totals: dict[str, int] = {}
    for shard, pieces in enumerate(per_shard):
        for name, spec in pieces.items():
            shape, dtype = (spec.shape, spec.dtype) if isinstance(spec, np.ndarray) else spec
            shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
            m = _PART.match(name)
            variable, k, n = (m["variable"], int(m["k"]), int(m["n"])) if m else (name, 0, 1)
            if n < 2 and m:
                raise ShardingError(f"shard {shard} holds {name!r}: a variable is never cut into fewer than 2 parts")
            if totals.setdefault(variable, n) != n:
                raise ShardingError(f"pieces of {variable!r} disagree on the number of parts "
                                    f"({totals[variable]} and {n}, shard {shard})")
            if k >= n:
                raise ShardingError(f"shard {shard} holds {name!r}: part {k} of {n} does not exist")
            if k in found.setdefault(variable, {}):
                raise ShardingError(f"{name!r} is held twice (shards {found[variable][k][0]} and {shard})")
            if m and not shape:
                raise ShardingError(f"shard {shard} holds {name!r} as a 0-d scalar: a slice has rows")
            found[variable][k] = (shard, shape, dtype)

    variables: dict[str, Spec] = {}
    pieces: list[Piece] = []
    for variable, parts in found.items():
        n = totals[variable]
        missing = [k for k in range(n) if k not in parts]
        if missing:
            raise ShardingError(f"{variable!r} is incomplete: no part(s) {missing} of {n} on any shard")
        first = parts[0]
        if any(parts[k][2] != first[2] or parts[k][1][1:] != first[1][1:] for k in range(n)):
            raise ShardingError(f"the parts of {variable!r} disagree on dtype or trailing shape")
        start = 0
        for k in range(n):
            shard, shape, dtype = parts[k]
            stop = start + (shape[0] if shape else 0)
            pieces.append(Piece(piece_name(variable, k, n), variable, shard, k, n, start, stop, shape, dtype))
            start = stop
        variables[variable] = (first[1] if n == 1 else (start, *first[1][1:]), first[2])
    return Placement(len(per_shard), variables, tuple(pieces))
