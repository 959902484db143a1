"""How ZarrTier guards its location: another store's location is refused untouched, a lost
index is rebuilt from the commit records that verify (never answered by deletion), read-only
opens change nothing, one writer per location (a lease on S3), and missing buckets are named."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest_s3 import S3Location, s3, s3_server

import lazyckpt
from lazyckpt import (
    ConfigurationError,
    CorruptionError,
    ForeignLocationError,
    LocationInUseError,
    SnapshotNotFoundError,
)
from lazyckpt.testing import build_snapshot
from tiers import FileTier, ZarrTier
from tiers.zarr.store import DurableLocalStore

__all__ = ["s3", "s3_server"]  # the fixtures, imported for pytest

SMALL = {"staging_bytes": 1 << 20, "shard_size": 64 << 10, "pack_bytes": 4 << 10}


def tree(root: Path) -> list[tuple[str, int]]:
    """Every file under ``root`` with its size: what a refused open must leave alone."""
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()
    )


def state_of(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 77, generator=g), "small": torch.randn(9, generator=g)}


async def write(
    make: Callable[[], lazyckpt.Tier], steps: list[int], torn: int | None = None
) -> None:
    """Commit ``steps``, then leave ``torn`` half written, as a killed writer would."""
    async with lazyckpt.Checkpointer([make()], **SMALL) as c:
        for step in steps:
            await (await c.snapshot(state_of(step), step=step)).committed()
    if torn is not None:
        tier = make()
        await tier.open()
        manifest, payloads = build_snapshot(torn, state_of(torn), shard_size=64 << 10)
        await tier.begin(manifest)
        await tier.put_shard(manifest, manifest.shards[0], memoryview(payloads[0]))
        await tier.aclose()


async def restored_step(tier: lazyckpt.Tier) -> int:
    async with lazyckpt.Checkpointer([tier]) as c:
        step = (await c.steps())[-1]
        state = await c.restore()
    expected = state_of(step)
    assert all(torch.equal(state[k], expected[k]) for k in expected)  # type: ignore[arg-type]
    return step


async def test_a_file_tiers_snapshots_survive_a_zarr_tier(tmp_path: Path) -> None:
    await write(lambda: FileTier(tmp_path), [1, 2], torn=3)
    before = tree(tmp_path)
    for readonly in (False, True):
        tier = ZarrTier(tmp_path, readonly=readonly)
        with pytest.raises(ForeignLocationError, match="FileTier") as caught:
            await tier.open()
        await tier.aclose()
        assert caught.value.location == str(tmp_path)
    assert tree(tmp_path) == before
    assert await restored_step(FileTier(tmp_path, readonly=True)) == 2


async def test_a_lost_index_is_rebuilt_not_answered_by_deletion(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await write(lambda: ZarrTier(tmp_path), [1, 2, 3], torn=4)
    (tmp_path / "zarr.json").unlink()  # a user's rm, a half-copied tree
    before = tree(tmp_path)
    assert any(name.startswith("step-000000000004/") for name, _ in before)

    reader = ZarrTier(tmp_path, readonly=True)  # a reader rebuilds nothing, deletes nothing
    with pytest.raises(CorruptionError, match="rebuild"):
        await reader.open()
    await reader.aclose()
    assert tree(tmp_path) == before

    caplog.set_level(logging.WARNING, logger="lazyckpt")
    writer = ZarrTier(tmp_path)
    await writer.open()
    try:
        assert await writer.steps() == [1, 2, 3]
    finally:
        await writer.aclose()
    assert "rebuilt it from the 3 of 4 step groups" in caplog.text
    assert (tmp_path / "step-000000000004").is_dir()  # left in place on that open
    assert await restored_step(ZarrTier(tmp_path)) == 3
    # with the index back, the torn step is an ordinary leftover, swept by the next writer
    assert not (tmp_path / "step-000000000004").exists()


async def test_a_lost_index_beside_a_damaged_commit_record_is_refused(tmp_path: Path) -> None:
    await write(lambda: ZarrTier(tmp_path), [1, 2])
    (tmp_path / "zarr.json").unlink()
    (tmp_path / "step-000000000002" / "zarr.json").write_text('{"zarr_format": 3')
    before = tree(tmp_path)
    tier = ZarrTier(tmp_path)
    with pytest.raises(CorruptionError, match="step 2 was committed cannot be verified"):
        await tier.open()
    await tier.aclose()
    assert tree(tmp_path) == before


async def test_a_leftover_holding_what_zarr_tier_never_writes_is_kept(tmp_path: Path) -> None:
    await write(lambda: ZarrTier(tmp_path), [1], torn=2)
    (tmp_path / "step-000000000002" / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    tier = ZarrTier(tmp_path)
    with pytest.raises(ForeignLocationError, match=r"notes\.txt"):
        await tier.open()
    await tier.aclose()
    assert tree(tmp_path) == before


async def test_restore_only_open_changes_nothing(tmp_path: Path) -> None:
    await write(lambda: ZarrTier(tmp_path), [1], torn=2)
    before = tree(tmp_path)
    assert await restored_step(ZarrTier(tmp_path, readonly=True)) == 1
    assert tree(tmp_path) == before  # the torn step too: only a writer sweeps it
    missing = tmp_path / "elsewhere"
    with pytest.raises(SnapshotNotFoundError, match=re.escape(str(missing))):
        async with lazyckpt.Checkpointer([ZarrTier(missing, readonly=True)]):
            pass
    assert not missing.exists()


async def test_a_location_that_is_a_file_is_named(tmp_path: Path) -> None:
    where = tmp_path / "run"
    where.write_text("not a directory")
    tier = ZarrTier(where)
    with pytest.raises(ConfigurationError, match=re.escape(f"{where} is a file")):
        await tier.open()
    await tier.aclose()


# -- S3 ------------------------------------------------------------------------------------------


async def test_a_missing_bucket_is_named(s3: S3Location) -> None:
    url = "s3://no-such-bucket-here/run"
    writer = ZarrTier(url, **s3.server.tier_options())
    with pytest.raises(ConfigurationError, match="'no-such-bucket-here' does not exist"):
        await writer.open()
    await writer.aclose()
    with pytest.raises(SnapshotNotFoundError, match="'no-such-bucket-here' does not exist"):
        async with lazyckpt.Checkpointer(
            [ZarrTier(url, readonly=True, **s3.server.tier_options())]
        ):
            pass
    buckets = {b["Name"] for b in s3.server.client().list_buckets()["Buckets"]}
    assert "no-such-bucket-here" not in buckets


async def test_one_writer_per_s3_location_by_lease(s3: S3Location) -> None:
    options = {**s3.server.tier_options(), "lease_seconds": 1.0}
    first = ZarrTier(s3.url, **options)
    await first.open()
    try:
        second = ZarrTier(s3.url, **options)
        with pytest.raises(LocationInUseError) as caught:
            await second.open()
        await second.aclose()
        assert caught.value.holder is not None and caught.value.holder["pid"] == os.getpid()
        assert "token" not in caught.value.holder
        assert s3.url in str(caught.value)
        await write_one(first, 1)  # the holder goes on

        # the first writer stalls past its lease (as a killed one would): the next takes over
        await asyncio.sleep(1.2)
        third = ZarrTier(s3.url, **options)
        await third.open()
        try:
            with pytest.raises(LocationInUseError, match="took the location over"):
                await write_one(first, 2)  # the stale writer stops before writing anything
            await write_one(third, 2)
            assert await third.steps() == [1, 2]
        finally:
            await third.aclose()
    finally:
        await first.aclose()
    lease = f"{s3.prefix}/.lazyckpt-writer-rank-00000.json"
    listed = s3.keys()
    assert lease not in listed  # the holder released it; the stale writer left it alone


async def write_one(tier: ZarrTier, step: int) -> None:
    manifest, payloads = build_snapshot(step, state_of(step), shard_size=64 << 10)
    await tier.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await tier.put_shard(manifest, shard, memoryview(data))
    await tier.commit(manifest)


async def test_a_lost_s3_index_is_rebuilt(s3: S3Location) -> None:
    options = s3.server.tier_options()
    await write(lambda: ZarrTier(s3.url, **options), [1, 2])
    client = s3.server.client()
    client.delete_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/zarr.json")
    tier = ZarrTier(s3.url, **options)
    await tier.open()
    try:
        assert await tier.steps() == [1, 2]
    finally:
        await tier.aclose()
    body = client.get_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/zarr.json")["Body"]
    assert json.loads(body.read())["attributes"]["lazyckpt"]["committed"] == [1, 2]


def test_cli_reads_create_nothing(
    tmp_path: Path, s3: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lazyckpt.cli import EXIT_NOT_FOUND, main

    missing = tmp_path / "nothing-here"
    assert main(["ls", f"zarr+file://{missing}"]) == EXIT_NOT_FOUND
    assert not missing.exists()
    options = s3.server.tier_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_REGION", options["region"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert main(["ls", "s3://no-such-bucket-here/run"]) == EXIT_NOT_FOUND
    buckets = {b["Name"] for b in s3.server.client().list_buckets()["Buckets"]}
    assert "no-such-bucket-here" not in buckets


@pytest.mark.parametrize(
    "stalls_at",
    [
        # step 5's commit record, in its group (named after the writer's token, or plainly)
        pytest.param(r"step-000000000005(-[0-9a-f]{16})?/zarr\.json", id="the-commit-record"),
        pytest.param(r"zarr\.json", id="the-index"),
    ],
)
async def test_a_writer_that_stalls_past_its_lease_mid_commit_commits_nothing(
    s3: S3Location, monkeypatch: pytest.MonkeyPatch, stalls_at: str
) -> None:
    """The stale writer passed its lease check, then stalled (before the commit record, or
    between reading and writing the index) while a new writer took over and swept the
    stale one's uncommitted step: its commit must fail, and no index may list that step."""
    import obstore

    options = {**s3.server.tier_options(), "lease_seconds": 1.0}
    first = ZarrTier(s3.url, **options)
    await first.open()
    manifest, payloads = build_snapshot(5, state_of(5), shard_size=64 << 10)
    await first.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await first.put_shard(manifest, shard, memoryview(data))

    stalled, resume = asyncio.Event(), asyncio.Event()
    put = obstore.put_async
    stale_store = first._backend_store

    async def slow_put(store: object, key: str, *args: object, **kwargs: object) -> object:
        if store is stale_store and re.fullmatch(stalls_at, key) and not resume.is_set():
            stalled.set()
            await resume.wait()
        return await put(store, key, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(obstore, "put_async", slow_put)
    commit = asyncio.create_task(first.commit(manifest))
    await stalled.wait()
    await asyncio.sleep(1.2)  # the lease runs out while the writer is stalled
    second = ZarrTier(s3.url, **options)
    await second.open()  # takes the location over and sweeps step 5, which is uncommitted
    try:
        resume.set()
        with pytest.raises(LocationInUseError):
            await commit
        with pytest.raises(LocationInUseError):  # and it stays stopped
            await write_one(first, 7)
        assert await second.steps() == []
        await write_one(second, 6)  # the new writer goes on
        assert await second.steps() == [6]
    finally:
        await second.aclose()
        await first.aclose()
    reader = ZarrTier(s3.url, readonly=True, **s3.server.tier_options())
    await reader.open()
    try:
        assert await reader.steps() == [6]
    finally:
        await reader.aclose()


async def test_a_lost_index_never_lists_a_step_whose_data_is_incomplete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A delete that crashed part way (the index already updated, some objects gone, the
    step's commit record still there) and then a lost index: the rebuilt index must not
    list the step whose data is incomplete."""
    await write(lambda: ZarrTier(tmp_path), [1, 2, 3])
    chunks = sorted((tmp_path / "step-000000000002" / "tensors").rglob("c/*/*"))
    assert chunks
    chunks[-1].unlink()  # one chunk of step 2 gone, its zarr.json (the record) still there
    (tmp_path / "zarr.json").unlink()
    caplog.set_level(logging.WARNING, logger="lazyckpt")
    writer = ZarrTier(tmp_path)
    await writer.open()
    try:
        assert await writer.steps() == [1, 3]
    finally:
        await writer.aclose()
    assert "step-000000000002" in caplog.text
    assert (tmp_path / "step-000000000002").is_dir()  # left in place on that open
    assert await restored_step(ZarrTier(tmp_path, readonly=True)) == 3


async def test_a_writer_that_lost_its_lease_deletes_nothing_of_the_new_ones(
    s3: S3Location,
) -> None:
    """The stale writer gives up its step (the engine aborts it) while the writer that took
    over writes the same step number, as a restarted job does: the abort must not remove
    the new writer's objects, or the new writer would commit a step without its data."""
    options = {**s3.server.tier_options(), "lease_seconds": 1.0}
    first = ZarrTier(s3.url, **options)
    await first.open()
    manifest, payloads = build_snapshot(5, state_of(5), shard_size=64 << 10)
    await first.begin(manifest)
    await first.put_shard(manifest, manifest.shards[0], memoryview(payloads[0]))
    await asyncio.sleep(1.2)  # stalled past its lease
    second = ZarrTier(s3.url, **options)
    await second.open()
    try:
        manifest, payloads = build_snapshot(5, state_of(5), shard_size=64 << 10)
        await second.begin(manifest)
        for shard, data in zip(manifest.shards, payloads, strict=True):
            await second.put_shard(manifest, shard, memoryview(data))
        await first.abort(5)  # the stale writer cleans up after its failure
        await second.commit(manifest)
        assert await second.steps() == [5]
    finally:
        await second.aclose()
        await first.aclose()
    assert await restored_step(ZarrTier(s3.url, readonly=True, **s3.server.tier_options())) == 5


async def test_index_and_manifest_reads_never_queue_behind_the_bulk_writes(
    tmp_path: Path,
) -> None:
    """On a path, the index and the commit records are read with aiofiles, off the store's
    bounded pool: with that pool busy (chunk writes), listing and reading a manifest answer."""
    await write(lambda: ZarrTier(tmp_path), [1])
    tier = ZarrTier(tmp_path, io_threads=1)
    await tier.open()
    store = tier._store
    assert isinstance(store, DurableLocalStore)
    busy, release = threading.Event(), threading.Event()

    def long_write() -> None:
        busy.set()
        release.wait(30)

    blocked = asyncio.ensure_future(store._run(long_write))
    try:
        await asyncio.to_thread(busy.wait, 10)
        assert await asyncio.wait_for(tier.steps(), 10) == [1]
        assert (await asyncio.wait_for(tier.read_manifest(1), 10)).step == 1
    finally:
        release.set()
        await blocked
        await tier.aclose()


async def test_closing_a_writer_whose_lease_ran_out_leaves_the_takers_lease(
    s3: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer idle past its lease closes while another tries to take the location over,
    the taker getting in right before the close deletes the lease object (if it can get in
    then at all): never may two later writers both hold the location, as they would if the
    close deleted the taker's lease."""
    import obstore

    options = {**s3.server.tier_options(), "lease_seconds": 1.0}
    first = ZarrTier(s3.url, **options)
    await first.open()
    await asyncio.sleep(1.2)  # idle past its lease
    second, third = ZarrTier(s3.url, **options), ZarrTier(s3.url, **options)
    delete = obstore.delete_async
    stale_store = first._backend_store

    async def taker_first(store: object, key: object, *args: object) -> None:
        if store is stale_store and not second._leased:
            with contextlib.suppress(LocationInUseError):
                await second.open()
        await delete(store, key, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(obstore, "delete_async", taker_first)
    await first.aclose()
    try:
        with contextlib.suppress(LocationInUseError):
            await third.open()
        assert not (second._leased and third._leased), "two writers hold the location"
    finally:
        await third.aclose()
        await second.aclose()
