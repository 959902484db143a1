"""``snapshot()``, the manifest and ``restore()`` against the number of tensors (1,000 to
100,000 tiny ones), next to the time DCP spends planning a save of the same states.

Each tensor holds 16 float32 values, so the bytes stay negligible and only the count varies.
For each count, in one process:

- ``snapshot()`` (with ``eager_bytes=0``: every tensor left to the capture, as a guarded
  optimizer's parameters and state are) cold (a new Checkpointer and a state whose keys this process has never
  seen: every cache empty) and warm (the same state again, as every training step does),
  in µs per tensor (the warm one also in CPU time of the calling thread, which moves
  less with the machine's load), with the garbage collector's collections per generation
  and the time it spent during the call (``gc.callbacks``), and the Python function calls per tensor of
  one warm call under ``cProfile`` (a count, so it does not depend on the machine's load),
  the collector's seconds over whole cycles (``snapshot()`` until committed), and a warm
  call with the default eager policy (every tiny tensor copied at once);
- the manifest a FileTier commits: its size on disk, the time to read and parse it back
  (``tier.read_manifest``) and to encode it;
- ``restore()`` from that FileTier into new tensors and into existing ones (``into=``), in
  µs per tensor (the page cache is warm: the bytes are a few MiB, the overhead is the point);
- DCP: the time ``dcp.save`` and ``dcp.async_save`` spend in their planner
  (``set_up_planner``, ``create_local_plan``, ``create_global_plan``, ``finish_plan``,
  timed by a planner subclass), the time ``dcp.async_save`` blocks, and the size of DCP's
  metadata file.

The machine these runs are made on is shared, so absolute times move by tens of percent
from run to run; the call counts and the ratios within one run are the steadier figures.

    python bench/many_tensors.py                       # 1,000 to 100,000 tensors (minutes)
    python bench/many_tensors.py --quick               # 1,000 and 3,000 (seconds)
    python bench/many_tensors.py --profile 100000      # cProfile of one warm snapshot()
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import gc
import io
import json
import pstats
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import REPO, Progress, loadavg, machine_info, scratch_dir, summarize

import lazyckpt
from tiers import FileTier, HostMemoryTier

COUNTS = [1000, 3000, 10000, 30000, 100000]
QUICK_COUNTS = [1000, 3000]
NUMEL = 16  # float32 values per tensor: 64 bytes

# single-process DCP warns that it runs without a process group, and about its async API
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")


def make_state(n: int, prefix: str) -> dict[str, Any]:
    """``n`` tiny tensors in the nesting of an unflattened optimizer state: ``n // 2``
    parameters under ``model`` and, per parameter, an ``exp_avg`` under ``optim``.

    ``prefix`` makes the keys new to this process, so that a cold snapshot meets no cache.
    """
    params = n // 2
    model = {f"{prefix}.layers.{i}.weight": torch.zeros(NUMEL) for i in range(params)}
    optim = {i: {"exp_avg": torch.zeros(NUMEL)} for i in range(n - params)}
    return {"model": model, "optim": {"state": optim, "param_groups": [{"lr": 1e-3}]}, "step": 0}


class GcWatch:
    """Collections per generation and seconds spent collecting while it is active."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1

    @contextmanager
    def active(self) -> Iterator[None]:
        gc.callbacks.append(self._callback)
        try:
            yield
        finally:
            gc.callbacks.remove(self._callback)


def calls_per_tensor(fn: Callable[[], Any], n: int) -> tuple[float, str]:
    """Python function calls per tensor of one call of ``fn``, and cProfile's top entries."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return total / n, text.getvalue()


# -- lazyckpt --------------------------------------------------------------------------------


async def _lazy(n: int, tmp: Path, reps: int, progress: Progress) -> dict[str, Any]:
    state = make_state(n, f"c{n}")
    root = tmp / f"lazy-{n}"
    out: dict[str, Any] = {"tensors": n}
    cold_s: float
    warm: list[float] = []
    warm_cpu: list[float] = []  # CPU seconds of the calling thread: steadier under load
    watches: list[GcWatch] = []
    # eager_bytes=0: every tensor is left to the capture, as the parameters and optimizer
    # state a guarded optimizer owns are; the default policy's copies are measured below
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(capacity_bytes=256 << 20), FileTier(root, keep_last=1)], eager_bytes=0
    ) as ckpt:
        gc.collect()
        cold_watch = GcWatch()
        with cold_watch.active():
            t0 = time.perf_counter()
            h = await ckpt.snapshot(state, step=0)
            cold_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        await h.committed()
        out["cold_to_durable_s"] = time.perf_counter() - t0
        cycle = GcWatch()  # the collector over whole cycles: snapshot() until committed
        for step in range(1, reps + 1):
            watch = GcWatch()
            with cycle.active():
                with watch.active():
                    c0, t0 = time.thread_time(), time.perf_counter()
                    h = await ckpt.snapshot(state, step=step)
                    warm.append(time.perf_counter() - t0)
                    warm_cpu.append(time.thread_time() - c0)
                watches.append(watch)
                await h.committed()
        handles: list[lazyckpt.SnapshotHandle] = []

        def one_snapshot() -> None:
            # Checkpointer.snapshot() is a coroutine around this synchronous call
            handles.append(ckpt._core.snapshot(state, reps + 1))

        calls, top = calls_per_tensor(one_snapshot, n)
        await handles[0].committed()
        out["snapshot_calls_per_tensor"] = calls
        out["snapshot_profile_top"] = top
    # the default policy: tensors no guarded optimizer owns, up to 1 MiB, are copied at once
    default: list[float] = []
    async with lazyckpt.Checkpointer([HostMemoryTier(capacity_bytes=256 << 20)]) as ckpt:
        for step in range(3):
            t0 = time.perf_counter()
            h = await ckpt.snapshot(state, step=step)
            default.append(time.perf_counter() - t0)
            await h.committed()
    out["snapshot_default_policy_warm_us_per_tensor"] = min(default[1:]) / n * 1e6
    out["snapshot_cold_us_per_tensor"] = cold_s / n * 1e6
    out["snapshot_cold_gc"] = {"collections": cold_watch.collections, "s": cold_watch.seconds}
    out["snapshot_warm_s"] = summarize(warm)
    out["snapshot_warm_us_per_tensor"] = summarize([w / n * 1e6 for w in warm])
    out["snapshot_warm_cpu_us_per_tensor"] = summarize([w / n * 1e6 for w in warm_cpu])
    out["snapshot_warm_gc"] = {
        "collections_per_call": [sum(w.collections[g] for w in watches) / reps for g in range(3)],
        "s_per_call": sum(w.seconds for w in watches) / reps,
        "s_per_cycle": cycle.seconds / reps,
    }
    progress(
        f"  {n} tensors: snapshot() cold {out['snapshot_cold_us_per_tensor']:.2f} µs/tensor, "
        f"warm {out['snapshot_warm_us_per_tensor']['median']:.2f} µs/tensor "
        f"({out['snapshot_warm_cpu_us_per_tensor']['median']:.2f} of CPU), "
        f"{calls:.1f} calls/tensor, gc {out['snapshot_warm_gc']['s_per_call'] * 1e3:.1f} ms/call, "
        f"{out['snapshot_warm_gc']['s_per_cycle'] * 1e3:.1f} ms/cycle; default eager policy "
        f"{out['snapshot_default_policy_warm_us_per_tensor']:.2f} µs/tensor"
    )

    # the manifest, as the file tier committed it; read back by a second (read-only) tier
    committed = max(int(p.name[5:]) for p in root.glob("step-*"))
    man_path = next(root.glob(f"step-{committed:012d}/manifest*"))
    out["manifest_bytes"] = man_path.stat().st_size
    out["manifest_file"] = man_path.name
    reader = FileTier(root, readonly=True)
    await reader.open()
    parse: list[float] = []
    manifest = None
    for _ in range(3):
        t0 = time.perf_counter()
        manifest = await reader.read_manifest(committed)
        parse.append(time.perf_counter() - t0)
    assert manifest is not None
    encode: list[float] = []
    for _ in range(3):
        t0 = time.perf_counter()
        manifest.to_json()
        encode.append(time.perf_counter() - t0)
    await reader.aclose()
    raw = man_path.read_bytes()
    out["manifest_parse_calls_per_tensor"], _ = calls_per_tensor(
        lambda: lazyckpt.Manifest.from_json(raw), n
    )
    out["manifest_read_s"] = summarize(parse)
    out["manifest_read_us_per_tensor"] = summarize(parse)["median"] / n * 1e6
    out["manifest_encode_s"] = summarize(encode)
    progress(
        f"  {n} tensors: manifest {out['manifest_bytes'] / 1e6:.2f} MB, read+parse "
        f"{out['manifest_read_us_per_tensor']:.2f} µs/tensor, "
        f"{out['manifest_parse_calls_per_tensor']:.1f} calls/tensor"
    )

    # restore: the bytes are a few MiB and in the page cache; the per-tensor work is measured
    template = make_state(n, f"c{n}")
    restore_new: list[float] = []
    restore_into: list[float] = []
    async with lazyckpt.Checkpointer([FileTier(root, readonly=True)]) as rd:
        for _ in range(2):
            gc.collect()
            t0 = time.perf_counter()
            got = await rd.restore(committed)
            restore_new.append(time.perf_counter() - t0)
            del got
            gc.collect()
            t0 = time.perf_counter()
            await rd.restore(committed, into=template)
            restore_into.append(time.perf_counter() - t0)
    out["restore_s"] = summarize(restore_new)
    out["restore_into_s"] = summarize(restore_into)
    out["restore_us_per_tensor"] = summarize(restore_new)["median"] / n * 1e6
    out["restore_into_us_per_tensor"] = summarize(restore_into)["median"] / n * 1e6
    progress(
        f"  {n} tensors: restore {out['restore_us_per_tensor']:.1f} µs/tensor, "
        f"into= {out['restore_into_us_per_tensor']:.1f} µs/tensor"
    )
    return out


# -- DCP ---------------------------------------------------------------------------------------


def _timed_planner(base: type) -> type:
    """A subclass of DCP's planner ``base`` that adds up the seconds of its planning calls."""

    class Timed(base):  # type: ignore[misc, valid-type]
        seconds = 0.0

        def _timed(self, name: str, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return getattr(super(), name)(*args, **kwargs)
            finally:
                type(self).seconds += time.perf_counter() - t0

        def set_up_planner(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("set_up_planner", *args, **kwargs)

        def create_local_plan(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("create_local_plan", *args, **kwargs)

        def create_global_plan(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("create_global_plan", *args, **kwargs)

        def finish_plan(self, *args: Any, **kwargs: Any) -> Any:
            return self._timed("finish_plan", *args, **kwargs)

    return Timed


def _dcp(n: int, tmp: Path, progress: Progress) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = make_state(n, f"d{n}")
    flat = {"model": state["model"], "optim": state["optim"]["state"]}
    out: dict[str, Any] = {}
    planner_cls = _timed_planner(DefaultSavePlanner)
    d = tmp / f"dcp-{n}"
    planner_cls.seconds = 0.0
    t0 = time.perf_counter()
    dcp.save(flat, checkpoint_id=str(d), planner=planner_cls())
    out["save_s"] = time.perf_counter() - t0
    out["save_plan_s"] = planner_cls.seconds
    out["metadata_bytes"] = (d / ".metadata").stat().st_size
    shutil.rmtree(d)
    planner_cls.seconds = 0.0
    t0 = time.perf_counter()
    fut = dcp.async_save(flat, checkpoint_id=str(d), planner=planner_cls())
    out["async_save_call_s"] = time.perf_counter() - t0
    fut.result()
    out["async_save_total_s"] = time.perf_counter() - t0
    out["async_save_plan_s"] = planner_cls.seconds
    shutil.rmtree(d)
    out["save_plan_us_per_tensor"] = out["save_plan_s"] / n * 1e6
    out["async_save_plan_us_per_tensor"] = out["async_save_plan_s"] / n * 1e6
    progress(
        f"  {n} tensors: dcp.save plans {out['save_plan_us_per_tensor']:.1f} µs/tensor, "
        f"async_save {out['async_save_plan_us_per_tensor']:.1f} µs/tensor (call blocks "
        f"{out['async_save_call_s'] * 1e3:.0f} ms), .metadata {out['metadata_bytes'] / 1e6:.2f} MB"
    )
    return out


def run(counts: list[int], reps: int, tmp: Path, progress: Progress, dcp: bool) -> dict[str, Any]:
    rows = []
    for n in counts:
        row = asyncio.run(_lazy(n, tmp, reps, progress))
        row.pop("snapshot_profile_top")  # file paths of this machine: printed by --profile only
        if dcp:
            row["dcp"] = _dcp(n, tmp, progress)
        rows.append(row)
        gc.collect()
    return {"tensor_numel": NUMEL, "rows": rows}


def write_plots(doc: dict[str, Any], img_dir: Path) -> list[Path]:
    """µs per tensor against the tensor count (snapshot, manifest, restore, DCP planning)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]["rows"]
    xs = [r["tensors"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(xs, [r["snapshot_warm_us_per_tensor"]["median"] for r in rows], "o-", label="snapshot() warm")
    if all("snapshot_warm_cpu_us_per_tensor" in r for r in rows):
        a.plot(
            xs, [r["snapshot_warm_cpu_us_per_tensor"]["median"] for r in rows], "o:",
            label="snapshot() warm, CPU of the calling thread",
        )
    a.plot(xs, [r["snapshot_cold_us_per_tensor"] for r in rows], "o--", label="snapshot() cold")
    a.plot(xs, [r["manifest_read_us_per_tensor"] for r in rows], "s-", label="manifest read+parse")
    if all("dcp" in r for r in rows):
        a.plot(xs, [r["dcp"]["save_plan_us_per_tensor"] for r in rows], "^-", label="dcp.save planning")
        a.plot(
            xs, [r["dcp"]["async_save_plan_us_per_tensor"] for r in rows], "v-",
            label="dcp.async_save planning",
        )
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("tensors")
    a.set_ylabel("µs per tensor")
    a.set_title("per-tensor cost (flat = linear)")
    a.legend(fontsize=8)
    b.plot(xs, [r["restore_us_per_tensor"] for r in rows], "o-", label="restore()")
    b.plot(xs, [r["restore_into_us_per_tensor"] for r in rows], "o--", label="restore(into=)")
    b2 = b.twinx()
    b2.plot(xs, [r["manifest_bytes"] / r["tensors"] for r in rows], "s:", color="gray")
    b2.set_ylabel("manifest bytes per tensor (dotted)")
    b.set_xscale("log")
    b.set_xlabel("tensors")
    b.set_ylabel("µs per tensor")
    b.set_title("restore per tensor; manifest size")
    b.legend(fontsize=8)
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "bench-many-tensors.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 and 3,000 tensors")
    parser.add_argument("--counts", type=str, default=None, help="comma-separated counts")
    parser.add_argument("--reps", type=int, default=None, help="warm snapshots per count")
    parser.add_argument("--no-dcp", action="store_true", help="skip the DCP planning figures")
    parser.add_argument("--profile", type=int, default=None, metavar="N",
                        help="print cProfile's top entries for one warm snapshot() of N tensors")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--img", type=Path, default=None, help="write the plot there")
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args()
    progress = Progress()
    if args.counts:
        counts = [int(c) for c in args.counts.split(",")]
    else:
        counts = QUICK_COUNTS if args.quick else COUNTS
    reps = args.reps or (3 if args.quick else 7)
    with scratch_dir(args.tmp, "many-") as tmp:
        if args.profile:
            row = asyncio.run(_lazy(args.profile, tmp, 2, progress))
            print(row["snapshot_profile_top"])
            return
        started = dt.datetime.now(dt.UTC)
        results = run(counts, reps, tmp, progress, dcp=not args.no_dcp)
    doc = {
        "schema": 1,
        "benchmark": "many_tensors",
        "quick": args.quick,
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg": loadavg(),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"many-tensors-{doc['machine']['slug']}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    progress(f"wrote {path}")
    if args.img is not None:
        for p in write_plots(doc, args.img):
            progress(f"wrote {p}")


if __name__ == "__main__":
    _main()
