"""Kill a snapshotting process at random moments and at every named point of the pipeline;
a fresh process must then find the latest committed step intact, bit for bit. Start a second
writer on a location while the first still writes (a job restarted while its old incarnation
runs), and a writer of the other kind on it: neither may harm what is committed there. On S3
(a real server, SeaweedFS on loopback) kill the writer, and once the server itself.

``make test`` runs a short version; ``make soak`` sets LAZYCKPT_SOAK_KILLS=200.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import lazyckpt
import lazyckpt.testing
from lazyckpt.hooks import POINTS

sys.path.insert(0, str(Path(__file__).parent))
from helpers.crash_child import durable_tier, incremental_state_of, state_of
from helpers.seaweed import SeaweedHandle, SeaweedLocation, seaweed_handle, step_group

__all__ = ["seaweed_handle"]  # the fixture, imported for pytest

KILLS = int(os.environ.get("LAZYCKPT_SOAK_KILLS", "20"))
CHILD = Path(__file__).parent / "helpers" / "crash_child.py"
TIERS = ["file"] + (["zarr"] if "zarr" in lazyckpt.available_tiers() else [])


def equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(equal, a, b))
    return a == b


async def check(root: Path, kind: str) -> int | None:
    """Open the durable tier as a new process would; the latest step must be intact."""
    async with lazyckpt.Checkpointer([durable_tier(root, kind)]) as ckpt:
        steps = await ckpt.steps()
        if not steps:
            return None
        restored = await ckpt.restore()
        assert equal(restored, state_of(steps[-1])), f"step {steps[-1]} differs"
    return steps[-1]


def run_child(
    root: Path | str,
    kind: str,
    first: int,
    env: dict[str, str],
    kill_after: float | None,
    wait: str = "captured",
) -> int:
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), str(root), kind, str(first), str(first + 6), wait],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"child failed ({proc.returncode}): {err.decode()[-2000:]}")
    return proc.returncode


def anywhere_trials(points: list[str]) -> int:
    """Trials of :func:`test_kill_anywhere_keeps_the_last_commit`: in ``make test`` the
    fewest in which every point is chosen once (every 4th trial is a random moment instead),
    in ``make soak`` LAZYCKPT_SOAK_KILLS, if more."""
    cover = next(n for n in itertools.count() if n - (n + 1) // 4 >= len(points))
    return max(cover, int(os.environ.get("LAZYCKPT_SOAK_KILLS", "0")))


@pytest.mark.parametrize("kind", TIERS)
async def test_kill_anywhere_keeps_the_last_commit(kind: str, tmp_path: Path) -> None:
    rng = random.Random(1234)
    other = "zarr." if kind == "file" else "file."  # the other tier's own points
    points = [p for p in POINTS if not p.startswith(other)]
    trials = anywhere_trials(points)
    survived: Counter[str] = Counter()
    latest: int | None = None
    for trial in range(trials):
        env = dict(os.environ)
        kill_after = None
        if trial % 4 == 3:  # a random moment, from outside
            label = "random"
            kill_after = rng.uniform(0.5, 3.0)
            env.pop("LAZYCKPT_CRASH_AT", None)
        else:
            # the next point in turn, counting point trials only: with trial % len(points),
            # a list of 8 points (the Zarr tier's) never got the 4th and the 8th
            label = points[(trial - trial // 4) % len(points)]
            env["LAZYCKPT_CRASH_AT"] = f"{label}:{rng.randint(1, 12)}"
        first = (latest or 0) + 1 if latest is not None else 0
        code = run_child(tmp_path, kind, first, env, kill_after)
        found = await check(tmp_path, kind)
        if latest is not None:
            assert found is not None and found >= latest, "a committed step was lost"
        latest = found
        survived[label if code else f"{label} (not reached)"] += 1
    assert sum(n for k, n in survived.items() if "not reached" not in k) >= trials // 2
    assert {k.removesuffix(" (not reached)") for k in survived} == {*points, "random"}
    # leftovers of the last crash are cleaned when a tier opens, never listed
    if kind == "file":
        async with lazyckpt.Checkpointer([durable_tier(tmp_path, kind)]) as ckpt:
            listed = await ckpt.steps()
        on_disk = sorted(p.name for p in (tmp_path / "file").glob("step-*"))
        assert on_disk == [f"step-{s:012d}" for s in listed]
    print(f"{kind}: kills survived by point: {dict(survived)}")


async def check_cadenced(root: Path) -> tuple[int | None, int | None]:
    """The newest step on the node-local tier (restored bit for bit) and on the parallel
    file system's (every listed step restored bit for bit), opened as a new job would."""
    async with lazyckpt.Checkpointer([durable_tier(root, "file")]) as ckpt:
        steps = await ckpt.steps()
        if steps:
            assert equal(await ckpt.restore(), state_of(steps[-1])), f"local step {steps[-1]} differs"
        local = steps[-1] if steps else None
    async with lazyckpt.Checkpointer([durable_tier(root, "zarr")]) as ckpt:
        steps = await ckpt.steps()
        for step in steps:
            assert equal(await ckpt.restore(step), state_of(step)), f"pfs step {step} differs"
        pfs = steps[-1] if steps else None
    return local, pfs


@pytest.mark.skipif("zarr" not in TIERS, reason="the parallel file system's stand-in is a ZarrTier")
async def test_kill_anywhere_with_mixed_cadences_keeps_every_commit(tmp_path: Path) -> None:
    # host and node-local every step, the PFS every 3rd; a run's close writes its last
    # step to the PFS as an emergency copy, and a third of the kills land inside one
    rng = random.Random(4321)
    points = [p for p in POINTS if p != "emergency.shard.read"]
    survived: Counter[str] = Counter()
    latest: tuple[int | None, int | None] = (None, None)
    for trial in range(max(5, KILLS // 4)):
        env = dict(os.environ, LAZYCKPT_CHILD_CADENCE="1")
        kill_after = None
        if trial % 3 == 0:
            label = "emergency.shard.read"
            env["LAZYCKPT_CRASH_AT"] = f"{label}:{rng.randint(1, 6)}"
        elif trial % 4 == 3:
            label = "random"
            kill_after = rng.uniform(0.5, 3.0)
            env.pop("LAZYCKPT_CRASH_AT", None)
        else:
            label = points[trial % len(points)]
            env["LAZYCKPT_CRASH_AT"] = f"{label}:{rng.randint(1, 12)}"
        newest = [s for s in latest if s is not None]
        first = max(newest) + 1 if newest else 0
        code = run_child(tmp_path, "file", first, env, kill_after)
        found = await check_cadenced(tmp_path)
        for before, after, tier in zip(latest, found, ("local", "pfs"), strict=True):
            if before is not None:
                assert after is not None and after >= before, f"a step committed on {tier} was lost"
        if code == 0 and found[0] is not None and found[0] % 3:
            assert found[1] == found[0], "the finished run's last step has no emergency copy"
        latest = found
        survived[label if code else f"{label} (not reached)"] += 1
    assert survived["emergency.shard.read"] >= 1, survived
    print(f"mixed cadences: kills survived by point: {dict(survived)}")


# the points where an incremental snapshot's references are at stake: its commit, the
# retention that retires referenced steps and collects them, and a kill from outside
def incremental_points(kind: str) -> list[str]:
    """The points of the tier, the engine's tier calls and retention: those where references
    are at stake (retiring, collecting, deleting) first, so a short run reaches them."""
    first = ["file.delete.retired", "file.collect.before_remove", "zarr.delete_dir.before_remove",
             "retention.before_delete", "file.delete.after_unlink"]
    mine = [p for p in POINTS if p.startswith((f"{kind}.", "tier.", "retention."))]
    return [p for p in first if p in mine] + [p for p in mine if p not in first]


async def check_references(root: Path, kind: str) -> list[int]:
    """Open the tier as a restarted writer would (sweeping what a crash left): every
    listed step restores bit for bit, and every step directory left on disk is listed or
    holds data a listed step refers to."""
    tier = durable_tier(root, kind)
    async with lazyckpt.Checkpointer([tier]) as ckpt:
        steps = await ckpt.steps()
        referred: set[int] = set()
        for step in steps:
            referred |= (await tier.read_manifest(step)).references()
            assert equal(await ckpt.restore(step=step), incremental_state_of(step)), (
                f"step {step} differs"
            )
    assert referred <= set(range(max(steps, default=0)))  # references go back in time
    on_disk = {int(p.name[5:]) for p in (root / kind).glob("step-*")}
    assert on_disk <= set(steps) | referred, f"unreferenced data left: {on_disk - set(steps) - referred}"
    return steps


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "mode"), [("file", "1"), ("file", "versions"), *([("zarr", "1")] if "zarr" in TIERS else [])]
)
async def test_kill_anywhere_keeps_incremental_steps_whole(
    kind: str, mode: str, tmp_path: Path
) -> None:
    """Incremental snapshots under kills: a committed step never refers to data that was
    deleted or half written, whatever the point of the kill (commit, retention's retiring
    and collecting, or a random moment), and nothing unreferenced survives a restart."""
    rng = random.Random(77)
    latest: int | None = None
    reached = 0
    killed_at: Counter[str] = Counter()
    for trial in range(max(6, KILLS // 4)):
        env = dict(os.environ, LAZYCKPT_CHILD_INCREMENTAL=mode)
        kill_after = None
        point = "random"
        if trial % 4 == 3:
            kill_after = rng.uniform(0.5, 3.0)
            env.pop("LAZYCKPT_CRASH_AT", None)
        else:
            points = incremental_points(kind)
            point = points[trial % len(points)]
            # a step is retired or collected about once per run of the child: at its first
            nth = 1 if point.endswith(("retired", "before_remove")) else rng.randint(1, 3)
            env["LAZYCKPT_CRASH_AT"] = f"{point}:{nth}"
        first = latest + 1 if latest is not None else 0
        code = run_child(tmp_path, kind, first, env, kill_after, wait="committed")
        reached += code != 0
        if code:
            killed_at[point] += 1
        steps = await check_references(tmp_path, kind)
        if latest is not None:
            assert steps and steps[-1] >= latest, "a committed step was lost"
        latest = steps[-1] if steps else latest
    assert reached >= 2  # most trials really were killed
    # the kills that matter most here landed: while a step was retired or its data removed
    assert killed_at["file.delete.retired"] + killed_at["zarr.delete_dir.before_remove"] >= 1
    if kind == "file":
        assert killed_at["file.collect.before_remove"] >= 1, killed_at
    print(f"{kind}/{mode}: kills by point: {dict(killed_at)}")


def test_sigkill_mid_flush_keeps_previous_step(tmp_path: Path) -> None:
    """The plainest case: the writer dies while a shard is on its way to disk."""
    shards = len(lazyckpt.testing.build_snapshot(0, state_of(0), shard_size=1 << 16, pack_bytes=4096)[0].shards)
    # Each step is committed before the next starts; die during the third shard of step 2.
    env = dict(os.environ, LAZYCKPT_CRASH_AT=f"file.write.before_sync:{2 * shards + 3}")
    code = run_child(tmp_path, "file", 0, env, None, wait="committed")
    assert code == -signal.SIGKILL
    assert (tmp_path / "file" / "step-000000000002").exists()  # the torn step, left behind
    assert asyncio.run(check(tmp_path, "file")) == 1
    assert not (tmp_path / "file" / "step-000000000002").exists()  # cleaned on open


def start_child(root: Path, kind: str, first: int, *, hold: bool) -> subprocess.Popen[bytes]:
    """A writer of six steps; with ``hold`` it pauses between steps and, done, stays open
    until a line arrives on its stdin."""
    env = dict(os.environ, LAZYCKPT_CHILD_PAUSE="0.2" if hold else "0")
    env.pop("LAZYCKPT_CRASH_AT", None)
    if hold:
        env["LAZYCKPT_CHILD_HOLD"] = "1"
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(root), kind, str(first), str(first + 6), "committed"],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, err.decode(errors="replace")


def tree(root: Path) -> list[tuple[str, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()
    )


async def check_every_step(root: Path, kind: str) -> list[int]:
    """Every listed step (not just the latest) restores bit for bit, read-only."""
    async with lazyckpt.Checkpointer([durable_tier(root, kind, readonly=True)]) as ckpt:
        steps = await ckpt.steps()
        for step in steps:
            assert equal(await ckpt.restore(step=step), state_of(step)), f"step {step} differs"
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("kind", TIERS)
async def test_two_writers_and_a_foreign_one_harm_nothing(kind: str, tmp_path: Path) -> None:
    rng = random.Random(99)
    other = "zarr" if kind == "file" else "file"
    location = tmp_path / kind
    refused = 0
    first = 0
    for trial in range(max(2, KILLS // 10)):
        old = start_child(tmp_path, kind, first, hold=True)
        assert old.stdout is not None and old.stdout.readline() == b"opened\n"
        killed = trial % 2 == 1  # every other time the old writer dies at a random moment
        if killed:
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            old.send_signal(signal.SIGKILL)
            old.wait()
        new = start_child(tmp_path, kind, first + 100, hold=False)
        new_code, new_err = finish(new)
        if not killed:
            assert old.stdin is not None
            old.stdin.write(b"go\n")
            old.stdin.flush()
        old_code, old_err = finish(old)
        if killed:  # the kernel dropped the dead writer's lock: the new one just works
            assert new_code == 0, new_err[-2000:]
        else:  # both alive at once: the second is refused at open, the first unharmed
            assert new_code != 0 and "LocationInUseError" in new_err, new_err[-2000:]
            assert old_code == 0, old_err[-2000:]
            refused += 1
        steps = await check_every_step(tmp_path, kind)
        assert steps, "nothing committed"
        first = steps[-1] + 101

        # a writer of the other kind on this location is refused and changes nothing
        if other in TIERS:
            before = tree(location)
            with pytest.raises(lazyckpt.ForeignLocationError):
                async with lazyckpt.Checkpointer(
                    [lazyckpt.load_tier(other, str(location))], staging_bytes=1 << 20
                ):
                    pass
            assert tree(location) == before
    assert refused >= 1


# -- on S3: a real server (SeaweedFS on loopback) ------------------------------------------

# a handful of writer kills in `make test`, 40 under `make soak`; then one server kill
S3_KILLS = max(3, KILLS // 5)
# the children's lease: a killed writer's lease must run out before the next writer opens
# (as a restarted job waits), so a short one keeps each round short. A writer that stalls
# past it loses nothing while nobody else opens the location: it renews the same lease.
S3_LEASE = 2.0
# the engine's own points (the tiers' are the file system's), those where the index and the
# objects on S3 are at stake first, so that the short run reaches them
_S3_FIRST = ["tier.commit.after", "retention.before_delete", "tier.put.done", "tier.commit.before"]
S3_POINTS = [p for p in _S3_FIRST if p in POINTS] + [
    p for p in POINTS if not p.startswith(("file.", "zarr.")) and p not in _S3_FIRST
]


def s3_env(loc: SeaweedLocation, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server, the credentials and the children's lease, the way a job is configured:
    in the environment, which the children inherit and this process's tiers read."""
    options = loc.server.tier_options()
    for name, value in {
        "AWS_ENDPOINT_URL": options["endpoint_url"],
        "AWS_REGION": options["region"],
        "AWS_ACCESS_KEY_ID": options["access_key_id"],
        "AWS_SECRET_ACCESS_KEY": options["secret_access_key"],
        "AWS_ALLOW_HTTP": "true",
        "LAZYCKPT_CHILD_LEASE": str(S3_LEASE),
    }.items():
        monkeypatch.setenv(name, value)


def wait_for_s3_lease(loc: SeaweedLocation) -> float:
    """Wait until the lease a killed writer left under ``loc`` (its ZarrTier at
    ``<prefix>/zarr``) has run out; the seconds waited (0 when none is left)."""
    client = loc.server.client()
    key = f"{loc.prefix}/zarr/.lazyckpt-writer-rank-00000.json"
    try:
        body = client.get_object(Bucket=loc.server.bucket, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return 0.0
    wait = max(0.0, float(json.loads(body)["expires"]) - time.time() + 0.1)
    assert wait <= S3_LEASE + 1, f"a lease of {wait:.1f} s left, the children take {S3_LEASE}"
    time.sleep(wait)
    return wait


async def check_s3(loc: SeaweedLocation) -> list[int]:
    """Open the location as a restarted job would (a writer, which sweeps what a kill
    left): every listed step restores bit for bit, and no step group holds objects but
    those of listed steps."""
    wait_for_s3_lease(loc)
    where = SeaweedLocation(loc.server, f"{loc.prefix}/zarr")
    async with lazyckpt.Checkpointer([durable_tier(loc.url, "zarr")]) as ckpt:
        steps = await ckpt.steps()
        for step in steps:
            assert equal(await ckpt.restore(step=step), state_of(step)), f"step {step} differs"
    index = where.index()
    listed = {step_group(index, s) for s in steps}
    # groups from a flat listing: SeaweedFS lists an emptied prefix for a while
    listing = where.keys()
    names = [key.split("/")[2] for key in listing]  # soak/zarr/<name>/...
    stored = {name for name in names if name.startswith("step-")}
    assert stored <= listed, f"unlisted step groups left: {sorted(stored - listed)}"
    return steps


def run_child_through_a_server_crash(
    loc: SeaweedLocation, handle: SeaweedHandle, first: int, rng: random.Random
) -> tuple[int, str]:
    """A writer of 20 steps, each committed before the next; the server is SIGKILLed at a
    random moment while it writes and started again on its data. The writer rides it out
    (its retries outlast the restart) or fails a snapshot; it must not be left hanging."""
    env = dict(os.environ)
    env.pop("LAZYCKPT_CRASH_AT", None)
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), loc.url, "zarr", str(first), str(first + 20), "committed"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"opened\n"
        time.sleep(rng.uniform(0.1, 1.0))  # into the writes
        handle.restart(crash=True)
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err.decode(errors="replace")


@pytest.mark.s3
@pytest.mark.skipif("zarr" not in TIERS, reason="ZarrTier is not installed")
@pytest.mark.timeout(120 + 30 * S3_KILLS)  # a round takes 5 to 10 s, more on a busy machine
async def test_kill_anywhere_on_s3_keeps_every_commit(
    seaweed_handle: SeaweedHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer writing HostMemoryTier and ZarrTier on S3, SIGKILLed at every named point
    of the engine and at random moments, then the S3 server itself SIGKILLed mid-write and
    restarted: after each, every listed step restores bit for bit and none is lost."""
    loc = SeaweedLocation(seaweed_handle.info, "soak")  # a server of this test's own
    s3_env(loc, monkeypatch)
    rng = random.Random(4242)
    survived: Counter[str] = Counter()
    latest: int | None = None
    for trial in range(S3_KILLS + 1):
        first = latest + 1 if latest is not None else 0
        if trial == S3_KILLS:  # last: the server, not the writer, dies
            label = "server killed"
            code, err = run_child_through_a_server_crash(loc, seaweed_handle, first, rng)
            # it rode the restart out, or a snapshot failed on it (a lazyckpt error)
            assert code == 0 or "lazyckpt" in err, f"child failed ({code}): {err[-3000:]}"
            label += " (ridden out)" if code == 0 else " (a snapshot failed)"
            code = 1  # counted as reached either way
        else:
            env = dict(os.environ)
            env.pop("LAZYCKPT_CRASH_AT", None)
            kill_after = None
            if trial % 4 == 3:  # a random moment, from outside (the child opens in 2-4 s)
                label = "random"
                kill_after = rng.uniform(2.0, 5.0)
            else:
                label = S3_POINTS[(trial - trial // 4) % len(S3_POINTS)]
                env["LAZYCKPT_CRASH_AT"] = f"{label}:{rng.randint(1, 8)}"
            code = run_child(loc.url, "zarr", first, env, kill_after)
        steps = await check_s3(loc)
        if latest is not None:
            assert steps and steps[-1] >= latest, "a committed step was lost"
        latest = steps[-1] if steps else latest
        survived[label if code else f"{label} (not reached)"] += 1
    writer_kills = sum(n for k, n in survived.items() if "not reached" not in k and "server" not in k)
    assert writer_kills >= S3_KILLS // 2, survived
    assert latest is not None, "nothing was ever committed"
    print(f"s3: kills survived by point: {dict(survived)}")


# -- through the framework integrations' save paths ---------------------------------------

# a few kills per integration in `make test`, many more in `make soak`
INTEGRATION_KILLS = max(3, KILLS // 6)
DCP_CHILD = Path(__file__).parent / "helpers" / "crash_child_dcp.py"
DS_CHILD = Path(__file__).parent / "helpers" / "crash_child_deepspeed.py"
# what a DeepSpeed job on the CPU accelerator loads at start: its shared-memory
# communication op, built by torch's JIT extension loader on first use (where it is: the
# loader's own answer, from a private function, as torch offers no public one)
DS_WARM = """
from deepspeed.comm.torch import build_shm_op
from torch.utils.cpp_extension import _get_build_directory
build_shm_op()
print(_get_build_directory("deepspeed_shm_comm", False))
"""


@pytest.fixture(scope="module")
def deepspeed_ops() -> Path:
    """The build folder of that op, built here once by a process nobody kills.

    torch's loader takes a lock file in an op's build folder every time a process loads the
    op, built or not, and waits for as long as the file is there. A child killed at that
    moment leaves the lock behind, and every later DeepSpeed process on the machine then
    hangs at start. So the children these tests kill never load from this folder: each one
    gets a private copy of it (:func:`deepspeed_env`)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    warm = subprocess.run(
        [sys.executable, "-c", DS_WARM], env=env, capture_output=True, text=True, timeout=900
    )
    assert warm.returncode == 0, warm.stderr[-3000:]
    return Path(warm.stdout.splitlines()[-1])


def deepspeed_env(op: Path, scratch: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for one DeepSpeed child that may be killed: the CPU accelerator, and a fresh
    copy of the built op (its lock file left out) under an extension root of its own
    (where ``TORCH_EXTENSIONS_DIR`` is set, torch builds an op in ``$TORCH_EXTENSIONS_DIR/<op
    name>``; the copy keeps the files' times, so nothing is rebuilt)."""
    root = scratch / f"torch-extensions-{next(_copies)}"
    shutil.copytree(op, root / op.name, ignore=shutil.ignore_patterns("lock"))
    return {**env, "DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(root)}


_copies = itertools.count()


def run_and_read(
    argv: list[str], env: dict[str, str], kill_after: float | None
) -> tuple[int, list[str]]:
    """Run a child (killed after ``kill_after`` seconds, if given) and return its exit code
    and the lines it printed; a child that fails other than by SIGKILL fails the test."""
    proc = subprocess.Popen(
        [sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=170)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"child failed ({proc.returncode}): {err.decode()[-3000:]}")
    return proc.returncode, out.decode().splitlines()


def kill_env(rng: random.Random, trial: int, points: list[str], most: int) -> tuple[str, dict[str, str]]:
    """Every third trial a kill from outside at a random moment (label ``random``, no
    crash point); otherwise the next named point, reached 1 to ``most`` times."""
    env = dict(os.environ)
    env.pop("LAZYCKPT_CRASH_AT", None)
    if trial % 3 == 2:
        return "random", env
    label = points[(trial - trial // 3) % len(points)]  # each point in turn
    env["LAZYCKPT_CRASH_AT"] = f"{label}:{rng.randint(1, most)}"
    return label, env


@pytest.mark.slow
@pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning", "ignore::FutureWarning"
)
def test_kill_during_dcp_async_save_keeps_the_last_commit(tmp_path: Path) -> None:
    """``dcp.async_save`` through LazyStorageWriter, killed anywhere: ``dcp.load`` through
    LazyStorageReader finds the latest committed step bit for bit, never loses a step whose
    ``upload_completion`` resolved, and a step that was not committed cannot be loaded."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    from lazyckpt.integrations.dcp import LazyStorageReader
    from tiers import FileTier

    rng = random.Random(4321)
    points = [p for p in POINTS if not p.startswith("zarr.")]
    survived: Counter[str] = Counter()
    latest: int | None = None
    for trial in range(INTEGRATION_KILLS):
        label, env = kill_env(rng, trial, points, 4)
        kill_after = rng.uniform(0.8, 3.0) if label == "random" else None
        first = 0 if latest is None else latest + 1
        argv = [str(DCP_CHILD), str(tmp_path), str(first), str(first + 6)]
        code, lines = run_and_read(argv, env, kill_after)
        staged = [int(x.split()[1]) for x in lines if x.startswith("staged ")]
        durable = [int(x.split()[1]) for x in lines if x.startswith("durable ")]
        with lazyckpt.SyncCheckpointer([FileTier(tmp_path / "file")]) as ckpt:
            steps = ckpt.steps()
            found = steps[-1] if steps else None
            if latest is not None:
                assert found is not None and found >= latest, "a committed step was lost"
            if durable:  # upload_completion said so: it must be there
                assert found is not None and found >= max(durable), f"step {max(durable)} lost"
            if found is not None:
                template = state_of(0)  # loaded into: tensors overwritten, values replaced
                load(template, checkpoint_id=None, storage_reader=LazyStorageReader(ckpt))
                assert equal(template, state_of(found)), f"step {found} differs"
            for step in set(staged) - set(steps):  # begun, not committed: not loadable
                with pytest.raises(CheckpointException) as failed:  # DCP wraps the reader's
                    load(state_of(0), checkpoint_id=step, storage_reader=LazyStorageReader(ckpt))
                # DCP hands on lazyckpt's SnapshotNotFoundError, or (a failed metadata read)
                # only its message
                error, _ = failed.value.failures[0]
                assert f"step {step} is not committed on any tier" in str(error), error
        latest = found
        survived[label if code else f"{label} (not reached)"] += 1
    assert sum(n for k, n in survived.items() if "not reached" not in k) >= INTEGRATION_KILLS // 2
    print(f"dcp: kills survived by point: {dict(survived)}")


def same_as_torch_load(a: object, b: object) -> bool:
    """Equal as ``torch.load`` results (DeepSpeed's config objects, which have no
    ``__eq__``, by type and repr)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_as_torch_load(a[k], b[k]) for k in a
        )
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_as_torch_load, a, b))
    if type(a).__module__.startswith("deepspeed"):
        return type(a) is type(b) and repr(a) == repr(b)
    return bool(a == b)


def check_deepspeed(root: Path) -> int:
    """DeepSpeed's ``latest`` names a tag every file of which loads through lazyckpt bit
    for bit as the reference saved with DeepSpeed's default engine; its global step."""
    from lazyckpt.integrations.deepspeed import LazyCheckpointEngine
    from tiers import FileTier, HostMemoryTier

    tag = (root / "ds" / "latest").read_text()
    assert tag.startswith("step"), f"latest names {tag!r}"
    names = sorted(p.name for p in (root / "ds" / tag).iterdir())
    assert names == sorted(p.name for p in (root / "ref" / tag).iterdir()), names
    engine = LazyCheckpointEngine([HostMemoryTier(8 << 20), FileTier(root / "tiers")])
    try:
        for name in names:
            path = root / "ds" / tag / name
            assert path.read_bytes()[:1] == b"{", f"{path} is not a lazyckpt pointer"
            got = engine.load(str(path))
            want = torch.load(root / "ref" / tag / name, weights_only=False)
            assert same_as_torch_load(got, want), f"{path} differs from what was saved"
    finally:
        engine.cleanup()
    return int(tag.removeprefix("step"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # DeepSpeed compiles its CPU op at first use: minutes on a busy box
def test_kill_under_deepspeed_latest_names_a_durable_tag(
    tmp_path: Path, deepspeed_ops: Path
) -> None:
    """A DeepSpeed job checkpointing every step through LazyCheckpointEngine (both ``wait``
    modes), killed anywhere and restarted from ``latest``: ``latest`` always names a tag
    that loads bit for bit, and never moves back."""
    env = dict(os.environ)
    env.pop("LAZYCKPT_CRASH_AT", None)
    root = tmp_path / "job"
    root.mkdir()
    env = deepspeed_env(deepspeed_ops, tmp_path, env)
    code, _ = run_and_read([str(DS_CHILD), str(root), "2", "durable"], env, None)
    assert code == 0
    latest = check_deepspeed(root)
    rng = random.Random(77)
    points = [p for p in POINTS if not p.startswith("zarr.")]
    survived: Counter[str] = Counter()
    for trial in range(INTEGRATION_KILLS):
        label, env = kill_env(rng, trial, points, 3)
        env = deepspeed_env(deepspeed_ops, tmp_path, env)
        kill_after = rng.uniform(1.5, 5.0) if label == "random" else None
        wait = ("durable", "captured")[trial % 2]
        code, _ = run_and_read([str(DS_CHILD), str(root), "4", wait], env, kill_after)
        found = check_deepspeed(root)
        assert found >= latest, f"latest moved back from step{latest} to step{found}"
        latest = found
        survived[f"{label} ({wait})" if code else f"{label} ({wait}, not reached)"] += 1
    assert sum(n for k, n in survived.items() if "not reached" not in k) >= INTEGRATION_KILLS // 2
    print(f"deepspeed: kills survived by point: {dict(survived)}")


def test_deepspeed_pointer_left_torn_by_a_kill_is_cleaned(tmp_path: Path) -> None:
    """A writer killed while it wrote a tag's pointer files leaves a temporary file beside
    them; the next save of that tag (a restarted job reaches the same global step) must not
    leave it in DeepSpeed's directory."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    from deepspeed.runtime.checkpoint_engine import CheckpointCommitInfo

    from lazyckpt.integrations.deepspeed import LazyCheckpointEngine
    from tiers import FileTier, HostMemoryTier

    tag_dir = tmp_path / "ds" / "step3"
    tag_dir.mkdir(parents=True)
    torn = tag_dir / "model.pt.tmp.999999"  # what _write_durably leaves when killed mid-way
    torn.write_bytes(b'{"format": "lazyckpt-deep')
    engine = LazyCheckpointEngine([HostMemoryTier(4 << 20), FileTier(tmp_path / "tiers")])
    try:
        info = CheckpointCommitInfo(tag="step3", save_dir=str(tmp_path / "ds"), save_latest=True)
        engine.create(info)
        engine.save({"w": torch.ones(4)}, str(tag_dir / "model.pt"))
        assert engine.commit(info)
    finally:
        engine.cleanup()
    assert sorted(p.name for p in tag_dir.iterdir()) == ["model.pt"]


@pytest.mark.slow
def test_kill_while_latest_is_written_under_deepspeed(
    tmp_path: Path, deepspeed_ops: Path
) -> None:
    """DeepSpeed writes ``latest`` by truncating it and writing the tag, without fsync: a
    kill in between leaves it empty. With LazyCheckpointEngine a kill at that moment (the
    child dies as soon as DeepSpeed's engine opens ``latest`` to write) must leave a
    ``latest`` that names a tag which loads."""
    env = dict(os.environ, LAZYCKPT_KILL_IN_LATEST="1")
    env.pop("LAZYCKPT_CRASH_AT", None)
    root = tmp_path / "job"
    root.mkdir()
    env = deepspeed_env(deepspeed_ops, tmp_path, env)
    run_and_read([str(DS_CHILD), str(root), "2", "durable"], env, None)
    assert check_deepspeed(root) == 2


LIGHTNING_CHILD = Path(__file__).parent / "helpers" / "crash_child_lightning.py"


@pytest.mark.slow
def test_kill_under_lightning_every_pointer_file_loads(tmp_path: Path) -> None:
    """LazyCheckpointIO saving as ModelCheckpoint does (``save_top_k`` 0, 1 or 2 files,
    ``last.ckpt``, older files removed), killed anywhere: every pointer file left loads bit for bit, and
    ``last.ckpt`` never moves back."""
    pytest.importorskip("lightning_fabric", reason="Lightning is not installed")
    from helpers.crash_child_lightning import checkpoint_of

    from lazyckpt.integrations.lightning import LazyCheckpointIO, read_pointer
    from tiers import FileTier

    rng = random.Random(2024)
    points = [p for p in POINTS if not p.startswith("zarr.")]
    survived: Counter[str] = Counter()
    last: int | None = None
    for trial in range(INTEGRATION_KILLS):
        label, env = kill_env(rng, trial, points, 4)
        kill_after = rng.uniform(0.8, 3.0) if label == "random" else None
        first = 0 if last is None else last + 1
        # save_top_k, varied across the named and the random kills (0, only last.ckpt, is
        # the hardest case: nothing else names the step it replaces)
        keep = (trial + trial // 3) % 3
        argv = [str(LIGHTNING_CHILD), str(tmp_path), str(first), str(first + 6), str(keep)]
        code, _ = run_and_read(argv, env, kill_after)
        folder = tmp_path / "ckpts"
        with LazyCheckpointIO([FileTier(tmp_path / "tiers")]) as io:
            for path in sorted(folder.glob("*.ckpt")) if folder.exists() else []:
                step = read_pointer(str(path))
                assert step is not None, f"{path} is not a pointer file"
                loaded = io.load_checkpoint(path)
                assert equal(loaded, checkpoint_of(step)), f"{path} (step {step}) differs"
            found = read_pointer(str(folder / "last.ckpt")) if (folder / "last.ckpt").exists() else None
        if last is not None:
            assert found is not None and found >= last, f"last.ckpt moved back from {last}"
        last = found
        survived[f"{label} (top {keep})" if code else f"{label} (top {keep}, not reached)"] += 1
    assert sum(n for k, n in survived.items() if "not reached" not in k) >= INTEGRATION_KILLS // 2
    print(f"lightning: kills survived by point: {dict(survived)}")


@pytest.mark.slow
def test_lightning_last_ckpt_survives_a_kill_before_its_next_step_commits(tmp_path: Path) -> None:
    """``last.ckpt`` alone (``save_top_k=0``): saving step 1 over it must not delete step 0,
    which the file on disk names, before step 1 is committed and the file rewritten; the
    writer is killed just before step 1's commit."""
    pytest.importorskip("lightning_fabric", reason="Lightning is not installed")
    from helpers.crash_child_lightning import checkpoint_of

    from lazyckpt.integrations.lightning import LazyCheckpointIO, read_pointer
    from tiers import FileTier

    # a pause after each step, so that step 0's pointer is down before step 1 is saved
    env = dict(
        os.environ, LAZYCKPT_CRASH_AT="file.commit.before_manifest:2", LAZYCKPT_CHILD_PAUSE="1"
    )
    argv = [str(LIGHTNING_CHILD), str(tmp_path), "0", "3", "0"]
    code, _ = run_and_read(argv, env, None)
    assert code == -signal.SIGKILL
    last = tmp_path / "ckpts" / "last.ckpt"
    assert read_pointer(str(last)) == 0
    with LazyCheckpointIO([FileTier(tmp_path / "tiers")]) as io:
        assert equal(io.load_checkpoint(last), checkpoint_of(0))
