"""A real (tiny) training run: snapshot with the guard, restore into a fresh model and
optimizer, and continue with bit-identical losses (AdamW, dropout, RNG state)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_gpt() -> ModuleType:
    return load("train_gpt")


async def test_resume_reproduces_losses_bit_for_bit(train_gpt: ModuleType, tmp_path: Path) -> None:
    cfg = train_gpt.Config(layers=2, width=32, heads=2, context=32, batch=4, steps=14, every=4)
    result = await train_gpt.train(cfg, tmp_path, quiet=True)
    assert result["steps"] == [0, 4, 8, 12, 13]
    assert all(s.reached_s.get("file") is not None for s in result["stats"])
    await train_gpt.forget(tmp_path, 13)
    await train_gpt.forget(tmp_path, 12)
    start, replay = await train_gpt.resume(cfg, tmp_path, until=cfg.steps)
    assert start == 9
    assert replay == result["losses"][9:]


async def test_a_different_seed_would_not_match(train_gpt: ModuleType, tmp_path: Path) -> None:
    """The bit-for-bit comparison above can fail: without the RNG state, dropout differs."""
    import torch

    cfg = train_gpt.Config(layers=1, width=32, heads=2, context=32, batch=4, steps=6, every=5)
    result = await train_gpt.train(cfg, tmp_path, quiet=True)
    await train_gpt.forget(tmp_path, 5)
    torch.manual_seed(999)
    data, vocab = train_gpt.load_text()
    model, opt = train_gpt.make_model(vocab, cfg, seed=cfg.seed)
    for step in range(1, 6):
        loss = train_gpt.train_step(model, opt, data, step, cfg)
    assert loss != result["losses"][5]
