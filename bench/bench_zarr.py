"""ZarrTier throughput against the plain baselines, measured side by side in one run.

- **local**: a snapshot made durable by ``ZarrTier`` on a path (every object and directory
  fsynced, then the commit) against one plain sequential ``os.write`` + ``fsync`` of the
  same bytes to the same file system.
- **s3**: ``ZarrTier("s3://...")`` against plain obstore puts of the same shard bytes, with
  the same number of puts in flight, both to a real S3 server on 127.0.0.1 (SeaweedFS's
  ``weed mini``, in a process of its own: tests/helpers/seaweed.py).
- **encode**: zarr's own ``AsyncArray.setitem`` against writing encoded chunk bytes straight
  to the store (what ZarrTier does), same array, same store.
- **objects**: how many objects one snapshot of a model with 1000 tensors takes.

Methods alternate within each repetition (A B B A ...) so that drifts of a noisy disk hit
them evenly; a first round warms up and is not counted; figures are medians. Prints a table and writes JSON to ``bench/results/``.

    python bench/bench_zarr.py                  # 256 MiB, 5 repetitions after a warm-up
    python bench/bench_zarr.py --size 64 --reps 2 --skip s3
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # helpers.seaweed

from common import (
    REPO,
    MiB,
    Progress,
    abab,
    layer_shapes,
    loadavg,
    machine_info,
    scratch_dir,
    summarize,
)

from lazyckpt import FORMAT_VERSION, Manifest
from lazyckpt.testing import build_snapshot
from tiers import ZarrTier
from tiers.zarr.store import DurableLocalStore

SHARD = 16 * MiB  # the Checkpointer's default shard size
INFLIGHT = 4  # the Checkpointer's default io_concurrency: puts in flight per tier


def weights_state(total: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 matrices of up to 64 MiB (several 16 MiB chunks each) with a bias each, about
    ``total`` bytes."""
    g = torch.Generator().manual_seed(seed)
    rows = max(256, (min(64 * MiB, total // 4) - 4096) // 4096)
    state: dict[str, torch.Tensor] = {}
    used = i = 0
    while used + rows * 4096 <= total or not state:
        state[f"layers.{i}.weight"] = torch.randn(rows, 1024, generator=g)
        state[f"layers.{i}.bias"] = torch.randn(1024, generator=g)
        used += rows * 4096 + 4096
        i += 1
    return state


def thousand_tensor_state(total: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """A transformer-like state of exactly 1000 tensors (83 layers of 12, plus 4), about
    ``total`` bytes: matrices sized to fill it, biases and norms small."""
    g = torch.Generator().manual_seed(seed)
    width = max(64, int((total / (83 * 48)) ** 0.5) // 64 * 64)
    state: dict[str, torch.Tensor] = {}
    for layer in range(83):
        p = f"layers.{layer}."
        for name, shape in layer_shapes(width).items():
            state[p + name] = torch.randn(*shape, generator=g)
    for name in ("embed.weight", "pos.weight", "head.norm.weight", "head.norm.bias"):
        state[name] = torch.randn(width if "norm" in name else 4 * width, width, generator=g)
    return state


async def write_snapshot(tier: ZarrTier, manifest: Manifest, payloads: list[bytes]) -> None:
    """begin, every shard with INFLIGHT puts in flight, commit: what the engine does."""
    sem = asyncio.Semaphore(INFLIGHT)

    async def put(i: int) -> None:
        async with sem:
            await tier.put_shard(manifest, manifest.shards[i], memoryview(payloads[i]))

    await tier.begin(manifest)
    async with asyncio.TaskGroup() as tg:
        for i in range(len(payloads)):
            tg.create_task(put(i))
    await tier.commit(manifest)


async def timed(fn: Callable[[], Awaitable[None]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


def plain_write_fsync(path: Path, payloads: list[bytes]) -> float:
    """The baseline: the same bytes, one file, sequential 16 MiB writes, one fsync."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for p in payloads:
            view = memoryview(p)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


# -- local -------------------------------------------------------------------------------------


async def bench_local(size: int, reps: int, progress: Progress) -> dict[str, Any]:
    manifest, payloads = build_snapshot(1, weights_state(size), shard_size=SHARD, pack_bytes=MiB)
    with scratch_dir(None, "bench-zarr-") as d:
        tier = ZarrTier(d / "zarr")
        await tier.open()
        try:
            return await _side_by_side(
                "local",
                tier,
                manifest,
                payloads,
                "plain write+fsync",
                lambda: asyncio.to_thread(plain_write_fsync, d / "plain.bin", payloads),
                "ZarrTier durable",
                reps,
                progress,
            )
        finally:
            await tier.aclose()


async def _side_by_side(
    where: str,
    tier: ZarrTier,
    manifest: Manifest,
    payloads: list[bytes],
    baseline: str,
    run_baseline: Callable[[], Awaitable[float]],
    name: str,
    reps: int,
    progress: Progress,
) -> dict[str, Any]:
    """The baseline and the tier, alternating (rep 0 warms up); ``run_baseline`` returns
    its own seconds. Each tier write goes under a new step and is deleted afterwards."""
    nbytes = sum(len(p) for p in payloads)
    times: dict[str, list[float]] = {baseline: [], name: []}
    for rep, method in abab(list(times), reps + 1):
        if method == baseline:
            seconds = await run_baseline()
        else:
            m = _restep(manifest, rep + 1)
            seconds = await timed(lambda m=m: write_snapshot(tier, m, payloads))
            await tier.delete(m.step)
        if rep:
            times[method].append(seconds)
        progress(f"{where} {method}: {nbytes / MiB / seconds:.0f} MiB/s")
    return _rates(times, nbytes, baseline=baseline)


def _restep(manifest: Manifest, step: int) -> Manifest:
    from dataclasses import replace

    return replace(manifest, step=step)


def _rates(times: dict[str, list[float]], nbytes: int, *, baseline: str) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": nbytes, "methods": {}}
    for name, seconds in times.items():
        rates = [nbytes / MiB / s for s in seconds]
        out["methods"][name] = {"seconds": summarize(seconds), "mib_per_s": summarize(rates)}
    base = out["methods"][baseline]["mib_per_s"]["median"]
    for entry in out["methods"].values():
        entry["vs_baseline"] = entry["mib_per_s"]["median"] / base
    return out


# -- S3 ----------------------------------------------------------------------------------------


async def bench_s3(size: int, reps: int, progress: Progress) -> dict[str, Any]:
    import obstore
    from helpers.seaweed import start_seaweed, stop_seaweed
    from obstore.store import S3Store

    where = tempfile.TemporaryDirectory(prefix="bench-zarr-s3-")
    handle, server = start_seaweed(where.name)
    try:
        plain = S3Store(
            server.bucket,
            prefix="plain",
            config={
                "endpoint": server.endpoint,
                "region": server.region,
                "access_key_id": server.access_key_id,
                "secret_access_key": server.secret_access_key,
                "virtual_hosted_style_request": False,
            },
            client_options={"allow_http": True},
        )
        tier = ZarrTier(f"s3://{server.bucket}/zarr", **server.tier_options())
        await tier.open()
        manifest, payloads = build_snapshot(
            1, weights_state(size), shard_size=SHARD, pack_bytes=MiB
        )

        async def plain_puts() -> None:
            sem = asyncio.Semaphore(INFLIGHT)

            async def put(i: int) -> None:
                async with sem:
                    await obstore.put_async(plain, f"shard-{i}", payloads[i])

            async with asyncio.TaskGroup() as tg:
                for i in range(len(payloads)):
                    tg.create_task(put(i))

        async def baseline() -> float:
            seconds = await timed(plain_puts)
            await obstore.delete_async(plain, [f"shard-{i}" for i in range(len(payloads))])
            return seconds

        try:
            return await _side_by_side(
                "s3",
                tier,
                manifest,
                payloads,
                "plain obstore puts",
                baseline,
                "ZarrTier S3",
                reps,
                progress,
            )
        finally:
            await tier.aclose()
    finally:
        stop_seaweed(handle)
        where.cleanup()


# -- setitem against raw chunk writes ----------------------------------------------------------


async def raw_chunk_writes(arr: Any, data: np.ndarray[Any, Any], chunk: int) -> None:
    """What ZarrTier does: each chunk's bytes plus their crc32c, straight to the store, with
    INFLIGHT writes at once."""
    from zarr.core.buffer.cpu import Buffer

    from tiers.zarr.codec import _chunk_parts, _join

    raw = memoryview(data).cast("B")
    step = chunk * data.itemsize
    sem = asyncio.Semaphore(INFLIGHT)

    async def put(i: int) -> None:
        async with sem:
            piece = raw[i * step : (i + 1) * step]
            encoded = await asyncio.to_thread(lambda: _join(_chunk_parts(piece, None, step)))
            key = f"{arr.path}/{arr.metadata.encode_chunk_key((i,))}"
            await arr.store_path.store.set(key, Buffer.from_array_like(encoded))

    async with asyncio.TaskGroup() as tg:
        for i in range(len(raw) // step):
            tg.create_task(put(i))


async def bench_encode(size: int, reps: int, progress: Progress) -> dict[str, Any]:
    import zarr
    import zarr.api.asynchronous as za
    from zarr.codecs import Crc32cCodec
    from zarr.storage import MemoryStore

    chunk = SHARD // 4
    n = size // 4 // chunk * chunk
    data = torch.randn(n).numpy()
    nbytes = data.nbytes
    results: dict[str, Any] = {}
    with scratch_dir(None, "bench-zarr-enc-") as d:
        for store_name in ("MemoryStore", "DurableLocalStore"):
            times: dict[str, list[float]] = {"zarr setitem": [], "raw store.set": []}
            for rep, method in abab(list(times), reps + 1):  # rep 0 warms up
                store: Any = (
                    MemoryStore()
                    if store_name == "MemoryStore"
                    else DurableLocalStore(d / str(rep))
                )
                with zarr.config.set({"async.concurrency": INFLIGHT}):
                    arr = await za.create_array(
                        store=store,
                        name=f"{method.split()[0]}",
                        shape=(n,),
                        chunks=(chunk,),
                        dtype="float32",
                        compressors=[Crc32cCodec()],
                        filters=None,
                        fill_value=0.0,
                        config={"write_empty_chunks": True},
                    )
                    if method == "zarr setitem":
                        seconds = await timed(lambda arr=arr: arr.setitem(slice(None), data))
                    else:
                        seconds = await timed(lambda arr=arr: raw_chunk_writes(arr, data, chunk))
                    back = await arr.getitem(slice(0, 1024))
                    assert np.array_equal(back, data[:1024])  # zarr reads what we wrote
                if rep:
                    times[method].append(seconds)
                if isinstance(store, DurableLocalStore):
                    store.close()
                    await store.with_read_only(False).delete_dir("")
                progress(f"encode {store_name} {method}: {nbytes / MiB / seconds:.0f} MiB/s")
            results[store_name] = _rates(times, nbytes, baseline="zarr setitem")
    return results


# -- objects per snapshot ----------------------------------------------------------------------


async def bench_objects(size: int, progress: Progress) -> dict[str, Any]:
    state = thousand_tensor_state(size)
    manifest, payloads = build_snapshot(1, state, shard_size=SHARD, pack_bytes=MiB)
    with scratch_dir(None, "bench-zarr-obj-") as d:
        tier = ZarrTier(d / "zarr")
        await tier.open()
        try:
            seconds = await timed(lambda: write_snapshot(tier, manifest, payloads))
        finally:
            await tier.aclose()
        step_dir = d / "zarr" / "step-000000000001"
        objects = sum(len(files) for _, _, files in os.walk(step_dir))
    nbytes = sum(len(p) for p in payloads)
    packed = sum(1 for t in manifest.tensors if t.mode == "pack")
    result = {
        "tensors": len(manifest.tensors),
        "bytes": nbytes,
        "packed_tensors": packed,
        "arrays": len(manifest.tensors) - packed,
        "objects_in_snapshot": objects,
        "one_array_per_tensor_would_be": 2 * len(manifest.tensors),
        "durable_mib_per_s": nbytes / MiB / seconds,
    }
    progress(f"objects: {objects} for {len(manifest.tensors)} tensors ({nbytes / MiB:.0f} MiB)")
    return result


# -- report ------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    lines = ["| benchmark | method | MiB/s (median) | vs baseline |", "| --- | --- | --- | --- |"]

    def rows(section: str, entry: dict[str, Any]) -> None:
        for name, m in entry["methods"].items():
            lines.append(
                f"| {section} | {name} | {m['mib_per_s']['median']:.0f} | "
                f"{m['vs_baseline'] * 100:.0f} % |"
            )

    if "local" in results:
        rows(f"local path, {results['local']['bytes'] / MiB:.0f} MiB", results["local"])
    if "s3" in results:
        rows(f"S3 (SeaweedFS, loopback), {results['s3']['bytes'] / MiB:.0f} MiB", results["s3"])
    for store, entry in results.get("encode", {}).items():
        rows(f"encode into {store}", entry)
    if "objects" in results:
        o = results["objects"]
        lines.append(
            f"| objects, {o['tensors']} tensors ({o['bytes'] / MiB:.0f} MiB) | ZarrTier | "
            f"{o['objects_in_snapshot']} objects ({o['packed_tensors']} tensors packed) | "
            f"one array per tensor: {o['one_array_per_tensor_would_be']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=256, help="MiB per snapshot (default 256)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per method")
    parser.add_argument(
        "--skip", default="", help="comma-separated sections to skip: local,s3,encode,objects"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    if args.size * MiB < SHARD:  # the encode section writes whole chunks of SHARD bytes
        parser.error(f"--size must be at least {SHARD // MiB} MiB, got {args.size}")
    skip = {s for s in args.skip.split(",") if s}
    size = args.size * MiB
    progress = Progress()

    async def run() -> dict[str, Any]:
        results: dict[str, Any] = {}
        if "local" not in skip:
            results["local"] = await bench_local(size, args.reps, progress)
        if "s3" not in skip:
            results["s3"] = await bench_s3(size, args.reps, progress)
        if "encode" not in skip:
            results["encode"] = await bench_encode(size, args.reps, progress)
        if "objects" not in skip:
            results["objects"] = await bench_objects(size, progress)
        return results

    results = asyncio.run(run())
    report = {
        "benchmark": "zarr",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg": loadavg(),
        "size_mib": args.size,
        "reps": args.reps,
        "shard_bytes": SHARD,
        "inflight": INFLIGHT,
        "lazyckpt_format": FORMAT_VERSION,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    path = args.out / f"zarr-{report['machine']['slug']}-{stamp}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    print(f"\nwritten to {shown}")


if __name__ == "__main__":
    main()
