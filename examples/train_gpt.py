"""Train a small GPT-style model on CPU with lazy checkpointing, then restore and continue.

This is what ``make demo`` runs. It trains a character-level transformer on a short text that
ships with the repository, snapshots model, optimizer and RNG state every few steps through
host memory and a local directory (and Zarr, when that tier is installed), prints where the
time of each snapshot went, then restores the last snapshot into a *fresh* model and
optimizer, as a new process would after a crash, and shows that training continues with
exactly the same losses.

Run ``python examples/train_gpt.py --help`` for the knobs.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import lazyckpt
from tiers import FileTier, HostMemoryTier

TEXT = Path(__file__).parent / "data" / "harbour.txt"


@dataclass
class Config:
    layers: int = 4
    width: int = 128
    heads: int = 4
    context: int = 64
    batch: int = 16
    dropout: float = 0.1
    lr: float = 3e-3
    steps: int = 60
    every: int = 5
    seed: int = 0


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.width, 4 * cfg.width),
            nn.GELU(),
            nn.Linear(4 * cfg.width, cfg.width),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only transformer with a tied output head."""

    def __init__(self, vocab: int, cfg: Config) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.width)
        self.position = nn.Parameter(torch.zeros(cfg.context, cfg.width))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.Sequential(*(Block(cfg) for _ in range(cfg.layers)))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor under two keys
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(idx) + self.position[: idx.shape[1]])
        return self.head(self.ln(self.blocks(x)))


def load_text() -> tuple[torch.Tensor, int]:
    text = TEXT.read_text()
    alphabet = sorted(set(text))
    index = {ch: i for i, ch in enumerate(alphabet)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long), len(alphabet)


def batch_for(step: int, data: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a step depends only on the step, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(len(data) - cfg.context - 1, (cfg.batch,), generator=g)
    x = torch.stack([data[s : s + cfg.context] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + cfg.context + 1] for s in starts.tolist()])
    return x, y


def train_step(
    model: GPT, opt: torch.optim.Optimizer, data: torch.Tensor, step: int, cfg: Config
) -> float:
    model.train()
    x, y = batch_for(step, data, cfg)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()  # with ckpt.guard(opt), this first waits for any capture still running
    return float(loss.item())


def make_model(vocab: int, cfg: Config, seed: int) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(vocab, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    return model, opt


def default_tiers(root: Path, host_bytes: int) -> list[lazyckpt.Tier]:
    chain: list[lazyckpt.Tier] = [HostMemoryTier(host_bytes), FileTier(root / "file")]
    if "zarr" in lazyckpt.available_tiers():
        chain.append(lazyckpt.load_tier("zarr", str(root / "zarr")))
    return chain


def durable_tiers(root: Path) -> list[lazyckpt.Tier]:
    """What a new process finds after a crash: only the durable tiers."""
    chain: list[lazyckpt.Tier] = [FileTier(root / "file")]
    if "zarr" in lazyckpt.available_tiers():
        chain.append(lazyckpt.load_tier("zarr", str(root / "zarr")))
    return chain


async def train(
    cfg: Config, root: Path, *, host_bytes: int = 64 << 20, quiet: bool = False
) -> dict[str, Any]:
    """Train ``cfg.steps`` steps, snapshotting every ``cfg.every``; return losses and stats."""
    data, vocab = load_text()
    model, opt = make_model(vocab, cfg, cfg.seed)
    losses: list[float] = []
    handles: list[lazyckpt.SnapshotHandle] = []
    t0 = time.perf_counter()
    async with lazyckpt.Checkpointer(
        default_tiers(root, host_bytes), shard_size=1 << 20, pack_bytes=64 << 10
    ) as ckpt:
        ckpt.guard(opt)
        for step in range(cfg.steps):
            losses.append(train_step(model, opt, data, step, cfg))
            if step % cfg.every == 0 or step == cfg.steps - 1:
                state = {"model": model, "optim": opt, "rng": torch.get_rng_state(), "step": step}
                handles.append(await ckpt.snapshot(state, step=step))
                if not quiet:
                    print(
                        f"step {step:4d}  loss {losses[-1]:.4f}  snapshot requested "
                        f"({time.perf_counter() - t0:5.1f}s)",
                        flush=True,
                    )
        tier_names = [t.name for t in ckpt.tiers]
    # leaving the block drained the pipeline: every snapshot is committed or raised
    return {
        "losses": losses,
        "stats": [h.stats for h in handles],
        "tiers": tier_names,
        "steps": [h.step for h in handles],
        "seconds": time.perf_counter() - t0,
    }


async def resume(cfg: Config, root: Path, until: int) -> tuple[int, list[float]]:
    """Restore the latest snapshot into a fresh model and optimizer and train on."""
    data, vocab = load_text()
    model, opt = make_model(vocab, cfg, seed=cfg.seed + 12345)  # deliberately different init
    async with lazyckpt.Checkpointer(durable_tiers(root)) as ckpt:
        live: dict[str, Any] = {"model": model, "optim": opt}
        await ckpt.restore(into=live)
    torch.set_rng_state(live["rng"])
    start = int(live["step"]) + 1
    return start, [train_step(model, opt, data, step, cfg) for step in range(start, until)]


async def forget(root: Path, step: int) -> None:
    """Delete a committed step from every durable tier, through the tiers' own API."""
    for tier in durable_tiers(root):
        await tier.open()
        try:
            await tier.delete(step)
        finally:
            await tier.aclose()


def print_table(result: dict[str, Any]) -> None:
    names = [n for n in result["tiers"]]
    header = f"{'step':>5} {'in snapshot()':>14} {'guard wait':>11} {'captured':>9}"
    header += "".join(f" {('-> ' + n):>10}" for n in names)
    print(header)
    print("-" * len(header))
    for stats in result["stats"]:
        row = f"{stats.step:>5} {stats.snapshot_s * 1e3:>11.2f} ms {stats.guard_s * 1e3:>8.2f} ms"
        row += f" {stats.capture_s * 1e3:>6.1f} ms" if stats.capture_s else f" {'-':>9}"
        for n in names:
            v = stats.reached_s.get(n)
            row += f" {v * 1e3:>7.1f} ms" if v is not None else f" {'-':>10}"
        print(row)
    print(
        "(in snapshot(): time the training loop spent inside the call; guard wait: time "
        "optimizer.step() waited for the capture; the rest: time from the request until the "
        "snapshot was in host memory and committed on each tier)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--every", type=int, default=Config.every)
    parser.add_argument("--layers", type=int, default=Config.layers)
    parser.add_argument("--width", type=int, default=Config.width)
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints go (default: temp)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    args = parser.parse_args(argv)
    cfg = Config(steps=args.steps, every=args.every, layers=args.layers, width=args.width)
    root = args.dir or Path(tempfile.mkdtemp(prefix="lazyckpt-demo-"))
    try:
        print(f"training {cfg.layers}-layer GPT (width {cfg.width}) for {cfg.steps} steps, "
              f"snapshot every {cfg.every}; checkpoints in {root}")
        result = asyncio.run(train(cfg, root))
        print(f"\ntrained in {result['seconds']:.1f}s; every snapshot committed\n")
        print_table(result)
        last = result["steps"][-1]
        resume_from = result["steps"][-2] if len(result["steps"]) > 1 else last
        # Pretend the run died right after the second-to-last snapshot: delete the newest one
        # so the restore must pick the earlier step, then replay the steps after it.
        if resume_from != last:
            asyncio.run(forget(root, last))
        start, replay = asyncio.run(resume(cfg, root, until=cfg.steps))
        original = result["losses"][start:]
        same = replay == original
        print(f"\nrestored step {start - 1} into a fresh model and optimizer; "
              f"replayed steps {start}..{cfg.steps - 1}:")
        for step, (a, b) in enumerate(zip(original, replay, strict=True), start):
            print(f"  step {step:4d}  original {a:.6f}  resumed {b:.6f}  {'same' if a == b else 'DIFFERENT'}")
        print("losses identical bit for bit" if same else "LOSSES DIFFER")
        if not math.isfinite(result["losses"][-1]):
            return 1
        return 0 if same else 1
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
