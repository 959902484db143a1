"""Incremental snapshots of a real adapter fine-tune: transformers' Llama with its weights
frozen and low-rank adapters on the attention projections, AdamW on the adapters, the guard
on, a snapshot every step. Later snapshots write only what the adapters changed, the base is
referred to, and every kept step restores bit for bit into fresh objects."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import lazyckpt
from tiers import FileTier, HostMemoryTier

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB = 97
OPTIONS = {"shard_size": 1 << 16, "pack_bytes": 4096}


class LoRA(nn.Module):
    """A frozen projection plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(base.in_features, rank) * 0.02)
        self.b = nn.Parameter(torch.zeros(rank, base.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a @ self.b  # type: ignore[no-any-return]


def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    model.train()
    adapters = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(adapters, lr=1e-2)


def snapshot_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [cloned(v) for v in value]
    return value


@pytest.mark.slow
@pytest.mark.parametrize("mode", [True, "versions"])
async def test_adapter_fine_tune_writes_the_adapters_and_restores_every_kept_step(
    tmp_path: Path, mode: bool | str
) -> None:
    model, opt = build(0)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    data = torch.Generator().manual_seed(1)
    expected: dict[int, dict[str, Any]] = {}
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(64 << 20), FileTier(tmp_path, keep_last=3)], incremental=mode, **OPTIONS
    ) as ckpt:
        ckpt.guard(opt)
        for step in range(1, 7):
            tokens = torch.randint(0, VOCAB, (2, 16), generator=data)
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
            handle = await ckpt.snapshot({"model": model, "optim": opt}, step=step)
            expected[step] = cloned(snapshot_of(model, opt))
            await handle.committed()
        metrics = ckpt.metrics()["tiers"]["file"]
    # five later snapshots referred to most of the frozen base instead of writing it again
    assert metrics["reused_bytes"] >= 5 * base_bytes * 0.8, metrics
    # ... and wrote it once: six snapshots wrote little more than one copy of the base
    assert metrics["bytes"] < 1.3 * base_bytes, metrics

    async with lazyckpt.Checkpointer([FileTier(tmp_path, readonly=True)]) as reader:
        assert await reader.steps() == [4, 5, 6]
        for step in (4, 5, 6):
            fresh, fresh_opt = build(1)  # other random weights: everything must come back
            await reader.restore(step, into={"model": fresh, "optim": fresh_opt})
            assert equal(fresh.state_dict(), expected[step]["model"]), step
            assert equal(fresh_opt.state_dict(), expected[step]["optim"]), step
        assert (await reader.verify(6)).ok
