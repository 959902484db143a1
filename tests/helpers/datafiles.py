"""A FileTier snapshot's data files, handled from outside the library: dropped from the page
cache (a restore then reads them cold), or damaged (a bad copy)."""

from __future__ import annotations

import os
from pathlib import Path


def drop_data_files(root: Path) -> None:
    """Drop every ``*.data`` file under ``root`` from the page cache (synced first, so that
    ``POSIX_FADV_DONTNEED`` can drop every page): the next read goes to the disk."""
    for f in root.rglob("*.data"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def damage_data_file(root: Path, step: int) -> None:
    """Flip one byte in every shard-sized region (512 KiB) of a step's data file, durably:
    every shard of the step then fails its checksum."""
    data = next((root / f"step-{step:012d}").glob("rank-*.data"))
    with open(data, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        for at in range(1000, size, 1 << 19):
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
