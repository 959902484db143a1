"""Turning a results document into targets, a Markdown report and PNG plots.

Everything here reads the JSON that ``run.py`` writes and nothing else, so a report can be
rebuilt from a stored result (``python bench/report.py results.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["evaluate_targets", "scaling_model", "write_markdown", "write_plots"]

GiB = 1 << 30
MiB = 1 << 20

METHOD_LABELS = {
    "none": "no checkpoint",
    "torch_save": "torch.save + fsync",
    "dcp_save": "DCP save",
    "dcp_async": "DCP async_save (default stager)",
    "dcp_async_stager": "DCP async_save (async+shm stager)",
    "lazyckpt": "lazyckpt (Host + File)",
    "lazyckpt_direct": "lazyckpt (Host + File, O_DIRECT)",
}


def _med(d: dict[str, Any]) -> float:
    return float(d.get("median", float("nan")))


def _status(value: float, full: float, partial: float | None = None, *, higher: bool = True) -> str:
    """'met' when the full target is reached, 'partly' when only the lower bound of a
    range is, else 'missed'."""
    if not math.isfinite(value):
        return "n/a"
    ok = value >= full if higher else value <= full
    if ok:
        return "met"
    if partial is not None and (value >= partial if higher else value <= partial):
        return "partly"
    return "missed"


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The benchmark targets, each with the measured value and a verdict."""
    r = results["results"]
    out: list[dict[str, Any]] = []

    def add(name: str, value: float, target: str, status: str, note: str = "") -> None:
        out.append({"name": name, "value": value, "target": target, "status": status, "note": note})

    if "capture" in r:
        c = r["capture"]
        add(
            "time in snapshot() / memcpy of the state",
            c["snapshot_over_memcpy"],
            "<= 5 %",
            _status(c["snapshot_over_memcpy"], 0.05, higher=False),
        )
        add(
            "capture bandwidth / memcpy bandwidth",
            c["capture_over_memcpy_bw"],
            ">= 70-80 %",
            _status(c["capture_over_memcpy_bw"], 0.80, 0.70),
            f"vs memcpy + crc32c: {c['capture_over_memcpy_crc_bw']:.0%}",
        )
        if "capture_threads2_over_memcpy_bw" in c:
            add(
                "capture bandwidth, capture_threads=2 / memcpy",
                c["capture_threads2_over_memcpy_bw"],
                ">= 70-80 %",
                _status(c["capture_threads2_over_memcpy_bw"], 0.80, 0.70),
            )
    if "flush" in r:
        f = r["flush"]
        add(
            "FileTier snapshot-to-durable / plain write + fsync",
            f["file_over_write_fsync_bw"],
            ">= 85-90 %",
            _status(f["file_over_write_fsync_bw"], 0.90, 0.85),
            "one writer thread, as the target states",
        )
        add(
            "FileTier snapshot-to-durable / 2-thread write + fsync",
            f["file_over_write_fsync_2threads_bw"],
            ">= 85-90 %",
            _status(f["file_over_write_fsync_2threads_bw"], 0.90, 0.85),
            "a stricter floor: the same parallelism as FileTier's pool",
        )
        if "file_direct_over_write_fsync_bw" in f:
            add(
                "FileTier(direct=True) snapshot-to-durable / plain write + fsync",
                f["file_direct_over_write_fsync_bw"],
                ">= 85-90 %",
                _status(f["file_direct_over_write_fsync_bw"], 0.90, 0.85),
                "O_DIRECT: no copy into the page cache",
            )
    if "restore" in r:
        s = r["restore"]
        add(
            "restore(into=) from FileTier / plain read",
            s["restore_into_over_read_bw"],
            ">= 90 %",
            _status(s["restore_into_over_read_bw"], 0.90),
        )
        add(
            "restore() into new tensors from FileTier / plain read",
            s["restore_over_read_bw"],
            ">= 90 %",
            _status(s["restore_over_read_bw"], 0.90),
            "includes first-touch page faults of the new tensors",
        )
    if "rss" in r:
        m = r["rss"]
        limit = max(16.0, 0.05 * m["arena_capacity"] / MiB)
        add(
            f"RSS growth over {m['snapshots']} snapshots (MiB)",
            m["growth_mib"],
            f"flat (<= {limit:.0f} MiB)",
            _status(m["growth_mib"], limit, higher=False),
            f"opening added {m['rss_mib']['after_open'] - m['rss_mib']['after_state']:.0f} MiB "
            f"(arena {m['arena_capacity'] / MiB:.0f} MiB); peak {m['rss_mib']['hwm']:.0f} MiB",
        )
    if "e2e" in r:
        summary = r["e2e"]["summary"]
        nbytes = r["e2e"]["config"]["checkpoint_bytes"]
        for label, per in summary.items():
            for variant in ("lazyckpt", "lazyckpt_direct"):
                if variant not in per:
                    continue
                lazy = per[variant]
                if "dcp_async" in per:
                    dcp = per["dcp_async"]
                    ratio = _med(lazy["stall_s"]) / max(_med(dcp["stall_s"]), 1e-12)
                    add(
                        f"{label}: stall {variant} / DCP async_save (median)",
                        ratio,
                        "<= 1 %",
                        _status(ratio, 0.01, higher=False),
                    )
                    if label == "every_1":
                        speed = _med(dcp["total_durable_s"]) / _med(lazy["total_durable_s"])
                        loop = _med(dcp["loop_s"]) / _med(lazy["loop_s"])
                        add(
                            f"{label}: end-to-end speed-up of {variant} vs DCP async_save",
                            speed,
                            ">= 2x",
                            _status(speed, 2.0),
                            "all iterations until the last checkpoint is durable; "
                            f"loop alone: {loop:.2f}x",
                        )
                if "none" in per:
                    over = _med(lazy["loop_s"]) / _med(per["none"]["loop_s"]) - 1
                    durable = _med(lazy["total_durable_s"]) / _med(per["none"]["loop_s"]) - 1
                    every = int(label.split("_")[1])
                    interval = every * _med(per["none"]["iter_s"])
                    need = nbytes / interval / GiB
                    have = _tier_gib_s(r, direct=variant.endswith("direct"))
                    keeps_up = have is not None and have >= need
                    add(
                        f"{label}: {variant} loop time over no checkpointing",
                        over,
                        "<= 10 % where the tier keeps up",
                        _status(over, 0.10, higher=False) if keeps_up else "n/a",
                        f"needs {need:.2f} GiB/s durable ({nbytes / GiB:.2f} GiB every "
                        f"{interval:.1f} s)"
                        + (f"; the tier measured {have:.2f} GiB/s" if have is not None else "")
                        + ("" if keeps_up else ", so it cannot keep up")
                        + f"; until the last is durable: {durable:+.0%}",
                    )
    return out


def _tier_gib_s(r: dict[str, Any], *, direct: bool = False) -> float | None:
    """FileTier's snapshot-to-durable bandwidth measured by this run's flush benchmark
    (idle machine, no training competing), or None when it did not run."""
    if "flush" not in r:
        return None
    key = "lazyckpt_file_direct" if direct else "lazyckpt_file"
    value = r["flush"]["gib_per_s"].get(key)
    return None if value is None else float(value)


def scaling_model(results: dict[str, Any]) -> dict[str, Any] | None:
    """Per-tensor and per-byte costs fitted from this run, and what they predict for larger
    models (fp32 parameters + two AdamW moments = 12 bytes per parameter)."""
    r = results["results"]
    if not {"snapshot_latency", "capture", "flush"} <= set(r):
        return None
    pts = sorted(r["snapshot_latency"]["by_tensors"], key=lambda p: p["tensors"])
    fixed_s = pts[0]["median"]
    # cost per tensor at each measured count; it grows with the count (see the docs), so a
    # prediction uses the figure measured at the next larger count: conservative
    per_tensor = [
        (p["tensors"], (p["median"] - fixed_s) / max(p["tensors"] - 1, 1)) for p in pts[1:]
    ]

    def snapshot_s(n: int) -> float:
        cost = next((c for count, c in per_tensor if count >= n), per_tensor[-1][1])
        return fixed_s + cost * n

    cap_bw = r["capture"]["gib_per_s"]["capture"] * GiB
    memcpy_bw = r["capture"]["gib_per_s"]["memcpy"] * GiB
    file_bw = r["flush"]["gib_per_s"]["lazyckpt_file"] * GiB
    disk_bw = r["flush"]["gib_per_s"]["write_fsync"] * GiB
    rows = []
    # (label, parameters, tensors in model + optimizer state): ~12 tensors per layer x 3
    for label, params, layers in (
        ("this run's GPT", None, None),
        ("1.3 B", 1.3e9, 24),
        ("7 B", 7e9, 32),
        ("13 B", 13e9, 40),
        ("70 B", 70e9, 80),
    ):
        if params is None:
            if "e2e" not in r:
                continue
            cfg = r["e2e"]["config"]
            nbytes = float(cfg["checkpoint_bytes"])
            tensors = int(cfg["tensors"])
        else:
            nbytes = 12 * params
            tensors = 3 * (12 * layers + 3)
        rows.append(
            {
                "model": label,
                "checkpoint_gib": nbytes / GiB,
                "tensors": tensors,
                "snapshot_ms": snapshot_s(tensors) * 1e3,
                "capture_s": nbytes / cap_bw,
                "durable_s": nbytes / file_bw,
                # the capture must finish within one forward+backward, the file tier within
                # the checkpoint interval, or the loop waits (guard / arena backpressure)
                "min_interval_s": nbytes / file_bw,
            }
        )
    return {
        "fixed_s": fixed_s,
        "per_tensor_s": {str(n): c for n, c in per_tensor},
        "capture_gib_s": cap_bw / GiB,
        "memcpy_gib_s": memcpy_bw / GiB,
        "file_gib_s": file_bw / GiB,
        "disk_gib_s": disk_bw / GiB,
        "rows": rows,
    }


# -- Markdown ---------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _spread(d: dict[str, Any], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(d['median'] * scale)} [{fmt.format(d['min'] * scale)}-{fmt.format(d['max'] * scale)}]"


def write_markdown(results: dict[str, Any], path: Path, img_rel: str | None = None) -> str:
    """Write the tables of one run as Markdown (and return the text)."""
    r = results["results"]
    m = results["machine"]
    lines = [
        f"# Benchmark results: {m['slug']}, {results['date']}",
        "",
        f"Machine: {m['cpus']} CPUs, {m['mem_gib']} GiB RAM, GPU: {m['gpu'] or 'none'}; "
        f"Python {m['python']}, torch {m['torch']} ({m['torch_threads']} intra-op threads), "
        f"kernel {m['kernel']}. lazyckpt {results['code']['lazyckpt']} at commit "
        f"{results['code']['commit']}"
        + (" (library files modified)." if results["code"]["library_dirty"] else "."),
        f"Load average at start / end: {results['conditions']['loadavg_start']} / "
        f"{results['conditions']['loadavg_end']}. Run took {results['elapsed_s']:.0f} s"
        + (" (quick sizes)." if results["quick"] else "."),
        "",
        "Medians of repeated, alternating measurements; brackets give [min-max].",
        "",
    ]
    targets = results.get("targets", [])
    if targets:
        lines += [
            "## Targets",
            "",
            "| metric | measured | target | status | note |",
            "|---|---|---|---|---|",
        ]
        for t in targets:
            v = t["value"]
            if t["target"].endswith("x"):
                shown = f"{v:.2f}x"
            elif "MiB" in t["name"]:
                shown = f"{v:.2f}"
            else:  # a ratio: two decimals where a target is a few per cent
                shown = f"{v:.2%}" if abs(v) < 0.1 else f"{v:.1%}"
            lines.append(f"| {t['name']} | {shown} | {t['target']} | {t['status']} | {t['note']} |")
        lines.append("")
    if "snapshot_latency" in r:
        s = r["snapshot_latency"]
        lines += [
            "## Time in snapshot()",
            "",
            "| tensors | bytes | median | p95 |",
            "|---:|---:|---:|---:|",
        ]
        for p in s["by_tensors"] + s["by_bytes"]:
            lines.append(
                f"| {p['tensors']} | {p['bytes'] / MiB:.2f} MiB | {_ms(p['median'])} | {_ms(p['p95'])} |"
            )
        lines.append("")
    if "capture" in r:
        c = r["capture"]
        lines += [
            f"## Capture of a {c['bytes'] / GiB:.2f} GiB model-like state ({c['tensors']} tensors)",
            "",
            "| what | seconds | GiB/s |",
            "|---|---:|---:|",
        ]
        for k, v in c["seconds"].items():
            lines.append(f"| {k} | {_spread(v, fmt='{:.3f}')} | {c['gib_per_s'][k]:.2f} |")
        lines.append(f"| time in snapshot() | {_spread(c['snapshot_s'], 1e3, '{:.2f}')} ms | |")
        lines.append("")
    if "flush" in r:
        f = r["flush"]
        lines += [
            f"## Durable flush of {f['bytes'] / GiB:.2f} GiB (same directory)",
            "",
            "| what | seconds | GiB/s | CPU seconds (process) |",
            "|---|---:|---:|---:|",
        ]
        for k, v in f["seconds"].items():
            cpu = f.get("cpu_seconds", {}).get(k)
            shown = _spread(cpu) if cpu else "-"
            lines.append(f"| {k} | {_spread(v)} | {f['gib_per_s'][k]:.2f} | {shown} |")
        lines.append("")
    if "restore" in r:
        s = r["restore"]
        lines += [
            f"## Restore of {s['bytes'] / GiB:.2f} GiB, page cache dropped before each read",
            "",
            "| what | seconds | GiB/s |",
            "|---|---:|---:|",
        ]
        for k, v in s["seconds"].items():
            lines.append(f"| {k} | {_spread(v)} | {s['gib_per_s'][k]:.2f} |")
        lines.append("")
    if "rss" in r:
        q = r["rss"]
        mm = q["rss_mib"]
        lines += [
            f"## Resident memory over {q['snapshots']} snapshots",
            "",
            f"State {q['state_bytes'] / MiB:.0f} MiB, arena {q['arena_capacity'] / MiB:.0f} MiB. "
            f"RSS after allocating the state {mm['after_state']:.0f} MiB, after opening the "
            f"Checkpointer {mm['after_open']:.0f} MiB; max in the first quarter "
            f"{mm['first_quarter_max']:.0f} MiB, in the last quarter {mm['last_quarter_max']:.0f} "
            f"MiB; peak (VmHWM) {mm['hwm']:.0f} MiB.",
            "",
        ]
    if "e2e" in r:
        e = r["e2e"]
        cfg = e["config"]
        lines += [
            "## End-to-end training",
            "",
            f"GPT, {cfg['params'] / 1e6:.1f} M parameters, checkpoint (model + AdamW) "
            f"{cfg['checkpoint_bytes'] / GiB:.2f} GiB in {cfg['tensors']} tensors; batch "
            f"{cfg['batch']} x {cfg['seq']} tokens; {cfg['reps']} alternating reps per method. "
            f"{cfg['stall_definition']}.",
            "",
        ]
        for label, per in e["summary"].items():
            lines += [
                f"### Checkpoint {label.replace('_', ' ')} iteration(s), {cfg['iters'][label]} iterations",
                "",
                "| method | stall median | stall p95 | iteration median | loop | until last durable | last ckpt durable after | CPU time | peak RSS |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for name, v in per.items():
                lines.append(
                    f"| {METHOD_LABELS.get(name, name)} | {_ms(_med(v['stall_s']))} | "
                    f"{_ms(v['stall_s'].get('p95', 0.0))} | {_ms(_med(v['iter_s']))} | "
                    f"{_med(v['loop_s']):.2f} s | {_med(v['total_durable_s']):.2f} s | "
                    f"{_med(v['last_durable_s']):.2f} s | "
                    + (f"{_med(v['cpu_s']):.1f} s" if "cpu_s" in v else "-")
                    + f" | {_med(v['peak_rss_mib']):.0f} MiB |"
                )
            for variant in ("lazyckpt", "lazyckpt_direct"):
                lazy = per.get(variant, {}).get("lazyckpt")
                if not lazy:
                    continue
                cap = ", ".join(f"{x:.2f}" for x in lazy["capture_s_median"] if x is not None)
                fil = ", ".join(f"{x:.2f}" for x in lazy["to_file_s_median"] if x is not None)
                lines += [
                    "",
                    f"{METHOD_LABELS[variant]}, its own timings per trial (median per "
                    f"snapshot): capture took {cap} s while training ran; durable on the file "
                    f"tier {fil} s after snapshot(); {lazy['committed']} snapshots committed; "
                    f"the arena made captures wait {lazy['arena_waits']} times.",
                ]
            lines.append("")
    if "s3_real" in r:
        import s3_real

        q = r["s3_real"]
        lines += [
            "## ZarrTier on a real S3 server (SeaweedFS on loopback) against plain obstore",
            "",
            f"{q['server']['version']}; {q['reps']} alternating repetitions; plain: the same "
            f"data objects, {q['inflight']} requests in flight. Ratio lazyckpt / plain per "
            "repetition, median [min-max].",
            "",
            s3_real.table(q),
            "",
        ]
    model = scaling_model(results)
    if model:
        lines += [
            "## Scaling on paper (from this run's fitted costs)",
            "",
            f"snapshot() = {model['fixed_s'] * 1e6:.0f} us + per tensor "
            + ", ".join(f"{c * 1e6:.1f} us (at {n})" for n, c in model["per_tensor_s"].items())
            + f"; capture {model['capture_gib_s']:.2f} GiB/s (memcpy "
            f"{model['memcpy_gib_s']:.2f}); FileTier durable {model['file_gib_s']:.2f} GiB/s "
            f"(plain write + fsync {model['disk_gib_s']:.2f}).",
            "",
            "| model | checkpoint | tensors | snapshot() | capture | to durable (shortest sustainable interval) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for row in model["rows"]:
            lines.append(
                f"| {row['model']} | {row['checkpoint_gib']:.1f} GiB | {row['tensors']} | "
                f"{row['snapshot_ms']:.2f} ms | {row['capture_s']:.2f} s | {row['durable_s']:.1f} s |"
            )
        lines.append("")
    if img_rel:
        lines += ["## Plots", ""]
        for name in ("snapshot-latency", "bandwidth", "e2e", "rss"):
            lines.append(f"![{name}]({img_rel}/bench-{name}.png)")
        lines.append("")
    text = "\n".join(lines)
    path.write_text(text)
    return text


# -- plots ------------------------------------------------------------------------------------


def write_plots(results: dict[str, Any], img_dir: Path) -> list[Path]:
    """Write the PNG plots that docs/benchmarks.md embeds; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img_dir.mkdir(parents=True, exist_ok=True)
    r = results["results"]
    written: list[Path] = []
    tag = f"{results['machine']['slug']}, {results['date']}"

    def save(fig: Any, name: str) -> None:
        p = img_dir / f"bench-{name}.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(p)

    if "snapshot_latency" in r:
        s = r["snapshot_latency"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
        xs = [p["tensors"] for p in s["by_tensors"]]
        a.errorbar(
            xs,
            [p["median"] * 1e3 for p in s["by_tensors"]],
            yerr=[[0] * len(xs), [(p["p95"] - p["median"]) * 1e3 for p in s["by_tensors"]]],
            marker="o",
            capsize=3,
        )
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("tensors in the state (1 KiB each)")
        a.set_ylabel("time in snapshot() [ms]")
        a.set_title("vs number of tensors")
        a.grid(True, which="both", alpha=0.3)
        xb = [p["bytes"] / MiB for p in s["by_bytes"]]
        b.plot(xb, [p["median"] * 1e3 for p in s["by_bytes"]], marker="o")
        b.set_xscale("log")
        b.set_ylim(bottom=0)
        b.set_xlabel("state size [MiB] (16 tensors)")
        b.set_ylabel("time in snapshot() [ms]")
        b.set_title("vs bytes")
        b.grid(True, which="both", alpha=0.3)
        fig.suptitle(f"snapshot() latency ({tag})")
        save(fig, "snapshot-latency")

    groups: list[tuple[str, dict[str, Any]]] = []
    for key in ("capture", "flush", "restore"):
        if key in r:
            groups.append((key, r[key]))
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8))
        if len(groups) == 1:
            axes = [axes]
        for ax, (key, g) in zip(axes, groups, strict=True):
            names = list(g["seconds"])
            bw = [g["bytes"] / g["seconds"][n]["median"] / GiB for n in names]
            lo = [bw[i] - g["bytes"] / g["seconds"][n]["max"] / GiB for i, n in enumerate(names)]
            hi = [g["bytes"] / g["seconds"][n]["min"] / GiB - bw[i] for i, n in enumerate(names)]
            colors = [
                "tab:orange" if n.startswith(("capture", "lazyckpt")) else "tab:gray" for n in names
            ]
            ax.barh(names, bw, xerr=[lo, hi], color=colors, capsize=3)
            ax.set_xlabel("GiB/s (median, min-max)")
            ax.set_title(f"{key} ({g['bytes'] / GiB:.2f} GiB)")
            ax.invert_yaxis()
            ax.grid(True, axis="x", alpha=0.3)
        fig.suptitle(f"bandwidth against the floor (orange: lazyckpt) ({tag})")
        fig.tight_layout()
        save(fig, "bandwidth")

    if "e2e" in r:
        summary = r["e2e"]["summary"]
        labels = list(summary)
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
        methods = [m for m in METHOD_LABELS if any(m in summary[lab] for lab in labels)]
        stall_methods = [m for m in methods if m != "none"]
        width = 0.8 / len(labels)
        for j, lab in enumerate(labels):
            per = summary[lab]
            name = lab.replace("_", " ")
            xs = [i + j * width for i in range(len(stall_methods))]
            med = [_med(per[m]["stall_s"]) if m in per else 0.0 for m in stall_methods]
            p95 = [per[m]["stall_s"].get("p95", 0.0) if m in per else 0.0 for m in stall_methods]
            a.bar(xs, med, width, label=name, color=f"C{j}")
            up = [max(p - q, 0.0) for p, q in zip(p95, med, strict=True)]
            a.errorbar(xs, med, yerr=[[0.0] * len(xs), up], fmt="none", ecolor="k", capsize=2)
            xs = [i + j * width for i in range(len(methods))]
            loop = [_med(per[m]["loop_s"]) if m in per else 0.0 for m in methods]
            total = [_med(per[m]["total_durable_s"]) if m in per else 0.0 for m in methods]
            b.bar(xs, total, width, alpha=0.35, color=f"C{j}")
            b.bar(xs, loop, width, color=f"C{j}", label=f"{name}: loop (light: until last durable)")
        for ax, ms in ((a, stall_methods), (b, methods)):
            ax.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(ms))])
            ax.set_xticklabels([METHOD_LABELS[m] for m in ms], fontsize=7, rotation=25, ha="right")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        a.set_yscale("log")
        a.set_ylabel("stall per checkpoint [s] (median, p95)")
        a.set_title("training blocked per checkpoint")
        b.set_ylabel("seconds")
        b.set_title("time for the trial's iterations")
        fig.suptitle(f"end-to-end GPT training ({tag})")
        fig.tight_layout()
        save(fig, "e2e")

    if "rss" in r:
        q = r["rss"]
        series = [v / 1024 for v in q["rss_kib"]["series"]]
        fig, ax = plt.subplots(figsize=(7, 3.6))
        ax.plot(range(1, len(series) + 1), series, label="VmRSS after each snapshot()")
        ax.axhline(
            q["rss_mib"]["after_state"], color="gray", ls=":", label="before opening (state only)"
        )
        ax.axhline(
            q["rss_mib"]["after_state"] + q["arena_capacity"] / MiB,
            color="k",
            ls="--",
            label="state + arena",
        )
        ax.set_xlabel("snapshot")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"resident memory over {q['snapshots']} snapshots ({tag})")
        save(fig, "rss")
    return written


def _main() -> None:
    parser = argparse.ArgumentParser(description="Rebuild the Markdown and plots of a result.")
    parser.add_argument("result", type=Path)
    parser.add_argument("--img", type=Path, default=None)
    args = parser.parse_args()
    results = json.loads(args.result.read_text())
    # derived fields only; the measurements stay as they were recorded
    results["targets"] = evaluate_targets(results)
    results["scaling"] = scaling_model(results)
    args.result.write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    rel = None
    if args.img:
        write_plots(results, args.img)
        rel = os.path.relpath(args.img, args.result.parent)
    write_markdown(results, args.result.with_suffix(".md"), img_rel=rel)


if __name__ == "__main__":
    _main()
