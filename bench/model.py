"""A small GPT-style transformer for the end-to-end benchmark.

Token embedding, learned position embedding, ``n_layer`` pre-LayerNorm blocks of causal
self-attention and an MLP, a final LayerNorm and an LM head tied to the token embedding.
It is written out here (rather than imported) so that the benchmark's state has a known,
realistic mix of a few large matrices and many small vectors, and so that its size can be
chosen to fit the machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "adamw_state_bytes", "random_batch"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; ``n_embd`` must be divisible by ``n_head``."""

    vocab_size: int = 8192
    block_size: int = 128
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The whole model; ``forward(idx, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one storage under two keys
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # GPT-2's scaled init for the residual projections keeps activations bounded
                scale = (
                    math.sqrt(2 * cfg.n_layer)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 1.0
                )
                nn.init.normal_(p, mean=0.0, std=std / scale)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        _, t = idx.shape
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def random_batch(
    cfg: GPTConfig, batch: int, seq: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and their next-token targets (the data do not matter here)."""
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def adamw_state_bytes(model: nn.Module) -> int:
    """Bytes of parameters plus AdamW's two moments (what a checkpoint of both holds)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * n
