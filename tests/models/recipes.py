"""Small training setups built from real third-party model code, for the resume tests.

Each recipe builds its objects from a seed, names the state a trainer would snapshot, takes
one training step, and puts back what lives outside the objects (the global RNG) after a
restore. Sizes are tiny, so that a CPU runs a few steps in seconds; everything else is what
a user of those stacks writes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

# transformers must never reach the network: the models are built from configs
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class Recipe:
    """One training setup. ``objects`` holds everything it trains with."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.objects: dict[str, Any] = {}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        opt: torch.optim.Optimizer = self.objects["optim"]
        return opt

    def state(self) -> dict[str, Any]:
        """What is snapshotted: live objects (restored into in place) and the global RNG."""
        return {**self.objects, "rng": torch.get_rng_state()}

    def loaded(self, state: dict[str, Any]) -> None:
        """After ``restore(into=state)``: put back what is not an object of the recipe."""
        torch.set_rng_state(state["rng"])

    def step(self, step: int) -> float:
        raise NotImplementedError


def _token_batch(gen: torch.Generator, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 24), generator=gen)


class Llama(Recipe):
    """transformers' Llama with attention dropout, AdamW and a warm-up/cosine schedule."""

    VOCAB = 97

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

        config = LlamaConfig(
            vocab_size=self.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attention_dropout=0.1,
        )
        model = LlamaForCausalLM(config)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        self.objects = {
            "model": model,
            "optim": opt,
            "sched": get_cosine_schedule_with_warmup(opt, 2, 20),
            "data": torch.Generator().manual_seed(seed + 1),
        }

    def step(self, step: int) -> float:
        o = self.objects
        tokens = _token_batch(o["data"], self.VOCAB)
        loss = o["model"](input_ids=tokens, labels=tokens).loss
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(o["model"].parameters(), 1.0)
        o["optim"].step()
        o["sched"].step()
        o["optim"].zero_grad()
        return float(loss.item())


class GPT2(Recipe):
    """transformers' GPT-2 (tied input and output embeddings, dropout), AdamW, linear decay."""

    VOCAB = 101

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

        config = GPT2Config(
            vocab_size=self.VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2
        )
        model = GPT2LMHeadModel(config)
        assert model.lm_head.weight is model.transformer.wte.weight  # tied
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        self.objects = {
            "model": model,
            "optim": opt,
            "sched": get_linear_schedule_with_warmup(opt, 2, 20),  # type: ignore[no-untyped-call]
            "data": torch.Generator().manual_seed(seed + 1),
        }

    def step(self, step: int) -> float:
        o = self.objects
        tokens = _token_batch(o["data"], self.VOCAB)
        loss = o["model"](input_ids=tokens, labels=tokens).loss
        torch.autograd.backward(loss)
        o["optim"].step()
        o["sched"].step()
        o["optim"].zero_grad()
        return float(loss.item())


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input, as in a ResNet basic block."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        ResidualBlock(8),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        ResidualBlock(16),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


class ConvNet(Recipe):
    """A BatchNorm residual conv net: SGD with momentum and Nesterov, bfloat16 autocast with a
    GradScaler, OneCycleLR, and random flips from a numpy generator kept in the state."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        model = conv_net()
        model.train()
        opt = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4
        )
        self.objects = {
            "model": model,
            "optim": opt,
            "sched": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=40),
            "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**10),
            "data": torch.Generator().manual_seed(seed + 1),
            "augment": np.random.default_rng(seed + 2),
        }

    def step(self, step: int) -> float:
        o = self.objects
        images = torch.randn(8, 3, 16, 16, generator=o["data"])
        labels = torch.randint(0, 10, (8,), generator=o["data"])
        flip = torch.from_numpy(o["augment"].random(8) < 0.5)
        images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(o["model"](images), labels)
        torch.autograd.backward(o["scaler"].scale(loss))
        o["scaler"].step(o["optim"])
        o["scaler"].update()
        o["sched"].step()
        o["optim"].zero_grad()
        return float(loss.item())


class _Tokens(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, vocab, (n, 17), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class _Bigram(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 24)
        self.norm = nn.LayerNorm(24)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(24, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.drop(self.norm(self.embed(tokens))))
        return logits


class DataLoaderRecipe(Recipe):
    """torchdata's StatefulDataLoader, shuffling, snapshotted mid-epoch (an epoch is 5
    steps, so the resumed run crosses an epoch boundary)."""

    VOCAB = 50

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        from torchdata.stateful_dataloader import StatefulDataLoader

        model = _Bigram(self.VOCAB)
        # No generator= of its own: the sampler seeds one from the global RNG (in the
        # snapshot) each epoch. With an explicit generator, torchdata 0.11 reshuffles the
        # epoch after a mid-epoch resume differently from the uninterrupted run.
        loader = StatefulDataLoader(_Tokens(20, self.VOCAB), batch_size=4, shuffle=True)
        self.objects = {
            "model": model,
            "optim": torch.optim.Adam(model.parameters(), lr=1e-2),
            "loader": loader,
        }
        self._batches: Iterator[torch.Tensor] | None = None

    def loaded(self, state: dict[str, Any]) -> None:
        # the restored position takes effect when the iterator is made, which draws from the
        # global RNG: made before that RNG is put back, as in the run that was interrupted
        self._batches = iter(self.objects["loader"])
        super().loaded(state)

    def _next(self) -> torch.Tensor:
        if self._batches is None:
            self._batches = iter(self.objects["loader"])
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.objects["loader"])
            return next(self._batches)

    def step(self, step: int) -> float:
        o = self.objects
        batch = self._next()
        logits = o["model"](batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.VOCAB), batch[:, 1:].reshape(-1))
        torch.autograd.backward(loss)
        o["optim"].step()
        o["optim"].zero_grad()
        return float(loss.item())


class Compiled(Recipe):
    """A ``torch.compile``'d model (dynamo with the ``eager`` backend: the same
    ``OptimizedModule`` and ``_orig_mod.`` keys as inductor, without its code generation,
    which takes half a minute on a small CPU) with dropout and AdamW."""

    VOCAB = 50
    COMPILE = True

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        model = _Bigram(self.VOCAB)
        compiled: Callable[..., Any] = (
            torch.compile(model, backend="eager") if self.COMPILE else model
        )
        self.objects = {
            "model": compiled,
            "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "data": torch.Generator().manual_seed(seed + 1),
        }

    def step(self, step: int) -> float:
        o = self.objects
        batch = torch.randint(0, self.VOCAB, (4, 17), generator=o["data"])
        logits = o["model"](batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.VOCAB), batch[:, 1:].reshape(-1))
        torch.autograd.backward(loss)
        o["optim"].step()
        o["optim"].zero_grad()
        return float(loss.item())


class Uncompiled(Compiled):
    """The same model, not compiled: restores a compiled run's snapshot (keys without the
    ``_orig_mod.`` prefix) and continues it."""

    COMPILE = False


class FSDP2(Recipe):
    """An MLP sharded with FSDP2 (``fully_shard`` per layer and at the root) over every rank,
    its state taken through ``torch.distributed.checkpoint.state_dict``: the snapshot holds
    ``get_state_dict``'s DTensors and the restore goes back through ``set_state_dict``."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        model = nn.Sequential(
            nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(),
            nn.Linear(64, 4),
        )
        for layer in (model[0], model[3], model[5]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.objects = {
            "optim": torch.optim.AdamW(model.parameters(), lr=1e-2),
            # each rank draws its own batches: the data-parallel part
            "data": torch.Generator().manual_seed(seed + 1 + torch.distributed.get_rank()),
        }

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optim": optim_state,
            "data": self.objects["data"],
            "rng": torch.get_rng_state(),
        }

    def loaded(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        torch.set_rng_state(state["rng"])

    def step(self, step: int) -> float:
        x = torch.randn(8, 16, generator=self.objects["data"])
        y = torch.randn(8, 4, generator=self.objects["data"])
        loss = nn.functional.mse_loss(self.model(x), y)
        torch.autograd.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.item())


RECIPES: dict[str, type[Recipe]] = {
    "llama": Llama,
    "gpt2": GPT2,
    "convnet": ConvNet,
    "dataloader": DataLoaderRecipe,
    "compiled": Compiled,
    "uncompiled": Uncompiled,
    "fsdp2": FSDP2,
}
