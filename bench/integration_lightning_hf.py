"""What a checkpoint costs the training loop of PyTorch Lightning and of the Hugging Face
Trainer, lazyckpt against each framework's default, side by side in one run.

- **Lightning**: ``ModelCheckpoint(every_n_train_steps=K)`` saving through the default
  ``TorchCheckpointIO`` (``torch.save``), through Lightning's own ``AsyncCheckpointIO``
  (``torch.save`` on a thread after cloning every tensor), and through ``LazyCheckpointIO``
  (host memory, then a local directory); and no checkpointing at all.
- **Hugging Face**: the Trainer's own save (``save_strategy="steps"``: safetensors weights,
  ``optimizer.pt``, scheduler, RNG, ``trainer_state.json``) against
  ``LazyCheckpointCallback`` on the same schedule; and no checkpointing.

Each step is timed from its start to the next step's start, so a save at the end of a step
is in that step. ``per checkpoint`` is what a checkpoint adds to the loop: the median of
(the saving step + the step after it, where a lazy capture overlaps and the guard may
wait) minus two median steps away from checkpoints in the same runs; the run without
checkpoints, measured the same way, gives the noise floor. ``save call`` is the time
spent inside the framework's save call itself; ``guard`` the time lazyckpt's
optimizer-step hook waited for a capture. ``drain`` is what the end of training waited for
lazyckpt's last snapshots to become durable (outside the loop; the default savers have
nothing left to wait for, although ``torch.save`` leaves its bytes in the page cache
unsynced, while lazyckpt's file tier fsyncs). Methods alternate within each repetition;
figures are medians over repetitions.

    python bench/integration_lightning_hf.py                # 32 MiB models, 2 repetitions
    python bench/integration_lightning_hf.py --mb 4 --reps 1 --only hf
"""

from __future__ import annotations

import os
import sys

# Before torch loads OpenMP: on a machine whose cores are shared with other work, OpenMP's
# default spin-waiting makes every step many times slower, and how much depends on how many
# threads run torch operations (lazyckpt's copy threads change it). Passive waiting takes
# that artefact out of the comparison; ``--spin`` puts it back.
if "--spin" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import datetime as dt
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, Progress, abab, loadavg, machine_info, scratch_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")  # the frameworks' advice for real runs is noise here
for name in ("pytorch_lightning", "lightning", "transformers"):
    logging.getLogger(name).setLevel(logging.ERROR)

from tiers import FileTier, HostMemoryTier  # noqa: E402

STEPS, EVERY = 18, 4  # checkpoints at steps 4, 8, 12 and 16, all inside the loop


# -- Lightning -----------------------------------------------------------------------------


def lightning_run(method: str, root: Path, width: int, batch: int) -> dict[str, Any]:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lazyckpt.integrations.lightning import LazyCheckpointIO

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1),
            )

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(b[0]), b[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> DataLoader[Any]:
            x = torch.randn(STEPS * batch, width)
            return DataLoader(TensorDataset(x, x[:, :1]), batch_size=batch)

    marks = StepMarks()

    class Marks(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            marks.start()

        def on_train_batch_end(self, *args: Any) -> None:
            pass  # ModelCheckpoint saves after this hook; the next start closes the step

        def on_train_end(self, *args: Any) -> None:
            marks.end()

    plugins: list[Any] = []
    io: Any = None
    if method == "torch":
        io = Timed(pl.plugins.TorchCheckpointIO())
    elif method == "async":
        io = Timed(pl.plugins.AsyncCheckpointIO(pl.plugins.TorchCheckpointIO()))
    elif method == "lazyckpt":
        io = TimedLazyIO(LazyCheckpointIO)(
            [HostMemoryTier(arena_bytes(width)), FileTier(root / "store")]
        )
    callbacks: list[Any] = [Marks()]
    if io is not None:
        plugins.append(io)
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=str(root / "ckpts"), every_n_train_steps=EVERY, save_top_k=-1
        ))
        if method == "lazyckpt":
            callbacks.insert(0, io)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), plugins=plugins,
        callbacks=callbacks, enable_checkpointing=io is not None,
    )
    t0 = time.perf_counter()
    trainer.fit(Net())
    total = time.perf_counter() - t0
    out = {
        "loop_s": marks.loop_s(),
        "steps_s": marks.durations(),
        "drain_s": max(0.0, total - marks.total_from(t0)),
    }
    if io is not None:
        out["save_call_s"] = io.save_s
        out["saves"] = io.saves
    if method == "lazyckpt":
        out["guard_s"] = sum(s["guard_s"] for s in io.checkpointer.metrics()["snapshots"])
        io.close()
    return out


# -- Hugging Face --------------------------------------------------------------------------


def hf_run(method: str, root: Path, width: int, batch: int) -> dict[str, Any]:
    import transformers

    from lazyckpt.integrations.huggingface import LazyCheckpointCallback

    marks = StepMarks()
    saves = {"s": 0.0, "n": 0}

    class Marks(transformers.TrainerCallback):
        def on_step_begin(self, *args: Any, **kw: Any) -> None:
            marks.start()

        def on_train_end(self, *args: Any, **kw: Any) -> None:
            marks.end()

    class TimedTrainer(transformers.Trainer):
        def _save_checkpoint(self, *args: Any, **kw: Any) -> None:
            t = time.perf_counter()
            super()._save_checkpoint(*args, **kw)
            saves["s"] += time.perf_counter() - t
            saves["n"] += 1

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=512, n_positions=16, n_embd=width, n_layer=4, n_head=8
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (STEPS * batch, 16))
    data = [{"input_ids": r, "labels": r} for r in ids]
    callbacks: list[Any] = [Marks()]
    cb: Any = None
    if method == "lazyckpt":
        cb = TimedLazyCallback(LazyCheckpointCallback)(
            [HostMemoryTier(arena_bytes(width, hf=True)), FileTier(root / "store")]
        )
        callbacks.append(cb)
    args = transformers.TrainingArguments(
        output_dir=str(root / "out"), per_device_train_batch_size=batch, num_train_epochs=1,
        save_strategy="no" if method == "none" else "steps", save_steps=EVERY,
        logging_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, seed=0,
    )
    trainer = TimedTrainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    out: dict[str, Any] = {
        "loop_s": marks.loop_s(),
        "steps_s": marks.durations(),
        "drain_s": max(0.0, total - marks.total_from(t0)),
    }
    if method == "trainer":
        out["save_call_s"], out["saves"] = saves["s"], saves["n"]
    if cb is not None:
        out["save_call_s"], out["saves"] = cb.save_s, cb.saves
        out["guard_s"] = sum(s["guard_s"] for s in cb.checkpointer.metrics()["snapshots"])
        cb.close()
    return out


# -- timing helpers ------------------------------------------------------------------------


class StepMarks:
    """Start times of the steps and the end of the last one."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.stop = 0.0

    def start(self) -> None:
        self.starts.append(time.perf_counter())

    def end(self) -> None:
        self.stop = time.perf_counter()

    def loop_s(self) -> float:
        # from the second step: the first one carries the frameworks' warm-up
        return self.stop - self.starts[1]

    def durations(self) -> list[float]:
        """Each step's time, start to the next start (a save at a step's end is in it)."""
        ends = [*self.starts[1:], self.stop]
        return [b - a for a, b in zip(self.starts, ends, strict=True)]

    def total_from(self, t0: float) -> float:
        return self.stop - t0


class Timed:
    """A CheckpointIO wrapper timing the save call (delegates everything)."""

    def __init__(self, inner: Any) -> None:
        import pytorch_lightning as pl

        self.__class__ = type("TimedIO", (Timed, pl.plugins.CheckpointIO), {})
        self.inner, self.save_s, self.saves = inner, 0.0, 0

    def save_checkpoint(self, *args: Any, **kw: Any) -> None:
        t = time.perf_counter()
        self.inner.save_checkpoint(*args, **kw)
        self.save_s += time.perf_counter() - t
        self.saves += 1

    def load_checkpoint(self, *args: Any, **kw: Any) -> Any:
        return self.inner.load_checkpoint(*args, **kw)

    def remove_checkpoint(self, *args: Any, **kw: Any) -> None:
        self.inner.remove_checkpoint(*args, **kw)

    def teardown(self) -> None:
        self.inner.teardown()


def TimedLazyIO(cls: type) -> Callable[..., Any]:
    class TimedLazy(cls):  # type: ignore[misc]
        save_s, saves = 0.0, 0

        def save_checkpoint(self, *args: Any, **kw: Any) -> None:
            t = time.perf_counter()
            super().save_checkpoint(*args, **kw)
            self.save_s += time.perf_counter() - t
            self.saves += 1

    return TimedLazy


def TimedLazyCallback(cls: type) -> Callable[..., Any]:
    class TimedLazy(cls):  # type: ignore[misc]
        save_s, saves = 0.0, 0

        def _snapshot(self, *args: Any, **kw: Any) -> None:
            t = time.perf_counter()
            super()._snapshot(*args, **kw)
            self.save_s += time.perf_counter() - t
            self.saves += 1

    return TimedLazy


def arena_bytes(width: int, hf: bool = False) -> int:
    """Host memory for two snapshots of the model and its AdamW state, with room."""
    params = (48 * width * width + 600 * width) if hf else 3 * width * width
    return max(64 << 20, int(params * 4 * 3 * 2.5))


# -- driver --------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=32, help="model parameters, MiB (fp32)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--only", choices=["lightning", "hf"], default=None)
    ap.add_argument("--tmp", default=None, help="scratch parent (default: runs/)")
    ap.add_argument("--spin", action="store_true", help="keep OpenMP's default spin-waiting")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = ap.parse_args()
    progress = Progress()
    # Lightning: 3 square layers (3 width^2); GPT-2 with 4 layers: 12 width^2 each
    pl_width = int((a.mb * 2**20 / 4 / 3) ** 0.5) // 64 * 64
    hf_width = int((a.mb * 2**20 / 4 / 48) ** 0.5) // 64 * 64
    suites: dict[str, tuple[Callable[..., dict[str, Any]], list[str], int]] = {
        "lightning": (lightning_run, ["none", "torch", "async", "lazyckpt"], pl_width),
        "hf": (hf_run, ["none", "trainer", "lazyckpt"], hf_width),
    }
    result: dict[str, Any] = {
        "machine": machine_info(), "load_start": loadavg(), "mb": a.mb, "steps": STEPS,
        "every": EVERY, "reps": a.reps, "date": dt.datetime.now(dt.UTC).isoformat(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
    }
    for suite, (run, methods, width) in suites.items():
        if a.only and a.only != suite:
            continue
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for rep, method in abab(methods, a.reps + 1):
            with scratch_dir(a.tmp, f"bench-{suite}-") as root:
                r = run(method, root, width, a.batch)
            if rep > 0:  # the first round warms up imports and caches
                runs[method].append(r)
            progress(f"{suite} {method:9s} rep {rep}: loop {r['loop_s']:.2f}s "
                     f"save {r.get('save_call_s', 0):.2f}s drain {r['drain_s']:.2f}s")
        params = 3 * width * width if suite == "lightning" else 48 * width * width
        result[suite] = {
            "width": width, "param_mib": round(params * 4 / 2**20, 1),
            "checkpoint_mib": round(3 * params * 4 / 2**20, 1),  # with AdamW's two moments
            "runs": runs, "summary": summarize(runs),
        }
    result["load_end"] = loadavg()
    print(table(result))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"integrations-{result['machine']['slug']}-{dt.date.today().isoformat()}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    progress(f"wrote {out / name}")
    return 0


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per method: the median step without a checkpoint nearby, and what a checkpoint adds
    to the loop: the step that saves plus the one after it (where a lazy capture overlaps
    and the guard may wait), minus two median steps of the same runs. Comparing within a
    run keeps the shared machine's drifts between runs out; the ``none`` row, measured the
    same way at the same steps, is the noise floor."""
    saving = set(range(EVERY, STEPS + 1, EVERY))  # 1-based steps that end in a save
    out = {}
    for method, rs in runs.items():
        quiet = [
            d for r in rs for i, d in enumerate(r["steps_s"][1:], start=2)
            if i not in saving and i - 1 not in saving
        ]
        pairs = [
            r["steps_s"][k - 1] + r["steps_s"][k] for r in rs for k in sorted(saving)
            if k < len(r["steps_s"])
        ]
        step = statistics.median(quiet)
        row = {
            "step_s": step,
            "per_checkpoint_s": statistics.median(pairs) - 2 * step,
            "loop_s": statistics.median(r["loop_s"] for r in rs),
            "drain_s": statistics.median(r["drain_s"] for r in rs),
        }
        saves = rs[0].get("saves", 0)
        if saves:
            row["saves"] = saves
            row["save_call_s"] = statistics.median(r["save_call_s"] / saves for r in rs)
        if "guard_s" in rs[0]:
            row["guard_s"] = statistics.median(r["guard_s"] / saves for r in rs)
        out[method] = row
    return out


def table(result: dict[str, Any]) -> str:
    lines = []
    for suite in ("lightning", "hf"):
        if suite not in result:
            continue
        lines += [
            f"\n{suite} (width {result[suite]['width']}: checkpoints of "
            f"~{result[suite]['checkpoint_mib']} MiB every {EVERY} of {STEPS} steps)",
            "| method | median step s | per checkpoint s | save call s | guard s | drain s |",
            "|---|---|---|---|---|---|",
        ]
        for method, row in result[suite]["summary"].items():
            def f(key: str, row: dict[str, float] = row) -> str:
                return f"{row[key]:.3f}" if key in row else "-"
            lines.append(
                f"| {method} | {f('step_s')} | {f('per_checkpoint_s')} | {f('save_call_s')} "
                f"| {f('guard_s')} | {f('drain_s')} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
