"""``bench/restore_fresh.py --quick`` runs end to end and writes a well-formed result: every
trial in a fresh process, every method bit for bit (the shape only: timings are reported,
never asserted)."""

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


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_restore_fresh_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "restore_fresh.py"), "--quick",
         "--out", str(tmp_path), "--tmp", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("restore-*.json")
    doc = json.loads(path.read_text())
    assert "/" not in json.dumps(doc["machine"])
    assert "## large" in path.with_suffix(".md").read_text()
    r = doc["results"]["large"]
    assert r["roundtrip_ok"] == dict.fromkeys(r["roundtrip_ok"], True)
    assert set(r["roundtrip_ok"]) == {
        "lazyckpt_restore", "lazyckpt_restore_into", "torch_load", "dcp_load_alloc",
        "dcp_load_into",
    }
    for cache in ("cold", "warm"):
        for name, v in r[cache]["methods"].items():
            for key in ("seconds", "cpu_seconds", "process_seconds", "process_cpu_seconds"):
                assert _positive(v[key]["median"]), (cache, name, key)
            assert _positive(v["cpu_s_per_gib"]["median"]), (cache, name)
        ratios = r[cache]["ratios"]
        for key in ("restore_over_best_peer", "into_over_dcp_into",
                    "restore_cpu_over_best_peer", "into_cpu_over_dcp_into"):
            assert _positive(ratios[key]), (cache, key)
