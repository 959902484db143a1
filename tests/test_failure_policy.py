"""A failed snapshot never costs a training step: the guard waits and never raises into
``optimizer.step()``; failures go to the handle, the log, metrics and ``on_failure``."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from pathlib import Path

import pytest
import torch

import lazyckpt
from lazyckpt import ImmutabilityViolationError, Manifest, SnapshotFailedError
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.bn_net import Trainer
from helpers.gating import hold_captures

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096, "retries": 0}
STEPS = 10


class EveryOtherCommitFails(FaultyTier):
    """A tier whose commit fails on every other call (the 1st, 3rd, ...)."""

    async def commit(self, manifest: Manifest) -> None:
        if self.calls["commit"] % 2 == 0:
            self.fail_next("commit")
        await super().commit(manifest)


def failures_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name == "lazyckpt" and r.levelno >= logging.WARNING and "SNAPSHOT FAILED" in r.getMessage()
    ]


async def test_a_tier_failing_every_other_commit_costs_no_optimizer_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = Trainer(STEPS)
    flaky = EveryOtherCommitFails(FileTier(tmp_path / "file"))
    handles = []
    async with lazyckpt.Checkpointer([HostMemoryTier(32 << 20), flaky], **SMALL) as ckpt:
        ckpt.guard(run.opt)
        for step in range(STEPS):
            run.step(step)  # nothing here may raise
            handles.append(await ckpt.snapshot(run.state(step), step=step))
            await handles[-1].reached("host")  # commits in step order: every other one fails
        failed = []
        for h in handles:
            try:
                await h.committed()
            except SnapshotFailedError as exc:
                assert exc.step == h.step and exc.tiers == ("file",)
                failed.append(h.step)
        assert ckpt.metrics()["snapshots_failed"] == len(failed) == STEPS // 2
        listed = await flaky.steps()
        # nor through the host tier, whose copy of a failed snapshot is dropped
        assert await ckpt.steps() == listed
    # every optimizer, scaler and scheduler update happened
    assert run.optimizer_steps == STEPS
    assert run.sched.last_epoch == STEPS
    assert run.scaler._get_growth_tracker() == STEPS
    # a failed snapshot is never listed; one warning per failed snapshot, naming its step
    assert listed == [s for s in range(STEPS) if s not in failed]
    logged = failures_logged(caplog)
    assert sorted(int(re.search(r"step (\d+) ", m).group(1)) for m in logged) == failed  # type: ignore[union-attr]
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "file")]) as fresh:
        assert await fresh.steps() == listed


async def test_a_failed_capture_does_not_stop_the_next_optimizer_step(tmp_path: Path) -> None:
    run = Trainer(STEPS)
    frozen = torch.zeros(1 << 19)  # 2 MiB, lazy, and (wrongly) changed before its capture
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(32 << 20), FileTier(tmp_path / "file")], **SMALL
    ) as ckpt:
        ckpt.guard(run.opt)
        run.step(0)
        gate, release = hold_captures(ckpt)
        handle = await ckpt.snapshot({**run.state(0), "frozen": frozen}, step=0)
        frozen.add_(1)
        gate.set()
        release()
        run.step(1)  # the guard waits for the failed capture and lets the step run
        assert run.optimizer_steps == 2
        with pytest.raises(SnapshotFailedError) as info:
            await handle.captured()
        assert info.group_contains(ImmutabilityViolationError, match="'frozen'")
        # "warn": nothing else raises it, and training and snapshots go on
        await ckpt.wait_captured()
        await (await ckpt.snapshot(run.state(1), step=1)).committed()
        assert await ckpt.steps() == [1]


async def test_on_failure_raise_raises_from_the_next_snapshot_never_from_the_step(
    tmp_path: Path,
) -> None:
    run = Trainer(STEPS)
    broken = FaultyTier(FileTier(tmp_path / "file"))
    broken.break_("put_shard")
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(32 << 20), broken], on_failure="raise", **SMALL
    ) as ckpt:
        ckpt.guard(run.opt)
        raised = []
        for step in range(STEPS):
            run.step(step)  # the optimizer hook never raises, whatever the policy
            try:
                handle = await ckpt.snapshot(run.state(step), step=step)
            except SnapshotFailedError as exc:
                raised.append(exc.step)
                handle = await ckpt.snapshot(run.state(step), step=step)
            with pytest.raises(SnapshotFailedError):
                await handle.committed()  # seen here: not raised again by the next snapshot()
        assert raised == []
        assert ckpt.metrics()["snapshots_failed"] == STEPS
        # an unseen failure is raised by the next snapshot(), once
        await ckpt.snapshot(run.state(STEPS), step=STEPS)
        engine = ckpt._core.engine
        await asyncio.wrap_future(engine.loop.submit(engine.drain()))
        with pytest.raises(SnapshotFailedError, match=f"step {STEPS}"):
            await ckpt.snapshot(run.state(STEPS + 1), step=STEPS + 1)
        broken.heal()
        await (await ckpt.snapshot(run.state(STEPS + 1), step=STEPS + 1)).committed()
    assert run.optimizer_steps == STEPS


async def test_drain_lists_every_unseen_failure_and_hands_it_over(tmp_path: Path) -> None:
    """``drain()``'s report lists the failures of snapshots that ended before it as well as
    of those it waited for; with ``on_failure="raise"`` the next ``snapshot()`` does not
    raise them again, since the report delivered them."""
    broken = FaultyTier(FileTier(tmp_path / "file"), name="file")
    broken.break_("commit")
    state = {"w": torch.randn(100, 100)}
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(8 << 20), broken], on_failure="raise", **SMALL
    ) as ckpt:
        engine = ckpt._core.engine
        await ckpt.snapshot(state, step=1)
        await asyncio.wrap_future(engine.loop.submit(engine.drain()))  # step 1 ended, unseen
        report = await ckpt.drain()
        assert report.failed == {1: ("file",)}
        await ckpt.snapshot(state, step=2)  # step 1's failure was handed over: no raise
        await ckpt.snapshot(state, step=3)
        report = await ckpt.drain()
        assert report.failed == {2: ("file",), 3: ("file",)}
        broken.heal()
        await (await ckpt.snapshot(state, step=4)).committed()
        assert await ckpt.steps() == [4]


async def test_drain_leaves_a_failure_of_no_step_to_the_policy(tmp_path: Path) -> None:
    """A retention pass's failure belongs to no snapshot: ``drain()`` does not list it, so it
    stays for the failure policy (the next ``snapshot()`` raises it with "raise")."""
    from lazyckpt import hooks

    def refuse(name: str) -> None:
        if name == "retention.before_delete":
            raise OSError("disk says no")

    state = {"w": torch.randn(64, 64)}
    hooks.set_hook(refuse)
    try:
        async with lazyckpt.Checkpointer(
            [HostMemoryTier(8 << 20), FileTier(tmp_path / "file", keep_last=1)],
            on_failure="raise", **SMALL,
        ) as ckpt:
            await (await ckpt.snapshot(state, step=1)).committed()
            await (await ckpt.snapshot(state, step=2)).committed()
            for _ in range(200):  # the retention pass after step 2 runs and fails
                if ckpt._core.engine._unreported:
                    break
                await asyncio.sleep(0.01)
            report = await ckpt.drain()
            assert report.failed == {}
            with pytest.raises(lazyckpt.TierError, match="disk says no"):
                await ckpt.snapshot(state, step=3)
    finally:
        hooks.set_hook(None)


def test_on_failure_is_validated(tmp_path: Path) -> None:
    with pytest.raises(lazyckpt.ConfigurationError, match="on_failure"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], on_failure="ignore")


async def test_warn_leaves_close_quiet_and_raise_raises_there(tmp_path: Path) -> None:
    for policy in ("warn", "raise"):
        broken = FaultyTier(FileTier(tmp_path / policy))
        broken.break_("commit")
        try:
            async with lazyckpt.Checkpointer(
                [HostMemoryTier(8 << 20), broken], on_failure=policy, **SMALL
            ) as ckpt:
                await ckpt.snapshot({"w": torch.randn(100, 100)}, step=0)
        except SnapshotFailedError:
            assert policy == "raise"
        else:
            assert policy == "warn"


@pytest.mark.slow
def test_the_batchnorm_flaky_storage_example() -> None:
    import subprocess

    example = Path(__file__).resolve().parent.parent / "examples" / "batchnorm_flaky_storage.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "optimizer steps: 12 of 12" in done.stdout
    assert "losses identical bit for bit: True" in done.stdout
    assert done.stderr.count("SNAPSHOT FAILED") == 4


async def test_one_failed_snapshot_logs_one_warning_whatever_its_shard_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every shard of a snapshot fails on a broken tier: one warning for the snapshot (its
    first failure, and how many more there were), not one per shard."""
    broken = FaultyTier(FileTier(tmp_path / "file"))
    broken.break_("put_shard")
    broken.delay_s = 0.2  # the shards reach the tier together, and each fails there
    state = {f"w{i}": torch.randn(1 << 15) for i in range(8)}  # 8 chunk shards of 128 KiB
    caplog.set_level(logging.INFO, logger="lazyckpt")
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(32 << 20), broken], staging_bytes=16 << 20, **SMALL
    ) as ckpt:
        handle = await ckpt.snapshot(state, step=1)
        with pytest.raises(SnapshotFailedError) as caught:
            await handle.committed()
    failures = len(caught.value.exceptions)
    assert failures > 1  # several shards failed, each on its own
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name == "lazyckpt" and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    assert "SNAPSHOT FAILED: step 1 " in warning and "injected permanent failure" in warning
    assert f"and {failures - 1} more" in warning
