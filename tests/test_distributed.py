"""Several ranks on loopback (gloo): coordinated commits, a rank killed mid-checkpoint,
restore agreement. Each rank is a real process."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "helpers" / "dist_worker.py"
sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import launch_ranks, rank_results  # noqa: E402


def launch(scenario: str, root: Path, out: Path, world: int) -> list[int]:
    out.mkdir(parents=True, exist_ok=True)
    return launch_ranks(WORKER, [scenario, str(root), str(out)], world, may_be_killed=True)


@pytest.mark.parametrize("world", [2, 4])
def test_coordinated_commit_and_restore_agreement(tmp_path: Path, world: int) -> None:
    root = tmp_path / "ckpt"
    assert launch("commit", root, tmp_path / "out", world) == [0] * world
    res = rank_results(tmp_path / "out")
    assert sorted(res) == list(range(world))
    for r in res.values():
        assert r["errors"] == []
        assert r["steps"] == [0, 1, 2, 3]
        assert r["restored_step"] == 3 and r["restored_ok"]
    step_dir = root / "step-000000000003"
    names = sorted(p.name for p in step_dir.iterdir())
    expected = [f"rank-{r:05d}.data" for r in range(world)] + [f"rank-{r:05d}.json" for r in range(world)]
    assert names == sorted(["manifest.json", *expected])
    record = json.loads((step_dir / "manifest.json").read_text())
    assert record == {"format": "lazyckpt-commit", "step": 3, "world_size": world}


def test_a_killed_rank_never_commits_and_others_get_a_typed_error(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    codes = launch("kill", root, tmp_path / "out", 2)
    assert codes == [0, -signal.SIGKILL]
    survivor = rank_results(tmp_path / "out")[0]
    (error,) = survivor["errors"]
    assert error["step"] == 2
    assert "DeadlineExceededError" in error["types"]
    assert error["seconds"] < 60
    assert (root / "step-000000000001" / "manifest.json").exists()
    assert not (root / "step-000000000002" / "manifest.json").exists()
    # a restarted job (both ranks) agrees on step 1 and restores it bit for bit
    launch("restore", root, tmp_path / "again", 2)
    for r in rank_results(tmp_path / "again").values():
        assert r["steps"] == [0, 1]
        assert r["restored_step"] == 1 and r["restored_ok"]


def test_a_rank_that_fails_its_part_is_named_and_later_steps_commit(tmp_path: Path) -> None:
    # one rank's commit of step 2 fails (an I/O error, not a death): the agreement sees it,
    # nobody commits step 2, the others are told which rank failed, and the channel stays
    # usable: step 3 commits on every rank
    root = tmp_path / "ckpt"
    assert launch("fail", root, tmp_path / "out", 2) == [0, 0]
    res = rank_results(tmp_path / "out")
    (error,) = res[0]["errors"]
    assert error["step"] == 2 and error["types"] == ["TierBrokenError"]
    assert "rank(s) [1] failed" in error["messages"][0]
    assert [e["step"] for e in res[1]["errors"]] == [2]
    for r in res.values():
        assert r["steps"] == [0, 1, 3]  # the failed step 2 is not listed, not even in memory
        assert r["restored_step"] == 3 and r["restored_ok"]
    assert (root / "step-000000000003" / "manifest.json").exists()
    assert not (root / "step-000000000002" / "manifest.json").exists()


class _Peers:
    """A stand-in for the coordinator of rank 0 of two: every collective agrees at once,
    except that the confirming agreement for ``lost_step`` never returns (a peer hung or
    the network broke right after this rank wrote its commit record)."""

    lost_step = 2

    def __init__(self, rank: int, world_size: int, stages: int, timeout: float) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.calls: dict[int, int] = {}
        self.collectives = 0

    async def gather(self, channel: int, value: object) -> list[object]:
        return [value] * self.world_size

    async def agree(self, channel: int, step: int, ok: bool) -> list[bool]:
        from lazyckpt import DeadlineExceededError

        self.calls[step] = self.calls.get(step, 0) + 1
        if step == self.lost_step and self.calls[step] == 2:
            raise DeadlineExceededError("rank 1 did not answer")
        return [ok] * self.world_size

    async def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


async def test_a_commit_record_not_every_rank_confirmed_is_taken_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import lazyckpt
    from lazyckpt._engine import scheduler as _engine
    from tiers import FileTier, HostMemoryTier

    monkeypatch.setattr(_engine, "distributed_context", lambda requested: (0, 2))
    monkeypatch.setattr(_engine, "Coordinator", _Peers)
    tier = FileTier(tmp_path / "f")
    options = {"shard_size": 1 << 14, "retries": 0}
    async with lazyckpt.Checkpointer([HostMemoryTier(4 << 20), tier], **options) as ckpt:
        for step in (1, 2, 3):
            handle = await ckpt.snapshot({"w": torch.full((8,), float(step))}, step=step)
            if step == _Peers.lost_step:
                with pytest.raises(lazyckpt.SnapshotFailedError):
                    await handle.reached("file")
            else:
                await handle.reached("file")
        # this rank wrote step 2's record before the confirmation was lost: it is taken back
        assert await tier.steps() == [1, 3]
        assert not (tmp_path / "f" / "step-000000000002").exists()
