"""Every file in examples/ runs, as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=EXAMPLES.parent
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_train_gpt_demo_small() -> None:
    out = run(str(EXAMPLES / "train_gpt.py"), "--steps", "12", "--every", "4", "--layers", "1", "--width", "32")
    assert "losses identical bit for bit" in out
    assert "-> file" in out


def test_custom_tier_example() -> None:
    out = run(str(EXAMPLES / "custom_tier.py"))
    assert "restored bit for bit" in out


def test_lora_incremental_example() -> None:
    for mode in ("true", "versions"):
        out = run(str(EXAMPLES / "lora_incremental.py"), "--mode", mode, "--layers", "2", "--steps", "8")
        assert "every kept step restored bit for bit (5 steps)" in out
        assert "retired: ['step-000000000000']" in out


def test_multilevel_example() -> None:
    out = run(str(EXAMPLES / "multilevel.py"), "--steps", "25")
    assert "restored step 25 from the slow tier alone: bit for bit True" in out
    assert "KEPT BECAUSE" in out and "best 3 by val_loss" in out


def test_every_example_is_covered() -> None:
    covered = {"train_gpt.py", "custom_tier.py", "lora_incremental.py", "multilevel.py"}
    present = {p.name for p in EXAMPLES.glob("*.py")}
    assert present <= covered | _covered_elsewhere(), present - covered


def _covered_elsewhere() -> set[str]:
    # examples exercised by their own test files
    tests = Path(__file__).parent
    return {p.name for p in EXAMPLES.glob("*.py") if any(p.stem in t.read_text() for t in tests.rglob("test_*.py") if t.name != "test_examples.py")}
