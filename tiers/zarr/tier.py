"""ZarrTier: snapshots as Zarr v3 groups, on a local or Lustre path or on S3.

Layout under the root (a directory, an S3 prefix, or any Zarr v3 store)::

    zarr.json                        root group; attributes.lazyckpt.committed lists the
                                     committed steps (the commit index)
    step-000000000100/               one group per snapshot
        zarr.json                    written at commit: format version, step, key -> array
                                     map, and the lazyckpt manifest (so restore is exact)
        tensors/                     one array per large tensor, at its state-dict key
            model/zarr.json
            model/layer.weight/zarr.json
            model/layer.weight/c/0/0, c/1/0, ...
        packed/                      the small tensors, side by side in a sharded uint8
            zarr.json                array; attributes.lazyckpt.index: key -> offset, dtype,
            c/0, c/1, ...            shape. One shard object per pack shard.

A snapshot written by several ranks has one such group per rank inside the step's group,
and the step's own ``zarr.json`` is the commit record (step, world size, no manifest)::

    step-000000000100/
        zarr.json                    the commit record, written by rank 0
        rank-00000/                  rank 0's part: zarr.json (its manifest), tensors/, packed/
        rank-00001/                  rank 1's part, written by rank 1 alone

Every array is uncompressed with a crc32c codec, so plain ``zarr`` (no lazyckpt installed)
reads every tensor and detects a damaged chunk. dtypes zarr lacks (bfloat16, float8,
complex32) are stored as unsigned integers of the same width; the real dtype is in the
attributes. A shard of the lazyckpt layout is exactly one zarr chunk (a pack shard is one
zarr shard), so each is written as one object, already encoded, straight to the store:
zarr's ``setitem`` would copy it twice more on the way.

Commit protocol: ``begin`` writes the array metadata, ``put_shard`` one object per shard,
``commit`` the snapshot group's ``zarr.json`` and then, last, the root ``zarr.json`` with
the step added to its index: one atomic object write (an S3 PUT, or a rename here). A step
missing from the index does not exist for ``steps()`` or restore, and ``open()`` removes
what a crash left of it. Listing committed steps reads that one small object and never
lists the keys of a snapshot.

With several ranks, ``commit`` publishes only the rank's part (its group's ``zarr.json``);
once every rank's part is durable and the ranks agreed (the engine's coordinator), rank 0's
``commit_global`` writes the commit record and then the index. Only rank 0 ever writes the
index (and deletes steps, and cleans up at ``open()``), so no two processes read-modify-write
the same object, and no two ranks write any object in common.

One writer per location: on a path each writing rank holds an ``flock`` on
``.lazyckpt-writer-rank-NNNNN.lock`` in the root for its life; on S3 it holds a lease, the
object ``.lazyckpt-writer-rank-NNNNN.json``, created with a conditional PUT (``If-None-Match``)
and renewed with ``If-Match`` on its ETag, so a second writer is refused at ``open()`` and a
writer that lost its lease (it stalled past ``lease_seconds`` and another took over) fails
before it writes again. The index on S3 is fenced by that lease: it names the owning
writer's token and is replaced only with ``If-Match`` on the ETag just read, and a writer that
takes over writes its token there before it sweeps anything, so a writer that stalls past its
lease after its last check still never commits. Readers take neither.

``open()`` deletes only what it can prove is its own uncommitted leftover: a step group
missing from the index, under a root whose ``zarr.json`` carries lazyckpt's attributes, that
holds nothing but this layout. A location another store wrote is refused
(:class:`~lazyckpt.ForeignLocationError`). A root whose ``zarr.json`` was lost is rebuilt
from the step groups whose commit records verify, and nothing is deleted on that open.

Incremental snapshots (:class:`~lazyckpt.tier.SupportsReferences`): a shard whose manifest
entry names ``stored_in`` is read from that step's objects (the same shard index of the
same rank's part); its own group does not hold it. For a plain zarr reader, the ``arrays``
map then points a tensor whose chunks are all stored with one earlier step at that step's
array (a path from the store's root, starting with ``/``), and the packed index entry of a
small tensor stored with an earlier step names that step's packed array (``array``); a
tensor whose chunks are stored partly here and partly elsewhere has the others copied into
its array at commit, so that every array a map names is whole. Deleting a step that
committed steps still refer to moves it from the index's ``committed`` list to its
``retired`` list (one atomic write) and keeps its objects; :meth:`ZarrTier.collect` removes
a retired step once no committed step refers to it, and ``open()`` never sweeps one.

``docs/zarr.md`` has the plain-zarr recipe and the S3 configuration.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Collection

from lazyckpt.tier import (
    FORMAT_VERSION,
    ConfigurationError,
    CorruptionError,
    LocationInUseError,
    Manifest,
    ShardMeta,
    SnapshotNotFoundError,
    TierBrokenError,
    TierLevel,
)

from .codec import _chunk_parts, _decode_pack_shard, _encode_pack_shard
from .layout import (
    _ChunkTarget,
    _group_doc,
    _pack_document,
    _PackTarget,
    _part_attributes,
    _part_prefix,
    _Plan,
    _rank_name,
    _step_prefix,
)
from .location import ZarrLocation
from .store import DurableLocalStore
from .uploads import Upload, UploadsError, abort_uploads, unfinished_uploads

__all__ = ["ZarrTier"]

log = logging.getLogger("lazyckpt")


# -- the tier -----------------------------------------------------------------------------------


log = logging.getLogger(__name__)

# the largest object one S3 PUT takes
_MAX_PUT = 5 << 30


class ZarrTier(ZarrLocation):
    """Snapshots as Zarr v3 groups on a parallel file system path or on S3.

    Each committed snapshot is a group that plain ``zarr`` opens and reads tensors from by
    their state-dict key (``docs/zarr.md``); small tensors are packed into one sharded
    array, so a checkpoint of thousands of tensors is a handful of objects.

    With several ranks (a distributed Checkpointer), every rank gives the same location;
    each writes its own part and rank 0 commits the step once all agreed.

    Args:
        location: a directory (local or Lustre; every write is fsynced), ``s3://bucket/prefix``,
            or any Zarr v3 ``Store`` object (used as given).
        name: the tier's name (default ``"zarr"``).
        concurrency: most requests this tier has in flight at once (metadata writes,
            deletes, reads).
        io_threads: threads doing file I/O (paths) and copies (all locations).
        pack_chunk_bytes: inner chunk size of the packed array: the unit a plain zarr reader
            fetches to read one small tensor.
        endpoint_url, region, access_key_id, secret_access_key, session_token, allow_http: S3
            settings; each defaults to its standard environment variable
            (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``,
            ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ALLOW_HTTP``). Credentials
            never appear in manifests, errors or logs.
        retries: S3 retries of a failed request (5xx, dropped connections, timeouts), with
            exponential backoff and jitter from 1 s to 8 s: the default 10 ride out a server
            that is gone for ten seconds or more (a restart).
        retry_timeout: seconds after which a failing S3 request is not retried any more.
        connect_timeout, request_timeout: S3 connection and whole-request limits, seconds.
        keep_last, keep_every: retention (see :class:`lazyckpt.Retention`).
        retention: the whole retention policy as one :class:`lazyckpt.Retention` (which
            also holds ``keep_best`` and ``keep_within``), instead of ``keep_last`` and
            ``keep_every``.
        skip_signature: S3: send unsigned requests (a bucket that allows anonymous access)
            instead of looking for credentials.
        require_conditional_writes: S3: at open for writing, check that the server honours
            conditional writes (a second create-if-absent of a probe object must fail) and
            refuse it otherwise; ``False`` writes without the one-writer guarantee.
        readonly: only read (a restore, an inspection): ``open()`` creates, deletes and locks
            nothing, a missing location or bucket is :class:`~lazyckpt.SnapshotNotFoundError`,
            and writing is refused. A reader works beside a running writer.
        lease_seconds: on S3, how long a writer's lease lasts without renewal (it renews at
            every snapshot, and while writing one); a writer that was killed blocks the next
            one until then. Hosts' clocks must agree to well within it.
    """

    # the locations the command line opens with this tier: s3:// URLs, and a local directory
    # whose root holds the Zarr group's metadata
    url_schemes = ("s3",)
    location_marker = "zarr.json"
    level = TierLevel.PFS
    default_name = "zarr"

    # -- life cycle (open() and the location's checks: ZarrLocation) -------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._plans.clear()
        self._unsynced.clear()
        # joining worker threads blocks: not on the event loop
        if isinstance(self._store, DurableLocalStore):
            await asyncio.to_thread(self._store.close)
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, wait=True)
        await self._drop_writer_lock()  # after the last write: the next writer may start

    # -- writing ---------------------------------------------------------------------------

    async def begin(self, manifest: Manifest) -> None:
        self._writable("write a snapshot")
        with self._backend("begin"):
            # begin removes what sits at the step's prefix: only while the lease is surely
            # this writer's (a taker may be writing the same step number there)
            await self._renew_lease(force=True)
            root = await self._read_root()
            if root is None and manifest.world_size > 1:
                raise ConfigurationError(
                    f"rank {manifest.rank} finds no lazyckpt root at {self.location}, which "
                    "rank 0 creates when it opens: every rank must give ZarrTier the same "
                    "shared location (an S3 prefix, or a directory every rank sees)"
                )
            if manifest.step in self._committed(root):
                raise TierBrokenError(
                    f"step {manifest.step} is already committed; delete it first", tier=self.name
                )
            if manifest.step in self._retired(root):
                raise TierBrokenError(
                    f"step {manifest.step} was deleted but committed incremental steps still "
                    "read shards from its objects; snapshot under another step number, or "
                    "delete the steps that refer to it",
                    tier=self.name,
                )
            token = self._incarnation
            if token is not None and manifest.world_size == 1:
                # on S3 a writer writes its steps into groups named after its lease token:
                # objects no other incarnation names, so a writer that stalled past its
                # lease can neither overwrite nor delete what the taker writes
                self._writing[manifest.step] = _step_prefix(manifest.step, token)
            plan = self._plan(manifest)
            if self._s3 is not None:
                largest = max(
                    (t.chunk_bytes for t in plan.targets if isinstance(t, _ChunkTarget)),
                    default=0,
                )
                if largest + 4 > _MAX_PUT:
                    raise ConfigurationError(
                        f"step {manifest.step}: a chunk of {largest + 4} bytes exceeds the "
                        "5 GiB an S3 PUT takes; use a smaller shard_size"
                    )
            self._geometry.pop((manifest.step, manifest.rank), None)
            # leftovers of an earlier attempt (this rank's part only: the others write
            # theirs; on S3 only this incarnation's own group)
            await self._store.delete_dir(plan.prefix)
            self._unsynced.pop(manifest.step, None)
            await self._put_documents(plan)
            self._begun.add(manifest.step)

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        with self._backend(f"put shard {shard.index}"):
            if len(data) != shard.length:
                raise ConfigurationError(
                    f"shard {shard.index}: {len(data)} bytes, not {shard.length}"
                )
            await self._renew_lease()
            plan = self._plan(manifest)
            target = plan.targets[shard.index]
            if isinstance(target, _ChunkTarget):
                # data, padding and crc go out as pieces: no copy where the store takes them
                parts = await self._cpu(_chunk_parts, data, shard.crc32c, target.chunk_bytes)
            else:
                assert plan.pack is not None
                parts = [memoryview(await self._cpu(_encode_pack_shard, data, plan.pack))]
            await self._put_unpublished(manifest.step, target.key, parts)

    async def commit(self, manifest: Manifest) -> None:
        """Make this snapshot durable and, written by one rank, visible. With several ranks
        this publishes this rank's part only (its group's ``zarr.json``, with its manifest);
        :meth:`commit_global` makes the step visible once every rank has done so."""
        self._writable("commit a snapshot")
        with self._backend("commit"):
            await self._renew_lease()
            plan = self._plan(manifest)
            if manifest.step not in self._begun:  # committed without begin(): metadata owed
                await self._put_documents(plan)
            if manifest.references():
                await self._point_at_stored(plan)
            if isinstance(self._store, DurableLocalStore):
                # kept until done: a commit that fails here and is retried syncs them again
                await self._store.sync_directories(self._unsynced.get(manifest.step, ()))
            await self._put(f"{plan.prefix}/zarr.json", _group_doc(_part_attributes(plan)))
            if manifest.world_size == 1:
                self._refers[manifest.step] = manifest.references()
            if manifest.world_size == 1:
                group = self._writing.get(manifest.step)
                await self._update_index(add=manifest.step, group=group)
                if group is not None:
                    self._groups[manifest.step] = group
                self._writing.pop(manifest.step, None)
            self._begun.discard(manifest.step)
            self._unsynced.pop(manifest.step, None)
            if plan.pack is not None:
                self._geometry[(manifest.step, manifest.rank)] = plan.pack

    async def commit_global(self, step: int, world_size: int) -> None:
        """Make a step written by ``world_size`` ranks visible, once every rank's part is
        durable (the engine calls this on every rank after they agreed). Rank 0 writes the
        step's group ``zarr.json`` (the commit record) and then the root index with the step
        added: that one atomic object write is the commit point. The other ranks write
        nothing; the first time, each checks that it sees rank 0's part, i.e. that every
        rank was given the same location. Idempotent."""
        with self._backend("commit"):
            if world_size == 1:
                return  # commit() published it
            self._writable("commit a snapshot")
            await self._renew_lease()
            prefix = self._group(step)
            if not self._committer:
                if not self._shared_checked:
                    key = f"{prefix}/{_rank_name(0)}/zarr.json"
                    if not await self._request(self._store.exists(key)):
                        raise ConfigurationError(
                            f"rank {self.rank} does not see rank 0's part of step {step} at "
                            f"{self.location}/{key}: every rank must give ZarrTier the same "
                            "shared location"
                        )
                    self._shared_checked = True
                return
            record = {
                "lazyckpt": {
                    "format_version": FORMAT_VERSION,
                    "step": step,
                    "world_size": world_size,
                    "parts": "rank-%05d",
                }
            }
            await self._put(f"{prefix}/zarr.json", _group_doc(record))
            await self._update_index(add=step)

    async def abort(self, step: int) -> None:
        with self._backend("abort"):
            own = self._writing.pop(step, None)
            self._forget(step)
            if self.readonly:
                return  # a read-only tier wrote nothing to abort
            if own is not None:
                # this incarnation's own group: nobody else names it, nothing to re-check
                # (a committed step never lives in a group still being written)
                await self._store.delete_dir(own)
                return
            if self._incarnation is not None:
                return  # it wrote nothing of this step
            try:
                await self._renew_lease(force=True)
            except LocationInUseError:
                return  # what is there now is the taker's (it may write the same step)
            if step in self._committed(await self._read_root()):
                return
            if self.world_size == 1:
                await self._store.delete_dir(_step_prefix(step))
                return
            # this rank's part only: the others may still be writing theirs
            await self._store.delete_dir(_part_prefix(step, self.rank, self.world_size))
            if isinstance(self._store, DurableLocalStore):
                await self._store.remove_empty_dir(_step_prefix(step))

    # -- reading ---------------------------------------------------------------------------

    async def steps(self) -> list[int]:
        with self._backend("list"):
            return self._committed(await self._read_root())

    async def read_manifest(self, step: int) -> Manifest:
        return await self.read_rank_manifest(step, self.rank)

    async def read_rank_manifest(self, step: int, rank: int) -> Manifest:
        """Rank ``rank``'s manifest of a committed step. A step written by a single process
        has one manifest, returned for any rank; a step of several ranks that has no part of
        ``rank`` raises :class:`~lazyckpt.CorruptionError` (a resharding restore then reads
        another rank's)."""
        with self._backend("read manifest"):
            if step not in self._committed(await self._read_root()):
                raise SnapshotNotFoundError(f"step {step} is not committed on {self.name!r}")
            key = f"{self._group(step)}/zarr.json"
            attrs = await self._group_attributes(key)
            if "manifest" not in attrs:  # the commit record of a step of several ranks
                world = attrs.get("world_size")
                if type(world) is not int or world < 2:
                    raise CorruptionError(
                        f"{self.name}:{self.location}/{key} is damaged: no manifest and no "
                        "world size"
                    )
                if not 0 <= rank < world:
                    raise CorruptionError(
                        f"step {step} was written by {world} ranks: it has no part of rank {rank}"
                    )
                key = f"{self._part_of(step, rank, world)}/zarr.json"
                attrs = await self._group_attributes(key)
            source = f"{self.name}:{self.location}/{key}"
            try:
                manifest = Manifest.from_json(json.dumps(attrs["manifest"]), source=source)
            except KeyError as exc:
                raise CorruptionError(f"{source} is damaged: {exc!r:.200}") from exc
            if manifest.step != step:
                raise CorruptionError(f"{source} holds step {manifest.step}, not {step}")
            if manifest.world_size > 1 and manifest.rank != rank:
                raise CorruptionError(
                    f"{source} holds rank {manifest.rank}'s manifest, not {rank}'s"
                )
            return manifest

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        with self._backend(f"read shard {shard.index}"):
            if len(out) != shard.length:
                raise ConfigurationError(f"shard {shard.index}: out has {len(out)} bytes")
            if shard.stored_in is not None:  # an incremental step: an earlier step's objects
                manifest, shard = await self._stored_shard(manifest, shard)
            plan = self._plan(manifest)
            target = plan.targets[shard.index]
            where = f"{self.name}:{self.location}/{target.key}"
            if isinstance(target, _PackTarget):
                geometry = await self._pack_geometry(plan)
                if target.slot >= len(geometry.lengths) or (
                    geometry.lengths[target.slot] != shard.length
                ):
                    raise CorruptionError(f"{where} does not hold {shard.length} bytes")
                raw = await self._get(target.key)
                if raw is None:
                    raise CorruptionError(f"{where} is missing")
                blob = memoryview(raw.as_buffer_like()).cast("B")
                try:
                    await self._cpu(_decode_pack_shard, blob, out, geometry)
                except CorruptionError as exc:
                    raise CorruptionError(f"{where}: {exc}") from None
                return
            expected = target.chunk_bytes + 4
            if isinstance(self._store, DurableLocalStore):
                try:
                    size = await self._request(self._store.read_into(target.key, out))
                except FileNotFoundError:
                    raise CorruptionError(f"{where} is missing") from None
            else:
                raw = await self._get(target.key)
                if raw is None:
                    raise CorruptionError(f"{where} is missing")
                stored = memoryview(raw.as_buffer_like()).cast("B")
                size = len(stored)
                if size == expected:
                    await self._cpu(out.__setitem__, slice(None), stored[: shard.length])
            if size != expected:
                raise CorruptionError(f"{where} holds {size} bytes, not {expected}")

    async def delete(self, step: int) -> None:
        """Un-commit ``step`` (remove it from the index), then remove its objects, every
        rank's part. With several ranks this is rank 0's work, as committing is; on the
        others it only forgets what this instance cached.

        Deletes run one at a time: retention passes may overlap (one still listing when the
        next step's commit starts another) and ask to delete the same step twice; the second
        then finds nothing left to do instead of removing a tree the first is removing."""
        with self._backend(f"delete step {step}"):
            self._forget(step)
            if not self._committer:
                return
            self._writable("delete a snapshot")
            await self._renew_lease()
            async with self._delete_lock:
                committed = self._committed(await self._read_root())
                referenced = await self._referenced([s for s in committed if s != step])
                if step in referenced and step in committed:
                    # committed incremental steps read shards from its objects: it leaves
                    # the index for the retired list, in the same write, and stays
                    await self._update_index(remove=step, retire=True)
                    return
                group = self._group(step)  # as the index names it, before it forgets it
                await self._update_index(remove=step)  # un-commit first
                # then its objects: on S3 a group no later writer names again (a step
                # written anew lives in its writer's own group), so even a writer that
                # stalled past its lease since the fenced write above removes nothing of
                # the taker's
                await self._store.delete_dir(group)

    # -- incremental snapshots (SupportsReferences) ------------------------------------------

    async def _open_for_writing(self) -> None:
        await super()._open_for_writing()
        if self._committer and self._retired(await self._read_root()):
            # retired steps whose last referrer was deleted just before a crash
            await self.collect()
        if self._committer and self._s3 is not None and self._leased:
            # uploads other tools or earlier versions left unfinished (this tier makes none):
            # with the lease held no live writer of this location owns one
            try:
                found = await self.unfinished_uploads()
                if found:
                    await self._confirm_owner()
                    await abort_uploads(self._s3, found, self._timeout)
                    self.uploads_aborted = found
                    log.warning(
                        "%s: aborted %d unfinished multipart uploads holding %d bytes",
                        self.location, len(found), sum(u.bytes for u in found),
                    )
            except UploadsError as exc:  # a server without the calls: say so, open anyway
                log.warning("%s: unfinished uploads not listed: %s", self.location, exc)

    async def unfinished_uploads(self) -> list[Upload]:
        """The unfinished multipart uploads under this S3 location (none elsewhere), each
        with the bytes its parts hold: what ``lazyckpt ls`` reports and the writer's
        ``open()`` and ``lazyckpt gc`` abort."""
        if self._s3 is None:
            return []
        with self._backend("list unfinished uploads"):
            return await unfinished_uploads(self._s3, self._timeout)

    async def collect(self, keep: Collection[int] = ()) -> list[int]:
        """Remove every retired step that no committed step refers to and that is not in
        ``keep``: its objects first, then its entry in the retired list (a crash between
        leaves an entry whose objects are gone, which nothing reads and the next collect
        drops). Rank 0's work with several ranks; the others remove nothing."""
        with self._backend("collect"):
            if not self._committer:
                return []
            self._writable("collect unreferenced data")
            await self._renew_lease()
            async with self._delete_lock:
                root = await self._read_root()
                retired = [s for s in self._retired(root) if s not in keep]
                if not retired:
                    return []
                referenced = await self._referenced(self._committed(root))
                doomed = [s for s in retired if s not in referenced]
                groups = [self._group(s) for s in doomed]
                if self._leased and doomed:
                    # fenced first: a writer that lost its lease deletes nothing
                    await self._update_index(unretire=doomed)
                for step, group in zip(doomed, groups, strict=True):
                    self._forget(step)
                    await self._store.delete_dir(group)
                if doomed and not self._leased:
                    await self._update_index(unretire=doomed)
                return doomed

    async def _stored_shard(
        self, manifest: Manifest, shard: ShardMeta
    ) -> tuple[Manifest, ShardMeta]:
        """The manifest and shard entry of the step that stores a referring shard's bytes."""
        assert shard.stored_in is not None
        home = await self._stored_manifest(shard.stored_in, manifest.rank)
        if shard.index >= len(home.shards):
            raise CorruptionError(
                f"step {manifest.step} refers to shard {shard.index} of step {home.step}, "
                "which has no such shard"
            )
        found = home.shards[shard.index]
        if found.stored_in is not None or found.length != shard.length:
            raise CorruptionError(
                f"step {manifest.step} refers to shard {shard.index} of step {home.step}, "
                "which does not hold it"
            )
        return home, found

    async def _point_at_stored(self, plan: _Plan) -> None:
        """Before an incremental step's part is published: point the ``arrays`` map and the
        packed index at the earlier steps' arrays holding its tensors, and make whole the
        arrays whose chunks are stored partly here (see the module docstring)."""
        m = plan.manifest
        shards = m.shards
        for t, meta in enumerate(m.tensors):
            if meta.alias_of is not None or meta.mode not in ("rows", "flat") or not meta.shards:
                continue
            homes = {shards[i].stored_in for i in meta.shards}
            if None not in homes and len(homes) == 1:
                (home,) = homes
                assert home is not None
                prefix = self._part_of(home, m.rank, m.world_size)
                path = f"/{prefix}/{plan.arrays[meta.key]}"
                for other in m.tensors:  # the key and its aliases
                    if other.key == meta.key or other.alias_of == t:
                        plan.arrays[other.key] = path
                continue
            for i in meta.shards:  # mixed: copy the chunks stored elsewhere into this array
                if shards[i].stored_in is None:
                    continue
                home_m, home_shard = await self._stored_shard(m, shards[i])
                source = self._plan(home_m).targets[home_shard.index].key
                raw = await self._get(source)
                if raw is None:
                    raise CorruptionError(f"{self.location}/{source} is missing")
                data = memoryview(raw.as_buffer_like()).cast("B")
                await self._put_unpublished(m.step, plan.targets[i].key, [data])
        packs = [s for s in shards if s.kind == "pack"]
        external: dict[int, tuple[str, int]] = {}
        for slot, shard in enumerate(packs):
            if shard.stored_in is None:
                continue
            home_m, home_shard = await self._stored_shard(m, shard)
            home_plan = self._plan(home_m)
            target = home_plan.targets[home_shard.index]
            assert isinstance(target, _PackTarget)
            geometry = await self._pack_geometry(home_plan)
            external[slot] = (f"/{home_plan.prefix}/packed", target.slot * geometry.shard_bytes)
        if external:
            plan.external = external
            await self._put_unpublished(
                m.step, f"{plan.prefix}/packed/zarr.json", [memoryview(_pack_document(plan))]
            )
