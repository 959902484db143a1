"""bench/incremental.py runs end to end at quick sizes and writes a well-formed result.

Timings are reported by the benchmark, never asserted here; the bytes written are not
timings (they follow from the state and the method), so those are checked.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_quick_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "incremental.py"), "--quick",
         "--out", str(tmp_path), "--tmp", str(tmp_path)],
        capture_output=True, text=True, timeout=170, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("incremental-*.json")
    result = json.loads(path.read_text())
    assert set(result["workloads"]) == {"lora", "full"}
    for name, work in result["workloads"].items():
        assert set(work["methods"]) == {"lazyckpt", "incremental", "versions", "dcp_async"}
        for m in work["methods"].values():
            assert math.isfinite(m["stall_s"]["median"]) and m["stall_s"]["median"] >= 0
            assert m["storage_bytes"] > 0
            assert m["bytes_per_snapshot"]["file"]["first"] >= work["state_bytes"]
        share = {k: m["bytes_per_snapshot"]["file"]["later_over_state"] for k, m in work["methods"].items()}
        if name == "lora":  # the frozen base is written once
            assert share["incremental"] <= 0.02 and share["versions"] <= 0.02
            assert share["lazyckpt"] >= 1.0
            skipped = work["methods"]["versions"]["capture_skipped_bytes"]
            assert skipped > 0 and work["methods"]["incremental"]["capture_skipped_bytes"] == 0
        else:  # everything changes: everything is written
            assert all(s >= 1.0 for s in share.values())
