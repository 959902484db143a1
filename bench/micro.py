"""Microbenchmarks, each next to its physical floor measured in the same run.

- ``snapshot_latency``: time spent inside ``snapshot()`` against the number of tensors and
  against the number of bytes (it should grow with the first, not the second);
- ``capture``: a ~1 GiB model-like state: time in ``snapshot()`` and capture bandwidth
  against a plain ``copy_`` of the same tensors into a pre-faulted buffer (and against
  copy + crc32c); side by side, the capture as it was before the checksum left it
  (``capture_crc_inline``: each piece checksummed by the copying thread) and the checksum
  stage without its lowered thread priority (``capture_crc_same_priority``), and for each
  the time until the host tier holds the snapshot with its checksums;
- ``flush``: FileTier, from ``snapshot()`` until durable, against a sequential write +
  fsync of the same bytes into the same directory;
- ``restore``: from FileTier against a plain read of the same bytes, ``torch.load`` and
  ``torch.distributed.checkpoint.load``, with every file evicted from the page cache first;
- ``rss``: resident memory over many snapshots, in a child process of its own.

Methods alternate within each benchmark (``common.abab``) and every figure is a median.
Run through ``bench/run.py``; ``python bench/micro.py rss-child ...`` is the child entry.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import ctypes
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    MiB,
    Progress,
    abab,
    drop_from_page_cache,
    make_model_like_state,
    proc_status_kib,
    summarize,
    tree_bytes,
)

import lazyckpt
from tiers import FileTier, HostMemoryTier

__all__ = [
    "bench_capture",
    "bench_flush",
    "bench_restore",
    "bench_rss",
    "bench_snapshot_latency",
    "memcpy_into",
]

SHARD = 16 << 20  # the library's default shard size, stated explicitly for the record
PIECE = 8 << 20  # the plain baselines read and write in the same piece size as FileTier


def _quiet_dcp_warnings() -> None:
    # DCP warns about running without a process group and about its experimental parts;
    # the warnings say nothing about the figures.
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) // a * a


def _malloc_trim() -> None:
    """Return freed heap memory to the OS, so that every method that allocates new tensors
    pays for fresh pages, not only whichever ran first (page faults are slow on a VM)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# -- floors ---------------------------------------------------------------------------------


def prefaulted(nbytes: int) -> torch.Tensor:
    """A flat uint8 buffer whose pages are all touched already (no page faults later)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    return buf


def _layout(state: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    out = []
    cursor = 0
    for t in state.values():
        out.append((t, cursor))
        cursor += _align(t.numel() * t.element_size(), 64)
    return out


def memcpy_into(
    dest: torch.Tensor, layout: list[tuple[torch.Tensor, int]], *, crc: bool = False
) -> int:
    """Copy every tensor into ``dest`` at its offset (torch ``copy_``, the same primitive a
    capture uses); with ``crc`` also checksum each piece right after it is copied."""
    view = memoryview(dest.numpy()) if crc else None
    value = 0
    for t, off in layout:
        n = t.numel() * t.element_size()
        dest[off : off + n].view(t.dtype).view(t.shape).copy_(t)
        if view is not None:
            value = crc32c.crc32c(view[off : off + n], value=value)
    return value


def plain_write_fsync(path: Path, data: memoryview) -> None:
    """Sequential ``os.write`` in PIECE-sized pieces, then ``fsync``: the disk's floor."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for o in range(0, len(data), PIECE):
            piece = data[o : o + PIECE]
            while piece:
                piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_write_fsync_parallel(path: Path, data: memoryview, threads: int = 2) -> None:
    """The same pieces written by ``threads`` threads with ``os.pwrite`` (as FileTier's pool
    does), then one ``fsync``: the floor for a writer that keeps several requests in flight,
    which a virtual disk rewards."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    offsets = list(range(0, len(data), PIECE))

    def write(o: int) -> None:
        piece, at = data[o : o + PIECE], o
        while piece:
            n = os.pwrite(fd, piece, at)
            piece, at = piece[n:], at + n

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, offsets))
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save_durable(obj: Any, path: Path) -> None:
    """``torch.save`` followed by ``fsync``, so that the file is as durable as the others."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def plain_read(path: Path, out: memoryview) -> int:
    """Sequential ``preadv`` of a whole file into a pre-faulted buffer; returns bytes read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done : done + PIECE]], done)
            if n == 0:
                break
            done += n
        return done
    finally:
        os.close(fd)


# -- snapshot() latency ----------------------------------------------------------------------


async def _time_snapshots(
    ckpt: lazyckpt.Checkpointer, state: dict[str, Any], first_step: int, reps: int
) -> tuple[list[float], int]:
    """Time ``snapshot()`` alone ``reps`` times, draining each snapshot before the next so
    that no backpressure or background copy leaks into the next measurement."""
    times = []
    step = first_step
    for _ in range(reps):
        t0 = time.perf_counter()
        h = await ckpt.snapshot(state, step=step)
        times.append(time.perf_counter() - t0)
        await h.committed()
        step += 1
    return times, step


async def _snapshot_latency(quick: bool, progress: Progress) -> dict[str, Any]:
    counts = [1, 10, 100, 1000] if quick else [1, 10, 100, 1000, 10000]
    sizes = [1 * MiB, 16 * MiB] if quick else [1 * MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
    cap = _align(max(sizes) + 64 * MiB)
    by_tensors = []
    by_bytes = []
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(capacity_bytes=cap)], shard_size=SHARD
    ) as ckpt:
        step = 0
        # warm-up: first calls pay for imports and lazily built tables
        _, step = await _time_snapshots(ckpt, {"w": torch.zeros(4)}, step, 3)
        for n in counts:
            # 1 KiB tensors: the bytes stay negligible, so only the count varies
            state = {f"t{i}": torch.randn(256) for i in range(n)}
            reps = 5 if n >= 10000 else (10 if quick else 20)
            times, step = await _time_snapshots(ckpt, state, step, reps)
            by_tensors.append({"tensors": n, "bytes": tree_bytes(state), **summarize(times)})
            progress(f"  snapshot() with {n} tensors: {summarize(times)['median'] * 1e3:.3f} ms")
        for size in sizes:
            # 16 tensors: the count stays fixed, only the bytes grow
            per = size // 16 // 4
            state = {f"t{i}": torch.randn(per) for i in range(16)}
            times, step = await _time_snapshots(ckpt, state, step, 5 if quick else 10)
            by_bytes.append({"tensors": 16, "bytes": tree_bytes(state), **summarize(times)})
            progress(
                f"  snapshot() of {size // MiB} MiB in 16 tensors: "
                f"{summarize(times)['median'] * 1e3:.3f} ms"
            )
            del state
            gc.collect()
    return {"by_tensors": by_tensors, "by_bytes": by_bytes, "tiers": ["host"]}


def bench_snapshot_latency(quick: bool, progress: Progress) -> dict[str, Any]:
    """``snapshot()`` latency vs number of tensors and vs bytes (host tier only)."""
    return asyncio.run(_snapshot_latency(quick, progress))


# -- capture vs memcpy ------------------------------------------------------------------------


PIECE_CRC = 4 << 20  # piece size of the inline-checksum capture (as the library used)


def _copy_and_crc(job: Any) -> int:
    """The capture as it was before the checksum stage: copy each piece of a shard, then
    checksum it on the same thread while it is still in cache; version check last."""
    from lazyckpt._capture.cpu import check_versions, source_view

    dest = job.block.tensor()
    view = job.block.memoryview()
    crc = 0
    cursor = 0
    for seg in job.shard.segments:
        if seg.offset > cursor:
            dest[cursor : seg.offset].zero_()
            crc = crc32c.crc32c(view[cursor : seg.offset], value=crc)
        meta = job.manifest.tensors[seg.tensor]
        shape = job.manifest.segment_shape(seg)
        nbytes = job.manifest.segment_nbytes(seg)
        src = source_view(job, seg)
        out = dest[seg.offset : seg.offset + nbytes].view(meta.torch_dtype).view(shape)
        if len(shape) >= 1 and shape[0] > 1 and nbytes > PIECE_CRC:
            row_bytes = nbytes // shape[0]
            rows = max(1, PIECE_CRC // row_bytes)
            for r in range(0, shape[0], rows):
                out[r : r + rows].copy_(src[r : r + rows])
                lo = seg.offset + r * row_bytes
                hi = seg.offset + min(shape[0], r + rows) * row_bytes
                crc = crc32c.crc32c(view[lo:hi], value=crc)
        else:
            out.copy_(src)
            crc = crc32c.crc32c(view[seg.offset : seg.offset + nbytes], value=crc)
        cursor = seg.offset + nbytes
    if cursor < job.shard.length:
        dest[cursor : job.shard.length].zero_()
        crc = crc32c.crc32c(view[cursor : job.shard.length], value=crc)
    check_versions(job)
    return crc


class CrcInlineCapture:
    """Capture backend and checksum stage in one, reproducing the design before the checksum
    stage: the crc is computed inside the capture (so before ``captured()``), and the
    checksum stage only hands it over."""

    def __init__(self, threads: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads)
        self._crcs: dict[int, int] = {}

    async def capture(self, job: Any) -> None:
        loop = asyncio.get_running_loop()
        self._crcs[id(job.block)] = await loop.run_in_executor(self._pool, _copy_and_crc, job)

    async def checksum(self, block: Any) -> int:
        return self._crcs.pop(id(block))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _crc_inline(ckpt: lazyckpt.Checkpointer) -> None:
    engine = ckpt._core.engine
    engine.capture.close()
    engine.checksums.close()
    inline = CrcInlineCapture(engine.options.capture_threads)
    engine.capture = inline
    engine.checksums = inline


def _checksums_same_priority(ckpt: lazyckpt.Checkpointer) -> None:
    from lazyckpt._capture.cpu import ChecksumPool

    engine = ckpt._core.engine
    engine.checksums.close()
    engine.checksums = ChecksumPool(niceness=0)


# name -> how to change a default Checkpointer (None: leave it as it is)
CAPTURE_VARIANTS: dict[str, Callable[[lazyckpt.Checkpointer], None] | None] = {
    "capture": None,
    "capture_crc_same_priority": _checksums_same_priority,
    "capture_crc_inline": _crc_inline,
}


async def _capture(
    state: dict[str, torch.Tensor],
    reps: int,
    progress: Progress,
    variants: dict[str, Callable[[lazyckpt.Checkpointer], None] | None] | None = None,
) -> dict[str, Any]:
    variants = CAPTURE_VARIANTS if variants is None else variants
    nbytes = tree_bytes(state)
    layout = _layout(state)
    dest = prefaulted(_align(layout[-1][1] + nbytes))  # generous: includes the alignment gaps
    memcpy_into(dest, layout)  # warm caches and the thread pool once
    cap = _align(nbytes + 64 * MiB)
    samples: dict[str, list[float]] = {"memcpy": [], "memcpy_crc32c": []}
    samples |= {name: [] for name in variants}
    to_host: dict[str, list[float]] = {name: [] for name in variants}
    in_snapshot: list[float] = []
    capture_stats: list[float] = []
    # each variant has its own Checkpointer (and arena), with the default options
    ckpts = {
        name: lazyckpt.Checkpointer([HostMemoryTier(capacity_bytes=cap)], shard_size=SHARD)
        for name in variants
    }
    metrics: dict[str, Any] = {}
    try:
        for name, ckpt in ckpts.items():
            await ckpt.open()
            change = variants[name]
            if change is not None:
                change(ckpt)
            h = await ckpt.snapshot(state, step=0)  # warm-up: first capture
            await h.committed()
        step = 0
        for rep, name in abab(list(samples), reps):
            if name in ckpts:
                step += 1
                ckpt = ckpts[name]
                t0 = time.perf_counter()
                h = await ckpt.snapshot(state, step=step)
                t1 = time.perf_counter()
                await h.captured()
                t2 = time.perf_counter()
                await h.committed()  # the host tier: every shard with its checksum
                t3 = time.perf_counter()
                samples[name].append(t2 - t0)
                to_host[name].append(t3 - t0)
                if name == "capture":
                    in_snapshot.append(t1 - t0)
                    assert h.stats is not None and h.stats.capture_s is not None
                    capture_stats.append(h.stats.capture_s)
                progress(f"  rep {rep}: {name} {samples[name][-1]:.3f}s, on host {t3 - t0:.3f}s")
            else:
                t0 = time.perf_counter()
                memcpy_into(dest, layout, crc=name == "memcpy_crc32c")
                samples[name].append(time.perf_counter() - t0)
        metrics = ckpts["capture"].metrics() if "capture" in ckpts else {}
    finally:
        for ckpt in ckpts.values():
            await ckpt.aclose()
    del dest
    summary = {k: summarize(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in summary.items()}
    snap = summarize(in_snapshot) if in_snapshot else None
    out: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": len(state),
        "seconds": summary,
        "to_host_s": {k: summarize(v) for k, v in to_host.items()},
        "gib_per_s": {k: nbytes / v / (1 << 30) for k, v in med.items()},
        "arena_peak": metrics.get("arena", {}).get("peak"),
    }
    for name in variants:
        out[f"{name}_over_memcpy_bw"] = med["memcpy"] / med[name]
        out[f"{name}_to_host_over_memcpy_crc_bw"] = (
            med["memcpy_crc32c"] / out["to_host_s"][name]["median"]
        )
    if snap is not None:
        out["snapshot_s"] = snap
        out["capture_stats_s"] = summarize(capture_stats)
        out["snapshot_over_memcpy"] = snap["median"] / med["memcpy"]
        out["capture_over_memcpy_crc_bw"] = med["memcpy_crc32c"] / med["capture"]
    return out


def bench_capture(
    state: dict[str, torch.Tensor],
    reps: int,
    progress: Progress,
    variants: dict[str, Callable[[lazyckpt.Checkpointer], None] | None] | None = None,
) -> dict[str, Any]:
    """Time in ``snapshot()`` and capture bandwidth against memcpy (host tier only), for
    each of ``variants`` (default :data:`CAPTURE_VARIANTS`)."""
    return asyncio.run(_capture(state, reps, progress, variants))


# -- durable flush vs write + fsync -------------------------------------------------------------


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all threads), in seconds."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _flush(
    state: dict[str, torch.Tensor], reps: int, tmp: Path, progress: Progress
) -> dict[str, Any]:
    nbytes = tree_bytes(state)
    layout = _layout(state)
    src = prefaulted(_align(layout[-1][1] + nbytes))
    memcpy_into(src, layout)
    data = memoryview(src.numpy())[: layout[-1][1] + layout[-1][0].numel() * 4]
    cap = _align(nbytes + 64 * MiB)
    samples: dict[str, list[float]] = {
        "write_fsync": [],
        "write_fsync_2threads": [],
        "lazyckpt_file": [],
        "lazyckpt_file_direct": [],
    }
    cpu: dict[str, list[float]] = {k: [] for k in samples}
    capture_s: list[float] = []
    # the default FileTier (buffered writes) and the same with O_DIRECT, each with its own
    # arena and directory; both snapshot the same state
    ckpts = {
        name: lazyckpt.Checkpointer(
            [
                HostMemoryTier(capacity_bytes=cap),
                FileTier(tmp / name, direct=name.endswith("direct")),
            ],
            shard_size=SHARD,
        )
        for name in ("lazyckpt_file", "lazyckpt_file_direct")
    }
    try:
        for ckpt in ckpts.values():
            await ckpt.open()
        step = 0
        for rep, name in abab(list(samples), reps):
            os.sync()  # start each trial with no dirty pages from the previous one
            c0 = _cpu_seconds()
            if name.startswith("write_fsync"):
                path = tmp / f"plain-{rep}.bin"
                write = plain_write_fsync if name == "write_fsync" else plain_write_fsync_parallel
                t0 = time.perf_counter()
                write(path, data)
                samples[name].append(time.perf_counter() - t0)
                path.unlink()
            else:
                step += 1
                t0 = time.perf_counter()
                h = await ckpts[name].snapshot(state, step=step)
                await h.reached("file")
                samples[name].append(time.perf_counter() - t0)
                assert h.stats is not None and h.stats.capture_s is not None
                if name == "lazyckpt_file":
                    capture_s.append(h.stats.capture_s)
                # remove the committed step outside the timing (a retention policy would
                # delete it in the background, overlapping the next trial)
                shutil.rmtree(tmp / name / f"step-{step:012d}")
            cpu[name].append(_cpu_seconds() - c0)
            progress(f"  rep {rep}: {name} {samples[name][-1]:.2f}s, {cpu[name][-1]:.2f} CPU-s")
    finally:
        for ckpt in ckpts.values():
            await ckpt.aclose()
    summary = {k: summarize(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in summary.items()}
    return {
        "bytes": nbytes,
        "seconds": summary,
        "cpu_seconds": {k: summarize(v) for k, v in cpu.items()},
        "capture_s": summarize(capture_s),
        "gib_per_s": {k: nbytes / v / (1 << 30) for k, v in med.items()},
        "file_over_write_fsync_bw": med["write_fsync"] / med["lazyckpt_file"],
        "file_over_write_fsync_2threads_bw": med["write_fsync_2threads"] / med["lazyckpt_file"],
        "file_direct_over_write_fsync_bw": med["write_fsync"] / med["lazyckpt_file_direct"],
    }


def bench_flush(
    state: dict[str, torch.Tensor], reps: int, tmp: Path, progress: Progress
) -> dict[str, Any]:
    """FileTier snapshot-to-durable against plain sequential write + fsync, same directory."""
    return asyncio.run(_flush(state, reps, tmp, progress))


# -- restore -------------------------------------------------------------------------------------


async def _restore(
    state: dict[str, torch.Tensor], reps: int, tmp: Path, progress: Progress
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    _quiet_dcp_warnings()
    nbytes = tree_bytes(state)
    root = tmp / "lazy"
    # write each format once, durably
    cap = _align(nbytes + 64 * MiB)
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(capacity_bytes=cap), FileTier(root)], shard_size=SHARD
    ) as ckpt:
        h = await ckpt.snapshot(state, step=1)
        await h.committed()
    torch_path = tmp / "state.pt"
    torch_save_durable(state, torch_path)
    dcp_dir = tmp / "dcp"
    dcp.save(state, checkpoint_id=str(dcp_dir))
    data_file = next(root.glob("step-*/rank-*.data"))
    read_buf = prefaulted(_align(data_file.stat().st_size))
    read_view = memoryview(read_buf.numpy())[: data_file.stat().st_size]
    template = {k: torch.zeros_like(v) for k, v in state.items()}  # pre-faulted targets
    files = {
        "plain_read": data_file,
        "lazyckpt_restore": root,
        "lazyckpt_restore_into": root,
        "torch_load": torch_path,
        "dcp_load_into": dcp_dir,
    }
    samples: dict[str, list[float]] = {k: [] for k in files}
    async with lazyckpt.Checkpointer([FileTier(root)], shard_size=SHARD) as reader:
        for rep, name in abab(list(samples), reps):
            drop_from_page_cache(files[name])
            t0 = time.perf_counter()
            if name == "plain_read":
                plain_read(data_file, read_view)
            elif name == "lazyckpt_restore":
                out = await reader.restore(1)
                del out
            elif name == "lazyckpt_restore_into":
                await reader.restore(1, into=template)
            elif name == "torch_load":
                out = torch.load(torch_path, weights_only=True)
                del out
            else:
                dcp.load(template, checkpoint_id=str(dcp_dir))
            samples[name].append(time.perf_counter() - t0)
            _malloc_trim()
            progress(f"  rep {rep}: {name} {samples[name][-1]:.2f}s")
    # the bytes came back right (checked once, outside the timing)
    ok = all(torch.equal(template[k], state[k]) for k in state)
    summary = {k: summarize(v) for k, v in samples.items()}
    med = {k: v["median"] for k, v in summary.items()}
    return {
        "bytes": nbytes,
        "file_bytes": {
            "lazyckpt": data_file.stat().st_size,
            "torch_save": torch_path.stat().st_size,
            "dcp": sum(f.stat().st_size for f in dcp_dir.iterdir()),
        },
        "seconds": summary,
        "gib_per_s": {k: nbytes / v / (1 << 30) for k, v in med.items()},
        "restore_over_read_bw": med["plain_read"] / med["lazyckpt_restore"],
        "restore_into_over_read_bw": med["plain_read"] / med["lazyckpt_restore_into"],
        "roundtrip_ok": ok,
        "page_cache": "each file evicted with fsync + POSIX_FADV_DONTNEED before every read",
    }


def bench_restore(
    state: dict[str, torch.Tensor], reps: int, tmp: Path, progress: Progress
) -> dict[str, Any]:
    """Restore from FileTier vs plain read, torch.load and dcp.load (cold page cache)."""
    return asyncio.run(_restore(state, reps, tmp, progress))


# -- RSS over many snapshots ------------------------------------------------------------------


async def _rss_child(nbytes: int, snapshots: int, root: Path) -> dict[str, Any]:
    """In a fresh process: snapshot a state ``snapshots`` times (Host + File), changing it
    in place between snapshots as an optimizer would, and sample VmRSS after each."""
    rss_import = proc_status_kib("VmRSS")
    state = make_model_like_state(nbytes, width=256)
    state_bytes = tree_bytes(state)
    rss_state = proc_status_kib("VmRSS")
    cap = _align(4 * state_bytes)
    series = []
    async with lazyckpt.Checkpointer(
        [HostMemoryTier(capacity_bytes=cap), FileTier(root, keep_last=2)], shard_size=1 << 20
    ) as ckpt:
        rss_open = proc_status_kib("VmRSS")
        h = None
        for step in range(snapshots):
            await ckpt.wait_captured()  # what the guard does before optimizer.step()
            with torch.no_grad():
                for t in state.values():
                    t.add_(1e-3)
            h = await ckpt.snapshot({"model": state, "step": step}, step=step)
            series.append(proc_status_kib("VmRSS"))
        if h is not None:
            await h.committed()
        arena = ckpt.metrics()["arena"]
    return {
        "state_bytes": state_bytes,
        "arena_capacity": cap,
        "arena_peak": arena["peak"],
        "snapshots": snapshots,
        "rss_kib": {
            "after_import": rss_import,
            "after_state": rss_state,
            "after_open": rss_open,
            "series": series,
            "hwm": proc_status_kib("VmHWM"),
        },
    }


def bench_rss(quick: bool, tmp: Path, progress: Progress) -> dict[str, Any]:
    """Peak and per-snapshot RSS over many snapshots, measured in a child process."""
    nbytes = 4 * MiB if quick else 32 * MiB
    snapshots = 20 if quick else 200
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "rss-child",
        "--bytes",
        str(nbytes),
        "--snapshots",
        str(snapshots),
        "--dir",
        str(tmp / "rss"),
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    kib = out["rss_kib"]
    series = kib["series"]
    quarter = max(1, len(series) // 4)
    out["rss_mib"] = {
        "after_state": kib["after_state"] / 1024,
        "after_open": kib["after_open"] / 1024,
        "first_quarter_max": max(series[:quarter]) / 1024,
        "last_quarter_max": max(series[-quarter:]) / 1024,
        "max": max(series) / 1024,
        "hwm": kib["hwm"] / 1024,
    }
    # growth over the run: what a leak would show; the arena itself is touched at open
    out["growth_mib"] = out["rss_mib"]["last_quarter_max"] - out["rss_mib"]["first_quarter_max"]
    out["hwm_over_state_plus_arena_mib"] = (
        kib["hwm"] * 1024 - out["state_bytes"] - out["arena_capacity"]
    ) / MiB
    progress(
        f"  {snapshots} snapshots in {time.perf_counter() - t0:.1f}s: RSS "
        f"{out['rss_mib']['first_quarter_max']:.0f} -> {out['rss_mib']['last_quarter_max']:.0f} MiB"
    )
    return out


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    child = sub.add_parser("rss-child", help="internal: the RSS benchmark's child process")
    child.add_argument("--bytes", type=int, required=True)
    child.add_argument("--snapshots", type=int, required=True)
    child.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()
    result = asyncio.run(_rss_child(args.bytes, args.snapshots, args.dir))
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
