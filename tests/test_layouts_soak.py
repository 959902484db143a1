"""Kill a 4-rank job laid out on a 2-D mesh (HSDP 2x2 through ``fully_shard``, plus an
expert weight sharded over a sub-mesh) while it snapshots every step, again and again: the
whole job at once, either every rank SIGKILLed from outside at a random moment or every rank
given the same crash point (``LAZYCKPT_CRASH_AT``; the first rank to die there takes the
job down, as a launcher would). After each kill a fresh set of 4 ranks on the same layout
lists the steps and restores every listed one, model, experts and optimizer state bit for
bit against an uninterrupted run's; the newest listed step never goes backwards. The next
trial resumes from it.

``make test`` runs 2 trials (a crash point, then a random kill); ``make soak`` sets
LAZYCKPT_SOAK_KILLS=200 (25 trials).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lazyckpt.hooks import POINTS

sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import free_port, launch_ranks, rank_results

WORKER = Path(__file__).parent / "helpers" / "layouts_soak_worker.py"
KILLS = int(os.environ.get("LAZYCKPT_SOAK_KILLS", "20"))
TRIALS = max(2, KILLS // 8)
STEPS = 8  # steps a trial trains past the newest listed one, if nothing kills it first
WINDOW = 1.2  # seconds after every rank started training in which a random kill lands
GRACE = 0.1  # seconds the other ranks run on after the first one died at its crash point
WORLD = 4
TRIAL_TIMEOUT = 120.0
# the points a FileTier chain reaches while it snapshots and retires old steps; those where
# a step is committed or deleted first, so that a short run reaches them
FIRST = ["file.commit.before_rename", "tier.put.done", "file.commit.after_rename",
         "retention.before_delete", "file.commit.before_manifest", "file.delete.retired"]
CRASH_POINTS = FIRST + [
    p for p in POINTS if p not in FIRST and not p.startswith(("zarr.", "emergency."))
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """Every step's full tensors from one uninterrupted 4-rank run, no checkpointing."""
    out = tmp_path_factory.mktemp("reference")
    launch_ranks(WORKER, ["reference", str(out / "unused"), str(out), str(TRIALS * STEPS)],
                 WORLD, timeout=TRIAL_TIMEOUT)
    states: dict[int, dict[str, torch.Tensor]] = torch.load(out / "reference.pt")
    assert sorted(states) == list(range(1, TRIALS * STEPS + 1))
    return states


def _report(procs: list[subprocess.Popen[bytes]], logs: list[Any], what: str) -> str:
    parts = [what]
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        parts.append(f"-- rank {rank} (exit {proc.returncode}):\n{log.read().decode()[-3000:]}")
    return "\n".join(parts)


def kill_job(root: Path, out: Path, env: dict[str, str], kill: random.Random | None,
             window: float) -> str:
    """Start 4 training ranks; kill the whole job: with ``kill`` at a random moment up to
    ``window`` seconds after every rank started training, else when the first rank dies at
    its crash point (and the others had GRACE seconds to reach it too). Return how it
    ended: "finished" if nothing killed it (the point never reached, the random moment
    after the end). Every rank has ended when it returns."""
    port = str(free_port())
    with contextlib.ExitStack() as stack:
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for rank in range(WORLD):
                log = stack.enter_context(tempfile.TemporaryFile())
                logs.append(log)
                rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(WORLD),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), "train", str(root), str(out), str(STEPS)],
                    env=rank_env, stdout=log, stderr=subprocess.STDOUT))
            end = time.monotonic() + TRIAL_TIMEOUT
            kill_at = None
            while time.monotonic() < end:
                codes = [p.poll() for p in procs]
                if None not in codes:
                    break
                if kill_at is None and any(c is not None and c != 0 for c in codes):
                    # one rank died: the others, given the same point, may reach it too
                    # before the launcher notices and takes the whole job down
                    kill_at = time.monotonic() + GRACE
                if kill is not None and kill_at is None and all(
                    (out / f"started{r}").exists() for r in range(WORLD)
                ):
                    kill_at = time.monotonic() + kill.uniform(0.0, window)
                if kill_at is not None and time.monotonic() >= kill_at:
                    break
                time.sleep(0.02)
            else:
                raise AssertionError(
                    _report(procs, logs, f"the job still ran after {TRIAL_TIMEOUT}s")
                )
            died = sum(p.poll() == -signal.SIGKILL for p in procs)
        finally:
            for proc in procs:  # every rank still running: this job's own, by PID
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
            for proc in procs:
                proc.wait()
        codes = [p.returncode for p in procs]
        if any(c not in (0, -signal.SIGKILL) for c in codes):
            raise AssertionError(_report(procs, logs, f"a rank failed: exit codes {codes}"))
        if all(c == 0 for c in codes):
            return "finished"
        return "killed" if kill is not None else f"{died} ranks died at the point"


def check(root: Path, out: Path, reference: dict[int, dict[str, torch.Tensor]]) -> list[int]:
    """In a fresh set of 4 ranks on the same layout: every listed step restores bit for bit."""
    out.mkdir()
    launch_ranks(WORKER, ["check", str(root), str(out), "0"], WORLD, timeout=TRIAL_TIMEOUT)
    found = rank_results(out)
    assert sorted(found) == list(range(WORLD))
    listed = found[0]["listed"]
    assert all(r["listed"] == listed for r in found.values()), found
    restored: dict[int, dict[str, torch.Tensor]] = torch.load(out / "restored.pt")
    assert sorted(restored) == listed
    for step in listed:
        expected = reference[step]
        got = restored[step]
        assert got.keys() == expected.keys(), (step, sorted(got.keys() ^ expected.keys()))
        for key, value in got.items():
            assert value.dtype == expected[key].dtype and torch.equal(value, expected[key]), (
                f"step {step}: {key} differs from the uninterrupted run's"
            )
    return listed


@pytest.mark.timeout(120 + 60 * TRIALS)  # a trial takes 20 to 40 s, more on a busy machine
def test_killing_a_2d_mesh_job_leaves_every_listed_step_restorable(
    reference: dict[int, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    rng = random.Random(2828)
    root = tmp_path / "ckpt"
    newest = 0
    kills = 0
    checked = 0
    log = []
    for trial in range(TRIALS):
        out = tmp_path / f"trial{trial}"
        out.mkdir()
        env = dict(os.environ)
        env.pop("LAZYCKPT_CRASH_AT", None)
        killer = None
        if trial % 3 == 1:
            label, killer = "random", rng
        else:
            label = CRASH_POINTS[(trial - (trial + 1) // 3) % len(CRASH_POINTS)]
            env["LAZYCKPT_CRASH_AT"] = f"{label}:{rng.randint(1, STEPS - 1)}"
        t0 = time.monotonic()
        how = kill_job(root, out, env, killer, WINDOW)
        trained = time.monotonic() - t0
        listed = check(root, tmp_path / f"check{trial}", reference)
        found = listed[-1] if listed else 0
        assert found >= newest, f"trial {trial} ({label}): newest step {found} < {newest} before"
        if how == "finished":
            assert found == newest + STEPS, (trial, label, newest, listed)
        else:
            kills += 1
        checked += len(listed)
        log.append(f"{trial}: {env.get('LAZYCKPT_CRASH_AT', label)} {how}, steps {newest} -> "
                   f"{listed} ({trained:.1f} s + check {time.monotonic() - t0 - trained:.1f} s)")
        newest = found
    print("\n".join(log))
    assert kills >= TRIALS // 2, log
    assert checked > 0 and newest > 0, log
