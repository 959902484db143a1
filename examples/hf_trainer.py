"""Hugging Face Trainer with lazyckpt: the Trainer's checkpoints become lazyckpt snapshots,
and a new Trainer resumes from one with exactly the losses of an uninterrupted run.

A tiny Llama (random weights from a config: nothing is downloaded) learns a short text
that ships with the repository. It trains three ways: straight through; with
``LazyCheckpointCallback`` taking the Trainer's saves (every 4 steps, through host memory
and a local directory); and, with a fresh model, fresh tiers and a fresh Trainer, resumed
from the snapshot in the middle. Dropout is on, so the RNG states must come back too.

    python examples/hf_trainer.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config, no pretrained weights: no network

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from lazyckpt.integrations.huggingface import LazyCheckpointCallback
from tiers import FileTier, HostMemoryTier

TEXT = Path(__file__).parent / "data" / "harbour.txt"
CONTEXT = 32


class Chunks(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """The text as bytes, cut into fixed windows (a byte-level "tokenizer")."""

    def __init__(self) -> None:
        data = torch.tensor(list(TEXT.read_bytes()[: 48 * CONTEXT]), dtype=torch.long)
        self.windows = data.view(-1, CONTEXT)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def tiny_llama(seed: int) -> tuple[Any, list[float]]:
    """A freshly initialised tiny Llama, and the list its training losses are appended to."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
        attention_dropout=0.1,
    )
    model = LlamaForCausalLM(config)
    losses: list[float] = []
    model.register_forward_hook(
        lambda m, _args, out: losses.append(out.loss.item()) if m.training else None
    )
    return model, losses


def train(root: Path, model: Any, callbacks: list[Any], resume: str | None = None) -> None:
    args = TrainingArguments(
        output_dir=str(root / "out"),
        per_device_train_batch_size=8,
        num_train_epochs=2,  # 12 steps
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=4,
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    Trainer(model=model, args=args, train_dataset=Chunks(), callbacks=callbacks).train(
        resume_from_checkpoint=resume
    )


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="lazyckpt-hf-"))
    try:
        straight, straight_losses = tiny_llama(seed=0)
        train(root / "straight", straight, [])

        # the part a user writes
        with LazyCheckpointCallback([HostMemoryTier(64 << 20), FileTier(root / "store")]) as cb:
            train(root, tiny_llama(seed=0)[0], [cb])
            steps = cb.checkpointer.steps()
            print("lazyckpt steps:", steps)
            for stats in cb.metrics()["snapshots"]:
                print(f"step {stats['step']:2d}: {stats['bytes'] / 2**20:.1f} MiB, snapshot() "
                      f"{stats['snapshot_s'] * 1e3:.1f} ms, guard waited "
                      f"{stats['guard_s'] * 1e3:.1f} ms")

        middle = steps[len(steps) // 2 - 1]
        with LazyCheckpointCallback([HostMemoryTier(64 << 20), FileTier(root / "store")]) as cb:
            # other initial weights: all of them come from the snapshot
            resumed, resumed_losses = tiny_llama(seed=99)
            train(root / "again", resumed, [cb], resume=cb.checkpoint_dir(middle))

        print(f"resumed at step {middle}: {len(resumed_losses)} more steps, "
              f"last loss {resumed_losses[-1]:.6f}")
        if resumed_losses != straight_losses[middle:]:
            print("losses differ from the uninterrupted run")
            return 1
        print("losses identical bit for bit to the uninterrupted run")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
