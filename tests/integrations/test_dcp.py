"""lazyckpt as PyTorch DCP's storage: dcp.save / dcp.async_save / dcp.load through
LazyStorageWriter and LazyStorageReader, in one process and as FSDP2 on 2 gloo ranks loaded
on 1."""

from __future__ import annotations

import asyncio
import json
import pickle
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save, save

import lazyckpt
from lazyckpt import (
    ConfigurationError,
    SnapshotFailedError,
    SnapshotSkippedError,
    SnapshotSkippedWarning,
    SyncCheckpointer,
    UnsupportedStateError,
)
from lazyckpt.cli import main as cli_main
from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent.parent))
from helpers.gating import hold_captures
from helpers.ranks import launch_ranks, rank_results

WORKER = Path(__file__).parent / "dcp_worker.py"

# DCP warns that it runs without a process group in a single process, and that async_save
# is experimental; neither is what these tests check.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore::FutureWarning",
)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)  # other weights than trained()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()  # so the optimizer has state to be overwritten
    opt.zero_grad()
    return model, opt


def dcp_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"epoch": 3, "tag": "run-a", "lrs": [0.1, 0.2]}}


def frozen(state: Any) -> Any:
    """A deep copy with every tensor cloned: the state as it was at this moment."""
    if isinstance(state, dict):
        return {k: frozen(v) for k, v in state.items()}
    if isinstance(state, list):
        return [frozen(v) for v in state]
    return state.detach().clone() if isinstance(state, torch.Tensor) else state


def assert_same(got: Any, expected: Any, key: str = "") -> None:
    if isinstance(expected, dict):
        assert sorted(map(str, got)) == sorted(map(str, expected)), key
        for k in expected:
            assert_same(got[k], expected[k], f"{key}/{k}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), key
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{key}/{i}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, key
        assert torch.equal(got, expected), key
    else:
        assert got == expected, key


def load_into_fresh(ckpt: SyncCheckpointer, checkpoint_id: str | None) -> dict[str, Any]:
    model, opt = fresh()
    state = dcp_state(model, opt)
    state["extra"] = {"epoch": 0, "tag": "", "lrs": [0.0, 0.0]}
    load(state, checkpoint_id=checkpoint_id, storage_reader=LazyStorageReader(ckpt))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = dcp_state(model, opt)
    loaded["extra"] = state["extra"]
    return loaded


def lazy_async_save(state: Any, step: int, ckpt: Any) -> AsyncSaveResponse:
    """``dcp.async_save`` through lazyckpt, the step passed as DCP's (string) checkpoint id."""
    response = async_save(state, checkpoint_id=str(step), storage_writer=LazyStorageWriter(ckpt))
    assert isinstance(response, AsyncSaveResponse)  # the writer's stage() returns a future
    return response


def cause_of(exc: CheckpointException) -> BaseException:
    """The exception rank 0's part of a DCP save raised."""
    error, _traceback = exc.failures[0]
    return error


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[SyncCheckpointer]:
    with SyncCheckpointer([HostMemoryTier(8 << 20), FileTier(tmp_path / "ckpt")]) as c:
        yield c


def test_async_save_returns_before_the_capture_and_completes_in_order(
    ckpt: SyncCheckpointer,
) -> None:
    model, opt = trained()
    state = dcp_state(model, opt)
    expected = frozen(state)
    gate, put_back = hold_captures(ckpt)
    try:
        # an int checkpoint id works too (DCP annotates it as a path, hence the ignore)
        response = async_save(state, checkpoint_id=7, storage_writer=LazyStorageWriter(ckpt))  # type: ignore[arg-type]
        assert isinstance(response, AsyncSaveResponse)
        # nothing is copied yet: neither the staging nor the upload can be complete
        assert not response.staging_completion.done()
        assert not response.upload_completion.done()
        gate.set()
        response.staging_completion.result(timeout=30)
    finally:
        gate.set()
        put_back()
    with torch.no_grad():  # training goes on: the save must hold the values at staging
        for p in model.parameters():
            p.add_(1.0)
    response.upload_completion.result(timeout=30)
    assert ckpt.steps() == [7]
    assert_same(load_into_fresh(ckpt, "7"), expected)


def test_sync_save_and_load_round_trip_bit_for_bit(ckpt: SyncCheckpointer) -> None:
    model, opt = trained()
    state = dcp_state(model, opt)
    save(state, checkpoint_id="3", storage_writer=LazyStorageWriter(ckpt))
    assert ckpt.steps() == [3]  # committed when dcp.save returns
    assert_same(load_into_fresh(ckpt, "3"), frozen(state))


def test_a_writer_keeps_the_checkpointer_it_was_given_open(tmp_path: Path) -> None:
    """A helper that opens a Checkpointer and returns only the DCP writer: the writer is an
    owner, so the Checkpointer is not closed as dropped when the helper's frame goes."""
    import gc

    def make_writer() -> LazyStorageWriter:
        ckpt = SyncCheckpointer([HostMemoryTier(8 << 20), FileTier(tmp_path)]).open()
        return LazyStorageWriter(ckpt)

    writer = make_writer()
    gc.collect()
    model, opt = trained()
    save(dcp_state(model, opt), checkpoint_id="3", storage_writer=writer)
    with SyncCheckpointer([FileTier(tmp_path, readonly=True)]) as reader:
        assert reader.steps() == [3]
    writer._checkpointer.close()


def test_a_dcp_save_is_an_ordinary_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    model, opt = trained()
    state = dcp_state(model, opt)
    with SyncCheckpointer([FileTier(root)]) as ckpt:
        lazy_async_save(state, 5, ckpt)
        ckpt.wait_captured()
        ckpt.snapshot({"w": torch.ones(3)}, step=6)  # plain lazyckpt steps after it
    with SyncCheckpointer([FileTier(root)]) as ckpt:
        assert ckpt.steps() == [5, 6]
        restored = ckpt.restore(5)  # lazyckpt's own restore reads what DCP saved
        assert_same(restored, frozen(state))
    assert cli_main(["ls", str(root), "--json"]) == 0
    assert [e["step"] for e in json.loads(capsys.readouterr().out)] == [5, 6]
    assert cli_main(["verify", str(root), "--step", "5"]) == 0


def test_load_without_checkpoint_id_takes_the_latest(ckpt: SyncCheckpointer) -> None:
    model, opt = trained()
    save(dcp_state(model, opt), checkpoint_id="1", storage_writer=LazyStorageWriter(ckpt))
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    latest = frozen(dcp_state(model, opt))
    save(dcp_state(model, opt), checkpoint_id="2", storage_writer=LazyStorageWriter(ckpt))
    assert_same(load_into_fresh(ckpt, None), latest)


def test_checkpoint_id_must_be_a_step(ckpt: SyncCheckpointer) -> None:
    state = {"w": torch.ones(4)}
    with pytest.raises(ConfigurationError, match="not a step"):
        save(state, checkpoint_id="/ckpt/step-3", storage_writer=LazyStorageWriter(ckpt))
    with pytest.raises(ConfigurationError, match="needs the step"):
        LazyStorageWriter(ckpt).stage(state)  # outside async_save, no step to find
    assert LazyStorageWriter.validate_checkpoint_id("12")
    assert not LazyStorageReader.validate_checkpoint_id("/ckpt/12")
    writer = LazyStorageWriter(ckpt, step=4)
    writer.stage(state).result(timeout=30)
    with pytest.raises(ConfigurationError, match="differs from the step staged"):
        writer.reset(5)


def test_values_are_stored_without_pickle(ckpt: SyncCheckpointer) -> None:
    class Opaque:
        pass

    state = {"w": torch.ones(4), "obj": Opaque()}
    with pytest.raises(UnsupportedStateError, match="obj"):  # at the call, before any copy
        lazy_async_save(state, 1, ckpt)
    with pytest.raises(CheckpointException, match="UnsupportedStateError"):  # DCP wraps it
        save(state, checkpoint_id="1", storage_writer=LazyStorageWriter(ckpt))
    assert ckpt.steps() == []


def test_a_failed_upload_fails_the_future_not_the_run(tmp_path: Path) -> None:
    faulty = FaultyTier(FileTier(tmp_path / "ckpt"))
    with SyncCheckpointer([faulty], retries=0) as ckpt:
        faulty.break_("commit")
        response = lazy_async_save({"w": torch.ones(64)}, 1, ckpt)
        response.staging_completion.result(timeout=30)  # the capture itself succeeded
        with pytest.raises(CheckpointException) as failed:  # DCP wraps the writer's error
            response.upload_completion.result(timeout=30)
        assert isinstance(cause_of(failed.value), SnapshotFailedError)
        faulty.heal()
        save({"w": torch.ones(64)}, checkpoint_id="2", storage_writer=LazyStorageWriter(ckpt))
        assert ckpt.steps() == [2]


def test_a_skipped_save_says_so(tmp_path: Path) -> None:
    with SyncCheckpointer([FileTier(tmp_path / "ckpt")], when_busy="skip") as ckpt:
        gate, put_back = hold_captures(ckpt)
        try:
            first = lazy_async_save({"w": torch.ones(8)}, 1, ckpt)
            with pytest.warns(SnapshotSkippedWarning):
                second = lazy_async_save({"w": torch.ones(8)}, 2, ckpt)
            second.staging_completion.result(timeout=30)  # nothing to stage
            with pytest.raises(CheckpointException) as skipped:
                second.upload_completion.result(timeout=30)
            assert isinstance(cause_of(skipped.value), SnapshotSkippedError)
        finally:
            gate.set()
            put_back()
        first.upload_completion.result(timeout=30)
        assert ckpt.steps() == [1]


async def test_works_with_the_async_checkpointer(tmp_path: Path) -> None:
    async with lazyckpt.Checkpointer([FileTier(tmp_path / "ckpt")]) as ckpt:
        state = {"w": torch.arange(10.0)}
        response = lazy_async_save(state, 1, ckpt)
        await ckpt.wait_captured()
        await asyncio.wrap_future(response.upload_completion)  # never block the loop
        assert await ckpt.steps() == [1]


@pytest.mark.slow
def test_fsdp2_saved_on_two_ranks_loads_on_one(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    launch_ranks(WORKER, ["save", str(root), str(out)], 2, timeout=150)
    saved = rank_results(out)
    assert sorted(saved) == [0, 1]
    for r in saved.values():
        assert r["response"] == "AsyncSaveResponse"
        assert r["steps"] == [1, 2]
    for path in out.glob("rank*.json"):
        path.unlink()
    launch_ranks(WORKER, ["load", str(root), str(out)], 1, timeout=150)
    loaded = rank_results(out)[0]
    assert loaded["keys"], "the state loaded on 1 rank has other keys than the one saved on 2"
    assert loaded["differ"] == []
    assert loaded["steps"] == [1, 2]
    assert loaded["restored_keys"] == ["model", "optim"]


@pytest.mark.slow
def test_the_dcp_async_save_example_runs() -> None:
    example = Path(__file__).parent.parent.parent / "examples" / "dcp_async_save.py"
    out = subprocess.run(
        [sys.executable, str(example), "--steps", "8", "--every", "4", "--width", "64"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "committed steps: [4, 8] -> file" in out.stdout
    assert "model and optimizer bit for bit" in out.stdout


def test_the_process_executor_is_refused_with_a_reason(ckpt: SyncCheckpointer) -> None:
    with pytest.raises(ConfigurationError, match=r"AsyncCheckpointerType\.THREAD"):
        pickle.dumps(LazyStorageWriter(ckpt))


def test_the_snippet_in_the_docs_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = (Path(__file__).parent.parent.parent / "docs" / "integrations.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "LazyStorageWriter" in b]
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(blocks[0], scope)
    with SyncCheckpointer([FileTier(tmp_path / "checkpoints")]) as ckpt:
        assert ckpt.steps() == [50, 100]
        saved = ckpt.restore(100)
    assert torch.equal(saved["model"]["weight"], scope["model"].weight)


@pytest.mark.slow
def test_the_dcp_benchmark_runs_quick(tmp_path: Path) -> None:
    bench = Path(__file__).parent.parent.parent / "bench" / "integration_dcp.py"
    result = tmp_path / "result.json"
    out = subprocess.run(
        [sys.executable, str(bench), "--quick", "--tmp", str(tmp_path), "--out", str(result)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads(result.read_text())["summary"]
    assert sorted(summary) == ["dcp", "lazyckpt", "none"]
    for method in ("dcp", "lazyckpt"):
        assert summary[method]["async_save_call_s"]["median"] > 0
    assert "| lazyckpt |" in out.stdout


def test_one_writer_and_one_reader_serve_many_saves_and_loads(ckpt: SyncCheckpointer) -> None:
    writer, reader = LazyStorageWriter(ckpt), LazyStorageReader(ckpt)
    for step in (1, 2):
        response = async_save(
            {"w": torch.full((4,), float(step))}, checkpoint_id=str(step), storage_writer=writer
        )
        assert isinstance(response, AsyncSaveResponse)
        response.upload_completion.result(timeout=30)
    save({"w": torch.full((4,), 3.0)}, checkpoint_id="3", storage_writer=writer)
    assert ckpt.steps() == [1, 2, 3]
    state = {"w": torch.zeros(4)}
    load(state, checkpoint_id="1", storage_reader=reader)
    assert torch.equal(state["w"], torch.full((4,), 1.0))
    load(state, storage_reader=reader)  # no id this time: the latest, not the last one asked
    assert torch.equal(state["w"], torch.full((4,), 3.0))


def test_overwrite_false_refuses_a_step_that_exists_as_dcp_does(
    ckpt: SyncCheckpointer, tmp_path: Path
) -> None:
    # DCP's own writer: the second save into the same checkpoint fails in its planning
    theirs = tmp_path / "dcp"
    save({"w": torch.ones(4)}, storage_writer=FileSystemWriter(theirs, overwrite=False))
    with pytest.raises(CheckpointException) as refused_by_dcp:
        save({"w": torch.ones(4)}, storage_writer=FileSystemWriter(theirs, overwrite=False))
    dcp_error = cause_of(refused_by_dcp.value)

    writer = LazyStorageWriter(ckpt, overwrite=False)  # one writer for every save below
    save({"w": torch.ones(4)}, checkpoint_id="1", storage_writer=writer)  # a new step: saved
    with pytest.raises(CheckpointException) as refused:
        save({"w": torch.zeros(4)}, checkpoint_id="1", storage_writer=writer)
    error = cause_of(refused.value)
    assert type(error) is type(dcp_error) is RuntimeError
    assert str(error).startswith(str(dcp_error))  # "Checkpoint already exists and ..."
    assert "lazyckpt step 1" in str(error)

    # async_save: returns, stages nothing, and its upload fails the same way
    response = async_save({"w": torch.zeros(4)}, checkpoint_id="1", storage_writer=writer)
    assert isinstance(response, AsyncSaveResponse)
    response.staging_completion.result(timeout=30)
    with pytest.raises(CheckpointException) as failed:
        response.upload_completion.result(timeout=30)
    assert type(cause_of(failed.value)) is RuntimeError
    assert [s["step"] for s in ckpt.metrics()["snapshots"]] == [1]  # no snapshot was taken
    state = {"w": torch.full((4,), 7.0)}
    load(state, checkpoint_id="1", storage_reader=LazyStorageReader(ckpt))
    assert torch.equal(state["w"], torch.ones(4))  # the first save's, untouched

    # a step still in flight exists too
    gate, put_back = hold_captures(ckpt)
    try:
        pending = async_save({"w": torch.full((4,), 2.0)}, checkpoint_id="2", storage_writer=writer)
        assert isinstance(pending, AsyncSaveResponse)
        with pytest.raises(CheckpointException, match="already exists"):
            save({"w": torch.zeros(4)}, checkpoint_id="2", storage_writer=LazyStorageWriter(ckpt, overwrite=False))
    finally:
        gate.set()
        put_back()
    pending.upload_completion.result(timeout=30)
    save({"w": torch.full((4,), 3.0)}, checkpoint_id="3", storage_writer=writer)
    assert ckpt.steps() == [1, 2, 3]

    # the default refuses a step that exists with lazyckpt's own error (steps increase)
    with pytest.raises(CheckpointException, match="not newer than the newest snapshot"):
        save({"w": torch.zeros(4)}, checkpoint_id="3", storage_writer=LazyStorageWriter(ckpt))
    with pytest.raises(ConfigurationError, match="overwrite must be True or False"):
        LazyStorageWriter(ckpt, overwrite="no")  # type: ignore[arg-type]
