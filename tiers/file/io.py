"""Positional file I/O of FileTier: pieces written with ``pwrite`` (through an aligned bounce
buffer where ``O_DIRECT`` needs one). Reading is ``file.read``."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

__all__ = [
    "ALIGN",
    "address",
    "probe_direct",
    "pwrite",
    "pwrite_many",
]

ALIGN = 4096


def pwrite(fd: int, direct: bool, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``direct``: to a file opened ``O_DIRECT``)."""
    if direct:
        _pwrite_direct(fd, data, offset)
        return
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def pwrite_many(fd: int, direct: bool, data: Sequence[memoryview], offsets: Sequence[int]) -> None:
    """Write each ``data[j]`` at ``offsets[j]``: each run of adjacent buffers with one
    ``pwritev`` (one release of the interpreter lock for the run), a buffer that
    ``O_DIRECT`` cannot take as it is (unaligned address or length) with :func:`pwrite`."""
    j = 0
    while j < len(data):
        run = [data[j]]
        end = offsets[j] + len(data[j])
        while (
            j + len(run) < len(data)
            and offsets[j + len(run)] == end
            and _vectorable(direct, run[-1])
            and _vectorable(direct, data[j + len(run)])
        ):
            end += len(data[j + len(run)])
            run.append(data[j + len(run)])
        if len(run) == 1:
            pwrite(fd, direct, run[0], offsets[j])
        else:
            _pwritev(fd, direct, run, offsets[j])
        j += len(run)


def _vectorable(direct: bool, view: memoryview) -> bool:
    return not direct or (len(view) % ALIGN == 0 and address(view) % ALIGN == 0)


def _pwritev(fd: int, direct: bool, run: list[memoryview], offset: int) -> None:
    """All of ``run`` from ``offset`` on; what a short write leaves, :func:`pwrite` writes
    buffer by buffer."""
    done = os.pwritev(fd, run, offset)
    for view in run:
        if done < len(view):
            pwrite(fd, direct, view[done:], offset + done)
        done = max(0, done - len(view))
        offset += len(view)


def _pwrite_direct(fd: int, data: memoryview, offset: int) -> None:
    # O_DIRECT wants the address, length and offset aligned. Arena blocks are; whatever
    # is not (a tail, a foreign buffer) goes through an aligned bounce buffer.
    head = len(data) // ALIGN * ALIGN
    aligned = address(data) % ALIGN == 0
    if head and aligned:
        done = 0
        while done < head:
            done += os.pwrite(fd, data[done:head], offset + done)
        data, offset = data[head:], offset + head
    if data:
        size = (len(data) + ALIGN - 1) // ALIGN * ALIGN
        with mmap.mmap(-1, size) as bounce:
            bounce[: len(data)] = data
            view = memoryview(bounce)
            try:
                done = 0
                while done < size:
                    done += os.pwrite(fd, view[done:], offset + done)
            finally:
                view.release()


def probe_direct(fd: int) -> None:
    """Some file systems accept O_DIRECT at open and refuse it at the first write: find out
    now, with one aligned block at the start of the file (a shard overwrites it later)."""
    with mmap.mmap(-1, ALIGN) as block:
        view = memoryview(block)
        try:
            os.pwrite(fd, view, 0)
        finally:
            view.release()


def address(view: memoryview) -> int:
    """Where ``view``'s bytes start in memory; -1 for a read-only view (never aligned for
    ``O_DIRECT``: it goes through the bounce buffer)."""
    if view.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
