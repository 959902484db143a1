"""LazyCheckpointIO against the real PyTorch Lightning Trainer, on CPU with a tiny model."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed")

import pytorch_lightning as pl

from lazyckpt import ConfigurationError, LocationInUseError, SyncCheckpointer
from lazyckpt.integrations.lightning import LazyCheckpointIO, read_pointer
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

pytestmark = [
    # Lightning's advice for real runs (more data-loader workers, logging intervals) is noise here
    pytest.mark.filterwarnings("ignore::lightning_fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]

BATCHES = 4  # per epoch


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8, lr: float = 0.05, seed: int = 0, data_seed: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(self.hparams["data_seed"])
        x = torch.randn(BATCHES * 8, 4, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


def trainer(root: Path, *, epochs: int, plugins: list[Any], callbacks: list[Any]) -> Any:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        plugins=plugins,
        callbacks=callbacks,
        deterministic=True,
    )


def chain(root: Path, **kw: Any) -> list[Any]:
    return [HostMemoryTier(8 << 20), FileTier(root / "store", **kw)]


def every_epoch(root: Path, **kw: Any) -> Any:
    return pl.callbacks.ModelCheckpoint(
        dirpath=str(root / "ckpts"), every_n_epochs=1, save_top_k=-1, save_last=True, **kw
    )


@pytest.mark.slow
def test_resume_from_lazyckpt_continues_bit_identically(tmp_path: Path) -> None:
    straight = Tiny()
    trainer(tmp_path / "a", epochs=4, plugins=[], callbacks=[]).fit(straight)

    io = LazyCheckpointIO(chain(tmp_path))
    first = Tiny()
    trainer(tmp_path, epochs=2, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(first)
    io.close()
    assert first.losses == straight.losses[: 2 * BATCHES]

    ckpts = tmp_path / "ckpts"
    assert sorted(os.listdir(ckpts)) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert [read_pointer(str(ckpts / n)) for n in sorted(os.listdir(ckpts))] == [4, 8, 8]
    with SyncCheckpointer([FileTier(tmp_path / "store")]) as check:
        assert check.steps() == [4, 8]

    # a fresh model (other initial weights), fresh tiers, resumed from the 'last' path
    io = LazyCheckpointIO(chain(tmp_path))
    resumed = Tiny(seed=123)
    trainer(tmp_path, epochs=4, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(
        resumed, ckpt_path="last"
    )
    assert io.checkpointer.steps() == [4, 8, 12, 16]  # save_top_k=-1: every step stays
    io.close()
    assert resumed.losses == straight.losses[2 * BATCHES :]
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_dict_round_trips(tmp_path: Path) -> None:
    def best(root: Path) -> Any:  # best_k_models is keyed by absolute paths, with tensors
        return pl.callbacks.ModelCheckpoint(
            dirpath=str(root / "ckpts"), monitor="train_loss", save_top_k=2, save_last=True,
            every_n_train_steps=1,
        )

    io = LazyCheckpointIO(chain(tmp_path))
    trainer(tmp_path, epochs=1, plugins=[io], callbacks=[io, best(tmp_path)]).fit(Tiny(6, 0.1))
    loaded = io.load_checkpoint(tmp_path / "ckpts" / "last.ckpt")
    io.close()
    plain = pl.plugins.TorchCheckpointIO()
    root = tmp_path / "plain"
    trainer(root, epochs=1, plugins=[plain], callbacks=[best(root)]).fit(Tiny(6, 0.1))
    expected = plain.load_checkpoint(root / "ckpts" / "last.ckpt")

    assert loaded.keys() == expected.keys()
    assert loaded["hyper_parameters"] == {"width": 6, "lr": 0.1, "seed": 0, "data_seed": 1}
    assert loaded["global_step"] == BATCHES
    for key in ("loops", "lr_schedulers", "epoch", "hparams_name"):
        assert loaded[key] == expected[key], key
    assert loaded["optimizer_states"][0]["param_groups"] == expected["optimizer_states"][0]["param_groups"]
    for k, v in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][k], v)
    (cb_key,) = [k for k in expected["callbacks"] if k.startswith("ModelCheckpoint")]
    got, want = loaded["callbacks"][cb_key], expected["callbacks"][cb_key]
    assert got.keys() == want.keys()
    assert {Path(p).name: v for p, v in got["best_k_models"].items()} == {
        Path(p).name: v for p, v in want["best_k_models"].items()
    }
    assert len(got["best_k_models"]) == 2 and all(
        Path(p).is_absolute() and isinstance(v, torch.Tensor) for p, v in got["best_k_models"].items()
    )


def test_top_k_removal_deletes_steps(tmp_path: Path) -> None:
    io = LazyCheckpointIO(chain(tmp_path))
    keep2 = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ckpts"), monitor="step", mode="max", save_top_k=2,
        every_n_train_steps=1,
    )
    trainer(tmp_path, epochs=2, plugins=[io], callbacks=[io, keep2]).fit(Tiny())
    names = sorted(os.listdir(tmp_path / "ckpts"))
    assert names == ["epoch=1-step=7.ckpt", "epoch=1-step=8.ckpt"]
    assert io.checkpointer.steps() == [7, 8]
    io.close()


def test_retention_that_would_drop_a_kept_checkpoint_is_refused(tmp_path: Path) -> None:
    io = LazyCheckpointIO(chain(tmp_path, keep_last=3))
    best = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ckpts"), monitor="train_loss", save_top_k=2
    )
    with pytest.raises(ConfigurationError, match="retention"):
        trainer(tmp_path, epochs=1, plugins=[io], callbacks=[io, best]).fit(Tiny())
    io.close()
    io = LazyCheckpointIO(chain(tmp_path, keep_last=1))
    latest = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), save_last=True)
    with pytest.raises(ConfigurationError, match="keep_last to at least 2"):
        trainer(tmp_path, epochs=1, plugins=[io], callbacks=[io, latest]).fit(Tiny())
    io.close()


def test_best_by_a_metric_is_kept_by_the_tiers_own_retention(tmp_path: Path) -> None:
    from lazyckpt import KeepBest, Retention
    from lazyckpt.tier import StepInfo

    keep = Retention(keep_last=1, keep_best=KeepBest("train_loss", 2))
    io = LazyCheckpointIO(chain(tmp_path, retention=keep))
    best = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ckpts"), monitor="train_loss", save_top_k=2, every_n_train_steps=1
    )
    trainer(tmp_path, epochs=2, plugins=[io], callbacks=[io, best]).fit(Tiny())
    ckpt = io.checkpointer
    ckpt.drain()
    store = ckpt._core.engine.tiers[1]
    infos = {s: StepInfo.from_manifest(ckpt._call(partial(store.read_manifest, s))) for s in ckpt.steps()}
    # every save carried the monitored value; the tier kept the best two and the newest
    assert all("train_loss" in info.metrics for info in infos.values())
    kept_by_callback = {int(n.split("step=")[1].split(".")[0]) for n in os.listdir(tmp_path / "ckpts")}
    assert kept_by_callback <= set(infos)
    assert len(infos) <= 3
    io.close()
    wrong = Retention(keep_last=1, keep_best=KeepBest("train_loss", 1))
    io = LazyCheckpointIO(chain(tmp_path / "other", retention=wrong))
    with pytest.raises(ConfigurationError, match=r"KeepBest\('train_loss', 2, 'min'\)"):
        trainer(tmp_path, epochs=1, plugins=[io], callbacks=[io, best]).fit(Tiny())
    io.close()


def test_callback_only_installs_itself(tmp_path: Path) -> None:
    io = LazyCheckpointIO(chain(tmp_path))
    t = trainer(tmp_path, epochs=1, plugins=[], callbacks=[io, every_epoch(tmp_path)])
    t.fit(Tiny())
    assert t.strategy.checkpoint_io is io
    assert read_pointer(str(tmp_path / "ckpts" / "last.ckpt")) == BATCHES
    io.close()


def test_plugin_only_waits_for_each_capture_and_warns(tmp_path: Path) -> None:
    io = LazyCheckpointIO(chain(tmp_path))
    with pytest.warns(UserWarning, match="not registered as a callback"):
        trainer(tmp_path, epochs=2, plugins=[io], callbacks=[every_epoch(tmp_path)]).fit(Tiny())
    assert io.checkpointer.steps() == [4, 8]
    io.close()


def test_failed_save_does_not_stop_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = FaultyTier(FileTier(tmp_path / "store"))
    broken.break_("commit")
    io = LazyCheckpointIO([HostMemoryTier(8 << 20), broken], retries=0)
    model = Tiny()
    with caplog.at_level(logging.ERROR, logger="lazyckpt.integrations.lightning"):
        trainer(tmp_path, epochs=2, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(model)
    assert len(model.losses) == 2 * BATCHES  # training ran to the end
    assert "FAILED" in caplog.text
    assert not (tmp_path / "ckpts").exists() or os.listdir(tmp_path / "ckpts") == []
    io.close()


def test_path_appears_only_once_the_step_is_durable(tmp_path: Path) -> None:
    slow = FaultyTier(FileTier(tmp_path / "store"))
    io = LazyCheckpointIO([HostMemoryTier(8 << 20), slow], deadline=None)
    slow.hang("commit")
    path = tmp_path / "ckpts" / "a.ckpt"
    w = torch.ones(4)
    with pytest.warns(UserWarning, match="not registered as a callback"):
        io.save_checkpoint({"global_step": 3, "w": w}, path)
    w.add_(1)  # outside training the save waited for its capture: this change is not in it
    assert not path.exists()
    slow.heal()
    io.teardown()
    assert read_pointer(str(path)) == 3
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(4))
    io.remove_checkpoint(path)
    assert not path.exists() and io.checkpointer.steps() == []
    io.close()


def test_a_step_no_path_names_any_more_is_deleted(tmp_path: Path) -> None:
    path = tmp_path / "ckpts" / "last.ckpt"
    for step in (1, 2):  # two runs, each with its own object, overwriting the same path
        with LazyCheckpointIO(chain(tmp_path)) as io:
            io._guarded = io._training = True  # as inside fit, with the callback
            io.save_checkpoint({"global_step": step, "w": torch.full((3,), step)}, path)
            io.teardown()
            assert read_pointer(str(path)) == step
            assert io.checkpointer.steps() == [step]


def test_plain_checkpoint_files_still_load(tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    torch.save({"global_step": 1, "w": torch.arange(3)}, path)
    io = LazyCheckpointIO(chain(tmp_path))
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(3))
    io.close()


@pytest.mark.slow
def test_example_lightning_train_runs() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
    out = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300,
        cwd=example.parent.parent,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "last.ckpt              -> lazyckpt step 16" in out.stdout
    assert "losses identical bit for bit" in out.stdout


def test_keys_lazyckpt_would_refuse_round_trip(tmp_path: Path) -> None:
    odd = {
        "global_step": 5,
        "by_path": {"/abs/epoch=1.ckpt": torch.tensor(0.5), "": torch.ones(2), "..": [1, (2, 3)]},
        "lazyckpt.items": {"x": torch.zeros(1)},
        "ints": {0: {"exp_avg": torch.arange(3)}},
    }
    with LazyCheckpointIO(chain(tmp_path)) as io:
        io._guarded = io._training = True
        io.save_checkpoint(odd, tmp_path / "odd.ckpt")
        io.teardown()
        back = io.load_checkpoint(tmp_path / "odd.ckpt")
    assert back.keys() == odd.keys()
    assert list(back["by_path"]) == ["/abs/epoch=1.ckpt", "", ".."]
    assert torch.equal(back["by_path"]["/abs/epoch=1.ckpt"], torch.tensor(0.5))
    assert back["by_path"][".."] == [1, (2, 3)]
    assert torch.equal(back["lazyckpt.items"]["x"], torch.zeros(1))
    assert torch.equal(back["ints"][0]["exp_avg"], torch.arange(3))


class Recorder(pl.Callback):
    """The module's weights at each epoch's end (what ModelCheckpoint saves then), by step."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.states[trainer.global_step] = weights(pl_module)


def weights(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def stored_weights(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    with SyncCheckpointer([FileTier(root / "store")]) as check:
        return {s: check.restore(s)["state_dict"] for s in check.steps()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_from_an_earlier_step_replaces_the_abandoned_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpts = tmp_path / "ckpts"
    with LazyCheckpointIO(chain(tmp_path)) as io:
        trainer(tmp_path, epochs=4, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(Tiny())
    old = stored_weights(tmp_path)
    assert sorted(old) == [4, 8, 12, 16]

    # a rollback: resume from the top-k file of step 8 with other data and learning rate
    recorder = Recorder()
    again = Tiny(lr=0.02, seed=3, data_seed=2)
    with (
        caplog.at_level(logging.WARNING, logger="lazyckpt.integrations.lightning"),
        LazyCheckpointIO(chain(tmp_path)) as io,
    ):
        t = trainer(tmp_path, epochs=4, plugins=[io], callbacks=[io, every_epoch(tmp_path), recorder])
        t.fit(again, ckpt_path=str(ckpts / "epoch=1-step=8.ckpt"))
        assert io.metrics()["snapshots_failed"] == 0
    # Lightning names a top-k file whose name is taken '-v1' (epoch=2-step=12.ckpt still
    # existed when it chose); the old file named a step of the abandoned run and is gone
    assert {n: read_pointer(str(ckpts / n)) for n in os.listdir(ckpts)} == {
        "epoch=0-step=4.ckpt": 4, "epoch=1-step=8.ckpt": 8, "epoch=2-step=12-v1.ckpt": 12,
        "epoch=3-step=16.ckpt": 16, "last.ckpt": 16,
    }
    new = stored_weights(tmp_path)
    assert sorted(new) == [4, 8, 12, 16]
    for step in (4, 8):  # the history both runs share is kept
        assert same(new[step], old[step]), step
    for step in (12, 16):  # every later step holds the second run's state
        assert same(new[step], recorder.states[step]), step
        assert not same(new[step], old[step]), step
    assert same(new[16], weights(again))
    assert "step(s) [12, 16] from another run" in caplog.text  # named, not silent

    # 'last' is the second run's end, and the top-k file of step 12 continues the second run
    with LazyCheckpointIO(chain(tmp_path)) as io:
        latest = Tiny(lr=0.02, seed=9, data_seed=2)
        trainer(tmp_path, epochs=4, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(
            latest, ckpt_path="last"
        )
        assert same(weights(latest), weights(again))
        resumed = Tiny(lr=0.02, seed=9, data_seed=2)
        trainer(tmp_path, epochs=4, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(
            resumed, ckpt_path=str(ckpts / "epoch=2-step=12-v1.ckpt")
        )
    assert resumed.losses == again.losses[-BATCHES:]
    assert same(weights(resumed), weights(again))
    # its save of step 16 replaced the step with the same state, and 'last' names it
    assert read_pointer(str(ckpts / "last.ckpt")) == 16
    assert same(stored_weights(tmp_path)[16], weights(again))


def test_pointers_to_abandoned_steps_go_before_the_new_save_lands(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    with LazyCheckpointIO(chain(tmp_path)) as io:  # the first run: steps 1, 2, 3
        io._guarded = io._training = True  # as inside fit, with the callback
        for step in (1, 2, 3):
            checkpoint = {"global_step": step, "w": torch.full((3,), float(step))}
            io.save_checkpoint(checkpoint, ckpts / f"step={step}.ckpt")
            io.save_checkpoint(checkpoint, ckpts / "last.ckpt")
        io.teardown()
    slow = FaultyTier(FileTier(tmp_path / "store"))
    with LazyCheckpointIO([HostMemoryTier(8 << 20), slow], deadline=None) as io:
        io._guarded = io._training = True
        assert io.load_checkpoint(ckpts / "step=1.ckpt")["global_step"] == 1  # the rollback
        slow.hang("commit")
        io.save_checkpoint({"global_step": 2, "w": torch.full((3,), -2.0)}, ckpts / "step=2.ckpt")
        io.save_checkpoint({"global_step": 2, "w": torch.full((3,), -2.0)}, ckpts / "last.ckpt")
        # until the new step 2 is durable: no path names the abandoned steps 2 and 3, and
        # 'last' names the step resumed from
        assert sorted(os.listdir(ckpts)) == ["last.ckpt", "step=1.ckpt"]
        assert read_pointer(str(ckpts / "last.ckpt")) == 1
        assert 3 not in io.checkpointer.steps()
        slow.heal()
        io.teardown()
        assert {n: read_pointer(str(ckpts / n)) for n in os.listdir(ckpts)} == {
            "step=1.ckpt": 1, "step=2.ckpt": 2, "last.ckpt": 2
        }
        assert torch.equal(io.load_checkpoint(ckpts / "last.ckpt")["w"], torch.full((3,), -2.0))
        assert io.checkpointer.steps() == [1, 2]


def test_a_step_going_back_within_a_run_is_refused_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="lazyckpt.integrations.lightning"),
        LazyCheckpointIO(chain(tmp_path)) as io,
    ):
        io._guarded = io._training = True
        io.save_checkpoint({"global_step": 5, "w": torch.ones(2)}, tmp_path / "a.ckpt")
        io.save_checkpoint({"global_step": 3, "w": torch.zeros(2)}, tmp_path / "b.ckpt")
        io.teardown()
        assert io.checkpointer.steps() == [5]  # this run's own step 5 is not replaced
    assert "comes after step 5, which this run already saved" in caplog.text
    assert read_pointer(str(tmp_path / "a.ckpt")) == 5 and not (tmp_path / "b.ckpt").exists()


def test_fit_releases_the_location_and_a_second_fit_reopens_it(tmp_path: Path) -> None:
    # a notebook: fit, then look at the steps and fit again, with a fresh object and with
    # the first one, none of them closed in between
    io = LazyCheckpointIO(chain(tmp_path))
    trainer(tmp_path, epochs=1, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(Tiny())
    with SyncCheckpointer([FileTier(tmp_path / "store")]) as look:  # a writer's open: free
        assert look.steps() == [BATCHES]
        assert look.restore(BATCHES)["global_step"] == BATCHES
    fresh = LazyCheckpointIO(chain(tmp_path))
    trainer(tmp_path, epochs=2, plugins=[fresh], callbacks=[fresh, every_epoch(tmp_path)]).fit(
        Tiny(), ckpt_path="last"
    )
    model = Tiny()
    trainer(tmp_path, epochs=3, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(
        model, ckpt_path="last"
    )
    assert len(model.losses) == BATCHES  # resumed after epoch 2: one epoch to go
    with SyncCheckpointer([FileTier(tmp_path / "store")]) as look:
        assert look.steps() == [BATCHES, 2 * BATCHES, 3 * BATCHES]
    io.close()
    fresh.close()


def test_a_second_writer_in_the_process_is_told_where_the_first_was_opened(
    tmp_path: Path,
) -> None:
    io = LazyCheckpointIO(chain(tmp_path))
    trainer(tmp_path, epochs=1, plugins=[io], callbacks=[io, every_epoch(tmp_path)]).fit(Tiny())
    held = io.checkpointer  # opened again, outside fit: it holds the location until close()
    line = sys._getframe().f_lineno - 1
    assert held.steps() == [BATCHES]
    # reading beside it takes no lock
    with SyncCheckpointer([FileTier(tmp_path / "store", readonly=True)]) as look:
        assert look.steps() == [BATCHES]
        assert look.restore(BATCHES)["global_step"] == BATCHES
    other = LazyCheckpointIO(chain(tmp_path))
    with pytest.raises(LocationInUseError) as caught:
        trainer(tmp_path, epochs=2, plugins=[other], callbacks=[other]).fit(Tiny())
    message = str(caught.value)
    assert "already opened by this process" in message
    assert f"by a LazyCheckpointIO, at {__file__}:{line} in " in message
    assert "close()" in message and "readonly=True" in message
    assert caught.value.holder is not None and caught.value.holder["pid"] == os.getpid()
    assert isinstance(caught.value.__cause__, LocationInUseError)  # the tier's own error
    io.close()
    # the holder closed: the same object opens now, on a clean start
    model = Tiny()
    trainer(tmp_path, epochs=2, plugins=[other], callbacks=[other, every_epoch(tmp_path)]).fit(
        model, ckpt_path=str(tmp_path / "ckpts" / "last.ckpt")
    )
    assert len(model.losses) == BATCHES
    with SyncCheckpointer([FileTier(tmp_path / "store")]) as look:
        assert look.steps() == [BATCHES, 2 * BATCHES]
    other.close()
