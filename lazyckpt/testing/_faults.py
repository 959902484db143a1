"""Fault-injecting tiers: wrap a real tier and make it slow, flaky, broken, hung or full.

They exist so that what lazyckpt promises under failure is tested, not assumed::

    faulty = FaultyTier(FileTier(path))
    faulty.fail_next("put_shard", 2)            # two transient failures, then fine
    faulty.capacity_bytes = 10 << 20            # ENOSPC once 10 MiB were written
    faulty.hang("commit")                       # commit never returns (use a deadline)
    faulty.delay_s = 0.05                       # every call 50 ms slower
"""

from __future__ import annotations

import asyncio
import errno
from collections import Counter
from typing import Any

from .._errors import TierBrokenError, TierError, TierFullError
from .._format.entries import ShardMeta
from .._format.manifest import Manifest
from .._tiering.interface import Tier

__all__ = ["FaultyTier"]

_METHODS = (
    ["open", "begin", "put_shard", "commit", "abort", "steps", "read_manifest", "read_shard", "delete", "aclose"]
)


class FaultyTier(Tier):
    """Delegates to ``inner`` and injects the faults configured on it (see module doc).

    ``calls`` counts every call by method name; ``bytes_written`` counts accepted shard
    bytes. Faults raise lazyckpt's own tier errors, as a real tier translates its backend's.
    """

    def __init__(self, inner: Tier, *, name: str | None = None) -> None:
        super().__init__(name=name or inner.name)
        self.inner = inner
        self.level = inner.level
        self.retention = inner.retention
        self.delay_s = 0.0
        self.capacity_bytes: int | None = None
        self.bytes_written = 0
        self.calls: Counter[str] = Counter()
        self._fail: dict[str, int] = {}
        self._fail_exc: dict[str, type[TierError]] = {}
        self._hang: set[str] = set()
        self._broken: set[str] = set()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def bind(self, rank: int, world_size: int) -> None:
        """Bind this wrapper and the tier it wraps (which is the one that stores per rank)."""
        super().bind(rank, world_size)
        self.inner.bind(rank, world_size)

    # -- configuring faults ----------------------------------------------------------------

    def fail_next(self, method: str, times: int = 1, *, full: bool = False) -> None:
        """The next ``times`` calls of ``method`` fail (``full``: with TierFullError)."""
        self._check(method)
        self._fail[method] = self._fail.get(method, 0) + times
        self._fail_exc[method] = TierFullError if full else TierBrokenError

    def break_(self, method: str) -> None:
        """Every call of ``method`` fails from now on, until :meth:`heal`."""
        self._check(method)
        self._broken.add(method)

    def hang(self, method: str) -> None:
        """Calls of ``method`` do not return until :meth:`heal` (or until cancelled)."""
        self._check(method)
        self._hang.add(method)

    def heal(self) -> None:
        """Remove every configured fault."""
        self._fail.clear()
        self._hang.clear()
        self._broken.clear()
        self.capacity_bytes = None
        self.delay_s = 0.0

    @staticmethod
    def _check(method: str) -> None:
        if method not in _METHODS:
            raise ValueError(f"unknown tier method {method!r}; one of {_METHODS}")

    async def _enter(self, method: str) -> None:
        self.calls[method] += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        # heal() may come from another thread and loop, so no asyncio.Event: poll instead
        while method in self._hang:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        if method in self._broken:
            raise TierBrokenError(f"{method}: injected permanent failure", tier=self.name)
        left = self._fail.get(method, 0)
        if left:
            self._fail[method] = left - 1
            exc = self._fail_exc.get(method, TierBrokenError)
            cause = OSError(errno.ENOSPC if exc is TierFullError else errno.EIO, "injected")
            raise exc(f"{method}: injected failure", tier=self.name) from cause

    # -- Tier --------------------------------------------------------------------------------

    async def open(self) -> None:
        await self._enter("open")
        await self.inner.open()

    async def begin(self, manifest: Manifest) -> None:
        await self._enter("begin")
        await self.inner.begin(manifest)

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        await self._enter("put_shard")
        if self.capacity_bytes is not None and self.bytes_written + len(data) > self.capacity_bytes:
            raise TierFullError("injected: no space left on device", tier=self.name) from OSError(
                errno.ENOSPC, "No space left on device"
            )
        self.bytes_written += len(data)  # reserve before awaiting: puts run concurrently
        try:
            await self.inner.put_shard(manifest, shard, data)
        except BaseException:
            self.bytes_written -= len(data)
            raise

    async def commit(self, manifest: Manifest) -> None:
        await self._enter("commit")
        await self.inner.commit(manifest)

    async def abort(self, step: int) -> None:
        await self._enter("abort")
        await self.inner.abort(step)

    async def steps(self) -> list[int]:
        await self._enter("steps")
        return await self.inner.steps()

    async def read_manifest(self, step: int) -> Manifest:
        await self._enter("read_manifest")
        return await self.inner.read_manifest(step)

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        await self._enter("read_shard")
        await self.inner.read_shard(manifest, shard, out)

    async def delete(self, step: int) -> None:
        await self._enter("delete")
        await self.inner.delete(step)

    async def aclose(self) -> None:
        self.calls["aclose"] += 1
        await self.inner.aclose()
