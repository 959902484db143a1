"""Tensors that change outside the optimizer step (BatchNorm statistics updated by every
forward pass) are copied at snapshot(): a guarded BatchNorm net snapshots every step
without a failure and resumes bit for bit. Which tensors are eager is the EagerPolicy's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import ConfigurationError, ImmutabilityViolationError, SnapshotFailedError
from lazyckpt._capture.cpu import EagerPolicy, optimizer_pointers
from lazyckpt._format.walk import walk_state
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.bn_net import Trainer
from helpers.gating import hold_captures

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}
STEPS = 20


def chain(tmp_path: Path) -> list[lazyckpt.Tier]:
    return [HostMemoryTier(32 << 20), FileTier(tmp_path / "file")]


@pytest.mark.slow
async def test_a_guarded_batchnorm_net_snapshots_every_step_and_resumes_bit_identical(
    tmp_path: Path,
) -> None:
    reference = Trainer(STEPS)
    expected = [reference.step(s) for s in range(STEPS)]

    run = Trainer(STEPS)
    handles = []
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        ckpt.guard(run.opt)
        losses = []
        for step in range(STEPS):
            losses.append(run.step(step))
            # the next forward pass updates the BatchNorm buffers while this capture runs
            handles.append(await ckpt.snapshot(run.state(step), step=step))
        for h in handles:
            await h.committed()
        assert ckpt.metrics()["snapshots_failed"] == 0
        assert await ckpt.steps() == list(range(STEPS))
    assert losses == expected

    middle = STEPS // 2 - 1
    resumed = Trainer(STEPS, seed=123)  # different weights: all must come from the snapshot
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        await fresh.restore(step=middle, into=resumed.state(0))
    assert resumed.model.stem.bn.num_batches_tracked is not None
    assert int(resumed.model.stem.bn.num_batches_tracked) == middle + 1
    after = [resumed.step(s) for s in range(middle + 1, STEPS)]
    assert after == expected[middle + 1 :]


async def test_without_eager_copies_a_forward_pass_tears_the_buffers(tmp_path: Path) -> None:
    """What the eager copy prevents: a BatchNorm buffer left lazy and changed by a forward
    pass before its capture fails the snapshot (with advice naming the eager option)."""
    run = Trainer(4)
    async with lazyckpt.Checkpointer(chain(tmp_path), lazy=("model/*",), **SMALL) as ckpt:
        ckpt.guard(run.opt)
        gate, release = hold_captures(ckpt)
        handle = await ckpt.snapshot(run.state(0), step=0)
        run.model(torch.randn(2, 3, 16, 16))  # forward: running stats change
        gate.set()
        release()
        with pytest.raises(SnapshotFailedError) as info:
            await handle.captured()
        assert info.group_contains(ImmutabilityViolationError, match=r"bn\.(running|num_b).*eager")


class WithEMA(torch.nn.Module):
    """A model whose large buffer (an exponential moving average of the input, 2 MiB) is
    updated in every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.ema = torch.nn.Buffer(torch.zeros(512, 1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.9).add_(x.mean())
        out: torch.Tensor = self.lin(x)
        return out


@pytest.mark.parametrize("eager", [(), ("model/ema",)])
async def test_an_eager_key_pattern_copies_a_large_buffer_at_snapshot(
    tmp_path: Path, eager: tuple[str, ...]
) -> None:
    model = WithEMA()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    async with lazyckpt.Checkpointer(chain(tmp_path), eager=eager, **SMALL) as ckpt:
        ckpt.guard(opt)
        model(torch.ones(2, 4))
        before = model.ema.clone()
        gate, release = hold_captures(ckpt)
        handle = await ckpt.snapshot({"model": model}, step=1)
        model(torch.ones(2, 4))  # changes the 2 MiB buffer before its capture
        gate.set()
        release()
        if not eager:  # larger than eager_bytes and not named: lazy, so the change is caught
            with pytest.raises(SnapshotFailedError):
                await handle.committed()
            return
        await handle.committed()
        restored = await ckpt.restore(step=1)
    assert torch.equal(restored["model"]["ema"], before)


class WithFrozen(WithEMA):
    """WithEMA with a large frozen weight that no optimizer owns and nothing changes."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Parameter(torch.randn(512, 1024), requires_grad=False)


@pytest.mark.parametrize("lazy", [(), ("model/ema",)])
async def test_a_large_buffer_seen_changing_is_copied_at_snapshot_from_then_on(
    tmp_path: Path, lazy: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """Under a guard, a tensor no guarded optimizer owns that changed between a snapshot
    and the next optimizer step (here a 2 MiB buffer updated in every forward pass, not
    named in ``eager=``) is copied at ``snapshot()`` from then on: the forward pass racing
    its capture no longer fails the snapshot or tears it, and a warning names it once. A
    frozen weight stays lazy, and a key matching ``lazy=`` is left as the user asked."""
    model = WithFrozen()
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    caplog.set_level("WARNING", logger="lazyckpt")
    async with lazyckpt.Checkpointer(chain(tmp_path), lazy=lazy, **SMALL) as ckpt:
        ckpt.guard(opt)
        model(torch.ones(2, 4))
        first = await ckpt.snapshot({"model": model}, step=1)
        await first.captured()  # nothing races the first capture: nothing is known yet
        for step in (2, 3, 4):
            model(torch.ones(2, 4)).sum().backward()  # the buffer changes in forward
            opt.step()  # the guard's wait sees it
            opt.zero_grad()
            before = model.ema.clone()
            gate, release = hold_captures(ckpt)
            handle = await ckpt.snapshot({"model": model}, step=step)
            model(torch.ones(2, 4))  # and again before this snapshot's capture
            gate.set()
            release()
            if lazy:  # left lazy on purpose: the version check fails it, as before
                with pytest.raises(SnapshotFailedError):
                    await handle.committed()
                continue
            await handle.committed()
            restored = await ckpt.restore(step=step)
            assert torch.equal(restored["model"]["ema"], before)
            assert torch.equal(restored["model"]["frozen"], model.frozen)
    warned = [r.getMessage() for r in caplog.records if "optimizer step although" in r.message]
    if lazy:
        assert warned == []
    else:
        assert len(warned) == 1 and "'model/ema'" in warned[0] and "eager=" in warned[0]
    assert not any("frozen" in m for m in warned)


async def test_a_restore_before_the_step_marks_nothing_as_changing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restore with ``into=`` between a ``snapshot()`` and the optimizer step writes the
    frozen weight in place: that is no write racing the capture, and it must not make the
    weight be copied at every later snapshot."""
    model = WithFrozen()
    opt = torch.optim.SGD(model.lin.parameters(), lr=0.1)
    caplog.set_level("WARNING", logger="lazyckpt")
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        ckpt.guard(opt)
        await (await ckpt.snapshot({"model": model}, step=1)).committed()
        await ckpt.restore(step=1, into={"model": model})
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        assert ckpt._core._changes_seen == set()  # the restore ended that watch
        await (await ckpt.snapshot({"model": model}, step=2)).committed()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        assert ckpt._core._changes_seen == {"model/ema"}  # watched again; changed in forward
    assert not any("'model/frozen'" in r.getMessage() for r in caplog.records)


def refs_of(state: dict[str, Any]) -> list[Any]:
    return walk_state(state, allow_pickle=False)[1]


def test_the_policy_chooses_by_ownership_size_and_key() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    big = torch.zeros(1 << 18)  # 1 MiB: not above the default limit
    bigger = torch.zeros((1 << 18) + 1)
    state = {"model": model, "optim": opt, "big": big, "bigger": bigger, "tied": big}
    refs = refs_of(state)
    keys = [r.key for r in refs]
    owned = optimizer_pointers([opt])

    def chosen(policy: EagerPolicy, owned: set[int]) -> set[str]:
        return {keys[i] for i in policy.choose(refs, owned)}

    buffers = {"model/1.running_mean", "model/1.running_var", "model/1.num_batches_tracked"}
    assert chosen(EagerPolicy(), owned) == buffers | {"big", "tied"}
    # without a guard nothing is known to change only in the optimizer step
    everything_small = set(keys) - {"bigger"}
    assert chosen(EagerPolicy(), set()) == everything_small
    assert chosen(EagerPolicy(eager=("bigger", "model/0.*")), owned) == (
        buffers | {"big", "tied", "bigger", "model/0.weight", "model/0.bias"}
    )
    assert chosen(EagerPolicy(lazy=("model/*", "big")), owned) == set()
    assert chosen(EagerPolicy(eager_bytes=0), owned) == set()


def test_bad_policy_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="eager must be a list"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], eager="model/ema")
    with pytest.raises(ConfigurationError, match="eager_bytes"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], eager_bytes=-1)


async def test_eager_copies_keep_aliases_and_restore_exactly(tmp_path: Path) -> None:
    emb = torch.randn(10, 4)
    state = {"a": emb, "b": emb, "view": emb.t()}
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        before = emb.clone()
        handle = await ckpt.snapshot(state, step=0)
        emb.add_(1)  # after snapshot(): the eager copies hold the values before
        await handle.committed()
        restored = await ckpt.restore(step=0)
    assert restored["a"] is restored["b"]
    assert torch.equal(restored["a"], before)
    assert torch.equal(restored["view"], before.t())


async def test_a_snapshot_taken_in_inference_mode(tmp_path: Path) -> None:
    model = torch.nn.BatchNorm1d(4)
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        with torch.inference_mode():
            handle = await ckpt.snapshot({"model": model, "t": torch.ones(3)}, step=0)
        await handle.committed()
        restored = await ckpt.restore(step=0)
    assert torch.equal(restored["t"], torch.ones(3))
    assert torch.equal(restored["model"]["running_var"], torch.ones(4))


def test_lbfgs_history_counts_as_owned() -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.LBFGS(model.parameters(), history_size=3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss: torch.Tensor = model(torch.randn(2, 4)).square().sum()
        torch.autograd.backward(loss)
        return loss

    for _ in range(2):
        opt.step(closure)  # type: ignore[no-untyped-call]
    history = opt.state[model.weight]["old_dirs"]
    assert history and all(t.data_ptr() in optimizer_pointers([opt]) for t in history)


async def test_the_owned_set_follows_the_optimizer_through_a_restore(tmp_path: Path) -> None:
    run = Trainer(4)
    async with lazyckpt.Checkpointer(chain(tmp_path), **SMALL) as ckpt:
        ckpt.guard(run.opt)
        before = ckpt._core.owned_pointers()
        assert len(before) == len(list(run.model.parameters()))  # no state yet
        run.step(0)  # SGD creates its momentum buffers
        grown = ckpt._core.owned_pointers()
        assert len(grown) == 2 * len(before)
        await (await ckpt.snapshot(run.state(0), step=0)).committed()
        await ckpt.restore(step=0, into=run.state(0))  # load_state_dict: new state tensors
        momentum = {int(s["momentum_buffer"].data_ptr()) for s in run.opt.state.values()}
        assert momentum <= ckpt._core.owned_pointers()
