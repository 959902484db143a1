"""Incremental snapshots: only the shards whose bytes changed are written; every step stays
restorable on its own, through retention, deletion, a restart and the CLI."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
import zarr

import lazyckpt
from lazyckpt import ConfigurationError, CorruptionError, Manifest
from lazyckpt.testing import build_snapshot
from tiers import FileTier, HostMemoryTier, ZarrTier

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


class FineTune:
    """A fine-tune's state: a frozen base (the same tensors every step) and a small trainable
    part that an optimizer step changes."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        # larger than eager_bytes (1 MiB), as a model's weights are: captured lazily
        self.base = {f"layer{i}": torch.randn(600, 512, generator=g) for i in range(4)}
        self.base["norm"] = torch.randn(256, generator=g)  # small: packed with others
        self.adapter = {"a": torch.randn(256, 8, generator=g), "b": torch.zeros(8, 256)}

    def train(self, step: int) -> None:
        with torch.no_grad():  # in place, as an optimizer does: the version counters move
            self.adapter["a"].add_(0.01 * (step + 1))
            self.adapter["b"].add_(0.02)

    def state(self, step: int) -> dict[str, Any]:
        return {"base": self.base, "adapter": self.adapter, "step": step}

    def copy(self, step: int) -> dict[str, Any]:
        return {
            "base": {k: v.clone() for k, v in self.base.items()},
            "adapter": {k: v.clone() for k, v in self.adapter.items()},
            "step": step,
        }


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return bool(a == b)


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


def used_bytes(root: Path) -> int:
    """Bytes the files under ``root`` really take (a sparse file's holes take none)."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


async def run(
    root: Path, steps: range, mode: bool | str, model: FineTune, **options: Any
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    expected = {}
    tier = FileTier(root, keep_last=options.pop("keep_last", None))
    async with lazyckpt.Checkpointer([tier], incremental=mode, **SMALL, **options) as ckpt:
        for step in steps:
            model.train(step)
            handle = await ckpt.snapshot(model.state(step), step=step)
            expected[step] = model.copy(step)
            await handle.committed()
        metrics = ckpt.metrics()
    return expected, metrics


# -- the manifest ----------------------------------------------------------------------------


def test_manifest_round_trips_digests_and_references() -> None:
    manifest, _ = build_snapshot(7, {"w": torch.randn(300, 100)}, shard_size=1 << 14)
    n = len(manifest.shards)
    digests = [f"{i:032x}" for i in range(n)]
    plain = manifest.with_digests(digests)
    assert plain.format_version() <= 3  # digests alone: older readers still read it
    refers = plain.with_references({0: 3, 2: 5})
    assert refers.format_version() == 4  # an older reader would read the wrong bytes
    assert refers.references() == {3, 5}
    back = Manifest.from_json(refers.to_json())
    assert back.shards == refers.shards
    assert [s.stored_in for s in back.shards[:3]] == [3, None, 5]
    assert back.self_contained().references() == frozenset()
    assert back.self_contained().shards[0].digest == digests[0]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("digest", "XYZ", "bad digest"), ("stored_in", 7, "its own step"), ("stored_in", -1, ">= 0")],
)
def test_manifest_refuses_bad_references(field: str, value: object, message: str) -> None:
    manifest, _ = build_snapshot(7, {"w": torch.randn(300, 100)}, shard_size=1 << 14)
    doc = json.loads(manifest.with_references({0: 3}).to_json())
    doc.pop("checksum")
    doc["shards"][0][field] = value
    body = json.dumps(doc, separators=(",", ":"))
    raw = body[:-1] + f',"checksum":{crc32c.crc32c(body.encode())}}}'
    with pytest.raises(CorruptionError, match=message):
        Manifest.from_json(raw)


def test_incremental_option_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="incremental must be"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], incremental="yes")


# -- what is written, and what is restored -----------------------------------------------------


@pytest.mark.parametrize("mode", [True, "versions"])
async def test_fine_tune_writes_only_what_changed(mode: bool | str, tmp_path: Path) -> None:
    model = FineTune()
    expected, metrics = await run(tmp_path / "inc", range(8), mode, model)
    _, full = await run(tmp_path / "full", range(8), False, FineTune())
    written = metrics["tiers"]["file"]["bytes"]
    state_bytes = sum(t.nbytes for t in [*model.base.values(), *model.adapter.values()])
    # the first snapshot writes everything, each later one the adapter's shards only
    assert written < state_bytes + 7 * (2 * SMALL["shard_size"])
    assert full["tiers"]["file"]["bytes"] >= 8 * state_bytes
    assert metrics["tiers"]["file"]["reused_bytes"] >= 7 * 4 * 600 * 512 * 4
    if mode == "versions":  # the frozen base was not even copied after the first snapshot
        assert metrics["capture_skipped_bytes"] >= 7 * 4 * 600 * 512 * 4
    else:
        assert metrics["capture_skipped_bytes"] == 0
    assert used_bytes(tmp_path / "inc") < used_bytes(tmp_path / "full") / 4
    # every step restores on its own, bit for bit, in a new process's Checkpointer
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "inc", readonly=True)]) as ckpt:
        assert await ckpt.steps() == list(range(8))
        for step in range(8):
            assert equal(await ckpt.restore(step=step), expected[step])
            assert (await ckpt.verify(step)).ok
        manifest = await ckpt._core.engine.tiers[0].read_manifest(7)
        assert manifest.references() == {0}  # flattened: never a chain through step 6
        assert manifest.extra["incremental"] is True


async def test_full_fine_tune_writes_everything(tmp_path: Path) -> None:
    """When every tensor changes, nothing is referred to, and the steps are plain."""
    model = FineTune()
    g = torch.Generator().manual_seed(1)

    def train_all(step: int) -> None:
        with torch.no_grad():
            for t in [*model.base.values(), *model.adapter.values()]:
                t.add_(torch.randn(t.shape, generator=g))

    model.train = train_all  # type: ignore[method-assign]
    expected, metrics = await run(tmp_path, range(3), True, model)
    assert metrics["tiers"]["file"]["reused_bytes"] == 0
    tier = FileTier(tmp_path, readonly=True)
    async with lazyckpt.Checkpointer([tier]) as ckpt:
        for step in range(3):
            assert equal(await ckpt.restore(step=step), expected[step])
        # the version counters moved: after the first snapshot no chunk is even hashed (the
        # small tensors copied at snapshot() have no counter to go by: always hashed)
        assert all(s.digest for s in (await tier.read_manifest(0)).shards)
        later = await tier.read_manifest(2)
        large = [s for s in later.shards if later.tensors[s.segments[0].tensor].nbytes > 1 << 20]
        assert large and not any(s.digest for s in large)


def crc_preserving_mask(n: int) -> bytes:
    """A nonzero n-byte mask ``d`` with ``crc32c(x ^ d) == crc32c(x)`` for every ``x`` of n
    bytes: CRC-32C is affine over GF(2), so 64 bits of freedom give a kernel vector."""
    zero = crc32c.crc32c(bytes(n))
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (vector, the unit masks it is made of)
    for j in range(64):
        unit = bytearray(n)
        unit[j // 8] |= 1 << (j % 8)
        vector, made_of = crc32c.crc32c(bytes(unit)) ^ zero, 1 << j
        while vector:
            top = vector.bit_length() - 1
            if top not in basis:
                basis[top] = (vector, made_of)
                break
            vector ^= basis[top][0]
            made_of ^= basis[top][1]
        else:
            return int.to_bytes(made_of, 8, "little") + bytes(n - 8)
    raise AssertionError("64 vectors in a 32-bit space are dependent")


async def test_a_change_with_the_same_crc32c_is_written(tmp_path: Path) -> None:
    """The crc32c alone would take this changed shard for the unchanged one: the digest does
    not, so the change is written and restored."""
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)  # exactly one shard
    mask = torch.frombuffer(bytearray(crc_preserving_mask(1 << 16)), dtype=torch.uint8)
    changed = data ^ mask
    assert not torch.equal(changed, data)
    assert crc32c.crc32c(changed.numpy().tobytes()) == crc32c.crc32c(data.numpy().tobytes())
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], incremental=True, **SMALL) as ckpt:
        await (await ckpt.snapshot({"w": data}, step=1)).committed()
        await (await ckpt.snapshot({"w": changed}, step=2)).committed()
        assert ckpt.metrics()["tiers"]["file"]["reused_bytes"] == 0
        assert torch.equal((await ckpt.restore(step=2))["w"], changed)
        assert torch.equal((await ckpt.restore(step=1))["w"], data)


async def test_versions_skips_only_unchanged_frozen_tensors(tmp_path: Path) -> None:
    """``"versions"`` trusts the version counter; a write through ``.data`` bypasses it and
    is missed (as documented), while ``True`` compares the bytes and writes it."""
    for mode, sees_it in (("versions", False), (True, True)):
        root = tmp_path / str(mode)
        frozen = torch.zeros(600, 512)  # above eager_bytes: captured lazily
        trainable = torch.nn.Parameter(torch.zeros(600, 512))  # requires grad: never skipped
        async with lazyckpt.Checkpointer([FileTier(root)], incremental=mode, **SMALL) as ckpt:
            await (await ckpt.snapshot({"f": frozen, "t": trainable}, step=1)).committed()
            frozen.data.fill_(1.0)  # bypasses the version counter
            await (await ckpt.snapshot({"f": frozen, "t": trainable}, step=2)).committed()
            restored = await ckpt.restore(step=2)
            assert torch.equal(restored["f"], frozen) is sees_it
            frozen.fill_(2.0)  # moves the version counter: seen by both
            await (await ckpt.snapshot({"f": frozen, "t": trainable}, step=3)).committed()
            assert torch.equal((await ckpt.restore(step=3))["f"], frozen)
            skipped = ckpt.metrics()["capture_skipped_bytes"]
        # only "f" at step 2 was skipped: "t" requires grad, and "f" changed at step 3
        assert skipped == (frozen.nbytes if mode == "versions" else 0)


async def test_versions_never_skips_a_modules_trainable_parameters(tmp_path: Path) -> None:
    """A module is walked with ``keep_vars=True``: its trainable parameters come as
    themselves, require grad and are captured every time, so a write through ``.data`` is
    seen; a frozen parameter written the same way is skipped (the documented miss)."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 600), torch.nn.Linear(512, 600))
    model[1].weight.requires_grad_(False)  # above eager_bytes, like model[0].weight
    async with lazyckpt.Checkpointer(
        [FileTier(tmp_path)], incremental="versions", **SMALL
    ) as ckpt:
        await (await ckpt.snapshot({"m": model}, step=1)).committed()
        for layer in model:
            layer.weight.data.fill_(3.0)  # bypasses the version counter
        await (await ckpt.snapshot({"m": model}, step=2)).committed()
        restored = (await ckpt.restore(step=2))["m"]
        assert torch.equal(restored["0.weight"], model[0].weight.detach())
        assert not torch.equal(restored["1.weight"], model[1].weight.detach())
        assert ckpt.metrics()["capture_skipped_bytes"] == model[1].weight.nbytes


async def test_a_freed_tensor_is_not_taken_for_a_new_one(tmp_path: Path) -> None:
    """A tensor made anew for every snapshot may land at the address of the last one, with
    the same version: the engine holds the captured tensors, so it never does."""
    async with lazyckpt.Checkpointer(
        [FileTier(tmp_path)], incremental="versions", **SMALL
    ) as ckpt:
        for step in range(4):
            fresh = torch.full((600, 512), float(step))
            await (await ckpt.snapshot({"x": fresh}, step=step)).committed()
            del fresh
            restored = (await ckpt.restore(step=step))["x"]
            assert torch.equal(restored, torch.full((600, 512), float(step)))


async def test_host_tier_in_front(tmp_path: Path) -> None:
    """With a host tier first, the durable tier is incremental; every step restores."""
    model = FineTune()
    chain = [HostMemoryTier(8 << 20), FileTier(tmp_path)]
    expected = {}
    async with lazyckpt.Checkpointer(chain, incremental="versions", **SMALL) as ckpt:
        for step in range(4):
            model.train(step)
            expected[step] = model.copy(step)
            await (await ckpt.snapshot(model.state(step), step=step)).committed()
        for step in range(4):
            assert equal(await ckpt.restore(step=step), expected[step])
        assert ckpt.metrics()["tiers"]["file"]["reused_bytes"] > 0
        # the host tier keeps only steps it holds whole: the first, captured in full; the
        # others skipped the frozen base's capture and restore from the file tier
        assert await chain[0].steps() == [0]


# -- retention, deletion, restarts ------------------------------------------------------------


async def test_retention_keeps_what_kept_steps_refer_to(tmp_path: Path) -> None:
    model = FineTune()
    expected, _ = await run(tmp_path, range(10), True, model, keep_last=3)
    on_disk = step_dirs(tmp_path)
    # step 0 holds the frozen base every kept step refers to: retired, not deleted
    assert on_disk == ["step-000000000000", *(f"step-{s:012d}" for s in (7, 8, 9))]
    assert (tmp_path / "step-000000000000" / "retired").exists()
    assert not (tmp_path / "step-000000000000" / "manifest.json").exists()
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], incremental=True, **SMALL) as ckpt:
        assert await ckpt.steps() == [7, 8, 9]  # a restart keeps the retired data
        assert (tmp_path / "step-000000000000").exists()
        for step in (7, 8, 9):
            assert equal(await ckpt.restore(step=step), expected[step])
        for step in (7, 8):
            await ckpt.delete(step)
        assert (tmp_path / "step-000000000000").exists()  # step 9 still refers to it
        await ckpt.delete(9)
        assert not step_dirs(tmp_path)  # nothing refers to it any more


async def test_a_crash_leftover_goes_but_retired_data_stays(tmp_path: Path) -> None:
    model = FineTune()
    expected, _ = await run(tmp_path, range(5), True, model, keep_last=2)
    torn = tmp_path / "step-000000000005"
    shutil.copytree(tmp_path / "step-000000000004", torn)  # a step whose commit never came
    (torn / "manifest.json").unlink()
    unmarked = tmp_path / "step-000000000000"
    (unmarked / "retired").unlink()  # a crash before the mark: the references still count
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], **SMALL) as ckpt:
        assert not torn.exists()
        assert unmarked.exists()
        assert equal(await ckpt.restore(step=4), expected[4])


async def test_a_retired_step_number_is_not_overwritten(tmp_path: Path) -> None:
    """A tier refuses to begin a step over data that committed steps refer to (a Checkpointer
    never asks, since steps increase; an import or another tool might)."""
    model = FineTune()
    expected, _ = await run(tmp_path, range(4), True, model)
    tier = FileTier(tmp_path)
    await tier.open()
    try:
        await tier.delete(0)  # retired: steps 1-3 read the base from it
        manifest = await tier.read_manifest(2)
        assert 0 in manifest.references()
        with pytest.raises(lazyckpt.TierError, match="refer to"):
            await tier.begin(replace(manifest.self_contained(), step=0))
    finally:
        await tier.aclose()
    async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as ckpt:
        for step in (1, 2, 3):
            assert equal(await ckpt.restore(step=step), expected[step])


async def test_deleting_the_referrers_frees_the_data(tmp_path: Path) -> None:
    model = FineTune()
    await run(tmp_path, range(3), True, model)
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], incremental=True, **SMALL) as ckpt:
        await ckpt.delete(0)
        assert (tmp_path / "step-000000000000" / "retired").exists()
        await ckpt.delete(1)
        assert (tmp_path / "step-000000000000").exists()  # step 2 still refers to it
        await ckpt.delete(2)
        assert not step_dirs(tmp_path)


# -- the command line ---------------------------------------------------------------------------


def test_cli_verify_export_copy_and_gc_follow_references(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio

    import safetensors.torch

    from lazyckpt.cli import EXIT_OK, main

    def cli(*argv: str | Path) -> tuple[int, str]:
        code = main([str(a) for a in argv])
        return code, capsys.readouterr().out

    root = tmp_path / "run"
    expected, _ = asyncio.run(run(root, range(4), True, FineTune()))
    assert cli("verify", root, "--all")[0] == EXIT_OK
    out = tmp_path / "step3.safetensors"
    assert cli("export", root, "--step", "3", "--to", out)[0] == EXIT_OK
    loaded = safetensors.torch.load_file(out)
    assert torch.equal(loaded["base/layer0"], expected[3]["base"]["layer0"])
    assert torch.equal(loaded["adapter/a"], expected[3]["adapter"]["a"])
    # a copy is whole at the destination, whichever steps it refers to at the source
    copy = tmp_path / "copy"
    assert cli("copy", root, copy, "--step", "3", "-q")[0] == EXIT_OK
    assert step_dirs(copy) == ["step-000000000003"]

    async def check_copy() -> None:
        tier = FileTier(copy, readonly=True)
        async with lazyckpt.Checkpointer([tier]) as ckpt:
            assert (await tier.read_manifest(3)).references() == frozenset()
            assert equal(await ckpt.restore(step=3), expected[3])

    asyncio.run(check_copy())
    # gc retires step 0 (steps 2 and 3 read the base from it), and frees it once they go
    code, printed = cli("gc", root, "--keep-last", "2")
    assert code == EXIT_OK and "deleted step 0" in printed
    assert (root / "step-000000000000" / "retired").exists()
    assert cli("verify", root, "--all")[0] == EXIT_OK
    code, printed = cli("gc", root, "--keep-last", "1")
    assert code == EXIT_OK and "deleted step 2" in printed
    assert (root / "step-000000000000").exists()  # step 3 still refers to it


# -- ZarrTier ---------------------------------------------------------------------------------


def plain_zarr_tensors(root: Path, step: int) -> dict[str, np.ndarray]:
    """Every tensor of a step as plain zarr reads it, by the recipe in docs/zarr.md: the
    ``arrays`` map (a path from the root when it starts with ``/``) and the packed index
    (an ``array`` entry naming another step's packed array)."""
    store = zarr.open_group(root, mode="r")
    snap = store[f"step-{step:012d}"]
    found = {}
    for key, path in snap.attrs["lazyckpt"]["arrays"].items():
        arr = store[path[1:]] if path.startswith("/") else snap[path]
        found[key] = arr[:]
    if snap.attrs["lazyckpt"]["packed"]:
        for key, e in snap["packed"].attrs["lazyckpt"]["index"].items():
            blob = store[e["array"][1:]] if "array" in e else snap["packed"]
            raw = blob[e["offset"] : e["offset"] + e["nbytes"]]
            found[key] = raw.view(e["data_type"]).reshape(e["shape"])
    return found


async def test_zarr_tier_is_incremental_and_plain_zarr_reads_every_step(tmp_path: Path) -> None:
    model = FineTune()
    g = torch.Generator().manual_seed(3)
    # an embedding table with a few rows updated per step: some of its chunks change
    model.adapter["emb"] = torch.randn(400, 256, generator=g)
    train = model.train

    def train_with_rows(step: int) -> None:
        train(step)
        with torch.no_grad():
            model.adapter["emb"][step * 7 % 400].add_(1.0)

    model.train = train_with_rows  # type: ignore[method-assign]
    expected = {}
    tier = ZarrTier(tmp_path, keep_last=3)
    async with lazyckpt.Checkpointer([tier], incremental=True, **SMALL) as ckpt:
        for step in range(6):
            model.train(step)
            expected[step] = model.copy(step)
            await (await ckpt.snapshot(model.state(step), step=step)).committed()
        written = ckpt.metrics()["tiers"]["zarr"]["bytes"]
        assert ckpt.metrics()["tiers"]["zarr"]["reused_bytes"] >= 5 * 4 * 600 * 512 * 4
        for step in (3, 4, 5):
            assert equal(await ckpt.restore(step=step), expected[step])
    state_bytes = sum(t.nbytes for t in _leaves(expected[0]))
    assert written < state_bytes + 5 * state_bytes // 10
    index = json.loads((tmp_path / "zarr.json").read_text())["attributes"]["lazyckpt"]
    assert index["committed"] == [3, 4, 5]
    assert index["retired"] == [0]  # the frozen base lives there; steps 3-5 refer to it
    for step in (3, 4, 5):
        plain = plain_zarr_tensors(tmp_path, step)
        for part in ("base", "adapter"):
            for name, t in expected[step][part].items():
                assert np.array_equal(plain[f"{part}/{name}"], t.numpy()), (step, part, name)
    snap = zarr.open_group(tmp_path, mode="r")["step-000000000005"]
    assert snap.attrs["lazyckpt"]["arrays"]["base/layer0"].startswith("/step-000000000000/")
    packed = snap["packed"].attrs["lazyckpt"]["index"]["base/norm"]
    assert packed["array"] == "/step-000000000000/packed"
    # deleting the steps that refer to it frees the retired step's objects
    async with lazyckpt.Checkpointer([ZarrTier(tmp_path)], **SMALL) as ckpt:
        for step in (3, 4, 5):
            await ckpt.delete(step)
    assert not step_dirs(tmp_path)
    index = json.loads((tmp_path / "zarr.json").read_text())["attributes"]["lazyckpt"]
    assert index["committed"] == [] and "retired" not in index


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _leaves(v)]
    return []


async def test_lazy_restore_reads_through_references(tmp_path: Path) -> None:
    """A lazy restore into a guarded optimizer, of a step that refers to earlier data, is
    bit for bit the state snapshotted."""
    torch.manual_seed(0)
    frozen = torch.nn.Linear(600, 512)
    frozen.requires_grad_(False)
    head = torch.nn.Linear(512, 4)
    optim = torch.optim.Adam(head.parameters())
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], incremental=True, **SMALL) as ckpt:
        ckpt.guard(optim)
        for step in range(3):
            head(frozen(torch.randn(2, 600))).sum().backward()
            optim.step()
            optim.zero_grad()
            state = {"frozen": frozen, "head": head, "optim": optim}
            await (await ckpt.snapshot(state, step=step)).committed()
        assert ckpt.metrics()["tiers"]["file"]["reused_bytes"] > 0
    torch.manual_seed(1)
    frozen2, head2 = torch.nn.Linear(600, 512), torch.nn.Linear(512, 4)
    optim2 = torch.optim.Adam(head2.parameters())
    async with lazyckpt.Checkpointer([FileTier(tmp_path)], **SMALL) as ckpt:
        ckpt.guard(optim2)
        await ckpt.restore(2, into={"frozen": frozen2, "head": head2, "optim": optim2}, lazy=True)
        assert torch.equal(frozen2.weight, frozen.weight)  # read from step 0's data
        assert torch.equal(head2.weight, head.weight)
        head2.zero_grad()
        optim2.step()  # no gradients: changes nothing, but waits for the optimizer's state
    for i, moments in optim.state_dict()["state"].items():
        for name, value in moments.items():
            assert torch.equal(optim2.state_dict()["state"][i][name], value), (i, name)
