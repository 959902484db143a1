"""A torch.compile'd model's ``_orig_mod.`` keys: restore(into=...) across compiled and plain
models, and ``lazyckpt export --strip-prefix``.

The models are really compiled, with the ``eager`` backend: dynamo wraps the module in an
``OptimizedModule`` exactly as with the default backend (the keys are the same), in a few
seconds rather than the half minute inductor's code generation takes on a small CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

import lazyckpt
from lazyckpt.cli import EXIT_OK, EXIT_USAGE, main
from tiers import FileTier


def net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


def train_one_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def snapshot_sync(root: Path, state: dict[str, Any]) -> None:
    with lazyckpt.SyncCheckpointer([FileTier(root)]) as ckpt:
        ckpt.snapshot(state, step=1).wait()


async def snapshot(root: Path, state: dict[str, Any]) -> None:
    async with lazyckpt.Checkpointer([FileTier(root)]) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()


async def restore_into(root: Path, target: dict[str, Any]) -> None:
    async with lazyckpt.Checkpointer([FileTier(root)]) as ckpt:
        await ckpt.restore(into=target)


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = list(a.parameters()), list(b.parameters())
    return len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


@pytest.mark.slow
async def test_a_compiled_models_snapshot_restores_into_the_plain_model_and_back(
    tmp_path: Path,
) -> None:
    trained = compiled(net())
    assert next(iter(trained.state_dict())).startswith("_orig_mod.")
    opt = torch.optim.AdamW(trained.parameters())
    train_one_step(trained, opt, torch.randn(4, 6))
    await snapshot(tmp_path / "compiled", {"model": trained, "optim": opt})

    plain = net()
    plain_opt = torch.optim.AdamW(plain.parameters())
    await restore_into(tmp_path / "compiled", {"model": plain, "optim": plain_opt})
    assert same_parameters(plain, trained)
    # the two continue identically: the optimizer state came along
    x = torch.randn(4, 6)
    train_one_step(plain, plain_opt, x)
    train_one_step(trained, opt, x)
    assert same_parameters(plain, trained)
    assert torch.equal(plain(x), trained(x))

    # and the other way: a plain model's snapshot into a compiled one
    await snapshot(tmp_path / "plain", {"model": plain})
    other = compiled(net())
    await restore_into(tmp_path / "plain", {"model": other})
    assert same_parameters(other, plain)


async def test_restore_without_into_and_strip_prefix(tmp_path: Path) -> None:
    trained = compiled(net())
    await snapshot(tmp_path, {"model": trained})
    async with lazyckpt.Checkpointer([FileTier(tmp_path)]) as ckpt:
        state = await ckpt.restore()
    plain = net()
    with pytest.raises(RuntimeError, match="_orig_mod"):
        plain.load_state_dict(state["model"])  # torch's own error, as documented
    plain.load_state_dict(lazyckpt.strip_prefix(state["model"], "_orig_mod."))
    assert same_parameters(plain, trained)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_strip_prefix_gives_the_plain_models_keys(
    tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trained = compiled(net())
    snapshot_sync(tmp_path / "ckpt", {"model": trained, "step": 1})
    out = tmp_path / f"model{suffix}"
    argv = ["export", str(tmp_path / "ckpt"), "--select", "model", "--to", str(out), "-q"]
    assert main([*argv, "--strip-prefix", "_orig_mod."]) == EXIT_OK
    loaded = (
        safetensors.torch.load_file(out)
        if suffix == ".safetensors"
        else torch.load(out, weights_only=True)
    )
    plain = net()
    plain.load_state_dict(loaded)  # strict: exactly the plain model's keys
    assert same_parameters(plain, trained)

    # without --select, every component of the key path is stripped
    whole = tmp_path / f"whole{suffix}"
    argv = ["export", str(tmp_path / "ckpt"), "--to", str(whole), "-q"]
    assert main([*argv, "--strip-prefix", "_orig_mod."]) == EXIT_OK
    loaded = (
        safetensors.torch.load_file(whole)
        if suffix == ".safetensors"
        else torch.load(whole, weights_only=True)["model"]
    )
    assert set(loaded) == (
        {f"model/{k}" for k in net().state_dict()}
        if suffix == ".safetensors"
        else set(net().state_dict())
    )


def test_export_strip_prefix_refuses_to_merge_two_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = torch.zeros(2)
    snapshot_sync(tmp_path / "ckpt", {"m": {"module.w": w, "w": w.clone()}})
    for suffix in (".safetensors", ".pt"):
        out = tmp_path / f"x{suffix}"
        argv = ["export", str(tmp_path / "ckpt"), "--to", str(out), "--strip-prefix", "module."]
        assert main(argv) == EXIT_USAGE
        assert "the same" in capsys.readouterr().err
        assert not out.exists()
