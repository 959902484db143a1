"""PeerTier through the conformance suite.

A peer tier needs a second rank to hold its replicas, so the tier under test is a pair in
one event loop: rank 0's ``PeerTier`` (every call goes to it) and rank 1's, on another
"node", which stores what rank 0 sends. Both meet through an in-process stand-in for the
rendezvous collective. The location the suite inspects is rank 1's replica directory of
rank 0. The suite's two-rank checks (``commit_global``) open one instance per rank over one
shared location, which a pair is not; ``tests/test_peer.py`` runs the two-phase commit with
real ranks instead.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lazyckpt import Manifest, ShardMeta, Tier, TierLevel
from lazyckpt.testing import TierTests
from tiers import PeerTier


class _Gather:
    """``all_gather`` among the ranks of one loop: what lazyckpt's control group does."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rounds: list[dict[int, Any]] = []
        self.calls = [0] * n
        self.changed = asyncio.Condition()

    def exchange(self, rank: int) -> Callable[[Any], Any]:
        async def call(value: Any) -> list[Any]:
            i = self.calls[rank]
            self.calls[rank] += 1
            async with self.changed:
                while len(self.rounds) <= i:
                    self.rounds.append({})
                self.rounds[i][rank] = value
                self.changed.notify_all()
                await self.changed.wait_for(lambda: len(self.rounds[i]) == self.n)
            return [self.rounds[i][r] for r in range(self.n)]

        return call


class PeerPair(Tier):
    """Rank 0's PeerTier, with rank 1's beside it holding the replicas."""

    level = TierLevel.PEER
    default_name = "peer"

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.ranks = [
            PeerTier(root / node, node=node, address="127.0.0.1", timeout=5.0, linger=0.5)
            for node in ("a", "b")
        ]
        for rank, tier in enumerate(self.ranks):
            tier.bind(rank, 2)

    async def open(self) -> None:
        opened: list[PeerTier] = []
        try:
            for tier in self.ranks:
                await tier.open()
                opened.append(tier)
            gather = _Gather(2)
            await asyncio.gather(
                *(t.rendezvous(gather.exchange(r)) for r, t in enumerate(self.ranks))
            )
        except BaseException:
            await asyncio.gather(*(t.aclose() for t in opened), return_exceptions=True)
            raise

    async def begin(self, manifest: Manifest) -> None:
        await self.ranks[0].begin(manifest)

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        await self.ranks[0].put_shard(manifest, shard, data)

    async def commit(self, manifest: Manifest) -> None:
        await self.ranks[0].commit(manifest)

    async def abort(self, step: int) -> None:
        await self.ranks[0].abort(step)

    async def steps(self) -> list[int]:
        return await self.ranks[0].steps()

    async def read_manifest(self, step: int) -> Manifest:
        return await self.ranks[0].read_manifest(step)

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        await self.ranks[0].read_shard(manifest, shard, out)

    async def delete(self, step: int) -> None:
        await self.ranks[0].delete(step)

    async def aclose(self) -> None:
        results = await asyncio.gather(*(t.aclose() for t in self.ranks), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r


class TestPeerTier(TierTests):
    honours_readonly = False  # a peer tier serves its peers: it is never read-only

    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Callable[[], Tier]:
        self.root = tmp_path / "job"
        self.held = self.root / "b" / "rank-00000"  # rank 1's replicas of rank 0
        return lambda: PeerPair(self.root)

    async def raw_steps(self, tier: Tier) -> list[int]:
        return _listed(self.held)

    async def stored_names(self) -> set[str]:
        return _names(self.held)


def _listed(held: Path) -> list[int]:
    """The oracle: a step is committed exactly when its commit file exists."""
    if not held.exists():
        return []
    return sorted(
        int(name.split("-")[1])
        for name in os.listdir(held)
        if os.path.exists(held / name / "manifest.json")
    )


def _names(held: Path) -> set[str]:
    if not held.exists():
        return set()
    return {
        os.path.relpath(os.path.join(d, f), held) for d, _, files in os.walk(held) for f in files
    }
