"""LazyCheckpointCallback against the real transformers Trainer, on CPU with a tiny GPT-2."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("accelerate", reason="accelerate is not installed")

from transformers import TrainerCallback  # noqa: E402

from lazyckpt import ConfigurationError, SyncCheckpointer  # noqa: E402
from lazyckpt.integrations.huggingface import LazyCheckpointCallback  # noqa: E402
from lazyckpt.testing import FaultyTier  # noqa: E402
from tiers import FileTier, HostMemoryTier  # noqa: E402

SAMPLES, BATCH, EPOCHS = 16, 4, 3  # 4 steps an epoch, 12 in all


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (SAMPLES, 16), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2  # dropout 0.1 stays on
    )
    m = transformers.GPT2LMHeadModel(config)
    m.losses = []
    m.register_forward_hook(lambda mod, _i, out: mod.losses.append(out.loss.item()) if mod.training else None)
    return m


def train(
    root: Path, m: Any, callbacks: list[Any], resume: str | None = None, data_seed: int = 7,
    **kw: Any,
) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(root / "out"),
        "per_device_train_batch_size": BATCH,
        "num_train_epochs": EPOCHS,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_strategy": "steps",
        "save_steps": 2,
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
    }
    args = transformers.TrainingArguments(**{**options, **kw})
    trainer = transformers.Trainer(
        model=m, args=args, train_dataset=Tokens(data_seed), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def chain(root: Path) -> list[Any]:
    return [HostMemoryTier(16 << 20), FileTier(root / "store")]


@pytest.mark.slow
def test_resume_continues_bit_identically(tmp_path: Path) -> None:
    straight = model()
    train(tmp_path / "plain", straight, [])

    with LazyCheckpointCallback(chain(tmp_path)) as cb:
        lazy = model()
        t = train(tmp_path, lazy, [cb])
        assert lazy.losses == straight.losses  # the callback does not perturb training
        assert cb.checkpointer.steps() == [2, 4, 6, 8, 10, 12]
        log_history = t.state.log_history
    assert not os.path.exists(tmp_path / "out") or not any(
        n.startswith("checkpoint-") for n in os.listdir(tmp_path / "out")
    )  # the Trainer's own save was replaced

    for step in (4, 6):  # an epoch boundary and the middle of an epoch
        with LazyCheckpointCallback(chain(tmp_path)) as cb:
            resumed = model(seed=step)  # other initial weights
            folder = cb.checkpoint_dir(step)
            assert folder is not None
            t = train(tmp_path / f"r{step}", resumed, [cb], resume=folder)
        assert resumed.losses == straight.losses[step:], step
        for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
            assert torch.equal(a, b)
        assert t.state.log_history[: step] == log_history[: step]
        assert not os.path.exists(folder)  # the resume folder is gone after training


def test_every_step_and_latest(tmp_path: Path) -> None:
    with LazyCheckpointCallback(chain(tmp_path), every_step=True) as cb:
        assert cb.checkpoint_dir() is None  # nothing saved yet
        train(tmp_path, model(), [cb], num_train_epochs=1)
        assert cb.checkpointer.steps() == [1, 2, 3, 4]
        folder = cb.checkpoint_dir()
        assert folder is not None and folder.endswith("checkpoint-4")
        assert sorted(os.listdir(folder)) == [
            "optimizer.pt", "pytorch_model.bin", "rng_state.pth", "scheduler.pt", "trainer_state.json"
        ]
    with SyncCheckpointer([FileTier(tmp_path / "store")]) as check:
        saved = check.restore(3)
    assert set(saved) == {"format", "model", "optimizer", "scheduler", "scaler", "rng", "trainer_state"}
    assert '"global_step": 3' in saved["trainer_state"]


def test_the_logged_metrics_go_with_each_snapshot_for_retention_by_the_best(tmp_path: Path) -> None:
    from lazyckpt import KeepBest, Retention
    from lazyckpt.tier import StepInfo

    keep = Retention(keep_last=1, keep_best=KeepBest("eval_loss", 2))
    tiers = [HostMemoryTier(16 << 20), FileTier(tmp_path / "store", retention=keep)]
    with LazyCheckpointCallback(tiers) as cb:
        t = transformers.Trainer(
            model=model(),
            args=transformers.TrainingArguments(
                output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                num_train_epochs=EPOCHS, learning_rate=1e-2, logging_steps=1,
                save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2,
                metric_for_best_model="eval_loss", report_to=[], disable_tqdm=True,
                use_cpu=True, seed=0,
            ),
            train_dataset=Tokens(), eval_dataset=Tokens(seed=8), callbacks=[cb],
        )
        t.train()
        ckpt = cb.checkpointer
        ckpt.drain()
        evals = {e["step"]: e["eval_loss"] for e in t.state.log_history if "eval_loss" in e}
    with SyncCheckpointer([FileTier(tmp_path / "store", readonly=True)]) as check:
        tier = check._core.engine.tiers[0]
        kept = check.steps()
        infos = {s: StepInfo.from_manifest(check._call(lambda s=s: tier.read_manifest(s))) for s in kept}
    assert all(infos[s].metrics["eval_loss"] == evals[s] for s in kept)
    best = sorted(evals, key=lambda s: (evals[s], -s))[:2]
    assert set(kept) == {*best, max(evals)}


def test_keep_trainer_save_keeps_the_trainers_folders(tmp_path: Path) -> None:
    with LazyCheckpointCallback(chain(tmp_path), keep_trainer_save=True) as cb:
        train(tmp_path, model(), [cb], num_train_epochs=1)
        assert cb.checkpointer.steps() == [2, 4]
    assert sorted(n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-")) == [
        "checkpoint-2", "checkpoint-4"
    ]


def test_failed_snapshot_does_not_stop_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = FaultyTier(FileTier(tmp_path / "store"))
    broken.break_("commit")
    m = model()
    with (
        caplog.at_level(logging.ERROR, logger="lazyckpt.integrations.huggingface"),
        LazyCheckpointCallback([HostMemoryTier(16 << 20), broken], retries=0) as cb,
    ):
        train(tmp_path, m, [cb], num_train_epochs=1)
    assert len(m.losses) == SAMPLES // BATCH
    assert "FAILED" in caplog.text


@pytest.mark.slow
def test_example_hf_trainer_runs() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
    out = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300,
        cwd=example.parent.parent,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "lazyckpt steps: [4, 8, 12]" in out.stdout
    assert "losses identical bit for bit" in out.stdout


def test_load_best_model_at_end_needs_the_trainers_folders(tmp_path: Path) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), load_best_model_at_end=True, eval_strategy="steps",
        eval_steps=2, save_steps=2, report_to=[], use_cpu=True, max_steps=2,
    )
    with LazyCheckpointCallback(chain(tmp_path)) as cb:
        trainer = transformers.Trainer(
            model=model(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(), callbacks=[cb]
        )
        with pytest.raises(ConfigurationError, match="keep_trainer_save"):
            trainer.train()


@pytest.mark.slow
def test_resume_with_gradient_accumulation(tmp_path: Path) -> None:
    # 2 micro-batches an update: 2 updates an epoch, snapshots at updates 2, 4, 6
    straight = model()
    train(tmp_path / "plain", straight, [], gradient_accumulation_steps=2)
    with LazyCheckpointCallback(chain(tmp_path)) as cb:
        train(tmp_path, model(), [cb], gradient_accumulation_steps=2)
        assert cb.checkpointer.steps() == [2, 4, 6]
    with LazyCheckpointCallback(chain(tmp_path)) as cb:
        resumed = model(seed=5)
        train(tmp_path / "r", resumed, [cb], gradient_accumulation_steps=2, resume=cb.checkpoint_dir(2))
    assert resumed.losses == straight.losses[2 * 2 :]  # a loss per micro-batch


class Recorder(TrainerCallback):
    """The model's weights after each optimizer step, by global step (what a snapshot of
    that step, taken before the next step's forward, holds)."""

    def __init__(self) -> None:
        self.states: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.states[state.global_step] = {
            k: v.detach().clone() for k, v in kw["model"].state_dict().items()
        }


def stored_models(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    with SyncCheckpointer([FileTier(root / "store")]) as check:
        return {s: check.restore(s)["model"] for s in check.steps()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_resume_from_an_earlier_step_replaces_the_abandoned_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a rollback: train to step 12, resume from step 4 with other data and learning rate
    with LazyCheckpointCallback(chain(tmp_path)) as cb:
        train(tmp_path, model(), [cb])
    old = stored_models(tmp_path)
    assert sorted(old) == [2, 4, 6, 8, 10, 12]

    recorder = Recorder()
    with (
        caplog.at_level(logging.WARNING, logger="lazyckpt.integrations.huggingface"),
        LazyCheckpointCallback(chain(tmp_path)) as cb,
    ):
        again = model(seed=3)
        train(
            tmp_path / "again", again, [cb, recorder], resume=cb.checkpoint_dir(4),
            data_seed=8, learning_rate=3e-3,
        )
        assert cb.metrics()["snapshots_failed"] == 0
    new = stored_models(tmp_path)
    assert sorted(new) == [2, 4, 6, 8, 10, 12]
    for step in (2, 4):  # the history both runs share is kept
        assert same(new[step], old[step]), step
    for step in (6, 8, 10, 12):  # every later step holds the second run's state
        assert same(new[step], recorder.states[step]), step
        assert not same(new[step], old[step]), step
    assert same(new[12], {k: v.detach() for k, v in again.state_dict().items()})
    assert "step(s) [6, 8, 10, 12] from another run" in caplog.text  # named, not silent

    # the newest checkpoint is the second run's end, and step 10 continues the second run
    with LazyCheckpointCallback(chain(tmp_path)) as cb:
        folder = cb.checkpoint_dir()
        assert folder is not None and folder.endswith("checkpoint-12")
        resumed = model(seed=9)
        train(
            tmp_path / "third", resumed, [cb], resume=cb.checkpoint_dir(10),
            data_seed=8, learning_rate=3e-3,
        )
        assert cb.checkpointer.steps() == [2, 4, 6, 8, 10, 12]
    assert resumed.losses == again.losses[-2:]
    assert same(resumed.state_dict(), again.state_dict())
    assert same(stored_models(tmp_path)[12], recorder.states[12])  # a save of step 12 again:
    # the state resumed from step 10 reproduces it, so the store is unchanged


def test_a_new_run_on_tiers_with_another_runs_steps_replaces_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # no resume at all: a second run from step 0 on the same tiers, as the Trainer
    # overwrites checkpoint-N folders of an output directory it reuses
    with LazyCheckpointCallback(chain(tmp_path)) as cb:
        train(tmp_path, model(), [cb], num_train_epochs=1)
    old = stored_models(tmp_path)
    recorder = Recorder()
    with (
        caplog.at_level(logging.WARNING, logger="lazyckpt.integrations.huggingface"),
        LazyCheckpointCallback(chain(tmp_path)) as cb,
    ):
        train(tmp_path, model(seed=4), [cb, recorder], num_train_epochs=1, data_seed=8)
    new = stored_models(tmp_path)
    assert sorted(new) == sorted(old) == [2, 4]
    for step in (2, 4):
        assert same(new[step], recorder.states[step]) and not same(new[step], old[step])
    assert "step(s) [2, 4] from another run" in caplog.text


def test_the_same_step_saved_twice_in_a_run_is_saved_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.DEBUG, logger="lazyckpt.integrations.huggingface"),
        LazyCheckpointCallback(chain(tmp_path)) as cb,
    ):
        t = train(tmp_path, model(), [cb], num_train_epochs=1)
        taken = len(cb.metrics()["snapshots"])  # the run's, closed at its end
        assert taken == 2
        cb._due = True  # the step's save decided again (a step's and the epoch's end)
        cb.on_train_end(
            t.args, t.state, t.control,
            model=t.model, optimizer=t.optimizer, lr_scheduler=t.lr_scheduler,
        )
        assert len(cb.metrics()["snapshots"]) == taken
        assert cb.checkpointer.steps() == [2, 4]
    assert "already saved by this run" in caplog.text
    assert "another run" not in caplog.text and "NOT saved" not in caplog.text


def test_train_releases_the_location_and_a_second_train_reopens_it(tmp_path: Path) -> None:
    # a notebook: train, look at the steps, train again with a fresh callback and with the
    # first one, none of them closed in between
    cb = LazyCheckpointCallback(chain(tmp_path))
    train(tmp_path, model(), [cb], num_train_epochs=1)
    assert [s["step"] for s in cb.metrics()["snapshots"]] == [2, 4]  # the closed run's
    with SyncCheckpointer([FileTier(tmp_path / "store")]) as look:  # a writer's open: free
        assert look.steps() == [2, 4]
        assert look.restore(4)["format"] == "lazyckpt.huggingface/1"
    fresh = LazyCheckpointCallback(chain(tmp_path))
    train(tmp_path, model(), [fresh], num_train_epochs=2, resume=fresh.checkpoint_dir())
    again = model()
    train(tmp_path, again, [cb], num_train_epochs=3, resume=cb.checkpoint_dir())
    assert len(again.losses) == 4  # resumed at step 8: one epoch to go
    with SyncCheckpointer([FileTier(tmp_path / "store")]) as look:
        assert look.steps() == [2, 4, 6, 8, 10, 12]
    cb.close()
    fresh.close()


def test_a_second_writer_in_the_process_is_told_where_the_first_was_opened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cb = LazyCheckpointCallback(chain(tmp_path))
    train(tmp_path, model(), [cb], num_train_epochs=1)
    assert cb.checkpointer.steps() == [2, 4]  # opened again outside train(): held till close()
    line = sys._getframe().f_lineno - 1
    with SyncCheckpointer([FileTier(tmp_path / "store", readonly=True)]) as look:
        assert look.steps() == [2, 4]  # reading beside it takes no lock
    other = LazyCheckpointCallback(chain(tmp_path))
    with caplog.at_level(logging.ERROR, logger="lazyckpt.integrations.huggingface"):
        train(tmp_path, model(), [other], num_train_epochs=1)  # runs on, unsaved, as before
    assert "could not open the tiers" in caplog.text
    assert "already opened by this process" in caplog.text
    assert f"by a LazyCheckpointCallback, at {__file__}:{line} in " in caplog.text
    cb.close()
    caplog.clear()
    train(tmp_path, model(), [other], num_train_epochs=2, resume=other.checkpoint_dir())
    assert "could not open" not in caplog.text
    assert other.checkpointer.steps() == [2, 4, 6, 8]
    other.close()
