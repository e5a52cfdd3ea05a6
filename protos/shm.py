"""Same-host fast path: tensors through shared memory, gRPC for control only.

    # worker side (PSClient(address, shm=True) does all of this itself)
    seg = shm.Segment.create(nbytes)          # /dev/shm/tfps-<pid>-<random>, mode 0600
    seg.array[...]                            # its bytes, a writable uint8 array
    seg.close()                               # unmap and unlink (also at interpreter exit)

    # server side: what workers name, opened after the checks below, cached
    segments = shm.SegmentCache()
    m = segments.get(worker_id, "push", name, writable=False)    # ShmError if refused
    gradients = shm.views(m, layout.entries, header.shm_offsets)  # zero-copy, read-only
    segments.drop(worker_id)                  # the worker left or registered again

The worker owns its segments: one for pushes (the gradients' bytes, grown when
a push needs more) and one for pulls (the server writes the values there).
They are plain files in ``/dev/shm`` (tmpfs), so any process that sees the same
``/dev/shm`` (the same machine, or containers sharing an IPC namespace) can
map them, and no other can. That is the probe: at Register the worker writes a
random token into its push segment and names both segments; the server reads
the token back and writes a nonce of its own into the pull segment; the worker
uses shared memory only if both match. Every refusal is a ``ShmError`` (reason
SHM_REFUSED), and the service turns it into FAILED_PRECONDITION before anything is
applied, so the worker can fall back to the streams and repeat the call.

Lifetime. A segment's size is fixed for its life; growing makes a new one
under a new name. ``Segment.close`` unlinks it, and so do garbage collection
and interpreter exit (``weakref.finalize``; in the creating process only, not
in a forked child). A worker killed by SIGKILL, or by a signal it has no
handler for, leaves its segments behind: ``ls -l /dev/shm/tfps-*`` finds them,
the pid in the name says whose, and ``rm`` removes them. The server keeps at
most one mapping per worker and role (push, pull); it drops them when the
worker leaves, registers again, or names another segment. Memory of a segment
the worker already unlinked is freed when the server drops its mapping.

Security: what the server opens, reads and writes.

- Only ``/dev/shm/<name>`` where ``name`` starts with ``tfps-``, is at most 255
  characters of ``[A-Za-z0-9._-]`` (so no ``/``: nothing outside the directory).
- Opened with ``O_NOFOLLOW | O_NONBLOCK`` and then checked on the open descriptor: a regular
  file on the ``/dev/shm`` file system, with one link (not a hard link to some
  other program's file), owned by the server's own user. Segments are created
  mode 0600, so only that user (and root) can open them at all; another user's
  file is refused even when the server could open it.
- Push segments are mapped read-only. Every offset and length is checked
  against the file's size before a byte is touched, and writes go through
  bounds-checked slices, so the server never reads or writes outside a segment.
  Every use re-checks the name (inode and size) and re-opens a replaced file.
- What remains, and why it is acceptable: a client that shrinks its own segment
  while the server reads or writes it makes the server fault (SIGBUS), and one
  that writes its push segment during its own push can change the gradient
  after the server checked it for NaN/Inf. Both need the server's own user,
  who can stop the server anyway; PSClient holds a segment still for the whole
  call. (Calls are still authenticated as usual: the token, TLS.)
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from typing import Iterable, Sequence

import numpy as np

from ps_common.reasons import Reason

PREFIX = "tfps-"
DIRECTORY = "/dev/shm"
TOKEN_BYTES = 16  # the probe's token and nonce
ALIGN = 64  # every tensor in a segment starts at a multiple of this (a cache line)
MIN_BYTES = 4096  # a new segment holds at least one page
_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


class ShmError(Exception):
    """The fast path cannot serve this call (reason SHM_REFUSED: the worker streams it instead)."""

    reason = Reason.SHM_REFUSED

    def __init__(self, message: str):
        super().__init__(f"shared memory: {message}")


def check_name(name: str) -> str:
    """``name`` if the server may open it, else ShmError."""
    if not name.startswith(PREFIX) or "/" in name or not _NAME.fullmatch(name):
        raise ShmError(f"segment name {name[:80]!r} refused: it must start with {PREFIX!r} and hold at most "
                       "255 of [A-Za-z0-9._-] (no '/')")
    return name


def new_name() -> str:
    """``tfps-<pid>-<16 hex>``: easy to find, and to tell whose."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def new_token() -> bytes:
    """The probe's random bytes (the worker's token, the server's nonce)."""
    return secrets.token_bytes(TOKEN_BYTES)


def _path(name: str) -> str:
    return os.path.join(DIRECTORY, name)


def aligned_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """(offset of each of ``sizes`` laid end to end at ALIGN boundaries, bytes they span)."""
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + n
    return offsets, end


# -- the worker's side: segments it owns ------------------------------------------------
class Segment:
    """A shared-memory segment this process created and will unlink. Not thread-safe:
    PSClient lends each segment to one call at a time."""

    def __init__(self, name: str, size: int, mm: mmap.mmap):
        self.name, self.size = name, size
        self._mmap = mm
        self.array = np.frombuffer(mm, np.uint8)  # writable: the mapping is
        self.closed = False
        # Unlinks when closed, when garbage-collected, or at interpreter exit, whichever
        # comes first; only in the creating process (a forked child exits without it).
        self._unlink = weakref.finalize(self, _unlink_if_creator, name, os.getpid())

    @classmethod
    def create(cls, size: int) -> "Segment":
        """A new segment of at least ``size`` bytes, its memory reserved now (so a full
        ``/dev/shm`` is an OSError here, not a SIGBUS later). OSError when it cannot be made."""
        size = max(MIN_BYTES, -(-int(size) // MIN_BYTES) * MIN_BYTES)
        while True:
            name = new_name()
            try:
                fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue
            break
        try:
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        os.close(fd)  # the mapping keeps the file open
        return cls(name, size, mm)

    @property
    def path(self) -> str:
        return _path(self.name)

    def close(self) -> None:
        """Unlink and unmap; harmless to repeat. In a forked child, only forgets it."""
        if self.closed:
            return
        self.closed = True
        self._unlink()
        self.array = None
        try:
            self._mmap.close()
        except BufferError:  # someone still holds a view: unmapped when it goes
            pass


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def _unlink_if_creator(name: str, creator: int) -> None:
    if os.getpid() == creator:
        _unlink(name)


# -- the server's side: segments workers name -------------------------------------------
@dataclasses.dataclass(frozen=True)
class Mapping:
    """One worker's segment, mapped by the server."""

    name: str
    size: int
    inode: tuple[int, int]  # (st_dev, st_ino)
    writable: bool
    array: np.ndarray  # uint8 over the whole mapping; read-only unless writable


def _directory_device() -> int:
    return os.stat(DIRECTORY).st_dev


def open_segment(name: str, writable: bool) -> Mapping:
    """Map ``/dev/shm/<name>`` after every check of the module docstring, or ShmError."""
    check_name(name)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO must not block us
    try:
        fd = os.open(_path(name), flags)
    except FileNotFoundError:
        raise ShmError(f"no segment {name!r} in {DIRECTORY} on the server's host (is the server on another "
                       "host, or in another IPC namespace?)") from None
    except PermissionError:
        raise ShmError(f"segment {name!r}: permission denied (does the server run as another user?)") from None
    except OSError as e:  # ELOOP: a symbolic link
        raise ShmError(f"segment {name!r} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_dev != _directory_device():
            raise ShmError(f"segment {name!r} is not a regular file in {DIRECTORY}")
        if st.st_nlink != 1:
            raise ShmError(f"segment {name!r} has {st.st_nlink} links; a segment has exactly one")
        if st.st_uid != os.geteuid():
            raise ShmError(f"segment {name!r} belongs to uid {st.st_uid}; the server runs as uid {os.geteuid()}")
        if st.st_size <= 0:
            raise ShmError(f"segment {name!r} is empty")
        access = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, access)
        except (OSError, ValueError) as e:
            raise ShmError(f"segment {name!r} cannot be mapped: {e}") from None
    finally:
        os.close(fd)
    array = np.frombuffer(mm, np.uint8)
    if not writable:
        array.flags.writeable = False
    return Mapping(name, st.st_size, (st.st_dev, st.st_ino), writable, array)


class SegmentCache:
    """The server's mappings: at most one per (worker id, role). Thread-safe; the lock is a
    leaf lock, never held while a file is opened or a byte copied.

    A dropped mapping is unmapped once the last call using it ends (its arrays hold it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, str], Mapping] = {}

    def get(self, worker_id: int, role: str, name: str, writable: bool) -> Mapping:
        """The mapping of ``name`` for this worker's ``role``, opened if new, changed or
        replaced on disk (the worker's previous segment for that role is dropped)."""
        check_name(name)
        key = (worker_id, role)
        with self._lock:
            cached = self._maps.get(key)
        if cached is not None and cached.name == name and cached.writable == writable:
            try:
                st = os.stat(_path(name), follow_symlinks=False)
            except OSError:
                st = None
            if st is not None and (st.st_dev, st.st_ino) == cached.inode and st.st_size == cached.size:
                return cached
        mapping = open_segment(name, writable)
        with self._lock:
            self._maps[key] = mapping
        return mapping

    def drop(self, worker_id: int) -> None:
        with self._lock:
            for key in [k for k in self._maps if k[0] == worker_id]:
                del self._maps[key]

    def names(self) -> dict[tuple[int, str], str]:
        """(worker id, role) -> segment name, for tests and status pages."""
        with self._lock:
            return {k: m.name for k, m in self._maps.items()}


# -- tensors in a segment ---------------------------------------------------------------
def _span(mapping_size: int, name: str, offset: int, nbytes: int, what: str) -> None:
    if offset < 0 or offset + nbytes > mapping_size:
        raise ShmError(f"tensor {name!r}: {nbytes} bytes at offset {offset} do not fit in segment {what} "
                       f"of {mapping_size} bytes")


def views(mapping: Mapping, entries: Sequence, offsets: Sequence[int]) -> dict[str, np.ndarray]:
    """name -> a view of each entry (``stream.Entry``: name, dtype, shape, nbytes) at its
    offset in the mapping, after checking every offset; read-only if the mapping is."""
    if len(offsets) != len(entries):
        raise ShmError(f"{len(offsets)} offsets for {len(entries)} tensors")
    out = {}
    for e, off in zip(entries, offsets):
        _span(mapping.size, e.name, off, e.nbytes, repr(mapping.name))
    for e, off in zip(entries, offsets):
        out[e.name] = mapping.array[off:off + e.nbytes].view(e.dtype).reshape(e.shape)
    return out


def write(mapping: Mapping, arrays: dict[str, np.ndarray], offsets: Sequence[int]) -> None:
    """Copy each array's bytes (C-contiguous, little-endian: ``stream.to_wire``) to its
    offset in the mapping, after checking every offset."""
    if len(offsets) != len(arrays):
        raise ShmError(f"{len(offsets)} offsets for {len(arrays)} tensors")
    for (name, a), off in zip(arrays.items(), offsets):
        _span(mapping.size, name, off, a.nbytes, repr(mapping.name))
    for a, off in zip(arrays.values(), offsets):
        mapping.array[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def needed_bytes(sizes: Iterable[int]) -> int:
    """Bytes a segment needs to hold tensors of ``sizes`` laid out by ``aligned_offsets``."""
    return aligned_offsets(sizes)[1]


__all__ = ["ALIGN", "DIRECTORY", "Mapping", "PREFIX", "Segment", "SegmentCache", "ShmError", "TOKEN_BYTES",
           "aligned_offsets", "check_name", "needed_bytes", "open_segment", "views", "write"]
