"""``lazyckpt export`` into a directory: sharded safetensors files and
``model.safetensors.index.json``, the layout transformers writes, loaded back with
``from_pretrained`` bit for bit. Models are built from configs: nothing is downloaded."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from conftest import Run

from lazyckpt import SyncCheckpointer
from lazyckpt.cli import EXIT_DAMAGE, EXIT_OK, EXIT_USAGE
from lazyckpt.cli._formats import plan_shards
from lazyckpt.testing import build_snapshot
from tiers import FileTier

# transformers must never reach the network: the model is built from a config
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

INDEX = "model.safetensors.index.json"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def shard_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("*.safetensors"))


def read_dir(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The index, and every tensor of the files it names (each read from its own file)."""
    index = json.loads((out / INDEX).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        with safetensors.safe_open(out / name, "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                assert index["weight_map"][key] == name, key
                tensors[key] = f.get_tensor(key)
    return index, tensors


def snapshot(root: Path, state: dict[str, Any], step: int = 7) -> None:
    with SyncCheckpointer([FileTier(root)], shard_size=64 << 10, pack_bytes=4 << 10) as ckpt:
        ckpt.snapshot(state, step=step).wait()


@pytest.fixture
def weights(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A snapshot of a model's weights under ``model/``, beside an optimizer-like entry."""
    g = torch.Generator().manual_seed(1)
    model = {
        "embed.weight": torch.randn(64, 100, generator=g),  # 25 KiB each
        "layer.0.weight": torch.randn(64, 100, generator=g),
        "layer.0.bias": torch.randn(64, generator=g),
        "layer.1.weight": torch.randn(64, 100, generator=g).to(torch.bfloat16),
        "head.weight": torch.randn(200, 100, generator=g),  # 78 KiB: larger than a shard
        "norm.weight": torch.ones(100),
    }
    root = tmp_path / "run"
    snapshot(root, {"model": model, "optim": {"lr": 0.1, "m": torch.zeros(3)}, "step": 7})
    return root, model


def test_shards_are_planned_as_transformers_plans_them() -> None:
    assert plan_shards([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_shards([4, 20, 4, 4], 8) == [[1], [0, 2], [3]]  # too large: a file alone
    assert plan_shards([8, 1], 8) == [[0], [1]]
    assert plan_shards([], 8) == [[]]
    with pytest.raises(ValueError, match="at least 1 byte"):
        plan_shards([1], 0)


def test_sharded_export_writes_the_index_and_every_tensor(
    weights: Any, run: Run, tmp_path: Path
) -> None:
    root, model = weights
    out = tmp_path / "hf"
    code, _, err = run(
        "export", root, "--select", "model", "--max-shard-size", "40KiB", "--to", out
    )
    assert code == EXIT_OK, err
    assert "export step 7: done" in err
    # 25 KiB + 25 KiB would pass 40 KiB; the 78 KiB head goes alone
    assert f"as 3 safetensors files and {INDEX}" in err
    assert shard_files(out) == [f"model-0000{k}-of-00003.safetensors" for k in range(1, 4)]
    assert sorted(p.name for p in out.iterdir()) == sorted([*shard_files(out), INDEX])
    index, tensors = read_dir(out)
    assert set(tensors) == set(model)
    for key, tensor in model.items():
        assert same_bits(tensors[key], tensor), key
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in model.values())
    assert list(index["weight_map"]) == sorted(model)
    for name in shard_files(out):
        with safetensors.safe_open(out / name, "pt") as f:
            held = [f.get_tensor(k).nbytes for k in f.keys()]  # noqa: SIM118
            assert f.metadata() == {"format": "pt", "lazyckpt.step": "7"}
        assert sum(held) <= 40 << 10 or len(held) == 1  # only a larger tensor goes alone


def test_a_trailing_slash_or_an_existing_directory_is_a_directory_export(
    weights: Any, run: Run, tmp_path: Path
) -> None:
    root, model = weights
    out = tmp_path / "hf"
    # the default shard size holds everything: one file, with its index all the same
    assert run("export", root, "--select", "model", "--to", f"{out}/", "-q")[0] == EXIT_OK
    assert shard_files(out) == ["model-00001-of-00001.safetensors"]
    assert set(read_dir(out)[1]) == set(model)
    there = tmp_path / "existing"
    there.mkdir()
    (there / "config.json").write_text("{}")  # what is beside the weights stays
    code, _, err = run("export", root, "--select", "model", "--to", there, "-q")
    assert code == EXIT_OK, err
    assert sorted(p.name for p in there.iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        INDEX,
    ]


def test_replacing_an_export_needs_force_and_removes_the_old_shards(
    weights: Any, run: Run, tmp_path: Path
) -> None:
    root, model = weights
    out = tmp_path / "hf"
    args = ("export", root, "--select", "model", "--to", out, "-q")
    assert run(*args, "--max-shard-size", "40KiB")[0] == EXIT_OK
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = run(*args, "--max-shard-size", "1MiB")
    assert code == EXIT_USAGE
    assert "--force" in err and INDEX in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "model.safetensors").write_bytes(b"a single-file checkpoint from elsewhere")
    assert run(*args, "--max-shard-size", "1MiB", "--force")[0] == EXIT_OK
    assert shard_files(out) == ["model-00001-of-00001.safetensors"]  # the others are gone
    index, tensors = read_dir(out)
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert all(same_bits(tensors[k], t) for k, t in model.items())


def test_bad_directory_exports_are_usage_errors(weights: Any, run: Run, tmp_path: Path) -> None:
    root, _ = weights
    base = ("export", root, "--select", "model")
    for extra, message in [
        (("--max-shard-size", "0", "--to", tmp_path / "a"), "at least 1 byte"),
        (("--max-shard-size", "1MiB", "--to", tmp_path / "a.safetensors"), "names a file"),
        (("--max-shard-size", "1MiB", "--format", "torch", "--to", tmp_path / "b"), "torch"),
        (("--format", "torch", "--to", f"{tmp_path / 'c'}/"), "one file"),
    ]:
        code, _, err = run(*base, *extra)
        assert code == EXIT_USAGE, extra
        assert message in err, (extra, err)
    assert run(*base, "--max-shard-size", "lots", "--to", tmp_path / "d")[0] == EXIT_USAGE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing was written


def test_a_damaged_snapshot_leaves_no_directory(weights: Any, run: Run, tmp_path: Path) -> None:
    root, _ = weights
    data = root / "step-000000000007" / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    out = tmp_path / "hf"
    code, _, _ = run("export", root, "--max-shard-size", "40KiB", "--to", out)
    assert code == EXIT_DAMAGE
    assert not out.exists()
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert run("export", root, "--max-shard-size", "40KiB", "--to", out)[0] == EXIT_DAMAGE
    assert [p.name for p in out.iterdir()] == ["config.json"]  # no partial file is left


async def _write_two_ranks(root: Path, states: list[dict[str, Any]]) -> None:
    tiers = []
    for rank in range(2):
        tier = FileTier(root)
        tier.bind(rank, 2)
        await tier.open()
        tiers.append(tier)
    try:
        for tier in tiers:
            manifest, payloads = build_snapshot(3, states[tier.rank], rank=tier.rank, world_size=2)
            await tier.begin(manifest)
            for shard, data in zip(manifest.shards, payloads, strict=True):
                await tier.put_shard(manifest, shard, memoryview(data))
            await tier.commit(manifest)
        for tier in tiers:
            await tier.commit_global(3, 2)
    finally:
        for tier in tiers:
            await tier.aclose()


def test_a_step_of_two_ranks_is_sharded_from_memory(run: Run, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    states = [{f"w{i}": torch.randn(50, 100, generator=g) for i in range(4)} for _ in range(2)]
    root = tmp_path / "run"
    asyncio.run(_write_two_ranks(root, states))
    out = tmp_path / "hf"
    code, _, err = run("export", root, "--max-shard-size", "30KiB", "--to", out, "-q")
    assert code == EXIT_OK, err
    assert len(shard_files(out)) == 4  # 19.5 KiB each: one a file
    _, tensors = read_dir(out)
    assert set(tensors) == set(states[0])
    for key, tensor in states[0].items():  # a tensor each rank saved as its own: rank 0's
        assert same_bits(tensors[key], tensor), key


def test_from_pretrained_loads_a_sharded_export_of_llama(run: Run, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # not the initial values: the norms are ones
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    root = tmp_path / "run"
    # as a torch.compile'd model's state is saved, beside the optimizer
    compiled = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    optim = torch.optim.AdamW(model.parameters())
    snapshot(root, {"model": compiled, "optim": optim.state_dict()})

    out = tmp_path / "llama"
    code, _, err = run(
        "export", root, "--select", "model", "--strip-prefix", "_orig_mod.",
        "--max-shard-size", "100KiB", "--to", out, "-q",
    )  # fmt: skip
    assert code == EXIT_OK, err
    assert len(shard_files(out)) > 2
    config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert same_bits(got[key], tensor), key
    tokens = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model.eval()(tokens).logits)
