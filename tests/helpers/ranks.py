"""Launching a worker script as several real ranks on 127.0.0.1 (gloo), for the tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(
    worker: Path, args: list[str], world: int, *, timeout: float = 150, may_be_killed: bool = False
) -> list[int]:
    """Run ``worker args`` as ranks 0..world-1; return their exit codes. Every process ends:
    whatever is still running ``timeout`` seconds after the start is killed. A rank that
    failed (or was killed, unless ``may_be_killed``) fails the test with its output.

    Each rank's output goes to a file, not a pipe: a rank that writes more than a pipe holds
    cannot block while another rank is being waited for, and nothing is left open whatever
    happens."""
    port = str(free_port())
    allowed = (0, -signal.SIGKILL) if may_be_killed else (0,)
    with contextlib.ExitStack() as stack:
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for rank in range(world):
                env = dict(
                    os.environ,
                    RANK=str(rank),
                    WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                    GLOO_SOCKET_IFNAME="lo",
                    OMP_NUM_THREADS="1",
                )
                log = stack.enter_context(tempfile.TemporaryFile())
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(worker), *args],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                codes = [p.poll() for p in procs]
                if None not in codes or any(c not in (None, *allowed) for c in codes):
                    break  # all done, or one failed: the others would only wait for it
                time.sleep(0.05)
            stopped = [r for r, p in enumerate(procs) if p.poll() is None]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        codes = [proc.wait() for proc in procs]  # every one has ended
        failed = [r for r, code in enumerate(codes) if r not in stopped and code not in allowed]
        if failed or stopped:
            report = []
            for r in sorted(failed + stopped):
                logs[r].seek(0)
                if r in failed:
                    what = f"exit {codes[r]}"
                elif failed:
                    what = "stopped: another rank failed"
                else:
                    what = f"still running after {timeout}s"
                report.append(f"-- rank {r} ({what}):\n{logs[r].read().decode()[-3000:]}")
            raise AssertionError("\n".join(report))
        return codes


def rank_results(out: Path) -> dict[int, dict[str, Any]]:
    """The JSON each rank wrote to ``out/rank<N>.json``, by rank."""
    found = {}
    for path in out.glob("rank*.json"):
        data = json.loads(path.read_text())
        found[data["rank"]] = data
    return found


async def commit_each(ckpt: Any, states: Any) -> list[dict[str, Any]]:
    """Rank-side: snapshot each ``(step, state)`` and wait for its commit; return, for every
    step that failed, its step, error types and messages, and how long the failure took."""
    import time

    import lazyckpt

    errors: list[dict[str, Any]] = []
    for step, state in states:
        handle = await ckpt.snapshot(state, step=step)
        t0 = time.monotonic()
        try:
            await handle.committed()
        except lazyckpt.SnapshotFailedError as exc:
            errors.append(
                {
                    "step": step,
                    "types": sorted({type(e).__name__ for e in exc.exceptions}),
                    "messages": [str(e) for e in exc.exceptions],
                    "seconds": time.monotonic() - t0,
                }
            )
    return errors


def end_rank() -> NoReturn:
    """Rank-side, last: destroy the process groups and leave the process at once, without
    the interpreter's finalization (whatever the rank had to say is written by now).

    A rank that built a DeviceMesh cannot end cleanly otherwise: torch's DTensor caches (the
    redistribution planner, keyed by mesh) keep the mesh, and through it the gloo group
    and that group's worker threads, alive past ``destroy_process_group()``. A gloo thread
    that finishes a collective's work object just as the interpreter finalizes drops the
    last reference to an output tensor there, takes the interpreter lock and aborts the
    process ("terminate called without an active exception", SIGABRT, the core's stack in
    ``AsyncAllgatherCoalescedWork``'s destructor): in 2 of 4 runs of the DTensor and Zarr
    multi-rank test files on a loaded machine. Nothing of lazyckpt's runs then: every Checkpointer is closed."""
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
