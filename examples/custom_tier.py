"""Writing your own tier: a toy object store, registered through the entry point.

A tier is a subclass of :class:`lazyckpt.tier.Tier` with a handful of coroutines; everything
a tier author needs comes from the one module ``lazyckpt.tier``. This one keeps "objects" in
a dict shared by every instance with the same bucket name, the way a real object store
outlives its clients: one object per shard, one manifest object written last as the commit
marker (an object store PUT is atomic, renames are not). ``open()`` removes what a writer
that died before its commit left: objects of a step that has no manifest.

A package makes its tier discoverable with an entry point in its ``pyproject.toml``::

    [project.entry-points."lazyckpt.tiers"]
    dictstore = "mypackage.tiers:DictStoreTier"

after which ``lazyckpt.load_tier("dictstore", "bucket")`` builds it. Running this file
registers the tier for the current process (as an installed package would), then snapshots
and restores through it. ``tests/conformance/test_custom_tier_conformance.py`` runs the same
conformance suite against it that the built-in tiers pass.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import torch

import lazyckpt
from lazyckpt.tier import (
    CorruptionError,
    Manifest,
    ShardMeta,
    SnapshotNotFoundError,
    Tier,
    TierClosedError,
    TierLevel,
)

_BUCKETS: dict[str, dict[str, bytes]] = {}


class DictStoreTier(Tier):
    """A toy object store tier: ``objects[key] = bytes``; committed = manifest present."""

    level = TierLevel.PFS
    default_name = "dictstore"

    def __init__(self, bucket: str, *, name: str | None = None, keep_last: int | None = None) -> None:
        super().__init__(name=name, keep_last=keep_last)
        self.bucket = bucket
        self._closed = False

    @property
    def _objects(self) -> dict[str, bytes]:
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        return _BUCKETS.setdefault(self.bucket, {})

    @staticmethod
    def _prefix(step: int) -> str:
        return f"step-{step:012d}/"

    async def open(self) -> None:
        """Remove the objects of steps without a manifest: a writer died before committing
        them. The bucket holds nothing but this layout, so nothing else is touched."""
        committed = {key.split("/")[0] for key in self._objects if key.endswith("/manifest.json")}
        for key in [k for k in self._objects if k.split("/")[0] not in committed]:
            del self._objects[key]

    async def begin(self, manifest: Manifest) -> None:
        self._objects  # noqa: B018 - raises if closed

    async def put_shard(
        self, manifest: Manifest, shard: ShardMeta, data: memoryview
    ) -> None:
        self._objects[f"{self._prefix(manifest.step)}shard-{shard.index}"] = bytes(data)

    async def commit(self, manifest: Manifest) -> None:
        self._objects[f"{self._prefix(manifest.step)}manifest.json"] = manifest.to_json()

    async def abort(self, step: int) -> None:
        prefix = self._prefix(step)
        if f"{prefix}manifest.json" not in self._objects:
            for key in [k for k in self._objects if k.startswith(prefix)]:
                del self._objects[key]

    async def steps(self) -> list[int]:
        return sorted(
            int(key[5:17]) for key in self._objects if key.endswith("/manifest.json")
        )

    async def read_manifest(self, step: int) -> Manifest:
        try:
            data = self._objects[f"{self._prefix(step)}manifest.json"]
        except KeyError:
            raise SnapshotNotFoundError(f"step {step} not in {self.bucket!r}") from None
        return Manifest.from_json(data, source=f"{self.bucket}/step {step}")

    async def read_shard(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview
    ) -> None:
        data = self._objects.get(f"{self._prefix(manifest.step)}shard-{shard.index}")
        if data is None or len(data) != len(out):
            raise CorruptionError(f"shard {shard.index} of step {manifest.step} is missing")
        out[:] = data

    async def delete(self, step: int) -> None:
        prefix = self._prefix(step)
        self._objects.pop(f"{prefix}manifest.json", None)  # un-commit first
        for key in [k for k in self._objects if k.startswith(prefix)]:
            del self._objects[key]

    async def aclose(self) -> None:
        self._closed = True


def register_entry_point(where: Path) -> None:
    """Make ``dictstore`` discoverable in this process, as ``pip install`` of a package with
    the entry point above would: a minimal distribution metadata folder on ``sys.path``."""
    dist = where / "dictstore_example-1.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dictstore-example\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[lazyckpt.tiers]\ndictstore = custom_tier:DictStoreTier\n"
    )
    sys.path.insert(0, str(where))
    sys.path.insert(0, str(Path(__file__).parent))


async def demo() -> None:
    tier = lazyckpt.load_tier("dictstore", "demo-bucket")
    state = {"w": torch.randn(64, 64), "step": 3}
    async with lazyckpt.Checkpointer([tier], staging_bytes=1 << 20, shard_size=1 << 16) as ckpt:
        await (await ckpt.snapshot(state, step=3)).committed()
    async with lazyckpt.Checkpointer([lazyckpt.load_tier("dictstore", "demo-bucket")]) as ckpt:
        restored = await ckpt.restore()
    assert torch.equal(restored["w"], state["w"]) and restored["step"] == 3
    objects = len(lazyckpt.load_tier("dictstore", "demo-bucket")._objects)
    print(f"{type(tier).__name__} via entry point: snapshot of step 3 restored bit for bit "
          f"({objects} objects)")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        register_entry_point(Path(tmp))
        asyncio.run(demo())
