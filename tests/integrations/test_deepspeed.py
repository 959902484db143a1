"""LazyCheckpointEngine: driven by hand (fast), and inside DeepSpeed's own engine on CPU
(ZeRO-1, gloo, world size 1) in worker processes (slow: DeepSpeed's start-up)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'lazyckpt[deepspeed]'")

from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

from lazyckpt import ConfigurationError, CorruptionError, SnapshotNotFoundError
from lazyckpt.integrations.deepspeed import POINTER_FORMAT, LazyCheckpointEngine
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


_OPEN: list[LazyCheckpointEngine] = []


@pytest.fixture(autouse=True)
def _clean_up_engines() -> Iterator[None]:
    yield
    while _OPEN:  # a failed test still drains and closes its engines
        _OPEN.pop().cleanup()


def engine_on(root: Path, *tiers: Any, **options: Any) -> LazyCheckpointEngine:
    chain = tiers or (FileTier(root / "tiers"),)
    eng = LazyCheckpointEngine([HostMemoryTier(4 << 20), *chain], **options)
    _OPEN.append(eng)
    return eng


def save_tag(
    engine: LazyCheckpointEngine, save_dir: Path, tag: str, files: dict[str, Any]
) -> CheckpointCommitInfo:
    """What DeepSpeed's save_checkpoint does with an engine, minus the model."""
    info = CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=True)
    engine.makedirs(str(save_dir / tag), exist_ok=True)
    engine.create(info)
    for name, state in files.items():
        engine.save(state, str(save_dir / tag / name))
    return info


def test_save_commit_load_by_hand(tmp_path: Path) -> None:
    eng = engine_on(tmp_path)
    w = torch.randn(16, 4)
    model = {"module": {"w": w}, "global_steps": 3, "shapes": torch.Size([16, 4])}
    exp_avg = torch.randn(64)
    optim = {"optimizer_state_dict": {"exp_avg": exp_avg, "step": 3}}
    info = save_tag(eng, tmp_path / "ds", "global_step3", {"model.pt": model, "optim.pt": optim})
    assert eng.get_commit_info() == info  # decoupled: DeepSpeed commits at its next step
    assert eng.commit(info) is True
    # latest written by the engine, atomically; DeepSpeed is told not to write it again
    assert info.save_latest is False
    assert (tmp_path / "ds" / "latest").read_text() == "global_step3"
    assert eng.get_commit_info() is None
    assert eng.checkpointer.steps() == [0]  # one lazyckpt step for the two files of the tag
    pointer = json.loads((tmp_path / "ds" / "global_step3" / "model.pt").read_text())
    assert pointer == {
        "format": POINTER_FORMAT, "version": 1, "step": 0, "tag": "global_step3",
        "key": "global_step3/model.pt", "rank": 0,
    }
    got = eng.load(str(tmp_path / "ds" / "global_step3" / "model.pt"), map_location="cpu")
    assert torch.equal(got["module"]["w"], w) and got["module"]["w"] is not w
    assert got["global_steps"] == 3 and got["shapes"] == torch.Size([16, 4])
    got = eng.load(str(tmp_path / "ds" / "global_step3" / "optim.pt"))
    assert torch.equal(got["optimizer_state_dict"]["exp_avg"], exp_avg)
    # a second load of the same file restores again instead of sharing tensors
    again = eng.load(str(tmp_path / "ds" / "global_step3" / "model.pt"))
    assert torch.equal(again["module"]["w"], w)
    eng.cleanup()
    # a new engine (a new run) numbers its steps after the ones already in the tiers
    eng2 = engine_on(tmp_path)
    info = save_tag(eng2, tmp_path / "ds", "global_step6", {"model.pt": model})
    assert eng2.commit(info)
    assert eng2.checkpointer.steps() == [0, 1]
    eng2.cleanup()


def test_the_capture_is_taken_at_the_next_forward(tmp_path: Path) -> None:
    """Sealed by the first forward after save_checkpoint, the snapshot holds the values of
    that moment even if they change before DeepSpeed's commit (after the capture)."""
    eng = engine_on(tmp_path)
    w = torch.zeros(1024)
    info = save_tag(eng, tmp_path / "ds", "t", {"model.pt": {"w": w}})
    torch.nn.Linear(2, 2)(torch.ones(2))  # the next iteration's forward pass
    eng.checkpointer.wait_captured()  # what the guard before the optimizer step ensures
    w.add_(1)  # the optimizer step
    assert eng.commit(info)
    assert torch.equal(eng.load(str(tmp_path / "ds" / "t" / "model.pt"))["w"], torch.zeros(1024))
    eng.cleanup()


def test_a_failed_checkpoint_returns_false_and_keeps_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    slow = FaultyTier(FileTier(tmp_path / "tiers"))
    eng = engine_on(tmp_path, slow, retries=0)
    slow.break_("put_shard")
    info = save_tag(eng, tmp_path / "ds", "t", {"model.pt": {"w": torch.ones(8)}})
    with caplog.at_level(logging.ERROR, logger="lazyckpt.deepspeed"):
        assert eng.commit(info) is False
    assert info.save_latest is False  # DeepSpeed reads it after commit(): no 'latest'
    assert "checkpoint 't'" in caplog.text and "injected permanent failure" in caplog.text
    assert not (tmp_path / "ds" / "t" / "model.pt").exists()
    slow.heal()
    info = save_tag(eng, tmp_path / "ds", "u", {"model.pt": {"w": torch.ones(8)}})
    assert eng.commit(info) is True  # the next checkpoint works again
    eng.cleanup()


def test_wait_captured_publishes_latest_once_durable(tmp_path: Path) -> None:
    slow = FaultyTier(FileTier(tmp_path / "tiers"))
    eng = engine_on(tmp_path, slow, wait="captured")
    slow.hang("commit")
    info = save_tag(eng, tmp_path / "ds", "t", {"model.pt": {"w": torch.ones(8)}})
    assert eng.commit(info) is True  # captured: the optimizer step may go on
    assert info.save_latest is False  # DeepSpeed must not write latest: the engine will
    assert not (tmp_path / "ds" / "t" / "model.pt").exists()
    assert not (tmp_path / "ds" / "latest").exists()
    slow.heal()
    eng.cleanup()  # waits for the publication
    assert (tmp_path / "ds" / "latest").read_text() == "t"
    assert json.loads((tmp_path / "ds" / "t" / "model.pt").read_text())["step"] == 0


def test_wait_captured_failure_keeps_latest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    slow = FaultyTier(FileTier(tmp_path / "tiers"))
    eng = engine_on(tmp_path, slow, wait="captured", retries=0)
    info = save_tag(eng, tmp_path / "ds", "t", {"model.pt": {"w": torch.ones(8)}})
    assert eng.commit(info)
    # "t" is only captured when commit returns: let it become durable (and named by latest)
    # before the tier breaks, or "t" fails too
    latest = tmp_path / "ds" / "latest"
    deadline = time.monotonic() + 60
    while not latest.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    slow.break_("put_shard")
    info = save_tag(eng, tmp_path / "ds", "u", {"model.pt": {"w": torch.ones(8)}})
    with caplog.at_level(logging.ERROR, logger="lazyckpt.deepspeed"):
        assert eng.commit(info) is True  # captured fine; the tier fails later
        eng.cleanup()
    assert (tmp_path / "ds" / "latest").read_text() == "t"
    assert "checkpoint 'u'" in caplog.text


def test_wait_must_be_known(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="wait must be"):
        LazyCheckpointEngine([FileTier(tmp_path)], wait="never")  # type: ignore[arg-type]


def test_commit_of_another_tag_commits_nothing(tmp_path: Path) -> None:
    eng = engine_on(tmp_path)
    save_tag(eng, tmp_path / "ds", "t", {"model.pt": {"w": torch.ones(8)}})
    other = CheckpointCommitInfo(tag="other", save_dir=str(tmp_path / "ds"), save_latest=True)
    assert eng.commit(other) is False and other.save_latest is False
    eng.cleanup()  # still commits "t", and writes latest as DeepSpeed would have
    assert (tmp_path / "ds" / "latest").read_text() == "t"


def test_save_after_the_seal_fails_the_checkpoint(tmp_path: Path) -> None:
    eng = engine_on(tmp_path)
    info = save_tag(eng, tmp_path / "ds", "t", {"a.pt": {"w": torch.ones(8)}})
    torch.nn.Linear(2, 2)(torch.ones(2))
    eng.save({"w": torch.ones(8)}, str(tmp_path / "ds" / "t" / "b.pt"))
    assert eng.commit(info) is False  # a step missing a file must not become 'latest'
    eng.cleanup()


def test_save_without_create_is_refused(tmp_path: Path) -> None:
    eng = engine_on(tmp_path)
    with pytest.raises(ConfigurationError, match="without create"):
        eng.save({"w": torch.ones(2)}, str(tmp_path / "x.pt"))
    eng.cleanup()


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    eng = engine_on(tmp_path / "a")
    info = save_tag(eng, tmp_path / "ds", "t", {"model.pt": {"w": torch.ones(8)}})
    assert eng.commit(info)
    eng.cleanup()
    other = engine_on(tmp_path / "b")  # tiers that never held the step
    with pytest.raises(SnapshotNotFoundError, match=r"model\.pt points at lazyckpt step 0"):
        other.load(str(tmp_path / "ds" / "t" / "model.pt"))
    bad = tmp_path / "ds" / "t" / "bad.pt"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(CorruptionError, match=r"bad\.pt is neither"):
        other.load(str(bad))
    other.cleanup()
    with pytest.raises(ConfigurationError, match="cleaned up"):
        other.create(CheckpointCommitInfo(tag="x", save_dir=str(tmp_path), save_latest=False))


def run_worker(*args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, str(HERE / "deepspeed_worker.py"), *args],
        capture_output=True, text=True, timeout=170, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]))


@pytest.mark.slow
def test_deepspeed_resume_is_bit_identical(tmp_path: Path) -> None:
    r = run_worker("resume", str(tmp_path))
    assert r["resumed"] == r["continued"]  # losses of the resumed run equal, bit for bit
    assert r["loaded_path"].endswith("t3/mp_rank_00_model_states.pt")
    # decoupled: 'latest' is written at the commit in the next step(), not by save_checkpoint
    assert r["pending_before_step"] and r["latest_before_step"] is None
    assert r["latest_after"] == "t3"
    assert r["steps"] == [0]
    assert r["files"] == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert all(r["identical"].values()), r["identical"]  # load() == torch.load of the same state
    assert r["fallback"]  # a torch.save'd file is still read
    assert r["pointer"]["tag"] == "t3"


@pytest.mark.slow
def test_deepspeed_latest_never_names_a_non_durable_tag(tmp_path: Path) -> None:
    r = run_worker("durable", str(tmp_path))
    assert r["latest_a"] == "a"
    # the durable tier holds the commit of "b": step() waits in commit(), latest stays "a"
    assert r["held_latest"] == "a" and not r["held_step_returned"]
    assert not r["held_pointer_exists"]
    assert r["latest_b"] == "b"
    # "c" fails on the durable tier: training goes on, latest stays "b", the error is logged
    assert len(r["failed_losses"]) == 2
    assert r["latest_after_failure"] == "b"
    assert any("checkpoint 'c'" in m and "injected permanent failure" in m for m in r["errors"])
    assert r["latest_d"] == "d"
    assert r["latest_e"] == "e"  # committed by engine.destroy(), latest written for it


@pytest.mark.slow
def test_deepspeed_wait_captured_does_not_hold_the_step(tmp_path: Path) -> None:
    # the worker heals the tier only after two step()s returned: waiting for durability in
    # step() would hang it (and fail this test at the worker's timeout)
    r = run_worker("captured", str(tmp_path))
    assert r["held_latest"] is None  # not durable yet: no latest
    assert r["latest_a"] == "a"


@pytest.mark.slow
def test_deepspeed_two_ranks_resume_bit_identical(tmp_path: Path) -> None:
    """ZeRO-1 on 2 gloo ranks: each rank saves its optimizer file, rank 0 the model states;
    on resume every rank reads rank 0's model states (from the shared file tier)."""
    sys.path.insert(0, str(HERE.parent))
    from helpers.ranks import launch_ranks, rank_results

    launch_ranks(HERE / "deepspeed_worker.py", ["ranks", str(tmp_path)], 2, timeout=170)
    results = rank_results(tmp_path)
    assert sorted(results) == [0, 1]
    for r in results.values():
        assert r["resumed"] == r["continued"]
        assert r["steps"] == [0] and r["latest"] == "t3"
        assert r["loaded_path"].endswith("t3/mp_rank_00_model_states.pt")
    assert results[0]["files"] == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


@pytest.mark.slow
def test_deepspeed_train_example(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "deepspeed_train.py"), "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=170, cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "losses identical bit for bit" in out.stdout
