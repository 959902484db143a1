"""Helpers shared by the benchmark modules: statistics, memory readings, page-cache
eviction, scratch directories, progress lines and a description of the machine.

Nothing here knows about any particular benchmark, so the CPU suite and a GPU run can use
the same code.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "REPO",
    "GiB",
    "MiB",
    "Progress",
    "abab",
    "drop_from_page_cache",
    "machine_info",
    "make_model_like_state",
    "proc_status_kib",
    "reset_peak_rss",
    "scratch_dir",
    "summarize",
    "tree_bytes",
]

MiB = 1 << 20
GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent


# -- statistics ------------------------------------------------------------------------------


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted, non-empty sequence."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(xs: Sequence[float]) -> dict[str, Any]:
    """Median and spread of repeated measurements (min, p25, p75, p95, max, n).

    Medians are what the reports quote; the spread is kept so that a reader can see how
    noisy a figure was (this machine's disk moves by up to about 30 % between runs).
    """
    if not xs:
        return {"n": 0}
    s = sorted(float(x) for x in xs)
    return {
        "n": len(s),
        "median": statistics.median(s),
        "min": s[0],
        "p25": _quantile(s, 0.25),
        "p75": _quantile(s, 0.75),
        "p95": _quantile(s, 0.95),
        "max": s[-1],
    }


def abab(names: Sequence[str], reps: int) -> Iterator[tuple[int, str]]:
    """Yield ``(rep, name)`` so that methods alternate and their order rotates every rep.

    Interleaving spreads slow drifts of the machine (other processes, disk write-back)
    evenly over the methods instead of penalising whichever ran last.
    """
    n = len(names)
    for rep in range(reps):
        shift = rep % n
        order = list(names[shift:]) + list(names[:shift])
        if rep % 2:
            order.reverse()
        for name in order:
            yield rep, name


# -- memory ----------------------------------------------------------------------------------


def proc_status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``); 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so that it covers only what follows.

    Linux supports this through ``/proc/self/clear_refs`` (value 5). Returns False where it
    is not available; the peak then covers the whole process so far.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- files -----------------------------------------------------------------------------------


def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Evict a file (or every file under a directory) from the page cache.

    Read benchmarks would otherwise measure memory, not the disk. The files have been
    fsynced when they were written, so ``POSIX_FADV_DONTNEED`` can drop their pages.
    """
    p = Path(path)
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextlib.contextmanager
def scratch_dir(parent: str | os.PathLike[str] | None, prefix: str) -> Iterator[Path]:
    """A fresh directory for one benchmark, removed afterwards.

    ``parent`` defaults to the repository's ignored ``runs/`` directory, which sits on the
    same file system as the system temp directory on the machines this suite targets.
    """
    base = Path(parent) if parent is not None else REPO / "runs"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- states ----------------------------------------------------------------------------------


def layer_shapes(width: int) -> dict[str, tuple[int, ...]]:
    """The 12 tensors of one transformer layer of ``width``: 4 matrices, 8 vectors."""
    return {
        "attn.qkv.weight": (3 * width, width),
        "attn.qkv.bias": (3 * width,),
        "attn.proj.weight": (width, width),
        "attn.proj.bias": (width,),
        "ln1.weight": (width,),
        "ln1.bias": (width,),
        "mlp.fc.weight": (4 * width, width),
        "mlp.fc.bias": (4 * width,),
        "mlp.out.weight": (width, 4 * width),
        "mlp.out.bias": (width,),
        "ln2.weight": (width,),
        "ln2.bias": (width,),
    }


def make_model_like_state(
    total_bytes: int, *, width: int = 1024, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A flat dict of fp32 tensors shaped like a transformer's weights, about ``total_bytes``.

    Each layer has four large matrices (QKV, attention out, MLP in, MLP out: 12·width²
    values in all) and eight small vectors (biases and LayerNorm weights), plus one
    embedding matrix, so the state has both the bulk bytes and the many small tensors of
    a real model. Layers are added until the total is reached; ``width`` shrinks for small
    totals so that a quick run still has several layers.
    """
    gen = torch.Generator().manual_seed(seed)
    while width > 64 and 12 * width * width * 4 * 4 > total_bytes:
        width //= 2
    per_layer = 12 * width * width * 4 + 13 * width * 4
    emb_rows = max(1, min(16 * width, (total_bytes // 16) // (width * 4)))
    state: dict[str, torch.Tensor] = {"embed.weight": torch.randn(emb_rows, width, generator=gen)}
    used = emb_rows * width * 4
    layer = 0
    while used + per_layer <= total_bytes or layer == 0:
        p = f"layers.{layer}."
        for name, shape in layer_shapes(width).items():
            state[p + name] = torch.randn(*shape, generator=gen)
        used += per_layer
        layer += 1
    return state


def tree_bytes(obj: Any) -> int:
    """Bytes of all distinct tensors in a nested structure (aliases counted once)."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            key = node.untyped_storage().data_ptr() + node.storage_offset() * node.element_size()
            if key not in seen:
                seen.add(key)
                total += node.numel() * node.element_size()
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return total


# -- progress and machine ----------------------------------------------------------------------


class Progress:
    """One line per phase on stderr, with the time since the suite started."""

    def __init__(self, stream: Any = None) -> None:
        self.t0 = time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.t0
        print(f"[{elapsed:7.1f}s] {message}", file=self.stream, flush=True)


def _mem_total_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return 0.0


def machine_info() -> dict[str, Any]:
    """What the figures depend on, without host names or paths."""
    cpus = os.cpu_count() or 0
    gpu = torch.cuda.is_available()
    slug = f"cpu-{cpus}core"
    if gpu:
        name = torch.cuda.get_device_name(0).lower()
        slug = "gpu-" + "".join(c if c.isalnum() else "-" for c in name).strip("-")
    return {
        "slug": slug,
        "cpus": cpus,
        "mem_gib": _mem_total_gib(),
        "gpu": torch.cuda.get_device_name(0) if gpu else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "kernel": platform.release(),
        "machine": platform.machine(),
    }


def loadavg() -> list[float]:
    """The 1/5/15-minute load averages (other work sharing the CPUs), or [] if unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []
