"""What a checkpoint costs a training loop through PyTorch DCP: ``dcp.async_save`` with its
own file-system writer and default stager, against ``dcp.async_save`` with lazyckpt's
``LazyStorageWriter``, side by side in one run.

The loop trains an MLP with AdamW and saves every ``--every`` iterations, as torchtitan's
DCP manager does in its ``async`` mode: before a new save it waits for the previous one to
be written. Each method runs the same loop; the methods alternate (``abab``). Reported per
method: the loop's wall time, the time per checkpoint it cost over the loop without
checkpoints (the same run, alternating with them), how long the ``async_save`` call
itself blocked, the time in ``optimizer.step()`` (with lazyckpt it includes the guard's
wait for a capture still running; DCP's default stager has copied before ``async_save``
returns), and the time to drain the last save after the loop.

    python bench/integration_dcp.py                 # about a minute on 2 CPUs
    python bench/integration_dcp.py --quick         # a few seconds
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import MiB, abab, loadavg, machine_info, scratch_dir, summarize, tree_bytes

from lazyckpt import SyncCheckpointer
from lazyckpt.integrations.dcp import LazyStorageWriter
from tiers import FileTier, HostMemoryTier

METHODS = ("none", "dcp", "lazyckpt")

# single-process DCP warns that it runs without a process group, and about its async API
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", category=FutureWarning)


def build(width: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU()]
        blocks += [torch.nn.Linear(4 * width, width)]
    model = torch.nn.Sequential(*blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def run_loop(method: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    """One training loop with checkpoints by ``method``; timings in seconds."""
    model, opt = build(args.width, args.layers)
    x = torch.randn(args.batch, args.width)
    saves: list[float] = []
    stalls = 0.0
    pending: Future[Any] | None = None
    ckpt: SyncCheckpointer | None = None
    if method == "lazyckpt":
        ckpt = SyncCheckpointer(
            [HostMemoryTier(args.host_mib * MiB), FileTier(root / "lazy")], deadline=None
        ).open()
        ckpt.guard(opt)
    for _ in range(args.warmup):  # the optimizer's state is made at its first step
        (model(x) - x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    t_loop = time.perf_counter()
    for it in range(1, args.iters + 1):
        loss = (model(x) - x).square().mean()
        loss.backward()
        t0 = time.perf_counter()
        opt.step()  # with lazyckpt's guard: waits here while a capture still runs
        stalls += time.perf_counter() - t0
        opt.zero_grad()
        if method == "none" or it % args.every:
            continue
        if pending is not None:  # torchtitan's async mode: one save in flight at a time
            pending.result()
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        t0 = time.perf_counter()
        if method == "dcp":
            writer = FileSystemWriter(str(root / "dcp" / str(it)))
            response = async_save(state, storage_writer=writer)
            assert isinstance(response, Future)
            pending = response
        else:
            assert ckpt is not None
            lazy = async_save(state, checkpoint_id=str(it), storage_writer=LazyStorageWriter(ckpt))
            assert isinstance(lazy, AsyncSaveResponse)
            pending = lazy.upload_completion
        saves.append(time.perf_counter() - t0)
    loop = time.perf_counter() - t_loop
    t0 = time.perf_counter()
    if pending is not None:
        pending.result()
    if ckpt is not None:
        ckpt.close()
    drain = time.perf_counter() - t0
    return {
        "loop_s": loop,
        "async_save_call_s": sum(saves) / len(saves) if saves else 0.0,
        "step_stall_s": stalls,
        "drain_s": drain,
        "checkpoints": float(len(saves)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--host-mib", type=int, default=1024)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1, see below)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--tmp", default=None, help="scratch parent (default: runs/)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.iters, args.reps = 128, 2, 32, 8, 1
    # One intra-op thread by default: on a small machine shared with other work, a team of
    # OpenMP threads as large as the core count makes every step wait for a descheduled
    # peer, and the loop's speed then swings by an order of magnitude between runs; the
    # background side of either method (DCP's writer thread, lazyckpt's engine) needs a
    # core as well.
    torch.set_num_threads(args.threads)

    model, opt = build(args.width, args.layers)
    model(torch.randn(2, args.width)).sum().backward()
    opt.step()
    state_bytes = tree_bytes(get_state_dict(model, opt))
    print(
        f"state {state_bytes / MiB:.0f} MiB (model + AdamW), {args.iters} iterations, "
        f"a checkpoint every {args.every}, {args.reps} reps per method",
        file=sys.stderr,
    )
    start_load = loadavg()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for rep, method in abab(METHODS, args.reps):
        with scratch_dir(args.tmp, f"bench-dcp-{method}-") as root:
            result = run_loop(method, args, root)
        runs[method].append(result)
        print(
            f"rep {rep} {method:9s} loop {result['loop_s']:.3f} s  "
            f"async_save call {result['async_save_call_s'] * 1e3:.1f} ms  "
            f"step stall {result['step_stall_s']:.3f} s  drain {result['drain_s']:.3f} s",
            file=sys.stderr,
        )

    base = summarize([r["loop_s"] for r in runs["none"]])["median"]
    summary: dict[str, Any] = {}
    for method in METHODS:
        rows = runs[method]
        n = rows[0]["checkpoints"] or 1.0
        summary[method] = {
            "loop_s": summarize([r["loop_s"] for r in rows]),
            "cost_per_checkpoint_s": summarize([(r["loop_s"] - base) / n for r in rows]),
            "async_save_call_s": summarize([r["async_save_call_s"] for r in rows]),
            "step_stall_s": summarize([r["step_stall_s"] for r in rows]),
            "drain_s": summarize([r["drain_s"] for r in rows]),
        }
    print(
        "\n| method | loop (s) | cost per checkpoint (s) | async_save call (ms) | "
        "optimizer steps (s) | drain after loop (s) |"
    )
    print("|---|---|---|---|---|---|")
    for method in METHODS:
        s = summary[method]
        print(
            f"| {method} | {s['loop_s']['median']:.3f} | "
            f"{s['cost_per_checkpoint_s']['median']:.3f} | "
            f"{s['async_save_call_s']['median'] * 1e3:.1f} | "
            f"{s['step_stall_s']['median']:.3f} | {s['drain_s']['median']:.3f} |"
        )
    document = {
        "benchmark": "integration_dcp",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "loadavg": {"start": start_load, "end": loadavg()},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "tmp")},
        "state_bytes": state_bytes,
        "runs": runs,
        "summary": summary,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
