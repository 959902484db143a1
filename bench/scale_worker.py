"""One rank of a ``bench/scale.py`` job: gloo on loopback, every figure measured in-process.

``scale_worker.py CONFIG.json OUT_DIR`` runs the parts listed in the config, in order, and
writes ``OUT_DIR/rank<N>.json``. Every part runs on every rank of the job:

- ``sweep``: a small FSDP-like state (``Shard(0)`` DTensors on a 1-D mesh of every rank,
  plus a few tensors inside ``lazyckpt.Replicated``, as a model's norms would be), snapshotted
  a few times on a ``FileTier``, restored, and the same state saved and loaded by DCP, the two
  alternating;
- ``many``: the same shape with many tiny ``Shard(0)`` DTensors per rank (10,000 and
  100,000) and nothing replicated;
- ``readonce``: a restore of a data-parallel state (``Replicated`` weights, 4 ranks) and of an
  HSDP 2x2 model (``fully_shard`` on a 2-D mesh, as ``tests/helpers/layouts_worker.py``
  builds it), each against ``dcp.load`` of the same state, the page cache dropped before
  every restore: bytes read from the files in all (``rchar`` of ``/proc/self/io``) against the
  bytes stored, and time.

What is counted, and how:

- every call a rank makes to ``torch.distributed``'s collectives and point-to-point calls
  (the module's functions are wrapped, so lazyckpt's coordinator and DCP are counted alike),
  per process group (lazyckpt's own groups or the default group DCP uses), with the seconds
  spent inside each;
- ``Coordinator.collectives``, lazyckpt's own count of the collectives it issued;
- restore planning: the seconds from the ``restore()`` call to the first shard read
  (``read_verified``), with the rank manifests read and the share plan timed inside;
  DCP's: from ``dcp.load``/``dcp.save`` to the storage layer's first ``read_data`` /
  ``write_data``, and the seconds inside its planner's methods.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import abab, drop_from_page_cache

import lazyckpt
from lazyckpt._restore import reshard as _reshard
from lazyckpt._restore import restore as _restore
from tiers import FileTier

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")

OPTIONS: dict[str, Any] = {"shard_size": 1 << 20, "deadline": 300.0}

# -- counting torch.distributed calls --------------------------------------------------------

COUNTED = (
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
    "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "monitored_barrier", "send", "recv", "isend", "irecv",
)


class Calls:
    """Counts (and times) calls of ``torch.distributed`` functions, per function and per
    kind of group, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.default_group: Any = None

    def install(self) -> None:
        for name in COUNTED:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            where = "default" if group is None or group is self.default_group else "own"
            key = f"{where}:{name}"
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                with self.lock:
                    self.counts[key] = self.counts.get(key, 0) + 1
                    self.seconds[key] = self.seconds.get(key, 0.0) + dt

        return counted

    def snapshot(self) -> tuple[dict[str, int], dict[str, float]]:
        with self.lock:
            return dict(self.counts), dict(self.seconds)

    @contextmanager
    def window(self, into: dict[str, Any]) -> Iterator[None]:
        """Record the calls made inside the block into ``into["calls"]``/``["call_s"]``."""
        c0, s0 = self.snapshot()
        try:
            yield
        finally:
            c1, s1 = self.snapshot()
            into["calls"] = {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}
            into["call_s"] = {k: v - s0.get(k, 0.0) for k, v in s1.items() if k in into["calls"]}


CALLS = Calls()


class Marks:
    """Timestamps and timings from inside the library's restore (wrapped functions)."""

    def __init__(self) -> None:
        self.first_read: float | None = None
        self.manifests = 0
        self.manifest_s = 0.0
        self.plan_s = 0.0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


MARKS = Marks()


def _install_restore_marks() -> None:
    """Wrap the restore's first shard read, its rank-manifest reads and its share plan."""
    for module in (_reshard, _restore):
        original = module.read_verified

        @functools.wraps(original)
        async def first(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            if MARKS.first_read is None:
                MARKS.first_read = time.perf_counter()
            return await __original(*args, **kwargs)

        module.read_verified = first  # type: ignore[assignment]

    read_rank_manifest = _reshard._read_rank_manifest

    async def counted_manifest(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await read_rank_manifest(*args, **kwargs)
        finally:
            MARKS.manifests += 1
            MARKS.manifest_s += time.perf_counter() - t0

    _reshard._read_rank_manifest = counted_manifest  # type: ignore[assignment]
    share_plan = _reshard._share_plan

    def timed_plan(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return share_plan(*args, **kwargs)
        finally:
            MARKS.plan_s += time.perf_counter() - t0

    _reshard._share_plan = timed_plan  # type: ignore[assignment]


def read_bytes() -> int:
    """Bytes this process read through read(2)/pread(2) so far (page cache or not)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return 0


# -- states -----------------------------------------------------------------------------------


def _mesh_1d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def sharded_state(
    mesh: Any, tensors: int, numel: int, replicated: int, rep_numel: int, seed: int
) -> dict[str, Any]:
    """``tensors`` ``Shard(0)`` DTensors of ``numel`` local values each (global ``numel x
    world``), and ``replicated`` tensors of ``rep_numel`` values marked ``Replicated``.
    Built from local chunks (``DTensor.from_local``), no collective. ``mesh=None``: plain
    per-rank tensors instead of the DTensors."""
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    model = {
        f"layers.{i}.weight": torch.randn(numel, generator=g)
        if mesh is None
        else DTensor.from_local(torch.randn(numel, generator=g), mesh, [Shard(0)], run_check=False)
        for i in range(tensors)
    }
    state: dict[str, Any] = {"model": model}
    if replicated:
        # identical on every rank: the same seed everywhere
        gr = torch.Generator().manual_seed(seed)
        state["norms"] = lazyckpt.Replicated(
            {f"norm.{j}": torch.randn(rep_numel, generator=gr) for j in range(replicated)}
        )
    return state


def dcp_view(state: dict[str, Any], per_rank: bool = False) -> dict[str, Any]:
    """The same tensors as a flat dict DCP takes (``Replicated`` unwrapped: DCP stores a
    plain tensor of the same key once, as replicated). ``per_rank``: the model's tensors
    under this rank's own keys (DCP would take plain tensors of the same key on every rank
    for copies of one tensor, and store one)."""
    model = f"rank{dist.get_rank()}/model" if per_rank else "model"
    out: dict[str, Any] = {f"{model}/{k}": v for k, v in state["model"].items()}
    if "norms" in state:
        out.update({f"norms/{k}": v for k, v in state["norms"].value.items()})
    return out


def _locals(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in dcp_view(state).items():
        out[k] = v.to_local() if hasattr(v, "to_local") else v
    return out


def _zero(tensors: Any) -> None:
    """Overwrite every tensor (local chunks of DTensors too) with zeros, so that a restore
    that leaves one untouched shows as a mismatch."""
    with torch.no_grad():
        for v in tensors:
            (v.to_local() if hasattr(v, "to_local") else v).zero_()


def _mismatch(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    la, lb = _locals(a), _locals(b)
    return [k for k in la if not torch.equal(la[k], lb[k])]


# -- DCP ------------------------------------------------------------------------------------


def _dcp_classes() -> dict[str, Any]:
    """DCP's default planners and file storage, timed: seconds inside the planner methods,
    and the time of the first ``write_data``/``read_data`` (where planning ends)."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

    def timed(base: type) -> type:
        class Timed(base):  # type: ignore[misc, valid-type]
            seconds = 0.0

            def _timed(self, name: str, *args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return getattr(super(), name)(*args, **kwargs)
                finally:
                    type(self).seconds += time.perf_counter() - t0

            def set_up_planner(self, *args: Any, **kwargs: Any) -> Any:
                return self._timed("set_up_planner", *args, **kwargs)

            def create_local_plan(self, *args: Any, **kwargs: Any) -> Any:
                return self._timed("create_local_plan", *args, **kwargs)

            def create_global_plan(self, *args: Any, **kwargs: Any) -> Any:
                return self._timed("create_global_plan", *args, **kwargs)

            def finish_plan(self, *args: Any, **kwargs: Any) -> Any:
                return self._timed("finish_plan", *args, **kwargs)

        return Timed

    class Writer(FileSystemWriter):
        first: float | None = None

        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            if Writer.first is None:
                Writer.first = time.perf_counter()
            return super().write_data(*args, **kwargs)

    class Reader(FileSystemReader):
        first: float | None = None

        def read_data(self, *args: Any, **kwargs: Any) -> Any:
            if Reader.first is None:
                Reader.first = time.perf_counter()
            return super().read_data(*args, **kwargs)

    return {
        "save_planner": timed(DefaultSavePlanner),
        "load_planner": timed(DefaultLoadPlanner),
        "writer": Writer,
        "reader": Reader,
    }


DCP: dict[str, Any] = {}


def dcp_save(state: dict[str, Any], path: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    planner, writer = DCP["save_planner"], DCP["writer"]
    planner.seconds = 0.0
    writer.first = None
    row: dict[str, Any] = {}
    with CALLS.window(row):
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer(str(path)), planner=planner())
        t1 = time.perf_counter()
    row["save_s"] = t1 - t0
    row["to_first_write_s"] = (writer.first or t1) - t0
    row["planner_s"] = planner.seconds
    return row


def dcp_load(state: dict[str, Any], path: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    planner, reader = DCP["load_planner"], DCP["reader"]
    planner.seconds = 0.0
    reader.first = None
    row: dict[str, Any] = {}
    before = read_bytes()
    with CALLS.window(row):
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=reader(str(path)), planner=planner())
        t1 = time.perf_counter()
    row["read_bytes"] = read_bytes() - before
    row["load_s"] = t1 - t0
    row["to_first_read_s"] = (reader.first or t1) - t0
    row["planner_s"] = planner.seconds
    return row


# -- lazyckpt -----------------------------------------------------------------------------------


def _coordinator(ckpt: lazyckpt.Checkpointer) -> Any:
    return ckpt._core.engine.coordinator


async def lazy_snapshot(ckpt: lazyckpt.Checkpointer, state: Any, step: int) -> dict[str, Any]:
    coord = _coordinator(ckpt)
    c0 = coord.collectives if coord is not None else 0
    row: dict[str, Any] = {}
    with CALLS.window(row):
        t0 = time.perf_counter()
        handle = await ckpt.snapshot(state, step=step)
        t1 = time.perf_counter()
        await handle.committed()
        t2 = time.perf_counter()
    row["snapshot_s"] = t1 - t0
    row["commit_s"] = t2 - t0
    row["coordinator_collectives"] = (coord.collectives if coord is not None else 0) - c0
    return row


async def lazy_restore(ckpt: lazyckpt.Checkpointer, into: Any) -> dict[str, Any]:
    coord = _coordinator(ckpt)
    c0 = coord.collectives if coord is not None else 0
    sent0 = coord.sent_bytes if coord is not None else 0
    MARKS.reset()
    row: dict[str, Any] = {}
    before = read_bytes()
    with CALLS.window(row):
        t0 = time.perf_counter()
        await ckpt.restore(into=into)  # the newest step every rank committed, as a resume does
        t1 = time.perf_counter()
    row["read_bytes"] = read_bytes() - before
    row["restore_s"] = t1 - t0
    row["to_first_read_s"] = (MARKS.first_read or t1) - t0
    row["manifests_read"] = MARKS.manifests
    row["manifest_read_s"] = MARKS.manifest_s  # summed over concurrent reads
    row["share_plan_s"] = MARKS.plan_s
    row["coordinator_collectives"] = (coord.collectives if coord is not None else 0) - c0
    row["sent_bytes"] = (coord.sent_bytes if coord is not None else 0) - sent0
    return row


def _barrier() -> None:
    """Line the ranks up between measurements (not counted: the real function)."""
    CALLS_BARRIER()


CALLS_BARRIER: Callable[[], Any] = dist.barrier


def _stored(path: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern))


def _drop(path: Path) -> None:
    """Rank 0 drops the files under ``path`` from the page cache; everyone waits."""
    if dist.get_rank() == 0:
        drop_from_page_cache(path)
    _barrier()


# -- parts ------------------------------------------------------------------------------------


async def part_sweep(cfg: dict[str, Any], root: Path, mesh: Any) -> dict[str, Any]:
    """``cfg["reps"]`` snapshots (after one warm-up) and restores, against DCP."""
    return await _save_restore(cfg, root / "sweep", mesh)


async def part_many(cfg: dict[str, Any], root: Path, mesh: Any) -> dict[str, Any]:
    """Each ``(kind, count)`` case of ``cfg["cases"]``: ``dtensor`` (``Shard(0)`` chunks of
    one global tensor each) or ``plain`` (per-rank tensors, each rank's own keys for DCP)."""
    out = {}
    for kind, n in cfg["cases"]:
        sub = {**cfg, "tensors": n, "kind": kind}
        out[f"{kind}-{n}"] = await _save_restore(sub, root / f"many-{kind}-{n}", mesh)
    return out


async def _save_restore(cfg: dict[str, Any], root: Path, mesh: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    tensors, numel = cfg["tensors"], cfg["numel"]
    replicated, rep_numel = cfg.get("replicated", 0), cfg.get("rep_numel", 0)
    plain = cfg.get("kind") == "plain"
    on = None if plain else mesh
    state = sharded_state(on, tensors, numel, replicated, rep_numel, seed=1)
    target = sharded_state(on, tensors, numel, replicated, rep_numel, seed=2)
    lazy_root, dcp_root = root / "lazy", root / "dcp"
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        lazy_root.mkdir(parents=True)
        dcp_root.mkdir(parents=True)
    _barrier()
    flat = dcp_view(state, per_rank=plain)
    out: dict[str, Any] = {"open": {}, "snapshots": [], "restores": [], "dcp_saves": [],
                           "dcp_loads": []}
    with CALLS.window(out["open"]):
        t0 = time.perf_counter()
        ckpt = await lazyckpt.Checkpointer([FileTier(lazy_root)], eager_bytes=0, **OPTIONS).open()
        out["open"]["open_s"] = time.perf_counter() - t0
    try:
        step = 1
        out["warmup"] = await lazy_snapshot(ckpt, state, step)  # cold caches
        _barrier()
        dcp_save(flat, dcp_root / "warmup")
        _barrier()
        reps = cfg["reps"]
        for rep, name in abab(["lazyckpt", "dcp"], reps):
            if name == "lazyckpt":
                step += 1
                out["snapshots"].append(await lazy_snapshot(ckpt, state, step))
            else:
                out["dcp_saves"].append(dcp_save(flat, dcp_root / f"s{rep}"))
            _barrier()
        out["stored_bytes"] = {
            "lazyckpt": _stored(lazy_root / f"step-{step:012d}", "rank-*.data"),
            "dcp": _stored(dcp_root / "s0", "*.distcp"),
        }
        dcp_target = dcp_view(target, per_rank=plain)
        for _rep, name in abab(["lazyckpt", "dcp"], cfg.get("restore_reps", reps)):
            _drop(root)
            _zero(dcp_target.values())
            if name == "lazyckpt":
                row = await lazy_restore(ckpt, target)
                row["mismatch"] = _mismatch(state, target)
                out["restores"].append(row)
            else:
                row = dcp_load(dcp_target, dcp_root / "s0")
                row["mismatch"] = _mismatch(state, target)
                out["dcp_loads"].append(row)
            _barrier()
    finally:
        await ckpt.aclose()
    _barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    out["local_bytes"] = sum(v.numel() * v.element_size() for v in _locals(state).values())
    return out


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(width, 4 * width)
        self.w2 = torch.nn.Linear(4 * width, width)


class Net(torch.nn.Module):
    def __init__(self, width: int, blocks: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleDict({str(i): Block(width) for i in range(blocks)})


def _hsdp(width: int, blocks: int, seed: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    """HSDP 2x2: ``fully_shard`` on a 2-D mesh (replicate x shard), as the layout tests do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Net(width, blocks, seed)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, {"model": model}


def _ddp(width: int, blocks: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Data parallel: the same weights on every rank, marked ``Replicated``."""
    weights = {k: v.detach().clone() for k, v in Net(width, blocks, seed).state_dict().items()}
    return weights, {"model": lazyckpt.Replicated(weights)}


def _params(obj: Any) -> list[torch.Tensor]:
    """The tensors a restore writes into: a module's state-dict tensors, or the dict's."""
    sd = obj.state_dict() if isinstance(obj, torch.nn.Module) else obj
    return list(sd.values())


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in sd.items()}


async def part_readonce(cfg: dict[str, Any], root: Path, mesh: Any) -> dict[str, Any]:
    """A same-layout restore of a DDP and an HSDP 2x2 state, against ``dcp.load``."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for layout in cfg["layouts"]:
        base = root / f"readonce-{layout}"
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
            (base / "lazy").mkdir(parents=True)
            (base / "dcp").mkdir(parents=True)
        _barrier()
        build = _hsdp if layout == "hsdp" else _ddp
        saved, state = build(cfg["width"], cfg["blocks"], seed=1)
        other, target = build(cfg["width"], cfg["blocks"], seed=2)
        saved_sd = saved.state_dict() if isinstance(saved, torch.nn.Module) else saved
        expected = _full(saved_sd)
        res: dict[str, Any] = {"restores": [], "dcp_loads": []}
        async with lazyckpt.Checkpointer([FileTier(base / "lazy")], **OPTIONS) as ckpt:
            res["save"] = await lazy_snapshot(ckpt, state, 1)
            dcp_save(dict(saved_sd), base / "dcp" / "s")
            _barrier()
            res["stored_bytes"] = {
                "lazyckpt": _stored(base / "lazy" / f"step-{1:012d}", "rank-*.data"),
                "dcp": _stored(base / "dcp" / "s", "*.distcp"),
            }
            for _rep, name in abab(["lazyckpt", "dcp"], cfg["reps"]):
                _drop(base)
                _zero(_params(other))
                if name == "lazyckpt":
                    row = await lazy_restore(ckpt, target)
                    res["restores"].append(row)
                else:
                    sd = other.state_dict() if isinstance(other, torch.nn.Module) else other
                    row = dcp_load(sd, base / "dcp" / "s")
                    res["dcp_loads"].append(row)
                got = _full(other.state_dict() if isinstance(other, torch.nn.Module) else other)
                row["mismatch"] = [k for k in expected if not torch.equal(expected[k], got[k])]
                _barrier()
        res["state_bytes"] = sum(v.numel() * v.element_size() for v in expected.values())
        out[layout] = res
        _barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    return out


PARTS = {"sweep": part_sweep, "many": part_many, "readonce": part_readonce}


async def main_async(config: dict[str, Any]) -> dict[str, Any]:
    root = Path(config["root"])
    mesh = _mesh_1d()
    CALLS.default_group = dist.group.WORLD
    CALLS.install()
    _install_restore_marks()
    DCP.update(_dcp_classes())
    result: dict[str, Any] = {}
    for name in config["parts"]:
        t0 = time.perf_counter()
        result[name] = await PARTS[name](config[name], root, mesh)
        result[f"{name}_wall_s"] = time.perf_counter() - t0
    return result


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    result = asyncio.run(main_async(config))
    result["rank"] = rank
    result["world"] = dist.get_world_size()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # leave without the interpreter's finalization: a DeviceMesh keeps gloo threads alive
    # past destroy_process_group (see tests/helpers/ranks.py::end_rank)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
