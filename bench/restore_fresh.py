"""Restore as a restarted job does it: a fresh process per trial (open, restore, close),
lazyckpt against ``torch.load`` and ``dcp.load``, with the page cache cold and warm.

Three states, each written once in every format (lazyckpt's ``FileTier``, ``torch.save``,
``dcp.save``):

- ``large``: 64 float32 tensors of 8 MiB (512 MiB);
- ``16k``: 16,384 float32 tensors of 4 KiB (64 MiB), half under ``model``, half in an
  optimizer-like ``{i: {"exp_avg": t}}``;
- ``100k``: 100,000 float32 tensors of 1 KiB (98 MiB), nested the same way.

Each trial starts a new Python process that imports what its method needs, then times one
restore: for lazyckpt ``SyncCheckpointer([FileTier(path, readonly=True)])`` opened,
``restore()`` (new tensors) or ``restore(into=)`` (existing, already touched tensors, as a
model in memory is), and closed; ``torch.load(weights_only=True)``; ``dcp.load`` into
tensors it allocates inside the timing (``dcp_load_alloc``) or into existing ones
(``dcp_load_into``). Before each trial the method's files are either evicted from the page
cache (``fsync`` + ``POSIX_FADV_DONTNEED``: cold) or read through once (warm: lazyckpt's
files are written past the page cache, so a warm restore needs them read first). The
methods and both cache states alternate (``common.abab``).

Reported per state, cache state and method: wall seconds of the timed part (median and
spread), CPU seconds of the timed part (user + system of all the child's threads,
``getrusage(RUSAGE_SELF)`` inside it) and of the whole child (interpreter start and imports
included, ``getrusage(RUSAGE_CHILDREN)``), CPU seconds per GiB, and the ratios the targets
are stated in: ``restore()`` against the better of ``torch.load`` and ``dcp.load`` (alloc),
``restore(into=)`` against ``dcp.load`` into (above 1: lazyckpt faster; per round as well,
for the spread). Every method's result is checked bit for bit once (its first trial,
outside the timing).

    python bench/restore_fresh.py                   # 3 states, 3 rounds (about 25 minutes)
    python bench/restore_fresh.py --quick           # a tiny large-tensor state, 1 round
    python bench/restore_fresh.py --states large --methods lazyckpt_restore,torch_load
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    REPO,
    GiB,
    Progress,
    abab,
    drop_from_page_cache,
    loadavg,
    machine_info,
    scratch_dir,
    summarize,
)

METHODS = [
    "lazyckpt_restore",
    "lazyckpt_restore_into",
    "torch_load",
    "dcp_load_alloc",
    "dcp_load_into",
]
BEFORE = "_before"  # a lazyckpt method run with --before's code
CACHES = ["cold", "warm"]
STATES = ["large", "16k", "100k"]

# (tensors, float32 values per tensor, nested like an optimizer's state): full and quick
_SPECS: dict[str, tuple[tuple[int, int, bool], tuple[int, int, bool]]] = {
    "large": ((64, 2 << 20, False), (16, 64 << 10, False)),
    "16k": ((16384, 1024, True), (1024, 1024, True)),
    "100k": ((100000, 256, True), (3000, 256, True)),
}


def make_state(kind: str, quick: bool, fill: str) -> dict[str, Any]:
    """The state ``kind`` (see the module docstring); ``fill``: ``"random"`` (seeded, what
    is written), ``"zeros"`` (touched targets for an ``into=`` restore) or ``"empty"``."""
    count, numel, nested = _SPECS[kind][1 if quick else 0]
    gen = torch.Generator().manual_seed(0)

    def one() -> torch.Tensor:
        if fill == "random":
            return torch.randn(numel, generator=gen)
        return torch.zeros(numel) if fill == "zeros" else torch.empty(numel)

    if not nested:
        return {f"layers.{i}.weight": one() for i in range(count)}
    half = count // 2
    return {
        "model": {f"layers.{i}.weight": one() for i in range(half)},
        "optim": {i: {"exp_avg": one()} for i in range(count - half)},
    }


def _leaves(state: Any) -> list[torch.Tensor]:
    """The tensors of a nested state, in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    out: list[torch.Tensor] = []
    for k in sorted(state, key=str):
        out.extend(_leaves(state[k]))
    return out


def digest(state: Any) -> int:
    """A checksum of every tensor's bytes, in key order (to check a restore bit for bit)."""
    import crc32c

    crc = 0
    for t in _leaves(state):
        crc = crc32c.crc32c(t.contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(state))


def warm_page_cache(path: Path) -> None:
    """Read a file (or every file under a directory) through the page cache once."""
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    buf = bytearray(8 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# -- the child: one timed restore in a fresh process ---------------------------------------


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one restore as ``spec`` says, timed from the open (or the load call) to the
    close; the result's digest with ``check``."""
    method, where = spec["method"].removesuffix(BEFORE), Path(spec["path"])
    sys.path.insert(0, spec["code"])  # before the repository: --code's lazyckpt and tiers
    t_start = time.perf_counter()
    template = None
    if method in ("lazyckpt_restore_into", "dcp_load_into"):
        template = make_state(spec["state"], spec["quick"], "zeros")
    if method.startswith("lazyckpt"):
        import lazyckpt
        from tiers import FileTier

        assert Path(lazyckpt.__file__).is_relative_to(spec["code"]), lazyckpt.__file__
    elif method.startswith("dcp"):
        import warnings

        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
        warnings.filterwarnings("ignore", category=FutureWarning)
    ready = time.perf_counter() - t_start
    c0 = _cpu_seconds()
    t0 = time.perf_counter()
    if method.startswith("lazyckpt"):
        with lazyckpt.SyncCheckpointer([FileTier(where, readonly=True)]) as reader:
            out = reader.restore(into=template)
    elif method == "torch_load":
        out = torch.load(where, weights_only=True)
    elif method == "dcp_load_alloc":
        out = make_state(spec["state"], spec["quick"], "empty")
        dcp.load(out, checkpoint_id=str(where))
    else:
        dcp.load(template, checkpoint_id=str(where))
        out = template
    wall = time.perf_counter() - t0
    cpu = _cpu_seconds() - c0
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "setup_s": ready,
        "digest": digest(out) if spec["check"] else None,
    }


# -- the parent ------------------------------------------------------------------------------


def _write(kind: str, quick: bool, tmp: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from micro import _quiet_dcp_warnings, torch_save_durable

    import lazyckpt
    from tiers import FileTier

    _quiet_dcp_warnings()
    state = make_state(kind, quick, "random")
    d = tmp / kind
    with lazyckpt.SyncCheckpointer([FileTier(d / "lazy")]) as ckpt:
        ckpt.snapshot(state, step=1)
    torch_save_durable(state, d / "state.pt")
    dcp.save(state, checkpoint_id=str(d / "dcp"))
    paths = {"lazy": d / "lazy", "torch": d / "state.pt", "dcp": d / "dcp"}
    for p in paths.values():
        drop_from_page_cache(p)  # fsyncs, so the files are durable before any trial
    return {
        "paths": paths,
        "bytes": state_bytes(state),
        "tensors": len(_leaves(state)),
        "digest": digest(state),
        "file_bytes": {
            "lazyckpt": sum(f.stat().st_size for f in (d / "lazy").rglob("*") if f.is_file()),
            "torch_save": (d / "state.pt").stat().st_size,
            "dcp": sum(f.stat().st_size for f in (d / "dcp").iterdir()),
        },
    }


def _where(paths: dict[str, Path], method: str) -> Path:
    if method.startswith("lazyckpt"):  # with or without BEFORE
        return paths["lazy"]
    return paths["torch"] if method == "torch_load" else paths["dcp"]


def _trial(spec: dict[str, Any]) -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['method']} failed:\n{proc.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    got["process_s"] = elapsed
    got["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return got


def _ratio(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True) if b > 0]


def run_state(
    kind: str,
    quick: bool,
    reps: int,
    caches: list[str],
    methods: list[str],
    code: Path,
    before: Path | None,
    tmp: Path,
    progress: Progress,
) -> dict[str, Any]:
    written = _write(kind, quick, tmp)
    paths, nbytes = written["paths"], written["bytes"]
    progress(f"{kind}: {written['tensors']} tensors, {nbytes / (1 << 20):.0f} MiB written")
    combos = [f"{c}:{m}" for c in caches for m in methods]
    trials: dict[str, list[dict[str, Any]]] = {c: [] for c in combos}
    ok: dict[str, bool] = {}
    for rep, combo in abab(combos, reps):
        cache, method = combo.split(":")
        where = _where(paths, method)
        if cache == "cold":
            drop_from_page_cache(where)
        else:
            warm_page_cache(where)
        check = method not in ok
        got = _trial(
            {"method": method, "path": str(where), "state": kind, "quick": quick,
             "check": check,
             "code": str(before if method.endswith(BEFORE) and before else code)}
        )
        if check:
            ok[method] = got["digest"] == written["digest"]
        trials[combo].append(got)
        progress(
            f"  {kind} rep {rep}: {combo} {got['wall_s']:.3f} s, {got['cpu_s']:.3f} CPU-s "
            f"(process {got['process_s']:.1f} s, {got['process_cpu_s']:.1f} CPU-s)"
        )
    out: dict[str, Any] = {
        "bytes": nbytes,
        "tensors": written["tensors"],
        "file_bytes": written["file_bytes"],
        "roundtrip_ok": ok,
    }
    for cache in caches:
        per: dict[str, Any] = {}
        wall = {m: [t["wall_s"] for t in trials[f"{cache}:{m}"]] for m in methods}
        for m in methods:
            ts = trials[f"{cache}:{m}"]
            cpu = [t["cpu_s"] for t in ts]
            per[m] = {
                "seconds": summarize(wall[m]),
                "cpu_seconds": summarize(cpu),
                "cpu_s_per_gib": summarize([c / (nbytes / GiB) for c in cpu]),
                "process_seconds": summarize([t["process_s"] for t in ts]),
                "process_cpu_seconds": summarize([t["process_cpu_s"] for t in ts]),
                "gib_per_s": nbytes / GiB / summarize(wall[m])["median"],
                "us_per_tensor": summarize(wall[m])["median"] / written["tensors"] * 1e6,
            }
        ratios: dict[str, Any] = {}
        if {"lazyckpt_restore", "torch_load", "dcp_load_alloc"} <= set(methods):
            best = [min(a, b) for a, b in zip(wall["torch_load"], wall["dcp_load_alloc"],
                                               strict=True)]
            med = min(per["torch_load"]["seconds"]["median"],
                      per["dcp_load_alloc"]["seconds"]["median"])
            ratios["restore_over_best_peer"] = med / per["lazyckpt_restore"]["seconds"]["median"]
            ratios["restore_over_best_peer_per_round"] = summarize(
                _ratio(best, wall["lazyckpt_restore"])
            )
            cpu_best = min(per["torch_load"]["cpu_seconds"]["median"],
                           per["dcp_load_alloc"]["cpu_seconds"]["median"])
            ratios["restore_cpu_over_best_peer"] = (
                cpu_best / per["lazyckpt_restore"]["cpu_seconds"]["median"]
            )
        if {"lazyckpt_restore_into", "dcp_load_into"} <= set(methods):
            ratios["into_over_dcp_into"] = (
                per["dcp_load_into"]["seconds"]["median"]
                / per["lazyckpt_restore_into"]["seconds"]["median"]
            )
            ratios["into_over_dcp_into_per_round"] = summarize(
                _ratio(wall["dcp_load_into"], wall["lazyckpt_restore_into"])
            )
            ratios["into_cpu_over_dcp_into"] = (
                per["dcp_load_into"]["cpu_seconds"]["median"]
                / per["lazyckpt_restore_into"]["cpu_seconds"]["median"]
            )
        out[cache] = {"methods": per, "ratios": ratios}
    return out


TARGET = 1.25


def to_markdown(doc: dict[str, Any]) -> str:
    """The result as Markdown tables: one per state, a row per cache state and method."""
    lines = [
        "# Restore in a fresh process, against torch.load and dcp.load",
        "",
        f"Started {doc['started']}; load average {doc['loadavg_start']} at the start, "
        f"{doc['loadavg_end']} at the end; {doc['reps']} rounds, methods and cache states "
        f"alternating; lazyckpt code: {doc['code']}. Wall and CPU are the timed part (open, "
        "restore, close; CPU of all the child's threads); \"process\" is the whole child "
        "(interpreter start and imports included). Medians [min-max].",
        "",
    ]
    for kind, r in doc["results"].items():
        lines += [
            f"## {kind}: {r['tensors']:,} tensors, {r['bytes'] / (1 << 20):.0f} MiB",
            "",
            "| cache | method | wall, s | CPU-s | CPU-s/GiB | µs/tensor | process s (CPU-s) |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for cache in CACHES:
            if cache not in r:
                continue
            for m, v in r[cache]["methods"].items():
                s, c = v["seconds"], v["cpu_seconds"]
                lines.append(
                    f"| {cache} | {m} | {s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}] | "
                    f"{c['median']:.3f} | {v['cpu_s_per_gib']['median']:.2f} | "
                    f"{v['us_per_tensor']:.1f} | {v['process_seconds']['median']:.2f} "
                    f"({v['process_cpu_seconds']['median']:.2f}) |"
                )
        lines += ["", "| cache | ratio (above 1: lazyckpt faster) | median | per round [min-max] | CPU | target |",
                  "|---|---|---:|---:|---:|---|"]
        for cache in CACHES:
            ratios = r.get(cache, {}).get("ratios", {})
            for name, label, cpu_key in (
                ("restore_over_best_peer", "restore() / better of torch.load, dcp.load",
                 "restore_cpu_over_best_peer"),
                ("into_over_dcp_into", "restore(into=) / dcp.load into",
                 "into_cpu_over_dcp_into"),
            ):
                if name not in ratios:
                    continue
                pr = ratios[f"{name}_per_round"]
                met = "met" if ratios[name] >= TARGET else "missed"
                lines.append(
                    f"| {cache} | {label} | {ratios[name]:.2f} | "
                    f"[{pr['min']:.2f}-{pr['max']:.2f}] | {ratios[cpu_key]:.2f} | "
                    f"≥ {TARGET} {met} |"
                )
        bad = [m for m, good in r["roundtrip_ok"].items() if not good]
        lines += ["", "Bit for bit: " + ("all methods." if not bad else f"FAILED for {bad}."), ""]
    return "\n".join(lines)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 round of a tiny large-tensor state (--states: others)"
    )
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 3)")
    parser.add_argument("--states", default=None, help=f"comma-separated of {STATES}")
    parser.add_argument("--methods", default=None, help=f"comma-separated of {METHODS}")
    parser.add_argument("--caches", default=None, help="cold,warm (default both)")
    parser.add_argument(
        "--code", type=Path, default=REPO,
        help="the directory lazyckpt and tiers are imported from in the children "
        "(another checkout: the figures of other code, same run)",
    )
    parser.add_argument(
        "--before", type=Path, default=None,
        help="also run the lazyckpt methods with the code in this directory (lazyckpt and "
        "tiers of an earlier commit: git archive COMMIT lazyckpt tiers | tar -x -C DIR), as "
        f"methods ending in {BEFORE!r}, alternating with the rest",
    )
    parser.add_argument("--label", default="", help="appended to the result's name")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--tmp", type=Path, default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(json.loads(args.child))))
        return
    progress = Progress()
    reps = args.reps or (1 if args.quick else 3)
    states = args.states.split(",") if args.states else (["large"] if args.quick else STATES)
    methods = args.methods.split(",") if args.methods else METHODS
    caches = args.caches.split(",") if args.caches else CACHES
    if args.before is not None:
        methods += [m + BEFORE for m in methods if m.startswith("lazyckpt")]
    started = dt.datetime.now(dt.UTC)
    load_start = loadavg()
    results: dict[str, Any] = {}
    with scratch_dir(args.tmp, "restore-fresh-") as tmp:
        for kind in states:
            results[kind] = run_state(
                kind, args.quick, reps, caches, methods, args.code.resolve(),
                args.before.resolve() if args.before else None, tmp, progress,
            )
    code = "this checkout" if args.code.resolve() == REPO else "another checkout"
    if args.before is not None:
        code += f"; methods ending in {BEFORE}: the code before the change"
    doc = {
        "schema": 1,
        "benchmark": "restore_fresh",
        "quick": args.quick,
        "started": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg_start": load_start,
        "loadavg_end": loadavg(),
        "reps": reps,
        "code": code,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    label = f"-{args.label}" if args.label else ""
    path = args.out / f"restore-{doc['machine']['slug']}-{stamp}{label}.json"
    path.write_text(json.dumps(doc, indent=1))
    path.with_suffix(".md").write_text(to_markdown(doc))
    for kind, r in results.items():
        for cache in caches:
            ratios = r[cache]["ratios"]
            shown = ", ".join(f"{k} {v:.2f}" for k, v in ratios.items() if isinstance(v, float))
            progress(f"{kind} {cache}: {shown}")
    progress(f"wrote {path}")


if __name__ == "__main__":
    _main()
