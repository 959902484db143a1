"""The command line with a third-party tier plugin, found through its entry point: the
plugin says which locations it serves, and ``import`` and ``copy`` write to it as the engine
does (deadline and retries: a transient failure is retried, a lasting one aborts the step)."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import safetensors.torch
import torch

from lazyckpt import Manifest, SyncCheckpointer
from lazyckpt.cli import EXIT_OK, EXIT_STORAGE, EXIT_USAGE, CommandError, main, resolve_location
from tiers import FileTier

PLUGIN = """
from lazyckpt.testing import FaultyTier
from tiers import FileTier

FAULTS = []  # (method, how): how is a count of transient failures, or "broken"
BUILT = []


class FlakyFileTier(FaultyTier):
    url_schemes = ("flaky",)  # flaky:///path
    location_marker = "FLAKY"  # a directory holding this file is one of ours

    def __init__(self, location, *, readonly=False):
        path = location.removeprefix("flaky://").removeprefix("file://")
        super().__init__(FileTier(path, readonly=readonly))
        self.readonly = readonly
        for method, how in FAULTS:
            if how == "broken":
                self.break_(method)
            else:
                self.fail_next(method, how)
        BUILT.append(self)
"""


@pytest.fixture
def faulty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A tier plugin registered as ``faulty``, serving ``flaky://`` URLs: a FileTier whose
    calls fail as the test says."""
    where = tmp_path / "plugin"
    dist = where / "faulty_tier_plugin-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: faulty-tier-plugin\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[lazyckpt.tiers]\nfaulty = faulty_tier_plugin:FlakyFileTier\n"
    )
    (where / "faulty_tier_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.delitem(sys.modules, "faulty_tier_plugin", raising=False)
    return importlib.import_module("faulty_tier_plugin")


def weights_file(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    weights = {"a": torch.randn(64, 64, generator=g), "b": torch.randn(3000, generator=g)}
    file = tmp_path / "w.safetensors"
    safetensors.torch.save_file(weights, file)
    return file, weights


def manifest_of(root: Path, step: int) -> Manifest:
    async def read() -> Manifest:
        tier = FileTier(root, readonly=True)
        try:
            return await tier.read_manifest(step)
        finally:
            await tier.aclose()

    return asyncio.run(read())


def restored(root: Path, step: int) -> Any:
    with SyncCheckpointer([FileTier(root)]) as ckpt:
        return ckpt.restore(step)


def test_the_plugin_says_which_locations_it_serves(
    tmp_path: Path, faulty: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert resolve_location("flaky:///data/x") == ("faulty", "flaky:///data/x")
    assert resolve_location("faulty+file:///data/x") == ("faulty", "file:///data/x")
    ours = tmp_path / "ours"
    ours.mkdir()
    assert resolve_location(str(ours)) == ("file", str(ours))
    (ours / "FLAKY").write_text("")
    assert resolve_location(str(ours)) == ("faulty", str(ours))
    assert resolve_location(f"file://{ours}") == ("faulty", str(ours))
    assert resolve_location("s3://bucket/run") == ("zarr", "s3://bucket/run")  # still there
    (ours / "zarr.json").write_text("{}")
    with pytest.raises(CommandError, match="faulty, zarr") as info:
        resolve_location(str(ours))
    assert info.value.code == EXIT_USAGE
    assert main(["ls", "ftp://host/x"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "flaky://..." in err and "s3://..." in err  # what the registered tiers serve


def test_import_retries_a_transient_put_failure(tmp_path: Path, faulty: ModuleType) -> None:
    file, weights = weights_file(tmp_path)
    root = tmp_path / "dst"
    faulty.FAULTS[:] = [("put_shard", 2), ("commit", 1)]
    argv = ["import", str(file), "--to", f"flaky://{root}", "--step", "4"]
    assert main([*argv, "--shard-size", "8KiB", "-q"]) == EXIT_OK
    (tier,) = faulty.BUILT
    shards = len(manifest_of(root, 4).shards)
    assert shards == 4  # 28 KiB in 8 KiB shards
    assert tier.calls["put_shard"] == shards + 2  # two puts were tried again
    assert tier.calls["commit"] == 2
    state = restored(root, 4)
    for key, tensor in weights.items():
        assert torch.equal(state[key], tensor), key


def test_import_that_keeps_failing_aborts_the_step(
    tmp_path: Path, faulty: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    file, _ = weights_file(tmp_path)
    root = tmp_path / "dst"
    faulty.FAULTS[:] = [("commit", "broken")]
    code = main(["import", str(file), "--to", f"flaky://{root}", "--step", "4", "-q"])
    assert code == EXIT_STORAGE
    assert "commit: injected permanent failure" in capsys.readouterr().err
    (tier,) = faulty.BUILT
    assert tier.calls["commit"] == 4  # the engine's default: three retries
    assert tier.calls["abort"] == 1
    assert sorted(root.glob("step-*")) == []  # nothing of the step is left


def test_copy_retries_then_aborts_like_the_engine(tmp_path: Path, faulty: ModuleType) -> None:
    src = tmp_path / "src"
    with SyncCheckpointer([FileTier(src)], shard_size=8 << 10, staging_bytes=1 << 20) as ckpt:
        for step in (1, 2):
            ckpt.snapshot({"w": torch.full((4000,), float(step))}, step=step).wait()
    dst = tmp_path / "dst"
    faulty.FAULTS[:] = [("put_shard", 3), ("begin", 1)]
    assert main(["copy", str(src), f"flaky://{dst}", "--step", "1", "-q"]) == EXIT_OK
    assert torch.equal(restored(dst, 1)["w"], torch.full((4000,), 1.0))

    faulty.FAULTS[:] = [("put_shard", "broken")]
    code = main(["copy", str(src), f"flaky://{dst}", "--step", "2", "-q"])
    assert code == EXIT_STORAGE
    tier = faulty.BUILT[-1]
    assert tier.calls["put_shard"] == 4 and tier.calls["abort"] == 1
    assert [p.name for p in sorted(dst.glob("step-*"))] == ["step-000000000001"]


def test_gc_retries_a_transient_delete_failure(tmp_path: Path, faulty: ModuleType) -> None:
    root = tmp_path / "run"
    with SyncCheckpointer([FileTier(root)], staging_bytes=1 << 20) as ckpt:
        for step in (1, 2, 3):
            ckpt.snapshot({"w": torch.full((10,), float(step))}, step=step).wait()
    faulty.FAULTS[:] = [("delete", 1)]
    assert main(["gc", f"flaky://{root}", "--keep-last", "1", "-q"]) == EXIT_OK
    (tier,) = faulty.BUILT
    assert tier.calls["delete"] == 3  # steps 1 and 2, and step 1 once more
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-000000000003"]
