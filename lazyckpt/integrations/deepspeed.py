"""DeepSpeed: a checkpoint engine that saves through lazyckpt, decoupled from training.

Install it on an engine after ``deepspeed.initialize``::

    engine.checkpoint_engine = LazyCheckpointEngine(tiers=[HostMemoryTier(...), FileTier(...)])

DeepSpeed 0.19 picks its checkpoint engine in a hard-wired factory (``checkpoint.writer``,
``datastates_ckpt`` or ``torch.save``): no configuration key names a third-party engine, so
the assignment above is the way in.

How one ``engine.save_checkpoint(save_dir, tag)`` flows through it:

1. ``create(info)``: a new group for the tag (a tag DeepSpeed never committed is committed
   first). A one-shot forward pre-hook on every module is armed.
2. ``save(state_dict, path)``, once per file (model states, one ZeRO optimizer file per
   rank, ...): the state dict is kept by reference under its path relative to ``save_dir``.
   Nothing is copied (``preserves_storage_sharing()`` is False, so DeepSpeed does not clone
   the tensors either).
3. The next forward pass (the hook), or the commit if it comes first, *seals* the group: one
   ``snapshot()`` of every file of the tag as one lazyckpt step. The capture runs while
   forward and backward run.
4. DeepSpeed calls ``commit(info)`` at the next gradient-accumulation boundary, before the
   optimizer step (the engine is *decoupled*). ``commit`` waits until the step is committed on
   the last tier, then writes at each file's path a small JSON *pointer* (step, tag, key),
   fsync'd, so DeepSpeed's own checks on its directory (``glob``, ``os.path.exists``) still
   hold. Only then is ``latest`` written, by this engine (rank 0), atomically and fsync'd:
   it never names a tag that is not durable. ``commit`` clears ``info.save_latest`` so that
   DeepSpeed does not write it again its own way (truncate, then write, no fsync: a kill in
   between would leave ``latest`` empty). With ``wait="captured"`` the commit waits only for
   the capture (what the optimizer step needs), and a thread of this engine writes the
   pointers and ``latest`` once the step is durable: training never waits for storage.
5. ``load(path)`` reads the pointer and restores the file's state from the fastest tier that
   holds the step; a file that is not a pointer (a checkpoint saved by DeepSpeed's default
   engine) is read with ``torch.load``.

A failed checkpoint never stops training: ``commit`` logs the failure (logger
``lazyckpt.deepspeed``), returns False and writes no ``latest`` (DeepSpeed's decoupled path
reads ``info.save_latest``, always cleared, after ``commit`` returns), so ``latest`` keeps
naming the last good tag.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lazyckpt.integrations.deepspeed needs DeepSpeed: pip install 'lazyckpt[deepspeed]'"
    ) from exc

from .._checkpointer.facades import SyncCheckpointer
from .._checkpointer.handle import SnapshotHandle
from .._errors import ConfigurationError, CorruptionError, LazyCkptError, SnapshotNotFoundError
from .._tiering.interface import SupportsRankManifests, Tier

__all__ = ["POINTER_FORMAT", "LazyCheckpointEngine"]

log = logging.getLogger("lazyckpt.deepspeed")

POINTER_FORMAT = "lazyckpt-deepspeed-pointer"
"""The ``format`` field of the pointer files written where DeepSpeed expects its files."""
_POINTER_VERSION = 1


@dataclass(eq=False)
class _Group:
    """The files of one tag on their way to one lazyckpt step."""

    info: CheckpointCommitInfo
    files: dict[str, Any] = field(default_factory=dict)  # key -> state dict (by reference)
    paths: dict[str, str] = field(default_factory=dict)  # key -> the path DeepSpeed gave
    sealed: bool = False
    step: int | None = None
    handle: SnapshotHandle | None = None
    error: BaseException | None = None


class LazyCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # DeepSpeed is untyped
    """A DeepSpeed ``CheckpointEngine`` that checkpoints lazily through lazyckpt's tiers.

    One DeepSpeed tag is one lazyckpt step (numbered 0, 1, 2, ... after the newest step
    already in the tiers); the snapshot holds ``{"tag": tag, "files": {key: state_dict}}``
    with ``key`` the file's path relative to ``save_dir``. Every rank uses its own engine
    (and ``Checkpointer``), as lazyckpt's distributed commit requires.

    Args:
        tiers: the lazyckpt tier chain, fastest first (``HostMemoryTier``, ``FileTier``,
            ``ZarrTier``).
        wait: what DeepSpeed's commit (in the ``step()`` after a checkpoint, before the
            optimizer step) waits for. ``"durable"`` (default): the step committed on the last
            tier; ``latest`` is then written, as with DeepSpeed's engines. ``"captured"``:
            only the capture; ``latest`` (and the pointer files) are written by this engine
            when the step is durable, later, and a checkpoint that fails on a tier after its
            capture is only logged (``latest`` keeps naming the last durable tag).
        **options: :class:`~lazyckpt.SyncCheckpointer` options. ``allow_pickle`` defaults
            to True here: DeepSpeed's files hold objects (its loss scaler, enums, named
            tuples) that only pickle can store, as its own ``torch.load(weights_only=False)``
            does; pass False if every reader must be kept from running checkpoint code.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        wait: Literal["durable", "captured"] = "durable",
        **options: Any,
    ) -> None:
        super().__init__(None)
        if wait not in ("durable", "captured"):
            raise ConfigurationError(f'wait must be "durable" or "captured", got {wait!r}')
        self.name = "LazyCheckpointEngine"
        self.wait = wait
        options.setdefault("allow_pickle", True)
        self._ckpt = SyncCheckpointer(tiers, **options)
        self._lock = threading.RLock()
        self._group: _Group | None = None
        self._next_step: int | None = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._loaded: tuple[int, int, dict[str, Any]] | None = None  # (step, rank, files)
        self._closed = False
        # wait="captured": publishes (pointers, then latest) in commit order, off the loop
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._published: list[concurrent.futures.Future[None]] = []

    @property
    def checkpointer(self) -> SyncCheckpointer:
        """The lazyckpt checkpointer underneath (``steps()``, ``metrics()``, ``verify()``)."""
        return self._ckpt

    # -- DeepSpeed's CheckpointEngine interface --------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        """Start the group of files of ``info.tag`` (commits a tag left uncommitted first)."""
        with self._lock:
            self._check_open()
            self.commit_pending()
            self._loaded = None
            group = _Group(info)
            try:
                self._open()
            except LazyCkptError as exc:
                group.error = exc
                log.error("checkpoint %r: lazyckpt could not open its tiers: %s", info.tag, exc)
            self._group = group
            # the next forward pass seals the group, so the capture overlaps forward/backward
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(
                self._on_forward
            )

    def save(self, state_dict: Any, path: str) -> None:
        """Record ``state_dict`` by reference as the file ``path`` of the current tag."""
        with self._lock:
            group = self._group
            if group is None:
                raise ConfigurationError(
                    f"save({path!r}) without create(): DeepSpeed calls create(info) before "
                    "saving the files of a tag; call it first when driving the engine by hand"
                )
            key = os.path.relpath(path, group.info.save_dir)
            if group.sealed:
                # the snapshot is taken: this file would be silently missing from the step
                group.error = group.error or ConfigurationError(
                    f"file {path!r} was saved after the checkpoint {group.info.tag!r} was sealed "
                    "(by a forward pass or a commit); save every file of a tag before training on"
                )
                log.error("checkpoint %r: %s", group.info.tag, group.error)
                return
            group.files[key] = state_dict
            group.paths[key] = path

    def load(self, path: str, map_location: Any = None) -> Any:
        """What ``torch.load(path)`` returns for a file DeepSpeed saved through this engine.

        ``map_location`` as a device (or device string) places the tensors there; otherwise
        (``None``, a function, a mapping) they come back on the CPU, which is what DeepSpeed
        asks for or copies from when it loads. Mappings come back as plain dicts. A file
        that is not a lazyckpt pointer is read with ``torch.load``.

        Raises:
            SnapshotNotFoundError: the step the pointer names is no longer in any tier
                (deleted by retention, or the tiers are not the ones it was saved to).
            CorruptionError: the pointer is damaged or names a step of another tag.
        """
        self._drain_publications()
        pointer = _read_pointer(path)
        if pointer is None:
            return torch.load(path, map_location=map_location, weights_only=False)
        step, tag, key, writer = pointer
        with self._lock:
            self._check_open()
            self.commit_pending()
            self._open()
            cached = self._loaded
            if cached is None or cached[:2] != (step, writer) or key not in cached[2]:
                device = map_location if isinstance(map_location, str | torch.device) else None
                try:
                    if writer == _rank():
                        state = self._ckpt.restore(step, map_location=device)
                    else:  # DeepSpeed has every rank read rank 0's model states
                        state = self._restore_rank(step, writer, device)
                except SnapshotNotFoundError as exc:
                    raise SnapshotNotFoundError(
                        f"{path} points at lazyckpt step {step} (tag {tag!r}), which no tier "
                        f"holds any more: {exc}. Load another tag, or check the tiers given "
                        "to LazyCheckpointEngine."
                    ) from exc
                if not isinstance(state, dict) or state.get("tag") != tag:
                    found = state.get("tag") if isinstance(state, dict) else None
                    raise CorruptionError(
                        f"{path} points at lazyckpt step {step} for tag {tag!r}, but that step "
                        f"holds tag {found!r}: the pointer and the tiers do not belong together"
                    )
                cached = self._loaded = (step, writer, dict(state["files"]))
            if key not in cached[2]:
                raise CorruptionError(
                    f"{path}: lazyckpt step {step} (tag {tag!r}) of rank {writer} has no file "
                    f"{key!r} (it has {sorted(cached[2])})"
                )
            # handed out once: a second load of the same file restores again, so two callers
            # never share (and mutate) the same tensors
            return cached[2].pop(key)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Make the tag durable: wait until its step is committed on the last tier, then
        write the pointer files (``wait="captured"``: wait for the capture only, and publish
        later), then (``"durable"``, rank 0) ``latest``. Always clears ``info.save_latest``:
        this engine writes ``latest`` itself, atomically. Returns False when the checkpoint
        failed (``latest`` left alone); never raises for a failed checkpoint."""
        with self._lock:
            group = self._group
            if group is None or group.info.tag != info.tag or group.info.save_dir != info.save_dir:
                log.error(
                    "commit of checkpoint %r in %s, which was not the one being saved; "
                    "nothing committed",
                    info.tag,
                    info.save_dir,
                )
                info.save_latest = False
                return False
            ok = self._finish(group)
            if ok and self.wait == "durable" and info.save_latest:
                ok = self._write_latest(info)
            # DeepSpeed's own write of 'latest' truncates it before writing the tag (and does
            # not fsync): a kill in between leaves it empty. This engine writes it atomically
            # (above, or from the publisher once durable), so DeepSpeed is told not to.
            info.save_latest = False
            return ok

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Create DeepSpeed's directory: it holds ``latest`` and the pointer files."""
        os.makedirs(path, exist_ok=exist_ok)

    def is_decoupled(self) -> bool:
        """True: DeepSpeed commits at the next step boundary, before the optimizer step."""
        return True

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The tag saved and not yet committed, if any (DeepSpeed's step() asks)."""
        group = self._group
        return None if group is None else group.info

    def preserves_storage_sharing(self) -> bool:
        """False: DeepSpeed then hands over its tensors without cloning them first."""
        return False

    def cleanup(self) -> None:
        """Commit what is pending (writing ``latest`` as DeepSpeed would have), drain every
        snapshot and close the tiers. ``engine.destroy()`` calls it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self.commit_pending()
            self._closed = True
            self._drain_publications()
            if self._publisher is not None:
                self._publisher.shutdown(wait=True)
            try:
                self._ckpt.close()
            except LazyCkptError as exc:
                log.error("closing lazyckpt's checkpointer: %s", exc)

    # -- beyond DeepSpeed's interface ------------------------------------------------------

    def open(self) -> LazyCheckpointEngine:
        """Open the tiers now instead of at the first checkpoint: allocate and pre-fault the
        host arena, clean up what a crash left, find the newest step. With several ranks,
        every rank calls it together. Returns the engine."""
        with self._lock:
            self._check_open()
            self._open()
        return self

    def commit_pending(self) -> bool:
        """Commit the tag saved last if DeepSpeed has not yet (it does at the next
        ``engine.step()``) and, on rank 0, point ``latest`` at it as DeepSpeed would have.

        Use it before ``load_checkpoint`` of a tag saved without a training step since, or
        at the end of training without ``engine.destroy()``. Returns False if that
        checkpoint failed, True otherwise (also when nothing was pending).
        """
        with self._lock:
            group = self._group
            if group is None:
                return True
            ok = self._finish(group)
            if ok and group.info.save_latest and self.wait == "durable":
                ok = self._write_latest(group.info)
            return ok

    # -- inside ------------------------------------------------------------------------------

    def _write_latest(self, info: CheckpointCommitInfo) -> bool:
        """On rank 0, point ``latest`` at ``info.tag`` atomically and durably; False if
        that failed (logged)."""
        if _rank() != 0:
            return True
        try:
            _write_durably(os.path.join(info.save_dir, "latest"), info.tag.encode())
        except OSError as exc:
            log.error("checkpoint %r: could not write 'latest': %s", info.tag, exc)
            return False
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError(
                "this LazyCheckpointEngine was cleaned up (engine.destroy()); install a new one"
            )

    def _open(self) -> None:
        if self._next_step is None:
            self._ckpt.open()
            steps = self._ckpt.steps()
            self._next_step = steps[-1] + 1 if steps else 0

    def _restore_rank(self, step: int, rank: int, device: torch.device | str | None) -> Any:
        """Rank ``rank``'s part of ``step``, from a tier that every rank reads (a shared
        ``FileTier`` or ``ZarrTier``)."""
        # lazyckpt's restore() reads the calling rank's own part; another rank's part is read
        # with the same pieces it uses for resharding
        from .._restore.reshard import _read_rank_manifest, _readers
        from .._restore.restore import restore_state

        core = self._ckpt._core

        async def read() -> Any:
            readers = await _readers(core.engine.tiers, step)
            if not readers:
                shared = [t.name for t in core.engine.tiers if isinstance(t, SupportsRankManifests)]
                raise SnapshotNotFoundError(
                    f"step {step} of rank {rank} is on no tier this rank can read "
                    f"(tiers that read other ranks' parts: {shared or 'none'})"
                )
            manifest = await _read_rank_manifest(readers, step, rank)
            return await restore_state(
                manifest, readers, into=None, map_location=device,
                allow_pickle=core.options.allow_pickle,
            )

        return core.engine.loop.submit(read()).result()

    def _on_forward(self, _module: torch.nn.Module, _args: Any) -> None:
        self._seal()

    def _seal(self) -> None:
        """Take the snapshot of the current group (once)."""
        with self._lock:
            group = self._group
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if group is None or group.sealed:
                return
            group.sealed = True
            files, group.files = group.files, {}  # lazyckpt holds what it needs from here
            if group.error is not None:
                return
            assert self._next_step is not None  # set by _open, or group.error is
            try:
                group.handle = self._ckpt.snapshot(
                    {"tag": group.info.tag, "files": files}, step=self._next_step
                )
            except LazyCkptError as exc:
                group.error = exc
                log.error("checkpoint %r: snapshot failed: %s", group.info.tag, exc)
                return
            group.step = self._next_step
            self._next_step += 1

    def _finish(self, group: _Group) -> bool:
        """Seal, wait for the durable commit, write the pointers; True if all went well.
        With ``wait="captured"``: wait for the capture and hand the rest to the publisher."""
        ok = self._finish_here(group)
        if self.wait == "durable":
            # with several ranks, every rank reaches this once per tag, whatever happened:
            # rank 0 lets 'latest' move only once every rank's pointers are down
            ok = _agree(ok)
        return ok

    def _finish_here(self, group: _Group) -> bool:
        self._seal()
        self._group = None
        tag = group.info.tag
        if group.error is not None:
            log.error("checkpoint %r failed and was not committed: %s", tag, group.error)
            return False
        handle = group.handle
        assert handle is not None and group.step is not None  # set by _seal without error
        if handle.skipped:
            log.warning("checkpoint %r skipped: lazyckpt was still busy (when_busy='skip')", tag)
            return False
        try:
            handle.wait("captured" if self.wait == "captured" else "committed")
        except LazyCkptError as exc:
            log.error("checkpoint %r (lazyckpt step %d) failed: %s", tag, group.step, exc)
            return False
        if self.wait == "captured":
            if self._publisher is None:
                self._publisher = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="lazyckpt-deepspeed-publish"
                )
            self._published = [f for f in self._published if not f.done()]
            # saved now: DeepSpeed reads and clears the flag when commit() returns
            latest = group.info.save_latest
            self._published.append(self._publisher.submit(self._publish, group, latest))
            return True
        return self._write_pointers(group)

    def _publish(self, group: _Group, latest: bool) -> None:
        """Publisher thread: once the step is durable, its pointers, then ``latest``."""
        assert group.handle is not None
        tag = group.info.tag
        try:
            group.handle.wait("committed")
        except LazyCkptError as exc:
            log.error("checkpoint %r (lazyckpt step %s) failed: %s", tag, group.step, exc)
            return
        if self._write_pointers(group) and latest and _rank() == 0:
            try:
                _write_durably(os.path.join(group.info.save_dir, "latest"), tag.encode())
            except OSError as exc:
                log.error("checkpoint %r: could not write 'latest': %s", tag, exc)

    def _drain_publications(self) -> None:
        """Wait until every durable-later checkpoint is published (or has failed)."""
        pending, self._published = self._published, []
        concurrent.futures.wait(pending)

    def _write_pointers(self, group: _Group) -> bool:
        tag = group.info.tag
        try:
            for key, path in group.paths.items():
                pointer = {
                    "format": POINTER_FORMAT,
                    "version": _POINTER_VERSION,
                    "step": group.step,
                    "tag": tag,
                    "key": key,
                    "rank": _rank(),
                }
                _write_durably(path, json.dumps(pointer).encode())
        except OSError as exc:
            log.error("checkpoint %r: could not write the pointer files: %s", tag, exc)
            return False
        return True


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _agree(ok: bool) -> bool:
    """True on every rank if ``ok`` on every rank. A collective on the trainer's group, on
    the training thread, at a point every rank reaches (DeepSpeed barriers there next)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _write_durably(path: str, data: bytes) -> None:
    """Write ``path`` atomically (temporary file, fsync, rename, fsync of the directory).

    Temporary files of ``path`` that a killed writer left (a restarted job saves the same
    tag again) are removed first: one writer per location, so none of them is in use."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    for stale in glob.glob(f"{glob.escape(path)}.tmp.*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_pointer(path: str) -> tuple[int, str, str, int] | None:
    """(step, tag, key, rank that wrote it) if ``path`` is a pointer file; None if it is anything else (a torch
    file starts with a zip or pickle header, never with ``{``)."""
    with open(path, "rb") as f:
        if f.read(1) != b"{":
            return None
        raw = b"{" + f.read(1 << 20)
    try:
        doc = json.loads(raw)
        if doc["format"] != POINTER_FORMAT:
            raise ValueError(f"format {doc['format']!r}")
        if doc["version"] != _POINTER_VERSION:
            raise ValueError(f"version {doc['version']!r}, this lazyckpt reads {_POINTER_VERSION}")
        step, tag, key, rank = doc["step"], doc["tag"], doc["key"], doc["rank"]
        if type(step) is not int or type(rank) is not int:
            raise ValueError("step or rank is not an integer")
        if not isinstance(tag, str) or not isinstance(key, str):
            raise ValueError("tag or key is not a string")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(
            f"{path} is neither a torch checkpoint nor a valid lazyckpt pointer ({exc}); "
            "restore it from a copy, or load another tag"
        ) from exc
    return step, tag, key, rank
