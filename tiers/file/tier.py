"""FileTier: durable local storage (NVMe, or any POSIX file system).

Layout under ``root``::

    step-000000000100/
        rank-00000.data     the snapshot's byte stream (shards at their stream offsets)
        manifest.json       the commit: present <=> the step is committed
        rank-00001.data     with several ranks: each rank's stream,
        rank-00001.json     each rank's manifest (durable before the commit), and
                            manifest.json is then a small commit record naming world_size

A shard is written with one ``os.pwrite`` and made durable with ``fdatasync`` before it
counts as ON_LOCAL, both in one job on a bounded thread pool; the shards the engine
captured together come in one ``put_shards`` (:class:`~lazyckpt.tier.SupportsBatchPut`):
adjacent ones with one ``os.pwritev``, then one ``fdatasync`` for the lot, in one job. The commit writes the
manifest to a temporary name, fsyncs it, renames it into place and fsyncs the directory
(and the root, for the step directory's own entry). Deleting removes the manifest first.

The root also holds ``lazyckpt-file.json`` (what kind of location this is, and its format)
and one lock file per writing rank (``.lazyckpt-writer-rank-NNNNN.lock``, an ``flock`` held
while the writer lives: a second writer is refused, readers never take it).

Incremental snapshots (:class:`~lazyckpt.tier.SupportsReferences`): a shard whose manifest
entry names ``stored_in`` is read from that step's data file of the same rank, at the same
offset (the step's own data file has a hole there). Deleting a step removes its manifest;
its data files stay while a committed step refers to them (the directory is then *retired*:
data files and a ``retired`` mark, no manifest), and :meth:`FileTier.collect` removes retired directories once no
committed step refers to them. The data file of an incremental step is written sparse (no
``posix_fallocate``), so that only the shards it wrote take space.

A step directory without a manifest that no committed step refers to is what a crash left
behind; ``open()`` removes it, but
only under a root it can prove is a file tier's (the marker, or for a directory written
before the marker existed, nothing but this layout) and only when the step directory holds
nothing but the files above. Anything else (a Zarr tier's directory, files lazyckpt did not
write) is refused with :class:`~lazyckpt.ForeignLocationError` and left untouched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from lazyckpt import hooks
from lazyckpt.tier import (
    ConfigurationError,
    CorruptionError,
    LazyCkptError,
    Manifest,
    Retention,
    ShardMeta,
    SnapshotNotFoundError,
    Tier,
    TierBrokenError,
    TierClosedError,
    TierLevel,
    backend_errors,
)

from .._fs import WriterLock, fsync_dir, lock_name, read_small, remove_flat
from .io import ALIGN, address, probe_direct, pwrite, pwrite_many
from .location import MANIFEST, MARKER, RETIRED, STEP_DIR, marker_document, survey
from .read import combine, read_piece

__all__ = ["FileTier"]

log = logging.getLogger("lazyckpt")

# what a shared file system may answer while another rank removes the same directory
_RACING_REMOVAL = {errno.ENOTEMPTY, errno.ESTALE, errno.EBUSY}



class FileTier(Tier):
    """Durable snapshots in a local directory.

    Args:
        root: the directory (created if missing, unless ``readonly``).
        name: the tier's name (default ``"file"``).
        io_threads: threads writing (bounded pool); also the tier's other file operations.
        read_threads: threads reading shards for a restore, in a pool of their own started
            at the first read: the pieces of a shard are read side by side, since a
            virtual disk or an NVMe drive serves several requests in flight faster than one
            (measured: about 2x a sequential read on a 2-vCPU VM).
        piece_bytes: size of each ``pread`` call of a restore (a shard's pieces are read
            side by side). A shard is written with one ``pwrite`` and synced in the same
            pool job.
        direct: write data files with ``O_DIRECT``, bypassing the page cache (buffers from
            the host arena are page-aligned; unaligned tails go through a bounce buffer).
            ``None`` (the default) uses it where the file system accepts it and falls back
            to buffered writes where it does not; ``True`` requires it; ``False`` never.
            Measured here, O_DIRECT cost about a fifth of the CPU time of buffered writes
            per GiB, which is what a training process shares its cores with.
        keep_last, keep_every: retention (see :class:`lazyckpt.Retention`).
        retention: the whole retention policy as one :class:`lazyckpt.Retention` (which
            also holds ``keep_best`` and ``keep_within``), instead of ``keep_last`` and
            ``keep_every``.
        read_direct: read shards whose bytes are not in the page cache with ``O_DIRECT``
            (where the file system accepts it): the disk writes into the destination, the
            kernel neither fills nor copies cache pages. Measured on a 2-vCPU VM, a cold
            read cost about a sixth of the CPU time of a buffered one, and was faster.
            Cached bytes (a restore just after a buffered write) are read through the
            cache either way. ``False`` always reads through the page cache.
        readonly: only read (a restore, an inspection): ``open()`` then creates, deletes and
            locks nothing, a missing root is :class:`~lazyckpt.SnapshotNotFoundError`, and
            writing is refused. A reader works beside a running writer.
    """

    # the locations the command line opens with this tier: local paths (and file:// URLs)
    url_schemes = ("file",)
    level = TierLevel.LOCAL
    default_name = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str | None = None,
        io_threads: int = 2,
        read_threads: int = 4,
        piece_bytes: int = 8 << 20,
        direct: bool | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        readonly: bool = False,
        read_direct: bool = True,
        retention: Retention | None = None,
    ) -> None:
        super().__init__(
            name=name, keep_last=keep_last, keep_every=keep_every, retention=retention
        )
        self.readonly = readonly
        if not isinstance(root, str | os.PathLike) or not str(root):
            raise ConfigurationError(f"FileTier root must be a path, got {root!r}")
        if io_threads < 1:
            raise ConfigurationError(f"io_threads must be at least 1, got {io_threads}")
        if read_threads < 1:
            raise ConfigurationError(f"read_threads must be at least 1, got {read_threads}")
        if piece_bytes < ALIGN or piece_bytes % ALIGN:
            raise ConfigurationError(f"piece_bytes must be a positive multiple of {ALIGN}")
        if direct and not hasattr(os, "O_DIRECT"):
            raise ConfigurationError("direct=True needs O_DIRECT, which this OS lacks")
        self.root = Path(root)
        self.direct = direct
        self.piece_bytes = piece_bytes
        self.read_direct = read_direct
        # a restore allocates the tensors it creates at this alignment, so that a direct
        # read lands in them without a bounce copy (SupportsChecksummedRead)
        self.read_alignment = ALIGN if read_direct else 1
        self._io_threads = io_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._read_threads = read_threads
        self._read_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._writing: dict[int, tuple[int, bool]] = {}  # step -> (fd, opened O_DIRECT)
        # committed step -> the steps its manifests (every rank's) refer to, or None when
        # they could not be read (then anything may be referred to): see _referenced
        self._refers: dict[int, frozenset[int] | None] = {}
        # retirements made by this writer, and how many there had been when a collect pass
        # last left no retired directory behind: while they are equal there is nothing to
        # collect, and collect() answers without a job (see collect)
        self._retirements = 0
        # the committed steps, as this writer knows them (see steps()): None until a listing
        # or after anything that may have left the disk unlike it (a failed commit or
        # delete); _changes counts the commits and deletes begun, so that a listing that
        # ran beside one is not taken for the answer
        # (a frozenset, replaced on each change: pool threads read it while the loop changes it)
        self._committed: frozenset[int] | None = None
        self._changes = 0
        self._collected_at: int | None = None
        self._lock: WriterLock | None = None
        # the root, held open from the first commit on: every commit fsyncs it (for the
        # step directory's entry), one call instead of three (open, fsync, close), each of
        # which is a take of the interpreter lock by the pool thread
        self._root_fd: int | None = None
        self._root_fd_lock = threading.Lock()
        self._closed = False

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "root": str(self.root), "direct": self.direct}

    def _dir(self, step: int) -> Path:
        return self.root / f"step-{step:012d}"

    def _data_path(self, manifest: Manifest) -> Path:
        return self._dir(manifest.step) / f"rank-{manifest.rank:05d}.data"

    def _writable(self, what: str) -> None:
        if self.readonly:
            raise ConfigurationError(
                f"tier {self.name!r} ({self.root}) was opened read-only: cannot {what}; "
                "build it without readonly=True to write"
            )

    async def _run(self, what: str, fn: object, *args: object) -> object:
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._io_threads, thread_name_prefix=f"lazyckpt-{self.name}"
            )
        loop = asyncio.get_running_loop()
        with backend_errors(self.name, what):
            return await loop.run_in_executor(self._pool, fn, *args)  # type: ignore[arg-type]

    async def _read_small(
        self, what: str, path: Path, missing: Callable[[], LazyCkptError]
    ) -> bytes:
        """A manifest, read with aiofiles (see :func:`read_small`): never behind the bulk
        writes queued on this tier's pool. A missing file is ``missing()``, decided here,
        before any other error is mapped."""
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        with backend_errors(self.name, what):
            try:
                return await read_small(path)
            except FileNotFoundError:
                raise missing() from None

    # -- life cycle --------------------------------------------------------------------------

    async def open(self) -> None:
        """Check that the root is a file tier's; for writing, also create it, take the
        writer's lock and remove what a crash left uncommitted (see the module docstring)."""
        await self._run(f"open {self.root}", self._open_sync)

    def _open_sync(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ConfigurationError(
                f"FileTier root {self.root} is a file, not a directory; give a directory path"
            )
        if self.readonly:
            if not self.root.is_dir():
                raise SnapshotNotFoundError(f"{self.root}: no such directory (tier {self.name!r})")
            survey(self.root, writing=False)  # refuses another store's location; changes nothing
            return
        if self.root.is_dir():
            # a foreign location is refused before anything (even a lock) is written there,
            # by every rank; the others only look for another store's signs, as a reader
            # does, since rank 0 may be sweeping leftovers meanwhile
            survey(self.root, writing=self.world_size == 1 or self.rank == 0)
        self.root.mkdir(parents=True, exist_ok=True)
        lock = WriterLock(self.root / lock_name(self.rank), str(self.root))
        lock.acquire()
        if self.world_size > 1 and self.rank != 0:
            # rank 0 checks and cleans the shared root (every rank waits for it before
            # writing); a second survey here would race with its removals
            self._lock = lock
            return
        try:
            marked, leftovers, temps = survey(self.root)
            if not marked:
                self._publish(self.root, MARKER, marker_document(), sync_root=False)
            if leftovers:
                # a retired step (data that committed incremental steps refer to) is not a
                # leftover; when a manifest cannot be read, nothing is taken for one
                referenced = self._referenced_sync()
                leftovers = [
                    e for e in leftovers
                    if referenced is not None and _step_of(e) not in referenced
                ]
            for entry in leftovers:
                shutil.rmtree(entry, ignore_errors=True)  # a crash left it uncommitted
            for temp in temps:
                temp.unlink(missing_ok=True)
        except BaseException:
            lock.release()
            raise
        self._lock = lock

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
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=True)
        if self._root_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._root_fd)
            self._root_fd = None
        if self._lock is not None:
            self._lock.release()  # after the last write: the next writer may start now
            self._lock = None

    # -- writing -----------------------------------------------------------------------------

    async def begin(self, manifest: Manifest) -> None:
        self._writable("write a snapshot")
        opened = await self._run(f"begin step {manifest.step}", self._begin_sync, manifest)
        assert isinstance(opened, tuple)
        self._writing[manifest.step] = opened

    def _begin_sync(self, manifest: Manifest) -> tuple[int, bool]:
        d = self._dir(manifest.step)
        if (d / MANIFEST).exists():
            raise FileExistsError(
                errno.EEXIST, f"step {manifest.step} is already committed", str(d / MANIFEST)
            )
        if d.exists():
            referenced = self._referenced_sync()
            if referenced is None or manifest.step in referenced:
                # truncating it would change the bytes committed incremental steps read
                raise FileExistsError(
                    errno.EEXIST,
                    f"step {manifest.step} was deleted but committed incremental steps still "
                    "read shards from its data; snapshot under another step number, or "
                    "delete the steps that refer to it",
                    str(d),
                )
            # no committed step refers to it any more: the mark of a retired step goes (the
            # data file is truncated below)
            with contextlib.suppress(FileNotFoundError):
                (d / RETIRED).unlink()
        d.mkdir(parents=True, exist_ok=True)
        path = self._data_path(manifest)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = self.direct is not False and hasattr(os, "O_DIRECT")
        fd = -1
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
                probe_direct(fd)
            except OSError as exc:
                if fd >= 0:
                    os.close(fd)
                if self.direct or exc.errno != errno.EINVAL:
                    raise
                fd, direct = -1, False  # this file system refuses O_DIRECT: write buffered
        if fd < 0:
            fd = os.open(path, flags, 0o644)
        if manifest.stream_bytes and not manifest.extra.get("incremental"):
            # a hint only (not every file system has it); an incremental step's file stays
            # sparse, since the shards it refers to elsewhere are never written to it
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, manifest.stream_bytes)
        return fd, direct

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        opened = self._writing.get(manifest.step)
        if opened is None:
            raise TierBrokenError(
                f"put_shard before begin for step {manifest.step}", tier=self.name
            )
        fd, direct = opened
        if len(data) != shard.length:
            raise ConfigurationError(f"shard {shard.index}: {len(data)} bytes, not {shard.length}")
        path = self._data_path(manifest)
        # one job per shard, not one per piece and one more for the sync: each job costs
        # the pool thread and the engine loop a wake-up and a take of the interpreter lock,
        # which a launch-bound training thread pays for (docs/design.md, "Staying out of
        # the training thread's way"); the write and the sync release the lock
        await self._run(
            f"write shard {shard.index} to {path}",
            self._write_shard,
            fd,
            direct,
            data,
            shard.offset,
        )

    async def put_shards(
        self, manifest: Manifest, shards: Sequence[ShardMeta], data: Sequence[memoryview]
    ) -> None:
        """Write several shards in one job: adjacent ones with one ``pwritev``, then one
        ``fdatasync`` for them all (:class:`~lazyckpt.tier.SupportsBatchPut`). Every shard
        is durable when it returns, as after :meth:`put_shard`; one job and one wake-up of
        the engine's loop for a capture batch instead of one per shard."""
        opened = self._writing.get(manifest.step)
        if opened is None:
            raise TierBrokenError(
                f"put_shards before begin for step {manifest.step}", tier=self.name
            )
        fd, direct = opened
        if len(shards) != len(data):
            raise ConfigurationError(f"{len(shards)} shards but {len(data)} buffers")
        for shard, view in zip(shards, data, strict=True):
            if len(view) != shard.length:
                raise ConfigurationError(
                    f"shard {shard.index}: {len(view)} bytes, not {shard.length}"
                )
        path = self._data_path(manifest)
        await self._run(
            f"write shards {', '.join(str(s.index) for s in shards)} to {path}",
            self._write_shards,
            fd,
            direct,
            list(data),
            [s.offset for s in shards],
        )

    def _write_shards(
        self, fd: int, direct: bool, data: list[memoryview], offsets: list[int]
    ) -> None:
        """Write the shards, then make them durable with one sync. Blocking."""
        pwrite_many(fd, direct, data, offsets)
        for _ in data:  # the crash point of each shard: written, not yet synced
            hooks.point("file.write.before_sync")
        os.fdatasync(fd)

    def _write_shard(self, fd: int, direct: bool, data: memoryview, offset: int) -> None:
        """Write a shard with one ``pwrite`` (more where the kernel writes less), then make
        it durable. Blocking."""
        pwrite(fd, direct, data, offset)
        hooks.point("file.write.before_sync")
        os.fdatasync(fd)

    async def commit(self, manifest: Manifest) -> None:
        self._writable("commit a snapshot")
        opened = self._writing.pop(manifest.step, None)
        self._changes += 1
        try:
            await self._run(
                f"commit step {manifest.step} in {self._dir(manifest.step)}",
                self._commit_sync,
                manifest,
                opened,
            )
        except BaseException:
            self._committed = None  # the manifest may have landed: list again
            raise
        if self._committed is not None and manifest.world_size == 1:
            self._committed = self._committed | {manifest.step}

    async def commit_global(self, step: int, world_size: int) -> None:
        """Write the commit record of a step written by ``world_size`` ranks (idempotent)."""
        record = json.dumps(
            {"format": "lazyckpt-commit", "step": step, "world_size": world_size}
        ).encode()
        self._writable("commit a snapshot")
        self._changes += 1
        self._committed = None  # several ranks: steps() lists every time
        await self._run(
            f"commit step {step} in {self._dir(step)}",
            self._publish,
            self._dir(step),
            MANIFEST,
            record,
        )

    def _publish(self, d: Path, name: str, payload: bytes, *, sync_root: bool = True) -> None:
        """Write ``payload`` to ``d/name`` atomically and durably (unique temp, fsync,
        rename, fsync of the directory and, with ``sync_root``, the root)."""
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
        if sync_root:
            os.fsync(self._root_dir_fd())

    def _root_dir_fd(self) -> int:
        """The root's descriptor for ``fsync`` (opened once, closed by :meth:`aclose`)."""
        with self._root_fd_lock:
            if self._root_fd is None:
                self._root_fd = os.open(
                    self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
                )
            return self._root_fd

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
            self._refers[manifest.step] = manifest.references()

    async def abort(self, step: int) -> None:
        opened = self._writing.pop(step, None)
        if opened is not None:
            with contextlib.suppress(OSError):
                os.close(opened[0])
        if self.readonly:
            return  # a read-only tier wrote nothing to abort
        await self._run(f"abort step {step} in {self._dir(step)}", self._abort_sync, step)

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
        """The step directories holding a manifest.

        A writer of a single process answers from what it knows, without a job: the
        directory listed once (at the first call), then its own commits and deletes, which
        are the only ones there can be (another writer is refused by the lock, a reader
        changes nothing). Retention lists after every commit, and a job costs a pool
        thread's takes of the interpreter lock and a wake-up of the loop, which a
        launch-bound training thread pays for (docs/design.md, "Staying out of the training
        thread's way"). A commit or delete that failed, or several ranks sharing the root,
        make it list again. The listing and each directory's look for a manifest run in one
        job on the event loop's executor (off this tier's pool, so it never waits behind
        the writes queued there)."""
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        known = self._known()
        if known is not None:
            return sorted(known)
        before = self._changes
        loop = asyncio.get_running_loop()
        with backend_errors(self.name, f"list {self.root}"):
            listed = await loop.run_in_executor(None, self._committed_sync)
        if self._changes == before and self._lock is not None and not self.readonly:
            self._committed = frozenset(listed)  # no commit or delete ran beside the listing
        return listed

    def _known(self) -> frozenset[int] | None:
        """The committed steps this writer knows of, where only it changes them."""
        if self.readonly or self._lock is None or self.world_size != 1:
            return None
        return self._committed

    async def read_manifest(self, step: int) -> Manifest:
        return await self.read_rank_manifest(step, self.rank)

    async def read_rank_manifest(self, step: int, rank: int) -> Manifest:
        """Rank ``rank``'s manifest of a committed step (every rank's part lies in the same
        directory); a step written by a single process has one manifest, for any rank."""
        path = self._dir(step) / MANIFEST
        data = await self._read_small(
            f"read manifest {path}",
            path,
            lambda: SnapshotNotFoundError(f"step {step} is not committed on {self.name!r}"),
        )
        if b'"lazyckpt-commit"' in data[:64]:  # several ranks: read this rank's manifest
            part = self._dir(step) / f"rank-{rank:05d}.json"
            data = await self._read_small(
                f"read manifest {part}",
                part,
                lambda: CorruptionError(f"{part} is missing from committed step {step}"),
            )
            path = part
        manifest = Manifest.from_json(data, source=f"{self.name}:{path}")
        if manifest.step != step:
            raise CorruptionError(f"{path} holds step {manifest.step}, not {step}")
        if manifest.world_size > 1 and manifest.rank != rank:
            raise CorruptionError(f"{path} holds rank {manifest.rank}'s manifest, not {rank}'s")
        return manifest

    def _reader(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        if self._read_pool is None:
            self._read_pool = concurrent.futures.ThreadPoolExecutor(
                self._read_threads, thread_name_prefix=f"lazyckpt-{self.name}-read"
            )
        return self._read_pool

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        await self._read(manifest, shard, out, checksum=False)

    async def read_shard_checksummed(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview
    ) -> int:
        """Read as :meth:`read_shard` does; each piece's crc32c is computed by the thread
        that read it, as it lands in ``out`` (see ``file.read``), and the shard's returned."""
        return await self._read(manifest, shard, out, checksum=True)

    async def _read(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview, *, checksum: bool
    ) -> int:
        path = self._data_path(manifest)
        if shard.stored_in is not None:  # an incremental step: the bytes of an earlier one
            path = self._dir(shard.stored_in) / path.name
        what = f"read shard {shard.index} from {path}"
        pool = self._reader()
        loop = asyncio.get_running_loop()
        with backend_errors(self.name, what):
            base = address(out) if shard.length else 0
            starts = range(0, shard.length, self.piece_bytes)
            futures = [
                loop.run_in_executor(
                    pool, read_piece, path, shard, out, base, s, self.piece_bytes, checksum,
                    self.read_direct,
                )
                for s in starts
            ]
            results = await asyncio.gather(*futures, return_exceptions=True)
            crcs: list[int] = []
            for result in results:  # every piece is done: the first failure is the answer
                if isinstance(result, BaseException):
                    raise result
                crcs.append(result)
        return combine(crcs, starts, shard.length) if checksum else 0

    async def delete(self, step: int) -> None:
        self._writable("delete a snapshot")
        self._changes += 1
        try:
            await self._run(f"delete step {step} in {self._dir(step)}", self._delete_sync, step)
        except BaseException:
            self._committed = None  # the manifest may be gone or not: list again
            raise
        if self._committed is not None:
            self._committed = self._committed - {step}

    def _delete_sync(self, step: int) -> None:
        d = self._dir(step)
        referenced = self._referenced_sync() if d.exists() else set()
        retired = referenced is None or step in referenced
        if retired:
            # committed incremental steps read shards from its data files: it stays, marked
            # (before the un-commit, so that a crash cannot leave it unmarked), and collect()
            # removes it once no committed step refers to it (counted before the mark is
            # written, so that a collect pass running meanwhile cannot miss it)
            self._retirements += 1
            with contextlib.suppress(FileNotFoundError):
                os.close(os.open(d / RETIRED, os.O_WRONLY | os.O_CREAT, 0o644))
            hooks.point("file.delete.retired")
        with contextlib.suppress(FileNotFoundError):
            (d / MANIFEST).unlink()
            fsync_dir(d)
            hooks.point("file.delete.after_unlink")
        self._refers.pop(step, None)
        if retired:
            return
        # uncommitted now; a file that vanished meanwhile is gone either way, but any other
        # failure is reported (retention surfaces it) rather than hidden. With several ranks
        # on a shared file system they all remove the same directory at once, and NFS or
        # Lustre may then answer ENOTEMPTY, ESTALE or EBUSY: one rank must not fail a step
        # the others take, so there it is a warning, and the next open() sweeps what is left.
        try:
            remove_flat(d)
        except OSError as exc:
            if self.world_size == 1 or exc.errno not in _RACING_REMOVAL:
                raise
            log.warning("step %d: removing %s left files behind (%s)", step, d, exc)


    # -- incremental snapshots (SupportsReferences) ------------------------------------------

    async def collect(self, keep: Collection[int] = ()) -> list[int]:
        """Remove every retired step directory (no manifest) that no committed step refers
        to and that is not in ``keep``; see the module docstring."""
        self._writable("collect unreferenced data")
        if self.world_size == 1 and self._collected_at == self._retirements:
            # the last pass left nothing retired and this writer retired nothing since; no
            # other process retires here (the writer's lock), so there is nothing to look
            # for: retention calls this after every delete, and a job is a take of the
            # interpreter lock and a wake-up of the loop
            return []
        removed = await self._run(f"collect in {self.root}", self._collect_sync, frozenset(keep))
        assert isinstance(removed, list)
        return removed

    def _collect_sync(self, keep: frozenset[int]) -> list[int]:
        seen = self._retirements
        if not self.root.exists():
            self._collected_at = seen
            return []
        marked = []
        for entry in self.root.iterdir():
            # only what delete() retired: a directory without a manifest may also be a step
            # another rank is writing
            m = STEP_DIR.match(entry.name)
            if m and (entry / RETIRED).exists() and not (entry / MANIFEST).exists():
                marked.append(int(m.group(1)))
        retired = [step for step in marked if step not in keep]
        if not retired:
            if not marked:
                self._collected_at = seen
            return []
        referenced = self._referenced_sync()
        if referenced is None:
            return []
        removed = []
        for step in sorted(retired):
            if step in referenced:
                continue
            d = self._dir(step)
            if (d / MANIFEST).exists():  # committed again meanwhile
                continue
            hooks.point("file.collect.before_remove")
            try:
                remove_flat(d)
            except OSError as exc:
                if self.world_size == 1 or exc.errno not in _RACING_REMOVAL:
                    raise
            removed.append(step)
        if len(removed) == len(marked):
            self._collected_at = seen
        return removed

    def _referenced_sync(self) -> set[int] | None:
        """The steps whose data committed steps refer to (every rank's manifests); None when
        a committed manifest could not be read, so that nothing is removed on a guess. The
        committed steps are those the writer knows (see :meth:`steps`), else listed."""
        committed = self._known()
        found: set[int] = set()
        for step in self._committed_sync() if committed is None else sorted(committed):
            refers = self._refers.get(step)
            if refers is None:
                refers = self._read_references(step)
                if refers is None:
                    return None
                self._refers[step] = refers
            found |= refers
        return found

    def _committed_sync(self) -> list[int]:
        """The committed steps: a listing and one ``stat`` per step directory, blocking (on
        the loop's executor for :meth:`steps`, on the tier's pool for the reference checks
        that need them)."""
        root = str(self.root)
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            return []
        return sorted(
            int(m.group(1))
            for name in names
            if (m := STEP_DIR.match(name)) and os.path.exists(os.path.join(root, name, MANIFEST))
        )

    def _read_references(self, step: int) -> frozenset[int] | None:
        d = self._dir(step)
        try:
            record = (d / MANIFEST).read_bytes()
            paths = [d / MANIFEST]
            if b'"lazyckpt-commit"' in record[:64]:
                paths = sorted(d.glob("rank-*.json"))
            found: set[int] = set()
            for path in paths:
                data = record if path.name == MANIFEST else path.read_bytes()
                if b'"stored_in"' in data:  # only an incremental manifest needs parsing
                    found |= Manifest.from_json(data, source=str(path)).references()
            return frozenset(found)
        except FileNotFoundError:
            return frozenset()  # deleted meanwhile: it refers to nothing any more
        except (OSError, CorruptionError) as exc:
            log.warning(
                "%s: cannot read which steps it refers to (%s); unreferenced data is kept",
                d, exc,
            )
            return None


def _step_of(entry: Path) -> int:
    m = STEP_DIR.match(entry.name)
    assert m is not None
    return int(m.group(1))
