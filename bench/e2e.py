"""End-to-end: one training loop, one model, checkpointed by each method in turn.

The loop is the usual one: forward, backward, ``optimizer.step()``, then a checkpoint every
``every`` iterations. The same model and optimizer (state about 1 GiB with AdamW on the
default size) serve every method, and the methods alternate (``common.abab``), so each
sees the same machine. Methods:

- ``none``: no checkpoint (the floor);
- ``torch_save``: ``torch.save`` of the model and optimizer state dicts, then ``fsync``;
- ``dcp_save``: ``torch.distributed.checkpoint.save`` (fsyncs its files by default);
- ``dcp_async``: ``dcp.async_save`` with its default stager (a blocking copy into fresh
  memory), waiting for the previous save to finish before starting the next one, as
  DCP's recipe recommends;
- ``dcp_async_stager``: ``dcp.async_save`` with a caller-owned ``DefaultStager`` using the
  options that run on a CPU: asynchronous staging in a thread and shared memory (pinned
  memory and non-blocking copies need CUDA). The loop waits for staging before the next
  ``optimizer.step()`` and for the previous upload before the next save;
- ``lazyckpt``: ``SyncCheckpointer([HostMemoryTier, FileTier])`` with ``guard(optimizer)``.

Per checkpoint, *stall* is the time the loop is blocked by checkpointing: inside the save
call, plus (for the asynchronous methods) waiting before ``optimizer.step()`` or before the
next save. All methods write durably (fsync) into the same directory tree.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    GiB,
    MiB,
    Progress,
    abab,
    proc_status_kib,
    reset_peak_rss,
    summarize,
)
from model import GPT, GPTConfig, adamw_state_bytes, random_batch

import lazyckpt
from tiers import FileTier, HostMemoryTier

__all__ = ["METHODS", "E2EConfig", "run_e2e"]

METHODS = [
    "none",
    "torch_save",
    "dcp_save",
    "dcp_async",
    "dcp_async_stager",
    "lazyckpt",
    "lazyckpt_direct",
]


@dataclass(frozen=True)
class E2EConfig:
    """Sizes of the end-to-end benchmark."""

    model: GPTConfig
    batch: int
    seq: int
    iters_every1: int  # iterations of a trial that checkpoints every iteration
    every_k: int  # the sparser frequency
    iters_every_k: int
    reps: int
    arena_factor: float = 2.0  # host arena = factor x checkpoint bytes

    @staticmethod
    def full() -> E2EConfig:
        # ~91 M parameters: params + AdamW moments ~= 1.02 GiB, an iteration ~0.5 s on 2 vCPUs
        return E2EConfig(
            model=GPTConfig(vocab_size=8192, block_size=128, n_layer=12, n_head=12, n_embd=768),
            batch=1,
            seq=64,
            iters_every1=8,
            every_k=8,
            iters_every_k=16,
            reps=3,
        )

    @staticmethod
    def quick() -> E2EConfig:
        return E2EConfig(
            model=GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64),
            batch=2,
            seq=16,
            iters_every1=3,
            every_k=2,
            iters_every_k=4,
            reps=1,
        )


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS between trials, so that no method inherits
    already-faulted memory from the previous one (page faults are slow on this VM)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _cpu_seconds() -> float:
    """User + system CPU time of this process, every thread included: training plus
    whatever a method does in the background (copies, checksums, the kernel's page-cache
    copies on its behalf)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Method:
    """One checkpointing method: set up, checkpoint, wait points, drain, tear down."""

    name = "none"

    def __init__(self, root: Path, model: GPT, opt: torch.optim.Optimizer, ckpt_bytes: int) -> None:
        self.root = root
        self.model = model
        self.opt = opt
        self.ckpt_bytes = ckpt_bytes
        self.extra: dict[str, Any] = {}  # method-specific figures for the trial's record

    def setup(self) -> None: ...

    def before_step(self) -> None:
        """Called right before ``optimizer.step()``; may block (counted as stall)."""

    def checkpoint(self, step: int) -> None:
        """Called after ``optimizer.step()`` every ``every`` iterations (counted as stall)."""

    def drain(self) -> None:
        """Block until the last checkpoint is durable (not counted as stall)."""

    def teardown(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


class _TorchSave(_Method):
    name = "torch_save"

    def checkpoint(self, step: int) -> None:
        path = self.root / f"step-{step}.pt"
        with open(path, "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())


class _DcpSave(_Method):
    name = "dcp_save"

    def checkpoint(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_dict(), checkpoint_id=str(self.root / f"step-{step}"))


class _DcpAsync(_Method):
    name = "dcp_async"

    def setup(self) -> None:
        self.upload: Any = None
        self.staging: Any = None
        self.stager: Any = None

    def _async_save(self, step: int) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(self.state_dict(), checkpoint_id=str(self.root / f"step-{step}"))

    def before_step(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def checkpoint(self, step: int) -> None:
        if self.upload is not None:
            self.upload.result()  # one save in flight at most (DCP's own recommendation)
        result = self._async_save(step)
        if hasattr(result, "upload_completion"):
            self.upload, self.staging = result.upload_completion, result.staging_completion
        else:
            self.upload = result

    def drain(self) -> None:
        if self.staging is not None:
            self.staging.result()
        if self.upload is not None:
            self.upload.result()

    def teardown(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class _DcpAsyncStager(_DcpAsync):
    name = "dcp_async_stager"

    def setup(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().setup()
        # pinned memory and non-blocking copies need CUDA; the rest runs on a CPU
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )

    def _async_save(self, step: int) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(
            self.state_dict(),
            checkpoint_id=str(self.root / f"step-{step}"),
            async_stager=self.stager,
        )


class _Lazy(_Method):
    name = "lazyckpt"
    arena_factor = 2.0
    direct = False

    def setup(self) -> None:
        cap = int(self.ckpt_bytes * self.arena_factor) // 4096 * 4096 + 64 * MiB
        self.ckpt = lazyckpt.SyncCheckpointer(
            [HostMemoryTier(capacity_bytes=cap), FileTier(self.root, direct=self.direct)],
            shard_size=16 << 20,
        )
        self.ckpt.open()
        self.ckpt.guard(self.opt)
        self.last: lazyckpt.SnapshotHandle | None = None
        self.handles: list[lazyckpt.SnapshotHandle] = []

    def checkpoint(self, step: int) -> None:
        # Stateful objects go in as they are: snapshot() calls their state_dict()
        self.last = self.ckpt.snapshot(
            {"model": self.model, "optim": self.opt, "step": step}, step=step
        )
        self.handles.append(self.last)

    def drain(self) -> None:
        if self.last is not None:
            self.last.wait("committed")
        # the library's own view of each snapshot: every one must have committed (a failed
        # one would have raised already; this makes it explicit), and where its time went
        stats = [h.stats for h in self.handles if h.stats is not None]
        self.extra = {
            "committed": sum(h.state() == "committed" for h in self.handles),
            "capture_s": summarize([s.capture_s for s in stats if s.capture_s is not None]),
            "to_file_s": summarize([s.reached_s["file"] for s in stats if "file" in s.reached_s]),
            "guard_s": summarize([s.guard_s for s in stats]),
        }

    def teardown(self) -> None:
        self.extra["metrics"] = {
            k: v for k, v in self.ckpt.metrics().items() if k in ("tiers", "arena")
        }
        self.ckpt.close()


class _LazyDirect(_Lazy):
    """The same, with FileTier writing through O_DIRECT: the bytes go from the arena to the
    disk without a copy into the page cache, which costs the CPUs that training uses."""

    name = "lazyckpt_direct"
    direct = True


_CLASSES: dict[str, type[_Method]] = {
    c.name: c
    for c in (_Method, _TorchSave, _DcpSave, _DcpAsync, _DcpAsyncStager, _Lazy, _LazyDirect)
}


def _trial(
    method: _Method,
    cfg: E2EConfig,
    every: int,
    iters: int,
    data: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Any]:
    """Run ``iters`` iterations with ``method`` checkpointing every ``every``; return the
    per-trial figures."""
    model, opt = method.model, method.opt
    rss_before = proc_status_kib("VmRSS")
    reset_peak_rss()
    # Time blocked in the step pre-hooks (the lazyckpt guard) is measured by two hooks
    # that bracket them: one registered before the method's setup, one after.
    marks: dict[str, float] = {}
    h_first = opt.register_step_pre_hook(lambda *_: marks.__setitem__("a", time.perf_counter()))
    t_setup = time.perf_counter()
    method.setup()
    setup_s = time.perf_counter() - t_setup
    h_last = opt.register_step_pre_hook(lambda *_: marks.__setitem__("b", time.perf_counter()))

    # stalls[j]: checkpoint j's own call, plus every wait before an optimizer step that
    # happens after it (and before the next checkpoint): those waits are its doing
    stalls: list[float] = []
    iter_s: list[float] = []
    last_request = 0.0
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    for i in range(iters):
        ti = time.perf_counter()
        x, y = data()
        loss = model(x, y)
        loss.backward()
        tw = time.perf_counter()
        method.before_step()
        waited = time.perf_counter() - tw
        opt.step()
        waited += marks["b"] - marks["a"]
        opt.zero_grad(set_to_none=False)
        if stalls:
            stalls[-1] += waited
        if (i + 1) % every == 0:
            tc = time.perf_counter()
            last_request = tc
            method.checkpoint(i + 1)
            stalls.append(time.perf_counter() - tc)
        iter_s.append(time.perf_counter() - ti)
    loop_s = time.perf_counter() - t0
    t_drain = time.perf_counter()
    method.drain()
    t_end = time.perf_counter()
    cpu_s = _cpu_seconds() - cpu0
    peak_kib = proc_status_kib("VmHWM")
    method.teardown()
    h_first.remove()
    h_last.remove()
    n_ckpt = len(stalls)
    return {
        "setup_s": setup_s,
        "loop_s": loop_s,
        "drain_s": t_end - t_drain,
        "total_durable_s": t_end - t0,
        "last_durable_s": (t_end - last_request) if n_ckpt else 0.0,
        "iter_s": iter_s,
        "stalls_s": stalls,
        "checkpoints": n_ckpt,
        "rss_before_mib": rss_before / 1024,
        "peak_rss_mib": peak_kib / 1024,
        "cpu_s": cpu_s,
        "loss": float(loss.detach()),
        **({"lazyckpt": method.extra} if method.extra else {}),
    }


def _stall_attribution_note() -> str:
    return (
        "stall per checkpoint = time inside the checkpoint call + time blocked before the "
        "following optimizer.step() (staging wait / lazyckpt guard) + time waiting for the "
        "previous save before starting a new one"
    )


def run_e2e(
    quick: bool, tmp: Path, progress: Progress, methods: list[str] | None = None
) -> dict[str, Any]:
    """Run every method at both frequencies, alternating; return raw trials and summaries."""
    warnings.filterwarnings("ignore", module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, message=".*pin_memory.*")
    cfg = E2EConfig.quick() if quick else E2EConfig.full()
    methods = methods or METHODS
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def data() -> tuple[torch.Tensor, torch.Tensor]:
        return random_batch(cfg.model, cfg.batch, cfg.seq, gen)

    # warm-up: creates the AdamW moments and settles the allocator
    for _ in range(3):
        x, y = data()
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    ckpt_bytes = adamw_state_bytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(model.state_dict()) + sum(len(s) for s in opt.state_dict()["state"].values())
    progress(
        f"  model: {n_params / 1e6:.1f} M params, checkpoint {ckpt_bytes / GiB:.2f} GiB "
        f"in {n_tensors} tensors"
    )

    import torch.distributed as dist

    own_pg = False
    if dist.is_available() and not dist.is_initialized():
        # DCP's asynchronous save is meant to run with a process group; a one-rank gloo
        # group on the loopback interface is what a single-process job would have
        dist.init_process_group(
            "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}"
        )
        own_pg = True
    configs = [
        ("every_1", 1, cfg.iters_every1),
        (f"every_{cfg.every_k}", cfg.every_k, cfg.iters_every_k),
    ]
    trials: dict[str, dict[str, list[dict[str, Any]]]] = {
        c[0]: {m: [] for m in methods} for c in configs
    }
    try:
        for label, every, iters in configs:
            progress(f"  {label}: {iters} iterations per trial, {cfg.reps} reps")
            for rep, name in abab(methods, cfg.reps):
                root = tmp / f"{label}-{name}-{rep}"
                root.mkdir(parents=True)
                _malloc_trim()
                os.sync()
                cls = _CLASSES[name]
                method = cls(root, model, opt, ckpt_bytes)
                if isinstance(method, _Lazy):
                    method.arena_factor = cfg.arena_factor
                result = _trial(method, cfg, every, iters, data)
                trials[label][name].append(result)
                shutil.rmtree(root, ignore_errors=True)
                st = summarize(result["stalls_s"]) if result["stalls_s"] else {"median": 0.0}
                progress(
                    f"  {label} rep {rep} {name:17s} loop {result['loop_s']:6.2f}s "
                    f"+drain {result['drain_s']:5.2f}s  stall med {st['median']:.4f}s  "
                    f"peak RSS {result['peak_rss_mib']:.0f} MiB"
                )
                del method
    finally:
        if own_pg:
            dist.destroy_process_group()
    return {
        "config": {
            "model": vars(cfg.model),
            "params": n_params,
            "checkpoint_bytes": ckpt_bytes,
            "tensors": n_tensors,
            "batch": cfg.batch,
            "seq": cfg.seq,
            "every_k": cfg.every_k,
            "iters": {c[0]: c[2] for c in configs},
            "reps": cfg.reps,
            "arena_bytes": int(ckpt_bytes * cfg.arena_factor) // 4096 * 4096 + 64 * MiB,
            "stall_definition": _stall_attribution_note(),
            "zero_grad": "set_to_none=False (gradients stay allocated between iterations)",
        },
        "summary": {label: _summarize_config(per) for label, per in trials.items()},
        "trials": trials,
    }


def _summarize_config(per_method: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, runs in per_method.items():
        if not runs:
            continue
        stalls = [s for r in runs for s in r["stalls_s"]]
        iters = [s for r in runs for s in r["iter_s"]]
        out[name] = {
            "stall_s": summarize(stalls) if stalls else {"n": 0, "median": 0.0, "p95": 0.0},
            "iter_s": summarize(iters),
            "loop_s": summarize([r["loop_s"] for r in runs]),
            "total_durable_s": summarize([r["total_durable_s"] for r in runs]),
            "last_durable_s": summarize([r["last_durable_s"] for r in runs]),
            "peak_rss_mib": summarize([r["peak_rss_mib"] for r in runs]),
            "rss_before_mib": summarize([r["rss_before_mib"] for r in runs]),
            "setup_s": summarize([r["setup_s"] for r in runs]),
            "cpu_s": summarize([r["cpu_s"] for r in runs]),
        }
        lazy = [r["lazyckpt"] for r in runs if "lazyckpt" in r]
        if lazy:
            out[name]["lazyckpt"] = {
                "committed": sum(x["committed"] for x in lazy),
                "capture_s_median": [x["capture_s"].get("median") for x in lazy],
                "to_file_s_median": [x["to_file_s"].get("median") for x in lazy],
                "arena_waits": sum(x["metrics"]["arena"]["waits"] for x in lazy),
            }
    return out
