"""FileTier: durable local storage (NVMe, or any POSIX file system).

Layout under ``root``::

    step-000000000100/
        rank-00000.data     the snapshot's byte stream (shards at their stream offsets)
        manifest.json       the commit: present <=> the step is committed
        rank-00001.data     with several ranks: each rank's stream,
        rank-00001.json     each rank's manifest (durable before the commit), and
                            manifest.json is then a small commit record naming world_size

A shard is written with ``os.pwrite`` in multi-MiB pieces from a bounded thread pool and
made durable with ``fdatasync`` before it counts as ON_LOCAL. The commit writes the
manifest to a temporary name, fsyncs it, renames it into place and fsyncs the directory
(and the root, for the step directory's own entry). Deleting removes the manifest first.
A step directory without a manifest is what a crash left behind; ``open()`` removes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import logging
import mmap
import os
import re
import shutil
import threading
from pathlib import Path

from lazyckpt import (
    ConfigurationError,
    CorruptionError,
    Manifest,
    ShardMeta,
    SnapshotNotFoundError,
    Tier,
    TierBrokenError,
    TierClosedError,
    TierLevel,
    hooks,
    translate_os_error,
)

from ._fs import fsync_dir, remove_tree

__all__ = ["FileTier"]

log = logging.getLogger("lazyckpt")

# what a shared file system may answer while another rank removes the same directory
_RACING_REMOVAL = {errno.ENOTEMPTY, errno.ESTALE, errno.EBUSY}

_STEP_DIR = re.compile(r"^step-(\d{12})$")
MANIFEST = "manifest.json"
ALIGN = 4096


class FileTier(Tier):
    """Durable snapshots in a local directory.

    Args:
        root: the directory (created if missing).
        name: the tier's name (default ``"file"``).
        io_threads: threads writing and reading (bounded pool).
        piece_bytes: size of each ``pwrite``/``pread`` call.
        direct: write data files with ``O_DIRECT``, bypassing the page cache (buffers from
            the host arena are page-aligned; unaligned tails go through a bounce buffer).
            ``None`` (the default) uses it where the file system accepts it and falls back
            to buffered writes where it does not; ``True`` requires it; ``False`` never.
            Measured here, O_DIRECT cost about a fifth of the CPU time of buffered writes
            per GiB, which is what a training process shares its cores with.
        keep_last, keep_every: retention (see :class:`lazyckpt.Retention`).
    """

    level = TierLevel.LOCAL
    default_name = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str | None = None,
        io_threads: int = 2,
        piece_bytes: int = 8 << 20,
        direct: bool | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
    ) -> None:
        super().__init__(name=name, keep_last=keep_last, keep_every=keep_every)
        if not isinstance(root, str | os.PathLike) or not str(root):
            raise ConfigurationError(f"FileTier root must be a path, got {root!r}")
        if io_threads < 1:
            raise ConfigurationError(f"io_threads must be at least 1, got {io_threads}")
        if piece_bytes < ALIGN or piece_bytes % ALIGN:
            raise ConfigurationError(f"piece_bytes must be a positive multiple of {ALIGN}")
        if direct and not hasattr(os, "O_DIRECT"):
            raise ConfigurationError("direct=True needs O_DIRECT, which this OS lacks")
        self.root = Path(root)
        self.direct = direct
        self.piece_bytes = piece_bytes
        self._io_threads = io_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._writing: dict[int, tuple[int, bool]] = {}  # step -> (fd, opened O_DIRECT)
        self._closed = False

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "root": str(self.root), "direct": self.direct}

    def _dir(self, step: int) -> Path:
        return self.root / f"step-{step:012d}"

    def _data_path(self, manifest: Manifest) -> Path:
        return self._dir(manifest.step) / f"rank-{manifest.rank:05d}.data"

    async def _run(self, what: str, fn: object, *args: object) -> object:
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._io_threads, thread_name_prefix=f"lazyckpt-{self.name}"
            )
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)  # type: ignore[arg-type]
        except OSError as exc:
            raise translate_os_error(exc, self.name, what) from exc

    # -- life cycle --------------------------------------------------------------------------

    async def open(self) -> None:
        await self._run("open", self._open_sync)

    def _open_sync(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if _STEP_DIR.match(entry.name) and not (entry / MANIFEST).exists():
                shutil.rmtree(entry, ignore_errors=True)  # a crash left it uncommitted
            elif entry.name.endswith(".tmp"):
                entry.unlink(missing_ok=True)
        for committed in self.root.glob("step-*/*.tmp"):
            committed.unlink(missing_ok=True)

    async def aclose(self) -> None:
        if self._closed:
            return
        for fd, _ in self._writing.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._writing.clear()
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- writing -----------------------------------------------------------------------------

    async def begin(self, manifest: Manifest) -> None:
        opened = await self._run("begin", self._begin_sync, manifest)
        assert isinstance(opened, tuple)
        self._writing[manifest.step] = opened

    def _begin_sync(self, manifest: Manifest) -> tuple[int, bool]:
        d = self._dir(manifest.step)
        if (d / MANIFEST).exists():
            raise FileExistsError(errno.EEXIST, f"step {manifest.step} is already committed")
        d.mkdir(parents=True, exist_ok=True)
        path = self._data_path(manifest)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = self.direct is not False and hasattr(os, "O_DIRECT")
        fd = -1
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
                _probe_direct(fd)
            except OSError as exc:
                if fd >= 0:
                    os.close(fd)
                if self.direct or exc.errno != errno.EINVAL:
                    raise
                fd, direct = -1, False  # this file system refuses O_DIRECT: write buffered
        if fd < 0:
            fd = os.open(path, flags, 0o644)
        if manifest.stream_bytes:
            with contextlib.suppress(OSError):  # a hint only; not every file system has it
                os.posix_fallocate(fd, 0, manifest.stream_bytes)
        return fd, direct

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        opened = self._writing.get(manifest.step)
        if opened is None:
            raise TierBrokenError(f"put_shard before begin for step {manifest.step}", tier=self.name)
        fd, direct = opened
        if len(data) != shard.length:
            raise ConfigurationError(f"shard {shard.index}: {len(data)} bytes, not {shard.length}")
        pieces = range(0, shard.length, self.piece_bytes)
        await asyncio.gather(
            *(
                self._run(
                    f"write shard {shard.index}",
                    self._pwrite,
                    fd,
                    direct,
                    data[o : o + self.piece_bytes],
                    shard.offset + o,
                )
                for o in pieces
            )
        )
        hooks.point("file.write.before_sync")
        await self._run(f"sync shard {shard.index}", os.fdatasync, fd)

    def _pwrite(self, fd: int, direct: bool, data: memoryview, offset: int) -> None:
        if direct:
            self._pwrite_direct(fd, data, offset)
            return
        while data:
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n

    def _pwrite_direct(self, fd: int, data: memoryview, offset: int) -> None:
        # O_DIRECT wants the address, length and offset aligned. Arena blocks are; whatever
        # is not (a tail, a foreign buffer) goes through an aligned bounce buffer.
        head = len(data) // ALIGN * ALIGN
        aligned = _address(data) % ALIGN == 0
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

    async def commit(self, manifest: Manifest) -> None:
        opened = self._writing.pop(manifest.step, None)
        await self._run("commit", self._commit_sync, manifest, opened)

    async def commit_global(self, step: int, world_size: int) -> None:
        """Write the commit record of a step written by ``world_size`` ranks (idempotent)."""
        record = json.dumps(
            {"format": "lazyckpt-commit", "step": step, "world_size": world_size}
        ).encode()
        await self._run("commit", self._publish, self._dir(step), MANIFEST, record)

    def _publish(self, d: Path, name: str, payload: bytes) -> None:
        """Write ``payload`` to ``d/name`` atomically and durably (unique temp, fsync,
        rename, fsync of the directory and the root)."""
        tmp = d / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(wfd, view) :]
            os.fsync(wfd)
        finally:
            os.close(wfd)
        if name == MANIFEST:
            hooks.point("file.commit.before_rename")
        os.replace(tmp, d / name)
        if name == MANIFEST:
            hooks.point("file.commit.after_rename")
        fsync_dir(d)
        fsync_dir(self.root)

    def _commit_sync(self, manifest: Manifest, opened: tuple[int, bool] | None) -> None:
        d = self._dir(manifest.step)
        if opened is not None:
            fd, direct = opened
            try:
                if direct:  # the last shard's tail was padded to the alignment
                    os.ftruncate(fd, manifest.stream_bytes)
                os.fdatasync(fd)
            finally:
                os.close(fd)
        else:
            d.mkdir(parents=True, exist_ok=True)  # a snapshot without tensor data
        hooks.point("file.commit.before_manifest")
        if manifest.world_size > 1:  # this rank's part only; the commit record comes later
            self._publish(d, f"rank-{manifest.rank:05d}.json", manifest.to_json())
        else:
            self._publish(d, MANIFEST, manifest.to_json())

    async def abort(self, step: int) -> None:
        opened = self._writing.pop(step, None)
        if opened is not None:
            with contextlib.suppress(OSError):
                os.close(opened[0])
        await self._run("abort", self._abort_sync, step)

    def _abort_sync(self, step: int) -> None:
        d = self._dir(step)
        if (d / MANIFEST).exists():
            return
        if self.world_size == 1:
            shutil.rmtree(d, ignore_errors=True)
            return
        for suffix in (".data", ".json"):  # only this rank's part; others may still write
            (d / f"rank-{self.rank:05d}{suffix}").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            d.rmdir()

    # -- reading -----------------------------------------------------------------------------

    async def steps(self) -> list[int]:
        result = await self._run("list", self._steps_sync)
        assert isinstance(result, list)
        return result

    def _steps_sync(self) -> list[int]:
        if not self.root.exists():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and (entry / MANIFEST).exists():
                found.append(int(m.group(1)))
        return sorted(found)

    async def read_manifest(self, step: int) -> Manifest:
        return await self.read_rank_manifest(step, self.rank)

    async def read_rank_manifest(self, step: int, rank: int) -> Manifest:
        """Rank ``rank``'s manifest of a committed step (every rank's part lies in the same
        directory); a step written by a single process has one manifest, for any rank."""
        path = self._dir(step) / MANIFEST
        try:
            data = await self._run("read manifest", path.read_bytes)
        except TierBrokenError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                raise SnapshotNotFoundError(f"step {step} is not committed on {self.name!r}") from None
            raise
        assert isinstance(data, bytes)
        if b'"lazyckpt-commit"' in data[:64]:  # several ranks: read this rank's manifest
            path = self._dir(step) / f"rank-{rank:05d}.json"
            try:
                data = await self._run("read manifest", path.read_bytes)
            except TierBrokenError as exc:
                raise CorruptionError(f"{path} is missing from committed step {step}") from exc
            assert isinstance(data, bytes)
        manifest = Manifest.from_json(data, source=f"{self.name}:{path}")
        if manifest.step != step:
            raise CorruptionError(f"{path} holds step {manifest.step}, not {step}")
        if manifest.world_size > 1 and manifest.rank != rank:
            raise CorruptionError(f"{path} holds rank {manifest.rank}'s manifest, not {rank}'s")
        return manifest

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        await self._run(f"read shard {shard.index}", self._read_sync, manifest, shard, out)

    def _read_sync(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        path = self._data_path(manifest)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CorruptionError(f"{path} is missing") from None
        try:
            done = 0
            while done < shard.length:
                n = os.preadv(fd, [out[done : done + self.piece_bytes]], shard.offset + done)
                if n == 0:
                    raise CorruptionError(
                        f"{path} is truncated: shard {shard.index} ends past the file"
                    )
                done += n
        finally:
            os.close(fd)

    async def delete(self, step: int) -> None:
        await self._run("delete", self._delete_sync, step)

    def _delete_sync(self, step: int) -> None:
        d = self._dir(step)
        with contextlib.suppress(FileNotFoundError):
            (d / MANIFEST).unlink()
            fsync_dir(d)
            hooks.point("file.delete.after_unlink")
        # uncommitted now; a file that vanished meanwhile is gone either way, but any other
        # failure is reported (retention surfaces it) rather than hidden. With several ranks
        # on a shared file system they all remove the same directory at once, and NFS or
        # Lustre may then answer ENOTEMPTY, ESTALE or EBUSY: one rank must not fail a step
        # the others take, so there it is a warning, and the next open() sweeps what is left.
        try:
            remove_tree(d)
        except OSError as exc:
            if self.world_size == 1 or exc.errno not in _RACING_REMOVAL:
                raise
            log.warning("step %d: removing %s left files behind (%s)", step, d, exc)


def _probe_direct(fd: int) -> None:
    """Some file systems accept O_DIRECT at open and refuse it at the first write: find out
    now, with one aligned block at the start of the file (a shard overwrites it later)."""
    with mmap.mmap(-1, ALIGN) as block:
        view = memoryview(block)
        try:
            os.pwrite(fd, view, 0)
        finally:
            view.release()


def _address(view: memoryview) -> int:
    import ctypes

    if view.readonly:
        return -1
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
