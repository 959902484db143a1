"""``bench/gpu_check.py`` on the CPU: its arguments, its budget guard, the JSON it writes
and the verdict it draws. The figures of a CPU run mean nothing and are not checked; that
the run goes through every phase with the same code a GPU run uses is what counts here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.py"


def run(
    args: list[str], out: Path | None = None, timeout: float = 150
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )


def only_json(folder: Path) -> dict[str, Any]:
    files = sorted(folder.glob("*.json"))
    assert len(files) == 1, files
    assert not list(folder.glob("*.tmp"))
    doc: dict[str, Any] = json.loads(files[0].read_text())
    assert doc["path"] == str(files[0])
    return doc


def positive(summary: dict[str, Any], n: int) -> bool:
    return summary["n"] == n and math.isfinite(summary["median"]) and summary["median"] >= 0


@pytest.mark.slow
def test_a_cpu_run_goes_through_every_phase_and_writes_under_out(tmp_path: Path) -> None:
    proc = run(
        ["--cpu", "--budget-s", "150", "--iters", "2", "--warmup", "1", "--bandwidth-mib", "8"],
        out=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = only_json(tmp_path)  # $OUT, since --out was not given
    assert doc["schema"] == 1 and doc["complete"] is True, proc.stderr[-3000:]
    assert doc["device"]["kind"] == "cpu"
    assert doc["tests"]["returncode"] == 0, doc["tests"]
    assert "skipped" in doc["tests"]["summary"], doc["tests"]
    bandwidth = doc["bandwidth"]
    assert bandwidth["bytes"] == 8 << 20 and bandwidth["capture_backend"] == "CpuCapture"
    assert bandwidth["ratio"] > 0 and bandwidth["lazyckpt_gbps"]["n"] == 5
    stall = doc["stall"]
    assert stall["model"] == "tiny" and stall["parameters"] > 0 and stall["state_bytes"] > 0
    runs = stall["runs"]
    assert set(runs) == {
        "no_checkpoint",
        "lazyckpt_stream",
        "lazyckpt_cpu",
        "dcp_async_stager",
        "dcp_async_default",
    }
    assert "needs CUDA" in runs["lazyckpt_stream"]["skipped"]
    for name in ("lazyckpt_cpu", "dcp_async_stager", "dcp_async_default"):
        assert "error" not in runs[name], runs[name]
        assert runs[name]["iters"] == 2 and positive(runs[name]["blocked_ms"], 2), name
        assert math.isfinite(runs[name]["overhead_ms"])
    assert runs["lazyckpt_cpu"]["failed"] == 0 and positive(runs["lazyckpt_cpu"]["snapshot_ms"], 2)
    assert runs["dcp_async_stager"]["stager"]["use_async_staging"] is True
    assert stall["lazyckpt_arena"]["peak"] <= stall["lazyckpt_arena"]["capacity"]
    interference = doc["interference"]
    assert interference["bytes"] == 32 << 20 and interference["ratio"] > 0
    methods = [r["method"] for r in interference["runs"]]
    assert methods == ["alone", "lazyckpt"] * 2
    assert all(r["iter_ms"]["n"] > 0 for r in interference["runs"])
    assert all(r["snapshots"] > 0 for r in interference["runs"] if r["method"] == "lazyckpt")
    assert doc["targets"] == {
        "evaluated": False,
        "why": "a CPU run checks the script, not the GPU path",
    }
    table = proc.stdout.strip().splitlines()
    assert table[0] == "lazyckpt GPU check on cpu"
    assert any(line.split()[:1] == ["lazyckpt_cpu"] for line in table)
    assert any(line.startswith("launch-bound loop") for line in table)
    assert table[-1] == f"written: {doc['path']}"  # the table comes last


@pytest.mark.slow
def test_a_tight_budget_skips_phases_and_says_so(tmp_path: Path) -> None:
    proc = run(["--cpu", "--budget-s", "25", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = only_json(tmp_path)
    assert doc["elapsed_s"] < 25 and doc["complete"] is True
    assert doc["tests"] == {"skipped": "budget"}
    assert doc["bandwidth"] == {"skipped": "budget"}
    runs = doc["stall"]["runs"]
    assert runs["no_checkpoint"]["iters"] >= 1  # what fits still runs
    assert runs["lazyckpt_cpu"] == {"skipped": "budget"}
    for name in ("dcp_async_stager", "dcp_async_default"):  # by their own estimates
        assert runs[name].get("skipped") == "budget" or runs[name]["iters"] >= 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu", "--budget-s", "0"], "--budget-s must be a positive"),
        (["--cpu", "--budget-s", "nan"], "--budget-s must be a positive"),
        (["--cpu", "--iters", "0"], "--iters, --bandwidth-mib and --interference-mib must be"),
        (["--cpu", "--model", "7b"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused(
    gpu_check: ModuleType,
    tmp_path: Path,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # in this process, through the script's main(): a fresh interpreter per case only
    # repeated the import of torch (the exit status of a run: the test below)
    with pytest.raises(SystemExit) as exited:
        gpu_check.main([*args, "--out", str(tmp_path)])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_without_cuda_it_asks_for_the_cpu_flag(tmp_path: Path) -> None:
    proc = run(["--out", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "pass --cpu" in proc.stderr


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def cuda_doc(ratio: float, stream_ms: float, meta_ms: float, dcp_ms: float) -> dict[str, Any]:
    def run_(blocked: float, meta: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"iters": 6, "iter_ms": 200.0, "overhead_ms": 1.0}
        out["blocked_ms"] = {"median": blocked, "n": 6}
        if meta is not None:
            out["snapshot_ms"] = {"median": meta, "n": 6}
        return out

    return {
        "device": {"kind": "cuda", "name": "a GPU"},
        "tests": {"summary": "12 passed", "returncode": 0},
        "bandwidth": {
            "bytes": 4 << 30,
            "ratio": ratio,
            "plain_gbps": {"median": 50.0},
            "lazyckpt_gbps": {"median": 50.0 * ratio},
        },
        "stall": {
            "model": "1.3b",
            "parameters": 1_300_000_000,
            "dtype": "torch.bfloat16",
            "state_bytes": 8 << 30,
            "runs": {
                "no_checkpoint": run_(0.0),
                "lazyckpt_stream": run_(stream_ms, meta_ms),
                "lazyckpt_cpu": {"error": "RuntimeError('x')"},
                "dcp_async_default": run_(dcp_ms),
            },
        },
        "path": "result.json",
    }


def test_the_verdict_follows_the_gpu_targets(gpu_check: ModuleType) -> None:
    good = gpu_check.targets(cuda_doc(ratio=0.85, stream_ms=3.5, meta_ms=3.0, dcp_ms=2000.0))
    assert good["evaluated"] is True
    assert good["capture_vs_plain_d2h"]["met"] is True
    assert good["stream_guard_stall"]["met"] is True  # 0.5 ms beyond the metadata
    assert good["dcp_default_over_lazyckpt_stream"]["value"] == pytest.approx(2000 / 3.5)
    assert good["dcp_default_over_lazyckpt_stream"]["met"] is True

    bad = gpu_check.targets(cuda_doc(ratio=0.6, stream_ms=8.0, meta_ms=3.0, dcp_ms=100.0))
    assert bad["capture_vs_plain_d2h"]["met"] is False
    assert bad["stream_guard_stall"]["met"] is False
    assert bad["dcp_default_over_lazyckpt_stream"]["met"] is False


def test_the_table_names_every_run_and_each_verdict(gpu_check: ModuleType) -> None:
    doc = cuda_doc(ratio=0.9, stream_ms=2.0, meta_ms=1.5, dcp_ms=900.0)
    doc["targets"] = gpu_check.targets(doc)
    text = gpu_check.table(doc)
    lines = text.splitlines()
    assert lines[0] == "lazyckpt GPU check on a GPU"
    assert "lazyckpt capture 45.00 GB/s (90%)" in text
    assert "1.30 B params" in text
    stream = next(line for line in lines if line.split()[:1] == ["lazyckpt_stream"])
    assert stream.split()[1:3] == ["2.00", "1.50"]
    assert any("lazyckpt_cpu" in line and "RuntimeError" in line for line in lines)
    assert sum(line.startswith("target ") and ": met" in line for line in lines) == 3
    assert lines[-1] == "written: result.json"
