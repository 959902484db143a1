"""Clean exits: a Checkpointer its trainer never closed, lazyckpt's own gloo groups, and the
test kit without pytest. Each case runs in a fresh interpreter, as a user's script would."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOISE = ("Task was destroyed", "ExceptionGroup", "Exception ignored", "Traceback (most recent call last)\n  File \"<frozen")


def run(code: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


TRAINER_RAISES = """
    import asyncio, torch, lazyckpt
    from lazyckpt.testing import FaultyTier
    from tiers import FileTier, HostMemoryTier

    async def main():
        slow = FaultyTier(FileTier("ckpt"))
        slow.{fault}
        ckpt = {kind}([HostMemoryTier(16 << 20), slow], exit_timeout={timeout})
        await ckpt.open() if {is_async} else ckpt.open()
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt.guard(opt)
        for step in range(3):
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            handle = ckpt.snapshot({{"model": model, "optim": opt}}, step=step)
            if {is_async}:
                handle = await handle
            asyncio.get_running_loop().create_task(handle.committed())
        raise RuntimeError("the trainer crashed")

    asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lazyckpt.Checkpointer", "lazyckpt.SyncCheckpointer"])
def test_a_checkpointer_never_closed_drains_quietly_at_exit(tmp_path: Path, kind: str) -> None:
    code = TRAINER_RAISES.format(
        fault="delay_s = 0.05", kind=kind, timeout=30, is_async=kind.endswith(".Checkpointer")
    )
    done = run(code, tmp_path)
    assert done.returncode == 1
    assert "RuntimeError: the trainer crashed" in done.stderr
    assert not [n for n in NOISE if n in done.stderr], done.stderr
    assert "lazyckpt" not in done.stderr.split("RuntimeError: the trainer crashed")[1]
    # drained at exit: every snapshot reached the durable tier
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        f"step-{s:012d}" for s in range(3)
    ]


@pytest.mark.slow
def test_a_checkpointer_that_cannot_drain_says_so_once(tmp_path: Path) -> None:
    code = TRAINER_RAISES.format(
        fault='hang("put_shard")', kind="lazyckpt.Checkpointer", timeout=0.5, is_async=True
    )
    done = run(code, tmp_path)
    assert done.returncode == 1
    assert not [n for n in NOISE if n in done.stderr], done.stderr
    tail = done.stderr.split("RuntimeError: the trainer crashed")[1]
    assert tail.count("was not closed before exit") == 1
    assert "steps [0, 1, 2] were abandoned" in tail


@pytest.mark.slow
def test_the_gloo_groups_are_destroyed_on_close(tmp_path: Path) -> None:
    code = """
        import asyncio, socket, torch, torch.distributed as dist, lazyckpt
        from torch.distributed.distributed_c10d import _world
        from tiers import FileTier

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        before = len(_world.pg_map)

        async def main():
            async with lazyckpt.Checkpointer([FileTier("ckpt")], distributed=True) as ckpt:
                during = len(_world.pg_map)
                await (await ckpt.snapshot({"w": torch.ones(3)}, step=0)).committed()
            return during

        during = asyncio.run(main())
        after = len(_world.pg_map)
        dist.destroy_process_group()
        print(before, during, after)
    """
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    before, during, after = map(int, done.stdout.split())
    assert during == before + 3  # a control group, one per durable tier, one for shard transfers
    assert after == before


@pytest.mark.slow
def test_the_test_kit_imports_without_pytest(tmp_path: Path) -> None:
    code = """
        import sys
        sys.modules["pytest"] = None  # any import of pytest now fails
        import lazyckpt.testing as kit
        from lazyckpt.testing import FaultyTier, build_snapshot
        from tiers import FileTier
        import torch
        FaultyTier(FileTier("x")).fail_next("commit")
        manifest, payloads = build_snapshot(1, {"w": torch.ones(4)})
        try:
            kit.TierTests
        except ImportError:
            print("TierTests needs pytest")
    """
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "TierTests needs pytest"


DROPPED = """
    import gc, threading, time, warnings, torch, lazyckpt
    from lazyckpt.testing import FaultyTier
    from tiers import FileTier

    warnings.simplefilter("always", ResourceWarning)

    def helper(step):
        # opens a Checkpointer, takes a snapshot and returns without closing it
        slow = FaultyTier(FileTier("ckpt"))
        slow.{fault}
        ckpt = lazyckpt.SyncCheckpointer([slow], exit_timeout={timeout})
        ckpt.open()
        ckpt.snapshot({{"w": torch.full((1000,), float(step))}}, step=step)

    helper(5)
    gc.collect()  # the Checkpointer is gone; its snapshot is still on its way
    print("returned")
"""


@pytest.mark.slow
def test_a_checkpointer_dropped_open_still_drains_at_exit(tmp_path: Path) -> None:
    done = run(DROPPED.format(fault="delay_s = 0.3", timeout=30), tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "returned"
    assert not [n for n in NOISE if n in done.stderr], done.stderr
    assert done.stderr.count("ResourceWarning: a lazyckpt Checkpointer was dropped") == 1
    assert "steps [5]" in done.stderr
    assert "abandoned" not in done.stderr
    assert [p.name for p in (tmp_path / "ckpt").glob("step-*")] == [f"step-{5:012d}"]


@pytest.mark.slow
def test_a_dropped_checkpointer_that_cannot_drain_says_so_once(tmp_path: Path) -> None:
    done = run(DROPPED.format(fault='hang("put_shard")', timeout=0.5), tmp_path)
    assert done.returncode == 0, done.stderr
    assert not [n for n in NOISE if n in done.stderr], done.stderr
    assert done.stderr.count("were abandoned") == 1
    assert "snapshots of steps [5] were abandoned" in done.stderr


@pytest.mark.slow
def test_a_checkpointer_dropped_idle_stops_its_thread_quietly(tmp_path: Path) -> None:
    code = """
        import gc, threading, time, torch, lazyckpt
        from tiers import FileTier

        ckpt = lazyckpt.SyncCheckpointer([FileTier("ckpt")]).__enter__()
        try:
            ckpt.snapshot({"x": torch.ones(1)}, step=10.0)
        except lazyckpt.ConfigurationError:
            pass
        del ckpt
        gc.collect()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not [t for t in threading.enumerate() if t.name == "lazyckpt-engine"]:
                break
            time.sleep(0.02)
        gc.collect()
        print(sorted(t.name for t in threading.enumerate()))
    """
    done = run(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "lazyckpt-engine" not in done.stdout
    assert not [n for n in NOISE if n in done.stderr], done.stderr


COLLECTED_UNDER_THE_ENGINE_LOCK = """
import faulthandler, gc, warnings
import torch, lazyckpt
from tiers import FileTier
warnings.simplefilter("ignore", ResourceWarning)
faulthandler.dump_traceback_later(30, exit=True)  # a deadlock ends the child, with stacks

class Trainer:  # holds its Checkpointer in a reference cycle, as trainers often do
    def __init__(self):
        self.me = self
        self.ckpt = lazyckpt.SyncCheckpointer([FileTier("store")]).open()

trainer = Trainer()
trainer.ckpt.snapshot({"w": torch.randn(256, 256)}, step=1)
engine = trainer.ckpt._core.engine
gc.disable()
del trainer  # garbage now, collected by the next pass of the cyclic collector
with engine._lock:  # a pass can start on any thread that allocates, this lock held or not
    gc.collect()
print("collected", flush=True)
"""


def test_the_dropped_checkpointers_finalizer_takes_no_engine_lock(tmp_path: Path) -> None:
    """The finalizer of a Checkpointer dropped open runs wherever the cyclic collector
    runs, also on a thread holding the engine's lock: it must not take that lock."""
    out = run(COLLECTED_UNDER_THE_ENGINE_LOCK, tmp_path, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "collected" in out.stdout
    with_step = run(
        "import lazyckpt\nfrom tiers import FileTier\n"
        "with lazyckpt.SyncCheckpointer([FileTier('store', readonly=True)]) as c:\n"
        "    print(c.steps())\n",
        tmp_path,
    )
    assert with_step.stdout.strip() == "[1]", with_step.stderr[-2000:]
