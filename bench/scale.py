"""Scale figures, measured: lazyckpt's per-rank costs against the number of ranks and of
tensors, next to DCP's, on real gloo jobs on loopback.

Each job is a set of processes (``bench/scale_worker.py``, one per rank, ``MASTER_ADDR``
127.0.0.1 on a free port, ``GLOO_SOCKET_IFNAME=lo``) that measures in-process and writes
one JSON per rank; this script launches the jobs, gathers their figures and writes
``bench/results/scale-<machine>-<date>.json`` and the tables as Markdown next to it.

- **sweep**, at 2, 4, 8 and 16 ranks: a small FSDP-like state (64 ``Shard(0)`` DTensors of
  4 KiB per rank on a 1-D mesh of every rank, plus 16 tensors of 4 KiB inside
  ``lazyckpt.Replicated``, as a model's norms would be) snapshotted on a ``FileTier``:
  the time ``snapshot()`` takes to return, the time until the step is committed (every
  rank's part durable and the ranks agreed), the ``torch.distributed`` calls made per
  snapshot (counted by wrapping the module's functions, on lazyckpt's own groups and on
  the default group) and lazyckpt's own count of its collectives
  (``Coordinator.collectives``); then a restore into the live state (a resume), with the
  time before the first shard read (restore planning: the rank manifests read, the
  agreement on who reads what) and the bytes read. DCP on the same state, alternating:
  ``dcp.save`` (time to its first ``write_data``, seconds in its default planner, total,
  calls) and ``dcp.load`` (the same for reading).
- **many**, at 1 and 2 ranks: 10,000 and 100,000 tiny ``Shard(0)`` DTensors per rank (16
  values each), the same figures.
- **readonce**, on 4 ranks: a data-parallel state (``Replicated`` weights) and an HSDP 2x2
  model (``fully_shard`` on a 2-D mesh) restored on the same layout, the page cache dropped
  before each restore: bytes read from the files in all over the bytes stored (the target is
  at most 1.3), and time, against ``dcp.load`` with its default planner.

The machine is what it is: 2 cores. At 8 and 16 ranks the processes are oversubscribed
(8 to 1 at 16 ranks), so the times there measure the scheduler as much as the code; the
counts (calls, manifests read, bytes) do not depend on it. ``docs/distributed.md`` models
16 to 16,000 ranks from these figures.

    python bench/scale.py            # everything (about 15 minutes here)
    python bench/scale.py --quick    # 2 and 4 ranks, tiny states (about a minute)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, Progress, loadavg, machine_info, scratch_dir, summarize

PARTS = ("sweep", "many", "readonce")
WORKER = Path(__file__).resolve().parent / "scale_worker.py"

SWEEP = {"tensors": 64, "numel": 1024, "replicated": 16, "rep_numel": 1024, "reps": 5,
         "restore_reps": 4}
FULL: dict[str, Any] = {
    "sweep_worlds": [2, 4, 8, 16],
    "sweep": SWEEP,
    "many_worlds": [1, 2],
    "many": {
        "cases": [["dtensor", 10_000], ["plain", 10_000], ["plain", 100_000]],
        "numel": 16, "reps": 1, "restore_reps": 2,
    },
    "readonce": {"layouts": ["ddp", "hsdp"], "width": 512, "blocks": 4, "reps": 3},
}
QUICK: dict[str, Any] = {
    "sweep_worlds": [2, 4],
    "sweep": {**SWEEP, "tensors": 16, "replicated": 4, "reps": 2, "restore_reps": 2},
    "many_worlds": [2],
    "many": {"cases": [["dtensor", 300], ["plain", 1_000]], "numel": 16, "reps": 1,
             "restore_reps": 2},
    "readonce": {"layouts": ["ddp", "hsdp"], "width": 128, "blocks": 2, "reps": 1},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, config: dict[str, Any], tmp: Path, timeout: float) -> dict[str, Any]:
    """Run one job of ``world`` ranks; every rank's result, and the job's wall time. Every
    process ends: one still running after ``timeout`` seconds is killed."""
    out = Path(tempfile.mkdtemp(prefix=f"scale-{world}-", dir=tmp))
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps({**config, "root": str(out / "data")}))
    port = str(free_port())
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        logs = []
        try:
            for rank in range(world):
                env = dict(
                    os.environ,
                    RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                    GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                )
                log = stack.enter_context(tempfile.TemporaryFile())
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), str(cfg_path), str(out)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                ))
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                codes = [p.poll() for p in procs]
                if None not in codes or any(c not in (None, 0) for c in codes):
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            codes = [proc.wait() for proc in procs]
        if any(codes):
            report = []
            for r, code in enumerate(codes):
                if code:
                    logs[r].seek(0)
                    report.append(f"-- rank {r} (exit {code}):\n{logs[r].read().decode()[-3000:]}")
            raise RuntimeError(f"{world}-rank job failed:\n" + "\n".join(report[:3]))
    wall = time.perf_counter() - t0
    ranks = {}
    for r in range(world):
        ranks[r] = json.loads((out / f"rank{r}.json").read_text())
    return {"wall_s": wall, "ranks": ranks}


# -- aggregation ------------------------------------------------------------------------------


def _values(ranks: dict[int, Any], get: Any) -> list[float]:
    out: list[float] = []
    for r in ranks.values():
        v = get(r)
        out.extend(v if isinstance(v, list) else [v])
    return out


def _slowest(ranks: dict[int, Any], rows: str, key: str, where: Any) -> list[float]:
    """Per repetition, the slowest rank's ``key`` (what the job waits for)."""
    per_rank = [where(r)[rows] for r in ranks.values()]
    return [max(rr[i][key] for rr in per_rank) for i in range(len(per_rank[0]))]


def _calls(row: dict[str, Any], group: str) -> dict[str, int]:
    return {k.split(":", 1)[1]: v for k, v in row.get("calls", {}).items() if k.startswith(group + ":")}


def _med(xs: list[float]) -> float:
    return float(summarize(xs)["median"])


def aggregate(ranks: dict[int, Any], where: Any) -> dict[str, Any]:
    """One save/restore comparison (``where(rank_result)`` picks it out of a rank's result)."""
    r0 = where(ranks[0])
    world = len(ranks)
    snaps = r0["snapshots"]
    lazy_restores = [where(r)["restores"] for r in ranks.values()]
    dcp_loads = [where(r)["dcp_loads"] for r in ranks.values()]
    stored = r0["stored_bytes"]
    n_restore = len(lazy_restores[0])
    n_load = len(dcp_loads[0])
    return {
        "world": world,
        "local_bytes_per_rank": r0["local_bytes"],
        "stored_bytes": stored,
        "open": {
            "seconds": summarize(_values(ranks, lambda r: where(r)["open"]["open_s"])),
            "calls_own": _calls(r0["open"], "own"),
            "calls_default": _calls(r0["open"], "default"),
        },
        "lazyckpt_snapshot": {
            "snapshot_s": summarize(_values(ranks, lambda r: [s["snapshot_s"] for s in where(r)["snapshots"]])),
            "commit_s": summarize(_slowest(ranks, "snapshots", "commit_s", where)),
            "cold_snapshot_s": summarize(_values(ranks, lambda r: where(r)["warmup"]["snapshot_s"])),
            "coordinator_collectives": [s["coordinator_collectives"] for s in snaps],
            "calls_own": _calls(snaps[-1], "own"),
            "calls_default": _calls(snaps[-1], "default"),
            "call_s_own": {k.split(":", 1)[1]: v for k, v in snaps[-1].get("call_s", {}).items()
                           if k.startswith("own:")},
        },
        "lazyckpt_restore": {
            "restore_s": summarize(_slowest(ranks, "restores", "restore_s", where)),
            "planning_s": summarize(_slowest(ranks, "restores", "to_first_read_s", where)),
            "planning_s_all_ranks": summarize(_values(ranks, lambda r: [x["to_first_read_s"] for x in where(r)["restores"]])),
            "manifests_read_per_rank": where(ranks[0])["restores"][-1]["manifests_read"],
            "manifest_read_s": summarize(_values(ranks, lambda r: [x["manifest_read_s"] for x in where(r)["restores"]])),
            "share_plan_s": summarize(_values(ranks, lambda r: [x["share_plan_s"] for x in where(r)["restores"]])),
            "coordinator_collectives": where(ranks[0])["restores"][-1]["coordinator_collectives"],
            "calls_own": _calls(where(ranks[0])["restores"][-1], "own"),
            "calls_default": _calls(where(ranks[0])["restores"][-1], "default"),
            "read_over_stored": [
                sum(rr[i]["read_bytes"] for rr in lazy_restores) / max(1, stored["lazyckpt"])
                for i in range(n_restore)
            ],
            "mismatches": sum(len(x["mismatch"]) for rr in lazy_restores for x in rr),
        },
        "dcp_save": {
            "save_s": summarize(_slowest(ranks, "dcp_saves", "save_s", where)),
            "planning_s": summarize(_slowest(ranks, "dcp_saves", "to_first_write_s", where)),
            "planner_s": summarize(_values(ranks, lambda r: [x["planner_s"] for x in where(r)["dcp_saves"]])),
            "planner_s_rank0": summarize([x["planner_s"] for x in r0["dcp_saves"]]),
            "calls_default": _calls(r0["dcp_saves"][-1], "default"),
        },
        "dcp_load": {
            "load_s": summarize(_slowest(ranks, "dcp_loads", "load_s", where)),
            "planning_s": summarize(_slowest(ranks, "dcp_loads", "to_first_read_s", where)),
            "planner_s": summarize(_values(ranks, lambda r: [x["planner_s"] for x in where(r)["dcp_loads"]])),
            "calls_default": _calls(r0["dcp_loads"][-1], "default"),
            "read_over_stored": [
                sum(rr[i]["read_bytes"] for rr in dcp_loads) / max(1, stored["dcp"])
                for i in range(n_load)
            ],
            "mismatches": sum(len(x["mismatch"]) for rr in dcp_loads for x in rr),
        },
    }


def aggregate_readonce(ranks: dict[int, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout, r0 in ranks[0]["readonce"].items():
        per = [r["readonce"][layout] for r in ranks.values()]
        stored = r0["stored_bytes"]
        n = len(r0["restores"])
        lazy_read = [sum(p["restores"][i]["read_bytes"] for p in per) for i in range(n)]
        dcp_read = [sum(p["dcp_loads"][i]["read_bytes"] for p in per) for i in range(n)]
        out[layout] = {
            "world": len(ranks),
            "state_bytes": r0["state_bytes"],
            "stored_bytes": stored,
            "lazyckpt": {
                "read_bytes": lazy_read,
                "read_over_stored": [b / stored["lazyckpt"] for b in lazy_read],
                "sent_bytes": [sum(p["restores"][i]["sent_bytes"] for p in per) for i in range(n)],
                "restore_s": summarize([max(p["restores"][i]["restore_s"] for p in per) for i in range(n)]),
                "planning_s": summarize([max(p["restores"][i]["to_first_read_s"] for p in per) for i in range(n)]),
                "mismatches": sum(len(x["mismatch"]) for p in per for x in p["restores"]),
            },
            "dcp": {
                "read_bytes": dcp_read,
                "read_over_stored": [b / stored["dcp"] for b in dcp_read],
                "load_s": summarize([max(p["dcp_loads"][i]["load_s"] for p in per) for i in range(n)]),
                "planning_s": summarize([max(p["dcp_loads"][i]["to_first_read_s"] for p in per) for i in range(n)]),
                "mismatches": sum(len(x["mismatch"]) for p in per for x in p["dcp_loads"]),
            },
        }
    return out


# -- report ---------------------------------------------------------------------------------


def _ms(s: dict[str, Any]) -> str:
    return f"{s['median'] * 1e3:,.1f}"


def _calls_str(calls: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(calls.items())) or "none"


def markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    lines = [
        f"# Scale figures ({doc['date']}{', quick' if doc['quick'] else ''})",
        "",
        f"Machine: {m['cpus']} CPUs, {m['mem_gib']} GiB, torch {m['torch']}, Python {m['python']}; "
        f"load average before {doc['loadavg_before']}, after {doc['loadavg_after']}. "
        "gloo on loopback; every rank a process, so 8 and 16 ranks oversubscribe the CPUs "
        "(times there measure the scheduler too; counts do not). Medians; the job's figure "
        "is the slowest rank's where the job waits for every rank (commit, restore, DCP).",
        "",
        "Command: `python bench/scale.py" + (" --quick" if doc["quick"] else "") + "`",
        "",
    ]
    r = doc["results"]

    def save_table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> None:
        lines.extend([
            f"## {title}: save", "",
            "| ranks | tensors/rank | `snapshot()` warm (ms) | cold (ms) | to committed (ms) | lazyckpt collectives/snapshot | torch.distributed calls/snapshot (own groups) | `dcp.save` planning: to first write (ms) | in planner, rank 0 (ms) | `dcp.save` total (ms) | DCP calls/save |",
            "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
        ])
        for label, a in rows:
            s, d = a["lazyckpt_snapshot"], a["dcp_save"]
            coll = sorted(set(s["coordinator_collectives"]))
            lines.append(
                f"| {label} | {a['tensors']:,} | {_ms(s['snapshot_s'])} | {_ms(s['cold_snapshot_s'])} | "
                f"{_ms(s['commit_s'])} | {'/'.join(map(str, coll))} | {_calls_str(s['calls_own'])} | "
                f"{_ms(d['planning_s'])} | {_ms(d['planner_s_rank0'])} | {_ms(d['save_s'])} | "
                f"{_calls_str(d['calls_default'])} |"
            )
        lines.extend([
            "", f"## {title}: restore", "",
            "| ranks | tensors/rank | lazyckpt planning: to first read (ms) | other ranks' manifests read from the tier, per rank | manifest reads, summed (ms) | lazyckpt restore (ms) | read / stored | lazyckpt calls (own groups) | `dcp.load` planning: to first read (ms) | `dcp.load` total (ms) | read / stored | DCP calls/load |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
        ])
        for label, a in rows:
            x, d = a["lazyckpt_restore"], a["dcp_load"]
            lines.append(
                f"| {label} | {a['tensors']:,} | {_ms(x['planning_s'])} | {x['manifests_read_per_rank']} | "
                f"{_ms(x['manifest_read_s'])} | {_ms(x['restore_s'])} | {_med(x['read_over_stored']):.2f} | "
                f"{_calls_str(x['calls_own'])} | {_ms(d['planning_s'])} | {_ms(d['load_s'])} | "
                f"{_med(d['read_over_stored']):.2f} | {_calls_str(d['calls_default'])} |"
            )
        lines.append("")

    if r["sweep"]:
        save_table("Sweep (small state)", [(str(a["world"]), a) for a in r["sweep"]])
    if r["many"]:
        save_table("Many tensors", [(f"{a['world']}, {a['kind']}", a) for a in r["many"]])
    if not r["readonce"]:
        return "\n".join(lines)
    lines.extend([
        "## Read once on restore (4 ranks, same layout, page cache dropped)", "",
        "| layout | state (MiB) | lazyckpt stored (MiB) | lazyckpt read / stored | sent between ranks (MiB) | lazyckpt restore (ms) | planning (ms) | DCP stored (MiB) | `dcp.load` read / stored | `dcp.load` (ms) | planning (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ])
    for layout, a in r["readonce"].items():
        lz, d = a["lazyckpt"], a["dcp"]
        lines.append(
            f"| {layout} | {a['state_bytes'] / 2**20:.1f} | {a['stored_bytes']['lazyckpt'] / 2**20:.1f} | "
            f"{_med(lz['read_over_stored']):.3f} | {_med(lz['sent_bytes']) / 2**20:.1f} | {_ms(lz['restore_s'])} | "
            f"{_ms(lz['planning_s'])} | {a['stored_bytes']['dcp'] / 2**20:.1f} | "
            f"{_med(d['read_over_stored']):.3f} | {_ms(d['load_s'])} | {_ms(d['planning_s'])} |"
        )
    lines.extend(["", "Job wall times (s, process start to exit): "
                  + ", ".join(f"{k}: {v:.1f}" for k, v in doc["job_wall_s"].items()), ""])
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def run(
    config: dict[str, Any], tmp: Path, progress: Progress, timeout: float, only: set[str]
) -> dict[str, Any]:
    """Launch the jobs of the parts in ``only``, one job per world size (the parts of the
    same size share its start-up)."""
    results: dict[str, Any] = {"sweep": [], "many": [], "readonce": {}}
    walls: dict[str, float] = {}
    jobs: dict[int, list[str]] = {}  # world size -> the parts its one job runs
    for world in config["sweep_worlds"] if "sweep" in only else []:
        jobs.setdefault(world, []).append("sweep")
    if "readonce" in only:
        jobs.setdefault(4, []).append("readonce")
    for world in config["many_worlds"] if "many" in only else []:
        jobs.setdefault(world, []).append("many")
    for world, parts in sorted(jobs.items()):
        job = launch(world, {**config, "parts": parts}, tmp, timeout)
        walls[f"{'+'.join(parts)}-{world}"] = job["wall_s"]
        progress(f"{world}-rank job ({', '.join(parts)}): {job['wall_s']:.0f} s")
        if "sweep" in parts:
            a = aggregate(job["ranks"], lambda r: r["sweep"])
            a["tensors"] = config["sweep"]["tensors"] + config["sweep"]["replicated"]
            results["sweep"].append(a)
            progress(
                f"  sweep: snapshot() {_ms(a['lazyckpt_snapshot']['snapshot_s'])} ms, committed "
                f"{_ms(a['lazyckpt_snapshot']['commit_s'])} ms, restore planning "
                f"{_ms(a['lazyckpt_restore']['planning_s'])} ms; dcp.save planning "
                f"{_ms(a['dcp_save']['planning_s'])} ms, dcp.load {_ms(a['dcp_load']['load_s'])} ms"
            )
        if "readonce" in parts:
            results["readonce"] = aggregate_readonce(job["ranks"])
            for layout, ro in results["readonce"].items():
                progress(
                    f"  read once, {layout}: lazyckpt {_med(ro['lazyckpt']['read_over_stored']):.3f}x "
                    f"stored in {_ms(ro['lazyckpt']['restore_s'])} ms; dcp.load "
                    f"{_med(ro['dcp']['read_over_stored']):.3f}x in {_ms(ro['dcp']['load_s'])} ms"
                )
        if "many" in parts:
            for kind, n in config["many"]["cases"]:
                a = aggregate(job["ranks"], lambda r, k=f"{kind}-{n}": r["many"][k])
                a["tensors"] = n
                a["kind"] = kind
                results["many"].append(a)
                progress(
                    f"  {n:,} {kind} tensors: snapshot() {_ms(a['lazyckpt_snapshot']['snapshot_s'])} ms, "
                    f"committed {_ms(a['lazyckpt_snapshot']['commit_s'])} ms, restore planning "
                    f"{_ms(a['lazyckpt_restore']['planning_s'])} ms; dcp.save planning "
                    f"{_ms(a['dcp_save']['planning_s'])} ms, dcp.load {_ms(a['dcp_load']['load_s'])} ms"
                )
    return {"results": results, "job_wall_s": walls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, tiny states")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--tmp", default=None, help="scratch directory (default: runs/)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per job")
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts ({', '.join(PARTS)})"
    )
    parser.add_argument(
        "--many-worlds", default=None, help="comma-separated world sizes of the many-tensor jobs"
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    if not only <= set(PARTS):
        parser.error(f"--only takes {', '.join(PARTS)}")
    config = dict(QUICK if args.quick else FULL)
    if args.many_worlds:
        config["many_worlds"] = [int(w) for w in args.many_worlds.split(",")]
    timeout = args.timeout or (80 if args.quick else 900)
    progress = Progress()
    machine = machine_info()
    before = loadavg()
    with scratch_dir(args.tmp, "scale-") as tmp:
        measured = run(config, tmp, progress, timeout, only)
    now = dt.datetime.now()
    doc = {
        "schema": 1,
        "bench": "scale",
        "quick": args.quick,
        "date": now.strftime("%Y-%m-%d %H:%M"),
        "machine": machine,
        "loadavg_before": before,
        "loadavg_after": loadavg(),
        "config": config,
        "parts": sorted(only),
        **measured,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"scale-{machine['slug']}-{now.strftime('%Y%m%d-%H%M%S')}"
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(doc))
    progress(f"wrote {out / stem}.json and .md")


if __name__ == "__main__":
    main()
