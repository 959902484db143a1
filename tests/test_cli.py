"""The ``lazyckpt`` command line on real snapshots: listing, inspecting, verifying damaged
copies, exporting and importing bit for bit, copying, retention, progress output."""

from __future__ import annotations

import asyncio
import fractions
import functools
import io
import json
import math
import zipfile
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import safetensors.torch
import torch
from conftest import Run
from conftest_s3 import S3Location, s3, s3_server

from lazyckpt import Manifest, ShardMeta, SyncCheckpointer
from lazyckpt._progress import Progress, format_bytes, format_duration
from lazyckpt.cli import (
    EXIT_DAMAGE,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    CommandError,
    ShardReader,
    resolve_location,
)
from lazyckpt.cli import _console as cli_console
from lazyckpt.testing import build_snapshot
from tiers import FileTier, HostMemoryTier

_T = TypeVar("_T")

__all__ = ["s3", "s3_server"]  # the fixtures, imported for pytest

SMALL = {"shard_size": 64 << 10, "pack_bytes": 4 << 10}
STEPS = (0, 5, 10)



def random_bits(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads included), so only a bitwise copy compares equal."""
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    net = torch.nn.Linear(16, 8)
    weight = torch.randn(300, 64, generator=g)  # 75 KiB: rows over two 64 KiB shards
    return {
        "model": {
            "weight": weight,
            "bias": torch.randn(300, generator=g),
            "emb": random_bits((50, 16), torch.bfloat16, g),
        },
        "tied": weight,  # the same tensor under a second key: stored once
        "net": net,
        "wide": torch.randn(2, 20000, generator=g),  # one row is larger than a shard: flat
        "mask": torch.rand(100, generator=g) > 0.5,
        "ids": torch.arange(10, dtype=torch.int64) * step,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "half": random_bits((7, 9), torch.float16, g),
        "step": step,
        "lr": 1e-3,
        "name": "run-a",
        "betas": (0.9, 0.999),
        "blob": b"\x00\x01\xff",
    }


@pytest.fixture
def snapshots(tmp_path: Path) -> tuple[Path, dict[int, dict[str, Any]]]:
    """A file tier with committed snapshots of steps 0, 5 and 10, and the states saved."""
    root = tmp_path / "run"
    states = {}
    with SyncCheckpointer([HostMemoryTier(8 << 20), FileTier(root)], **SMALL) as ckpt:
        for step in STEPS:
            states[step] = make_state(step)
            ckpt.snapshot(states[step], step=step).wait()
    return root, states


def restore(root: Path, step: int | None = None) -> Any:
    with SyncCheckpointer([FileTier(root)]) as ckpt:
        return ckpt.restore(step)


def manifest_of(root: Path, step: int) -> Manifest:
    async def read() -> Manifest:
        tier = FileTier(root)
        try:
            return await tier.read_manifest(step)
        finally:
            await tier.aclose()

    return asyncio.run(read())


def data_file(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}" / "rank-00000.data"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_state(got: Any, want: Any, where: str = "") -> None:
    """Tensors bit for bit, plain values equal, Stateful objects by their state dict."""
    if isinstance(want, torch.nn.Module):
        want = want.state_dict()
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert same_bits(got, want), where
    elif isinstance(want, dict):
        assert isinstance(got, dict), where
        assert list(got) == list(want), where
        for k in want:
            assert_same_state(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}/{i}")
    else:
        assert got == want, where


def flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state's tensors under their lazyckpt keys (``model/weight``)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            value = value.state_dict()
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in flat_tensors(value).items()})
    return out


def shard_holding(m: Manifest, key: str) -> ShardMeta:
    index = next(i for i, t in enumerate(m.tensors) if t.key == key)
    return next(s for s in m.shards if any(seg.tensor == index for seg in s.segments))


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


# -- help, usage, locations --------------------------------------------------------------------


def test_help_for_every_subcommand(run: Run) -> None:
    code, out, _ = run("--help")
    assert code == EXIT_OK
    commands = ["ls", "inspect", "verify", "export", "import", "copy", "gc", "timeline"]
    for command in commands:
        assert command in out
        code, text, _ = run(command, "--help")
        assert code == EXIT_OK
        assert f"usage: lazyckpt {command}" in text
        assert "exit status" in text


def test_usage_errors_exit_2(run: Run, tmp_path: Path) -> None:
    assert run()[0] == EXIT_USAGE
    assert run("frobnicate")[0] == EXIT_USAGE
    assert run("verify")[0] == EXIT_USAGE
    assert run("verify", tmp_path, "--step", "-3")[0] == EXIT_USAGE
    assert run("verify", tmp_path, "--step", "1", "--all")[0] == EXIT_USAGE
    code, _, err = run("ls", "ftp://example/x")
    assert code == EXIT_USAGE
    assert "ftp://" in err


def test_version(run: Run) -> None:
    code, out, _ = run("--version")
    assert code == EXIT_OK
    assert out.startswith("lazyckpt ")


def test_locations_resolve_to_tier_kinds(tmp_path: Path) -> None:
    assert resolve_location(str(tmp_path)) == ("file", str(tmp_path))
    assert resolve_location("file:///data/run1") == ("file", "/data/run1")
    assert resolve_location("s3://bucket/run1") == ("zarr", "s3://bucket/run1")
    assert resolve_location("zarr+file:///data/z") == ("zarr", "file:///data/z")
    assert resolve_location("zarr+s3://bucket/z") == ("zarr", "s3://bucket/z")
    assert resolve_location("mytier+rest://x/y") == ("mytier", "rest://x/y")
    with pytest.raises(CommandError) as info:
        resolve_location("ftp://host/x")
    assert info.value.code == EXIT_USAGE


# -- ls ------------------------------------------------------------------------------------------


def test_ls_lists_committed_snapshots(snapshots: Any, run: Run) -> None:
    root, states = snapshots
    code, out, _ = run("ls", root)
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "SIZE", "TENSORS", "RANKS", "CREATED", "TIERS"]
    assert [line.split()[0] for line in lines[1:]] == [str(s) for s in STEPS]
    assert all(line.rstrip().endswith("file") for line in lines[1:])

    code, out, _ = run("ls", root, "--json")
    assert code == EXIT_OK
    entries = json.loads(out)
    assert [e["step"] for e in entries] == list(STEPS)
    m = manifest_of(root, 10)
    last = entries[-1]
    assert last["bytes"] == m.tensor_bytes
    assert last["tensors"] == len(flat_tensors(states[10]))
    assert last["tiers"] == ["file"]
    assert last["created_unix"] == m.created


def test_ls_merges_locations_by_step(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, _ = snapshots
    other = tmp_path / "other"
    assert run("copy", root, other, "--step", "5", "-q")[0] == EXIT_OK
    code, out, _ = run("ls", root, other, "--json")
    assert code == EXIT_OK
    by_step = {e["step"]: e for e in json.loads(out)}
    assert by_step[5]["locations"] == [str(root), str(other)]
    assert by_step[0]["locations"] == [str(root)]


def test_ls_missing_directory_exits_3(run: Run, tmp_path: Path) -> None:
    code, _, err = run("ls", tmp_path / "nowhere")
    assert code == EXIT_NOT_FOUND
    assert "no such directory" in err


def test_ls_of_a_file_says_it_is_not_a_directory(run: Run, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    code, _, err = run("ls", tmp_path / "notes.txt")
    assert code == EXIT_NOT_FOUND
    assert "a file, not a directory" in err


def test_ls_empty_directory(run: Run, tmp_path: Path) -> None:
    code, out, err = run("ls", tmp_path)
    assert code == EXIT_OK
    assert out == ""
    assert "no committed snapshot" in err


# -- inspect -------------------------------------------------------------------------------------


def test_inspect_shows_keys_dtypes_shapes_and_values(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    code, out, _ = run("inspect", root, "--step", "5")
    assert code == EXIT_OK
    assert out.startswith("step 5 in ")
    lines = out.splitlines()
    assert lines[1].split() == ["KEY", "DTYPE", "SHAPE", "BYTES"]
    model = lines.index("model/")
    assert lines[model + 1].split()[:4] == ["weight", "float32", "[300,", "64]"]
    assert lines[model + 1].startswith("  ")  # nested under model/
    rows = {line.split()[0]: line for line in lines[2:]}
    assert "bfloat16" in rows["emb"]
    assert "[0, 3]" in rows["empty"]
    assert "= model/weight" in rows["tied"]  # the alias names what it shares
    assert "= 0.001" in rows["lr"]
    assert "= 'run-a'" in rows["name"]
    assert "= (0.9, 0.999)" in rows["betas"]


def test_inspect_json(snapshots: Any, run: Run) -> None:
    root, states = snapshots
    code, out, _ = run("inspect", root, "--json")
    assert code == EXIT_OK
    doc = json.loads(out)
    assert doc["step"] == 10
    tensors = {t["key"]: t for t in doc["tensors"]}
    want = flat_tensors(states[10])
    assert set(tensors) == set(want)
    for key, t in want.items():
        assert tensors[key]["shape"] == list(t.shape)
        assert tensors[key]["bytes"] == t.numel() * t.element_size()
    assert tensors["tied"]["same_as"] == "model/weight"


def test_inspect_unknown_step_exits_3(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    code, _, err = run("inspect", root, "--step", "4")
    assert code == EXIT_NOT_FOUND
    assert "step 4" in err


# -- verify --------------------------------------------------------------------------------------


def test_verify_intact(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    code, out, _ = run("verify", root, "--all")
    assert code == EXIT_OK
    assert [line.split(":")[0] for line in out.splitlines()[:3]] == [f"step {s}" for s in STEPS]
    assert "3 of 3 snapshots intact" in out


def test_verify_names_the_shard_and_keys_of_a_flipped_byte(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    m = manifest_of(root, 5)
    shard = shard_holding(m, "model/bias")
    flip_byte(data_file(root, 5), shard.offset + 17)

    code, out, _ = run("verify", root, "--step", "5")
    assert code == EXIT_DAMAGE
    assert "step 5: DAMAGED: 1 of" in out
    assert f"shard {shard.index} " in out
    assert "checksum mismatch" in out
    assert "model/bias" in out
    # Other steps are untouched.
    assert run("verify", root, "--step", "10")[0] == EXIT_OK

    code, out, _ = run("verify", root, "--step", "5", "--json")
    assert code == EXIT_DAMAGE
    (report,) = json.loads(out)["steps"]
    assert report["ok"] is False
    (damaged,) = report["damaged"]
    assert damaged["shard"] == shard.index
    assert "model/bias" in damaged["keys"]


def test_verify_a_flipped_byte_in_a_tied_weight_names_both_keys(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    m = manifest_of(root, 0)
    shard = shard_holding(m, "model/weight")
    flip_byte(data_file(root, 0), shard.offset + 5)
    code, out, _ = run("verify", root, "--step", "0", "--json")
    assert code == EXIT_DAMAGE
    (damaged,) = json.loads(out)["steps"][0]["damaged"]
    assert {"model/weight", "tied"} <= set(damaged["keys"])


def test_verify_truncated_data_file(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    m = manifest_of(root, 10)
    cut = m.shards[len(m.shards) // 2].offset + 10
    with data_file(root, 10).open("r+b") as f:
        f.truncate(cut)
    lost = [s.index for s in m.shards if s.offset + s.length > cut]

    code, out, _ = run("verify", root, "--json")
    assert code == EXIT_DAMAGE
    (report,) = json.loads(out)["steps"]
    assert [d["shard"] for d in report["damaged"]] == lost
    assert all("truncated" in d["error"] for d in report["damaged"])


def test_verify_all_counts_damaged_snapshots(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    flip_byte(data_file(root, 0), 3)
    code, out, _ = run("verify", root, "--all")
    assert code == EXIT_DAMAGE
    assert "step 0: DAMAGED" in out
    assert "step 5: ok" in out
    assert "2 of 3 snapshots intact" in out


def test_verify_damaged_manifest(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    manifest = root / f"step-{5:012d}" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:-40])
    code, out, _ = run("verify", root, "--step", "5")
    assert code == EXIT_DAMAGE
    assert "the manifest cannot be read" in out
    code, _, err = run("ls", root)
    assert code == EXIT_DAMAGE
    assert "step 5" in err


def test_verify_missing_data_file(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    data_file(root, 5).unlink()
    code, out, _ = run("verify", root, "--step", "5")
    assert code == EXIT_DAMAGE
    assert "missing" in out


# -- progress ------------------------------------------------------------------------------------


def test_progress_is_plain_lines_when_not_on_a_terminal(snapshots: Any, run: Run) -> None:
    root, _ = snapshots
    code, out, err = run("verify", root, "--all")
    assert code == EXIT_OK
    assert "\r" not in err
    done = [line for line in err.splitlines() if ": done, " in line]
    assert [line.split(":")[0] for line in done] == [f"verify step {s}" for s in STEPS]
    assert "verify" not in out  # results on stdout, progress on stderr

    code, _, err = run("verify", root, "-q")
    assert code == EXIT_OK
    assert err == ""


@pytest.mark.slow
def test_a_slow_ls_counts_snapshots_on_stderr(
    snapshots: Any, run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = snapshots
    code, out, err = run("ls", root)
    assert (code, err) == (EXIT_OK, "")  # quick: nothing on stderr
    slow = FileTier.read_manifest

    async def read_manifest(self: FileTier, step: int) -> Manifest:
        await asyncio.sleep(0.6)  # past the 0.5 s between two progress lines set below
        return await slow(self, step)

    monkeypatch.setattr(FileTier, "read_manifest", read_manifest)
    # the console's progress with its plain-line interval (5 s) cut to 0.5 s
    monkeypatch.setattr(cli_console, "Progress", functools.partial(Progress, interval=0.5))
    code, out, err = run("ls", root)
    assert code == EXIT_OK
    assert [line.split()[0] for line in out.splitlines()[1:]] == [str(s) for s in STEPS]
    lines = err.splitlines()
    assert lines[-1].startswith(f"ls: done, {len(STEPS)} snapshots in ")
    assert len(lines) >= 2 and f" of {len(STEPS)} snapshots" in lines[0]


# -- export --------------------------------------------------------------------------------------


def test_export_safetensors_bit_for_bit(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, states = snapshots
    out_file = tmp_path / "step5.safetensors"
    code, _, err = run("export", root, "--step", "5", "--to", out_file)
    assert code == EXIT_OK
    assert "export step 5: done" in err
    loaded = safetensors.torch.load_file(out_file)
    want = flat_tensors(states[5])
    assert set(loaded) == set(want)
    for key, tensor in want.items():
        assert same_bits(loaded[key], tensor), key
    assert loaded["model/emb"].dtype == torch.bfloat16
    with safetensors.safe_open(out_file, "pt") as f:
        assert f.metadata()["lazyckpt.step"] == "5"


def test_export_torch_bit_for_bit(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, states = snapshots
    out_file = tmp_path / "step10.pt"
    code, _, _ = run("export", root, "--to", out_file)  # the latest step
    assert code == EXIT_OK
    with zipfile.ZipFile(out_file) as zf:
        assert zf.testzip() is None  # every record's CRC-32 was filled in
    loaded = torch.load(out_file, weights_only=True)
    assert_same_state(loaded, states[10])
    # Tied weights stay tied: one storage in the file.
    assert loaded["tied"].untyped_storage().data_ptr() == (
        loaded["model"]["weight"].untyped_storage().data_ptr()
    )


def test_export_select_gives_a_loadable_state_dict(
    snapshots: Any, run: Run, tmp_path: Path
) -> None:
    root, states = snapshots
    for name in ("net.safetensors", "net.pt"):
        path = tmp_path / name
        assert run("export", root, "--select", "net", "--to", path, "-q")[0] == EXIT_OK
        loaded = (
            safetensors.torch.load_file(path)
            if name.endswith("safetensors")
            else torch.load(path, weights_only=True)
        )
        fresh = torch.nn.Linear(16, 8)
        fresh.load_state_dict(loaded)
        assert same_bits(fresh.weight, states[10]["net"].weight)
    code, _, err = run("export", root, "--select", "nothing", "--to", tmp_path / "x.pt")
    assert code == EXIT_NOT_FOUND
    assert "'nothing'" in err


def test_export_refuses_to_overwrite_and_unknown_suffix(
    snapshots: Any, run: Run, tmp_path: Path
) -> None:
    root, _ = snapshots
    target = tmp_path / "x.safetensors"
    target.write_bytes(b"keep me")
    code, _, err = run("export", root, "--to", target)
    assert code == EXIT_USAGE
    assert "--force" in err
    assert target.read_bytes() == b"keep me"
    assert run("export", root, "--to", target, "--force", "-q")[0] == EXIT_OK
    assert run("export", root, "--to", tmp_path / "x.data")[0] == EXIT_USAGE


def test_export_of_a_damaged_snapshot_fails_and_leaves_no_file(
    snapshots: Any, run: Run, tmp_path: Path
) -> None:
    root, _ = snapshots
    m = manifest_of(root, 5)
    flip_byte(data_file(root, 5), shard_holding(m, "wide").offset + 1)
    for name in ("x.safetensors", "x.pt"):
        code, _, err = run("export", root, "--step", "5", "--to", tmp_path / name)
        assert code == EXIT_DAMAGE
        assert "wide" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_export_safetensors_refuses_dtypes_it_cannot_hold(run: Run, tmp_path: Path) -> None:
    root = tmp_path / "c"
    with SyncCheckpointer([FileTier(root)], **SMALL) as ckpt:
        ckpt.snapshot({"z": torch.zeros(3, dtype=torch.complex128)}, step=1).wait()
    code, _, err = run("export", root, "--to", tmp_path / "z.safetensors")
    assert code == EXIT_USAGE
    assert "complex128" in err
    assert run("export", root, "--to", tmp_path / "z.pt", "-q")[0] == EXIT_OK


# -- import --------------------------------------------------------------------------------------


def test_export_then_import_safetensors_is_exact(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, states = snapshots
    file = tmp_path / "s.safetensors"
    assert run("export", root, "--step", "5", "--to", file, "-q")[0] == EXIT_OK
    target = tmp_path / "imported"
    code, _, err = run("import", file, "--to", target, "--step", "50")
    assert code == EXIT_OK
    assert "import step 50: done" in err
    assert run("verify", target, "-q")[0] == EXIT_OK
    restored = restore(target, 50)
    assert_same_state(restored, states[5])  # plain values and structure come back too
    assert restored["tied"] is restored["model"]["weight"]


def test_import_torch_file(snapshots: Any, run: Run, tmp_path: Path) -> None:
    _, states = snapshots
    state = states[10]
    file = tmp_path / "plain.pt"
    torch.save({**state, "net": state["net"].state_dict()}, file)
    target = tmp_path / "t"
    assert run("import", file, "--to", target, "--step", "3", "-q")[0] == EXIT_OK
    assert_same_state(restore(target, 3), state)


def test_import_foreign_safetensors_under_a_key(run: Run, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    weights = {
        "layer.0.weight": torch.randn(200, 100, generator=g),
        "layer.0.bias": random_bits((100,), torch.bfloat16, g),
        "count": torch.arange(5),
    }
    file = tmp_path / "w.safetensors"
    safetensors.torch.save_file(weights, file)
    target = tmp_path / "t"
    code, _, _ = run(
        "import", file, "--to", target, "--step", "1", "--under", "model", "--shard-size", "16KiB"
    )
    assert code == EXIT_OK
    restored = restore(target, 1)
    assert set(restored) == {"model"}
    assert set(restored["model"]) == set(weights)
    for key, tensor in weights.items():
        assert same_bits(restored["model"][key], tensor), key
    assert len(manifest_of(target, 1).shards) > 4  # the 16 KiB shards were used


def test_import_refuses_code_unless_allowed(run: Run, tmp_path: Path) -> None:
    file = tmp_path / "obj.pt"
    torch.save({"ratio": fractions.Fraction(1, 3), "w": torch.ones(2)}, file)
    target = tmp_path / "t"
    code, _, err = run("import", file, "--to", target, "--step", "1")
    assert code == EXIT_USAGE
    assert "--allow-pickle" in err
    assert run("import", file, "--to", target, "--step", "1", "--allow-pickle", "-q")[0] == 0
    with SyncCheckpointer([FileTier(target)], allow_pickle=True) as ckpt:
        assert ckpt.restore(1)["ratio"] == fractions.Fraction(1, 3)


def test_import_refuses_a_committed_step(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, _ = snapshots
    file = tmp_path / "s.safetensors"
    safetensors.torch.save_file({"a": torch.ones(3)}, file)
    code, _, err = run("import", file, "--to", root, "--step", "5")
    assert code == EXIT_USAGE
    assert "already committed" in err
    assert_same_state(restore(root, 5)["ids"], torch.arange(10) * 5)


def test_import_errors(run: Run, tmp_path: Path) -> None:
    assert run("import", tmp_path / "none.pt", "--to", tmp_path / "t", "--step", "1")[0] == 3
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"definitely not a checkpoint")
    assert run("import", junk, "--to", tmp_path / "t", "--step", "1")[0] == EXIT_USAGE
    good = tmp_path / "g.safetensors"
    safetensors.torch.save_file({"a": torch.ones(3)}, good)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run("import", good, "--to", blocker / "sub", "--step", "1")
    assert code == EXIT_STORAGE
    assert "storage error" in err


# -- copy ----------------------------------------------------------------------------------------


def test_copy_every_step_then_again(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, states = snapshots
    dst = tmp_path / "dst"
    code, out, _ = run("copy", root, dst)
    assert code == EXIT_OK
    assert [line.split(":")[0] for line in out.splitlines()] == [f"step {s}" for s in STEPS]
    assert run("verify", dst, "--all", "-q")[0] == EXIT_OK
    for step in STEPS:
        assert_same_state(restore(dst, step), states[step])
        assert manifest_of(dst, step).shards == manifest_of(root, step).shards

    code, out, err = run("copy", root, dst, "--step", "5")
    assert code == EXIT_OK
    assert "already on" in err
    assert out == ""


def test_copy_never_spreads_damage(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, _ = snapshots
    m = manifest_of(root, 5)
    flip_byte(data_file(root, 5), m.shards[-1].offset)
    dst = tmp_path / "dst"
    code, out, err = run("copy", root, dst, "--step", "0", "--step", "5", "--step", "10")
    assert code == EXIT_DAMAGE
    assert f"shard {m.shards[-1].index}" in err
    # the damaged step is named and skipped; the intact ones after it are still copied
    assert "step 5: NOT copied" in err
    assert "1 of 3 steps were not copied" in err and ": 5 (copied: 0, 10)" in err
    assert [line.split(":")[0] for line in out.splitlines()] == ["step 0", "step 10"]
    assert [p.name for p in sorted(dst.glob("step-*"))] == [
        "step-000000000000",
        "step-000000000010",
    ]  # the partial step was aborted
    assert run("verify", dst, "--all", "-q")[0] == EXIT_OK


def test_copy_unknown_step(snapshots: Any, run: Run, tmp_path: Path) -> None:
    root, _ = snapshots
    assert run("copy", root, tmp_path / "d", "--step", "7")[0] == EXIT_NOT_FOUND


# -- gc ------------------------------------------------------------------------------------------


def test_gc_dry_run_then_delete(run: Run, tmp_path: Path) -> None:
    root = tmp_path / "gc"
    with SyncCheckpointer([FileTier(root)], **SMALL) as ckpt:
        for step in (1, 2, 3, 4, 6):
            ckpt.snapshot({"x": torch.full((4,), float(step))}, step=step).wait()

    code, out, err = run("gc", root, "--keep-last", "2", "--keep-every", "3", "--dry-run")
    assert code == EXIT_OK
    assert out.splitlines() == ["would delete step 1", "would delete step 2"]
    assert "would keep 3 of 5" in err
    assert len(list(root.glob("step-*"))) == 5

    code, out, _ = run("gc", root, "--keep-last", "2", "--keep-every", "3")
    assert code == EXIT_OK
    assert out.splitlines() == ["deleted step 1", "deleted step 2"]
    code, out, _ = run("ls", root, "--json")
    assert [e["step"] for e in json.loads(out)] == [3, 4, 6]
    assert run("gc", root, "--keep-last", "0")[0] == EXIT_USAGE
    assert run("gc", root)[0] == EXIT_USAGE


# -- the bounded reader --------------------------------------------------------------------------


class CountingTier(FileTier):
    """A file tier that records how many reads overlap and which buffers they fill."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.active = 0
        self.most = 0
        self.buffers: set[int] = set()

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        await self._counted(super().read_shard(manifest, shard, out), out)

    async def read_shard_checksummed(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview
    ) -> int:
        # the read a verified read takes on a FileTier (it checksums while reading)
        return await self._counted(super().read_shard_checksummed(manifest, shard, out), out)

    async def _counted(self, read: Awaitable[_T], out: memoryview) -> _T:
        self.active += 1
        self.most = max(self.most, self.active)
        self.buffers.add(id(out.obj))
        try:
            await asyncio.sleep(0)  # let the other reads start if the reader allows them
            return await read
        finally:
            self.active -= 1


async def test_shard_reader_holds_a_bounded_window(tmp_path: Path) -> None:
    state = {"big": torch.randn(2000, 64), "more": torch.randn(1000, 64)}
    manifest, payloads = build_snapshot(1, state, shard_size=16 << 10, pack_bytes=1024)
    assert len(manifest.shards) > 20
    tier = CountingTier(tmp_path)
    try:
        await tier.begin(manifest)
        for shard, payload in zip(manifest.shards, payloads, strict=True):
            await tier.put_shard(manifest, shard, memoryview(payload))
        await tier.commit(manifest)
        seen = []
        async with ShardReader(tier, manifest, jobs=3) as reader:
            async for read in reader:
                assert read.error is None
                assert read.data is not None
                assert bytes(read.data) == payloads[read.shard.index]
                seen.append(read.shard.index)
        assert seen == list(range(len(manifest.shards)))  # in order
        assert tier.most == 3
        assert len(tier.buffers) <= 4  # jobs + the one the caller holds: memory stays flat
    finally:
        await tier.aclose()


# -- the progress display ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_prints_a_plain_line_per_interval() -> None:
    stream, clock = io.StringIO(), Clock()
    with Progress(4 << 20, "copy step 3", stream=stream, clock=clock, interval=5.0) as bar:
        for _ in range(4):
            clock.now += 2.0
            bar.advance(1 << 20)
    assert stream.getvalue().splitlines() == [
        "copy step 3: 75%, 3.0 MiB of 4.0 MiB, 512.0 KiB/s, 0:02 left",  # at 6 s, not 4 s
        "copy step 3: done, 4.0 MiB in 8.0 s (512.0 KiB/s)",
    ]


def test_progress_redraws_one_line_on_a_terminal() -> None:
    stream, clock = io.StringIO(), Clock()
    with Progress(1000, "verify", stream=stream, tty=True, clock=clock) as bar:
        clock.now = 1.0
        bar.advance(250)
        clock.now = 2.0
        bar.advance(250)
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    frames = text.split("\r")[1:]
    assert "[" in frames[0] and " 25%" in frames[0] and "250 B of 1000 B" in frames[0]
    assert " 50%" in frames[1] and "0:02 left" in frames[1]
    assert frames[-1].startswith("verify: done, 500 B in 2.0 s")


def test_progress_counts_things_in_their_unit() -> None:
    stream, clock = io.StringIO(), Clock()
    with Progress(40, "ls", unit="snapshots", stream=stream, clock=clock, interval=5.0) as bar:
        clock.now = 5.0
        bar.advance(10)
        clock.now = 8.0
        bar.advance(30)
    assert stream.getvalue().splitlines() == [
        "ls: 25%, 10 of 40 snapshots, 2.0 snapshots/s, 0:15 left",
        "ls: done, 40 snapshots in 8.0 s (5.0 snapshots/s)",
    ]


def test_progress_of_things_says_nothing_when_quick() -> None:
    stream, clock = io.StringIO(), Clock()
    with Progress(3, "gc", unit="snapshots", summary=False, stream=stream, clock=clock) as bar:
        clock.now = 4.0
        bar.advance(3)
    assert stream.getvalue() == ""
    with Progress(3, "gc", unit="snapshots", summary=False, stream=stream, clock=clock) as bar:
        clock.now = 10.0
        bar.advance(2)
        clock.now = 12.0
        bar.advance(1)
    assert stream.getvalue().splitlines()[-1] == "gc: done, 3 snapshots in 8.0 s (0.4 snapshots/s)"


def test_progress_says_where_it_stopped() -> None:
    stream, clock = io.StringIO(), Clock()
    with pytest.raises(KeyError), Progress(100, "export", stream=stream, clock=clock) as bar:
        bar.advance(40)
        raise KeyError("boom")
    assert stream.getvalue() == "export: stopped at 40%, 40 B\n"


def test_progress_can_be_silenced_and_asks_the_stream_about_terminals() -> None:
    stream = io.StringIO()
    with Progress(10, "x", stream=stream, enabled=False) as bar:
        bar.advance(10)
    assert stream.getvalue() == ""
    assert Progress(1, "x", stream=stream).tty is False  # StringIO is not a terminal


def test_sizes_and_durations_for_people() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 5 << 20, 3 << 40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.0 MiB",
        "3.0 TiB",
    ]
    assert [format_duration(s) for s in (0, 59.4, 61, 3725)] == ["0:00", "0:59", "1:01", "1:02:05"]


# -- S3 (SeaweedFS on 127.0.0.1) and Zarr --------------------------------------------------------


@pytest.fixture
def s3_env(s3: S3Location, monkeypatch: pytest.MonkeyPatch) -> str:
    """The S3 URL of a fresh prefix, with the test server configured the way a user would:
    through the standard AWS environment variables."""
    options = s3.server.tier_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_REGION", options["region"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    return s3.url


@pytest.mark.s3
def test_every_subcommand_on_s3(
    snapshots: Any, run: Run, tmp_path: Path, s3: S3Location, s3_env: str
) -> None:
    root, states = snapshots
    url = s3_env
    assert run("copy", root, url, "-q")[0] == EXIT_OK  # promote to S3, read back and checked

    code, out, _ = run("ls", url, root, "--json")
    assert code == EXIT_OK
    entries = json.loads(out)
    assert [e["step"] for e in entries] == list(STEPS)
    assert entries[0]["tiers"] == ["zarr", "file"]

    code, out, _ = run("inspect", url, "--step", "5")
    assert code == EXIT_OK
    assert "model/" in out.splitlines()

    assert run("verify", url, "--all", "-q")[0] == EXIT_OK

    file = tmp_path / "from-s3.safetensors"
    assert run("export", url, "--step", "5", "--to", file, "-q")[0] == EXIT_OK
    loaded = safetensors.torch.load_file(file)
    for key, tensor in flat_tensors(states[5]).items():
        assert same_bits(loaded[key], tensor), key

    assert run("import", file, "--to", url, "--step", "99", "-q")[0] == EXIT_OK
    back = tmp_path / "back"
    assert run("copy", url, back, "--step", "99", "-q")[0] == EXIT_OK
    assert_same_state(restore(back, 99), states[5])

    code, out, _ = run("gc", url, "--keep-last", "2")
    assert code == EXIT_OK
    assert out.splitlines() == ["deleted step 0", "deleted step 5"]
    code, out, _ = run("ls", url, "--json")
    assert [e["step"] for e in json.loads(out)] == [10, 99]


@pytest.mark.s3
def test_verify_names_a_damaged_object_on_s3(
    snapshots: Any, run: Run, s3: S3Location, s3_env: str
) -> None:
    root, _ = snapshots
    assert run("copy", root, s3_env, "--step", "10", "-q")[0] == EXIT_OK
    client = s3.server.client()
    key = next(k for k in sorted(s3.keys()) if "/tensors/wide/c/" in k)
    body = bytearray(client.get_object(Bucket=s3.server.bucket, Key=key)["Body"].read())
    body[20] ^= 0x01
    client.put_object(Bucket=s3.server.bucket, Key=key, Body=bytes(body))

    code, out, _ = run("verify", s3_env, "--json")
    assert code == EXIT_DAMAGE
    (damaged,) = json.loads(out)["steps"][0]["damaged"]
    assert damaged["keys"] == ["wide"]


def test_zarr_directory_is_recognised_and_verified(
    snapshots: Any, run: Run, tmp_path: Path
) -> None:
    root, _ = snapshots
    zdir = tmp_path / "z"
    assert run("copy", root, f"zarr+file://{zdir}", "--step", "5", "-q")[0] == EXIT_OK
    assert (zdir / "zarr.json").is_file()
    code, out, _ = run("ls", zdir, "--json")  # a plain path to a Zarr root
    assert code == EXIT_OK
    assert json.loads(out)[0]["tiers"] == ["zarr"]
    assert run("verify", zdir, "-q")[0] == EXIT_OK
    chunk = next(zdir.glob("step-*/tensors/wide/c/0*"))
    chunk = next(chunk.rglob("*")) if chunk.is_dir() else chunk
    flip_byte(chunk, 8)
    code, out, _ = run("verify", zdir)
    assert code == EXIT_DAMAGE
    assert "wide elements" in out
