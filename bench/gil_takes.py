"""How often each of the pipeline's threads takes the interpreter lock, per GiB streamed.

A launch-bound training thread pays for every time another thread takes the interpreter
lock while it runs (docs/design.md, "Staying out of the training thread's way"). The
training thread's waits (``bench/interference.py``) show the sum on a given machine and
load; this counts the causes, per thread, and does not depend on the load: a uprobe on
CPython's ``take_gil`` (every take, whether it had to wait or not) and, for the time the
lock is held, on its return and on ``drop_gil``. No training thread runs: snapshots (or the
plain thread's same bytes' work) follow one another as fast as they go.

Linux only, with ``perf`` and the rights to add uprobes (root, or a lowered
``kernel.perf_event_paranoid``) and a CPython whose ``take_gil`` is a symbol (3.9-3.12).
The held times are inflated on a loaded machine (a thread preempted while it holds the lock
counts as holding it); the takes are not.

    python bench/gil_takes.py                        # lazyckpt, 1 GiB snapshots, 3 of them
    python bench/gil_takes.py --mib 256 --snapshots 8
    python bench/gil_takes.py --method plain         # the plain thread (bench/interference.py)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import GiB, MiB, make_model_like_state, scratch_dir

ROLES = (
    ("lazyckpt-engine", "engine loop"),
    ("lazyckpt-capture", "capture pool"),
    ("lazyckpt-checksum", "checksum pool"),
    ("lazyckpt-host", "host tier"),
    ("lazyckpt-", "file tier"),
    ("uvloop", "default executor"),
    ("asyncio", "default executor"),
    ("plain-", "plain thread"),
    ("MainThread", "main thread"),
)
PROBES = ("take_gil", "take_gil%return", "drop_gil")


def _role(name: str) -> str:
    return next((role for prefix, role in ROLES if name.startswith(prefix)), "other threads")


def _libpython() -> str:
    """The file holding CPython's ``take_gil``: libpython where it is shared, else the
    interpreter itself."""
    lib = sysconfig.get_config_var("LDLIBRARY") or ""
    path = Path(sysconfig.get_config_var("LIBDIR") or "") / lib
    return str(path) if ".so" in lib and path.exists() else sys.executable


def run_child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Stream the snapshots; return the measured window and each thread's role."""
    import torch

    torch.set_num_threads(1)
    state = make_model_like_state(cfg["mib"] * MiB)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with scratch_dir(cfg["tmp"], "gil-takes-") as root:
        if cfg["method"] == "plain":
            from interference import _Plain

            plain = _Plain(state, root, 16 * MiB)

            def one() -> None:
                plain.start()
                while not plain.done():
                    time.sleep(0.02)

            close: Any = plain.close
        else:
            from lazyckpt import SyncCheckpointer
            from tiers import FileTier, HostMemoryTier

            ckpt = SyncCheckpointer(
                [HostMemoryTier(2 * nbytes + 64 * MiB), FileTier(root / "lazy", keep_last=2)],
                deadline=None,
                shard_size=cfg["shard_mib"] * MiB,
            ).open()
            ckpt.guard(torch.optim.SGD([torch.nn.Parameter(t) for t in state.values()], lr=0.1))
            step = [0]

            def one() -> None:
                step[0] += 1
                handle = ckpt.snapshot({"model": state}, step=step[0])
                while not handle.done():
                    time.sleep(0.02)

            close = ckpt.close
        one()  # starts the pools and threads: not measured
        t0 = time.clock_gettime(time.CLOCK_MONOTONIC)
        for _ in range(cfg["snapshots"]):
            one()
        t1 = time.clock_gettime(time.CLOCK_MONOTONIC)
        roles = {t.native_id: _role(t.name) for t in threading.enumerate()}
        close()
    return {"t0": t0, "t1": t1, "gib": cfg["snapshots"] * nbytes / GiB, "roles": roles}


def _tally(window: dict[str, Any], script: str) -> dict[str, dict[str, float]]:
    roles = {int(k): v for k, v in window["roles"].items()}
    takes: collections.Counter[str] = collections.Counter()
    held: collections.defaultdict[str, float] = collections.defaultdict(float)
    since: dict[int, float] = {}
    for line in script.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        tid, t, event = int(parts[0]), float(parts[1].rstrip(":")), parts[2]
        if not window["t0"] <= t <= window["t1"]:
            continue
        role = roles.get(tid, "other threads")
        if "take_gil__return" in event:
            since[tid] = t
        elif "take_gil" in event:
            takes[role] += 1
        elif "drop_gil" in event and tid in since:
            held[role] += t - since.pop(tid)
    gib = window["gib"]
    return {
        role: {"takes_per_gib": takes[role] / gib, "held_ms_per_gib": held[role] * 1e3 / gib}
        for role in sorted(set(takes) | set(held))
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("lazyckpt", "plain"), default="lazyckpt")
    parser.add_argument("--mib", type=int, default=1024, help="snapshot size")
    parser.add_argument("--shard-mib", type=int, default=16, help="lazyckpt's shard_size")
    parser.add_argument("--snapshots", type=int, default=3, help="measured snapshots")
    parser.add_argument("--tmp", default=None, help="scratch parent (default: runs/)")
    parser.add_argument("--out", default=None, help="write the result JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    if shutil.which("perf") is None:
        raise SystemExit("needs perf (linux-tools) and the rights to add uprobes")
    lib = _libpython()
    for probe in PROBES:  # already there from an earlier run: perf says so, harmlessly
        subprocess.run(["perf", "probe", "-q", "-x", lib, "--add", probe], capture_output=True, check=False)
    cfg = {k: getattr(args, k) for k in ("method", "mib", "shard_mib", "snapshots", "tmp")}
    group = Path(lib).name.split(".")[0].replace("-", "_")
    events = [f"probe_{group}:{p.replace('%', '__')}" for p in PROBES]
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        record = ["perf", "record", "-q", "-k", "CLOCK_MONOTONIC", "-o", data]
        for event in events:
            record += ["-e", event]
        child = [sys.executable, __file__, "--child", json.dumps(cfg)]
        done = subprocess.run([*record, "--", *child], capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not lines:
            raise SystemExit(f"the measured run failed (are the uprobes allowed?)\n{done.stderr[-2000:]}")
        script = subprocess.run(
            ["perf", "script", "-i", data, "-F", "tid,time,event"],
            capture_output=True, text=True, check=True,
        ).stdout
    per_role = _tally(json.loads(lines[-1]), script)
    others = {r: v for r, v in per_role.items() if r != "main thread"}
    print(f"{args.method}, {args.mib} MiB snapshots, per GiB streamed:")
    for role, v in per_role.items():
        print(f"  {role:18} {v['takes_per_gib']:8.0f} takes  {v['held_ms_per_gib']:8.1f} ms held")
    print(
        f"  {'all but main':18} {sum(v['takes_per_gib'] for v in others.values()):8.0f} takes  "
        f"{sum(v['held_ms_per_gib'] for v in others.values()):8.1f} ms held  (load {os.getloadavg()[0]:.1f})"
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"args": cfg, "per_gib": per_role}, indent=1))


if __name__ == "__main__":
    main()
