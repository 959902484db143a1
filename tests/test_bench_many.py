"""The tensor-count sweep and the restore comparison run end to end at tiny sizes and write
well-formed results (their shape only: timings are reported, never asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(script: str, *args: str, out: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args, "--out", str(out), "--tmp", str(out)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = out.glob("*.json")
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_many_tensors_quick(tmp_path: Path) -> None:
    doc = _run("many_tensors.py", "--counts", "300,600", "--reps", "2", out=tmp_path)
    rows = doc["results"]["rows"]
    assert [r["tensors"] for r in rows] == [300, 600]
    for r in rows:
        for key in ("snapshot_cold_us_per_tensor", "manifest_bytes", "restore_us_per_tensor",
                    "restore_into_us_per_tensor", "manifest_read_us_per_tensor",
                    "snapshot_calls_per_tensor"):
            assert _positive(r[key]), (key, r[key])
        assert _positive(r["snapshot_warm_us_per_tensor"]["median"])
        assert _positive(r["snapshot_warm_cpu_us_per_tensor"]["median"])
        assert len(r["snapshot_warm_gc"]["collections_per_call"]) == 3
        assert _positive(r["dcp"]["save_plan_s"]) and _positive(r["dcp"]["metadata_bytes"])
    # the manifest grows with the count
    assert rows[1]["manifest_bytes"] > rows[0]["manifest_bytes"]


def test_restore_compare_quick(tmp_path: Path) -> None:
    doc = _run("restore_compare.py", "--mib", "20", "--reps", "1", out=tmp_path)  # 3 pieces
    r = doc["results"]
    assert set(r["gib_per_s"]) == {
        "plain_read", "plain_read_parallel", "plain_read_direct", "lazyckpt_restore",
        "lazyckpt_restore_into",
        "torch_load", "dcp_load_alloc", "dcp_load_into",
    }
    assert all(_positive(v) for v in r["gib_per_s"].values())
    assert all(r["roundtrip_ok"].values()) and len(r["roundtrip_ok"]) == 5
    assert _positive(r["restore_over_best_peer"]) and _positive(r["restore_over_plain_read"])


def test_stall_sweep_quick(tmp_path: Path) -> None:
    doc = _run("stall_sweep.py", "--quick", out=tmp_path)
    rows = doc["results"]["rows"]
    assert [r["every"] for r in rows] == [1, 2, 4, 8, 16]
    for r in rows:
        for key in ("lazyckpt_stall_ms", "dcp_async_stall_ms", "lazyckpt_first_stall_ms",
                    "lazyckpt_later_stall_ms"):
            assert _positive(r[key]), (key, r[key])
        assert set(r["lazyckpt_split_ms"]) == set(r["lazyckpt_first_split_ms"]) == {
            "model_state_dict", "optim_state_dict", "walk", "plan", "other", "guard"
        }
    steady = doc["results"]["steady_state"]
    assert _positive(steady["lazyckpt_ms"]) and _positive(steady["dcp_async_ms"])
    assert steady["met"] == (steady["ratio_pct"] <= steady["target_pct"])
    (csv_path,) = tmp_path.glob("*.csv")
    assert len(csv_path.read_text().splitlines()) == 1 + len(rows)
