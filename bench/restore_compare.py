"""Restore speed read cold: lazyckpt against ``torch.load``, ``dcp.load`` and a plain read of
the same bytes, side by side in one run.

A model-like state (default 512 MiB of float32 in transformer-shaped tensors) is written
once in each format. Then, with every file dropped from the page cache before each read
(``fsync`` + ``POSIX_FADV_DONTNEED``), the methods alternate (``common.abab``):

- ``plain_read``: sequential ``preadv`` of lazyckpt's data file into a pre-faulted buffer;
- ``plain_read_parallel``: the same pieces read by 4 threads at once (a virtual disk serves
  several requests in flight faster than one);
- ``plain_read_direct``: the same, with ``O_DIRECT`` into page-aligned memory (no page
  cache on the way: what the disk gives a reader that does nothing else); the best of the
  three plain reads is the floor;
- ``lazyckpt_restore``: ``restore()`` into new tensors;
- ``lazyckpt_restore_into``: ``restore(into=)`` existing tensors;
- ``torch_load``: ``torch.load(weights_only=True)`` of a ``torch.save`` file;
- ``dcp_load_alloc``: ``dcp.load`` into tensors allocated for it inside the timing (what a
  caller without a model in memory pays);
- ``dcp_load_into``: ``dcp.load`` into existing tensors.

Reported per method: bandwidth (state bytes / wall time, median), CPU seconds (user + system,
all threads), and the ratios the targets are stated in. New tensors are returned to the OS
between trials (``malloc_trim``), so that every allocating method pays for fresh pages.

    python bench/restore_compare.py                  # 512 MiB, 5 rounds (a few minutes)
    python bench/restore_compare.py --quick          # 32 MiB, 2 rounds
    python bench/restore_compare.py --profile        # cProfile of one cold restore()
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import cProfile
import datetime as dt
import io
import json
import mmap
import os
import pstats
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    REPO,
    MiB,
    Progress,
    abab,
    drop_from_page_cache,
    loadavg,
    machine_info,
    make_model_like_state,
    scratch_dir,
    summarize,
    tree_bytes,
)
from micro import (
    PIECE,
    SHARD,
    _align,
    _malloc_trim,
    _quiet_dcp_warnings,
    plain_read,
    prefaulted,
    torch_save_durable,
)

import lazyckpt
from tiers import FileTier, HostMemoryTier

METHODS = [
    "plain_read",
    "plain_read_parallel",
    "plain_read_direct",
    "lazyckpt_restore",
    "lazyckpt_restore_into",
    "torch_load",
    "dcp_load_alloc",
    "dcp_load_into",
]


def plain_read_parallel(
    path: Path, out: memoryview, threads: int = 4, *, direct: bool = False
) -> None:
    """``preadv`` of a whole file in PIECE-sized pieces by ``threads`` threads; with
    ``direct``, through ``O_DIRECT`` (``out`` page-aligned, its length a multiple of 4 KiB
    and at least the file's)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    end = min(len(out), os.fstat(fd).st_size)

    def one(at: int) -> None:
        view = out[at : at + PIECE]
        done = 0
        while done < len(view) and at + done < end:
            n = os.preadv(fd, [view[done:]], at + done)
            if n == 0:
                raise EOFError(f"{path} ends at {at + done}")
            done += n

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, end, PIECE)))
    finally:
        os.close(fd)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _write_all(state: dict[str, torch.Tensor], tmp: Path) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    root = tmp / "lazy"
    cap = _align(tree_bytes(state) + 64 * MiB)
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(capacity_bytes=cap), FileTier(root)], shard_size=SHARD
    ) as ckpt:
        h = await ckpt.snapshot(state, step=1)
        await h.committed()
    torch_path = tmp / "state.pt"
    torch_save_durable(state, torch_path)
    dcp_dir = tmp / "dcp"
    dcp.save(state, checkpoint_id=str(dcp_dir))
    return {"lazy": root, "data": next(root.glob("step-*/rank-*.data")), "torch": torch_path,
            "dcp": dcp_dir}


async def _compare(
    state: dict[str, torch.Tensor], reps: int, tmp: Path, progress: Progress
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    _quiet_dcp_warnings()
    nbytes = tree_bytes(state)
    paths = await _write_all(state, tmp)
    data_size = paths["data"].stat().st_size
    read_buf = prefaulted(_align(data_size))
    read_view = memoryview(read_buf.numpy())[:data_size]
    direct_buf = mmap.mmap(-1, _align(data_size, 1 << 20))  # page-aligned, for O_DIRECT
    direct_view = memoryview(direct_buf)
    direct_view[:] = bytes(len(direct_view))  # pre-faulted like read_buf
    template = {k: torch.zeros_like(v) for k, v in state.items()}  # pre-faulted targets
    where = {
        "plain_read": paths["data"],
        "plain_read_parallel": paths["data"],
        "plain_read_direct": paths["data"],
        "lazyckpt_restore": paths["lazy"],
        "lazyckpt_restore_into": paths["lazy"],
        "torch_load": paths["torch"],
        "dcp_load_alloc": paths["dcp"],
        "dcp_load_into": paths["dcp"],
    }
    wall: dict[str, list[float]] = {m: [] for m in METHODS}
    cpu: dict[str, list[float]] = {m: [] for m in METHODS}
    ok: dict[str, bool] = {}
    async with lazyckpt.Checkpointer([FileTier(paths["lazy"], readonly=True)]) as reader:
        for rep, name in abab(METHODS, reps):
            drop_from_page_cache(where[name])
            out: Any = None
            c0 = _cpu_seconds()
            t0 = time.perf_counter()
            if name == "plain_read":
                plain_read(paths["data"], read_view)
            elif name == "plain_read_parallel":
                plain_read_parallel(paths["data"], read_view)
            elif name == "plain_read_direct":
                plain_read_parallel(paths["data"], direct_view, direct=True)
            elif name == "lazyckpt_restore":
                out = await reader.restore(1)
            elif name == "lazyckpt_restore_into":
                out = await reader.restore(1, into=template)
            elif name == "torch_load":
                out = torch.load(paths["torch"], weights_only=True)
            elif name == "dcp_load_alloc":
                out = {k: torch.empty_like(v) for k, v in state.items()}
                dcp.load(out, checkpoint_id=str(paths["dcp"]))
            else:
                dcp.load(template, checkpoint_id=str(paths["dcp"]))
                out = template
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(_cpu_seconds() - c0)
            if rep == 0 and out is not None:  # the bytes came back right (outside the timing)
                ok[name] = all(torch.equal(out[k], state[k]) for k in state)
            if out is not template:
                del out
            _malloc_trim()
            progress(f"  rep {rep}: {name} {wall[name][-1]:.2f}s, {cpu[name][-1]:.2f} CPU-s")
    med = {k: summarize(v)["median"] for k, v in wall.items()}
    gib = {k: nbytes / v / (1 << 30) for k, v in med.items()}
    best_new = max(gib["torch_load"], gib["dcp_load_alloc"])
    best_into = max(gib["dcp_load_into"], gib["torch_load"])
    floor = max(gib["plain_read"], gib["plain_read_parallel"], gib["plain_read_direct"])
    return {
        "bytes": nbytes,
        "tensors": len(state),
        "file_bytes": {
            "lazyckpt": data_size,
            "torch_save": paths["torch"].stat().st_size,
            "dcp": sum(f.stat().st_size for f in paths["dcp"].iterdir()),
        },
        "seconds": {k: summarize(v) for k, v in wall.items()},
        "cpu_seconds": {k: summarize(v) for k, v in cpu.items()},
        "gib_per_s": gib,
        "restore_over_best_peer": gib["lazyckpt_restore"] / best_new,
        "restore_into_over_best_peer": gib["lazyckpt_restore_into"] / best_into,
        "restore_over_plain_read": gib["lazyckpt_restore"] / floor,
        "restore_into_over_plain_read": gib["lazyckpt_restore_into"] / floor,
        "roundtrip_ok": ok,
        "page_cache": "each file evicted with fsync + POSIX_FADV_DONTNEED before every read",
    }


async def _profile(state: dict[str, torch.Tensor], tmp: Path, into: bool) -> str:
    paths = await _write_all(state, tmp)
    template = {k: torch.zeros_like(v) for k, v in state.items()} if into else None
    async with lazyckpt.Checkpointer([FileTier(paths["lazy"], readonly=True)]) as reader:
        drop_from_page_cache(paths["lazy"])
        prof = cProfile.Profile()
        prof.enable()  # this thread only: the engine loop and the I/O threads are not seen
        await reader.restore(1, into=template)
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    return text.getvalue()


def write_plots(doc: dict[str, Any], img_dir: Path) -> list[Path]:
    """Bandwidth and CPU seconds per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = doc["results"]
    names = list(r["gib_per_s"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    a.barh(names, [r["gib_per_s"][n] for n in names])
    a.set_xlabel("GiB/s (cold page cache, median)")
    a.set_title(f"restore of {r['bytes'] / (1 << 20):.0f} MiB")
    b.barh(names, [r["cpu_seconds"][n]["median"] for n in names], color="tab:orange")
    b.set_xlabel("CPU seconds (user + system, median)")
    b.set_title("CPU time")
    fig.tight_layout()
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / "bench-restore-compare.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 rounds")
    parser.add_argument("--mib", type=int, default=None, help="state size (default 512)")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 5)")
    parser.add_argument("--profile", action="store_true", help="cProfile one cold restore()")
    parser.add_argument("--into", action="store_true", help="with --profile: restore(into=)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--img", type=Path, default=None, help="write the plot there")
    parser.add_argument("--tmp", type=Path, default=None)
    args = parser.parse_args()
    progress = Progress()
    mib = args.mib or (32 if args.quick else 512)
    reps = args.reps or (2 if args.quick else 5)
    state = make_model_like_state(mib * MiB)
    with scratch_dir(args.tmp, "restore-") as tmp:
        if args.profile:
            print(asyncio.run(_profile(state, tmp, args.into)))
            return
        started = dt.datetime.now(dt.UTC)
        results = asyncio.run(_compare(state, reps, tmp, progress))
    doc = {
        "schema": 1,
        "benchmark": "restore_compare",
        "quick": args.quick,
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg": loadavg(),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"restore-compare-{doc['machine']['slug']}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=1))
    g = results["gib_per_s"]
    progress(
        "GiB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in g.items())
        + f"; restore/best peer {results['restore_over_best_peer']:.2f}, "
        f"into/best peer {results['restore_into_over_best_peer']:.2f}, "
        f"restore/plain read {results['restore_over_plain_read']:.2f}"
    )
    progress(f"wrote {path}")
    if args.img is not None:
        for p in write_plots(doc, args.img):
            progress(f"wrote {p}")


if __name__ == "__main__":
    _main()
