"""DTensor state across ranks: FSDP2 and plain DTensors saved on 4 ranks restored on 2 and
the other way round, bit for bit; replicated tensors written once; what is refused. Each rank
is a real process on loopback (gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import CorruptionError, Manifest
from lazyckpt._distributed.chunks import balance_writers
from tiers import FileTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import launch_ranks, rank_results

WORKER = Path(__file__).parent / "helpers" / "dtensor_worker.py"
REPLICATED_BYTES = 2 * 64 * 128 * 4  # tensors "c" and "d" of the worker's state


def launch(scenario: str, root: Path, out: Path, world: int) -> dict[int, dict[str, Any]]:
    """Run the worker on ``world`` ranks and collect what each wrote."""
    out.mkdir(parents=True, exist_ok=True)
    launch_ranks(WORKER, [scenario, str(root), str(out)], world, timeout=120)
    found = rank_results(out)
    assert sorted(found) == list(range(world))
    return found


@pytest.fixture(scope="module", params=[4, 2], ids=["saved-on-4", "saved-on-2"])
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, Path, Path, dict[int, dict[str, Any]]]:
    world = int(request.param)
    base = tmp_path_factory.mktemp(f"saved{world}")
    root, out = base / "ckpt", base / "out"
    return world, root, out, launch("save", root, out, world)


def test_snapshot_records_chunks_and_restores_on_the_same_world_size(saved: Any) -> None:
    world, _, _, res = saved
    for rank, r in res.items():
        assert r["steps"] == [1, 2]
        assert r["same_world_mismatch"] == []
        assert r["rank_value"] == rank  # per-rank values come back from the rank's own part
        assert r["format_version"] == 2
        # the two replicated tensors of 32 KiB: bytes balanced over the ranks
        group = tuple(range(world))
        writers = balance_writers([("c", 64 * 128 * 4, group), ("d", 64 * 128 * 4, group)])
        assert writers[0] != writers[1]
        for key, writer in zip(("c", "d"), writers, strict=True):
            assert r["modes"][key] == ("replica" if writer != rank else "rows")


def test_replicated_tensors_are_written_once_with_writes_spread(saved: Any) -> None:
    world, _, _, res = saved
    r0 = res[0]
    saved_bytes = r0["bytes_plain"] - r0["bytes_dedup"]
    # without dedup every rank writes c and d; with it one rank does (4 KiB-aligned shards)
    assert (
        (world - 1) * REPLICATED_BYTES
        <= saved_bytes
        <= (world - 1) * REPLICATED_BYTES + world * 4096
    )
    assert len(set(r0["writers"].values())) > 1


def test_unsupported_layouts_are_refused_and_versions_checked(saved: Any) -> None:
    world, _, _, res = saved
    for r in res.values():
        # Partial is refused; a 2-D mesh (on 4 ranks) is a layout like any other
        assert r["unsupported"] == ["UnsupportedStateError"] + (["accepted"] if world == 4 else [])
        assert r["versions"] == {"dtensor": True, "local": True}


def test_resharding_onto_another_world_size_is_bit_exact(saved: Any) -> None:
    world, root, out, _ = saved
    other = 2 if world == 4 else 4
    res = launch("restore", root, out / f"on{other}", other)
    for rank, r in res.items():
        assert r["steps"] == [1, 2]  # every rank agrees
        assert r["into_mismatch"] == []
        assert r["full_mismatch"] == []
        assert r["rank_value"] == rank % world


def test_one_process_restores_full_tensors(saved: Any) -> None:
    _, root, out, _ = saved
    expected = torch.load(out / "expected.pt")
    with lazyckpt.SyncCheckpointer([FileTier(root)]) as ckpt:
        state = ckpt.restore(1)
    assert torch.equal(state["a"], expected["a"])
    assert torch.equal(state["b"].view(torch.int16), expected["b"].view(torch.int16))
    assert torch.equal(state["d"], expected["d"])
    for k, v in state["model"].items():
        assert torch.equal(v, expected[f"model/{k}"])


def _manifest_doc(world: int) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": "lazyckpt",
        "format_version": 2,
        "step": 1,
        "rank": 1,
        "world_size": world,
        "created": 0.0,
        "stream_bytes": 4096,
        "pickled": False,
        "extra": {},
        "tensors": [
            {
                "key": "w",
                "dtype": "float32",
                "shape": [2, 3],
                "mode": "pack",
                "shards": [0],
                "chunk": 0,
                "offset": 0,
                "alias_of": None,
                "global_shape": [5, 3],
                "global_offset": [3, 0],
                "placements": ["shard(0)"],
            },
            {
                "key": "r",
                "dtype": "float32",
                "shape": [4],
                "mode": "replica",
                "shards": [],
                "chunk": 0,
                "offset": 0,
                "alias_of": None,
                "global_shape": [4],
                "global_offset": [0],
                "placements": ["replicate"],
                "writer": 0,
            },
        ],
        "shards": [
            {
                "index": 0,
                "offset": 0,
                "length": 24,
                "kind": "pack",
                "crc32c": 1,
                "segments": [[0, 0, 0, 6]],
            }
        ],
        "tree": {"$dict": [["w", {"$tensor": 0}], ["r", {"$tensor": 1}]]},
    }
    return doc


def _encode(doc: dict[str, Any]) -> bytes:
    import crc32c

    body = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    return json.dumps(
        {**doc, "checksum": crc32c.crc32c(body.encode())}, separators=(",", ":")
    ).encode()


def test_manifest_distributed_fields_round_trip() -> None:
    m = Manifest.from_json(_encode(_manifest_doc(2)))
    assert m.tensors[0].global_shape == (5, 3) and m.tensors[0].global_offset == (3, 0)
    assert m.tensors[1].writer == 0 and m.tensors[1].placements == ("replicate",)
    again = Manifest.from_json(m.to_json())
    assert again.tensors == m.tensors
    assert json.loads(m.to_json())["format_version"] == 2


@pytest.mark.parametrize(
    "damage",
    [
        {"global_offset": [4, 0]},  # the chunk would end past the global tensor
        {"global_shape": [5]},
        {"placements": ["shard(2)"]},
        {"placements": ["partial"]},
        {"placements": []},  # one per mesh dimension, at least one
        {"mode": "replica"},  # a replica needs a writer
    ],
)
def test_damaged_distributed_fields_are_corruption(damage: dict[str, Any]) -> None:
    doc = _manifest_doc(2)
    doc["tensors"][0].update(damage)
    with pytest.raises(CorruptionError):
        Manifest.from_json(_encode(doc))


@pytest.mark.parametrize("writer", [1, 2, -1])
def test_a_replica_must_name_another_existing_rank(writer: int) -> None:
    doc = _manifest_doc(2)
    doc["tensors"][1]["writer"] = writer
    with pytest.raises(CorruptionError):
        Manifest.from_json(_encode(doc))


def test_plain_manifests_keep_format_1(tmp_path: Path) -> None:
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        ckpt.snapshot({"w": torch.ones(3)}, step=0).wait()
    doc = json.loads((tmp_path / "step-000000000000" / "manifest.json").read_text())
    assert doc["format_version"] == 1
    assert set(doc["tensors"][0]) == {
        "key",
        "dtype",
        "shape",
        "mode",
        "shards",
        "chunk",
        "offset",
        "alias_of",
    }


@pytest.mark.slow
def test_incremental_snapshots_stay_in_each_rank_and_reshard(tmp_path: Path) -> None:
    """Incremental snapshots on 2 ranks: each rank's later steps write only the adapter and
    refer to the frozen tensors in its own part of step 1 (retired, not deleted, by
    keep_last=2); the last step restores bit for bit on 4 ranks."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    res = launch("incremental", root, out, 2)
    for r in res.values():
        assert r["steps"] == [3, 4]
        assert r["stored_in"] == [1]
        assert r["retired_data"]
        first, *later = (b - a for a, b in zip([0, *r["written"]], r["written"], strict=False))
        # the frozen tensors in shards of their own ("c" and "d", 32 KiB) are not written
        # again; the pack holding the adapter beside small frozen chunks is
        assert first > 0 and all(0 < n <= first - 32768 for n in later), r["written"]
    for r in launch("incremental-restore", root, out / "on4", 4).values():
        assert r["mismatch"] == []


def test_a_rank_that_wrote_every_replicated_chunk_restores_with_the_others(tmp_path: Path) -> None:
    # one Replicated tensor on two ranks: its writer holds no replica entry and needs
    # nothing from the other rank, which needs it; both must take the same restore path
    # (the resharding one exchanges shards), else the exchange waits for a rank not in it
    res = launch("one-replica", tmp_path / "ckpt", tmp_path / "out", 2)
    modes = sorted(r["modes"]["shared"] for r in res.values())
    assert modes[1] == "replica" and modes[0] != "replica"
    for r in res.values():
        assert r["plain_ok"] and r["into_ok"], r
