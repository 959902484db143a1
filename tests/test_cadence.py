"""A cadence per tier (``Checkpointer(cadence=...)``), emergency copies of the newest
snapshot, and the engine's retention by metric and by age."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import (
    Cadence,
    ConfigurationError,
    KeepBest,
    Retention,
    SyncCheckpointer,
    TierSkippedError,
)
from lazyckpt.testing import FaultyTier
from tests.helpers.ranks import free_port, launch_ranks
from tiers import FileTier, HostMemoryTier, ZarrTier

HELPERS = Path(__file__).resolve().parent / "helpers"


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(128, 64, generator=g), "b": torch.randn(64, generator=g), "step": step}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def chain(root: Path, host: bool = True) -> list[lazyckpt.Tier]:
    tiers: list[lazyckpt.Tier] = [HostMemoryTier(16 << 20)] if host else []
    return [*tiers, FileTier(root / "local", name="local"), ZarrTier(root / "pfs", name="pfs")]


def outcome(handle: lazyckpt.SnapshotHandle, tier: str) -> str:
    try:
        handle.wait(tier)
    except TierSkippedError as exc:
        assert exc.step == handle.step and exc.tier == tier
        return "skipped"
    return "reached"


def pfs_steps(root: Path) -> list[int]:
    with SyncCheckpointer([ZarrTier(root / "pfs", name="pfs", readonly=True)]) as ckpt:
        return ckpt.steps()


def test_a_tier_takes_only_the_steps_its_cadence_picks(tmp_path: Path) -> None:
    with SyncCheckpointer(
        chain(tmp_path), shard_size=1 << 16, cadence={"pfs": 3}, emergency_tiers=()
    ) as ckpt:
        handles = [ckpt.snapshot(state_of(s), step=s) for s in range(1, 8)]
        for h in handles:
            h.wait("committed")
            assert h.state() == "committed" and h.done()
            assert outcome(h, "local") == "reached"
            assert outcome(h, "pfs") == ("reached" if h.step % 3 == 0 else "skipped")
            assert h.stats is not None
            wanted = {"local", "pfs"} if h.step % 3 == 0 else {"local"}
            assert wanted <= set(h.stats.reached_s) and ("pfs" in h.stats.reached_s) == (
                h.step % 3 == 0
            )
        metrics = ckpt.metrics()["tiers"]
        assert metrics["pfs"]["bytes"] * 7 == metrics["local"]["bytes"] * 2
        assert ckpt.steps() == list(range(1, 8))
        report = ckpt.drain()
        assert report.emergency == {} and not report.failed
    assert pfs_steps(tmp_path) == [3, 6]
    with SyncCheckpointer([ZarrTier(tmp_path / "pfs", readonly=True)]) as pfs:
        assert same(pfs.restore(6), state_of(6))


async def test_awaiting_a_skipped_tier_raises_and_reports_nothing_as_failed(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer(
        chain(tmp_path),
        shard_size=1 << 16,
        cadence={"pfs": 10},
        on_failure="raise",
        emergency_tiers=(),
    ) as ckpt:
        h = await ckpt.snapshot(state_of(1), step=1)
        await h.committed()
        with pytest.raises(TierSkippedError, match="cadence"):
            await h.reached("pfs")
        with pytest.raises(lazyckpt.SnapshotSkippedError):  # the family it belongs to
            await h.reached("pfs")
        await h.reached("local")
        report = await ckpt.drain()
        assert not report.failed and report.skipped.get(1, ("pfs",)) == ("pfs",)


def test_the_drain_report_lists_skipped_tiers_apart_from_failures(tmp_path: Path) -> None:
    with SyncCheckpointer(
        chain(tmp_path), shard_size=1 << 16, cadence={"pfs": 2}, emergency_tiers=()
    ) as ckpt:
        for s in (1, 2):
            ckpt.snapshot(state_of(s), step=s)
        report = ckpt.drain()
        assert report.skipped == {1: ("pfs",)}
        assert report.reached[2] == ("host", "local", "pfs")
        assert report.complete and report.durable == {"local": 2, "pfs": 2}


def test_a_step_only_the_host_tier_takes_is_held_whole_and_restored(tmp_path: Path) -> None:
    tiers = [HostMemoryTier(8 << 20), FileTier(tmp_path, name="local")]
    with SyncCheckpointer(
        tiers, shard_size=1 << 16, cadence={"local": 4}, emergency_tiers=()
    ) as ckpt:
        for s in range(1, 7):
            ckpt.snapshot(state_of(s), step=s).wait("committed")
        assert ckpt.steps() == [1, 2, 3, 4, 5, 6]  # the host tier holds them all
        assert same(ckpt.restore(), state_of(6))
        assert same(ckpt.restore(4), state_of(4))
    with SyncCheckpointer([FileTier(tmp_path, readonly=True)]) as disk:
        assert disk.steps() == [4]


def test_incremental_references_point_only_at_steps_the_tier_holds(tmp_path: Path) -> None:
    frozen = torch.randn(256, 256)  # never changes: every later step refers to it

    def state(step: int) -> dict[str, Any]:
        return {"frozen": frozen, **state_of(step)}

    tiers = [FileTier(tmp_path / "local", name="local"), FileTier(tmp_path / "slow", name="slow")]
    tiers[1].level = lazyckpt.TierLevel.PFS
    with SyncCheckpointer(
        tiers, shard_size=1 << 16, cadence={"slow": 3}, incremental=True, emergency_tiers=()
    ) as ckpt:
        for s in range(1, 10):
            ckpt.snapshot(state(s), step=s).wait("committed")
        reused = ckpt.metrics()["tiers"]["slow"]["reused_bytes"]
    assert reused > 0
    with SyncCheckpointer([FileTier(tmp_path / "slow", readonly=True)]) as slow:
        held = slow.steps()
        assert held == [3, 6, 9]
        tier = slow._core.engine.tiers[0]
        for s in held:
            manifest = slow._call(partial(tier.read_manifest, s))
            assert manifest.references() <= set(held)
            assert same(slow.restore(s), state(s))


def test_a_cadence_by_time_takes_the_first_step_then_at_most_one_per_interval(
    tmp_path: Path,
) -> None:
    with SyncCheckpointer(
        chain(tmp_path),
        shard_size=1 << 16,
        cadence={"pfs": Cadence(seconds=0.3)},
        emergency_tiers=(),
    ) as ckpt:
        handles, called = [], {}
        for s in range(1, 9):
            called[s] = time.monotonic()
            handles.append(ckpt.snapshot(state_of(s), step=s))
            time.sleep(0.1)
        took = [h.step for h in handles if outcome(h, "pfs") == "reached"]
    assert took[0] == 1 and len(took) >= 2
    slack = 0.05  # snapshot() reads the clock a little after this test does
    for a, b in itertools.pairwise(took):
        assert called[b] - called[a] >= 0.3 - slack  # at most one per interval
    for s in range(1, 9):  # and a step is skipped only while the interval runs
        if s not in took:
            last = max(t for t in took if t < s)
            assert called[s] - called[last] < 0.3 + slack


def test_every_or_seconds_takes_either(tmp_path: Path) -> None:
    c = Cadence(every=10, seconds=60)
    assert c.due(20, 1.0) and c.due(3, None) and c.due(3, 61.0) and not c.due(3, 1.0)
    assert str(c) == "every 10 steps or every 60 s"
    assert c.describe() == {"every": 10, "seconds": 60.0}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"cadence": {"nope": 3}}, "not in the chain"),
        ({"cadence": {"host": 3}}, "first tier of the chain"),
        ({"cadence": {"pfs": 0}}, r"cadence\['pfs'\]"),
        ({"cadence": {"pfs": -2}}, r"cadence\['pfs'\]"),
        ({"cadence": {"pfs": 2.5}}, r"cadence\['pfs'\]"),
        ({"cadence": {"pfs": "10"}}, r"cadence\['pfs'\]"),
        ({"cadence": [("pfs", 3)]}, "cadence must be a mapping"),
        ({"emergency_tiers": ["nope"]}, "emergency_tiers names"),
        ({"emergency_tiers": ["host"]}, "emergency_tiers names"),
        ({"emergency_tiers": "pfs"}, "emergency_tiers must be"),
    ],
)
def test_bad_cadences_are_refused_naming_the_option(
    tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        SyncCheckpointer(chain(tmp_path), **options)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "needs every"),
        ({"every": 0}, "cadence every"),
        ({"every": True}, "cadence every"),
        ({"seconds": 0}, "cadence seconds"),
        ({"seconds": float("inf")}, "cadence seconds"),
        ({"seconds": float("nan")}, "cadence seconds"),
    ],
)
def test_bad_cadence_values_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Cadence(**kwargs)


def test_the_first_durable_tier_without_a_host_tier_cannot_skip(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="first tier of the chain"):
        SyncCheckpointer(chain(tmp_path, host=False), cadence={"local": 2})


# -- emergency copies ---------------------------------------------------------------------


def test_drain_writes_the_newest_snapshot_to_the_tiers_that_skipped_it(tmp_path: Path) -> None:
    with SyncCheckpointer(chain(tmp_path), shard_size=1 << 16, cadence={"pfs": 100}) as ckpt:
        for s in range(1, 5):
            ckpt.snapshot(state_of(s), step=s)
        report = ckpt.drain()
        assert report.emergency == {4: ("pfs",)}
        assert "emergency copy of step 4" in report.summary()
        assert report.durable["pfs"] == 4
        again = ckpt.drain()  # nothing new: no second copy
        assert again.emergency == {}
        for s in (5, 6):
            ckpt.snapshot(state_of(s), step=s)
    # close wrote the run's last step too
    assert pfs_steps(tmp_path) == [4, 6]
    with SyncCheckpointer([ZarrTier(tmp_path / "pfs", readonly=True)]) as pfs:
        assert same(pfs.restore(6), state_of(6))
        assert same(pfs.restore(4), state_of(4))


def test_no_emergency_tiers_means_no_copy(tmp_path: Path) -> None:
    with SyncCheckpointer(
        chain(tmp_path), shard_size=1 << 16, cadence={"pfs": 100}, emergency_tiers=()
    ) as ckpt:
        ckpt.snapshot(state_of(1), step=1)
        assert ckpt.drain().emergency == {}
    assert pfs_steps(tmp_path) == []


def test_an_emergency_copy_of_an_incremental_step_is_self_contained(tmp_path: Path) -> None:
    frozen = torch.randn(256, 256)
    tiers = [FileTier(tmp_path / "local", name="local"), FileTier(tmp_path / "slow", name="slow")]
    tiers[1].level = lazyckpt.TierLevel.PFS
    with SyncCheckpointer(
        tiers, shard_size=1 << 16, cadence={"slow": 100}, incremental=True
    ) as ckpt:
        for s in range(1, 4):
            ckpt.snapshot({"frozen": frozen, **state_of(s)}, step=s).wait("committed")
        local = ckpt._core.engine.tiers[0]
        assert ckpt._call(lambda: local.read_manifest(3)).references()  # refers to step 1
    with SyncCheckpointer([FileTier(tmp_path / "slow", readonly=True)]) as slow:
        assert slow.steps() == [3]
        tier = slow._core.engine.tiers[0]
        manifest = slow._call(lambda: tier.read_manifest(3))
        assert not manifest.references() and manifest.extra.get("emergency") is True
        assert same(slow.restore(3), {"frozen": frozen, **state_of(3)})


def test_an_emergency_copy_falls_back_to_the_next_tier_when_the_host_lost_it(
    tmp_path: Path,
) -> None:
    host = HostMemoryTier(8 << 20)
    with SyncCheckpointer(
        [host, FileTier(tmp_path / "local", name="local"), ZarrTier(tmp_path / "pfs", name="pfs")],
        shard_size=1 << 16,
        cadence={"pfs": 100},
    ) as ckpt:
        ckpt.snapshot(state_of(1), step=1).wait("committed")
        ckpt._call(lambda: host.delete(1))  # evicted meanwhile
        assert ckpt.drain().emergency == {1: ("pfs",)}
    with SyncCheckpointer([ZarrTier(tmp_path / "pfs", readonly=True)]) as pfs:
        assert same(pfs.restore(1), state_of(1))


def test_a_failed_emergency_copy_is_reported_and_tried_again_at_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    slow = FaultyTier(ZarrTier(tmp_path / "pfs"), name="pfs")
    with SyncCheckpointer(
        [FileTier(tmp_path / "local", name="local"), slow],
        shard_size=1 << 16,
        cadence={"pfs": 100},
        retries=0,
    ) as ckpt:
        ckpt.snapshot(state_of(1), step=1).wait("committed")
        slow.break_("put_shard")
        with caplog.at_level(logging.WARNING, logger="lazyckpt"):
            report = ckpt.drain()
        assert report.emergency == {1: ()}
        assert "emergency copy of step 1 committed on []" in caplog.text
        assert pfs_steps(tmp_path) == []  # nothing half written is listed
        slow.heal()
    assert pfs_steps(tmp_path) == [1]


# -- retention by metric and by age, in the engine -----------------------------------------


def test_retention_keeps_the_best_by_a_metric_passed_with_the_snapshot(tmp_path: Path) -> None:
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 3.0, 6: 6.0}
    keep = Retention(keep_last=1, keep_best=KeepBest("val_loss", 2))
    with SyncCheckpointer([FileTier(tmp_path, retention=keep)]) as ckpt:
        for s, loss in losses.items():
            ckpt.snapshot(state_of(s), step=s, metrics={"val_loss": loss}).wait()
        ckpt.drain()
        deadline = time.monotonic() + 10
        while ckpt.steps() != [2, 4, 6] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.steps() == [2, 4, 6]
    # a new run judges the steps it did not write by their manifests
    with SyncCheckpointer(
        [FileTier(tmp_path, retention=Retention(keep_best=KeepBest("val_loss", 1)))]
    ) as ckpt:
        ckpt.snapshot(state_of(7), step=7, metrics={"val_loss": 9.0}).wait()
        ckpt.drain()
        deadline = time.monotonic() + 10
        while ckpt.steps() != [2, 7] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.steps() == [2, 7]
    listed = subprocess.run(
        [sys.executable, "-m", "lazyckpt", "ls", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "best 1 by val_loss (min): 1" in listed and "newest" in listed


def test_bad_metrics_are_refused_at_snapshot(tmp_path: Path) -> None:
    with SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        for bad in ({"loss": float("nan")}, {"": 1.0}, {"loss": True}, [("loss", 1.0)]):
            with pytest.raises(ConfigurationError):
                ckpt.snapshot(state_of(1), step=1, metrics=bad)  # type: ignore[arg-type]
        assert ckpt.steps() == []


def test_retention_keeps_steps_within_an_age(tmp_path: Path) -> None:
    keep = Retention(keep_within=0.6)
    with SyncCheckpointer([FileTier(tmp_path, retention=keep)]) as ckpt:
        ckpt.snapshot(state_of(1), step=1).wait()
        time.sleep(1.0)
        ckpt.snapshot(state_of(2), step=2).wait()
        ckpt.snapshot(state_of(3), step=3).wait()
        ckpt.drain()
        deadline = time.monotonic() + 10
        while ckpt.steps() != [2, 3] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.steps() == [2, 3]


# -- preemption and several ranks ---------------------------------------------------------


def _child(root: Path, mode: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HELPERS / "drain_child.py"), str(root), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "PYTHONFAULTHANDLER": "1",
            **env,
        },
    )


def _preempt(children: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    try:
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line == "captured\n", line + child.communicate(timeout=60)[1]
        for child in children:
            child.send_signal(signal.SIGTERM)
        ends = []
        for child in children:
            try:
                out, err = child.communicate(timeout=90)
            except subprocess.TimeoutExpired:  # faulthandler prints where its threads were
                child.send_signal(signal.SIGABRT)
                out, err = child.communicate(timeout=30)
                raise AssertionError(f"a child did not end within 90 s:\n{err[-6000:]}") from None
            ends.append((child.returncode, out, err))
        return ends
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()


@pytest.mark.slow
def test_sigterm_after_a_capture_the_pfs_skips_leaves_it_on_the_pfs(tmp_path: Path) -> None:
    [(code, out, err)] = _preempt([_child(tmp_path, "cadence")])
    assert code == -signal.SIGTERM, err[-3000:]
    assert "not preempted" not in out
    assert "emergency copy of step 2" in err
    assert pfs_steps(tmp_path) == [2]
    with SyncCheckpointer([ZarrTier(tmp_path / "pfs", readonly=True)]) as pfs:
        from tests.helpers.drain_child import state_of as child_state

        assert same(pfs.restore(2), child_state(2))


@pytest.mark.slow
def test_sigterm_on_two_ranks_commits_the_emergency_copy_on_both(tmp_path: Path) -> None:
    world = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    world["MASTER_PORT"] = str(free_port())
    ends = _preempt([_child(tmp_path, "cadence", RANK=str(r), **world) for r in range(2)])
    said = [(rank, code, out, err[-3000:]) for rank, (code, out, err) in enumerate(ends)]
    for code, _out, err in ends:
        assert code == -signal.SIGTERM, said
        assert "emergency copy of step 2 committed on ['pfs']" in err, said
    world["MASTER_PORT"] = str(free_port())
    restores = [_child(tmp_path, "restore-pfs", RANK=str(r), **world) for r in range(2)]
    for rank, child in enumerate(restores):
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, (rank, err[-3000:])
        assert out == "restored step 2 True\n", (rank, out, err[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["every", "timed"])
def test_two_ranks_take_the_same_steps_and_copy_the_newest(tmp_path: Path, mode: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launch_ranks(HELPERS / "cadence_worker.py", [str(tmp_path), str(out), mode], 2, timeout=240)
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    assert results[0]["steps"] == results[1]["steps"]  # the same choice on every rank
    taken = [int(s) for s, got in results[0]["steps"].items() if got["pfs"] == "reached"]
    assert all(got["local"] == "reached" for got in results[0]["steps"].values())
    if mode == "every":
        assert taken == [5, 10]
    else:
        assert taken[0] == 1 and len(taken) < 12
    copied = {} if 12 in taken else {"12": ["pfs"]}  # step 12 may be due by time
    assert results[0]["emergency"] == results[1]["emergency"] == copied
    for r in results:
        assert r["pfs_steps"] == sorted({*taken, 12}) and r["restored_ok"]


class _SlowFirstStep(FileTier):
    """A FileTier whose writes of step 1 take 0.5 s more: step 2 commits first."""

    async def put_shard(self, manifest: Any, shard: Any, data: memoryview) -> None:
        if manifest.step == 1:
            await asyncio.sleep(0.5)
        await super().put_shard(manifest, shard, data)


def test_a_step_retention_kept_back_while_in_flight_goes_when_it_is_done(tmp_path: Path) -> None:
    # step 2 commits first; step 1's own commit then asks for a pass, which must keep it
    # (still in flight) and ask again once it is done: no later commit would
    tier = _SlowFirstStep(tmp_path, retention=Retention(keep_last=1))
    with SyncCheckpointer([tier], shard_size=1 << 16) as ckpt:
        first = ckpt.snapshot(state_of(1), step=1)
        ckpt.snapshot(state_of(2), step=2).wait()
        first.wait()
        deadline = time.monotonic() + 10
        while ckpt.steps() != [2] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.steps() == [2]
