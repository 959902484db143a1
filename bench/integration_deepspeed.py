"""What a checkpoint costs DeepSpeed's training loop: its default TorchCheckpointEngine
against LazyCheckpointEngine, side by side in one run (rounds alternate the two).

    python bench/integration_deepspeed.py [--width 1024] [--layers 4] [--checkpoints 4] [--every 4]

One process, DeepSpeed on CPU (ZeRO-1, gloo, world size 1): an MLP trained by DeepSpeed's
engine, ``engine.save_checkpoint`` every ``--every`` iterations. Per checkpoint it reports

- ``save``: the time inside ``save_checkpoint`` (torch.save of every file for the default
  engine, and the same followed by fsync for ``torch+fsync``; recording references for
  lazyckpt);
- ``commit``: the extra time of the next ``engine.step()`` over a plain one (lazyckpt's
  decoupled commit waits there until the checkpoint is durable, or with
  ``wait="captured"`` (``lazyckpt-captured``) until it is captured; the default engine
  commits inside ``save_checkpoint``);
- ``cost``: ``save`` plus the ``--every`` iterations after the checkpoint, minus the
  ``--every`` iterations just before it: everything the loop lost to the checkpoint, the
  capture competing with forward and backward included.

The process waits passively in OpenMP (``OMP_WAIT_POLICY=PASSIVE`` unless set): see the
comment where it is set. The default engine's files land in the page cache (``torch.save`` does not fsync); lazyckpt's
file tier fsyncs before ``latest`` moves. Results go to ``--out`` as JSON and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# OpenMP's worker threads spin while they wait; on a machine with more runnable threads than
# cores that spinning made plain DeepSpeed iterations 15x slower, and the slowdown went away
# whenever a lazyckpt checkpointer was open in the process (presumably libgomp throttling its
# spinning once more threads than cores run torch operations). Passive waiting puts every
# engine under the same policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
if "MASTER_PORT" not in os.environ:
    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(_s.getsockname()[1])
for _k, _v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: E402

from bench.common import loadavg, machine_info, scratch_dir  # noqa: E402
from lazyckpt.integrations.deepspeed import LazyCheckpointEngine  # noqa: E402
from tiers import FileTier, HostMemoryTier  # noqa: E402

ENGINES = ("torch", "torch+fsync", "lazyckpt", "lazyckpt-captured")


class FsyncTorchCheckpointEngine(TorchCheckpointEngine):  # type: ignore[misc]
    """DeepSpeed's default engine, made durable: each file is fsync'd before save() returns."""

    def save(self, state_dict: Any, path: str) -> None:
        with open(path, "wb") as f:
            torch.save(state_dict, f, _use_new_zipfile_serialization=self.zipfile_serialization)
            f.flush()
            os.fsync(f.fileno())


def make_engine(width: int, layers: int) -> Any:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Linear(64, width), torch.nn.GELU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    mods.append(torch.nn.Linear(width, 1))
    model = torch.nn.Sequential(*mods)
    config = {
        "train_batch_size": 64,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def iteration(engine: Any, i: int) -> float:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(64, 64, generator=g)
    t0 = time.perf_counter()
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - t0


def run_loop(kind: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    engine = make_engine(args.width, args.layers)
    if kind.startswith("lazyckpt"):
        engine.checkpoint_engine = LazyCheckpointEngine(
            [HostMemoryTier(args.host_mib << 20), FileTier(root / "tiers")],
            wait="captured" if kind.endswith("captured") else "durable",
        ).open()  # the arena is allocated before training, not in the first checkpoint
    elif kind == "torch+fsync":
        engine.checkpoint_engine = FsyncTorchCheckpointEngine()
    else:
        engine.checkpoint_engine = TorchCheckpointEngine()
    i = 0
    for _ in range(3):  # warm-up
        iteration(engine, i)
        i += 1
    plain_iters, saves, commits, costs = [], [], [], []
    for c in range(args.checkpoints):
        # a window without a checkpoint next to each window with one: the load of a shared
        # machine drifts, so each checkpoint is compared with its neighbour
        plain = [iteration(engine, i + j) for j in range(args.every)]
        i += args.every
        t0 = time.perf_counter()
        engine.save_checkpoint(str(root / "ds"), tag=f"c{c}")
        saves.append(time.perf_counter() - t0)
        times = [iteration(engine, i + j) for j in range(args.every)]
        i += args.every
        plain_iters += plain
        commits.append(times[0] - statistics.median(plain))
        costs.append(saves[-1] + sum(times) - sum(plain))
    engine.destroy()
    files = (root / "ds").rglob("*.pt")
    nbytes = sum(p.stat().st_size for p in files) // args.checkpoints if kind == "torch" else None
    return {
        "plain_iter_s": statistics.median(plain_iters),
        "save_s": saves,
        "commit_s": commits,
        "cost_s": costs,
        "ckpt_bytes": nbytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--checkpoints", type=int, default=4, help="checkpoints per round")
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--host-mib", type=int, default=512)
    parser.add_argument("--tmp", type=Path, default=None, help="scratch parent (default: runs/)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in ENGINES}
    for r in range(args.rounds):
        for kind in ENGINES if r % 2 == 0 else ENGINES[::-1]:  # ABBA: drift cancels
            with scratch_dir(args.tmp, f"ds-{kind}-") as root:
                results[kind].append(run_loop(kind, args, root))
            print(f"round {r} {kind}: done", file=sys.stderr)
    params = sum(p.numel() for p in make_engine(args.width, args.layers).module.parameters())
    summary: dict[str, dict[str, Any]] = {}
    for kind, runs in results.items():
        pool = {key: [x for run in runs for x in run[key]] for key in ("save_s", "commit_s", "cost_s")}
        summary[kind] = {key: statistics.median(v) for key, v in pool.items()}
        summary[kind]["cost_iqr_s"] = statistics.quantiles(pool["cost_s"], n=4)[::2]
        summary[kind]["plain_iter_s"] = statistics.median(run["plain_iter_s"] for run in runs)
    ckpt_bytes = next(run["ckpt_bytes"] for run in results["torch"])
    doc = {
        "machine": machine_info(),
        "loadavg": loadavg(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "params": params,
        "checkpoint_bytes": ckpt_bytes,
        "deepspeed": deepspeed.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "summary": summary,
        "runs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"deepspeed-{doc['machine']['slug']}-{time.strftime('%Y-%m-%d')}"
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"DeepSpeed {deepspeed.__version__}, ZeRO-1 on CPU, {params / 1e6:.1f} M parameters, "
        f"checkpoint {ckpt_bytes / 2**20:.0f} MiB, a checkpoint every {args.every} iterations, "
        f"{args.rounds} rounds x {args.checkpoints} checkpoints, medians; "
        f"load average {loadavg()} on {doc['machine']['cpus']} CPUs",
        "",
        "| engine | plain iteration | in save_checkpoint | extra in next step() | cost per checkpoint | (p25 to p75) |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ENGINES:
        s = summary[kind]
        lines.append(
            f"| {kind} | {1e3 * s['plain_iter_s']:.1f} ms | {1e3 * s['save_s']:.1f} ms | "
            f"{1e3 * s['commit_s']:.1f} ms | {1e3 * s['cost_s']:.1f} ms | "
            f"{1e3 * s['cost_iqr_s'][0]:.0f} to {1e3 * s['cost_iqr_s'][1]:.0f} ms |"
        )
    lines.append("")
    for lazy in ("lazyckpt", "lazyckpt-captured"):
        for base in ("torch", "torch+fsync"):
            b = summary[base]["cost_s"]
            ratio = summary[lazy]["cost_s"] / b if b > 0 else float("nan")
            lines.append(f"cost per checkpoint, {lazy} / {base}: {ratio:.2f}")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
