"""Real model code, snapshotted every step with the guard on and resumed in a fresh process
from the middle: the losses after the resume are bit-identical to the uninterrupted run's,
and no snapshot failed.

Each setup is in ``recipes.py``: transformers' Llama and GPT-2 (tied embeddings) from configs,
a BatchNorm conv net with SGD momentum, GradScaler and OneCycleLR, torchdata's
StatefulDataLoader, a ``torch.compile``'d model, and FSDP2 on two gloo ranks through
``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.ranks import launch_ranks

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
STEPS = 8
RESUME_AT = 3  # the snapshot after step 3: the resumed run trains steps 4 to 7

pytestmark = pytest.mark.slow


def run_worker(args: list[str], timeout: float = 150) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(WORKER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def check(trained: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert trained["failures"] == []
    assert trained["committed"] == list(range(STEPS))
    assert len(resumed["losses"]) == STEPS - RESUME_AT - 1
    # bit for bit: the floats themselves, not a tolerance
    assert resumed["losses"] == trained["losses"][RESUME_AT + 1 :]


Trained = Callable[[str], tuple[Path, dict[str, Any]]]


@pytest.fixture(scope="module")
def trained() -> Iterator[Trained]:
    """The uninterrupted run of a recipe, once per recipe: its checkpoint and its result."""
    runs: dict[str, tuple[Path, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def get(recipe: str) -> tuple[Path, dict[str, Any]]:
            if recipe not in runs:
                root, out = Path(tmp) / recipe, Path(tmp) / f"{recipe}.json"
                run_worker([recipe, str(root), str(out), str(STEPS)])
                runs[recipe] = (root, json.loads(out.read_text()))
            return runs[recipe]

        yield get


@pytest.mark.parametrize(
    ("recipe", "resumed_as"),
    [
        ("llama", "llama"),
        ("gpt2", "gpt2"),
        ("convnet", "convnet"),
        ("dataloader", "dataloader"),
        ("compiled", "compiled"),
        ("compiled", "uncompiled"),  # _orig_mod. keys restored into the plain model
    ],
)
def test_resume_in_a_fresh_process_is_bit_identical(
    recipe: str, resumed_as: str, trained: Trained, tmp_path: Path
) -> None:
    root, result = trained(recipe)
    out = tmp_path / "resumed.json"
    run_worker([resumed_as, str(root), str(out), str(STEPS), str(RESUME_AT)])
    check(result, json.loads(out.read_text()))


def test_fsdp2_on_two_ranks_resumes_bit_identical(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    launch_ranks(WORKER, ["fsdp2", str(root), str(tmp_path / "trained.json"), str(STEPS)], 2)
    launch_ranks(
        WORKER,
        ["fsdp2", str(root), str(tmp_path / "resumed.json"), str(STEPS), str(RESUME_AT)],
        2,
    )
    for rank in (0, 1):
        trained = json.loads((tmp_path / f"trained.json.rank{rank}").read_text())
        resumed = json.loads((tmp_path / f"resumed.json.rank{rank}").read_text())
        check(trained, resumed)
