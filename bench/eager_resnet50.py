"""What the eager copies and ``verify_sources`` cost, on a ResNet-50-sized state.

The layout is ResNet-50's (torchvision's ``resnet50``: 53 convolutions, 53 BatchNorm layers,
one linear head; 25.6 M parameters), written out as tensor shapes so that no torchvision is
needed, with SGD momentum buffers for every parameter, and a guard on the optimizer:

- ``snapshot()``: time inside ``snapshot()`` with the default policy (the 159 BatchNorm
  buffers, 106 running statistics and 53 ``num_batches_tracked`` counters, 0.2 MiB, are
  copied at ``snapshot()``) against
  ``lazy=("*",)`` (every tensor lazy, as before the eager copies existed);
- ``capture``: time from ``snapshot()`` until every shard is in host memory (what the guard
  waits for at most), with and without ``verify_sources=True``.

The configurations alternate snapshot by snapshot, in an order rotated every round, and
each figure is a median over ``--reps`` snapshots::

    python bench/eager_resnet50.py --reps 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import lazyckpt
from tiers import HostMemoryTier

# (blocks, width) of the four stages; each bottleneck block is 1x1 (width), 3x3 (width),
# 1x1 (4 * width), plus a 1x1 downsample on the first block of each stage
STAGES = [(3, 64), (4, 128), (6, 256), (3, 512)]


def resnet50_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter and buffer shapes of ResNet-50, keyed as its state_dict."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv_bn(name: str, cout: int, cin: int, k: int) -> None:
        shapes[f"{name}.weight"] = (cout, cin, k, k)
        bn = name.replace("conv", "bn") if "conv" in name else name.replace(".0", ".1")
        for part in ("weight", "bias", "running_mean", "running_var"):
            shapes[f"{bn}.{part}"] = (cout,)
        shapes[f"{bn}.num_batches_tracked"] = ()

    conv_bn("conv1", 64, 3, 7)
    cin = 64
    for stage, (blocks, width) in enumerate(STAGES, 1):
        for b in range(blocks):
            prefix = f"layer{stage}.{b}"
            conv_bn(f"{prefix}.conv1", width, cin, 1)
            conv_bn(f"{prefix}.conv2", width, width, 3)
            conv_bn(f"{prefix}.conv3", 4 * width, width, 1)
            if b == 0:
                conv_bn(f"{prefix}.downsample.0", 4 * width, cin, 1)
            cin = 4 * width
    shapes["fc.weight"] = (1000, 2048)
    shapes["fc.bias"] = (1000,)
    return shapes


def build() -> tuple[dict[str, torch.Tensor], torch.optim.SGD]:
    g = torch.Generator().manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    params = []
    for key, shape in resnet50_shapes().items():
        if key.endswith("num_batches_tracked"):
            model[key] = torch.zeros((), dtype=torch.int64)
        elif key.endswith(("running_mean", "running_var")):
            model[key] = torch.rand(shape, generator=g)
        else:
            p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.01)
            p.grad = torch.zeros_like(p)
            model[key] = p
            params.append(p)
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.step()  # creates the momentum buffers
    return model, opt


def forward_like(model: dict[str, torch.Tensor]) -> None:
    """What a forward pass does to the state: every BatchNorm buffer changes."""
    with torch.no_grad():
        for key, t in model.items():
            if key.endswith("num_batches_tracked"):
                t.add_(1)
            elif key.endswith(("running_mean", "running_var")):
                t.mul_(0.9).add_(0.1)


def measure(reps: int) -> dict[str, Any]:
    model, opt = build()
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    nbytes += sum(
        s["momentum_buffer"].numel() * 4 for s in opt.state.values() if "momentum_buffer" in s
    )
    configs: dict[str, dict[str, Any]] = {
        "eager (default)": {},
        "all lazy": {"lazy": ("*",)},
        "eager + verify_sources": {"verify_sources": True},
    }
    snapshot_s: dict[str, list[float]] = {name: [] for name in configs}
    capture_s: dict[str, list[float]] = {name: [] for name in configs}
    failed: dict[str, int] = {}
    ckpts = {
        name: lazyckpt.SyncCheckpointer(
            [HostMemoryTier(3 * nbytes, name=f"host{i}")], **options
        ).open()
        for i, (name, options) in enumerate(configs.items())
    }
    try:
        for ckpt in ckpts.values():
            ckpt.guard(opt)
        step = 0
        names = list(ckpts)
        for round_ in range(reps + 2):  # two warm-up rounds, not counted
            # rotated every round, so that no configuration always follows the same one
            k = round_ % len(names)
            for name in names[k:] + names[:k]:
                ckpt = ckpts[name]
                state = {"model": model, "optim": opt, "step": step}
                t0 = time.perf_counter()
                handle = ckpt.snapshot(state, step=step)
                t1 = time.perf_counter()
                handle.wait("captured")
                t2 = time.perf_counter()
                forward_like(model)
                handle.wait("committed")
                if step >= 2 * len(ckpts):
                    snapshot_s[name].append(t1 - t0)
                    capture_s[name].append(t2 - t0)
                step += 1
        for name, ckpt in ckpts.items():
            failed[name] = ckpt.metrics()["snapshots_failed"]
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    return {
        "tensors": len(model) + len(opt.state),
        "bytes": nbytes,
        "reps": reps,
        "snapshot_ms_median": {k: 1e3 * statistics.median(v) for k, v in snapshot_s.items()},
        "capture_ms_median": {k: 1e3 * statistics.median(v) for k, v in capture_s.items()},
        "snapshots_failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    print(json.dumps(measure(args.reps), indent=2))


if __name__ == "__main__":
    main()
