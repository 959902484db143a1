"""The stall of checkpointing every 1, 2, 4, 8 and 16 iterations: lazyckpt against DCP's
``async_save``, in one training loop, and where lazyckpt's remaining milliseconds go.

The loop and the methods are those of ``e2e.py`` (forward, backward, ``optimizer.step()``,
a checkpoint every ``k`` iterations; *stall* per checkpoint is the time inside the
checkpoint call plus the time blocked before the following ``optimizer.step()`` or before
the next save). Methods, alternating within each interval (``common.abab``) so that each
sees the same machine:

- ``none``: no checkpoint (the loop's floor);
- ``dcp_async``: ``dcp.async_save`` with its default stager, one save in flight;
- ``lazyckpt``: ``SyncCheckpointer([HostMemoryTier, FileTier])`` (the default FileTier,
  O_DIRECT) with ``guard(optimizer)``.

For lazyckpt each checkpoint's stall is also split: ``model.state_dict()`` and
``optimizer.state_dict()`` (called by ``snapshot()`` through the Stateful protocol), the
walk of the state, the planning, the rest of ``snapshot()`` (hand-off), and the guard's
wait before the next step. Between two checkpoints the forward and backward passes evict
the CPU caches, so the sparser the checkpoints, the colder the walk's tables: this is what
the split shows.

Two models: ``e2e`` (the default), the end-to-end benchmark's GPT (``E2EConfig.full()``,
91 M parameters, 1.02 GiB of parameters and AdamW moments in 593 tensors), the one the
stall target is stated on; ``small``, a 23 M-parameter GPT (0.26 GiB in 305 tensors),
faster, where DCP's staging copy, and so the yardstick, is four times shorter.

The *steady state* is what a training job pays at each checkpoint after its first: the
later checkpoints of every trial, pooled over the intervals of 2 iterations or more (every
iteration, DCP waits for its previous save, which is not its staging copy); its ratio,
lazyckpt's median stall over DCP's, is what the 1 % target is checked against.

Results: ``bench/results/stall-sweep-<machine>-<stamp>.json`` and ``.csv``, and with
``--img DIR`` a plot ``stall-sweep.png``.

    python bench/stall_sweep.py                  # the e2e model: 10-15 minutes on 2 vCPUs
    python bench/stall_sweep.py --model small    # about two minutes
    python bench/stall_sweep.py --quick          # a tiny model, seconds (the test's run)
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import REPO, GiB, Progress, abab, loadavg, machine_info, scratch_dir, summarize
from e2e import _CLASSES, E2EConfig, _free_port, _LazyDirect, _malloc_trim, _trial
from model import GPT, GPTConfig, adamw_state_bytes, random_batch

from lazyckpt._checkpointer import core as _core

INTERVALS = [1, 2, 4, 8, 16]
STEADY_FROM = 2  # intervals from which DCP's stall is its staging copy (see the docstring)
TARGET_PCT = 1.0  # lazyckpt's stall, at most this share of DCP async_save's
METHODS = ["none", "dcp_async", "lazyckpt"]
PARTS = ["model_state_dict", "optim_state_dict", "walk", "plan", "other", "guard"]


def iterations(every: int, quick: bool) -> int:
    """Iterations of one trial: at least three checkpoints (the first one is cold), and at
    least 8 iterations."""
    if quick:
        return 2 * every
    return max(8, 3 * every)


class _Timers:
    """Seconds spent in a few wrapped calls, per checkpoint."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def take(self) -> dict[str, float]:
        out, self.now = self.now, {}
        return out

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - t0

        return timed


class _LazySplit(_LazyDirect):
    """lazyckpt (default FileTier), with each snapshot's time split into its parts."""

    name = "lazyckpt"
    timers = _Timers()

    def setup(self) -> None:
        super().setup()
        self.parts: list[dict[str, float]] = []

    def state_dict(self) -> dict[str, Any]:  # not used: snapshot() takes the objects
        return super().state_dict()

    def checkpoint(self, step: int) -> None:
        timers = self.timers
        model_sd, opt_sd = self.model.state_dict, self.opt.state_dict
        # instance attributes shadow the methods for this one call only
        self.model.state_dict = timers.wrap("model_state_dict", model_sd)  # type: ignore[method-assign]
        self.opt.state_dict = timers.wrap("optim_state_dict", opt_sd)  # type: ignore[method-assign]
        t0 = time.perf_counter()
        try:
            super().checkpoint(step)
        finally:
            del self.model.state_dict, self.opt.state_dict
        total = time.perf_counter() - t0
        part = timers.take()
        # the walk's time includes the state_dict() calls it makes
        part["walk"] = part.get("walk", 0.0) - part.get("model_state_dict", 0.0) - part.get(
            "optim_state_dict", 0.0
        )
        part["other"] = total - sum(part.values())
        self.parts.append(part)


@contextmanager
def _split_core() -> Iterator[None]:
    """Time the walk and the planning inside ``snapshot()`` (module-level hooks, undone)."""
    timers = _LazySplit.timers
    module, core = vars(_core), _core._Core
    walk, plan = module["walk_state"], core._plan
    module["walk_state"] = timers.wrap("walk", walk)
    core._plan = timers.wrap("plan", plan)  # type: ignore[method-assign]
    try:
        yield
    finally:
        module["walk_state"] = walk
        core._plan = plan  # type: ignore[method-assign]


def _config(quick: bool, model: str) -> E2EConfig:
    if quick:
        return E2EConfig.quick()
    if model == "e2e":
        # the end-to-end benchmark's model and batch, 2 reps: an iteration ~0.5 s on 2 vCPUs
        return replace(E2EConfig.full(), reps=2)
    # ~23 M parameters: params + AdamW moments ~= 0.26 GiB in 75 tensors per moment, an
    # iteration ~0.1-0.3 s on 2 loaded vCPUs: the sweep fits in about two minutes
    return E2EConfig(
        model=GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512),
        batch=1,
        seq=64,
        iters_every1=8,
        every_k=8,
        iters_every_k=16,
        reps=2,
    )


def run(
    quick: bool,
    tmp: Path,
    progress: Progress,
    reps: int | None,
    model_name: str = "e2e",
    intervals: list[int] | None = None,
) -> dict[str, Any]:
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    cfg = _config(quick, model_name)
    reps = reps or cfg.reps
    intervals = intervals or INTERVALS
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(cfg.model, cfg.batch, cfg.seq, gen)

    for _ in range(3):  # creates the AdamW moments
        x, y = data()
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    ckpt_bytes = adamw_state_bytes(model)
    n_tensors = len(model.state_dict()) + sum(len(s) for s in opt.state_dict()["state"].values())
    progress(f"  checkpoint {ckpt_bytes / GiB:.2f} GiB in {n_tensors} tensors")
    classes = {**_CLASSES, "lazyckpt": _LazySplit}

    import torch.distributed as dist

    own_pg = False
    if dist.is_available() and not dist.is_initialized():
        dist.init_process_group(
            "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}"
        )
        own_pg = True
    rows: list[dict[str, Any]] = []
    try:
        with _split_core():
            for every in intervals:
                iters = iterations(every, quick)
                trials: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
                for rep, name in abab(METHODS, reps):
                    root = tmp / f"every{every}-{name}-{rep}"
                    root.mkdir(parents=True)
                    _malloc_trim()
                    os.sync()
                    method = classes[name](root, model, opt, ckpt_bytes)
                    result = _trial(method, cfg, every, iters, data)
                    if isinstance(method, _LazySplit):
                        result["parts"] = method.parts
                    trials[name].append(result)
                    shutil.rmtree(root, ignore_errors=True)
                rows.append(_row(every, iters, trials))
                r = rows[-1]
                progress(
                    f"  every {every:2d}: stall lazyckpt {r['lazyckpt_stall_ms']:.2f} ms, "
                    f"dcp_async {r['dcp_async_stall_ms']:.1f} ms ({r['ratio_pct']:.2f} %); "
                    f"first of a trial {r['lazyckpt_first_stall_ms']:.2f} / "
                    f"{r['dcp_async_first_stall_ms']:.1f} ms, later ones "
                    f"{r['lazyckpt_later_stall_ms']:.2f} / {r['dcp_async_later_stall_ms']:.1f} ms "
                    f"({r['later_ratio_pct']:.2f} %); "
                    f"loop over none: lazyckpt {r['lazyckpt_loop_overhead_pct']:+.1f} %, "
                    f"dcp {r['dcp_async_loop_overhead_pct']:+.1f} %"
                )
    finally:
        if own_pg:
            dist.destroy_process_group()
    steady = _steady(rows)
    progress(
        f"  steady state (later checkpoints, every {STEADY_FROM}+): lazyckpt "
        f"{steady['lazyckpt_ms']:.2f} ms, dcp_async {steady['dcp_async_ms']:.1f} ms "
        f"({steady['ratio_pct']:.2f} %, target {TARGET_PCT:g} %: "
        f"{'met' if steady['met'] else 'missed'}); first checkpoints "
        f"{steady['lazyckpt_first_ms']:.2f} / {steady['dcp_async_first_ms']:.1f} ms"
    )
    return {
        "config": {
            "model_name": "quick" if quick else model_name,
            "model": vars(cfg.model),
            "checkpoint_bytes": ckpt_bytes,
            "tensors": n_tensors,
            "reps": reps,
            "intervals": intervals,
        },
        "rows": rows,
        "steady_state": steady,
    }


def _steady(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The later checkpoints of every trial at intervals of ``STEADY_FROM`` or more, pooled
    (and the first ones apart): medians and lazyckpt's ratio to DCP's."""

    def pooled(name: str, first: bool) -> float:
        xs = [
            s
            for r in rows
            if r["every"] >= STEADY_FROM
            for t in r["trials"][name]
            for s in (t["stalls_s"][:1] if first else t["stalls_s"][1:])
        ]
        return float(summarize(xs)["median"]) * 1e3 if xs else float("nan")

    lazy, dcp = pooled("lazyckpt", False), pooled("dcp_async", False)
    ratio = 100 * lazy / dcp if dcp else float("nan")
    return {
        "from_every": STEADY_FROM,
        "lazyckpt_ms": lazy,
        "dcp_async_ms": dcp,
        "ratio_pct": ratio,
        "lazyckpt_first_ms": pooled("lazyckpt", True),
        "dcp_async_first_ms": pooled("dcp_async", True),
        "target_pct": TARGET_PCT,
        "met": bool(ratio <= TARGET_PCT),
    }


def _row(every: int, iters: int, trials: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def stall(name: str) -> float:
        return float(summarize([s for t in trials[name] for s in t["stalls_s"]])["median"])

    def loop(name: str) -> float:
        return float(summarize([t["loop_s"] for t in trials[name]])["median"])

    def split(first: bool) -> dict[str, float]:
        # the first checkpoint of a trial is a new Checkpointer's first snapshot: its key
        # cache, plan cache and optimizer pointer cache are empty (cold); the others reuse
        # them (warm)
        parts, guards = [], []
        for t in trials["lazyckpt"]:
            pairs = list(zip(t["stalls_s"], t["parts"], strict=True))
            for s, p in pairs[:1] if first else pairs[1:]:
                parts.append(p)
                guards.append(s - sum(p.values()))
        out = {k: summarize([p.get(k, 0.0) for p in parts])["median"] * 1e3 for k in PARTS[:-1]}
        out["guard"] = summarize(guards)["median"] * 1e3
        return out

    def later(name: str, first: bool) -> float:
        xs = [s for t in trials[name] for s in (t["stalls_s"][:1] if first else t["stalls_s"][1:])]
        return float(summarize(xs)["median"])

    lazy, dcp = stall("lazyckpt"), stall("dcp_async")
    lazy_warm, dcp_warm = later("lazyckpt", False), later("dcp_async", False)
    floor = loop("none")
    return {
        "every": every,
        "iterations": iters,
        "checkpoints_per_trial": iters // every,
        "lazyckpt_stall_ms": lazy * 1e3,
        "dcp_async_stall_ms": dcp * 1e3,
        "ratio_pct": 100 * lazy / dcp if dcp else float("nan"),
        "lazyckpt_first_stall_ms": later("lazyckpt", True) * 1e3,
        "dcp_async_first_stall_ms": later("dcp_async", True) * 1e3,
        "lazyckpt_later_stall_ms": lazy_warm * 1e3,
        "dcp_async_later_stall_ms": dcp_warm * 1e3,
        "later_ratio_pct": 100 * lazy_warm / dcp_warm if dcp_warm else float("nan"),
        "lazyckpt_split_ms": split(False),
        "lazyckpt_first_split_ms": split(True),
        "lazyckpt_loop_overhead_pct": 100 * (loop("lazyckpt") / floor - 1),
        "dcp_async_loop_overhead_pct": 100 * (loop("dcp_async") / floor - 1),
        "trials": trials,
    }


def write_csv(doc: dict[str, Any], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["every", "lazyckpt_stall_ms", "dcp_async_stall_ms", "ratio_pct",
             "lazyckpt_first_stall_ms", "dcp_async_first_stall_ms", "lazyckpt_later_stall_ms",
             "dcp_async_later_stall_ms", "later_ratio_pct"]
            + [f"later_{p}_ms" for p in PARTS]
            + [f"first_{p}_ms" for p in PARTS]
            + ["lazyckpt_loop_overhead_pct", "dcp_async_loop_overhead_pct"]
        )
        for r in doc["results"]["rows"]:
            w.writerow(
                [r["every"]]
                + [f"{r[k]:.3f}" for k in (
                    "lazyckpt_stall_ms", "dcp_async_stall_ms", "ratio_pct",
                    "lazyckpt_first_stall_ms", "dcp_async_first_stall_ms",
                    "lazyckpt_later_stall_ms", "dcp_async_later_stall_ms", "later_ratio_pct")]
                + [f"{r['lazyckpt_split_ms'][p]:.3f}" for p in PARTS]
                + [f"{r['lazyckpt_first_split_ms'][p]:.3f}" for p in PARTS]
                + [f"{r['lazyckpt_loop_overhead_pct']:.2f}", f"{r['dcp_async_loop_overhead_pct']:.2f}"]
            )


def write_plot(doc: dict[str, Any], img_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]["rows"]
    xs = [r["every"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(xs, [r["dcp_async_stall_ms"] for r in rows], "o-", label="DCP async_save")
    a.plot(xs, [r["lazyckpt_stall_ms"] for r in rows], "o-", label="lazyckpt")
    a.plot(xs, [r["lazyckpt_first_stall_ms"] for r in rows], "x--", label="lazyckpt, first")
    a.plot(xs, [r["lazyckpt_later_stall_ms"] for r in rows], "x:", label="lazyckpt, later")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("checkpoint every k iterations")
    a.set_ylabel("stall per checkpoint, median (ms)")
    a.legend()
    steady = doc["results"].get("steady_state")
    model = doc["results"]["config"].get("model_name", "")
    title = f"stall per checkpoint ({model} model)"
    if steady is not None:
        title += f"\nsteady state: {steady['lazyckpt_ms']:.2f} / {steady['dcp_async_ms']:.0f} ms"
        title += f" = {steady['ratio_pct']:.2f} %"
    a.set_title(title, fontsize=9)
    labels = [f"{x}\nfirst" for x in xs] + [f"{x}\nlater" for x in xs]
    bottom = [0.0] * len(labels)
    for part in PARTS:
        values = [r["lazyckpt_first_split_ms"][part] for r in rows]
        values += [r["lazyckpt_split_ms"][part] for r in rows]
        b.bar(labels, values, bottom=bottom, label=part)
        bottom = [p + v for p, v in zip(bottom, values, strict=True)]
    b.tick_params(axis="x", labelsize=7)
    b.set_xlabel("checkpoint every k iterations: a trial's first checkpoint, the later ones")
    b.set_ylabel("ms (medians per part)")
    b.set_title("lazyckpt's stall, split")
    b.legend(fontsize=7)
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "stall-sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, one rep")
    parser.add_argument(
        "--model",
        choices=["e2e", "small"],
        default="e2e",
        help="e2e: the end-to-end benchmark's 91 M-parameter GPT (the target's); small: 23 M",
    )
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument(
        "--intervals",
        type=lambda text: [int(k) for k in text.split(",")],
        default=None,
        help="comma-separated checkpoint intervals (default 1,2,4,8,16)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--img", type=Path, default=None, help="write the plot there")
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args()
    progress = Progress()
    started = dt.datetime.now(dt.UTC)
    load_before = loadavg()
    with scratch_dir(args.tmp, "stall-sweep-") as tmp:
        results = run(
            args.quick, tmp, progress, 1 if args.quick else args.reps, args.model, args.intervals
        )
    doc = {
        "schema": 1,
        "benchmark": "stall_sweep",
        "quick": args.quick,
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg_before": load_before,
        "loadavg_after": loadavg(),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"stall-sweep-{doc['machine']['slug']}-{started.strftime('%Y%m%d-%H%M%S')}"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    write_csv(doc, args.out / f"{stem}.csv")
    progress(f"wrote {args.out / stem}.json and .csv")
    if args.img is not None:
        progress(f"wrote {write_plot(doc, args.img)}")


if __name__ == "__main__":
    _main()
