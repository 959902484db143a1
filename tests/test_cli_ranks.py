"""The ``lazyckpt`` command on steps written by several ranks: copy moves every rank's part
and the commit record (or refuses), verify checks every part and names the damaged rank,
ls and inspect count every rank, export writes whole (global) tensors.

The quick tests play two ranks in one process (one FileTier per rank over the same
directory, as ``tests/test_zarr_multirank.py`` does for ZarrTier); the slow ones run two
real ranks (gloo on loopback) saving FSDP2 and DTensor state."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from conftest_s3 import S3Location, s3, s3_server

import lazyckpt
from lazyckpt import ConfigurationError, Manifest
from lazyckpt.cli._console import Console
from lazyckpt.cli._location import Location, open_location
from lazyckpt.cli._status import EXIT_DAMAGE, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from lazyckpt.testing import build_snapshot
from tiers import FileTier, HostMemoryTier, ZarrTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import launch_ranks

__all__ = ["s3", "s3_server"]  # the fixtures, imported for pytest

DTENSOR_WORKER = Path(__file__).parent / "helpers" / "dtensor_worker.py"
WORLD = 2


def rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {
        "big": torch.randn(200, 64, generator=g),  # chunk shards
        "small": torch.randn(7, generator=g),  # packed
        "rank": rank,
    }


async def _write_step(root: Path, step: int, world: int) -> list[Manifest]:
    """``step`` as ``world`` ranks write it: each rank's part, then rank 0's commit record."""
    tiers = []
    for rank in range(world):
        tier = FileTier(root)
        tier.bind(rank, world)
        await tier.open()
        tiers.append(tier)
    try:
        parts = []
        for tier in tiers:
            manifest, payloads = build_snapshot(
                step, rank_state(tier.rank, step), rank=tier.rank, world_size=world
            )
            await tier.begin(manifest)
            for shard, data in zip(manifest.shards, payloads, strict=True):
                await tier.put_shard(manifest, shard, memoryview(data))
            await tier.commit(manifest)
            parts.append(manifest)
        for tier in tiers:
            await tier.commit_global(step, world)
        return parts
    finally:
        for tier in tiers:
            await tier.aclose()


def write_steps(root: Path, steps: tuple[int, ...], world: int = WORLD) -> None:
    for step in steps:
        asyncio.run(_write_step(root, step, world))


async def _read_parts(tier: Any, step: int) -> list[tuple[Manifest, list[bytes]]]:
    await tier.open()
    try:
        first = await tier.read_manifest(step)
        out = []
        for rank in range(first.world_size):
            m = await tier.read_rank_manifest(step, rank)
            data = []
            for shard in m.shards:
                buf = bytearray(shard.length)
                await tier.read_shard(m, shard, memoryview(buf))
                data.append(bytes(buf))
            out.append((m, data))
        return out
    finally:
        await tier.aclose()


def parts_of(tier: Any, step: int) -> list[tuple[Manifest, list[bytes]]]:
    """Every rank's manifest of ``step`` and its shards' bytes."""
    return asyncio.run(_read_parts(tier, step))


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def rank_data(root: Path, step: int, rank: int) -> Path:
    return root / f"step-{step:012d}" / f"rank-{rank:05d}.data"


@pytest.fixture
def two_ranks(tmp_path: Path) -> Path:
    """A file tier holding steps 1, 2 and 3, each written by two ranks."""
    root = tmp_path / "run"
    write_steps(root, (1, 2, 3))
    return root


# -- copy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "zarr"])
def test_copy_moves_every_rank_and_the_commit_record(
    two_ranks: Path, run: Any, tmp_path: Path, kind: str
) -> None:
    dst = tmp_path / "dst"
    spec = f"zarr+file://{dst}" if kind == "zarr" else str(dst)
    code, out, _ = run("copy", two_ranks, spec, "--step", "2", "-q")
    assert code == EXIT_OK, out
    assert out.startswith("step 2: copied")
    code, out, _ = run("ls", spec, "--json")
    assert code == EXIT_OK
    (entry,) = json.loads(out)
    assert (entry["step"], entry["world_size"]) == (2, WORLD)
    want = parts_of(FileTier(two_ranks, readonly=True), 2)
    tier = ZarrTier(str(dst), readonly=True) if kind == "zarr" else FileTier(dst, readonly=True)
    got = parts_of(tier, 2)
    assert len(got) == WORLD
    for (gm, gdata), (wm, wdata) in zip(got, want, strict=True):
        assert (gm.rank, gm.world_size) == (wm.rank, wm.world_size)
        assert [s.crc32c for s in gm.shards] == [s.crc32c for s in wm.shards]
        assert gdata == wdata
    code, out, _ = run("verify", spec)
    assert code == EXIT_OK
    assert f"({WORLD} ranks," in out


def test_copy_to_s3_moves_every_rank(
    two_ranks: Path, run: Any, s3: S3Location, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = s3.server.tier_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_REGION", options["region"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    code, out, _ = run("copy", two_ranks, s3.url, "--step", "3", "-q")
    assert code == EXIT_OK, out
    keys, group = s3.keys(), s3.group(3)
    for rank in range(WORLD):
        assert f"{s3.prefix}/{group}/rank-{rank:05d}/zarr.json" in keys
    got = parts_of(ZarrTier(s3.url, readonly=True, **options), 3)
    want = parts_of(FileTier(two_ranks, readonly=True), 3)
    assert [data for _, data in got] == [data for _, data in want]
    code, out, _ = run("verify", s3.url, "-q")
    assert (code, out.split("(")[0]) == (EXIT_OK, "step 3: ok ")


def test_copy_refuses_a_destination_that_cannot_hold_several_ranks(
    two_ranks: Path, tmp_path: Path
) -> None:
    from lazyckpt.cli._copy import _copy_step

    async def attempt() -> list[int]:
        src = await open_location(str(two_ranks))
        host = HostMemoryTier(8 << 20)  # no commit record: it cannot hold several ranks
        await host.open()
        dst = Location("host", "host", host)
        args = argparse.Namespace(jobs=2, no_readback=False)
        try:
            with pytest.raises(ConfigurationError, match=r"written by 2 ranks.*commit_global"):
                await _copy_step(src, dst, 2, Console(quiet=True), args)
            return await host.steps()
        finally:
            await src.tier.aclose()
            await host.aclose()

    assert asyncio.run(attempt()) == []  # refused before anything was written


def test_copy_skips_a_step_with_a_damaged_rank_and_copies_the_rest(
    two_ranks: Path, run: Any, tmp_path: Path
) -> None:
    flip_byte(rank_data(two_ranks, 2, 1), 10)
    dst = tmp_path / "dst"
    code, out, err = run("copy", two_ranks, dst, "-q")
    assert code == EXIT_DAMAGE
    assert [line.split(":")[0] for line in out.splitlines()] == ["step 1", "step 3"]
    assert "step 2: NOT copied" in err and "rank 1" in err
    assert "1 of 3 steps were not copied" in err and "copied: 1, 3" in err
    assert "nothing was copied" not in err
    code, out, _ = run("ls", dst, "--json")
    assert [e["step"] for e in json.loads(out)] == [1, 3]
    # rank 0's part of step 2, written before the damage was found, is not left behind
    assert not (dst / "step-000000000002").exists()


def test_copy_onto_itself_is_a_usage_error(two_ranks: Path, run: Any) -> None:
    code, _, err = run("copy", two_ranks, f"{two_ranks}/../run/")
    assert code == EXIT_USAGE
    assert "same location" in err


# -- verify --------------------------------------------------------------------------------------


def test_verify_names_the_damaged_rank(two_ranks: Path, run: Any) -> None:
    m = parts_of(FileTier(two_ranks, readonly=True), 3)[1][0]
    big = next(s for s in m.shards if any(m.tensors[g.tensor].key == "big" for g in s.segments))
    flip_byte(rank_data(two_ranks, 3, 1), big.offset + 5)
    code, out, _ = run("verify", two_ranks, "--step", "3", "-q")
    assert code == EXIT_DAMAGE
    assert out.startswith(f"step 3: DAMAGED: 1 of {len(m.shards) * 2} shards ({WORLD} ranks)")
    assert f"rank 1 shard {big.index}" in out and "big rows" in out
    code, out, _ = run("verify", two_ranks, "--all", "--json", "-q")
    assert code == EXIT_DAMAGE
    reports = {r["step"]: r for r in json.loads(out)["steps"]}
    assert reports[1]["ok"] and reports[1]["world_size"] == WORLD
    (damage,) = reports[3]["damaged"]
    assert (damage["rank"], damage["shard"], damage["keys"]) == (1, big.index, ["big"])


def test_verify_reports_a_missing_rank_manifest(two_ranks: Path, run: Any) -> None:
    (two_ranks / "step-000000000001" / "rank-00001.json").unlink()
    code, out, _ = run("verify", two_ranks, "--step", "1", "-q")
    assert code == EXIT_DAMAGE
    assert "rank 1: the manifest cannot be read" in out


def test_api_verify_in_one_process_checks_every_rank(two_ranks: Path) -> None:
    async def check() -> tuple[bool, list[str], bool]:
        async with lazyckpt.Checkpointer([FileTier(two_ranks, readonly=True)]) as ckpt:
            intact = await ckpt.verify(1)
            flip_byte(rank_data(two_ranks, 2, 1), 3)
            damaged = await ckpt.verify(2)
            return damaged.ok, damaged.problems["file"], intact.ok

    ok, problems, intact = asyncio.run(check())
    assert intact
    assert not ok
    (problem,) = problems
    assert problem.startswith("rank 1 shard 0") and "rank 1" in problem


def test_unknown_step_lists_the_committed_steps(two_ranks: Path, run: Any) -> None:
    code, _, err = run("verify", two_ranks, "--step", "999")
    assert code == EXIT_NOT_FOUND
    assert "(committed steps: 1, 2, 3)" in err


# -- ls and inspect ------------------------------------------------------------------------------


def test_ls_and_inspect_count_every_rank(two_ranks: Path, run: Any) -> None:
    parts = [m for m, _ in parts_of(FileTier(two_ranks, readonly=True), 1)]
    code, out, _ = run("ls", two_ranks, "--json")
    assert code == EXIT_OK
    entry = json.loads(out)[0]
    assert entry["world_size"] == WORLD
    assert entry["bytes"] == sum(m.tensor_bytes for m in parts)
    assert entry["shards"] == sum(len(m.shards) for m in parts)
    code, out, _ = run("ls", two_ranks)
    assert out.splitlines()[0].split() == ["STEP", "SIZE", "TENSORS", "RANKS", "CREATED", "TIERS"]
    assert out.splitlines()[1].split()[4] == str(WORLD)
    code, out, _ = run("inspect", two_ranks, "--step", "1", "--json")
    doc = json.loads(out)
    assert (doc["world_size"], doc["bytes"]) == (WORLD, entry["bytes"])
    code, out, _ = run("inspect", two_ranks, "--step", "1")
    assert f"written by {WORLD} ranks" in out.splitlines()[0]


# -- real ranks: FSDP2 and DTensor state ---------------------------------------------------------


@pytest.fixture(scope="module")
def dtensor_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Steps 1 and 2 of FSDP2 and DTensor state saved by two real ranks on a file tier, and
    the full tensors they hold."""
    base = tmp_path_factory.mktemp("dtensor")
    root, out = base / "ckpt", base / "out"
    out.mkdir()
    launch_ranks(DTENSOR_WORKER, ["save", str(root), str(out)], WORLD, timeout=120)
    return root, torch.load(out / "expected.pt")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.slow
def test_export_writes_global_tensors(dtensor_saved: Any, run: Any, tmp_path: Path) -> None:
    root, expected = dtensor_saved
    file = tmp_path / "model.safetensors"
    assert run("export", root, "--step", "1", "--select", "model", "--to", file, "-q")[0] == 0
    model = safetensors.torch.load_file(file)
    want = {k[len("model/") :]: v for k, v in expected.items() if k.startswith("model/")}
    assert set(model) == set(want)
    for key, tensor in want.items():
        assert torch.equal(_bits(model[key]), _bits(tensor)), key
    whole = tmp_path / "all.pt"
    assert run("export", root, "--step", "1", "--to", whole, "-q")[0] == EXIT_OK
    state = torch.load(whole)
    for key in ("a", "b", "c", "d"):  # Shard(0), Shard(1) bfloat16, Replicate, Replicated
        assert state[key].shape == expected[key].shape, key
        assert torch.equal(_bits(state[key]), _bits(expected[key])), key


@pytest.mark.slow
def test_inspect_shows_global_shapes(dtensor_saved: Any, run: Any) -> None:
    root, expected = dtensor_saved
    code, out, _ = run("inspect", root, "--step", "1", "--json")
    assert code == EXIT_OK
    tensors = {t["key"]: t for t in json.loads(out)["tensors"]}
    assert tensors["a"]["shape"] == list(expected["a"].shape)  # 37 rows over 2 ranks
    assert tensors["a"]["rank0_shape"] == [19, 24]
    assert tensors["b"]["placements"] == ["shard(1)"]
    assert tensors["b"]["bytes"] == expected["b"].numel() * 2
    code, out, _ = run("inspect", root, "--step", "1")
    row = next(line for line in out.splitlines() if line.startswith("a "))
    assert "[37, 24] shard(0)" in row


@pytest.mark.slow
def test_copy_to_zarr_then_verify_names_a_damaged_chunk_of_rank_1(
    dtensor_saved: Any, run: Any, tmp_path: Path
) -> None:
    root, expected = dtensor_saved
    dst = tmp_path / "z"
    assert run("copy", root, f"zarr+file://{dst}", "--step", "1", "-q")[0] == EXIT_OK
    with lazyckpt.SyncCheckpointer([ZarrTier(str(dst), readonly=True)]) as ckpt:
        state = ckpt.restore(1)
    for k, v in state["model"].items():
        assert torch.equal(_bits(v), _bits(expected[f"model/{k}"])), k
    chunks = sorted(
        p for p in (dst / "step-000000000001" / "rank-00001").rglob("c/*") if p.is_file()
    )
    assert chunks
    flip_byte(chunks[0], 0)
    code, out, _ = run("verify", dst, "--step", "1", "-q")
    assert code == EXIT_DAMAGE
    assert "rank 1 shard" in out
    with lazyckpt.SyncCheckpointer([ZarrTier(str(dst), readonly=True)]) as ckpt:
        report = ckpt.verify(1)
    assert not report.ok and any(p.startswith("rank 1 ") for p in report.problems["zarr"])
