"""What the docs show works: the plain-numpy reader in docs/format.md, and every link."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

import lazyckpt
from tiers import FileTier, HostMemoryTier

ROOT = Path(__file__).resolve().parent.parent


def snippet(doc: str, marker: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if marker in block:
            return str(block)
    raise AssertionError(f"no python block with {marker!r} in {doc}")


async def test_format_md_numpy_reader(tmp_path: Path) -> None:
    bias = torch.randn(768)
    state = {"model": {"ln.bias": bias, "w": torch.randn(64, 64)}, "step": 100}
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), FileTier(tmp_path)]) as ckpt:
        await (await ckpt.snapshot(state, step=100)).committed()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict[str, object] = {}
        exec(snippet("format.md", "next(t for t in m"), scope)
    finally:
        os.chdir(cwd)
    assert np.array_equal(np.asarray(scope["ln_bias"]), bias.numpy())


def test_relative_links_resolve() -> None:
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


async def test_format_md_numpy_reader_of_columns(tmp_path: Path) -> None:
    bias = torch.randn(768)
    # enough tensors for the column encoding (format version 4)
    model = {"ln.bias": bias, **{f"layers.{i}.w": torch.randn(3) for i in range(300)}}
    async with lazyckpt.Checkpointer([HostMemoryTier(8 << 20), FileTier(tmp_path)]) as ckpt:
        await (await ckpt.snapshot({"model": model}, step=100)).committed()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict[str, object] = {}
        exec(snippet("format.md", "itertools.accumulate"), scope)
    finally:
        os.chdir(cwd)
    assert scope["m"]["format_version"] == 5  # type: ignore[index]
    assert np.array_equal(np.asarray(scope["ln_bias"]), bias.numpy())


def test_tiers_md_imports_the_whole_plugin_interface() -> None:
    # a tier author sees everything from one import: the block in docs/tiers.md runs and
    # names every public name of lazyckpt.tier
    import lazyckpt.tier

    block = snippet("tiers.md", "from lazyckpt.tier import")
    scope: dict[str, object] = {}
    exec(block, scope)
    named = set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", block.split("import", 1)[1]))
    assert set(lazyckpt.tier.__all__) <= named, set(lazyckpt.tier.__all__) - named
