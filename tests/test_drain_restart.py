"""After a crash, a restarted job restores from the fastest copy that survived: the
node-local tier, not the parallel file system behind it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lazyckpt import SyncCheckpointer
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier, ZarrTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.drain_child import same, state_of

CHILD = Path(__file__).parent / "helpers" / "drain_child.py"


def crash_after_commit(root: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(CHILD), str(root), "crash"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert done.stdout == "committed\n"


def restart(root: Path) -> tuple[Any, FaultyTier, FaultyTier]:
    """Open the same chain as the crashed job, restore the latest step; return it and the
    two durable tiers (wrapped to count their calls)."""
    local = FaultyTier(FileTier(root / "local", name="local"))
    pfs = FaultyTier(ZarrTier(root / "pfs", name="pfs"))
    with SyncCheckpointer([HostMemoryTier(8 << 20), local, pfs]) as ckpt:
        restored = ckpt.restore()
    return restored, local, pfs


@pytest.mark.slow
def test_a_restarted_job_restores_from_the_local_tier_not_the_slowest(tmp_path: Path) -> None:
    crash_after_commit(tmp_path)
    restored, local, pfs = restart(tmp_path)
    assert restored["step"] == 3 and same(restored, state_of(3))
    assert local.calls["read_shard"] > 0
    assert pfs.calls["read_shard"] == 0 and pfs.calls["read_manifest"] == 0
    # the node was replaced: its local copy is gone; the same restart falls back to the
    # parallel file system (which shows the counter above would have seen its reads)
    shutil.rmtree(tmp_path / "local")
    restored, local, pfs = restart(tmp_path)
    assert restored["step"] == 3 and same(restored, state_of(3))
    assert local.calls["read_shard"] == 0 and pfs.calls["read_shard"] > 0
