"""The layouts large runs use, built with torch's own parallelism APIs on 4 gloo ranks: HSDP
(``fully_shard`` on a 2-D mesh, with an expert weight sharded over a sub-mesh), FSDP over
tensor parallelism (``parallelize_module`` then ``fully_shard``), and two pipeline stages
run by ``torch.distributed.pipelining``, each sharded over its own ranks. Each snapshots every step with the guard on, resumes in a fresh
set of processes with the uninterrupted run's losses bit for bit, and restores onto another
layout (FSDP over all 4 ranks, and one process) with every tensor bit for bit."""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from tiers import FileTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import launch_ranks, rank_results

WORKER = Path(__file__).parent / "helpers" / "layouts_worker.py"

pytestmark = pytest.mark.slow


def launch(scenario: str, layout: str, root: Path, out: Path, world: int = 4) -> dict[int, Any]:
    out.mkdir(parents=True, exist_ok=True)
    launch_ranks(WORKER, [scenario, layout, str(root), str(out)], world, timeout=170)
    found = rank_results(out)
    assert sorted(found) == list(range(world))
    return found


@pytest.fixture(scope="module", params=["hsdp", "fsdp_tp", "pp"])
def trained(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, dict[int, Any]]:
    layout = str(request.param)
    base = tmp_path_factory.mktemp(layout)
    return layout, base / "ckpt", launch("train", layout, base / "ckpt", base / "train")


def test_resume_on_the_same_layout_matches_the_uninterrupted_losses(
    trained: tuple[str, Path, dict[int, Any]], tmp_path: Path
) -> None:
    layout, root, saved = trained
    for r in saved.values():
        assert r["steps"][-1] == 5
    resumed = launch("resume", layout, root, tmp_path / "resume")
    for rank, r in resumed.items():
        assert r["losses"] == saved[rank]["losses"], rank  # floats, compared exactly
    # (under pipelining only the last stage has losses; they depend on every stage)
    assert any(v != 0.0 for r in resumed.values() for v in r["losses"].values())


def _saved_full(saved: dict[int, Any], layout: str) -> dict[str, torch.Tensor]:
    """Every tensor of the model as saved, whole (a pipeline stage's from its ranks)."""
    out: dict[str, torch.Tensor] = {}
    for r in saved.values():
        for k, v in r["saved"].items():
            out[k] = torch.tensor(v)
    return out


# the layouts each saved layout is restored onto (layout, world size); the saved layout
# comes from the module fixture's own parameter, so that each is trained once
TARGETS = {
    "hsdp": [("fsdp", 4), ("fsdp", 2)],
    "fsdp_tp": [("fsdp", 4), ("tp", 4)],
    "pp": [("fsdp", 4), ("fsdp", 2)],
}


@pytest.mark.parametrize("case", [0, 1])
def test_another_layout_restores_every_tensor_bit_for_bit(
    trained: tuple[str, Path, dict[int, Any]], case: int, tmp_path: Path
) -> None:
    layout, root, saved = trained
    target, world = TARGETS[layout][case]
    expected = _saved_full(saved, layout)
    got = launch("reshard", target, root, tmp_path / "reshard", world)
    for rank, r in got.items():
        for k, v in r["restored"].items():
            assert torch.equal(torch.tensor(v), expected[k]), (rank, k)


def test_one_process_restores_full_tensors(
    trained: tuple[str, Path, dict[int, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    layout, root, saved = trained
    expected = _saved_full(saved, layout)
    with lazyckpt.SyncCheckpointer([FileTier(root)]) as ckpt:
        state = ckpt.restore(3)
    got = {f"model/{k}": v for k, v in state["model"].items()}
    if "experts" in state:
        got["experts"] = state["experts"]
    if layout == "pp":
        # every stage's layers, each from its own stage's ranks; the positional optimizer
        # state every stage saved under the same keys comes from stage 0, with a warning
        assert any(k.startswith("model/layers.0.") for k in got)
        assert any(k.startswith("model/layers.1.") for k in got)
        assert "saved by several of them" in caplog.text
    assert got.keys() == expected.keys()
    for k, v in got.items():
        assert torch.equal(v, expected[k]), k


def test_unsharded_pipeline_stages_resume_and_come_back_whole_in_one_process(
    tmp_path: Path,
) -> None:
    # each rank holds its stage's plain tensors under their own names: one process restoring
    # the step gets every stage's layers, each from its own rank
    root = tmp_path / "ckpt"
    saved = launch("train", "pp_plain", root, tmp_path / "train", world=2)
    expected = _saved_full(saved, "pp_plain")
    resumed = launch("resume", "pp_plain", root, tmp_path / "resume", world=2)
    for rank, r in resumed.items():
        assert r["losses"] == saved[rank]["losses"], rank
    assert any(v != 0.0 for v in resumed[1]["losses"].values())
    with lazyckpt.SyncCheckpointer([FileTier(root)]) as ckpt:
        state = ckpt.restore(3)
    got = {f"model/{k}": v for k, v in state["model"].items()}
    assert sorted(got) == sorted(expected)
    for k, v in got.items():
        assert torch.equal(v, expected[k]), k


@pytest.mark.parametrize("layout", ["hsdp", "fsdp_tp"])
def test_the_dcp_backend_saves_and_loads_a_2d_layout(layout: str, tmp_path: Path) -> None:
    """``dcp.save``/``dcp.load`` through ``LazyStorageWriter``/``LazyStorageReader``, with
    torch's own state-dict helpers, on HSDP and FSDP over tensor parallelism; then
    ``dcp.load`` of that step onto FSDP over the 4 ranks (resharded)."""
    res = launch("dcp", layout, tmp_path / "ckpt", tmp_path / "out")
    for rank, r in res.items():
        assert r["mismatch"] == [], rank
        first, second = r["next_loss"]
        assert first == second, rank
    saved = res[0]["saved"]
    got = launch("dcp-load", "fsdp", tmp_path / "ckpt", tmp_path / "onto-fsdp")
    for rank, r in got.items():
        assert r["restored"].keys() == saved.keys(), rank
        for k, v in r["restored"].items():
            assert torch.equal(torch.tensor(v), torch.tensor(saved[k])), (rank, k)


def test_a_data_parallel_restore_reads_each_stored_byte_about_once(tmp_path: Path) -> None:
    """4 ranks restoring 16 MiB of replicated weights: one rank reads each shard from the
    tier and sends it to the others (checked on arrival), instead of every rank reading
    every byte (4.00x the stored bytes before)."""
    root = tmp_path / "ckpt"
    saved = launch("ddp-save", "ddp", root, tmp_path / "save")
    stored = saved[0]["stored"]
    res = launch("ddp-restore", "ddp", root, tmp_path / "restore")
    read = sum(r["read"] for r in res.values())
    for rank, r in res.items():
        assert r["mismatch"] == [], rank
        assert r["rank_value"] == rank
    assert sum(r["sent"] for r in res.values()) > 0
    # manifests, metadata and the interpreter's own reads ride on top of the shards
    assert read <= 1.3 * stored, (read / stored, read, stored)
    # each saved rank's manifest is read from the tier once in the whole job, by one
    # rank, and handed to the others (16 reads before: every rank read every manifest)
    reads = sorted(m for r in res.values() for m in r["manifests_read"])
    assert reads == [0, 1, 2, 3], reads
    for rank, r in res.items():
        assert r["manifests_read"] == [rank]
    # on 2 ranks, rank 0 hands over saved ranks 0 and 2, rank 1 saved ranks 1 and 3; rank
    # 1 cannot read rank 3's: both read that one themselves, and the restore is the same
    flaky = launch("ddp-restore", "flaky", root, tmp_path / "flaky", world=2)
    for rank, r in flaky.items():
        assert r["mismatch"] == [], rank
    assert flaky[0]["manifests_read"] == [0, 2, 3]
    assert flaky[1]["manifests_read"] == [1, 3]


@pytest.mark.parametrize("trained", ["hsdp"], indirect=True)
def test_a_layout_that_cannot_be_mapped_is_refused_before_anything_loads(
    trained: tuple[str, Path, dict[int, Any]],
) -> None:
    _, root, _ = trained
    with lazyckpt.SyncCheckpointer([FileTier(root)]) as ckpt:
        full = ckpt.restore(3)
        target = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in full.items()}
        target["model"] = {k: torch.zeros_like(v) for k, v in full["model"].items()}
        key = "layers.0.w1.weight"
        target["model"][key] = torch.zeros(7, 3)
        with pytest.raises(lazyckpt.StateMismatchError, match=r"global shape \[32, 16\]") as info:
            ckpt.restore(3, into=target)
    assert info.value.key == f"model/{key}"
    assert all(not v.any() for k, v in target["model"].items() if k != key)  # nothing loaded


@pytest.mark.parametrize("trained", ["hsdp"], indirect=True)
def test_a_rank_that_refuses_a_restore_makes_every_rank_raise(
    trained: tuple[str, Path, dict[int, Any]], tmp_path: Path
) -> None:
    # rank 1's target does not fit: it raises before reading anything, and the other ranks,
    # which would have waited for its needs, raise too instead of waiting for a timeout
    _, root, _ = trained
    got = launch("refuse", "fsdp", root, tmp_path / "refuse")
    assert got[1]["error"] == "StateMismatchError", got[1]
    for rank in (0, 2, 3):
        assert got[rank]["error"] == "CoordinationError", got[rank]
        assert "rank 1 refused the restore (StateMismatchError" in got[rank]["message"]
    assert not any(r["loaded"] for r in got.values())


@pytest.mark.parametrize("trained", ["hsdp"], indirect=True)
def test_saved_ranks_that_disagree_about_a_tensor_are_refused_by_key(
    trained: tuple[str, Path, dict[int, Any]], tmp_path: Path
) -> None:
    # rank 1's manifest says another global shape for one DTensor than rank 0's (ranks
    # that ran different models): a typed error naming the key and both, nothing loaded
    from lazyckpt._format.manifest import Manifest

    _, root, _ = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    part = next(copy.glob("step-*3")) / "rank-00001.json"
    m = Manifest.from_json(part.read_bytes())
    key = "model/layers.0.w1.weight"
    tensors = tuple(
        replace(t, global_shape=(64, *t.global_shape[1:]))
        if t.key == key and t.global_shape is not None
        else t
        for t in m.tensors
    )
    part.write_bytes(replace(m, tensors=tensors).to_json())
    with (
        lazyckpt.SyncCheckpointer([FileTier(copy)]) as ckpt,
        pytest.raises(lazyckpt.StateMismatchError, match="disagree") as info,
    ):
        ckpt.restore(3)
    assert info.value.key == key
    assert "[32, 16]" in str(info.value) and "[64, 16]" in str(info.value)


def test_replicas_restored_through_the_host_tier_read_with_the_durable_tiers_manifest(
    tmp_path: Path,
) -> None:
    # a rank hands the others its manifest as the tiers they read from hold it, not the
    # host tier's copy it restores its own shards with (incremental: they differ)
    got = launch("host-incremental", "fsdp", tmp_path / "ckpt", tmp_path / "out", world=2)
    for rank, r in got.items():
        assert r["mismatch"] == [], rank


def test_tensor_parallel_on_2_ranks_restores_on_4(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    saved = launch("train", "tp", root, tmp_path / "train", 2)
    expected = _saved_full(saved, "tp")
    got = launch("reshard", "tp", root, tmp_path / "reshard", 4)
    for rank, r in got.items():
        for k, v in r["restored"].items():
            assert torch.equal(torch.tensor(v), expected[k]), (rank, k)
