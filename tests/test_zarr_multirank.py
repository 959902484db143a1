"""ZarrTier with several ranks: each rank writes its own part, rank 0 commits the step with
one atomic write of the root index once every rank agreed; a step a rank failed is never
listed; restore on the same or another world size; retention; plain zarr reads the parts.

The first tests play the ranks in one process (one ZarrTier per rank over the same store, as
``bench/dist_commit_sim.py`` does for FileTier); the last ones run real ranks (gloo on
loopback) through the Checkpointer."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from conftest_s3 import S3Location, indexed_group, s3, s3_server
from helpers.ranks import launch_ranks, rank_results

import lazyckpt
from lazyckpt import ConfigurationError, CorruptionError, Manifest, SyncCheckpointer, hooks
from lazyckpt.testing import build_snapshot
from tiers import ZarrTier

__all__ = ["s3", "s3_server"]  # the fixtures, imported for pytest

WORKER = Path(__file__).parent / "helpers" / "zarr_dist_worker.py"
STEP = "step-{:012d}"


def rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {
        "big": torch.randn(300, 100, generator=g),  # chunk shards
        "small": torch.randn(7, generator=g),  # packed
        "half": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "rank": rank,
    }


def rank_tiers(make: Callable[[], ZarrTier], world: int) -> list[ZarrTier]:
    """One tier per rank over the same location, as a distributed Checkpointer sets them."""
    tiers = []
    for rank in range(world):
        tier = make()
        tier.bind(rank, world)
        tiers.append(tier)
    return tiers


async def write_part(
    tier: ZarrTier, step: int, *, commit: bool = True
) -> tuple[Manifest, list[bytes]]:
    """Rank ``tier.rank``'s part of ``step``: begin, every shard, and (unless not) its commit."""
    manifest, payloads = build_snapshot(step, rank_state(tier.rank, step))
    manifest = replace(manifest, rank=tier.rank, world_size=tier.world_size)
    await tier.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await tier.put_shard(manifest, shard, memoryview(data))
    if commit:
        await tier.commit(manifest)
    return manifest, payloads


async def read_back(tier: ZarrTier, step: int, rank: int) -> tuple[Manifest, list[bytes]]:
    manifest = await tier.read_rank_manifest(step, rank)
    out = []
    for shard in manifest.shards:
        buf = bytearray(shard.length)
        await tier.read_shard(manifest, shard, memoryview(buf))
        out.append(bytes(buf))
    return manifest, out


@pytest.fixture(params=["path", "s3"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], ZarrTier]:
    if request.param == "path":
        return lambda: ZarrTier(tmp_path / "zarr")
    loc: S3Location = request.getfixturevalue("s3")
    return lambda: ZarrTier(loc.url, **loc.server.tier_options())


# -- the protocol, ranks played in one process ----------------------------------------------------


async def test_parts_become_visible_only_through_rank_0s_commit(
    make_tier: Callable[[], ZarrTier],
) -> None:
    tiers = rank_tiers(make_tier, 3)
    for t in tiers:
        await t.open()
    try:
        written = [await write_part(t, 7) for t in tiers]
        for t in tiers:
            assert await t.steps() == []  # every part is durable, none is visible
        for t in tiers[1:]:
            await t.commit_global(7, 3)
            assert await tiers[0].steps() == []  # the other ranks write nothing
        await tiers[0].commit_global(7, 3)
        await tiers[0].commit_global(7, 3)  # idempotent
        for t in tiers:
            assert await t.steps() == [7]
        for rank, (manifest, payloads) in enumerate(written):
            for reader in tiers:  # every rank reads every part (resharding needs it)
                got, data = await read_back(reader, 7, rank)
                assert got.rank == rank and got.world_size == 3
                assert got.shards == manifest.shards and data == payloads
        assert (await tiers[2].read_manifest(7)).rank == 2
        with pytest.raises(CorruptionError, match="no part of rank 3"):
            await tiers[0].read_rank_manifest(7, 3)
    finally:
        for t in tiers:
            await t.aclose()


async def test_layout_on_a_path(tmp_path: Path) -> None:
    tiers = rank_tiers(lambda: ZarrTier(tmp_path), 2)
    for t in tiers:
        await t.open()
    for t in tiers:
        await write_part(t, 5)
    for t in reversed(tiers):
        await t.commit_global(5, 2)
    for t in tiers:
        await t.aclose()
    step = tmp_path / STEP.format(5)
    assert sorted(p.name for p in step.iterdir()) == ["rank-00000", "rank-00001", "zarr.json"]
    for rank in (0, 1):
        assert sorted(p.name for p in (step / f"rank-{rank:05d}").iterdir()) == [
            "packed",
            "tensors",
            "zarr.json",
        ]
    record = json.loads((step / "zarr.json").read_text())["attributes"]["lazyckpt"]
    assert record == {
        "format_version": lazyckpt.FORMAT_VERSION,
        "step": 5,
        "world_size": 2,
        "parts": "rank-%05d",
    }
    root = json.loads((tmp_path / "zarr.json").read_text())
    assert root["attributes"]["lazyckpt"]["committed"] == [5]


async def test_a_step_a_rank_failed_is_never_listed_and_leaves_nothing(tmp_path: Path) -> None:
    tiers = rank_tiers(lambda: ZarrTier(tmp_path), 2)
    for t in tiers:
        await t.open()
    for t in tiers:
        await write_part(t, 1)
    for t in tiers:
        await t.commit_global(1, 2)
    # step 2: rank 0 commits its part, rank 1 fails half-way; the ranks disagree, nobody
    # writes the commit record, and each aborts its own part
    await write_part(tiers[0], 2)
    await write_part(tiers[1], 2, commit=False)
    for t in tiers:
        assert await t.steps() == [1]
    await tiers[0].abort(2)
    assert (tmp_path / STEP.format(2) / "rank-00001").is_dir()  # rank 1's part is its own
    await tiers[1].abort(2)
    assert not (tmp_path / STEP.format(2)).exists()
    # step 3: every part written, then a crash before the commit: the next open removes it
    for t in tiers:
        await write_part(t, 3)
        await t.aclose()
    again = rank_tiers(lambda: ZarrTier(tmp_path), 2)
    await again[1].open()
    assert (tmp_path / STEP.format(3)).is_dir()  # rank 0 cleans up, not the others
    await again[0].open()
    assert not (tmp_path / STEP.format(3)).exists()
    assert await again[1].steps() == [1]
    _, data = await read_back(again[1], 1, 1)
    assert data == build_snapshot(1, rank_state(1, 1))[1]
    for t in again:
        await t.aclose()


async def test_deleting_a_step_of_several_ranks_is_rank_0s_work(tmp_path: Path) -> None:
    tiers = rank_tiers(lambda: ZarrTier(tmp_path), 2)
    for t in tiers:
        await t.open()
    for step in (1, 2):
        for t in tiers:
            await write_part(t, step)
        for t in tiers:
            await t.commit_global(step, 2)
    await tiers[1].delete(1)  # retention runs on every rank; rank 1's does nothing
    assert await tiers[1].steps() == [1, 2]
    await tiers[0].delete(1)
    assert await tiers[1].steps() == [2]
    assert not (tmp_path / STEP.format(1)).exists()
    assert (tmp_path / STEP.format(2) / "rank-00001" / "zarr.json").exists()
    for t in tiers:
        await t.aclose()


async def committed_steps_of_two_ranks(root: Path, steps: range) -> list[ZarrTier]:
    tiers = rank_tiers(lambda: ZarrTier(root), 2)
    for t in tiers:
        await t.open()
    for step in steps:
        for t in tiers:
            await write_part(t, step)
        for t in tiers:
            await t.commit_global(step, 2)
    return tiers


async def test_a_step_deleted_twice_at_once_is_deleted(tmp_path: Path) -> None:
    """Two deletes of one step at once (retention passes that overlap ask for that) both
    succeed, and nothing else is touched."""
    tiers = await committed_steps_of_two_ranks(tmp_path, range(1, 3))
    await asyncio.gather(tiers[0].delete(1), tiers[0].delete(1))
    assert await tiers[1].steps() == [2]
    assert not (tmp_path / STEP.format(1)).exists()
    _, data = await read_back(tiers[1], 2, 1)
    assert data == build_snapshot(2, rank_state(1, 2))[1]
    for t in tiers:
        await t.aclose()


async def test_a_delete_that_finds_its_step_removed_under_it_succeeds(tmp_path: Path) -> None:
    """The race of two deletes of one step, made exact: the other one removes the whole tree
    between this one seeing it and removing it. Gone is what both wanted."""
    tiers = await committed_steps_of_two_ranks(tmp_path, range(1, 3))
    step = tmp_path / STEP.format(1)

    def the_other_delete(point: str) -> None:
        if point == "zarr.delete_dir.before_remove" and step.exists():
            shutil.rmtree(step)

    hooks.set_hook(the_other_delete)
    try:
        await tiers[0].delete(1)
    finally:
        hooks.set_hook(None)
    assert await tiers[1].steps() == [2] and not step.exists()
    for t in tiers:
        await t.aclose()


class ListsLate(ZarrTier):
    """A ZarrTier whose listings that still hold step 0 (a retention pass about to delete it)
    are slow: what a loaded machine does when that read waits behind the next snapshot's
    writes. Step 2 commits meanwhile; the pass it asks for must not delete step 0 beside
    this one."""

    slow_listings = 0
    deleting = 0
    overlaps = 0

    async def steps(self) -> list[int]:
        found = await super().steps()
        if len(found) >= 2 and found[0] == 0:  # a pass that will delete step 0: slowly
            self.slow_listings += 1
            await asyncio.sleep(0.3)
        return found

    async def delete(self, step: int) -> None:
        self.overlaps += self.deleting > 0
        self.deleting += 1
        try:
            await super().delete(step)
        finally:
            self.deleting -= 1


def test_retention_passes_do_not_overlap_on_a_slow_listing(tmp_path: Path) -> None:
    tier = ListsLate(tmp_path, keep_last=1)
    # no retries: a failed delete is not hidden by a second attempt that finds nothing left
    with SyncCheckpointer([tier], staging_bytes=1 << 20, retries=0) as ckpt:
        for step in range(3):
            ckpt.snapshot(rank_state(0, step), step=step).wait()
    # closing raised nothing: no retention pass failed
    assert tier.slow_listings >= 1 and tier.overlaps == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lazyckpt-writer-rank-00000.lock",  # the writer's lock; the kernel dropped it
        STEP.format(2),
        "zarr.json",
    ]
    with SyncCheckpointer([ZarrTier(tmp_path)], staging_bytes=1 << 20) as ckpt:
        assert ckpt.steps() == [2]
        assert torch.equal(ckpt.restore(2)["big"], rank_state(0, 2)["big"])


async def test_ranks_must_share_the_location(tmp_path: Path) -> None:
    rank0 = ZarrTier(tmp_path / "a")
    rank1 = ZarrTier(tmp_path / "b")  # a location of its own: rank 0 never sees it
    for rank, t in enumerate((rank0, rank1)):
        t.bind(rank, 2)
        await t.open()
    with pytest.raises(ConfigurationError, match="same shared location"):
        await write_part(rank1, 1)
    # a location that rank 1 had from an earlier run passes begin(); commit_global finds out
    await ZarrTier(tmp_path / "b").open()
    await write_part(rank0, 1)
    await write_part(rank1, 1)
    with pytest.raises(ConfigurationError, match="does not see rank 0's part"):
        await rank1.commit_global(1, 2)
    for t in (rank0, rank1):
        await t.aclose()


async def test_one_location_holds_single_and_multi_rank_steps(tmp_path: Path) -> None:
    """A run saved by one process and resumed on two ranks: both layouts side by side."""
    state = rank_state(0, 1)
    with SyncCheckpointer([ZarrTier(tmp_path)], staging_bytes=1 << 20) as ckpt:
        ckpt.snapshot(state, step=1).wait()
    tiers = rank_tiers(lambda: ZarrTier(tmp_path), 2)
    for t in tiers:
        await t.open()
        await write_part(t, 2)
    for t in tiers:
        await t.commit_global(2, 2)
    assert await tiers[1].steps() == [1, 2]
    single = await tiers[1].read_manifest(1)  # one manifest, whichever rank asks
    assert single.world_size == 1 and single.rank == 0
    assert not (tmp_path / STEP.format(1) / "rank-00000").exists()  # the old layout
    for t in tiers:
        await t.aclose()
    with SyncCheckpointer([ZarrTier(tmp_path)], staging_bytes=1 << 20) as ckpt:
        restored = ckpt.restore(1)
    assert torch.equal(restored["big"], state["big"])


def test_plain_zarr_reads_every_rank_part(tmp_path: Path) -> None:
    import asyncio

    async def write() -> None:
        tiers = rank_tiers(lambda: ZarrTier(tmp_path), 2)
        for t in tiers:
            await t.open()
            await write_part(t, 4)
        for t in tiers:
            await t.commit_global(4, 2)
            await t.aclose()

    asyncio.run(write())
    # what docs/zarr.md shows for several ranks: plain zarr, no lazyckpt
    root = zarr.open_group(tmp_path, mode="r")
    snap = root[f"step-{root.attrs['lazyckpt']['committed'][-1]:012d}"]
    world = snap.attrs["lazyckpt"]["world_size"]
    for rank in range(world):
        part = snap[f"rank-{rank:05d}"]
        want = rank_state(rank, 4)
        big = part[part.attrs["lazyckpt"]["arrays"]["big"]]
        assert np.array_equal(big[:], want["big"].numpy())
        e = part["packed"].attrs["lazyckpt"]["index"]["small"]
        small = part["packed"][e["offset"] : e["offset"] + e["nbytes"]].view(e["data_type"])
        assert np.array_equal(small, want["small"].numpy())
    assert sorted(name for name, _ in snap.groups()) == ["rank-00000", "rank-00001"]


# -- real ranks -----------------------------------------------------------------------------------


def launch(
    scenario: str, location: str, out: Path, world: int, **kw: Any
) -> dict[int, dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    launch_ranks(WORKER, [scenario, location, str(out)], world, timeout=90, **kw)
    return rank_results(out)


def test_two_ranks_save_retain_and_restore_bit_exact(tmp_path: Path) -> None:
    root = tmp_path / "zarr"
    res = launch("save", str(root), tmp_path / "out", 2)
    assert sorted(res) == [0, 1]
    for r in res.values():
        assert r["zarr_steps"] == [2, 3]  # keep_last=2, applied by rank 0 for everyone
        assert r["restored_step"] == 3 and r["restored_ok"]
    assert sorted(p.name for p in root.iterdir()) == [
        ".lazyckpt-writer-rank-00000.lock",  # one writer's lock per rank
        ".lazyckpt-writer-rank-00001.lock",
        STEP.format(2),
        STEP.format(3),
        "zarr.json",
    ]
    assert sorted(p.name for p in (root / STEP.format(3)).iterdir()) == [
        "rank-00000",
        "rank-00001",
        "zarr.json",
    ]


def test_a_killed_rank_never_commits_and_the_previous_step_restores(tmp_path: Path) -> None:
    root = tmp_path / "zarr"
    out = tmp_path / "out"
    out.mkdir()
    codes = launch_ranks(WORKER, ["kill", str(root), str(out)], 2, timeout=90, may_be_killed=True)
    assert codes == [0, -signal.SIGKILL]
    (error,) = rank_results(out)[0]["errors"]
    assert error["step"] == 2 and "DeadlineExceededError" in error["types"]
    index = json.loads((root / "zarr.json").read_text())["attributes"]["lazyckpt"]
    assert index["committed"] == [0, 1]
    assert not (root / STEP.format(2) / "zarr.json").exists()
    # a restarted job agrees on step 1, restores it bit for bit, and rank 0 swept step 2
    for r in launch("restore", str(root), tmp_path / "again", 2).values():
        assert r["steps"] == [0, 1]
        assert r["restored_step"] == 1 and r["restored_ok"]
    assert not (root / STEP.format(2)).exists()


def test_dtensor_state_reshards_through_zarr(tmp_path: Path) -> None:
    root = tmp_path / "zarr"
    out = tmp_path / "out"
    res = launch("dtensor", str(root), out, 2)
    for r in res.values():
        assert r["steps"] == [1]
        assert r["mismatch"] == []  # 2 ranks -> 2 ranks, every tensor in a new sharding
    step = root / STEP.format(1)
    attrs = [
        json.loads((step / f"rank-{r:05d}" / "zarr.json").read_text())["attributes"]["lazyckpt"]
        for r in (0, 1)
    ]
    # the Replicate tensor is written once; the other rank names the writer's part
    holders = [a for a in attrs if "c" in a["arrays"]]
    assert len(holders) == 1
    other = next(a for a in attrs if a is not holders[0])
    assert other["replicas"]["c"] == f"rank-{holders[0]['rank']:05d}"
    # where each rank's chunk of a sharded tensor lies, for a plain reader to reassemble it
    part = zarr.open_group(step / "rank-00001", mode="r")
    b = part[attrs[1]["arrays"]["b"]].attrs["lazyckpt"]
    assert (b["global_shape"], b["global_offset"], b["placements"]) == (
        [10, 1030],
        [0, 515],
        ["shard(1)"],
    )
    a = part["packed"].attrs["lazyckpt"]["index"]["a"]  # 18 rows of 24 floats: packed
    assert (a["global_shape"], a["global_offset"]) == ([37, 24], [19, 0])
    # plain zarr puts the Shard(1) tensor back together from the parts (docs/zarr.md)
    expected = torch.load(out / "expected.pt")
    snap = zarr.open_group(step, mode="r")
    whole = np.empty(b["global_shape"], dtype=np.uint16)  # bfloat16, stored as uint16
    for rank in range(snap.attrs["lazyckpt"]["world_size"]):
        arr = snap[f"rank-{rank:05d}"]["tensors/b"]
        lo = arr.attrs["lazyckpt"]["global_offset"]
        whole[tuple(slice(o, o + n) for o, n in zip(lo, arr.shape, strict=True))] = arr[:]
    assert np.array_equal(whole, expected["b"].view(torch.uint16).numpy())
    # 2 ranks -> 1 process: full tensors, assembled from both parts
    with lazyckpt.SyncCheckpointer([ZarrTier(root)], staging_bytes=1 << 20) as ckpt:
        state = ckpt.restore(1)
    got = {k: state[k] for k in ("a", "b", "c")}
    got.update({f"model/{k}": v for k, v in state["model"].items()})
    got.update(
        {f"optim/{i}/{n}": v for i, s in state["optim"]["state"].items() for n, v in s.items()}
    )
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(
            got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        ), k


async def test_a_lost_index_is_rebuilt_from_complete_steps_of_several_ranks(
    make_tier: Callable[[], ZarrTier],
) -> None:
    """Rebuilding a lost index checks every rank's part: a step that lost one object of
    rank 1's part (a delete that stopped part way) is left out, the complete one listed."""
    tiers = rank_tiers(make_tier, 2)
    for t in tiers:
        await t.open()
    try:
        for step in (3, 4):
            for t in tiers:
                await write_part(t, step)
            await tiers[0].commit_global(step, 2)
        store = tiers[0]._store
        part = f"{await indexed_group(store, 3)}/rank-00001/"
        victim = sorted([k async for k in store.list_prefix(part) if "/c/" in k])[-1]
        await store.delete(victim)
        await store.delete("zarr.json")
    finally:
        for t in tiers:
            await t.aclose()
    tiers = rank_tiers(make_tier, 2)
    await tiers[0].open()
    try:
        assert await tiers[0].steps() == [4]
        assert await read_back(tiers[0], 4, 1)
    finally:
        await tiers[0].aclose()
