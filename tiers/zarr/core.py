"""The plumbing of a ZarrTier: its construction and options, the store it writes through,
the error boundary, bounded requests, the thread pool for copies, and reading the commit
index and the group documents of committed steps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from zarr.abc.store import Store
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.core.buffer.cpu import Buffer as CpuBuffer

from lazyckpt.tier import (
    FORMAT_VERSION,
    ConfigurationError,
    CorruptionError,
    ForeignLocationError,
    LazyCkptError,
    Manifest,
    Retention,
    SnapshotNotFoundError,
    Tier,
    TierClosedError,
    backend_errors,
)

from .._fs import WriterLock, read_small
from .codec import _join, _PackGeometry
from .layout import (
    _STEP_GROUP,
    _documents,
    _geometry_from_document,
    _part_prefix,
    _Plan,
    _step_prefix,
    plan_snapshot,
)
from .s3 import _s3_settings, _s3_store, _S3Settings
from .store import DurableLocalStore

T = TypeVar("T")


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


class ZarrCore(Tier):
    """What every part of :class:`~tiers.ZarrTier` stands on (see its docstring for the
    options): the store, the error boundary, requests, and the commit index read."""

    def __init__(
        self,
        location: str | os.PathLike[str] | Store,
        *,
        name: str | None = None,
        concurrency: int = 32,
        io_threads: int = 4,
        pack_chunk_bytes: int = 64 << 10,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        allow_http: bool | None = None,
        retries: int = 10,
        retry_timeout: float = 60.0,
        connect_timeout: float = 5.0,
        request_timeout: float = 120.0,
        keep_last: int | None = None,
        keep_every: int | None = None,
        readonly: bool = False,
        lease_seconds: float = 300.0,
        skip_signature: bool = False,
        require_conditional_writes: bool = True,
        retention: Retention | None = None,
    ) -> None:
        super().__init__(
            name=name, keep_last=keep_last, keep_every=keep_every, retention=retention
        )
        self.readonly = readonly
        if not lease_seconds > 0:
            raise ConfigurationError(f"lease_seconds must be positive, got {lease_seconds!r}")
        self.lease_seconds = float(lease_seconds)
        self.require_conditional_writes = require_conditional_writes
        self._timeout = request_timeout
        # unfinished multipart uploads the last open() for writing aborted (S3)
        self.uploads_aborted: list[Any] = []
        self._retries = retries
        if sys.byteorder != "little":  # pragma: no cover - no big-endian test machine
            raise ConfigurationError("ZarrTier writes raw little-endian chunks; this host is not")
        if concurrency < 1 or io_threads < 1:
            raise ConfigurationError("concurrency and io_threads must be at least 1")
        if pack_chunk_bytes < 4096 or pack_chunk_bytes % 4096:
            raise ConfigurationError("pack_chunk_bytes must be a positive multiple of 4096")
        if (
            retries < 0
            or not retry_timeout > 0
            or not connect_timeout > 0
            or not request_timeout > 0
        ):
            raise ConfigurationError("retries must be >= 0 and the timeouts positive")
        self.concurrency = concurrency
        self.pack_chunk_bytes = pack_chunk_bytes
        self._io_threads = io_threads
        self._s3: _S3Settings | None = None
        self._local: Path | None = None  # the root directory, for a path location
        s3_options = {
            "endpoint_url": endpoint_url,
            "region": region,
            "access_key_id": access_key_id,
            "secret_access_key": secret_access_key,
            "session_token": session_token,
            "allow_http": allow_http,
            "skip_signature": skip_signature or None,
        }
        if isinstance(location, Store):
            self.location = f"<{type(location).__name__}>"
            self._store: Store = location
        elif isinstance(location, str) and location.startswith("s3://"):
            self._s3 = _s3_settings(location, s3_options)
            self.location = f"s3://{self._s3.bucket}/{self._s3.prefix}".rstrip("/")
            self._store = _s3_store(
                self._s3,
                retries=retries,
                retry_timeout=retry_timeout,
                connect_timeout=connect_timeout,
                request_timeout=request_timeout,
            )
        elif isinstance(location, str | os.PathLike) and str(location):
            path = str(location)
            if path.startswith("file://"):
                path = path[len("file://") :]
            elif "://" in path:
                raise ConfigurationError(
                    f"ZarrTier takes a path or an s3:// URL, got {path.split('://')[0]}://"
                )
            self.location = str(Path(path))
            self._local = Path(path)
            self._store = DurableLocalStore(path, read_only=readonly, io_threads=io_threads)
        else:
            raise ConfigurationError(
                f"ZarrTier takes a path, an s3:// URL or a zarr Store, got {location!r}"
            )
        if self._s3 is None and any(v is not None for v in s3_options.values()):
            raise ConfigurationError("S3 settings were given for a location that is not s3://")
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._plans: dict[tuple[int, int], _Plan] = {}  # (step, rank) ->
        # the group of each committed or retired step whose group is not the plain name (as
        # the index last read says), and of each step this writer is writing
        self._groups: dict[int, str] = {}
        self._writing: dict[int, str] = {}
        self._begun: set[int] = set()
        self._unsynced: dict[int, set[str]] = {}  # step -> directories to sync at commit
        self._geometry: dict[tuple[int, int], _PackGeometry] = {}  # (step, rank) ->
        # incremental snapshots: the manifests of steps that others refer to, by
        # (step, rank), and per committed step the steps its manifests refer to
        self._stored: dict[tuple[int, int], Manifest] = {}
        self._refers: dict[int, frozenset[int]] = {}
        self._shared_checked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests = asyncio.Semaphore(concurrency)
        self._index_lock = asyncio.Lock()
        self._delete_lock = asyncio.Lock()
        self._writer_lock: WriterLock | None = None
        self._lease: tuple[str, str, float] | None = None  # token, ETag, renewed (monotonic)
        self._leased = False  # this writer took a lease: without one now, it lost it
        self._closed = False

    def describe(self) -> dict[str, Any]:
        info = {**super().describe(), "location": self.location, "format": "zarr-v3"}
        if self._s3 is not None and self._s3.public_endpoint is not None:
            info["endpoint"] = self._s3.public_endpoint
        return info

    # -- plumbing --------------------------------------------------------------------------

    def _sync_primitives(self) -> None:
        # asyncio primitives belong to one loop; a tier reused from another loop (tests, a
        # second Checkpointer) gets fresh ones.
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._requests = asyncio.Semaphore(self.concurrency)
            self._index_lock = asyncio.Lock()
            self._delete_lock = asyncio.Lock()

    @contextlib.contextmanager
    def _backend(self, what: str) -> Iterator[None]:
        """Run a tier operation: refuse when closed, map backend errors once (the one
        mapping of every tier, with what only S3 says: a missing bucket)."""
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        self._sync_primitives()
        store = self._store
        if self.readonly and isinstance(store, DurableLocalStore) and not store.read_only:
            # readonly was set after construction (before any use): a store that never
            # creates the directory
            self._store = store.with_read_only(True)
        s3 = self._s3
        with backend_errors(
            self.name,
            what,
            scrub=None if s3 is None else s3.scrub,
            refine=None if s3 is None else self._no_bucket,
        ):
            yield

    def _no_bucket(self, exc: Exception) -> LazyCkptError | None:
        """The error for a bucket that does not exist, if ``exc`` says so (S3 only)."""
        if self._s3 is None or "NoSuchBucket" not in str(exc):
            return None
        where = f" at {self._s3.public_endpoint}" if self._s3.public_endpoint else ""
        if self.readonly:
            return SnapshotNotFoundError(
                f"{self.location}: the bucket {self._s3.bucket!r} does not exist{where}"
            )
        return ConfigurationError(
            f"{self.location}: the bucket {self._s3.bucket!r} does not exist{where}; create it "
            "(lazyckpt never creates buckets) or fix the location"
        )

    def _writable(self, what: str) -> None:
        if self.readonly:
            raise ConfigurationError(
                f"tier {self.name!r} ({self.location}) was opened read-only: cannot {what}; "
                "build it without readonly=True to write"
            )

    async def _request(self, aw: Awaitable[T]) -> T:
        async with self._requests:
            return await aw

    @staticmethod
    async def _all(aws: Iterable[Awaitable[Any]]) -> None:
        # Each awaitable takes its own request slot (see _request): taking one here as well
        # would deadlock once more than `concurrency` of them wait.
        try:
            async with asyncio.TaskGroup() as tg:
                for aw in aws:
                    tg.create_task(_awaited(aw))
        except ExceptionGroup as group:  # the first failure says what went wrong
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from first.__cause__

    async def _cpu(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._io_threads, thread_name_prefix=f"lazyckpt-{self.name}"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _get(self, key: str) -> Buffer | None:
        return await self._request(self._store.get(key, default_buffer_prototype()))

    async def _get_document(self, key: str) -> bytes | None:
        """A small metadata object (the index, a commit record, a group or array document).
        On a path it is read with aiofiles, off the store's bounded pool, so listing steps
        or reading a manifest never waits behind the chunk writes queued there; writes stay
        on the store (they fsync the file and its directory)."""
        if self._local is None:
            raw = await self._get(key)
            return None if raw is None else raw.to_bytes()
        try:
            return await read_small(self._local.joinpath(*key.split("/")))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    async def _put(self, key: str, data: bytes) -> None:
        await self._request(self._store.set(key, CpuBuffer.from_bytes(data)))

    async def _put_unpublished(self, step: int, key: str, parts: list[memoryview]) -> None:
        """Write an object of a snapshot that is not committed yet: on a path its directory
        entries are synced once, at commit, instead of with every object."""
        if isinstance(self._store, DurableLocalStore):
            pending = self._unsynced.setdefault(step, set())
            await self._request(self._store.write_parts(key, parts, unpublished=pending))
        elif self._s3 is not None:
            # One PUT per object, never a multipart upload: a writer killed or failing
            # mid-upload leaves no unfinished upload behind holding the parts it sent (they
            # are invisible to listings and billed until aborted). A PUT takes up to 5 GiB;
            # begin() refuses larger chunks.
            import obstore

            data = parts[0] if len(parts) == 1 else await self._cpu(_join, parts)
            await self._request(
                obstore.put_async(self._store.store, key, data, use_multipart=False)  # type: ignore[attr-defined]
            )
        elif len(parts) == 1:
            await self._request(self._store.set(key, CpuBuffer.from_bytes(parts[0])))
        else:
            joined = await self._cpu(_join, parts)
            await self._request(self._store.set(key, CpuBuffer.from_array_like(joined)))

    async def _put_documents(self, plan: _Plan) -> None:
        step = plan.manifest.step
        docs = _documents(plan)
        await self._all(self._put_unpublished(step, k, [memoryview(v)]) for k, v in docs.items())

    def _group(self, step: int) -> str:
        """The group ``step`` lives in: the one this writer writes it to, or the one the
        index names (the plain name unless the index says otherwise)."""
        return self._writing.get(step) or self._groups.get(step) or _step_prefix(step)

    def _part_of(self, step: int, rank: int, world_size: int) -> str:
        return _part_prefix(step, rank, world_size, self._group(step))

    def _plan(self, manifest: Manifest) -> _Plan:
        at = (manifest.step, manifest.rank)  # a resharding restore reads several ranks' parts
        plan = self._plans.get(at)
        group = self._group(manifest.step)
        if plan is None or plan.manifest is not manifest or not plan.prefix.startswith(group):
            plan = plan_snapshot(manifest, self.pack_chunk_bytes, group)
            self._plans[at] = plan
            while len(self._plans) > 64:  # readers of old steps just plan again
                del self._plans[next(iter(self._plans))]
        return plan

    def _forget(self, step: int) -> None:
        """Drop what is cached about ``step`` (every rank's part)."""
        for cache in (self._plans, self._geometry):
            for at in [at for at in cache if at[0] == step]:
                del cache[at]
        for at in [at for at in self._stored if at[0] == step]:
            del self._stored[at]
        self._refers.pop(step, None)
        self._begun.discard(step)
        self._unsynced.pop(step, None)

    @property
    def _committer(self) -> bool:
        """Whether this instance writes the commit index: the only one in a single-process
        run, rank 0 of several (the others never write it, so no two processes ever
        read-modify-write the same object)."""
        return self.world_size == 1 or self.rank == 0

    # -- the commit index ------------------------------------------------------------------

    async def _read_root(self) -> dict[str, Any] | None:
        raw = await self._get_document("zarr.json")
        if raw is None:
            return None
        root = self._parse_root(raw)
        self._groups = self._group_names(root)
        return root

    def _group_names(self, root: dict[str, Any] | None) -> dict[int, str]:
        """The index's map of steps to groups not named plainly (steps written on S3)."""
        if root is None:
            return {}
        found = root["attributes"]["lazyckpt"].get("groups", {})
        try:
            groups = {int(k): str(v) for k, v in found.items()}
        except (AttributeError, TypeError, ValueError):
            raise CorruptionError("the group map in the root zarr.json is damaged") from None
        for step, name in groups.items():
            m = _STEP_GROUP.match(name)
            if m is None or int(m.group(1)) != step:
                raise CorruptionError(
                    f"the group map in the root zarr.json is damaged: step {step} -> {name!r}"
                )
        return groups

    def _parse_root(self, raw: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(raw)
            if doc.get("node_type") != "group":
                raise ValueError("not a group")
        except (ValueError, AttributeError) as exc:
            raise CorruptionError(f"{self.location}/zarr.json is not a Zarr group: {exc}") from exc
        if not isinstance(doc.get("attributes", {}).get("lazyckpt"), dict):
            raise ForeignLocationError(
                f"{self.location} holds a Zarr group that lazyckpt did not write; nothing was "
                "changed. Give ZarrTier an empty or new location.",
                location=self.location,
            )
        return doc  # type: ignore[no-any-return]

    @staticmethod
    def _committed(root: dict[str, Any] | None) -> list[int]:
        if root is None:
            return []
        steps = root["attributes"]["lazyckpt"].get("committed", [])
        if not isinstance(steps, list) or any(type(s) is not int or s < 0 for s in steps):
            raise CorruptionError("the commit index in the root zarr.json is damaged")
        return sorted(steps)

    @staticmethod
    def _retired(root: dict[str, Any] | None) -> list[int]:
        """Deleted steps whose objects committed incremental steps still read."""
        if root is None:
            return []
        steps = root["attributes"]["lazyckpt"].get("retired", [])
        if not isinstance(steps, list) or any(type(s) is not int or s < 0 for s in steps):
            raise CorruptionError("the retired list in the root zarr.json is damaged")
        return sorted(steps)

    async def _stored_manifest(self, step: int, rank: int) -> Manifest:
        """Rank ``rank``'s manifest of a step whose objects are stored here, committed or
        retired (what an incremental step's shards are read from)."""
        at = (step, rank)
        found = self._stored.get(at)
        if found is not None:
            return found
        key = f"{self._group(step)}/zarr.json"
        attrs = await self._group_attributes(key)
        if "manifest" not in attrs:  # a commit record: the rank's own part
            world = attrs.get("world_size")
            if type(world) is not int or not 0 <= rank < world:
                raise CorruptionError(f"{self.location}/{key} has no part of rank {rank}")
            key = f"{self._part_of(step, rank, world)}/zarr.json"
            attrs = await self._group_attributes(key)
        found = self._record_manifest(attrs, key, step)
        if len(self._stored) >= 256:
            self._stored.clear()
        self._stored[at] = found
        return found

    async def _references_of(self, step: int) -> frozenset[int]:
        """The steps a committed step's manifests (every rank's) refer to."""
        found = self._refers.get(step)
        if found is not None:
            return found
        attrs = await self._group_attributes(f"{self._group(step)}/zarr.json")
        world = 1 if "manifest" in attrs else attrs.get("world_size")
        if type(world) is not int or world < 1:
            raise CorruptionError(f"{self.location}/{self._group(step)}/zarr.json is damaged")
        refers: set[int] = set()
        for rank in range(world):
            refers |= (await self._stored_manifest(step, rank)).references()
        self._refers[step] = frozenset(refers)
        return self._refers[step]

    async def _referenced(self, committed: Iterable[int]) -> set[int]:
        """The steps whose objects the ``committed`` steps refer to."""
        found: set[int] = set()
        for step in committed:
            found |= await self._references_of(step)
        return found

    def _check_version(self, root: dict[str, Any]) -> None:
        version = int(root["attributes"]["lazyckpt"].get("format_version", 1))
        if version > FORMAT_VERSION:
            raise ConfigurationError(
                f"{self.location} was written by a newer lazyckpt (format {version}); upgrade"
            )

    async def _names(self, prefix: str) -> list[str]:
        # a server with directories (SeaweedFS) may list the prefix itself, emptied, as ""
        return [n.rstrip("/") async for n in self._store.list_dir(prefix) if n.rstrip("/")]

    def _record_manifest(self, attrs: dict[str, Any], key: str, step: int) -> Manifest:
        source = f"{self.location}/{key}"
        try:
            manifest = Manifest.from_json(json.dumps(attrs["manifest"]), source=source)
        except KeyError as exc:
            raise CorruptionError(f"{source} has no manifest") from exc
        if manifest.step != step:
            raise CorruptionError(f"{source} holds step {manifest.step}")
        return manifest

    async def _group_attributes(self, key: str) -> dict[str, Any]:
        """``attributes.lazyckpt`` of the group document at ``key`` of a committed step."""
        source = f"{self.name}:{self.location}/{key}"
        raw = await self._get_document(key)
        if raw is None:
            raise CorruptionError(f"{source} is missing from a committed step")
        try:
            attrs = json.loads(raw)["attributes"]["lazyckpt"]
            if not isinstance(attrs, dict):
                raise TypeError("attributes.lazyckpt is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"{source} is damaged: {exc!r:.200}") from exc
        return attrs

    async def _pack_geometry(self, plan: _Plan) -> _PackGeometry:
        # Read from the store, never derived from this tier's options: the writer may have
        # used another pack_chunk_bytes.
        at = (plan.manifest.step, plan.manifest.rank)
        geometry = self._geometry.get(at)
        if geometry is None:
            key = f"{plan.prefix}/packed/zarr.json"
            raw = await self._get_document(key)
            if raw is None:
                raise CorruptionError(f"{self.location}/{key} is missing")
            geometry = _geometry_from_document(raw, f"{self.location}/{key}")
            self._geometry[at] = geometry
        return geometry
