"""A simulated multi-rank commit: what the file side of the commit protocol costs for N ranks.

One process plays every rank, one after another, through ``FileTier``'s own code: each
logical rank ``begin``s its step (creates its data file), writes its one small shard (its 200 tensors, packed), and commits
its part (its rank manifest, written to a temporary name, fsynced, renamed, the directory
fsynced); then the commit record is written once. This is the metadata work a shared file
system sees per committed step, without the data bandwidth. Then, optionally, the
agreement the ranks run per step and tier, timed over real gloo processes on loopback for
small worlds: the ``all_reduce`` lazyckpt uses, side by side with the ``all_gather_object``
it replaced.

    python bench/dist_commit_sim.py                      # N = 8, 64, 512, 4096
    python bench/dist_commit_sim.py --ranks 8 64 --gloo 2 4 8

Prints a Markdown table (the one in ``docs/distributed.md``) and, with ``--json``, writes
the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lazyckpt import LayoutOptions
from lazyckpt._format.manifest import plan_layout
from lazyckpt._format.walk import walk_state
from tiers import FileTier

TENSORS_PER_RANK = 200  # a manifest of the size a real model's shard has (200 entries)


def rank_state() -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.zeros(1) for i in range(TENSORS_PER_RANK)}


async def simulate(world: int, root: Path) -> dict[str, Any]:
    """Commit one step as ``world`` logical ranks; return times and file counts."""
    tree, refs = walk_state(rank_state(), allow_pickle=False)
    tier = FileTier(root)
    tier.bind(0, world)
    await tier.open()
    page = memoryview(bytearray(1 << 16))
    manifest_bytes = 0
    t0 = time.perf_counter()
    for rank in range(world):
        tier.bind(rank, world)
        manifest = plan_layout(1, tree, refs, LayoutOptions(), rank=rank, world_size=world)
        manifest = manifest.with_checksums([0] * len(manifest.shards))
        await tier.begin(manifest)
        for shard in manifest.shards:
            await tier.put_shard(manifest, shard, page[: shard.length])
        await tier.commit(replace(manifest, extra={"tier": tier.describe()}))
        manifest_bytes += len(manifest.to_json())
    parts = time.perf_counter() - t0
    t1 = time.perf_counter()
    await tier.commit_global(1, world)
    record = time.perf_counter() - t1
    assert await tier.steps() == [1]
    t2 = time.perf_counter()
    await tier.read_rank_manifest(1, world - 1)  # what one rank reads to restore
    read = time.perf_counter() - t2
    files = len(list((root / "step-000000000001").iterdir()))
    await tier.aclose()
    return {
        "ranks": world,
        "parts_s": parts,
        "per_rank_ms": parts / world * 1e3,
        "record_ms": record * 1e3,
        "read_manifest_ms": read * 1e3,
        "files": files,
        "manifest_bytes_per_rank": manifest_bytes // world,
    }


GLOO_CHILD = """
import os, sys, time, json, datetime
import torch
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
group = dist.new_group(backend="gloo")
out = [None] * dist.get_world_size()

def gather(i):
    dist.all_gather_object(out, (i, True), group=group)

def reduce(i):  # what Coordinator.agree does on the common path
    t = torch.tensor([i, -i, 0], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    t.tolist()

for i in range(5):
    gather(i)
    reduce(i)
times = {"all_gather_object": [], "all_reduce": []}
for i in range(int(sys.argv[1])):  # alternating, so both see the same machine
    for name, fn in (("all_gather_object", gather), ("all_reduce", reduce)):
        t0 = time.perf_counter()
        fn(i)
        times[name].append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(json.dumps(times))
dist.destroy_process_group()
"""


def gloo_agreement(world: int, rounds: int = 50) -> dict[str, float]:
    """Median seconds of one agreement over gloo, two ways: ``all_gather_object`` of a
    ``(step, ok)`` pair (the old protocol) and ``all_reduce`` of three int64 (the current)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", GLOO_CHILD, str(rounds)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    times = json.loads(outputs[0])
    return {name: float(statistics.median(xs)) for name, xs in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--gloo", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(asyncio.run(simulate(world, Path(tmp))))
    print(
        "| ranks | files in the step | rank parts, total (s) | per rank (ms) | commit record (ms) | one manifest read (ms) | manifest bytes per rank |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['ranks']} | {r['files']} | {r['parts_s']:.2f} | {r['per_rank_ms']:.2f} | "
            f"{r['record_ms']:.2f} | {r['read_manifest_ms']:.2f} | {r['manifest_bytes_per_rank']} |"
        )
    agreements = {}
    if args.gloo:
        print("\n| ranks (gloo, loopback) | all_gather_object median (ms) | all_reduce median (ms) |")
        print("|---:|---:|---:|")
        for world in args.gloo:
            agreements[world] = gloo_agreement(world)
            a = agreements[world]
            print(f"| {world} | {a['all_gather_object'] * 1e3:.3f} | {a['all_reduce'] * 1e3:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"commit": rows, "agreement_s": agreements}, indent=1))


if __name__ == "__main__":
    main()
