"""A cadence per tier: a snapshot every step into host memory and a node-local file tier,
with a throttled "PFS" tier taking every snapshot or only every 10th.

    python bench/cadence.py              # 61 MiB of state, 3 + 30 steps, 3 reps: 2.5 minutes here
    python bench/cadence.py --quick      # seconds: for the test suite

A real training loop on the CPU: the GPT of ``bench/model.py`` (4 layers of width 256, a
vocabulary of 8192: 5.3 M parameters, 61 MiB with AdamW's two moments), AdamW, a batch of
4 x 64 tokens, a snapshot of ``{"model", "optim"}`` after every optimizer step, the optimizer
guarded (``ckpt.guard(optimizer)``). The chain: ``HostMemoryTier`` (room for 3 snapshots),
``FileTier`` (node-local, ``keep_last=2``), then ``pfs``: a ``ZarrTier`` on a local directory
(level PFS, ``keep_last=2``) behind :class:`ThrottledTier`, a link of ``--pfs-mib-s`` MiB/s
shared by all its requests plus ``--pfs-latency-ms`` per request, like a parallel file
system or an object store that the whole cluster shares.

Configurations, alternating in one run (``common.abab``), each from a fresh model and
Checkpointer:

- ``none``: no checkpointing;
- ``everywhere``: the chain, every snapshot to every tier (no cadence, as before);
- ``cadence``: the chain with ``cadence={"pfs": 10}``; the default ``emergency_tiers``, so
  the drain at the end (what ``close()`` does) writes an emergency copy of the last step,
  which the cadence skipped.

Reported per configuration: the stall per step (the time the training thread waits: in
``snapshot()`` and in the guard, from ``handle.stats``; and the wall time of the guarded
``optimizer.step()`` plus ``snapshot()`` less ``none``'s ``optimizer.step()``), the loop time
over ``none``'s in the same rep, the backlog when the loop ends (snapshots not yet committed
on every tier that takes them, and the bytes then on the local tier), the ``drain()`` after
the loop, and what the slow tier was sent: bytes, requests (``begin``, ``put_shard``,
``commit``, ``delete``), the steps committed there.
Warm-up steps are snapshotted but not timed; the slow tier's counts cover the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import REPO, MiB, Progress, abab, loadavg, machine_info, scratch_dir, summarize
from model import GPT, GPTConfig, adamw_state_bytes, random_batch

import lazyckpt
from lazyckpt.testing import FaultyTier
from tiers import FileTier, HostMemoryTier, ZarrTier

CONFIGS = ("none", "everywhere", "cadence")
LABELS = {
    "none": "no checkpointing",
    "everywhere": "every snapshot to every tier",
    "cadence": "pfs every {every} steps",
}
SLOW = "pfs"

FULL = {
    "vocab": 8192, "width": 256, "layers": 4, "batch": 4, "seq": 64,
    "warmup": 3, "iters": 30, "every": 10, "reps": 3, "host_snapshots": 3, "pfs_mib_s": 64.0, "pfs_latency_ms": 20.0,
}
QUICK = {
    "vocab": 4096, "width": 128, "layers": 2, "batch": 2, "seq": 32,
    "warmup": 1, "iters": 11, "every": 5, "reps": 1, "host_snapshots": 3, "pfs_mib_s": 16.0, "pfs_latency_ms": 10.0,
}


class ThrottledTier(FaultyTier):
    """A tier behind a slow shared link: its puts share ``mib_s`` MiB/s of bandwidth (a
    put's bytes queue behind the bytes already sent) and every request pays ``latency_s``.

    The inner tier's own write runs during that time, so a put takes the longer of the two.
    Counts what it was sent (``FaultyTier.calls`` and ``bytes_written``) and the steps it
    committed, in order.
    """

    def __init__(self, inner: lazyckpt.Tier, *, mib_s: float, latency_s: float) -> None:
        super().__init__(inner)
        self.bytes_per_s = mib_s * MiB
        self.latency_s = latency_s
        self.committed: list[int] = []
        self._link_free = 0.0  # time.monotonic() at which the link has sent what is queued

    def _done_at(self, nbytes: int) -> float:
        now = time.monotonic()
        if nbytes:
            self._link_free = max(now, self._link_free) + nbytes / self.bytes_per_s
            return self._link_free + self.latency_s
        return now + self.latency_s

    @staticmethod
    async def _until(t: float) -> None:
        await asyncio.sleep(max(0.0, t - time.monotonic()))

    async def begin(self, manifest: Any) -> None:
        t = self._done_at(0)
        await super().begin(manifest)
        await self._until(t)

    async def put_shard(self, manifest: Any, shard: Any, data: memoryview) -> None:
        t = self._done_at(len(data))
        await super().put_shard(manifest, shard, data)
        await self._until(t)

    async def commit(self, manifest: Any) -> None:
        t = self._done_at(0)
        await super().commit(manifest)
        await self._until(t)
        self.committed.append(manifest.step)

    async def delete(self, step: int) -> None:
        t = self._done_at(0)
        await super().delete(step)
        await self._until(t)


def chain(root: Path, state_bytes: int, p: dict[str, Any]) -> tuple[list[lazyckpt.Tier], ThrottledTier]:
    slow = ThrottledTier(
        ZarrTier(root / "pfs", name=SLOW, keep_last=2),
        mib_s=p["pfs_mib_s"],
        latency_s=p["pfs_latency_ms"] / 1e3,
    )
    tiers = [
        HostMemoryTier(p["host_snapshots"] * state_bytes + (16 << 20), name="host"),
        FileTier(root / "local", name="local", keep_last=2),
        slow,
    ]
    return tiers, slow


def model_of(p: dict[str, Any]) -> tuple[GPT, torch.optim.Optimizer, GPTConfig]:
    cfg = GPTConfig(
        vocab_size=p["vocab"], block_size=p["seq"], n_layer=p["layers"], n_head=4, n_embd=p["width"]
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg


async def run_one(config: str, p: dict[str, Any], root: Path) -> dict[str, Any]:
    """One training run of ``warmup + iters`` steps under ``config``."""
    model, opt, cfg = model_of(p)
    gen = torch.Generator().manual_seed(1)
    steps = p["warmup"] + p["iters"]
    opt_s: list[float] = []  # wall time of the (guarded) optimizer.step()
    snap_s: list[float] = []  # wall time of snapshot()
    iter_s: list[float] = []
    handles: list[lazyckpt.SnapshotHandle] = []
    ckpt: lazyckpt.Checkpointer | None = None
    slow: ThrottledTier | None = None
    if config != "none":
        tiers, slow = chain(root, adamw_state_bytes(model), p)
        options: dict[str, Any] = {}
        if config == "cadence":
            options["cadence"] = {SLOW: p["every"]}
        ckpt = lazyckpt.Checkpointer(tiers, **options)
        await ckpt.open()
        ckpt.guard(opt)
    t_loop = 0.0
    pending: list[int] = []  # snapshots not yet committed on every tier taking them, per step
    for step in range(1, steps + 1):
        if step == p["warmup"] + 1:
            t_loop = time.perf_counter()
        t0 = time.perf_counter()
        x, y = random_batch(cfg, p["batch"], p["seq"], gen)
        model(x, y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if ckpt is not None:
            handles.append(await ckpt.snapshot({"model": model, "optim": opt}, step=step))
        t4 = time.perf_counter()
        if ckpt is not None:
            pending.append(sum(not h.done() for h in handles))
        if step > p["warmup"]:
            opt_s.append(t2 - t1)
            snap_s.append(t4 - t3)
            iter_s.append(t4 - t0)
    loop_s = time.perf_counter() - t_loop
    row: dict[str, Any] = {
        "config": config,
        "steps": steps,
        "loop_s": loop_s,
        "iter_s": summarize(iter_s),
        "optimizer_step_s": summarize(opt_s),
        "snapshot_wall_s": summarize(snap_s),
        "opt_plus_snapshot_s": [o + s for o, s in zip(opt_s, snap_s, strict=True)],
    }
    if ckpt is None or slow is None:
        return row
    local_bytes = sum(f.stat().st_size for f in (root / "local").rglob("*") if f.is_file())
    pfs_newest = max(slow.committed, default=0)
    t0 = time.perf_counter()
    report = await ckpt.drain()
    drain_s = time.perf_counter() - t0
    metrics = ckpt.metrics()
    await ckpt.aclose()
    close_s = time.perf_counter() - t0
    timed = handles[p["warmup"] :]
    stats = [h.stats for h in timed if h.stats is not None]
    stall = [s.snapshot_s + s.guard_s for s in stats]
    row |= {
        "pending_max": max(pending),
        "pending_at_end": pending[-1],
        "pfs_newest_at_end": pfs_newest,
        "local_bytes_at_end": local_bytes,
        "drain_s": drain_s,
        "drain_and_close_s": close_s,
        "stall_stats_s": summarize(stall),
        "stall_stats_mean_s": statistics.fmean(stall) if stall else 0.0,
        "snapshot_stats_s": summarize([s.snapshot_s for s in stats]),
        "guard_stats_s": summarize([s.guard_s for s in stats]),
        "snapshots_skipped": metrics.get("snapshots_skipped", 0),
        "emergency": {str(k): list(v) for k, v in report.emergency.items()},
        "drain_failed": {str(k): list(v) for k, v in report.failed.items()},
        "durable": report.durable,
        "slow_tier": {
            "bytes": slow.bytes_written,
            "bytes_metrics": metrics.get("tiers", {}).get(SLOW, {}).get("bytes"),
            "requests": {
                m: slow.calls[m] for m in ("begin", "put_shard", "commit", "delete", "abort")
            },
            "requests_total": sum(slow.calls[m] for m in ("begin", "put_shard", "commit", "delete", "abort")),
            "committed_steps": list(slow.committed),
        },
        "local_tier_bytes": metrics.get("tiers", {}).get("local", {}).get("bytes"),
    }
    return row


def aggregate(rows: Sequence[dict[str, Any]], p: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: medians over the reps, ratios paired within each rep."""
    by: dict[str, list[dict[str, Any]]] = {c: [r for r in rows if r["config"] == c] for c in CONFIGS}
    none_opt = statistics.median(r["optimizer_step_s"]["median"] for r in by["none"])
    none_loop = {r["rep"]: r["loop_s"] for r in by["none"]}
    out: dict[str, Any] = {}
    for config, rs in by.items():
        entry: dict[str, Any] = {
            "label": LABELS[config].format(every=p["every"]),
            "reps": len(rs),
            "loop_s": summarize([r["loop_s"] for r in rs]),
            "iter_s_median": summarize([r["iter_s"]["median"] for r in rs]),
            "loop_over_none": summarize([r["loop_s"] / none_loop[r["rep"]] for r in rs]),
        }
        if config != "none":
            walls = [x - none_opt for r in rs for x in r["opt_plus_snapshot_s"]]
            entry |= {
                "stall_stats_per_step_s": summarize([r["stall_stats_mean_s"] for r in rs]),
                "stall_stats_median_s": summarize([r["stall_stats_s"]["median"] for r in rs]),
                "stall_wall_per_step_s": summarize([max(0.0, w) for w in walls]),
                "stall_wall_mean_s": statistics.fmean(walls),
                "drain_s": summarize([r["drain_s"] for r in rs]),
                "pending_at_end": summarize([r["pending_at_end"] for r in rs]),
                "pending_max": summarize([r["pending_max"] for r in rs]),
                "local_bytes_at_end": summarize([r["local_bytes_at_end"] for r in rs]),
                "slow_bytes": summarize([r["slow_tier"]["bytes"] for r in rs]),
                "slow_requests": summarize([r["slow_tier"]["requests_total"] for r in rs]),
                "slow_puts": summarize([r["slow_tier"]["requests"]["put_shard"] for r in rs]),
                "slow_commits": summarize([r["slow_tier"]["requests"]["commit"] for r in rs]),
                "slow_committed_steps": rs[0]["slow_tier"]["committed_steps"],
                "emergency": rs[0]["emergency"],
                "snapshots_skipped": sum(r["snapshots_skipped"] for r in rs),
                "drain_failed": [r["drain_failed"] for r in rs if r["drain_failed"]],
            }
        out[config] = entry
    return out


def _ms(s: dict[str, Any]) -> str:
    return f"{s['median'] * 1e3:,.0f} ms ({s['min'] * 1e3:,.0f}-{s['max'] * 1e3:,.0f})"


def table(doc: dict[str, Any]) -> str:
    """The Markdown table of the summary (medians over the reps, min-max in brackets)."""
    lines = [
        "| configuration | stall per step | loop / none | pfs backlog at loop end | "
        "drain at end | bytes to pfs | requests to pfs (puts, commits) | steps committed on pfs |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for config in CONFIGS:
        e = doc["summary"][config]
        ratio = e["loop_over_none"]
        ratio_s = f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
        if config == "none":
            loop = e["loop_s"]["median"]
            lines.append(f"| {e['label']} | — | 1 ({loop:.1f} s) | — | — | — | — | — |")
            continue
        steps = e["slow_committed_steps"]
        emergency = [int(k) for k in e["emergency"]]
        steps_s = ", ".join(f"{s}*" if s in emergency else str(s) for s in steps)
        if len(steps) > 8:
            steps_s = f"all {len(steps)}"
        lines.append(
            f"| {e['label']} | {_ms(e['stall_stats_per_step_s'])} | {ratio_s} | "
            f"{e['pending_at_end']['median']:.0f} snapshots, "
            f"{e['local_bytes_at_end']['median'] / MiB:,.0f} MiB on local | "
            f"{e['drain_s']['median']:.1f} s | {e['slow_bytes']['median'] / MiB:,.0f} MiB | "
            f"{e['slow_requests']['median']:.0f} ({e['slow_puts']['median']:.0f}, "
            f"{e['slow_commits']['median']:.0f}) | {steps_s} |"
        )
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    p = doc["params"]
    m = doc["machine"]
    return "\n".join([
        f"# A cadence per tier ({doc['date']})",
        "",
        f"`bench/cadence.py{' --quick' if doc['quick'] else ''}` on {m['slug']} "
        f"({m['cpus']} CPUs, torch {m['torch']}, {m['torch_threads']} thread): "
        f"GPT {p['layers']}x{p['width']}, vocab {p['vocab']}, "
        f"{doc['state_bytes'] / MiB:.1f} MiB of state (weights + AdamW), "
        f"{p['warmup']} + {p['iters']} steps, a snapshot every step, {p['reps']} reps alternating. "
        f"Chain: host, local file, pfs (Zarr behind {p['pfs_mib_s']:g} MiB/s and "
        f"{p['pfs_latency_ms']:g} ms per request). Load average {doc['loadavg_before']} before, "
        f"{doc['loadavg_after']} after.",
        "",
        table(doc),
        "",
        "Stall per step: mean of `handle.stats.snapshot_s + guard_s` (the JSON also has the wall "
        "time of the guarded `optimizer.step()` + `snapshot()` less `optimizer.step()` without "
        "checkpointing). Backlog: snapshots not yet committed on every tier that takes them "
        "when the loop ends, and the bytes on the local tier then (`keep_last=2`). Drain: "
        "`drain()` after the loop. Medians over reps (min-max). Bytes and requests to pfs: the "
        "whole run, warm-up and drain included (requests: begin, put_shard, commit, delete). "
        "`*`: the emergency copy written by the drain.",
        "",
    ])


async def main_async(p: dict[str, Any], tmp: Path | None, progress: Progress) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for rep, config in abab(CONFIGS, p["reps"]):
        with scratch_dir(tmp, "lazyckpt-cadence-") as root:
            row = await run_one(config, p, root)
        row["rep"] = rep
        rows.append(row)
        extra = ""
        if config != "none":
            extra = (
                f", stall {row['stall_stats_mean_s'] * 1e3:.0f} ms/step, drain {row['drain_s']:.1f} s, "
                f"pending max {row['pending_max']} end {row['pending_at_end']}, "
                f"local {row['local_bytes_at_end'] / MiB:.0f} MiB, "
                f"pfs {row['slow_tier']['bytes'] / MiB:.0f} MiB, steps {row['slow_tier']['committed_steps']}"
            )
        progress(f"rep {rep} {config}: loop {row['loop_s']:.1f} s{extra}")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, for the test suite")
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None,
                            help=f"default {value} ({QUICK[key]} with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for training (1: the checkpoint's own threads get the other core)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--tmp", type=Path, default=None, help="scratch parent (default runs/)")
    args = parser.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    for key in FULL:
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    torch.set_num_threads(args.threads)
    progress = Progress()
    state_bytes = adamw_state_bytes(model_of(p)[0])
    progress(f"cadence bench: {state_bytes / MiB:.1f} MiB of state, {p}")
    doc: dict[str, Any] = {
        "benchmark": "cadence",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine_info(),
        "loadavg_before": loadavg(),
        "params": p,
        "state_bytes": state_bytes,
    }
    t0 = time.perf_counter()
    rows = asyncio.run(main_async(p, args.tmp, progress))
    doc["elapsed_s"] = time.perf_counter() - t0
    doc["loadavg_after"] = loadavg()
    doc["summary"] = aggregate(rows, p)
    for r in rows:
        r.pop("opt_plus_snapshot_s", None)
    doc["rows"] = rows
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    path = out / f"cadence-{doc['machine']['slug']}-{stamp}{'-quick' if args.quick else ''}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(doc))
    print(table(doc))
    print(f"wrote {path} and {path.with_suffix('.md').name}", file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
