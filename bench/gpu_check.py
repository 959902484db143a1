"""The GPU check of the CUDA capture path: its tests, then side-by-side measurements.

On a machine with one CUDA GPU::

    python bench/gpu_check.py --budget-s 540

1. runs ``pytest tests/gpu -q``;
2. measures the device-to-host bandwidth of a plain copy into pinned memory against
   lazyckpt's capture of the same bytes (side-stream copies into the pinned arena, polled
   events, crc32c);
3. trains a GPT-style model (1.3 B parameters in bf16 by default) with AdamW and a snapshot
   every iteration, and measures the stall per checkpoint of lazyckpt with either guard
   (``cpu``: the optimizer step waits for the capture; ``stream``: the compute stream waits
   on the copy events) against DCP ``async_save`` with its default stager and with its
   pinned, asynchronous stager, next to the same loop without checkpoints;
4. measures how much captures streaming in the background slow a launch-bound training
   thread (a loop of many tiny kernels, each launch a take of the interpreter lock): its
   iteration time alone and while lazyckpt snapshots a device state as fast as it can
   (``--interference-mib``), alternating.

Writes one JSON document under ``$OUT`` (or ``--out``; default ``bench/results``) after
every phase, so a run cut short still leaves what it measured, and prints a short table
last. ``--budget-s`` bounds the whole run: a phase that would not fit is skipped (and says
so), a measuring loop stops early at the deadline, and a watchdog ends the process soon
after it. ``--cpu`` (or ``--dry-run``) runs the same code on the CPU with a tiny model, so
that the script itself can be tested anywhere.

What "stall" means here: the time the training loop is blocked per checkpoint, in the
checkpoint call itself plus in whatever the optimizer step must wait for first (the guard,
or DCP's staging). The loop waits for its own compute stream (not the copies) before each of
those, so that the figure is the checkpoint's and not the GPU catching up. Both sinks are
host memory: lazyckpt keeps the snapshot in its host tier, DCP writes to a storage writer
that drops the bytes, so neither figure includes storage.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO))

from model import GPT, GPTConfig  # noqa: E402

import lazyckpt  # noqa: E402
from lazyckpt._capture.cuda import CudaCapture, stream_guard_hook  # noqa: E402
from tiers import HostMemoryTier  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SCHEMA = 1


@dataclass(frozen=True)
class ModelSize:
    """A model and the batch it trains on."""

    config: GPTConfig
    batch: int
    seq: int


MODELS: dict[str, ModelSize] = {
    "tiny": ModelSize(
        GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64), 2, 32
    ),
    "1.3b": ModelSize(
        GPTConfig(vocab_size=32768, block_size=1024, n_layer=24, n_head=16, n_embd=2048), 8, 1024
    ),
    "2.7b": ModelSize(
        GPTConfig(vocab_size=32768, block_size=1024, n_layer=32, n_head=32, n_embd=2560), 4, 1024
    ),
}


# -- arguments ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py",
        description="Test and measure lazyckpt's CUDA capture path against DCP async_save.",
    )
    parser.add_argument(
        "--cpu",
        "--dry-run",
        dest="cpu",
        action="store_true",
        help="run on the CPU with a tiny model (checks the script, measures nothing useful)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="wall-clock budget of the whole run"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the JSON result (default: $OUT, else bench/results)",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default=None, help="model size")
    parser.add_argument("--iters", type=int, default=None, help="measured iterations per run")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured iterations first")
    parser.add_argument(
        "--bandwidth-mib", type=int, default=None, help="bytes copied in the bandwidth phase"
    )
    parser.add_argument(
        "--interference-mib", type=int, default=None, help="device state of the interference phase"
    )
    parser.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.budget_s) and args.budget_s > 0):
        parser.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device here; pass --cpu (or --dry-run) to check the script on CPU")
    defaults = {
        "model": "tiny", "iters": 3, "warmup": 1, "bandwidth_mib": 64, "interference_mib": 32
    }
    if not args.cpu:
        defaults = {
            "model": "1.3b", "iters": 6, "warmup": 2, "bandwidth_mib": 4096, "interference_mib": 2048
        }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.iters < 1 or args.warmup < 0 or args.bandwidth_mib < 1 or args.interference_mib < 1:
        parser.error(
            "--iters, --bandwidth-mib and --interference-mib must be at least 1, --warmup at least 0"
        )
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or BENCH / "results")
    return args


# -- bookkeeping ----------------------------------------------------------------------------


class Budget:
    """The run's deadline."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


class Report:
    """The JSON document, rewritten whole after every phase."""

    def __init__(self, out: Path, doc: dict[str, Any]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        self.path = out / f"gpu_check-{doc['device']['kind']}-{stamp}.json"
        self.doc = doc
        self._lock = threading.Lock()

    def save(self) -> None:
        with self._lock:
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.doc, indent=2, sort_keys=True, default=str) + "\n")
            tmp.replace(self.path)


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


def summarize(xs: list[float]) -> dict[str, float | int]:
    if not xs:
        return {"n": 0}
    return {
        "median": statistics.median(xs),
        "mean": statistics.fmean(xs),
        "min": min(xs),
        "max": max(xs),
        "n": len(xs),
    }


def device_info(cpu: bool) -> dict[str, Any]:
    info: dict[str, Any] = {
        "kind": "cpu" if cpu else "cuda",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "host": platform.machine(),
    }
    if not cpu:
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            memory_gib=round(props.total_memory / GiB, 1),
            cuda=torch.version.cuda,
        )
    return info


def sync(device: torch.device) -> None:
    """Wait for the compute stream only: captures run on streams of their own."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # freed pinned memory stays in torch's host cache; the next phase pins its own
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()


# -- phase 1: tests -------------------------------------------------------------------------


def phase_tests(report: Report, budget: Budget, cpu: bool) -> None:
    reserve = 30.0 if cpu else 150.0  # what the measurements after it need at least
    limit = min(300.0, budget.left() - reserve)
    if limit < 20:
        report.doc["tests"] = {"skipped": "budget"}
        return
    log(f"pytest tests/gpu (limit {limit:.0f}s)")
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-rs"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode()
        report.doc["tests"] = {"returncode": None, "timed_out": True, "tail": tail[-3000:]}
        return
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    report.doc["tests"] = {
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else "",
        "seconds": round(time.monotonic() - t0, 1),
        "tail": (proc.stdout + proc.stderr)[-3000:],
    }


# -- phase 2: bandwidth ---------------------------------------------------------------------


def phase_bandwidth(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    device = torch.device("cpu" if args.cpu else "cuda")
    nbytes = args.bandwidth_mib * MiB
    estimate = 10.0 + 4 * nbytes / (2 * GiB)  # allocations, pinning and a few passes
    if budget.left() < estimate + (20 if args.cpu else 120):
        report.doc["bandwidth"] = {"skipped": "budget"}
        return
    log(f"bandwidth: {nbytes / MiB:.0f} MiB, plain copy vs capture")
    reps = 5
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    result: dict[str, Any] = {"bytes": nbytes, "reps": reps}
    plain: list[float] = []
    if device.type == "cuda":
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat = src.view(torch.uint8)
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(flat, non_blocking=True)
            torch.cuda.synchronize()
            plain.append(nbytes / (time.perf_counter() - t0) / 1e9)
        result["plain"] = "device to pinned host, one copy"
    else:
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            dst.copy_(src.view(torch.uint8))
            plain.append(nbytes / (time.perf_counter() - t0) / 1e9)
        result["plain"] = "memcpy into a pre-faulted buffer"
    del dst
    result["plain_gbps"] = summarize(plain[1:])  # the first pass warms up
    captured: list[float] = []
    capacity = nbytes + 64 * MiB
    with lazyckpt.SyncCheckpointer([HostMemoryTier(capacity, keep_last=1)]) as ckpt:
        result["capture_backend"] = type(ckpt._core.engine.capture).__name__
        for step in range(reps + 1):
            mark(ckpt, step)
            handle = ckpt.snapshot({"x": src}, step=step)
            handle.wait("captured", timeout=max(5.0, budget.left()))
            stats = handle.stats
            assert stats is not None and stats.capture_s
            captured.append(nbytes / stats.capture_s / 1e9)
    result["lazyckpt_gbps"] = summarize(captured[1:])
    result["ratio"] = result["lazyckpt_gbps"]["median"] / result["plain_gbps"]["median"]
    report.doc["bandwidth"] = result
    del src
    free_memory(device)


# -- phase 4: a launch-bound training thread beside the captures ----------------------------


def _launch_bound(x: torch.Tensor, ops: int) -> torch.Tensor:
    """One iteration of a launch-bound loop: ``ops`` tiny kernels, then wait for them."""
    for _ in range(ops):
        x = x.add_(1.0)
    sync(x.device)
    return x


def phase_interference(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    """The launch-bound loop's median iteration alone and while lazyckpt snapshots a device
    state back to back (host tier; the state owned by a guarded optimizer, so it is captured
    lazily), in alternating rounds; the time inside ``snapshot()`` is left out of the
    iterations (it is the stall, measured above)."""
    device = torch.device("cpu" if args.cpu else "cuda")
    seconds = 2.0 if args.cpu else 10.0
    rounds = 2
    if budget.left() < 2 * rounds * seconds + (15 if args.cpu else 60):
        report.doc["interference"] = {"skipped": "budget"}
        return
    nbytes = args.interference_mib * MiB
    pieces = 16  # a parameter-like state: a few tensors of equal size
    state = {
        f"p{i}": torch.empty(nbytes // pieces // 4, dtype=torch.float32, device=device).uniform_()
        for i in range(pieces)
    }
    ops = 400
    result: dict[str, Any] = {"bytes": nbytes, "ops_per_iter": ops, "seconds": seconds, "runs": []}
    report.doc["interference"] = result
    log(f"interference: {ops} tiny kernels per iteration beside {nbytes / MiB:.0f} MiB snapshots")
    x = torch.zeros(64, device=device)
    with lazyckpt.SyncCheckpointer([HostMemoryTier(2 * nbytes + 64 * MiB, keep_last=1)]) as ckpt:
        ckpt.guard(torch.optim.SGD([torch.nn.Parameter(t) for t in state.values()], lr=0.1))
        ckpt.snapshot(state, step=0).wait("committed", timeout=max(5.0, budget.left()))
        step = 1
        for _ in range(rounds):
            for method in ("alone", "lazyckpt"):
                for _ in range(20):  # warm-up
                    x = _launch_bound(x, ops)
                iters: list[float] = []
                snapshots = 0
                pending = None
                deadline = time.perf_counter() + seconds
                while time.perf_counter() < deadline and budget.left() > 10:
                    if method == "lazyckpt" and (pending is None or pending.done()):
                        if pending is not None:
                            pending.wait("committed", timeout=0)  # raises a failed snapshot
                        pending = ckpt.snapshot(state, step=step)
                        step += 1
                        snapshots += 1
                    t0 = time.perf_counter()
                    x = _launch_bound(x, ops)
                    iters.append((time.perf_counter() - t0) * 1e3)
                if pending is not None:
                    pending.wait("committed", timeout=max(5.0, budget.left()))
                result["runs"].append(
                    {
                        "method": method,
                        "iter_ms": summarize(iters),
                        "snapshots": snapshots,
                        "gib_per_s": snapshots * nbytes / GiB / seconds,
                    }
                )
                report.save()
    med = {
        m: statistics.median(r["iter_ms"]["median"] for r in result["runs"] if r["method"] == m)
        for m in ("alone", "lazyckpt")
    }
    result["median_iter_ms"] = med
    result["ratio"] = med["lazyckpt"] / med["alone"]
    del state
    free_memory(device)


# -- phase 3: stall per checkpoint ----------------------------------------------------------


def mark(ckpt: lazyckpt.SyncCheckpointer, step: int) -> None:
    """Record the snapshot's point on the compute stream (what ``snapshot()`` does itself
    once wired; done twice it is harmless, the later mark wins)."""
    capture = ckpt._core.engine.capture
    if isinstance(capture, CudaCapture):
        capture.mark_snapshot(step)


def install_guard(ckpt: lazyckpt.SyncCheckpointer, optimizer: Any, *, mode: str) -> Any:
    """``ckpt.guard(optimizer, mode=mode)``, or the stream hook by hand on a Checkpointer
    whose guard takes no mode."""
    if "mode" in inspect.signature(ckpt.guard).parameters:
        return ckpt.guard(optimizer, mode=mode)
    if mode == "cpu":
        return ckpt.guard(optimizer)
    core = ckpt._core
    engine = core.engine
    if not isinstance(engine.capture, CudaCapture):
        raise RuntimeError("the stream guard needs the CUDA capture")
    return optimizer.register_step_pre_hook(
        stream_guard_hook(
            engine.capture,
            engine.pending_captures,
            raise_unreported=engine.raise_unreported,
            closing=lambda: core._closing,
        )
    )


class StepTimer:
    """Times what runs before ``optimizer.step()`` between two of its pre-hooks."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.blocked = 0.0

    def start(self, *_: Any) -> None:
        self.t0 = time.perf_counter()

    def stop(self, *_: Any) -> None:
        self.blocked += time.perf_counter() - self.t0


@dataclass
class Trainer:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    device: torch.device

    def state_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = list(self.model.state_dict().values())
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total


def build_trainer(size: ModelSize, device: torch.device) -> Trainer:
    torch.manual_seed(0)
    with device:
        model = GPT(size.config)
    if device.type == "cuda":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, size.config.vocab_size, (size.batch, size.seq + 1), generator=gen)
    inputs, targets = data[:, :-1].to(device), data[:, 1:].to(device)
    trainer = Trainer(model, optimizer, inputs, targets, device)
    iteration(trainer)  # creates AdamW's state, so that every snapshot holds all of it
    sync(device)
    return trainer


def iteration(trainer: Trainer) -> None:
    loss = trainer.model(trainer.inputs, trainer.targets)
    loss.backward()
    sync(trainer.device)  # the GPU caught up: what the step waits for next is the checkpoint's
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    sync(trainer.device)


Checkpoint = Callable[[int], float | None]


def measure(
    trainer: Trainer,
    budget: Budget,
    args: argparse.Namespace,
    first_step: int,
    checkpoint: Checkpoint | None,
    guard: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> dict[str, Any]:
    """Train ``warmup + iters`` iterations, checkpointing after each; time the last
    ``iters``. ``checkpoint(step)`` returns the snapshot's own metadata seconds, if known."""
    timer = StepTimer()
    opt = trainer.optimizer
    handles = [opt.register_step_pre_hook(timer.start)]
    if guard is not None:
        handles.append(guard(opt))
    handles.append(opt.register_step_pre_hook(timer.stop))
    blocked: list[float] = []
    metadata: list[float] = []
    iters = 0
    cut = False
    t_start = 0.0
    try:
        for i in range(args.warmup + args.iters):
            if i == args.warmup:
                sync(trainer.device)
                t_start = time.perf_counter()
            timer.blocked = 0.0
            iteration(trainer)
            t0 = time.perf_counter()
            meta = checkpoint(first_step + i) if checkpoint is not None else None
            spent = time.perf_counter() - t0 + timer.blocked
            if i >= args.warmup:
                iters += 1
                blocked.append(spent * 1e3)
                if meta is not None:
                    metadata.append(meta * 1e3)
            if budget.left() < 15 and i + 1 < args.warmup + args.iters:
                cut = True
                break
        sync(trainer.device)
        elapsed = time.perf_counter() - t_start
    finally:
        for handle in handles:
            handle.remove()
    result: dict[str, Any] = {
        "iters": iters,
        "iter_ms": elapsed * 1e3 / iters if iters else None,
        "blocked_ms": summarize(blocked),
    }
    if metadata:
        result["snapshot_ms"] = summarize(metadata)
    if cut:
        result["cut_short"] = "budget"
    return result


def make_null_writer() -> Any:
    """A DCP storage writer that drops the bytes once resolved, so that DCP's figures are
    its staging and planning alone, as lazyckpt's are with its host tier."""
    from torch.distributed.checkpoint import StorageWriter
    from torch.distributed.checkpoint.storage import WriteResult

    class _NullWriter(StorageWriter):
        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: Any) -> Any:
            return plans

        def write_data(self, plan: Any, planner: Any) -> Any:
            results = []
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    size = data.numel() * data.element_size()
                else:
                    size = len(data.getbuffer())
                results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
            future: torch.futures.Future[Any] = torch.futures.Future()
            future.set_result(results)
            return future

        def finish(self, metadata: Any, results: Any) -> None:
            pass

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return True

        def storage_meta(self) -> Any:
            return None

    return _NullWriter()


class Snapshots:
    """lazyckpt's checkpoint call: mark the stream, snapshot, keep the handle."""

    def __init__(self, ckpt: lazyckpt.SyncCheckpointer, state: dict[str, Any]) -> None:
        self.ckpt = ckpt
        self.state = state
        self.handles: list[Any] = []

    def __call__(self, step: int) -> float | None:
        mark(self.ckpt, step)
        handle = self.ckpt.snapshot(self.state, step=step)
        self.handles.append(handle)
        return handle.stats.snapshot_s if handle.stats is not None else None


def run_lazyckpt(
    trainer: Trainer, budget: Budget, args: argparse.Namespace, runs: dict[str, Any]
) -> dict[str, Any] | None:
    """Both guards on one Checkpointer (one arena); returns the arena's figures."""
    modes = ["stream", "cpu"] if trainer.device.type == "cuda" else ["cpu"]
    if trainer.device.type != "cuda":
        runs["lazyckpt_stream"] = {"skipped": "needs CUDA: CPU tensors have no stream to order"}
    state_bytes = trainer.state_bytes()
    capacity = state_bytes + state_bytes // 8 + 64 * MiB
    if trainer.device.type == "cuda":
        # torch's caching host allocator pins the next power of two anyway: use all of it
        capacity = 1 << (capacity - 1).bit_length()
    per_run = (args.warmup + args.iters) * runs["no_checkpoint"].get("iter_ms", 1000) / 1e3
    if budget.left() < 30 + per_run * 2:
        for mode in modes:
            runs[f"lazyckpt_{mode}"] = {"skipped": "budget"}
        return None
    log(f"lazyckpt: arena {capacity / GiB:.1f} GiB, guards {modes}")
    step = 0
    state = {"model": trainer.model, "optim": trainer.optimizer}
    with lazyckpt.SyncCheckpointer([HostMemoryTier(capacity, keep_last=1)]) as ckpt:
        for mode in modes:
            name = f"lazyckpt_{mode}"
            if budget.left() < 15 + per_run * 1.5:
                runs[name] = {"skipped": "budget"}
                continue
            log(name)
            snapshots = Snapshots(ckpt, state)
            try:
                result = measure(
                    trainer,
                    budget,
                    args,
                    step,
                    snapshots,
                    guard=functools.partial(install_guard, ckpt, mode=mode),
                )
                ckpt.wait_captured()
                result["guard"] = mode
                result["capture_ms"] = summarize(
                    [
                        h.stats.capture_s * 1e3
                        for h in snapshots.handles
                        if h.stats and h.stats.capture_s
                    ]
                )
                result["failed"] = sum(h.state() == "failed" for h in snapshots.handles)
                runs[name] = result
            except Exception as exc:
                runs[name] = {"error": repr(exc)}
            step += args.warmup + args.iters + 1
        arena: dict[str, Any] = ckpt.metrics()["arena"]
    return arena


def run_dcp(
    trainer: Trainer, budget: Budget, args: argparse.Namespace, runs: dict[str, Any], pinned: bool
) -> None:
    name = "dcp_async_stager" if pinned else "dcp_async_default"
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError as exc:
        runs[name] = {"skipped": f"DCP unavailable: {exc}"}
        return
    cuda = trainer.device.type == "cuda"
    stager: Any = None
    if pinned:
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError as exc:
            runs[name] = {"skipped": f"this torch has no DefaultStager/StagingOptions: {exc}"}
            return
        # pinned memory and non-blocking copies need CUDA; shared memory only serves a
        # process-based upload, and a container's small /dev/shm cannot hold a model
        options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )

        class KeptStager(DefaultStager):
            """A stager that outlives each ``async_save``.

            Some torch releases close the caller's stager when the first save's upload
            finishes, which empties its copy table, so the second save fails with
            ``KeyError(<class 'type'>)``. Reusing one stager (and its pinned buffers) is how
            DCP's lazy mode is meant to run, so ``close`` waits for the end of the run.
            """

            def close(self) -> None:
                pass

            def release(self) -> None:
                super().close()

        stager = KeptStager(options)
    iter_s = runs["no_checkpoint"].get("iter_ms", 1000) / 1e3
    copy_s = trainer.state_bytes() / (2e9 if cuda else 1e9)  # pageable copies are slow
    estimate = (args.warmup + args.iters) * (iter_s + copy_s) + 10
    if budget.left() < estimate + 10:
        runs[name] = {"skipped": "budget", "estimate_s": round(estimate)}
        if stager is not None:
            stager.release()
        return
    log(name)
    state = {"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict()}
    pending: dict[str, Any] = {"upload": None, "staging": None}

    def wait_staging(*_: Any) -> None:
        staging = pending["staging"]
        if staging is not None:
            staging.result()
            pending["staging"] = None

    def checkpoint(_step: int) -> None:
        if pending["upload"] is not None:  # bounded: one checkpoint in flight, like the arena
            pending["upload"].result()
        state["optim"] = trainer.optimizer.state_dict()
        extra = {"async_stager": stager} if stager is not None else {}
        response = dcp.async_save(state, storage_writer=make_null_writer(), no_dist=True, **extra)
        if hasattr(response, "staging_completion"):
            pending["staging"] = response.staging_completion
            pending["upload"] = response.upload_completion
        else:
            pending["upload"] = response
        return None

    def guard(opt: torch.optim.Optimizer) -> Any:
        return opt.register_step_pre_hook(wait_staging)

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            warnings.filterwarnings("ignore", category=FutureWarning)
            result = measure(trainer, budget, args, 0, checkpoint, guard=guard)
            wait_staging()
            if pending["upload"] is not None:
                pending["upload"].result()
        result["stager"] = (
            {k: getattr(stager._config, k) for k in vars(stager._config)}
            if stager is not None and hasattr(stager, "_config")
            else "default (synchronous, pageable)"
        )
        runs[name] = result
    except Exception as exc:
        runs[name] = {"error": repr(exc)}
    finally:
        if stager is not None:
            stager.release()


def phase_stall(report: Report, budget: Budget, args: argparse.Namespace) -> None:
    device = torch.device("cpu" if args.cpu else "cuda")
    size = MODELS[args.model]
    if budget.left() < (20 if args.cpu else 90):
        report.doc["stall"] = {"skipped": "budget"}
        return
    log(f"stall: building the {args.model} model")
    trainer = build_trainer(size, device)
    params = sum(p.numel() for p in trainer.model.parameters())
    stall: dict[str, Any] = {
        "model": args.model,
        "parameters": params,
        "dtype": str(next(trainer.model.parameters()).dtype),
        "batch": size.batch,
        "seq": size.seq,
        "state_bytes": trainer.state_bytes(),
        "runs": {},
    }
    report.doc["stall"] = stall
    runs: dict[str, Any] = stall["runs"]
    log("no checkpoint")
    runs["no_checkpoint"] = measure(trainer, budget, args, 0, None)
    report.save()
    stall["lazyckpt_arena"] = run_lazyckpt(trainer, budget, args, runs)
    free_memory(device)
    report.save()
    run_dcp(trainer, budget, args, runs, pinned=True)
    free_memory(device)
    report.save()
    run_dcp(trainer, budget, args, runs, pinned=False)
    base = runs["no_checkpoint"].get("iter_ms")
    for result in runs.values():
        if base is not None and result.get("iter_ms") is not None:
            result["overhead_ms"] = result["iter_ms"] - base
    del trainer
    free_memory(device)


# -- verdict and table ----------------------------------------------------------------------


def _median(run: dict[str, Any] | None, key: str) -> float | None:
    if not run or key not in run:
        return None
    value = run[key].get("median")
    return float(value) if value is not None else None


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    """The GPU targets, judged on this run (only a CUDA run says anything about them)."""
    if doc["device"]["kind"] != "cuda":
        return {"evaluated": False, "why": "a CPU run checks the script, not the GPU path"}
    out: dict[str, Any] = {"evaluated": True}
    bandwidth = doc.get("bandwidth", {})
    if "ratio" in bandwidth:
        out["capture_vs_plain_d2h"] = {
            "target": ">= 0.80",
            "value": bandwidth["ratio"],
            "met": bandwidth["ratio"] >= 0.80,
        }
    runs = doc.get("stall", {}).get("runs", {})
    stream = runs.get("lazyckpt_stream")
    blocked = _median(stream, "blocked_ms")
    meta = _median(stream, "snapshot_ms")
    if blocked is not None and meta is not None:
        out["stream_guard_stall"] = {
            "target": "< 1 ms plus metadata",
            "blocked_ms": blocked,
            "metadata_ms": meta,
            "met": blocked - meta < 1.0,
        }
    interference = doc.get("interference", {})
    if "ratio" in interference:
        out["launch_bound_loop_beside_captures"] = {
            "target": "<= 1.10",
            "value": interference["ratio"],
            "met": interference["ratio"] <= 1.10,
        }
    dcp = _median(runs.get("dcp_async_default"), "blocked_ms")
    if blocked is not None and dcp is not None and blocked > 0:
        out["dcp_default_over_lazyckpt_stream"] = {
            "target": ">= 20",
            "value": dcp / blocked,
            "met": dcp / blocked >= 20,
        }
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(doc: dict[str, Any]) -> str:
    lines = [f"lazyckpt GPU check on {doc['device'].get('name', doc['device']['kind'])}"]
    tests = doc.get("tests", {})
    lines.append(f"tests/gpu: {tests.get('summary') or tests.get('skipped') or tests}")
    bw = doc.get("bandwidth", {})
    if "ratio" in bw:
        lines.append(
            f"bandwidth ({bw['bytes'] / MiB:.0f} MiB): plain {_median(bw, 'plain_gbps'):.2f} GB/s, "
            f"lazyckpt capture {_median(bw, 'lazyckpt_gbps'):.2f} GB/s ({bw['ratio']:.0%})"
        )
    else:
        lines.append(f"bandwidth: {bw.get('skipped', 'not measured')}")
    stall = doc.get("stall", {})
    if "runs" in stall:
        lines.append(
            f"stall per checkpoint, {stall['model']} ({_count(stall['parameters'])} params, "
            f"{stall['dtype']}, state {stall['state_bytes'] / GiB:.2f} GiB), AdamW, every iteration:"
        )
        lines.append(
            f"  {'run':<26}{'blocked ms':>12}{'metadata ms':>13}{'iter ms':>10}{'overhead ms':>13}"
        )
        for name, run in stall["runs"].items():
            if "skipped" in run or "error" in run:
                lines.append(f"  {name:<26}{run.get('skipped') or run.get('error')}")
                continue
            lines.append(
                f"  {name:<26}{_fmt(_median(run, 'blocked_ms'), 2):>12}"
                f"{_fmt(_median(run, 'snapshot_ms'), 2):>13}{_fmt(run.get('iter_ms')):>10}"
                f"{_fmt(run.get('overhead_ms')):>13}"
            )
    else:
        lines.append(f"stall: {stall.get('skipped', 'not measured')}")
    inter = doc.get("interference", {})
    if "ratio" in inter:
        med = inter["median_iter_ms"]
        lines.append(
            f"launch-bound loop ({inter['ops_per_iter']} tiny kernels) beside "
            f"{inter['bytes'] / MiB:.0f} MiB snapshots: {med['alone']:.2f} ms alone, "
            f"{med['lazyckpt']:.2f} ms beside them ({inter['ratio']:.2f}x)"
        )
    else:
        lines.append(f"interference: {inter.get('skipped', 'not measured')}")
    verdict = doc.get("targets", {})
    if verdict.get("evaluated"):
        for key, value in verdict.items():
            if isinstance(value, dict):
                lines.append(f"target {key}: {'met' if value['met'] else 'NOT met'} ({value})")
    else:
        lines.append(f"targets: not evaluated ({verdict.get('why', 'no data')})")
    lines.append(f"written: {doc.get('path')}")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------


@contextlib.contextmanager
def watchdog(report: Report, budget: Budget, grace: float = 30.0) -> Iterator[None]:
    """End the process soon after the budget, with what was measured written down."""

    def fire() -> None:
        report.doc["aborted"] = f"over budget by {grace:.0f}s"
        report.doc["elapsed_s"] = round(budget.elapsed(), 1)
        report.save()
        print(table(report.doc), flush=True)
        os._exit(3)

    timer = threading.Timer(budget.seconds + grace, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget = Budget(args.budget_s)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "started": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device_info(args.cpu),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "budget_s": args.budget_s,
    }
    report = Report(args.out, doc)
    doc["path"] = str(report.path)
    report.save()
    with watchdog(report, budget):
        if args.skip_tests:
            doc["tests"] = {"skipped": "--skip-tests"}
        else:
            phase_tests(report, budget, args.cpu)
        report.save()
        phase_bandwidth(report, budget, args)
        report.save()
        phase_stall(report, budget, args)
        report.save()
        phase_interference(report, budget, args)
        doc["targets"] = targets(doc)
        doc["elapsed_s"] = round(budget.elapsed(), 1)
        doc["complete"] = True
        report.save()
    print(table(doc), flush=True)
    tests = doc.get("tests", {})
    return 1 if tests.get("returncode") not in (None, 0) else 0


if __name__ == "__main__":
    sys.exit(main())
