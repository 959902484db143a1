"""lazyckpt as a storage backend of PyTorch Distributed Checkpoint (DCP).

``dcp.save`` / ``dcp.async_save`` with :class:`LazyStorageWriter` and ``dcp.load`` with
:class:`LazyStorageReader` keep DCP's API, planners and resharding, and put lazyckpt's
pipeline underneath: a bounded host arena, tiers with per-tier completion, atomic
checksummed commits. A DCP save is an ordinary lazyckpt step: ``steps()``, ``restore()``,
``lazyckpt ls`` and ``lazyckpt verify`` see it like any other.

How a save maps onto lazyckpt
-----------------------------
- ``dcp.async_save`` uses the writer as its stager: :meth:`LazyStorageWriter.stage` takes
  the lazyckpt snapshot of the state dict at once (references only, no copy) and returns a
  future that resolves when the capture is done. That future is DCP's
  ``staging_completion``; training may change the tensors after it resolves (guard the
  optimizer with ``checkpointer.guard(optimizer)`` or wait on it before ``step()``).
- DCP then plans and calls :meth:`~LazyStorageWriter.write_data` on its own thread; the
  bytes never pass through DCP. The write completes when the step is committed on the last
  tier, so ``upload_completion`` (or ``dcp.save``'s return) means durable.
- ``dcp.save`` (synchronous) takes the snapshot in ``write_data`` and returns once the step
  is committed.

What is stored, and why nothing is pickled
------------------------------------------
DCP's own file format pickles its ``Metadata`` and every non-tensor value
(``torch.save`` into a ``BytesIO``); loading them runs code from the checkpoint. lazyckpt
stores neither: the state is stored as lazyckpt stores any state (tensors as raw bytes,
plain values in the manifest's JSON tree; other objects only with ``allow_pickle=True``),
and :meth:`LazyStorageReader.read_metadata` rebuilds DCP's ``Metadata`` from the manifest:
every tensor is described as one chunk of its global shape, every other value as bytes.
DCP's planner then asks for whatever region each rank needs, whatever the sharding was at
save time. The ``BytesIO`` a value is handed to DCP in is made at load time from the
decoded plain value, so DCP's ``torch.load`` of it never reads bytes from storage.

The step
--------
``checkpoint_id`` is the step: an ``int``, or a string of decimal digits. DCP does not pass
``checkpoint_id`` to a stager, so for ``async_save`` the writer reads it from the
``async_save`` call it is staged by; ``LazyStorageWriter(ckpt, step=N)`` states it
explicitly instead.
"""

from __future__ import annotations

import concurrent.futures
import io
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .._checkpointer.core import _Core
from .._checkpointer.facades import Checkpointer, SyncCheckpointer
from .._checkpointer.handle import SnapshotHandle
from .._errors import ConfigurationError, SnapshotNotFoundError
from .._format.manifest import Manifest
from .._format.values import decode_tree
from .._restore.reshard import read_base_manifest

__all__ = ["LazyStorageReader", "LazyStorageWriter"]

StateDict = dict[str, Any]

AnyCheckpointer = Checkpointer | SyncCheckpointer


def _core_of(checkpointer: AnyCheckpointer) -> _Core:
    if not isinstance(checkpointer, Checkpointer | SyncCheckpointer):
        raise ConfigurationError(
            "LazyStorageWriter/LazyStorageReader take a lazyckpt Checkpointer or "
            f"SyncCheckpointer, got {type(checkpointer).__qualname__}"
        )
    return checkpointer._core


def _step_of(checkpoint_id: object) -> int:
    """The lazyckpt step a DCP ``checkpoint_id`` names."""
    if type(checkpoint_id) is int and checkpoint_id >= 0:
        return checkpoint_id
    if isinstance(checkpoint_id, str | os.PathLike):
        text = os.fspath(checkpoint_id)
        if isinstance(text, str) and text.isdecimal():
            return int(text)
    raise ConfigurationError(
        f"checkpoint_id {checkpoint_id!r} is not a step: with lazyckpt's DCP storage, pass "
        "the training step, a non-negative int (e.g. dcp.save(state, checkpoint_id=step, ...))"
    )


def _async_save_checkpoint_id() -> object:
    """The ``checkpoint_id`` of the ``dcp.async_save`` call this thread is inside, if any.

    DCP hands a stager only the state dict; the id is an argument of ``async_save`` (a
    public keyword, so its name is stable), found on the caller's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "async_save" and frame.f_globals.get("__name__") == (
            state_dict_saver.__name__
        ):
            return frame.f_locals.get("checkpoint_id")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0  # a plain value: kept in the manifest's tree, not in a shard
    dtype = item.tensor_data.properties.dtype
    return math.prod(item.tensor_data.chunk.sizes) * dtype.itemsize


def _chain(
    source: concurrent.futures.Future[None],
    handle: SnapshotHandle,
    stage: str,
    on_ok: Callable[[], object],
    on_error: Callable[[BaseException], object],
) -> None:
    """Call ``on_ok()`` or ``on_error(exc)`` when ``source`` (the handle's ``stage``) ends.
    The outcome is read through ``handle.wait`` so a failure counts as reported to the
    caller (lazyckpt does not raise it again at the next snapshot)."""

    def done(_: concurrent.futures.Future[None]) -> None:
        try:
            handle.wait(stage, timeout=0)
        except BaseException as exc:  # handed on to DCP's future unchanged
            on_error(exc)
            return
        on_ok()

    source.add_done_callback(done)


class LazyStorageWriter(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that saves through a lazyckpt
    Checkpointer.

    ``dcp.async_save(state, checkpoint_id=step, storage_writer=LazyStorageWriter(ckpt))``
    returns an ``AsyncSaveResponse`` before any byte is copied: its
    ``staging_completion`` resolves when lazyckpt's capture is done, its
    ``upload_completion`` when the step is committed on the last tier. ``dcp.save`` with it
    returns once the step is committed. Every rank passes its own writer over its own
    (opened) Checkpointer.

    Args:
        checkpointer: an open :class:`~lazyckpt.Checkpointer` or
            :class:`~lazyckpt.SyncCheckpointer`.
        step: the step to save; ``None`` takes it from ``checkpoint_id``.
        overwrite: ``False``, as DCP's ``FileSystemWriter(overwrite=False)``: a save of a
            step that exists (committed on a tier, or in flight) raises DCP's
            ``RuntimeError("Checkpoint already exists and self.overwrite=False. ...")``
            from :meth:`prepare_local_plan`, so that ``dcp.save`` raises, and
            ``async_save``'s ``upload_completion`` fails, with a ``CheckpointException``
            holding it; nothing is snapshotted. ``True`` (DCP's default): lazyckpt's own
            rule, that steps only increase, refuses such a step with
            :class:`~lazyckpt.ConfigurationError` (``dcp.save`` wraps it; ``async_save``
            raises it at the call); lazyckpt never writes over a committed step (delete it
            first with ``checkpointer.delete(step)``).
    """

    # The capture overlaps the next forward and backward passes; the staging future (or
    # the Checkpointer's optimizer guard) is the synchronization point.
    _synchronize_after_execute = False

    def __init__(
        self, checkpointer: AnyCheckpointer, *, step: int | None = None, overwrite: bool = True
    ) -> None:
        self._core = _core_of(checkpointer)
        # the facade too: a Checkpointer its owner dropped open is closed when the facade is
        # collected, and a writer still using it is an owner
        self._checkpointer = checkpointer
        self._fixed_step = None if step is None else _step_of(step)
        if not isinstance(overwrite, bool):
            raise ConfigurationError(f"overwrite must be True or False, got {overwrite!r}")
        self.overwrite = overwrite
        self._step: int | None = None  # this save's, from its checkpoint_id
        self._handle: SnapshotHandle | None = None
        # the step stage() found already there (overwrite=False): prepare_local_plan raises
        self._refused: int | None = None

    def __reduce__(self) -> Any:
        raise ConfigurationError(
            "LazyStorageWriter cannot be sent to another process: its Checkpointer runs in "
            "this one. Use dcp.async_save's default AsyncCheckpointerType.THREAD (lazyckpt "
            "already does its copying and writing off the training thread)"
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when ``checkpoint_id`` names a step (an int, or decimal digits)."""
        try:
            _step_of(checkpoint_id)
        except ConfigurationError:
            return False
        return True

    def stage(self, state_dict: StateDict) -> concurrent.futures.Future[StateDict]:
        """Take the lazyckpt snapshot of ``state_dict`` (no copy) and return a future that
        resolves to it once the capture is done (DCP's ``staging_completion``)."""
        step = self._fixed_step
        if step is None:
            found = _async_save_checkpoint_id()
            if found is None:
                raise ConfigurationError(
                    "LazyStorageWriter.stage() needs the step: call dcp.async_save(state, "
                    "checkpoint_id=step, ...) or build LazyStorageWriter(ckpt, step=step)"
                )
            step = _step_of(found)
        self._refused = None
        staged: concurrent.futures.Future[StateDict] = concurrent.futures.Future()
        if not self.overwrite and self._exists(step):
            # as FileSystemWriter: the save fails in its planning, on DCP's side, and
            # async_save's upload_completion carries the error; nothing to stage
            self._refused = step
            staged.set_result(state_dict)
            return staged
        handle = self._core.snapshot(state_dict, step)
        self._handle = handle
        if handle.skipped:  # when_busy="skip": nothing to wait for; write_data reports it
            staged.set_result(state_dict)
            return staged
        _chain(
            handle._future("captured"),
            handle,
            "captured",
            lambda: staged.set_result(state_dict),
            staged.set_exception,
        )
        return staged

    def synchronize_staging(self) -> None:
        """Block until every pending capture is done (DCP's older synchronization point;
        ``staging_completion`` or ``checkpointer.guard(optimizer)`` are the usual ones)."""
        self._core.wait_captured_blocking()

    def close(self) -> None:
        """Nothing to release: the Checkpointer owns every resource."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Start a save; ``checkpoint_id`` (if given) is its step."""
        if checkpoint_id is None:
            return
        step = _step_of(checkpoint_id)
        if self._handle is not None and self._handle.step != step:
            raise ConfigurationError(
                f"checkpoint_id {checkpoint_id!r} differs from the step staged ({self._handle.step})"
            )
        if self._refused != step:
            self._refused = None  # left by a save that stopped before its planning
        self._step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to set up: the Checkpointer is already open."""

    def storage_meta(self) -> StorageMeta | None:
        """The step, as DCP's checkpoint id."""
        step = self._handle.step if self._handle is not None else self._save_step()
        return None if step is None else StorageMeta(checkpoint_id=str(step))

    def _save_step(self) -> int | None:
        return self._step if self._step is not None else self._fixed_step

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The plan as DCP made it: lazyckpt lays out its own shards. With
        ``overwrite=False``, raises DCP's ``RuntimeError`` for a step that exists, where
        ``FileSystemWriter`` raises it."""
        if self.overwrite:
            return plan
        refused, self._refused = self._refused, None
        step = refused
        if step is None and self._handle is None:  # dcp.save: nothing staged, look now
            step = self._save_step()
            if step is not None and not self._exists(step):
                step = None
        if step is not None:
            self._step = None  # a reused writer starts afresh
            raise RuntimeError(
                f"Checkpoint already exists and self.overwrite=False. (lazyckpt step {step} "
                "is committed or in flight; delete it with checkpointer.delete(step) to save "
                "it again, or save another step)"
            )
        return plan

    def _exists(self, step: int) -> bool:
        """Whether ``step`` is committed on a tier (on every rank, when distributed: every
        rank asks at the same point of the save) or in flight."""
        core = self._core
        core.check_open()
        if core.engine.loop.in_loop_thread():
            raise ConfigurationError("dcp.save cannot run on the Checkpointer's engine thread")
        committed: list[int] = core.engine.loop.submit(core.steps_on_engine()).result()
        return step in committed or step in core.engine.steps_in_flight()

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The plans as DCP made them."""
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Complete when the step is committed on the last tier. The bytes are lazyckpt's:
        ``planner.resolve_data`` is never called, so DCP never copies or pickles them."""
        handle, self._handle = self._handle, None
        step, self._step = self._save_step(), None  # a reused writer starts afresh
        if handle is None:  # dcp.save: no stage(), the snapshot is taken here
            if step is None:
                raise ConfigurationError(
                    "dcp.save with LazyStorageWriter needs the step: pass checkpoint_id=step"
                )
            handle = self._core.snapshot(_planner_state(planner), step)
        results = [WriteResult(i.index, _item_bytes(i), handle.step) for i in plan.items]
        written: Future[list[WriteResult]] = Future()

        def fail(exc: BaseException) -> None:
            written.set_exception(exc)  # type: ignore[arg-type]  # torch's stub says T

        if handle.skipped:
            try:
                handle.wait("committed", timeout=0)  # raises SnapshotSkippedError
            except Exception as exc:  # becomes the save's outcome
                fail(exc)
            return written
        _chain(
            handle._future("committed"),
            handle,
            "committed",
            lambda: written.set_result(results),
            fail,
        )
        return written

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing to write: the step is committed, and DCP's metadata is rebuilt from
        lazyckpt's manifest at load (see the module docstring)."""


def _planner_state(planner: SavePlanner) -> Any:
    """The state dict a DCP save planner saves, nested again as the caller passed it."""
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, dict):
        raise ConfigurationError(
            f"dcp.save with LazyStorageWriter needs a planner with a state_dict attribute "
            f"(DefaultSavePlanner or a subclass); got {type(planner).__qualname__}"
        )
    mappings = getattr(planner, "mappings", None)
    if getattr(planner, "flatten_state_dict", False) and mappings:
        return unflatten_state_dict(state, mappings)
    return state


def _skeleton(manifest: Manifest, device: str, allow_pickle: bool) -> Any:
    """The saved state's structure with an empty tensor of the global shape per tensor
    (aliases share their original's) and the saved plain values."""
    placeholders: list[torch.Tensor] = []
    for meta in manifest.tensors:
        if meta.alias_of is not None:
            placeholders.append(placeholders[meta.alias_of])
            continue
        shape = meta.global_shape if meta.global_shape is not None else meta.shape
        placeholders.append(torch.empty(shape, dtype=meta.torch_dtype, device=device))
    return decode_tree(manifest.tree, placeholders, allow_pickle=allow_pickle)


class LazyStorageReader(StorageReader):
    """A DCP ``StorageReader`` over a lazyckpt Checkpointer:
    ``dcp.load(state, checkpoint_id=step, storage_reader=LazyStorageReader(ckpt))``.

    Works with DCP's default load planner, so a state sharded differently from the save
    (another world size, another FSDP mesh) loads. Each rank reads the whole of every saved
    tensor it loads into (its region is cut out afterwards); ``checkpointer.restore(into=)``
    reads only the overlapping shards, when DCP's planning is not needed.

    Args:
        checkpointer: an open :class:`~lazyckpt.Checkpointer` or
            :class:`~lazyckpt.SyncCheckpointer`.
        step: the step to load; ``None`` takes it from ``checkpoint_id``, and without one
            the latest committed step.
    """

    def __init__(self, checkpointer: AnyCheckpointer, *, step: int | None = None) -> None:
        self._core = _core_of(checkpointer)
        self._checkpointer = checkpointer  # an owner too (see LazyStorageWriter)
        self._fixed_step = None if step is None else _step_of(step)
        self._step: int | None = None  # this load's, from its checkpoint_id
        self._manifest: Manifest | None = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True when ``checkpoint_id`` names a step (an int, or decimal digits)."""
        return LazyStorageWriter.validate_checkpoint_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Start a load; ``checkpoint_id`` (if given) is its step."""
        self._manifest = None
        self._step = None if checkpoint_id is None else _step_of(checkpoint_id)

    def _run(self, coro: Any) -> Any:
        core = self._core
        core.check_open()
        if core.engine.loop.in_loop_thread():
            raise ConfigurationError("dcp.load cannot run on the Checkpointer's engine thread")
        return core.engine.loop.submit(coro).result()

    async def _read_manifest(self) -> Manifest:
        core = self._core
        step = self._step if self._step is not None else self._fixed_step
        if step is None:
            steps = await core.steps_on_engine()
            if not steps:
                raise SnapshotNotFoundError("no committed step to load: the tiers are empty")
            step = steps[-1]
        manifest, _ = await read_base_manifest(
            core.engine.tiers, step, core.engine.rank, core.engine.world_size
        )
        return manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``Metadata`` of the step, rebuilt from lazyckpt's manifest: one chunk of
        the global shape per tensor, bytes for every other value."""
        manifest: Manifest = self._run(self._read_manifest())
        self._manifest = manifest
        skeleton = _skeleton(manifest, "meta", self._core.options.allow_pickle)
        flat, mappings = flatten_state_dict(skeleton)
        described: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                size = value.size()
                described[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=value.dtype),
                    size=size,
                    chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
                )
            else:
                described[fqn] = BytesStorageMetadata()
        return Metadata(
            state_dict_metadata=described,
            planner_data=mappings,
            storage_meta=StorageMeta(checkpoint_id=str(manifest.step)),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to set up: :meth:`read_metadata` read the manifest."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan as DCP made it."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The plans as DCP made them."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Restore the step through lazyckpt (checksums verified, tier by tier fallback),
        then hand DCP each region it asked for."""
        manifest = self._manifest
        if manifest is None:
            raise ConfigurationError("read_data() before read_metadata(): use dcp.load")
        try:
            core = self._core
            core.wait_captured_blocking()  # a capture in flight may still be reading its tensors
            allow_pickle = core.options.allow_pickle
            full = _skeleton(manifest, "cpu", allow_pickle)
            self._run(core.restore_on_engine(manifest.step, full, None))
            flat, _ = flatten_state_dict(full)
            for item in plan.items:
                value = flat[item.storage_index.fqn]
                if item.type == LoadItemType.BYTE_IO:
                    buffer = io.BytesIO()
                    torch.save(value, buffer)  # made here from the decoded value, not read
                    buffer.seek(0)
                    planner.load_bytes(item, buffer)
                    continue
                region = value
                for dim, (start, length) in enumerate(
                    zip(item.storage_offsets, item.lengths, strict=True)
                ):
                    region = region.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                target.copy_(region)
                planner.commit_tensor(item, target)
        finally:
            self._step = self._manifest = None  # a reused reader starts afresh
        done: Future[None] = Future()
        done.set_result(None)
        return done
