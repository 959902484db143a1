"""FileTier specifics beyond the conformance suite: O_DIRECT selection and its fallback, and
how it guards its directory (foreign locations, read-only opens, one writer)."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import lazyckpt
import lazyckpt.testing
import tiers.file.tier as file_module
from lazyckpt import TierError
from tiers import FileTier, HostMemoryTier

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096, "retries": 0}


async def roundtrip(tier: FileTier) -> dict[str, torch.Tensor]:
    state = {"w": torch.randn(300, 77), "b": torch.randn(5)}
    async with lazyckpt.Checkpointer([HostMemoryTier(4 << 20), tier], **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    async with lazyckpt.Checkpointer([FileTier(tier.root)]) as fresh:
        restored = await fresh.restore()
    for key in state:
        assert torch.equal(restored[key], state[key])
    return state


@pytest.mark.parametrize("direct", [None, True, False])
async def test_every_mode_round_trips(tmp_path: Path, direct: bool | None) -> None:
    await roundtrip(FileTier(tmp_path, direct=direct))
    data = tmp_path / "step-000000000001" / "rank-00000.data"
    manifest = lazyckpt.Manifest.from_json((data.parent / "manifest.json").read_bytes())
    assert data.stat().st_size == manifest.stream_bytes  # O_DIRECT padding truncated away


async def test_auto_falls_back_where_o_direct_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(fd: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(file_module, "probe_direct", refuse)
    await roundtrip(FileTier(tmp_path / "auto"))  # buffered, silently
    with pytest.raises(lazyckpt.SnapshotFailedError) as info:
        await roundtrip(FileTier(tmp_path / "forced", direct=True))
    assert info.group_contains(TierError)


async def test_delete_reports_real_failures_and_tolerates_a_vanished_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = FileTier(tmp_path / "f")
    async with lazyckpt.Checkpointer([HostMemoryTier(4 << 20), tier], **SMALL) as ckpt:
        for step in (1, 2):
            await (await ckpt.snapshot({"w": torch.randn(64, 64)}, step=step)).committed()
        real_unlink = os.unlink

        def failing_unlink(path: object, *args: object, **kwargs: object) -> None:
            if str(path).endswith(".data"):
                raise OSError(errno.EIO, "injected I/O error")
            real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "unlink", failing_unlink)
        with pytest.raises(TierError):
            await tier.delete(1)  # the data file could not go: reported, not hidden
        monkeypatch.setattr(os, "unlink", real_unlink)
        assert 1 not in await tier.steps()  # un-committed first, as always
        await tier.delete(1)  # the rest goes now
        await tier.delete(1)  # and a step already gone is no error
        assert not (tmp_path / "f" / "step-000000000001").exists()
        assert await tier.steps() == [2]


async def test_ranks_racing_to_remove_a_shared_step_get_a_warning_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tier = FileTier(tmp_path / "f")
    async with lazyckpt.Checkpointer([HostMemoryTier(4 << 20), tier], **SMALL) as ckpt:
        for step in (1, 2):
            await (await ckpt.snapshot({"w": torch.randn(8, 8)}, step=step)).committed()

        def racing(path: Path) -> None:
            raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))

        monkeypatch.setattr(file_module, "remove_flat", racing)
        with pytest.raises(TierError):
            await tier.delete(1)  # one process: a real failure, reported
        tier.bind(0, 2)  # several ranks sharing the directory: another may be removing it
        await tier.delete(2)
        assert "left files behind" in caplog.text


# -- guarding the location -----------------------------------------------------------------------


def tree(root: Path) -> list[tuple[str, int]]:
    """Every file under ``root`` with its size."""
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()
    )


async def test_a_zarr_tiers_snapshots_survive_a_file_tier(tmp_path: Path) -> None:
    from tiers import ZarrTier

    state = {"w": torch.randn(300, 77)}
    async with lazyckpt.Checkpointer([ZarrTier(tmp_path)], staging_bytes=1 << 20, **SMALL) as c:
        for step in (1, 2):
            await (await c.snapshot(state, step=step)).committed()
    before = tree(tmp_path)
    for readonly in (False, True):  # a writer, and a restore-only open
        with pytest.raises(lazyckpt.ForeignLocationError, match="Zarr") as caught:
            async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=readonly)]):
                pass
        assert str(tmp_path) in str(caught.value) and caught.value.location == str(tmp_path)
    assert tree(tmp_path) == before
    async with lazyckpt.Checkpointer([ZarrTier(tmp_path, readonly=True)]) as c:
        assert await c.steps() == [1, 2]
        assert torch.equal((await c.restore())["w"], state["w"])


async def write_then_die(root: Path, committed: int, torn: int) -> dict[str, torch.Tensor]:
    """Commit ``committed``; leave ``torn`` half written, as a killed writer would."""
    state = {"w": torch.randn(300, 77)}
    async with lazyckpt.Checkpointer([FileTier(root)], staging_bytes=1 << 20, **SMALL) as c:
        await (await c.snapshot(state, step=committed)).committed()
    manifest, payloads = lazyckpt.testing.build_snapshot(torn, state, shard_size=1 << 16)
    tier = FileTier(root)
    await tier.open()
    await tier.begin(manifest)
    await tier.put_shard(manifest, manifest.shards[0], memoryview(payloads[0]))
    await tier.aclose()
    return state


async def test_restore_only_open_changes_nothing(tmp_path: Path) -> None:
    state = await write_then_die(tmp_path, 1, 2)
    before = tree(tmp_path)
    assert "step-000000000002/rank-00000.data" in dict(before)
    async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as c:
        assert await c.steps() == [1]
        assert torch.equal((await c.restore())["w"], state["w"])
    assert tree(tmp_path) == before  # the torn step too: only a writer sweeps it
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], staging_bytes=1 << 20) as c:
        assert await c.steps() == [1]
    assert not (tmp_path / "step-000000000002").exists()


async def test_restore_only_open_of_a_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "not" / "there"
    with pytest.raises(lazyckpt.SnapshotNotFoundError, match=re.escape(str(missing))):
        async with lazyckpt.Checkpointer([FileTier(missing, readonly=True)]):
            pass
    assert not (tmp_path / "not").exists()


async def test_a_root_that_is_a_file_is_named(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.write_text("not a directory")
    for readonly in (False, True):
        tier = FileTier(root, readonly=readonly)
        with pytest.raises(lazyckpt.ConfigurationError, match=re.escape(f"{root} is a file")):
            await tier.open()
        await tier.aclose()
    assert root.read_text() == "not a directory"


async def test_errors_name_their_path(tmp_path: Path) -> None:
    tier = FileTier(tmp_path)
    await tier.open()
    try:
        blocker = tmp_path / "step-000000000005"
        blocker.write_text("in the way")  # the step's directory cannot be made
        manifest, _ = lazyckpt.testing.build_snapshot(5, {"w": torch.randn(10)})
        with pytest.raises(TierError, match=re.escape(str(blocker))):
            await tier.begin(manifest)
    finally:
        await tier.aclose()


async def test_files_it_did_not_write_are_refused_not_deleted(tmp_path: Path) -> None:
    # an unmarked directory holding something else besides what looks like a torn step
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-000000000003").mkdir()
    (tmp_path / "step-000000000003" / "rank-00000.data").write_bytes(b"x" * 10)
    before = tree(tmp_path)
    with pytest.raises(lazyckpt.ForeignLocationError, match=r"notes\.txt"):
        await FileTier(tmp_path).open()
    assert tree(tmp_path) == before
    # a file tier's own directory whose uncommitted step holds a file it never writes
    root = tmp_path / "run"
    await write_then_die(root, 1, 2)
    (root / "step-000000000002" / "keep.me").write_text("not lazyckpt's")
    before = tree(root)
    with pytest.raises(lazyckpt.ForeignLocationError, match=r"keep\.me"):
        await FileTier(root).open()
    assert tree(root) == before


async def test_a_directory_from_before_the_marker_is_adopted(tmp_path: Path) -> None:
    state = await write_then_die(tmp_path, 1, 2)
    (tmp_path / "lazyckpt-file.json").unlink()  # as an earlier version left it
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], staging_bytes=1 << 20) as c:
        assert torch.equal((await c.restore())["w"], state["w"])
    assert (tmp_path / "lazyckpt-file.json").exists()
    assert not (tmp_path / "step-000000000002").exists()  # its torn step was this layout


HOLDER = """
import asyncio, sys
from tiers import FileTier

async def main():
    tier = FileTier(sys.argv[1])
    await tier.open()
    print("ready", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_one_writer_per_directory(tmp_path: Path) -> None:
    state = await write_then_die(tmp_path, 1, 2)
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER, str(tmp_path), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and await holder.stdout.readline() == b"ready\n"
        with pytest.raises(lazyckpt.LocationInUseError) as caught:
            async with lazyckpt.Checkpointer([FileTier(tmp_path)], staging_bytes=1 << 20):
                pass
        error = caught.value
        assert error.holder is not None and error.holder["pid"] == holder.pid
        assert f"process {holder.pid}" in str(error) and str(tmp_path) in str(error)
        # a reader works beside the writer
        async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as c:
            assert torch.equal((await c.restore())["w"], state["w"])
    finally:
        holder.send_signal(signal.SIGKILL)  # a killed writer never blocks the next
        await holder.wait()
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], staging_bytes=1 << 20) as c:
        await (await c.snapshot(state, step=3)).committed()
        assert await c.steps() == [1, 3]


def test_cli_reads_beside_a_writer_and_gc_waits_its_turn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lazyckpt.cli import main

    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)], staging_bytes=1 << 20, **SMALL) as c:
        for step in (1, 2, 3):
            c.snapshot({"w": torch.full((4,), float(step))}, step=step).wait()
        assert main(["ls", str(tmp_path)]) == 0  # a reader beside the writer
        assert main(["verify", str(tmp_path), "--all", "-q"]) == 0
        # gc deletes: a second writer, refused while the first is open
        assert main(["gc", str(tmp_path), "--keep-last", "1"]) == 2
        assert f"{tmp_path} is being written by process {os.getpid()}" in capsys.readouterr().err
        assert [p.name for p in sorted(tmp_path.glob("step-*"))] == [
            "step-000000000001",
            "step-000000000002",
            "step-000000000003",
        ]
    assert main(["gc", str(tmp_path), "--keep-last", "1"]) == 0  # its turn now
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000000000003"]


@pytest.mark.parametrize("kind", ["file", "zarr"])
async def test_one_lock_per_rank(tmp_path: Path, kind: str) -> None:
    """The ranks of one job write beside each other; a second job's rank is refused."""

    def rank(r: int) -> lazyckpt.Tier:
        tier = lazyckpt.load_tier(kind, str(tmp_path))
        tier.bind(r, 2)
        return tier

    ranks = [rank(0), rank(1)]
    for tier in ranks:
        await tier.open()
    try:
        intruder = rank(1)
        with pytest.raises(lazyckpt.LocationInUseError, match="rank-00001"):
            await intruder.open()
        await intruder.aclose()
    finally:
        for tier in ranks:
            await tier.aclose()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".lazyckpt-writer")) == [
        ".lazyckpt-writer-rank-00000.lock",
        ".lazyckpt-writer-rank-00001.lock",
    ]


async def test_a_reader_opens_while_the_writer_removes_a_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's open looks into each step directory; the writer beside it (retention, an
    abort) may remove one between the listing of the root and that look. The reader must
    open all the same: readers work beside a writer."""
    await write_then_die(tmp_path, 1, 2)
    doomed = tmp_path / "step-000000000002"
    listdir = Path.iterdir

    def removed_first(self: Path) -> Iterator[Path]:
        if self == doomed and doomed.exists():
            shutil.rmtree(doomed)  # the writer, between the reader's two listings
        return listdir(self)

    monkeypatch.setattr(Path, "iterdir", removed_first)
    tier = FileTier(tmp_path, readonly=True)
    await tier.open()
    try:
        assert await tier.steps() == [1]
    finally:
        await tier.aclose()


async def test_manifest_reads_never_queue_behind_the_bulk_writes(tmp_path: Path) -> None:
    """Manifests are read with aiofiles, off the tier's bounded I/O pool: with that pool
    busy (a long data write), reading a committed step's manifest still answers."""
    await write_then_die(tmp_path, 1, 2)
    tier = FileTier(tmp_path, io_threads=1)
    await tier.open()
    busy, release = threading.Event(), threading.Event()

    def long_write() -> None:
        busy.set()
        release.wait(30)

    blocked = asyncio.ensure_future(tier._run("a long write", long_write))
    try:
        await asyncio.to_thread(busy.wait, 10)
        manifest = await asyncio.wait_for(tier.read_manifest(1), 10)
        assert manifest.step == 1
    finally:
        release.set()
        await blocked
        await tier.aclose()


@pytest.mark.parametrize(("kind", "other"), [("file", "zarr"), ("zarr", "file")])
async def test_every_rank_refuses_a_foreign_location_unchanged(
    tmp_path: Path, kind: str, other: str
) -> None:
    """Not only rank 0: a rank that does not clean up still must not put its lock file (or
    anything) into a location another kind of tier wrote."""
    async with lazyckpt.Checkpointer(
        [lazyckpt.load_tier(other, str(tmp_path))], staging_bytes=1 << 20, **SMALL
    ) as c:
        await (await c.snapshot({"w": torch.randn(300, 77)}, step=1)).committed()
    before = tree(tmp_path)
    hidden = sorted(os.listdir(tmp_path))
    tier = lazyckpt.load_tier(kind, str(tmp_path))
    tier.bind(1, 2)
    with pytest.raises(lazyckpt.ForeignLocationError):
        await tier.open()
    await tier.aclose()
    assert tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == hidden
