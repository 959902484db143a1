"""Named points in the pipeline where tests inject crashes (test instrumentation).

The engine and the built-in tiers call :func:`point` at the moments that matter for crash
consistency (after a shard's data is written but before it is synced, between the data and
the manifest, during the rename that commits, during a retention delete). Normally nothing
happens there. A test can install a hook with :func:`set_hook`, or, for a child process it
is about to kill, set the environment variable ``LAZYCKPT_CRASH_AT=NAME:N`` so that the
process SIGKILLs itself on the N-th time it reaches point NAME: a crash at an exact place,
with no sleeping and no guessing.

Points: ``capture.done``, ``checksum.done``, ``tier.put.done``, ``tier.commit.before``,
``tier.commit.after``, ``file.write.before_sync``, ``file.commit.before_manifest``,
``file.commit.before_rename``, ``file.commit.after_rename``, ``file.delete.after_unlink``,
``file.delete.retired``, ``file.collect.before_remove``, ``zarr.delete_dir.before_remove``,
``retention.before_delete``, ``emergency.shard.read`` (an emergency copy read a shard back
and is about to write it).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

__all__ = ["POINTS", "crash_at", "point", "set_hook"]

POINTS = (
    "capture.done",
    "checksum.done",
    "tier.put.done",
    "tier.commit.before",
    "tier.commit.after",
    "file.write.before_sync",
    "file.commit.before_manifest",
    "file.commit.before_rename",
    "file.commit.after_rename",
    "file.delete.after_unlink",
    "file.delete.retired",
    "file.collect.before_remove",
    "zarr.delete_dir.before_remove",
    "retention.before_delete",
    "emergency.shard.read",
)

_hook: Callable[[str], None] | None = None


def point(name: str) -> None:
    """Mark that the pipeline reached ``name`` (a no-op unless a hook is installed)."""
    hook = _hook
    if hook is not None:
        hook(name)


def set_hook(hook: Callable[[str], None] | None) -> None:
    """Install (or with None, remove) the function called at every point."""
    global _hook
    _hook = hook


def crash_at(name: str, nth: int = 1) -> None:
    """Install a hook that SIGKILLs this process the ``nth`` time it reaches point ``name``
    (what ``LAZYCKPT_CRASH_AT=NAME:N`` does; for tests that kill one rank of several)."""
    if name not in POINTS:
        raise ValueError(f"unknown point {name!r}; points: {POINTS}")
    if nth < 1:
        raise ValueError(f"nth must be at least 1, got {nth}")
    remaining = [nth]
    lock = threading.Lock()

    def crash(reached: str) -> None:
        if reached != name:
            return
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    set_hook(crash)


def _crash_from_environment() -> None:
    spec = os.environ.get("LAZYCKPT_CRASH_AT")
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"LAZYCKPT_CRASH_AT names unknown point {name!r}; points: {POINTS}")
    crash_at(name, int(count or 1))


_crash_from_environment()
