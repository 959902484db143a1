"""What trainers keep beside tensors, and restore(into=...) targets: a full round trip
through a Checkpointer and its tiers, with pickle off."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import lazyckpt
from lazyckpt import ConfigurationError, LayoutOptions, StateMismatchError, UnsupportedStateError
from lazyckpt._format.manifest import plan_layout
from lazyckpt._format.values import INLINE_ARRAY_BYTES, DataclassValue
from lazyckpt._format.walk import walk_state
from lazyckpt._restore.keys import _prefix_map, align_into
from tiers import FileTier, HostMemoryTier

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


def tiers(tmp_path: Path) -> list[lazyckpt.Tier]:
    return [HostMemoryTier(32 << 20), FileTier(tmp_path / "file")]


async def save_and_restore(tmp_path: Path, state: dict[str, Any], into: Any = None) -> Any:
    """Snapshot ``state`` as step 1, then restore it with a fresh Checkpointer reading only
    the file tier (so every value really went through storage)."""
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        return await fresh.restore(into=into)


@dataclasses.dataclass
class TrainState:
    epoch: int
    best_loss: float
    history: list[float]
    ema: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    epoch: int


async def test_rng_states_and_arrays_round_trip_without_pickle(tmp_path: Path) -> None:
    np.random.seed(3)
    random.seed(4)
    torch_gen = torch.Generator().manual_seed(5)
    state: dict[str, Any] = {
        "np_global": np.random.get_state(),
        "py_global": random.getstate(),
        "torch_global": torch.get_rng_state(),
        "torch_gen": torch_gen,
        "np_rng": np.random.default_rng(6),
        "np_mt": np.random.Generator(np.random.MT19937(7)),
        "np_legacy": np.random.RandomState(8),
        "py_rng": random.Random(9),
        "bit_state": np.random.default_rng(10).bit_generator.state,
        "small": np.arange(12, dtype=np.int16).reshape(3, 4),
        "large": np.linspace(0, 1, 5000, dtype=np.float32).reshape(50, 100),
        "strings": np.array(["a", "bc"] * 1000),  # 32 KiB of '<U2': raw bytes in the shards
        "big_endian": np.arange(2000, dtype=">i8"),
        "strided": np.arange(40000, dtype=np.float64).reshape(200, 200)[::2, ::3],
    }
    back: dict[str, Any] = await save_and_restore(tmp_path, state)

    # every generator continues exactly where the saved one was
    np.random.set_state(back["np_global"])
    assert np.random.rand() == (np.random.seed(3), np.random.rand())[1]
    random.setstate(back["py_global"])
    assert random.random() == (random.seed(4), random.random())[1]
    assert torch.equal(back["torch_global"], state["torch_global"])
    assert isinstance(back["torch_gen"], torch.Generator)
    assert torch.equal(torch.rand(4, generator=back["torch_gen"]), torch.rand(4, generator=torch_gen))
    for name in ("np_rng", "np_mt"):
        assert type(back[name].bit_generator) is type(state[name].bit_generator)
        assert back[name].random() == state[name].random()
    assert back["np_legacy"].rand() == state["np_legacy"].rand()
    assert back["py_rng"].random() == state["py_rng"].random()
    assert back["bit_state"] == state["bit_state"]

    for name in ("small", "large", "strings", "big_endian", "strided"):
        array = back[name]
        assert type(array) is np.ndarray, name
        assert array.dtype == state[name].dtype and array.shape == state[name].shape, name
        assert np.array_equal(array, state[name]), name
        assert array.flags.writeable, name
    assert isinstance(back["np_global"], tuple) and back["np_global"][1].dtype == np.uint32


async def test_small_arrays_live_in_the_manifest_and_large_ones_in_shards(tmp_path: Path) -> None:
    small = np.zeros(INLINE_ARRAY_BYTES // 8, dtype=np.float64)
    large = np.zeros(INLINE_ARRAY_BYTES // 8 + 1, dtype=np.float64)
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot({"small": small, "large": large}, step=1)).committed()
        manifest = await ckpt.tiers[1].read_manifest(1)
    assert [t.key for t in manifest.tensors] == ["large"]
    assert manifest.tensors[0].dtype == "float64"


async def test_an_array_written_after_snapshot_does_not_reach_the_checkpoint(
    tmp_path: Path,
) -> None:
    """numpy writes bypass torch's version counter, so arrays are copied at snapshot()."""
    array = np.ones(100_000, dtype=np.float32)
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        handle = await ckpt.snapshot({"a": array}, step=1)
        array[:] = 7.0  # before the capture may have run
        await handle.committed()
        back = await ckpt.restore(1)
    assert np.all(back["a"] == 1.0)


async def test_dataclasses_come_back_as_fields_and_load_into_a_live_instance(
    tmp_path: Path,
) -> None:
    saved = TrainState(3, 0.25, [1.0, 0.5], torch.arange(4.0))
    back = await save_and_restore(tmp_path, {"train": saved})
    assert isinstance(back["train"], DataclassValue) and back["train"].type_name.endswith(
        "TrainState"
    )
    assert back["train"]["epoch"] == 3 and torch.equal(back["train"]["ema"], saved.ema)

    ema = torch.zeros(4)
    live = TrainState(0, 9.0, [], ema)
    target = {"train": live}
    assert await save_and_restore(tmp_path / "b", {"train": saved}, into=target) is target
    assert target["train"] is live and live.ema is ema  # loaded in place
    assert (live.epoch, live.best_loss, live.history) == (3, 0.25, [1.0, 0.5])
    assert torch.equal(ema, saved.ema)


async def test_with_pickle_allowed_a_dataclass_comes_back_as_its_class(tmp_path: Path) -> None:
    saved = TrainState(3, 0.25, [1.0], torch.arange(2.0))
    async with lazyckpt.Checkpointer(tiers(tmp_path), allow_pickle=True, **SMALL) as ckpt:
        await (await ckpt.snapshot({"train": saved}, step=1)).committed()
        back = await ckpt.restore(1)
    assert type(back["train"]) is TrainState and back["train"].epoch == 3
    assert torch.equal(back["train"].ema, saved.ema)


async def test_a_frozen_dataclass_target_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="frozen dataclass"):
        await save_and_restore(tmp_path, {"f": Frozen(2)}, into={"f": Frozen(0)})


async def test_generators_and_arrays_load_into_live_objects(tmp_path: Path) -> None:
    gen, np_rng, py_rng = torch.Generator().manual_seed(1), np.random.default_rng(2), random.Random(3)
    array = np.arange(10_000, dtype=np.int32)
    state = {"gen": gen, "np_rng": np_rng, "py_rng": py_rng, "array": array}
    expected = (torch.rand(3, generator=gen), np_rng.random(), py_rng.random())
    gen.manual_seed(1)
    np_rng.bit_generator.state = np.random.default_rng(2).bit_generator.state
    py_rng.seed(3)
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        live: dict[str, Any] = {
            "gen": torch.Generator().manual_seed(99),
            "np_rng": np.random.default_rng(99),
            "py_rng": random.Random(99),
            "array": np.zeros(10_000, dtype=np.int32),
        }
        objects = dict(live)
        await ckpt.restore(1, into=live)
    assert all(live[k] is objects[k] for k in live)  # the same objects, loaded in place
    got = (torch.rand(3, generator=live["gen"]), live["np_rng"].random(), live["py_rng"].random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert np.array_equal(live["array"], array)


@pytest.mark.parametrize(
    "value",
    [np.array([object()], dtype=object), np.zeros(3, dtype=[("a", "i4"), ("b", "f4")])],
)
async def test_arrays_that_need_pickle_are_refused_by_key(tmp_path: Path, value: Any) -> None:
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        with pytest.raises(UnsupportedStateError, match="'extra/arr'"):
            await ckpt.snapshot({"extra": {"arr": value}}, step=1)


# -- into= keys --------------------------------------------------------------------------------


def small_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


async def test_into_with_keys_the_snapshot_lacks_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot({"model": model, "optimizer": opt}, step=1)).committed()
        fresh = small_model()
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        target = {"model": fresh, "optim": fresh_opt}
        with pytest.raises(StateMismatchError) as info:
            await ckpt.restore(1, into=target)
    err = info.value
    assert err.key == "" and err.missing == ["optim"] and err.unexpected == ["optimizer"]
    assert "'optim'" in str(err) and "'optimizer'" in str(err)
    assert set(target) == {"model", "optim"}  # nothing added, nothing loaded
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == 0.5


async def test_a_module_with_other_keys_is_refused_before_loading(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot({"model": small_model()}, step=1)).committed()
        other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        before = [p.clone() for p in other.parameters()]
        with pytest.raises(StateMismatchError) as info:
            await ckpt.restore(1, into={"model": other})
    assert info.value.key == "model"
    assert info.value.missing == ["1.weight", "1.bias"]
    assert info.value.unexpected == ["2.weight", "2.bias"]
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))


async def test_into_a_subset_of_the_snapshot_restores_that_subset(tmp_path: Path) -> None:
    model = small_model()
    async with lazyckpt.Checkpointer(tiers(tmp_path), **SMALL) as ckpt:
        await (await ckpt.snapshot({"model": model, "step": 5}, step=1)).committed()
        fresh = small_model()
        target: dict[str, Any] = {"model": fresh}
        await ckpt.restore(1, into=target)
    assert target["step"] == 5
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


def compiled_keys(model: torch.nn.Module) -> torch.nn.Module:
    """A module whose state-dict keys are the ones ``torch.compile`` gives
    (``_orig_mod.`` + the model's), as the real compiled model in tests/models checks."""
    wrapper = torch.nn.Module()
    wrapper._orig_mod = model
    return wrapper


@pytest.mark.parametrize("direction", ["compiled to plain", "plain to compiled"])
async def test_wrapper_prefixes_are_mapped_on_restore_into(tmp_path: Path, direction: str) -> None:
    saved = small_model()
    saved_opt = torch.optim.AdamW(saved.parameters())
    saved(torch.randn(3, 4)).sum().backward()
    saved_opt.step()
    fresh = small_model()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    if direction == "compiled to plain":
        state: dict[str, Any] = {"model": compiled_keys(saved), "optim": saved_opt}
        target: dict[str, Any] = {"model": fresh, "optim": fresh_opt}
    else:
        state = {"model": saved, "optim": saved_opt}
        target = {"model": compiled_keys(fresh), "optim": fresh_opt}
    await save_and_restore(tmp_path, state, into=target)
    for a, b in zip(saved.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["exp_avg"], saved_opt.state_dict()["state"][0]["exp_avg"]
    )


async def test_mapping_targets_get_wrapper_prefixes_mapped_too(tmp_path: Path) -> None:
    saved = small_model()
    state = {"model": {f"module.{k}": v for k, v in saved.state_dict().items()}}
    fresh = small_model()
    target = {"model": fresh.state_dict()}  # live tensors of the fresh model
    await save_and_restore(tmp_path, state, into=target)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), fresh.parameters(), strict=True))


def test_strip_prefix_renames_the_top_level_keys_only() -> None:
    w = torch.ones(1)
    state = {"_orig_mod.a.weight": w, "step": 3, "_orig_mod.b": {"_orig_mod.c": 1}}
    out = lazyckpt.strip_prefix(state, "_orig_mod.")
    assert out == {"a.weight": w, "step": 3, "b": {"_orig_mod.c": 1}}
    assert out["a.weight"] is w
    with pytest.raises(ConfigurationError, match="both become 'x'"):
        lazyckpt.strip_prefix({"x": 1, "_orig_mod.x": 2}, "_orig_mod.")


def test_the_trainer_state_example_resumes_bit_for_bit() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "resume_trainer_state.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "resumed bit for bit" in done.stdout


def test_inspect_shows_trainer_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lazyckpt.cli import EXIT_OK, main

    state = {
        "big": np.zeros((100, 50), dtype=np.float32),
        "small": np.arange(3, dtype=np.int8),
        "gen": torch.Generator().manual_seed(0),
        "train": TrainState(2, 0.5, [], torch.zeros(3)),
    }
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        ckpt.snapshot(state, step=1).wait()
    assert main(["inspect", str(tmp_path)]) == EXIT_OK
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["big"].split()[1:5] == ["float32", "[100,", "50]", "19.5"]
    assert "array([0, 1, 2], dtype=int8)" in rows["small"]
    assert rows["gen"].split()[1:3] == ["uint8", "[5056]"]
    assert rows["epoch"].split() == ["epoch", "=", "2"] and "train/" in rows


module_keys = st.sets(
    st.lists(st.sampled_from(["0", "1", "layer", "bn", "weight", "bias", "module"]), min_size=1, max_size=3).map(".".join),
    min_size=1,
    max_size=8,
)
wrappings = st.sampled_from(["", "_orig_mod.", "module.", "module._orig_mod."])


@given(keys=module_keys, saved=wrappings, target=wrappings, extra=st.booleans())
def test_wrapper_prefixes_map_exactly_when_they_are_the_only_difference(
    keys: set[str], saved: str, target: str, extra: bool
) -> None:
    assume(saved != target)  # equal keys are never mapped
    have = [saved + k for k in sorted(keys)]
    want = [target + k for k in sorted(keys)] + (["not.saved"] if extra else [])
    mapping = _prefix_map(have, want)
    if extra:
        assert mapping is None  # a key the snapshot lacks is never invented
    else:
        assert mapping == dict(zip(have, want[: len(have)], strict=True))


def test_a_prefix_is_not_mapped_onto_a_key_that_is_already_there() -> None:
    assert _prefix_map(["_orig_mod.x", "x"], ["x"]) is None
    assert _prefix_map(["_orig_mod.x", "_orig_mod.y"], ["x", "y"]) == {
        "_orig_mod.x": "x",
        "_orig_mod.y": "y",
    }


def test_a_resharding_restore_checks_keys_but_maps_no_prefix() -> None:
    """Resharding matches other ranks' manifests by the saved keys: prefixes stay as saved,
    and a difference is refused before anything is read."""
    tree, refs = walk_state({"model": compiled_keys(small_model())}, allow_pickle=False)
    manifest = plan_layout(1, tree, refs, LayoutOptions())
    target = {"model": small_model()}
    renamed = align_into(manifest, target)
    assert [t.key for t in renamed.tensors] == [f"model/{k}" for k in small_model().state_dict()]
    with pytest.raises(StateMismatchError) as info:
        align_into(manifest, target, rename=False)
    assert info.value.key == "model" and info.value.missing == list(small_model().state_dict())
    assert align_into(manifest, {"model": compiled_keys(small_model())}, rename=False) is manifest
