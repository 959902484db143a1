"""Several ranks on loopback (gloo): coordinated commits, a rank killed mid-checkpoint,
restore agreement. Each rank is a real process."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "dist_worker.py"
sys.path.insert(0, str(Path(__file__).parent))
from ranks import launch_ranks, rank_results  # noqa: E402


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
        assert r["steps"] == [0, 1, 2, 3]  # step 2 only in every rank's host memory tier
        assert r["restored_step"] == 3 and r["restored_ok"]
    assert (root / "step-000000000003" / "manifest.json").exists()
    assert not (root / "step-000000000002" / "manifest.json").exists()
