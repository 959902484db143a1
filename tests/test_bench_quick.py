"""The benchmark suite runs end to end at quick sizes and writes a well-formed result.

Only the shape of the result is checked (keys present, numbers positive and finite):
timings are reported by the suite, never asserted here.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "bench" / "run.py"

pytestmark = pytest.mark.slow


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--out", str(out), "--tmp", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = sorted(out.glob("*.json"))
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    doc["_out"] = str(out)
    doc["_stem"] = files[0].stem
    return doc


def test_document_shape(result: dict[str, Any]) -> None:
    assert result["schema"] == 1
    assert result["quick"] is True
    assert set(result["results"]) == {
        "snapshot_latency",
        "capture",
        "flush",
        "restore",
        "rss",
        "e2e",
    }
    machine = result["machine"]
    assert machine["slug"].startswith(("cpu-", "gpu-"))
    assert _positive(machine["cpus"])
    # no host names or paths in what gets committed
    assert "/" not in json.dumps(machine)
    assert result["targets"], "targets are evaluated"
    for t in result["targets"]:
        assert {"name", "value", "target", "status"} <= set(t)
        assert t["status"] in {"met", "partly", "missed", "n/a"}
        assert _finite(t["value"])


def test_side_files(result: dict[str, Any]) -> None:
    out = Path(result["_out"])
    md = (out / f"{result['_stem']}.md").read_text()
    assert "## Targets" in md and "## End-to-end training" in md
    pngs = {p.name for p in (out / "img").glob("bench-*.png")}
    assert pngs == {
        "bench-snapshot-latency.png",
        "bench-bandwidth.png",
        "bench-e2e.png",
        "bench-rss.png",
    }


def test_micro_numbers(result: dict[str, Any]) -> None:
    r = result["results"]
    for p in r["snapshot_latency"]["by_tensors"] + r["snapshot_latency"]["by_bytes"]:
        assert _positive(p["tensors"]) and _positive(p["median"]) and _positive(p["p95"])
    for key in ("capture", "flush", "restore"):
        assert _positive(r[key]["bytes"])
        for name, seconds in r[key]["seconds"].items():
            assert _positive(seconds["median"]), (key, name)
            assert _positive(r[key]["gib_per_s"][name]), (key, name)
    assert _positive(r["capture"]["snapshot_over_memcpy"])
    assert _positive(r["capture"]["capture_over_memcpy_bw"])
    assert _positive(r["flush"]["file_over_write_fsync_bw"])
    assert _positive(r["restore"]["restore_over_read_bw"])
    assert r["restore"]["roundtrip_ok"] is True
    rss = r["rss"]
    assert len(rss["rss_kib"]["series"]) == rss["snapshots"]
    assert all(_positive(v) for v in rss["rss_kib"]["series"])
    assert _finite(rss["growth_mib"])


def test_e2e_numbers(result: dict[str, Any]) -> None:
    e2e = result["results"]["e2e"]
    assert _positive(e2e["config"]["checkpoint_bytes"])
    methods = {
        "none",
        "torch_save",
        "dcp_save",
        "dcp_async",
        "dcp_async_stager",
        "lazyckpt",
        "lazyckpt_direct",
    }
    assert len(e2e["summary"]) == 2
    for per in e2e["summary"].values():
        assert set(per) == methods
        for name, v in per.items():
            assert _positive(v["loop_s"]["median"]), name
            assert _positive(v["iter_s"]["median"]), name
            assert _positive(v["peak_rss_mib"]["median"]), name
            assert _finite(v["stall_s"]["median"]) and v["stall_s"]["median"] >= 0, name
            if name != "none":
                assert _positive(v["stall_s"]["median"]), name
                assert _positive(v["total_durable_s"]["median"]), name


def test_scale_quick(tmp_path: Path) -> None:
    """``bench/scale.py --quick``: gloo jobs of 2 and 4 ranks, the sweep, the many-tensor
    case and the read-once restore against DCP, well-formed (restores bit for bit)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "scale.py"), "--quick",
         "--out", str(tmp_path), "--tmp", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("scale-*.json")
    doc = json.loads(path.read_text())
    assert "/" not in json.dumps(doc["machine"])
    assert "## Read once" in path.with_suffix(".md").read_text()
    r = doc["results"]
    assert [a["world"] for a in r["sweep"]] == [2, 4]
    for a in r["sweep"] + r["many"]:
        s = a["lazyckpt_snapshot"]
        assert _positive(s["snapshot_s"]["median"]) and _positive(s["commit_s"]["median"])
        # two all_reduce per committed step and tier, whatever the world size
        assert set(s["coordinator_collectives"]) == {2}, s
        assert s["calls_own"] == {"all_reduce": 2}, s
        x = a["lazyckpt_restore"]
        assert _positive(x["planning_s"]["median"]) and x["mismatches"] == 0
        assert _positive(a["dcp_save"]["planning_s"]["median"])
        assert _positive(a["dcp_load"]["load_s"]["median"]) and a["dcp_load"]["mismatches"] == 0
    # the sweep's restore reads no other rank's manifest from the tier: each rank reads its
    # own and the job's all_gather hands it the others' (1 and 3 reads when each rank read
    # them all)
    assert [a["lazyckpt_restore"]["manifests_read_per_rank"] for a in r["sweep"]] == [0, 0]
    assert {a["kind"] for a in r["many"]} == {"dtensor", "plain"}
    for layout in ("ddp", "hsdp"):
        ro = r["readonce"][layout]
        assert ro["lazyckpt"]["mismatches"] == 0 and ro["dcp"]["mismatches"] == 0
        assert all(_positive(v) for v in ro["lazyckpt"]["read_over_stored"])


def test_cadence_quick(tmp_path: Path) -> None:
    """``bench/cadence.py --quick``: a training loop with the chain host, file and a
    throttled pfs tier, every snapshot everywhere against the pfs every 5th step: the pfs
    tier gets the cadence's steps and the emergency copy of the last one, and fewer bytes."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cadence.py"), "--quick",
         "--out", str(tmp_path), "--tmp", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = tmp_path.glob("cadence-*.json")
    doc = json.loads(path.read_text())
    assert "/" not in json.dumps(doc["machine"])
    assert "| pfs every 5 steps |" in path.with_suffix(".md").read_text()
    s = doc["summary"]
    assert set(s) == {"none", "everywhere", "cadence"}
    steps = doc["params"]["warmup"] + doc["params"]["iters"]  # 12: pfs takes 5, 10, then 12
    for name, e in s.items():
        assert _positive(e["loop_s"]["median"]) and _positive(e["loop_over_none"]["median"]), name
        if name == "none":
            continue
        assert _finite(e["stall_stats_per_step_s"]["median"]), name
        assert e["snapshots_skipped"] == 0 and not e["drain_failed"], name
    assert sorted(s["everywhere"]["slow_committed_steps"]) == list(range(1, steps + 1))
    assert s["everywhere"]["emergency"] == {}
    assert s["cadence"]["slow_committed_steps"] == [5, 10, 12]
    assert s["cadence"]["emergency"] == {"12": ["pfs"]}
    assert s["cadence"]["slow_bytes"]["median"] * 3 < s["everywhere"]["slow_bytes"]["median"]
    assert s["cadence"]["slow_commits"]["median"] == 3
