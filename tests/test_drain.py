"""drain() and the preemption handler: every captured snapshot durable before the exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import ConfigurationError, DrainReport, SnapshotSkippedWarning, SyncCheckpointer
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.drain_child import state_of
from helpers.ranks import free_port

CHILD = Path(__file__).parent / "helpers" / "drain_child.py"


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def chain(root: Path, delay: float = 0.0) -> tuple[list[lazyckpt.Tier], FaultyTier]:
    slow = FaultyTier(FileTier(root), name="file")
    slow.delay_s = delay
    return [HostMemoryTier(8 << 20), slow], slow


def test_drain_reports_what_reached_where(tmp_path: Path) -> None:
    tiers, _ = chain(tmp_path, delay=0.05)
    with SyncCheckpointer(tiers, shard_size=1 << 16) as ckpt:
        ckpt.snapshot(state_of(1), step=1)
        ckpt.snapshot(state_of(2), step=2)
        report = ckpt.drain()
        assert isinstance(report, DrainReport)
        assert report.complete and not report.timed_out
        assert report.reached[2] == ("host", "file")
        assert report.durable == {"file": 2}
        assert "file: step 2" in report.summary()
        assert ckpt.steps() == [1, 2]
        # nothing in flight: an empty drain still says what is durable where
        again = ckpt.drain(timeout=0)
        assert again.reached == {} and again.durable == {"file": 2}


def test_drain_timeout_lists_what_is_pending(tmp_path: Path) -> None:
    tiers, slow = chain(tmp_path)
    with SyncCheckpointer(tiers, shard_size=1 << 16, deadline=None) as ckpt:
        ckpt.snapshot(state_of(1), step=1).wait("committed")
        slow.hang("commit")
        ckpt.snapshot(state_of(2), step=2)
        report = ckpt.drain(timeout=0.3)
        assert report.timed_out and not report.complete
        assert report.pending == {2: ("file",)}
        assert report.reached[2] == ("host",)
        assert report.durable == {"file": 1}
        assert "not reached in time: step 2 on ['file']" in report.summary()
        slow.heal()
        assert ckpt.drain().reached[2] == ("host", "file")
        with pytest.raises(ConfigurationError, match="timeout"):
            ckpt.drain(timeout=-1)


async def test_async_drain(tmp_path: Path) -> None:
    tiers, _ = chain(tmp_path, delay=0.02)
    async with lazyckpt.Checkpointer(tiers, shard_size=1 << 16) as ckpt:
        await ckpt.snapshot(state_of(3), step=3)
        report = await ckpt.drain(timeout=30)
        assert report.reached == {3: ("host", "file")} and report.durable == {"file": 3}


def test_drain_lists_a_failed_snapshot(tmp_path: Path) -> None:
    tiers, slow = chain(tmp_path)
    with SyncCheckpointer(tiers, shard_size=1 << 16, retries=0) as ckpt:
        slow.break_("commit")
        ckpt.snapshot(state_of(1), step=1)
        report = ckpt.drain()
        assert report.failed == {1: ("file",)} and report.durable == {"file": None}
        slow.heal()


def test_signal_drains_chains_to_the_previous_handler_and_stops_snapshots(tmp_path: Path) -> None:
    calls: list[int] = []

    def previous(signum: int, _frame: object) -> None:
        calls.append(signum)

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        tiers, _ = chain(tmp_path, delay=0.05)
        with SyncCheckpointer(
            tiers, shard_size=1 << 16, preemption_signals=(signal.SIGUSR1,), preemption_grace=20
        ) as ckpt:
            assert signal.getsignal(signal.SIGUSR1) != previous
            ckpt.snapshot(state_of(1), step=1)
            ckpt.wait_captured()
            signal.raise_signal(signal.SIGUSR1)  # the handler runs before this returns
            assert calls == [signal.SIGUSR1]
            assert ckpt.steps() == [1]  # drained before the previous handler ran
            with pytest.warns(SnapshotSkippedWarning, match="preempted"):
                handle = ckpt.snapshot(state_of(2), step=2)
            assert handle.skipped
        # closing gives the signal its previous handler back
        assert signal.getsignal(signal.SIGUSR1) == previous
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_preemption_options_are_checked(tmp_path: Path) -> None:
    for bad in (
        {"preemption_signals": signal.SIGTERM},
        {"preemption_signals": (signal.SIGKILL,)},
        {"preemption_signals": ("TERM",)},
        {"preemption_grace": 0},
    ):
        with pytest.raises(ConfigurationError, match="preemption"):
            SyncCheckpointer([FileTier(tmp_path)], **bad)
    ckpt = SyncCheckpointer([FileTier(tmp_path)], preemption_signals=(signal.SIGUSR2,))
    errors: list[BaseException] = []

    def off_main() -> None:
        try:
            ckpt.open()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigurationError)
    assert "main thread" in str(errors[0])
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        ckpt._core.engine.loop.stop()


def start(root: Path, mode: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(root), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a child that hangs is stopped with SIGABRT: faulthandler then prints where every
        # thread of it was
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(sys.path),
            "PYTHONFAULTHANDLER": "1",
            **env,
        },
    )


def _end(child: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """The child's output once it ended; if it does not end within ``timeout``, it is
    stopped by SIGABRT and the test fails with its threads' stacks."""
    try:
        return child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGABRT)
        _out, err = child.communicate(timeout=30)
        raise AssertionError(
            f"{child.args[-1]} child did not end within {timeout} s; its stacks:\n{err[-6000:]}"
        ) from None


def preempt(children: list[subprocess.Popen[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Wait until every child captured step 2, SIGTERM them all, collect their ends."""
    try:
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line == "captured\n", line + child.communicate(timeout=60)[1]
        for child in children:  # right after step 2's capture: it is not durable yet
            child.send_signal(signal.SIGTERM)
        ends = []
        for child in children:
            out, err = _end(child, 60)
            ends.append(subprocess.CompletedProcess(child.args, child.returncode, out, err))
        return ends
    finally:  # on a failure too: no child left running, no pipe left for the GC to close
        for child in children:
            if child.poll() is None:
                child.kill()
            child.communicate()


def run_child(root: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return preempt([start(root, mode)])[0]


def restore_from_file(root: Path, step: int) -> Any:
    with SyncCheckpointer([FileTier(root, readonly=True)]) as ckpt:
        assert ckpt.steps()[-1] == step
        return ckpt.restore(step)


@pytest.mark.slow
def test_sigterm_leaves_the_captured_step_committed_on_the_slow_tier(tmp_path: Path) -> None:
    done = run_child(tmp_path, "default")
    assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
    assert "not preempted" not in done.stdout
    assert "drained on SIGTERM" in done.stderr and "file: step 2" in done.stderr
    assert same(restore_from_file(tmp_path, 2), state_of(2))


@pytest.mark.slow
def test_sigterm_chains_to_the_trainers_own_handler(tmp_path: Path) -> None:
    done = run_child(tmp_path, "previous")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "previous handler ran for SIGTERM" in done.stdout
    assert same(restore_from_file(tmp_path, 2), state_of(2))


@pytest.mark.slow
def test_sigterm_on_every_rank_keeps_the_commit_coordinated(tmp_path: Path) -> None:
    # as under torchrun: every rank gets the signal; each drains, the ranks still agree on
    # step 2's commit, then each ends by SIGTERM
    world = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    world["MASTER_PORT"] = str(free_port())
    ends = preempt([start(tmp_path, "default", RANK=str(r), **world) for r in range(2)])
    for end in ends:
        assert end.returncode == -signal.SIGTERM, end.stderr[-3000:]
        assert "file: step 2" in end.stderr
    record = tmp_path / "step-000000000002" / "manifest.json"
    assert record.exists()  # the shared commit record: every rank's part is down
    world["MASTER_PORT"] = str(free_port())
    restores = [start(tmp_path, "restore", RANK=str(r), **world) for r in range(2)]
    for child in restores:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-3000:]
        assert out == "restored step 2 True\n"


@pytest.mark.slow
def test_preemption_example() -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "preemption.py"
    out = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=example.parent.parent,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "trainer ended by SIGTERM" in out.stdout
    assert "bit for bit the replayed training" in out.stdout
    assert "drained on SIGTERM" in out.stderr
