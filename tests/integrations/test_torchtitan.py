"""torchtitan's checkpoint manager on lazyckpt, driven as torchtitan's trainer drives it, with
torchtitan's own optimizer, LR scheduler and dataloader containers on CPU. (The trainer
itself needs an accelerator in torchtitan 0.3, so the loop below plays its part.)"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset

pytest.importorskip("torchtitan", reason="torchtitan is not installed")

from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from lazyckpt import ConfigurationError, SnapshotFailedError, SyncCheckpointer
from lazyckpt.integrations.torchtitan import LazyCheckpointManager
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent.parent))
from helpers.ranks import launch_ranks, rank_results

WORKER = Path(__file__).parent / "torchtitan_worker.py"

pytestmark = pytest.mark.filterwarnings(
    "ignore:'set_vital' is deprecated:UserWarning",  # torchdata's, at every dataloader
    # torchtitan's LR scheduler container warns in its own load_state_dict
    "ignore:To get the last learning rate computed by the scheduler:UserWarning",
)

STEPS = 8


class Counting(IterableDataset[torch.Tensor]):
    """Batches that depend on how far the data has been read, with a resumable position."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.position += 1
            g = torch.Generator().manual_seed(self.position)
            yield torch.randn(16, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


class TrainState:
    """What torchtitan's trainer saves of itself under ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]


class Run:
    """One training run: torchtitan's containers around a tiny model, and the manager."""

    def __init__(self, folder: Path, **config: Any) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.optimizers = OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[
                ParamGroupConfig(
                    pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01}
                )
            ],
        ).build(model_parts=[self.model])
        self.lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
            optimizers=self.optimizers, training_steps=STEPS
        )
        self.dataloader = ParallelAwareDataloader(
            Counting(), dp_rank=0, dp_world_size=1, batch_size=4
        )
        self.train_state = TrainState()
        tiers = config.pop("tiers", None)
        settings = {"enable": True, "folder": "ckpt", "interval": 4, "host_bytes": 8 << 20}
        cfg = LazyCheckpointManager.Config(**{**settings, **config})
        assert isinstance(cfg, BaseCheckpointManager.Config)  # what the trainer's field holds
        build_args: dict[str, Any] = {
            "dataloader": self.dataloader,
            "model_parts": [self.model],
            "optimizers": self.optimizers,
            "lr_schedulers": self.lr_schedulers,
            "states": {"train_state": self.train_state},
            "sd_adapter": None,
            "base_folder": str(folder),
        }
        if tiers is not None:
            build_args["tiers"] = tiers
        self.checkpointer = cfg.build(**build_args)  # as torchtitan's trainer builds it

    def train(self, until: int) -> list[float]:
        """Steps ``train_state.step + 1`` to ``until``, as torchtitan's trainer runs them."""
        losses = []
        batches = iter(self.dataloader)
        while self.train_state.step < until:
            self.train_state.step += 1
            x = next(batches)
            loss = self.model(x).square().mean()
            loss.backward()
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.optimizers.zero_grad()
            self.train_state.tokens_seen += x.numel()
            losses.append(loss.item())
            self.checkpointer.save(self.train_state.step, last_step=self.train_state.step == STEPS)
        return losses


def committed(folder: Path) -> list[int]:
    with SyncCheckpointer([FileTier(folder)]) as ckpt:
        return ckpt.steps()


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    full = Run(tmp_path / "a", last_save_model_only=False)
    losses = full.train(STEPS)
    full.checkpointer.close()
    assert committed(tmp_path / "a" / "ckpt") == [4, 8]

    resumed = Run(tmp_path / "a", last_save_model_only=False, load_only=True)
    assert resumed.checkpointer.load(step=4)
    assert resumed.train_state.step == 4
    assert resumed.train_state.tokens_seen == 4 * 4 * 16
    assert resumed.lr_schedulers.state_dict() == {"last_epoch": 4}
    # the dataloader resumes at the fifth batch, the optimizer and model where they were
    assert resumed.train(STEPS) == losses[4:]
    resumed.checkpointer.close()


def test_load_takes_the_latest_and_a_fresh_folder_starts_fresh(tmp_path: Path) -> None:
    first = Run(tmp_path, last_save_model_only=False)
    first.train(6)
    first.checkpointer.close()
    again = Run(tmp_path)
    assert again.checkpointer.load()
    assert again.train_state.step == 4
    again.checkpointer.close()
    empty = Run(tmp_path / "elsewhere")
    assert not empty.checkpointer.load()
    with pytest.raises(ConfigurationError, match="load_step=3"):
        empty.checkpointer.load(step=3)
    empty.checkpointer.close()


def test_last_step_model_only_in_the_export_dtype_and_retention(tmp_path: Path) -> None:
    run = Run(tmp_path, interval=2, keep_latest_k=2, export_dtype="bfloat16")
    run.train(STEPS)
    run.checkpointer.close()
    with SyncCheckpointer([FileTier(tmp_path / "ckpt")]) as ckpt:
        assert ckpt.steps() == [6, 8]  # keep_latest_k
        last = ckpt.restore(8)
        assert sorted(last) == ["model"]
        assert {v.dtype for v in last["model"].values()} == {torch.bfloat16}
        assert sorted(ckpt.restore(6)) == [
            "dataloader",
            "lr_scheduler",
            "model",
            "optimizer",
            "train_state",
        ]


def test_a_failed_save_is_logged_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "ckpt"))
    run = Run(tmp_path, tiers=[HostMemoryTier(8 << 20), faulty])
    faulty.break_("commit")
    caplog.set_level(logging.WARNING)
    run.train(5)  # step 4's save fails on the file tier
    run.checkpointer.maybe_wait_for_saving()
    assert "a checkpoint failed, training goes on" in caplog.text
    faulty.heal()
    run.train(STEPS)
    run.checkpointer.close()
    assert committed(tmp_path / "ckpt") == [8]


def test_raise_save_errors_raises(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "ckpt"))
    run = Run(tmp_path, tiers=[faulty], raise_save_errors=True)
    faulty.break_("commit")
    run.train(4)
    with pytest.raises(SnapshotFailedError):
        run.checkpointer.maybe_wait_for_saving()
    faulty.heal()
    run.checkpointer.close()


def test_disabled_and_unsupported_settings(tmp_path: Path) -> None:
    off = Run(tmp_path, enable=False)
    assert not off.checkpointer.save(4)
    assert not off.checkpointer.load()
    with pytest.raises(ConfigurationError, match="safetensors"):
        Run(tmp_path, last_save_in_hf=True)


@pytest.mark.slow
def test_fsdp2_saved_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch_ranks(WORKER, ["save", str(tmp_path), str(out)], 2, timeout=150)
    saved = rank_results(out)
    assert sorted(saved) == [0, 1]
    assert all(r["steps"] == [2, 4] for r in saved.values())
    for path in out.glob("rank*.json"):
        path.unlink()
    launch_ranks(WORKER, ["load", str(tmp_path), str(out)], 1, timeout=150)
    loaded = rank_results(out)[0]
    assert loaded["loaded"]
    assert loaded["differ"] == []  # model and optimizer, gathered, bit for bit
    assert loaded["step"] == 4
    assert loaded["lr_epoch"] == 4


def test_the_config_serializes_as_torchtitan_logs_it() -> None:
    config = LazyCheckpointManager.Config(enable=True, interval=500, host_bytes=8 << 30)
    as_dict = config.to_dict()
    assert as_dict["host_bytes"] == 8 << 30
    assert as_dict["when_busy"] == "wait"
    assert as_dict["interval"] == 500
    with pytest.raises(ValueError, match="at least 2 checkpoint"):  # torchtitan's own check
        LazyCheckpointManager.Config(keep_latest_k=1)
