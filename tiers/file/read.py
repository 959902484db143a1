"""Reading FileTier shards back: pieces side by side, each checksummed as it lands, and read
past the page cache where the bytes are not in it.

A shard is read in pieces (``piece_bytes``) by the tier's read pool, one job per piece.
Each piece is read by one of two ways, chosen per piece:

- **Past the page cache** (``O_DIRECT``), when most of the piece's pages are not cached
  (``mincore`` over a mapping of its range; a cold restore). The disk writes straight into
  the destination where it is block-aligned (:data:`ALIGN`: a restore allocates its new
  tensors so), and into a per-thread bounce buffer copied out slice by slice where it is
  not (an ``into=`` target from PyTorch's allocator). Measured on a 2-vCPU VM: about a
  sixth of the CPU time of a buffered read of the same cold bytes, and faster, since the
  kernel neither fills nor copies page-cache pages (docs/design.md, "Reading a shard back, cold").
- **Through the page cache** (``preadv``), when the bytes are cached (a restore right after
  a buffered write, a second restore), where the file system refuses ``O_DIRECT``, for an
  unaligned tail, or with ``read_direct=False``.

With ``checksum``, every piece's crc32c is computed by the thread that read it, right
after the bytes landed in the destination (slice by slice where they passed through the
cache or a bounce buffer, so that the checksum reads them from the cache, not from
memory); :func:`crc32c_combine` joins the pieces'. The checksum covers the bytes as they
are in the destination, so it still checks the copy end to end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from lazyckpt.tier import CorruptionError, ShardMeta, crc32c_combine

from .io import ALIGN

__all__ = ["DataFile", "combine", "open_piece", "read_piece"]

_SLICE = 256 << 10  # checksummed right after landing, while in the core's L2 cache
_BOUNCE = 8 << 20  # per reading thread: a whole default piece in one direct read (2 MiB: 0.7x)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@dataclass
class DataFile:
    """A data file opened to read one piece of a shard: a buffered descriptor, and one
    opened ``O_DIRECT`` when the piece is read past the page cache."""

    path: Path
    fd: int
    direct_fd: int | None

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)


def open_piece(path: Path, offset: int, length: int, direct: bool) -> DataFile:
    """Open ``path`` to read ``length`` bytes at ``offset``; with ``direct``, also
    ``O_DIRECT`` unless those bytes are mostly in the page cache or the file system refuses
    it. A missing file is :class:`CorruptionError` (a committed step's data file is
    missing)."""
    try:
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    except FileNotFoundError:
        raise CorruptionError(f"{path} is missing") from None
    direct_fd = None
    try:
        if direct and _O_DIRECT and not _mostly_cached(fd, offset, length):
            with contextlib.suppress(OSError):  # tmpfs and others refuse O_DIRECT
                direct_fd = os.open(path, os.O_RDONLY | _O_DIRECT | _CLOEXEC)
    except BaseException:
        os.close(fd)
        raise
    return DataFile(path, fd, direct_fd)


def read_piece(
    path: Path,
    shard: ShardMeta,
    out: memoryview,
    base: int,
    start: int,
    piece: int,
    checksum: bool,
    direct: bool,
) -> int:
    """Read bytes ``[start, start + piece)`` of ``shard`` (clipped to it) from ``path`` into
    ``out``, whose memory starts at address ``base`` (-1: a read-only view, which
    ``preadv`` refuses); their crc32c with ``checksum`` (else 0).

    One job on the tier's read pool does it all (open, read, checksum, close): on two cores
    shared with training, every hand-over between threads waits for a time slice, so a
    piece costs one hand-over there and one back, not more. The descriptors are the job's
    own, so a restore cancelled meanwhile leaves none behind."""
    stop = min(start + piece, shard.length)
    file = open_piece(path, shard.offset + start, stop - start, direct)
    try:
        return _read_open(file, shard, out, base, start, stop, checksum)
    finally:
        file.close()


def _read_open(
    file: DataFile, shard: ShardMeta, out: memoryview, base: int, start: int, stop: int,
    checksum: bool,
) -> int:
    crc = 0
    at = start
    head = (stop - start) // ALIGN * ALIGN
    if file.direct_fd is not None and head and base >= 0:
        if (base + start) % ALIGN == 0:
            got = _direct(file.direct_fd, out[start : start + head], shard.offset + start)
            if checksum and got:
                crc = crc32c.crc32c(out[start : start + got])
            at = start + got
        else:
            at, crc = _direct_bounced(file, shard, base, start, start + head, checksum)
    while at < stop:  # through the page cache: the rest, or all of it
        end = min(at + _SLICE, stop)
        _pread(file, shard, out[at:end], at)
        if checksum:
            crc = crc32c.crc32c(out[at:end], crc)
        at = end
    return crc


def combine(crcs: list[int], starts: range, length: int) -> int:
    """The crc32c of a shard of ``length`` bytes from its pieces' (which begin at
    ``starts``)."""
    total = 0
    for i, (crc, start) in enumerate(zip(crcs, starts, strict=True)):
        stop = starts[i + 1] if i + 1 < len(starts) else length
        total = crc if i == 0 else crc32c_combine(total, crc, stop - start)
    return total


def _pread(file: DataFile, shard: ShardMeta, view: memoryview, at: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(file.fd, [view[done:]], shard.offset + at + done)
        if n == 0:
            raise CorruptionError(
                f"{file.path} is truncated: shard {shard.index} ends past the file"
            )
        done += n


def _direct(fd: int, view: memoryview, offset: int) -> int:
    """Read ``view`` (aligned, a whole number of blocks) from ``offset`` past the page
    cache; how many bytes came. Fewer at the end of the file, or none where the device
    refuses the alignment (the caller reads the rest through the cache)."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # a device wanting a larger alignment
                return done
            raise
        done += n
        if n == 0 or n % ALIGN:  # the end of the file: the rest is the caller's
            return done
    return done


class _Bounce(threading.local):
    view: memoryview | None = None
    address = 0


_bounce = _Bounce()


def _bounce_buffer() -> tuple[memoryview, int]:
    """This thread's aligned bounce buffer (allocated once per reading thread)."""
    if _bounce.view is None:
        buffer = mmap.mmap(-1, _BOUNCE)  # page-aligned, so block-aligned
        _bounce.view = memoryview(buffer)
        _bounce.address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return _bounce.view, _bounce.address


def _direct_bounced(
    file: DataFile, shard: ShardMeta, base: int, start: int, stop: int, checksum: bool
) -> tuple[int, int]:
    """``[start, stop)`` (block-aligned length) read past the cache through this thread's
    bounce buffer, copied into the destination slice by slice and checksummed there;
    returns how far it got and the crc32c so far."""
    assert file.direct_fd is not None
    bounce, bounce_at = _bounce_buffer()
    crc = 0
    at = start
    while at < stop:
        want = min(len(bounce), stop - at)
        got = _direct(file.direct_fd, bounce[:want], shard.offset + at)
        for lo in range(0, got, _SLICE):
            n = min(_SLICE, got - lo)
            ctypes.memmove(base + at + lo, bounce_at + lo, n)  # releases the GIL
            if checksum:
                dest = (ctypes.c_char * n).from_address(base + at + lo)
                crc = crc32c.crc32c(memoryview(dest).cast("B"), crc)
        at += got
        if got < want:
            break
    return at, crc


def _mostly_cached(fd: int, offset: int, length: int) -> bool:
    """Whether at least half the pages of ``[offset, offset + length)`` of the file are in
    the page cache (``mincore`` over a mapping of the range, which reads nothing). False
    where it cannot be told."""
    if _mincore is None or length <= 0:
        return False
    page = mmap.PAGESIZE
    lo = offset // page * page
    size = offset + length - lo
    pages = (size + page - 1) // page
    at = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
    if at is None or at == _MAP_FAILED:
        return False
    try:
        vec = (ctypes.c_ubyte * pages)()
        if _mincore(ctypes.c_void_p(at), size, vec) != 0:
            return False
        return 2 * (pages - bytes(vec).count(0)) >= pages
    finally:
        _munmap(ctypes.c_void_p(at), size)


def _libc_calls() -> tuple[Any, Any, Any] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, mincore, munmap = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):
        return None
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return mmap_, mincore, munmap


_MAP_FAILED = ctypes.c_void_p(-1).value
_calls = _libc_calls()
_mmap: Any
_mincore: Any
_munmap: Any
_mmap, _mincore, _munmap = _calls if _calls is not None else (None, None, None)
