"""Opening a ZarrTier's location: refuse what another store wrote, create the root and the
commit index, take the writer's lock or lease, rebuild an index that was lost from the step
groups whose commit records verify, and sweep what a crash left uncommitted (see
:mod:`tiers.zarr.tier` for the layout and the commit protocol)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from lazyckpt.tier import (
    FORMAT_VERSION,
    ConfigurationError,
    CorruptionError,
    ForeignLocationError,
    SnapshotNotFoundError,
)

from .layout import (
    _OURS_AT_ROOT,
    _PART_GROUP,
    _STEP_CHILDREN,
    _STEP_GROUP,
    _documents,
    _group_doc,
    _part_prefix,
    _step_prefix,
    plan_snapshot,
)
from .writer import ZarrWriter

__all__ = ["ZarrLocation"]

log = logging.getLogger("lazyckpt")


def _is_file(path: Path) -> bool:
    return path.exists() and not path.is_dir()


class ZarrLocation(ZarrWriter):
    """A ZarrTier's ``open()``: the checks and repairs of its location."""

    # -- life cycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Check that the location is a lazyckpt Zarr store; for writing, also create it,
        take the writer's lock (path) or lease (S3), rebuild a lost index, and remove what a
        crash left uncommitted (see the module docstring)."""
        with self._backend(f"open {self.location}"):
            local = self._local
            if local is not None and await asyncio.to_thread(_is_file, local):
                raise ConfigurationError(
                    f"ZarrTier location {local} is a file, not a directory; give a directory"
                )
            if self.readonly:
                await self._open_readonly()
                return
            # a foreign location is refused before the lock or lease is written there
            if await self._read_root() is None:
                names = await self._names("")
                if self._committer:
                    await self._rebuild_index(self._check_root_names(names))
                else:  # rank 0 may be writing the root meanwhile
                    self._check_root_names([n for n in names if n != "zarr.json"])
            await self._take_writer_lock()
            try:
                await self._open_for_writing()
            except BaseException:
                await self._drop_writer_lock()
                raise

    async def _open_readonly(self) -> None:
        root = await self._read_root()
        if root is not None:
            self._check_version(root)
            return
        names = await self._names("")
        steps = self._check_root_names(names)
        if steps:
            raise CorruptionError(
                f"{self.location}/zarr.json, the commit index, is missing but step groups are "
                "there; open the location once for writing (ZarrTier without readonly) to "
                "rebuild the index from the steps whose commit records verify"
            )
        raise SnapshotNotFoundError(f"{self.location}: no lazyckpt Zarr store there")

    async def _open_for_writing(self) -> None:
        root = await self._read_root()
        if root is None:
            if not self._committer:
                return  # rank 0 creates the root; every rank waits for it before writing
            names = await self._names("")
            steps = self._check_root_names(names)
            committed, incomplete, groups = await self._rebuild_index(steps)
            if self._leased:
                await self._update_fenced_index(committed, None, claim=True, groups=groups)
            else:
                document: dict[str, Any] = {
                    "format_version": FORMAT_VERSION,
                    "committed": committed,
                }
                if groups:
                    document["groups"] = {str(k): v for k, v in sorted(groups.items())}
                await self._put("zarr.json", _group_doc({"lazyckpt": document}))
            if steps:
                log.warning(
                    "%s: the commit index (zarr.json) was missing; rebuilt it from the %d of "
                    "%d step groups whose commit records verify (%s); the others were left "
                    "in place%s",
                    self.location,
                    len(committed),
                    len(steps),
                    ", ".join(map(str, committed[-5:])) or "none",
                    "; these have a commit record but not all their objects (a delete that "
                    f"stopped part way?): {', '.join(map(_step_prefix, incomplete[:5]))}"
                    if incomplete
                    else "",
                )
            return  # nothing is deleted on the open that rebuilt the index
        self._check_version(root)
        if not self._committer:
            return  # rank 0 cleans up; every rank waits for it before writing
        if self._leased:
            # the index names this writer before anything is deleted: a writer whose lease
            # this one took over can no longer commit the steps swept below
            await self._update_fenced_index((), None, claim=True)
            root = await self._read_root()
        # a retired step is kept for the committed steps that read it, not swept
        groups = self._group_names(root)
        indexed = {
            groups.get(s, _step_prefix(s)) for s in (*self._committed(root), *self._retired(root))
        }
        leftovers = []
        async for name in self._store.list_dir(""):
            m = _STEP_GROUP.match(name.rstrip("/"))
            if m and m.group(0) not in indexed:
                leftovers.append(m.group(0))
        for prefix in leftovers:  # each must be this layout, or nothing is deleted
            strange = [
                n
                for n in await self._names(prefix)
                if n not in _STEP_CHILDREN and not _PART_GROUP.match(n)
            ]
            if strange:
                raise ForeignLocationError(
                    f"{self.location}/{prefix} is not committed but holds "
                    f"{', '.join(strange[:5])}, which ZarrTier never writes; nothing was "
                    "deleted. Move it away.",
                    location=self.location,
                )
        if leftovers:
            # Listed in full before this check; a writer taking over claims the index before
            # it writes anything, and names its groups after its own token, so nothing it
            # writes is among, or under, the groups listed here.
            await self._confirm_owner()
        # what a crash left: snapshots that never reached the index
        await self._all(self._request(self._store.delete_dir(p)) for p in leftovers)

    def _check_root_names(self, names: list[str]) -> list[str]:
        """The step groups at a root without its ``zarr.json``; raises
        :class:`~lazyckpt.ForeignLocationError` for anything ZarrTier does not write."""
        if "lazyckpt-file.json" in names:
            raise ForeignLocationError(
                f"{self.location} is a FileTier location (lazyckpt-file.json), not a Zarr "
                "store; nothing was changed. Open it with FileTier, or give ZarrTier another "
                "location.",
                location=self.location,
            )
        strangers = [n for n in names if not _STEP_GROUP.match(n) and not _OURS_AT_ROOT.match(n)]
        if strangers:
            raise ForeignLocationError(
                f"{self.location} holds {', '.join(sorted(strangers)[:5])}, which ZarrTier "
                "did not write, and no lazyckpt zarr.json; nothing was changed. Give ZarrTier "
                "an empty or new location.",
                location=self.location,
            )
        return sorted(n for n in names if _STEP_GROUP.match(n))

    async def _rebuild_index(
        self, groups: list[str]
    ) -> tuple[list[int], list[int], dict[int, str]]:
        """The steps among ``groups`` whose commit records verify (a lost index, rebuilt),
        and those whose records verify but whose objects are not all there.

        A group without a commit record was never committed and is left alone; a record
        that does not verify stops the open, since nobody can tell what it held. A record
        does not prove its data: a delete that stopped part way (the index already without
        the step) leaves the record beside a part of the objects, so every object each
        manifest names must be listed too, or the step is left out (and left in place)."""
        committed: list[int] = []
        incomplete: list[int] = []
        named: dict[int, str] = {}  # steps found in groups not named plainly
        for prefix in groups:
            match = _STEP_GROUP.match(prefix)
            assert match is not None
            step = int(match.group(1))
            if step in committed:
                continue  # two writers' groups of one step verify: the first listed stands
            names = await self._names(prefix)
            if "manifest.json" in names or any(n.endswith(".data") for n in names):
                raise ForeignLocationError(
                    f"{self.location}/{prefix} is a FileTier snapshot (manifest.json, "
                    "rank-*.data), not a Zarr group; nothing was changed. Open the location "
                    "with FileTier.",
                    location=self.location,
                )
            if "zarr.json" not in names:
                continue  # never committed
            key = f"{prefix}/zarr.json"
            try:
                attrs = await self._group_attributes(key)
                if "manifest" in attrs:
                    manifests = [self._record_manifest(attrs, key, step)]
                else:
                    world = attrs.get("world_size")
                    if attrs.get("step") != step or type(world) is not int or world < 2:
                        raise CorruptionError("it is neither a manifest nor a commit record")
                    manifests = []
                    for rank in range(world):
                        part = f"{_part_prefix(step, rank, world, prefix)}/zarr.json"
                        manifests.append(
                            self._record_manifest(await self._group_attributes(part), part, step)
                        )
                plans = [plan_snapshot(m, self.pack_chunk_bytes, prefix) for m in manifests]
            except CorruptionError as exc:
                raise CorruptionError(
                    f"{self.location}/zarr.json (the commit index) is missing, and whether "
                    f"step {step} was committed cannot be verified ({exc}); nothing was "
                    f"changed. Move {prefix} away to rebuild the index without it."
                ) from exc
            stored = {k async for k in self._store.list_prefix(f"{prefix}/")}
            wanted = {t.key for plan in plans for t in plan.targets}
            wanted.update(k for plan in plans for k in _documents(plan))
            (committed if wanted <= stored else incomplete).append(step)
            if wanted <= stored and prefix != _step_prefix(step):
                named[step] = prefix
        return sorted(committed), incomplete, named
