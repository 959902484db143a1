"""torchtitan's checkpoint manager on lazyckpt, driven as torchtitan's trainer drives it, with
torchtitan's own optimizer, LR scheduler and dataloader containers on CPU. (The trainer
itself needs an accelerator in torchtitan 0.3, so the loop below plays its part.)"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
from torch.utils.data import IterableDataset

pytest.importorskip("torchtitan", reason="torchtitan is not installed")

from torchtitan.components.checkpointer import BaseCheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

from lazyckpt import (
    ConfigurationError,
    SnapshotFailedError,
    StateMismatchError,
    SyncCheckpointer,
)
from lazyckpt.integrations.torchtitan import LazyCheckpointManager
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import launch_ranks, rank_results
from titan_llama import TitanLlama, TitanLlamaAdapter, hf_config

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
    """One training run: torchtitan's containers around a tiny model (``model``, else a small
    MLP), and the manager, given ``sd_adapter`` as torchtitan's trainer gives it."""

    def __init__(
        self,
        folder: Path,
        *,
        model: torch.nn.Module | None = None,
        sd_adapter: Any = None,
        **config: Any,
    ) -> None:
        torch.manual_seed(0)
        self.model = model or torch.nn.Sequential(
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
            "sd_adapter": sd_adapter,
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


def test_a_cadence_per_tier_from_the_config(tmp_path: Path) -> None:
    from tiers import HostMemoryTier, ZarrTier

    tiers = [
        HostMemoryTier(8 << 20),
        FileTier(tmp_path / "local", name="local"),
        ZarrTier(tmp_path / "pfs", name="pfs"),
    ]
    run = Run(tmp_path, interval=1, tiers=tiers, cadence={"pfs": 3}, last_save_model_only=False)
    run.train(STEPS)
    run.checkpointer.close()
    with SyncCheckpointer([FileTier(tmp_path / "local", readonly=True)]) as local:
        assert local.steps() == list(range(1, STEPS + 1))
    with SyncCheckpointer([ZarrTier(tmp_path / "pfs", readonly=True)]) as pfs:
        # every 3rd step, and the last one as the close's emergency copy
        assert pfs.steps() == sorted({*range(3, STEPS + 1, 3), STEPS})


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


def test_disabled_settings(tmp_path: Path) -> None:
    off = Run(tmp_path, enable=False)
    assert not off.checkpointer.save(4)
    assert not off.checkpointer.load()


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


@pytest.fixture(scope="module", params=["hsdp", "fsdp_tp"])
def saved_2d(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Path]:
    """4 ranks trained and saved through the manager on a 2-D layout: the layout, the base
    folder, and the folder holding what rank 0 wrote (``expected.pt``, ``saved.json``)."""
    layout = str(request.param)
    base = tmp_path_factory.mktemp(layout)
    out = base / "out"
    out.mkdir()
    launch_ranks(WORKER, [f"save-{layout}", str(base), str(out)], 4, timeout=170)
    saved = rank_results(out)
    assert sorted(saved) == [0, 1, 2, 3]
    assert all(r["steps"] == [2, 4] for r in saved.values())
    return layout, base, out


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 2])
@pytest.mark.parametrize("saved_2d", ["hsdp", "fsdp_tp"], indirect=True)
def test_a_2d_layout_saved_loads_onto_fsdp(
    saved_2d: tuple[str, Path, Path], world: int, tmp_path: Path
) -> None:
    """HSDP 2x2, and FSDP over tensor parallelism 2x2, saved through the manager, load
    through ``manager.load()`` onto FSDP over another number of ranks (resharded)."""
    layout, base, saved_out = saved_2d
    out = tmp_path / "out"
    out.mkdir()
    for name in ("expected.pt", "saved.json"):
        shutil.copy(saved_out / name, out / name)
    launch_ranks(WORKER, ["load-fsdp", str(base), str(out)], world, timeout=170)
    loaded = rank_results(out)
    assert sorted(loaded) == list(range(world))
    # the dataloader loads where the data-parallel degree is the saved one: HSDP's 4, FSDP
    # over tensor parallelism's 2
    same_degree = world == {"hsdp": 4, "fsdp_tp": 2}[layout]
    resumes = {}
    for rank, r in loaded.items():
        assert r["loaded"], rank
        assert r["differ"] == [], rank  # model and optimizer, gathered, bit for bit
        assert r["layout_kept"], rank  # still FSDP over this world, as built
        assert r["step"] == 4, rank
        assert r["lr_epoch"] == 4, rank
        assert r["dataloader_loaded"] == same_degree, rank
        if same_degree:
            resumes[rank] = r["next_batch_resumes"]
    # torchtitan keys the dataloader's state by data-parallel rank: on FSDP x TP 2x2 dp
    # rank 1's was saved by ranks 2 and 3 only, and on 2 ranks rank 1 restores it (a value
    # only other ranks saved is found by its key, as with DCP)
    assert all(resumes.values()), resumes


def test_the_config_serializes_as_torchtitan_logs_it() -> None:
    config = LazyCheckpointManager.Config(enable=True, interval=500, host_bytes=8 << 30)
    as_dict = config.to_dict()
    assert as_dict["host_bytes"] == 8 << 30
    assert as_dict["when_busy"] == "wait"
    assert as_dict["interval"] == 500
    with pytest.raises(ValueError, match="at least 2 checkpoint"):  # torchtitan's own check
        LazyCheckpointManager.Config(keep_latest_k=1)


# -- Hugging Face checkpoints --------------------------------------------------------------------

INDEX = "model.safetensors.index.json"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def hf_run(folder: Path, adapter: Any = None, **config: Any) -> Run:
    return Run(folder, model=TitanLlama(), sd_adapter=adapter or TitanLlamaAdapter(), **config)


def transformers_llama(seed: int) -> Any:
    """transformers' Llama of the same shape as TitanLlama, built from its config, its norms
    moved off their initial ones."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model


def test_the_last_step_in_hf_is_what_from_pretrained_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    run = hf_run(tmp_path, last_save_in_hf=True, hf_max_shard_bytes=64 << 10)
    run.train(STEPS)
    run.checkpointer.close()
    assert committed(tmp_path / "ckpt") == [4]  # the last step is the HF directory alone
    out = tmp_path / "ckpt" / "hf" / f"step-{STEPS}"
    index = json.loads((out / INDEX).read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2
    assert set(index["weight_map"].values()) == set(files)
    trained = TitanLlamaAdapter().to_hf(run.model.state_dict())
    assert set(index["weight_map"]) == set(trained)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in trained.values())

    hf_config().save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    assert set(loaded) == set(trained)
    for key, tensor in trained.items():
        assert same_bits(loaded[key], tensor), key
    # the adapter's values, not the model's own: query rows are in transformers' order
    wq = run.model.state_dict()["layers.0.attention.wq.weight"]
    assert not torch.equal(loaded["model.layers.0.self_attn.q_proj.weight"], wq)


def test_the_hf_export_dtype_and_the_adapters_file_layout(tmp_path: Path) -> None:
    # the checkpoint the model came from, sharded by transformers itself: its index says
    # which file each tensor goes in, and the export follows it
    assets = tmp_path / "assets"
    transformers_llama(1).save_pretrained(assets, max_shard_size="100KB")
    original = json.loads((assets / INDEX).read_text())["weight_map"]
    assert len(set(original.values())) > 2
    adapter = TitanLlamaAdapter(hf_assets_path=str(assets))
    run = hf_run(tmp_path, adapter, last_save_in_hf=True, export_dtype="bfloat16")
    run.train(STEPS)
    run.checkpointer.close()
    out = tmp_path / "ckpt" / "hf" / f"step-{STEPS}"
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    assert weight_map == original
    with safetensors.safe_open(out / weight_map["lm_head.weight"], "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16


def test_a_run_starts_from_a_transformers_checkpoint(tmp_path: Path) -> None:
    hf = transformers_llama(2)
    source = tmp_path / "llama"
    hf.save_pretrained(source, max_shard_size="100KB")  # transformers' own sharded layout
    run = hf_run(tmp_path / "a", initial_load_in_hf=True, initial_load_path=str(source))
    assert run.checkpointer.load()
    want = TitanLlamaAdapter().from_hf(hf.state_dict())
    got = run.model.state_dict()
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert same_bits(got[key], tensor), key
    run.train(4)  # and trains on, saving step 4 as usual
    run.checkpointer.close()
    assert committed(tmp_path / "a" / "ckpt") == [4]

    # a committed step wins over the initial checkpoint, as in torchtitan's manager
    again = hf_run(tmp_path / "a", initial_load_in_hf=True, initial_load_path=str(source))
    assert again.checkpointer.load()
    assert again.train_state.step == 4
    for key, tensor in run.model.state_dict().items():
        assert same_bits(again.model.state_dict()[key], tensor), key
    again.checkpointer.close()


def test_hf_load_from_the_adapters_assets_and_a_single_file(tmp_path: Path) -> None:
    hf = transformers_llama(3)
    assets = tmp_path / "assets"
    hf.save_pretrained(assets)  # one model.safetensors, no index
    assert not (assets / INDEX).exists()
    adapter = TitanLlamaAdapter(hf_assets_path=str(assets))
    run = hf_run(tmp_path / "a", adapter, initial_load_in_hf=True)
    assert run.checkpointer.load()
    want = TitanLlamaAdapter().from_hf(hf.state_dict())
    for key, tensor in run.model.state_dict().items():
        assert same_bits(tensor, want[key]), key
    run.checkpointer.close()


def test_hf_settings_that_cannot_work(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="state-dict adapter"):
        Run(tmp_path, last_save_in_hf=True)  # the MLP has no adapter
    with pytest.raises(ConfigurationError, match="initial_load_path, else the model's"):
        hf_run(tmp_path, initial_load_in_hf=True)  # nowhere to load from
    with pytest.raises(ConfigurationError, match="at least 1 byte"):
        LazyCheckpointManager.Config(enable=True, last_save_in_hf=True, hf_max_shard_bytes=0)
    with pytest.raises(ConfigurationError, match="quantized"):
        hf_run(
            tmp_path,
            initial_load_in_hf=True,
            initial_load_in_hf_quantized=True,
            initial_load_path=str(tmp_path),
        )

    def load_from(path: Path) -> None:
        run = hf_run(tmp_path / "fresh", initial_load_in_hf=True, initial_load_path=str(path))
        try:
            run.checkpointer.load()
        finally:
            run.checkpointer.close()

    with pytest.raises(ConfigurationError, match="not a directory"):
        load_from(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigurationError, match="no safetensors files"):
        load_from(empty)
    partial = tmp_path / "partial"
    state = transformers_llama(4).state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    partial.mkdir()
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in state.items()}, partial / "model.safetensors"
    )
    with pytest.raises(StateMismatchError, match="lacks 1 tensor") as info:
        load_from(partial)
    assert info.value.missing == ["model.layers.1.mlp.up_proj.weight"]


@pytest.mark.slow
def test_fsdp2_ranks_save_and_load_hf(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "out"
    out.mkdir()
    launch_ranks(WORKER, ["hf", str(tmp_path), str(out)], 2, timeout=150)
    results = rank_results(out)
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert result["loaded"] and result["sharded"]
        assert result["differ"] == []  # the sharded model loads what the ranks wrote
    directory = tmp_path / "ckpt" / "hf" / "step-4"
    assert len(list(directory.glob("model-*.safetensors"))) > 2  # the ranks took turns
    hf_config().save_pretrained(directory)
    loaded = transformers.LlamaForCausalLM.from_pretrained(directory).state_dict()
    expected = torch.load(out / "expected_hf.pt", weights_only=True)
    index = json.loads((directory / INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
    assert set(loaded) == set(expected)
    for key, tensor in expected.items():
        assert same_bits(loaded[key], tensor), key
