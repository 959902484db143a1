"""How much a checkpoint streaming in the background slows a launch-bound training thread.

On a GPU the training thread is launch-bound: Python issues kernels, and each moment it
waits for the interpreter lock is a moment the GPU idles. This benchmark stands in for
that thread with a loop of many tiny torch ops on one intra-op thread (each op releases
and takes back the lock, as a kernel launch does), and measures its iteration time:

- ``alone``: no checkpoint;
- ``plain``: one plain thread does the snapshot's bytes' work (copy into a host buffer,
  crc32c, ``pwrite``, ``fdatasync``; every call releases the lock): the floor;
- ``lazyckpt``: a SyncCheckpointer with a host tier and a file tier;
- ``dcp-thread`` / ``dcp-process``: ``dcp.async_save`` with a ``FileSystemWriter`` and
  its thread executor, or its process executor (``AsyncCheckpointerType.PROCESS``).

A new snapshot of ``--mib`` MiB starts every ``--every`` iterations once the previous one
is complete (``--every 1``: the checkpoint streams all the time, as fast as each method
can), or with ``--every 5s`` every 5 seconds, so that the methods move the same bytes per
second and their costs compare at equal work. Placements:

- ``pinned``: the training thread on one core, every other thread (and a DCP helper
  process) on another one (``os.sched_setaffinity`` on the native thread ids), so the
  only thing they share is the interpreter lock;
- ``shared``: no affinity; the threads share all cores.

Each run is a fresh process (threads, affinity and DCP's helper process do not leak into
the next run) and the runs alternate (``abab``). A run reports the median iteration time
of the launch-bound work (``snapshot()``/``async_save`` calls are timed apart), the bytes
streamed, and figures that survive a machine loaded by other work:

- per thread (grouped by role), CPU time and voluntary context switches (wake-ups) from
  ``/proc/self/task/*/schedstat`` and ``status``, per GiB streamed;
- the training thread's *blocked* time: wall time minus its CPU time minus its time
  waiting for a CPU (``schedstat``). With the lock's other users on another core, what is
  left is time spent waiting for the interpreter lock (and page faults), per iteration
  and per GiB streamed.

    python bench/interference.py                         # every method, both placements
    python bench/interference.py --quick                 # a smoke run, a few seconds
    python bench/interference.py --methods alone,lazyckpt --placements pinned --mib 1024
    python bench/interference.py --switch-interval 0.5   # sys.setswitchinterval, in ms
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    GiB,
    MiB,
    abab,
    loadavg,
    machine_info,
    make_model_like_state,
    scratch_dir,
    summarize,
)

METHODS = ("alone", "plain", "lazyckpt", "dcp-thread", "dcp-process")
PLACEMENTS = ("pinned", "shared")
TRAIN_CORE = 0


# -- per-thread accounting (Linux /proc) --------------------------------------------------


def _tasks(pid: int | str = "self") -> dict[int, dict[str, int]]:
    """CPU ns, runqueue-wait ns and context switches of every thread of a process."""
    out: dict[int, dict[str, int]] = {}
    base = Path(f"/proc/{pid}/task")
    with contextlib.suppress(OSError):
        for entry in base.iterdir():
            try:
                cpu, wait, _ = (int(x) for x in (entry / "schedstat").read_text().split())
                status = (entry / "status").read_text().splitlines()
            except (OSError, ValueError):
                continue  # the thread ended meanwhile
            fields = dict(line.split(":\t", 1) for line in status if ":\t" in line)
            out[int(entry.name)] = {
                "cpu_ns": cpu,
                "wait_ns": wait,
                "vol": int(fields.get("voluntary_ctxt_switches", "0")),
                "invol": int(fields.get("nonvoluntary_ctxt_switches", "0")),
            }
    return out


def _children(pid: int | str = "self") -> list[int]:
    """Every descendant process (DCP's helper process and whatever it starts)."""
    found: list[int] = []
    todo = [str(pid)]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    kids = (task / "children").read_text().split()
                    found += [int(k) for k in kids]
                    todo += kids
    return found


def _role(name: str) -> str:
    for prefix, role in (
        ("lazyckpt-engine", "engine loop"),
        ("lazyckpt-capture", "capture pool"),
        ("lazyckpt-checksum", "checksum pool"),
        ("lazyckpt-host", "host tier"),
        ("lazyckpt-", "file tier"),
        ("asyncio", "default executor"),
        ("plain-", "plain thread"),
    ):
        if name.startswith(prefix):
            return role
    return "other threads"


def _account() -> dict[str, dict[str, int]]:
    """Per role: summed CPU ns, wake-ups, threads (this process and its children)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main = threading.main_thread().native_id
    roles: dict[str, dict[str, int]] = {}

    def add(role: str, row: dict[str, int]) -> None:
        acc = roles.setdefault(role, {"cpu_ns": 0, "wait_ns": 0, "vol": 0, "invol": 0, "threads": 0})
        for k in ("cpu_ns", "wait_ns", "vol", "invol"):
            acc[k] += row[k]
        acc["threads"] += 1

    for tid, row in _tasks().items():
        add("training thread" if tid == main else _role(names.get(tid, "")), row)
    for child in _children():
        for row in _tasks(child).values():
            add("helper process", row)
    # the whole process, threads that ended included (DCP's thread executor ends its
    # thread after each save; a thread's own /proc entry goes with it)
    use = resource.getrusage(resource.RUSAGE_SELF)
    roles["process"] = {
        "cpu_ns": int((use.ru_utime + use.ru_stime) * 1e9),
        "wait_ns": 0,
        "vol": use.ru_nvcsw,
        "invol": use.ru_nivcsw,
        "threads": 0,
    }
    return roles


def _affinity(tid: int) -> set[int]:
    try:
        return os.sched_getaffinity(tid)
    except OSError:  # the thread ended meanwhile
        return set()


def _pin_others(core: int) -> None:
    """Every thread but the training thread, and every child process, onto ``core``."""
    main = threading.main_thread().native_id
    for tid in _tasks():
        if tid != main:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, {core})
    for child in _children():
        for tid in _tasks(child):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, {core})


# -- one run (in a fresh process) ---------------------------------------------------------


class _Plain:
    """The floor: one thread does each snapshot's bytes' work with lock-free calls."""

    def __init__(self, state: dict[str, Any], root: Path, shard: int) -> None:
        import crc32c
        import torch

        self._crc = crc32c.crc32c
        self.flat = [t.reshape(-1).view(torch.uint8) for t in state.values()]
        total = sum(t.numel() for t in self.flat)
        self.buf = torch.empty(total, dtype=torch.uint8)
        self.path = root / "plain.data"
        self.shard = shard
        self.go = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="plain-writer", daemon=True)
        self.thread.start()

    def start(self) -> None:
        self.idle.clear()
        self.go.set()

    def done(self) -> bool:
        return self.idle.is_set()

    def _run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(self.buf.numpy().data)
        try:
            while True:
                self.go.wait()
                self.go.clear()
                if self.stop:
                    return
                at = 0
                for t in self.flat:  # a chunk per shard, as a pipeline would
                    for o in range(0, t.numel(), self.shard):
                        n = min(self.shard, t.numel() - o)
                        self.buf[at : at + n].copy_(t[o : o + n])
                        self._crc(view[at : at + n])
                        os.pwrite(fd, view[at : at + n], at)
                        at += n
                os.fdatasync(fd)
                self.idle.set()
        finally:
            os.close(fd)

    def close(self) -> None:
        self.idle.wait()
        self.stop = True
        self.go.set()
        self.thread.join()


def _launch_bound(x: Any, ops: int) -> Any:
    for _ in range(ops):
        x = x.mul(1.0001).add_(1e-4)
    return x


def run_one(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    if cfg["switch_interval_ms"]:
        sys.setswitchinterval(cfg["switch_interval_ms"] / 1e3)
    method, pinned = cfg["method"], cfg["placement"] == "pinned"
    other_core = 1 if TRAIN_CORE == 0 else 0
    if pinned:
        # threads inherit the affinity of the thread that starts them: start everything
        # on the pipeline's core, then move the training thread to its own
        os.sched_setaffinity(0, {other_core})
    state = make_model_like_state(cfg["mib"] * MiB)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    x = torch.ones(64)
    with scratch_dir(cfg["tmp"], "interference-") as root:
        pending: Any = None
        saves = 0
        ckpt: Any = None
        plain: _Plain | None = None
        if method == "lazyckpt":
            from lazyckpt import SyncCheckpointer
            from tiers import FileTier, HostMemoryTier

            ckpt = SyncCheckpointer(
                [HostMemoryTier(2 * nbytes + 64 * MiB), FileTier(root / "lazy", keep_last=2)],
                deadline=None,
                shard_size=cfg.get("shard_mib", 16) * MiB,
            ).open()
            # the state is what an optimizer owns (as parameters and their moments are), so
            # it is captured lazily, not copied at snapshot(); the loop never steps it
            ckpt.guard(torch.optim.SGD([torch.nn.Parameter(t) for t in state.values()], lr=0.1))
        elif method == "plain":
            plain = _Plain(state, root, 16 * MiB)
        elif method.startswith("dcp"):
            import torch.distributed as dist

            warnings.filterwarnings("ignore")
            import logging

            logging.disable(logging.INFO)
            if method == "dcp-process":
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(cfg["port"]))
                dist.init_process_group("gloo", rank=0, world_size=1)

        def start(step: int) -> Any:
            nonlocal saves
            saves += 1
            if ckpt is not None:
                return ckpt.snapshot({"model": state}, step=step)
            if plain is not None:
                plain.start()
                return plain
            from torch.distributed.checkpoint.filesystem import FileSystemWriter
            from torch.distributed.checkpoint.state_dict_saver import (
                AsyncCheckpointerType,
                async_save,
            )

            kind = AsyncCheckpointerType.PROCESS if method == "dcp-process" else AsyncCheckpointerType.THREAD
            return async_save(
                {"model": state},
                storage_writer=FileSystemWriter(str(root / "dcp" / str(step))),
                async_checkpointer_type=kind,
                no_dist=method == "dcp-thread",
            )

        def is_done(p: Any) -> bool:
            return bool(p.done())

        if method != "alone":  # the first one starts helpers and pools: not measured
            pending = start(0)
            while not is_done(pending):
                time.sleep(0.01)
            if isinstance(pending, Future):
                pending.result()
        if pinned:
            os.sched_setaffinity(0, {TRAIN_CORE})
            _pin_others(other_core)
        for _ in range(cfg["warmup"]):
            x = _launch_bound(x, cfg["ops"])
        iters: list[float] = []
        calls: list[float] = []
        saves = 0
        before = _account()
        t_begin = time.perf_counter()
        it = 0
        finished = 0  # saves finished inside the window
        every = str(cfg["every"])
        last_start = [-float("inf")]

        def due(it: int) -> bool:
            if every.endswith("s"):  # a period in seconds
                return time.perf_counter() - last_start[0] >= float(every[:-1])
            return it % int(every) == 0

        def running() -> bool:
            spent = time.perf_counter() - t_begin
            if method == "alone" or spent >= 4 * cfg["seconds"]:
                return bool(spent < cfg["seconds"])
            # long enough for a slow method to finish two saves, within bounds
            return bool(spent < cfg["seconds"] or finished < 2)

        while running():
            it += 1
            if method != "alone" and due(it) and (pending is None or is_done(pending)):
                if isinstance(pending, Future):
                    pending.result()
                if pending is not None:
                    finished += 1
                t0 = last_start[0] = time.perf_counter()
                pending = start(it)
                calls.append(time.perf_counter() - t0)
                if pinned and it < 50:  # a thread or process started by this call
                    _pin_others(other_core)
            t0 = time.perf_counter()
            x = _launch_bound(x, cfg["ops"])
            iters.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_begin
        after = _account()
        # a check of the placement: threads other than the training thread allowed on its core
        main_tid = threading.main_thread().native_id
        strays = [
            tid
            for tid in list(_tasks()) + [t for c in _children() for t in _tasks(c)]
            if tid != main_tid and TRAIN_CORE in _affinity(tid)
        ]
        # the bytes streamed: every finished save, and the running one by the time it took
        in_flight = pending is not None and not is_done(pending)
        streamed = (saves - (1 if in_flight else 0)) * nbytes
        if pending is not None:
            while not is_done(pending):
                time.sleep(0.01)
            if isinstance(pending, Future):
                pending.result()
        if ckpt is not None:
            ckpt.close()
        if plain is not None:
            plain.close()
    roles: dict[str, dict[str, float]] = {}
    for role, row in after.items():
        prev = before.get(role, {"cpu_ns": 0, "wait_ns": 0, "vol": 0, "invol": 0})
        roles[role] = {
            "cpu_ms": (row["cpu_ns"] - prev["cpu_ns"]) / 1e6,
            "runqueue_ms": (row["wait_ns"] - prev["wait_ns"]) / 1e6,
            "wakeups": row["vol"] - prev["vol"],
            "preempted": row["invol"] - prev["invol"],
            "threads": row["threads"],
        }
    train = roles.get("training thread", {"cpu_ms": 0.0, "runqueue_ms": 0.0})
    blocked_ms = wall * 1e3 - train["cpu_ms"] - train["runqueue_ms"]
    return {
        **cfg,
        "snapshot_bytes": nbytes,
        "iters": len(iters),
        "iter_ms": summarize([s * 1e3 for s in iters]),
        "iter_ms_mean": 1e3 * sum(iters) / max(1, len(iters)),
        "call_ms": summarize([s * 1e3 for s in calls]),
        "wall_s": wall,
        "saves_started": saves,
        "streamed_gib": streamed / GiB,
        "train_blocked_ms": blocked_ms,
        "threads_on_training_core": len(strays) if pinned else None,
        "roles": roles,
        "loadavg": loadavg(),
    }


# -- the driver ------------------------------------------------------------------------------


def _per_gib(row: dict[str, Any], value: float) -> float | None:
    gib = row["streamed_gib"]
    return value / gib if gib > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument(
        "--every", default="1,8", help="snapshot every N iterations, or every Ns seconds (list)"
    )
    parser.add_argument("--mib", type=int, default=256, help="snapshot size (up to 1024)")
    parser.add_argument("--shard-mib", type=int, default=16, help="lazyckpt's shard_size")
    parser.add_argument("--ops", type=int, default=400, help="tiny torch ops per iteration")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured time per run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--switch-interval", type=float, default=0.0, help="ms; 0: Python's")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tmp", default=None, help="scratch parent (default: runs/)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.quick:
        args.mib, args.seconds, args.reps, args.every = 32, 1.0, 1, "1"
    if len(os.sched_getaffinity(0)) < 2 and "pinned" in args.placements:
        raise SystemExit("the pinned placement needs two cores")
    methods = args.methods.split(",")
    placements = args.placements.split(",")
    everies = args.every.split(",")
    names = [f"{p}/{e}/{m}" for p in placements for e in everies for m in methods]
    rows: list[dict[str, Any]] = []
    for n, (rep, name) in enumerate(abab(names, args.reps)):
        placement, every, method = name.split("/")
        cfg = {
            "method": method,
            "placement": placement,
            "every": every,
            "mib": args.mib,
            "shard_mib": args.shard_mib,
            "ops": args.ops,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "switch_interval_ms": args.switch_interval,
            "tmp": args.tmp,
            "port": 29600 + n % 200,
            "rep": rep,
        }
        done = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(cfg)],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            print(f"{name}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        row = json.loads(lines[-1])
        rows.append(row)
        print(_line(row), flush=True)
    summary = _summary(rows)
    for line in _table(summary):
        print(line)
    result = {
        "benchmark": "interference",
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items() if k != "one"},
        "summary": summary,
        "runs": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def _pipeline(row: dict[str, Any]) -> dict[str, float]:
    """CPU ms and wake-ups of everything but the training thread: the process's (ended
    threads included) less the training thread's, plus a helper process's."""
    roles = row["roles"]
    zero = {"cpu_ms": 0.0, "wakeups": 0}
    train, helper = roles.get("training thread", zero), roles.get("helper process", zero)
    cpu = roles["process"]["cpu_ms"] - train["cpu_ms"] + helper["cpu_ms"]
    wake = roles["process"]["wakeups"] - train["wakeups"] + helper["wakeups"]
    return {"cpu_ms": cpu, "wakeups": wake}


def _line(row: dict[str, Any]) -> str:
    p = _pipeline(row)
    gib = row["streamed_gib"]

    def per(v: float) -> str:
        return f"{v / gib:8.0f}" if gib > 0 else "       -"

    return (
        f"{row['placement']:6} every {row['every']:>3} {row['method']:11} rep {row['rep']}: "
        f"iter {row['iter_ms']['median']:6.2f} ms  {gib:5.2f} GiB  "
        f"blocked {row['train_blocked_ms'] / max(1, row['iters']):6.3f} ms/iter  "
        f"cpu {row['roles']['training thread']['cpu_ms'] / max(1, row['iters']):6.3f} ms/iter  "
        f"runqueue {row['roles']['training thread']['runqueue_ms'] / max(1, row['iters']):6.3f} ms/iter  "
        f"others' cpu {per(p['cpu_ms'])} ms/GiB  "
        f"training thread's waits {per(row['roles']['training thread']['wakeups'])} /GiB  "
        f"load {row['loadavg'][:1]}"
    )


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = sorted({(r["placement"], r["every"], r["method"]) for r in rows})
    for placement, every, method in keys:
        mine = [r for r in rows if (r["placement"], r["every"], r["method"]) == (placement, every, method)]
        alone = [
            r["iter_ms"]["median"]
            for r in rows
            if (r["placement"], r["method"]) == (placement, "alone")
        ]
        med = statistics.median(r["iter_ms"]["median"] for r in mine)
        mean = statistics.median(r["iter_ms_mean"] for r in mine)
        alone_mean = [
            r["iter_ms_mean"] for r in rows if (r["placement"], r["method"]) == (placement, "alone")
        ]
        entry: dict[str, Any] = {
            "iter_ms_median": med,
            "ratio_to_alone": med / statistics.median(alone) if alone else None,
            "iter_ms_mean": mean,
            "mean_ratio_to_alone": mean / statistics.median(alone_mean) if alone_mean else None,
            "streamed_gib_per_s": statistics.median(r["streamed_gib"] / r["wall_s"] for r in mine),
            "train_blocked_ms_per_iter": statistics.median(
                r["train_blocked_ms"] / max(1, r["iters"]) for r in mine
            ),
            "train_cpu_ms_per_iter": statistics.median(
                r["roles"]["training thread"]["cpu_ms"] / max(1, r["iters"]) for r in mine
            ),
            "runs": len(mine),
        }
        if method != "alone":
            gibs = [r for r in mine if r["streamed_gib"] > 0]
            if gibs:
                entry["train_blocked_ms_per_gib"] = statistics.median(
                    r["train_blocked_ms"] / r["streamed_gib"] for r in gibs
                )
                entry["others_cpu_ms_per_gib"] = statistics.median(
                    _pipeline(r)["cpu_ms"] / r["streamed_gib"] for r in gibs
                )
                entry["others_wakeups_per_gib"] = statistics.median(
                    _pipeline(r)["wakeups"] / r["streamed_gib"] for r in gibs
                )
                entry["train_waits_per_gib"] = statistics.median(
                    r["roles"]["training thread"]["wakeups"] / r["streamed_gib"] for r in gibs
                )
                entry["roles_per_gib"] = {
                    role: {
                        "cpu_ms": statistics.median(
                            r["roles"].get(role, {"cpu_ms": 0.0})["cpu_ms"] / r["streamed_gib"]
                            for r in gibs
                        ),
                        "wakeups": statistics.median(
                            r["roles"].get(role, {"wakeups": 0})["wakeups"] / r["streamed_gib"]
                            for r in gibs
                        ),
                    }
                    for role in sorted({k for r in gibs for k in r["roles"]})
                }
        out[f"{placement}/{every}/{method}"] = entry
    return out


def _table(summary: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"{'placement/every/method':34} {'iter ms':>8} {'x alone':>8} {'mean x':>7} {'GiB/s':>6} "
        f"{'blocked ms/GiB':>15} {'waits/GiB':>10} {'others cpu ms/GiB':>18}",
    ]
    for name, e in summary.items():
        def f(key: str, fmt: str, e: dict[str, Any] = e) -> str:
            v = e.get(key)
            return format(v, fmt) if v is not None else "-"

        lines.append(
            f"{name:34} {e['iter_ms_median']:8.2f} {f('ratio_to_alone', '8.2f'):>8} "
            f"{f('mean_ratio_to_alone', '7.2f'):>7} "
            f"{e['streamed_gib_per_s']:6.2f} {f('train_blocked_ms_per_gib', '15.0f'):>15} "
            f"{f('train_waits_per_gib', '10.0f'):>10} {f('others_cpu_ms_per_gib', '18.0f'):>18}"
        )
    return lines


if __name__ == "__main__":
    main()
