"""Run the lazyckpt benchmark suite (``make bench``).

Writes ``<out>/<machine>-<date>.json`` with every measurement, a Markdown table next to it
and PNG plots (by default into ``docs/img/``, which ``docs/benchmarks.md`` embeds).
Prints one progress line per phase on stderr.

    python bench/run.py                 # the full suite (about 10-15 minutes on 2 vCPUs)
    python bench/run.py --quick         # small sizes, well under a minute
    python bench/run.py --only e2e      # one benchmark (comma-separate several)

``s3_real`` (ZarrTier on a real S3 server, SeaweedFS on loopback, against plain obstore; see
bench/s3_real.py) also writes ``<out>/s3_real.json``; a ``--quick`` run leaves it out unless
``--only`` names it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    REPO,
    GiB,
    MiB,
    Progress,
    loadavg,
    machine_info,
    make_model_like_state,
    scratch_dir,
    tree_bytes,
)

BENCHMARKS = ["snapshot_latency", "capture", "flush", "restore", "rss", "e2e", "s3_real"]
# left out of a --quick run unless --only names them: they start a server of their own
NOT_QUICK = {"s3_real"}
DEFAULT_OUT = REPO / "bench" / "results"
DEFAULT_IMG = REPO / "docs" / "img"


def _finite(obj: Any) -> Any:
    """JSON cannot hold NaN/inf: replace them with None so the file stays standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def code_version() -> dict[str, Any]:
    """Which library code was measured: the commit, and whether the library's files had
    uncommitted changes at the time (figures from a dirty tree say so)."""
    import subprocess

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(
                ["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    import lazyckpt

    return {
        "lazyckpt": lazyckpt.__version__,
        "commit": git("rev-parse", "--short=12", "HEAD") or None,
        "library_dirty": bool(git("status", "--porcelain", "--", "lazyckpt", "tiers")),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected benchmarks and return the results document."""
    import micro
    import s3_real
    from e2e import run_e2e

    progress = Progress()
    quick: bool = args.quick
    if args.only:
        only = [n.strip() for n in args.only.split(",")]
    else:
        only = [n for n in BENCHMARKS if not (quick and n in NOT_QUICK)]
    unknown = set(only) - set(BENCHMARKS)
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {sorted(unknown)}; choose from {BENCHMARKS}")
    info = machine_info()
    doc: dict[str, Any] = {
        "schema": 1,
        "suite": "lazyckpt bench",
        "machine": info,
        "date": dt.date.today().isoformat(),
        "quick": quick,
        "code": code_version(),
        "conditions": {"loadavg_start": loadavg()},
        "results": {},
    }
    progress(
        f"lazyckpt benchmarks on {info['slug']} ({'quick' if quick else 'full'}): {', '.join(only)}"
    )
    t_start = time.perf_counter()
    state: dict[str, Any] | None = None
    state_bytes = 32 * MiB if quick else GiB
    reps = (
        {"capture": 2, "flush": 1, "restore": 1}
        if quick
        else {"capture": 5, "flush": 4, "restore": 3}
    )

    def need_state() -> dict[str, Any]:
        nonlocal state
        if state is None:
            state = make_model_like_state(state_bytes)
            progress(
                f"model-like state: {tree_bytes(state) / MiB:.0f} MiB in {len(state)} fp32 tensors"
            )
        return state

    with scratch_dir(args.tmp, "lazyckpt-bench-") as tmp:
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "snapshot_latency": lambda: micro.bench_snapshot_latency(quick, progress),
            "capture": lambda: micro.bench_capture(need_state(), reps["capture"], progress),
            "flush": lambda: micro.bench_flush(need_state(), reps["flush"], tmp, progress),
            "restore": lambda: micro.bench_restore(need_state(), reps["restore"], tmp, progress),
            "rss": lambda: micro.bench_rss(quick, tmp, progress),
            "e2e": lambda: run_e2e(quick, tmp, progress),
            "s3_real": lambda: s3_real.run(quick, None, progress, tmp),
        }
        for name in BENCHMARKS:
            if name not in only:
                continue
            if name == "e2e":
                state = None  # give the micro state's memory back before training
                gc.collect()
            t0 = time.perf_counter()
            progress(f"{name} ...")
            doc["results"][name] = steps[name]()
            progress(f"{name} done in {time.perf_counter() - t0:.1f}s")
    doc["conditions"]["loadavg_end"] = loadavg()
    doc["elapsed_s"] = time.perf_counter() - t_start
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    parser.add_argument("--only", metavar="NAME", help=f"comma-separated subset of {BENCHMARKS}")
    parser.add_argument(
        "--out", type=Path, default=None, help="results directory (default bench/results)"
    )
    parser.add_argument(
        "--img",
        type=Path,
        default=None,
        help="plot directory (default docs/img, or OUT/img when --out is given)",
    )
    parser.add_argument(
        "--tmp", type=Path, default=None, help="scratch parent directory (default runs/)"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    args = parser.parse_args(argv)
    out: Path = args.out or DEFAULT_OUT
    img: Path = args.img or (out / "img" if args.out else DEFAULT_IMG)
    out.mkdir(parents=True, exist_ok=True)

    doc = run(args)
    if "s3_real" in doc["results"]:
        import s3_real

        s3_real.write(doc["results"]["s3_real"], out)

    from report import evaluate_targets, scaling_model, write_markdown, write_plots

    doc["targets"] = evaluate_targets(doc)
    doc["scaling"] = scaling_model(doc)
    stem = f"{doc['machine']['slug']}-{doc['date']}" + ("-quick" if doc["quick"] else "")
    json_path = out / f"{stem}.json"
    tmp_path = json_path.with_suffix(".json.tmp")
    tmp_path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    os.replace(tmp_path, json_path)
    plots: list[Path] = []
    if not args.no_plots:
        plots = write_plots(doc, img)
    try:
        rel = os.path.relpath(img, out)
    except ValueError:
        rel = str(img)
    write_markdown(doc, json_path.with_suffix(".md"), img_rel=rel if plots else None)
    print(f"wrote {json_path} and {json_path.with_suffix('.md').name}", file=sys.stderr)
    for t in doc["targets"]:
        print(
            f"  {t['status']:>6}  {t['name']}: {t['value']:.4g} (target {t['target']})",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
