"""Launching a worker script as several real ranks on 127.0.0.1 (gloo), for the tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(
    worker: Path, args: list[str], world: int, *, timeout: float = 150, may_be_killed: bool = False
) -> list[int]:
    """Run ``worker args`` as ranks 0..world-1; return their exit codes. Every process ends:
    whatever is still running at the timeout is killed. A rank that failed (or was killed,
    unless ``may_be_killed``) fails the test with its stderr."""
    port = str(free_port())
    procs = []
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
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    codes = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            allowed = (0, -signal.SIGKILL) if may_be_killed else (0,)
            if proc.returncode not in allowed:
                raise AssertionError(err.decode()[-3000:])
            codes.append(proc.returncode)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def rank_results(out: Path) -> dict[int, dict[str, Any]]:
    """The JSON each rank wrote to ``out/rank<N>.json``, by rank."""
    found = {}
    for path in out.glob("rank*.json"):
        data = json.loads(path.read_text())
        found[data["rank"]] = data
    return found
