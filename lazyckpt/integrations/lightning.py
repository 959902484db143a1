"""PyTorch Lightning: :class:`LazyCheckpointIO`, a ``CheckpointIO`` plugin that is also the
callback which guards the optimizer step.

::

    io = LazyCheckpointIO(tiers=[HostMemoryTier(1 << 30), FileTier("/ckpt")])
    trainer = Trainer(plugins=[io], callbacks=[io, ModelCheckpoint(every_n_train_steps=100)])
    trainer.fit(model)                                   # saves through lazyckpt
    trainer.fit(model, ckpt_path="last")                 # resumes from lazyckpt

How Lightning's calls map onto lazyckpt:

- ``save_checkpoint(checkpoint, path)`` takes a snapshot of the checkpoint dict at the step
  ``checkpoint["global_step"]`` and returns without copying tensor bytes. Once the step is
  committed on the last tier, a small JSON *pointer file* is written at ``path`` (atomically),
  so a path that exists always names a durable step: ``ModelCheckpoint``'s listing,
  ``ckpt_path="last"`` and ``best_model_path`` keep working. Two paths saved at the same
  global step (``save_last`` next to a top-k file) share one lazyckpt step.
- ``remove_checkpoint(path)`` removes the pointer and deletes the step with
  :meth:`~lazyckpt.SyncCheckpointer.delete` once no other path names it, so ``save_top_k``
  decides what is kept (the tiers' own retention must not drop a step a path still names;
  :meth:`LazyCheckpointIO.setup` checks this).
- ``load_checkpoint(path)`` reads the pointer and restores its step; a file that is not a
  pointer (an ordinary ``.ckpt``) is loaded with ``torch.load`` as Lightning would.
- Resume from an earlier step (a rollback), or a new run on tiers that hold another run's
  steps: the first save of a step the store already holds, but that this run did not write,
  replaces the other run's later steps, as Lightning overwrites a file of the same name.
  The steps after the one resumed from (or from the saved step on) are deleted, with a
  WARNING naming them; pointer files naming them are removed (a ``last*`` file is pointed
  at the step resumed from instead), then the new state is saved. Resumed through this
  plugin, no path names a step of the abandoned run after that save; resumed from a plain
  ``.ckpt`` (or not resumed), the other run's steps before it stay, with their pointers.
- As a callback, ``on_before_optimizer_step`` (after backward, before the update) waits for
  pending captures, so the copy overlaps the next forward and backward passes. Without the
  callback the plugin still saves correctly, but each save waits for its capture.
- ``teardown()`` (the end of ``fit``/``validate``/``test``) waits until every save is
  durable and its pointer written, then closes the tiers: the location is free for another
  Checkpointer of the process. The next use opens fresh copies of the tiers.

A failed save never stops training: it is logged (logger ``lazyckpt.integrations.lightning``,
level ERROR) and the path is not written.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from fsspec.implementations.local import LocalFileSystem

from .._checkpointer.facades import SyncCheckpointer
from .._checkpointer.handle import SnapshotHandle
from .._errors import ConfigurationError, LazyCkptError, SnapshotNotFoundError
from .._tiering.interface import Tier
from .._tiering.states import TierLevel
from ._lifetime import Lifetime
from ._rollback import abandoned_steps

__all__ = ["LazyCheckpointIO"]

log = logging.getLogger(__name__)

POINTER_KEY = "lazyckpt"
# A mapping whose keys lazyckpt refuses as key-path parts (ModelCheckpoint's best_k_models is
# keyed by absolute file paths) is stored as its list of items under this one key.
_ITEMS = "lazyckpt.items"
_POINTER_MAX = 4096  # a pointer file is a few dozen bytes; larger files are real checkpoints


def _frameworks() -> list[Any]:
    """The Lightning packages installed: the unified ``lightning`` and/or ``pytorch_lightning``."""
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(__import__(name, fromlist=["Trainer"]))
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "lazyckpt.integrations.lightning needs PyTorch Lightning: "
            "pip install 'lazyckpt[lightning]' (pytorch-lightning or lightning)"
        )
    return found


_PL = _frameworks()

if TYPE_CHECKING:
    from lightning_fabric.plugins import CheckpointIO as _CheckpointIO
    from pytorch_lightning.callbacks import Callback as _Callback

    class _Bases(_CheckpointIO, _Callback):  # type: ignore[misc]  # both define teardown
        pass
else:
    # Both packages may be installed side by side with separate class trees: the object must
    # pass either Trainer's isinstance checks, so it derives from every installed base.
    _Bases = type(
        "_LightningBases",
        tuple(pl.plugins.CheckpointIO for pl in _PL) + tuple(pl.Callback for pl in _PL),
        {},
    )


def _keeps_best(tier: Tier, cb: Any) -> bool:
    """Whether ``tier``'s retention keeps the steps ``cb`` (a ModelCheckpoint with a
    monitor) keeps: the best ``save_top_k`` by its monitor, in its mode."""
    best = tier.retention.keep_best
    return (
        best is not None
        and best.metric == cb.monitor
        and best.n >= cb.save_top_k
        and best.mode == cb.mode
    )


def _scalar_metrics(trainer: Any) -> dict[str, float] | None:
    """The trainer's callback metrics that are finite scalars, as floats (what a
    ``ModelCheckpoint`` monitors), for the snapshot's manifest; None without a trainer."""
    found = getattr(trainer, "callback_metrics", None)
    if not found:
        return None
    metrics: dict[str, float] = {}
    for name, value in found.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        number = float(value)
        if number == number and abs(number) != float("inf") and isinstance(name, str) and name:
            metrics[name] = number
    return metrics or None


def _isinstance_any(obj: object, attr: str) -> bool:
    """``isinstance`` against a class of that name in any installed Lightning package."""
    classes = []
    for pl in _PL:
        for module in (pl, pl.callbacks, pl.plugins, pl.strategies):
            cls = getattr(module, attr, None)
            if isinstance(cls, type):
                classes.append(cls)
    return isinstance(obj, tuple(classes))


def read_pointer(path: str) -> int | None:
    """The lazyckpt step a pointer file names, or None if ``path`` is not a pointer file."""
    fs = _filesystem(path)
    if not fs.exists(path) or fs.isdir(path) or fs.size(path) > _POINTER_MAX:
        return None
    with fs.open(path, "rb") as f:
        raw = f.read()
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get(POINTER_KEY), dict):
        return None
    step = doc[POINTER_KEY].get("step")
    if type(step) is not int:
        raise SnapshotNotFoundError(f"pointer file {path!r} names no valid step: {doc!r}")
    return step


def _filesystem(path: str) -> Any:
    try:
        from lightning.fabric.utilities.cloud_io import get_filesystem
    except ImportError:
        from lightning_fabric.utilities.cloud_io import get_filesystem
    return get_filesystem(path)


def _write_pointer(path: str, step: int) -> None:
    """Write the pointer atomically: a temporary file, flushed, then renamed over ``path``."""
    fs = _filesystem(path)
    parent = os.path.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    body = json.dumps({POINTER_KEY: {"step": step, "format": 1}}).encode()
    tmp = f"{path}.lazyckpt-tmp"
    if isinstance(fs, LocalFileSystem):
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with contextlib.suppress(OSError):  # some file systems cannot fsync a directory
            fd = os.open(parent or ".", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    else:
        with fs.open(tmp, "wb") as f:
            f.write(body)
        fs.mv(tmp, path)


def _plain_key(k: str) -> bool:
    """Whether lazyckpt takes ``k`` as a part of a tensor's key path as it is."""
    return k not in ("", ".", "..", _ITEMS) and not k.startswith("/") and len(k) <= 1024 and (
        k.isprintable()
    )


def _encode_keys(obj: Any) -> Any:
    """``obj`` with every mapping keyed by something other than plain relative names (and
    holding containers) turned into ``{_ITEMS: [[key, value], ...]}``; unchanged parts are
    shared, not copied."""
    if isinstance(obj, dict):
        items = [(k, _encode_keys(v)) for k, v in obj.items()]
        if any(isinstance(k, str) and not _plain_key(k) for k, _ in items):
            return {_ITEMS: [[k, v] for k, v in items]}
        if all(v is obj[k] for k, v in items):
            return obj
        return dict(items)
    if isinstance(obj, (list, tuple)):
        enc = [_encode_keys(v) for v in obj]
        if all(a is b for a, b in zip(enc, obj, strict=True)):
            return obj
        return type(obj)(enc) if isinstance(obj, list) else tuple(enc)
    return obj


def _decode_keys(obj: Any) -> Any:
    """Inverse of :func:`_encode_keys`."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _ITEMS in obj:
            return {k: _decode_keys(v) for k, v in obj[_ITEMS]}
        return {k: _decode_keys(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_keys(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_decode_keys(v) for v in obj)
    return obj


class LazyCheckpointIO(_Bases):
    """A Lightning ``CheckpointIO`` that saves through lazyckpt, and the callback that waits
    for its captures before each optimizer step.

    Pass it both as a plugin and as a callback: ``Trainer(plugins=[io], callbacks=[io])``.
    Passed only as a callback it installs itself as the strategy's ``CheckpointIO`` in
    :meth:`setup`; passed only as a plugin it saves correctly but waits for each capture
    inside ``save_checkpoint`` (no overlap with training), and warns once.

    Works with strategies that save through their ``CheckpointIO`` on rank 0 (single device,
    DDP). FSDP, ModelParallel and DeepSpeed strategies bypass ``CheckpointIO``; use the DCP
    backend there.

    Args:
        tiers: the lazyckpt tier chain, fastest first (see :class:`lazyckpt.Checkpointer`).
            Each ``fit``/``validate``/``test`` opens them at its first use and closes them
            at its end (Lightning's teardown), once every save is durable: the location is
            then free for another Checkpointer of the process, and the next run opens fresh
            copies of these tiers (taken before their first opening). Closing the object
            is needed only after a save outside a run.
        **options: :class:`lazyckpt.Checkpointer` options. ``distributed`` defaults to
            ``False``: Lightning saves on global rank 0 only.
    """

    def __init__(self, tiers: Sequence[Tier], **options: Any) -> None:
        super().__init__()
        options.setdefault("distributed", False)
        self._life = Lifetime(tiers, options)  # validates tiers and options now
        self._tiers = self._life.tiers
        self._closed = False
        self._lock = threading.Lock()
        self._paths: dict[str, int] = {}  # path -> step, for paths saved or read by this object
        self._pending: dict[int, SnapshotHandle] = {}  # step -> handle, not yet committed
        self._written: set[int] = set()  # steps this run snapshotted (since on_train_start)
        self._resumed: int | None = None  # the step load_checkpoint last restored
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._jobs: list[concurrent.futures.Future[None]] = []
        self._guarded = False  # registered as a callback: its hook guards the optimizer step
        # the trainer whose callback metrics go with each save (retention by the best)
        self._metrics_of: Any = None
        self._training = False  # between on_train_start and on_train_end
        self._guards: list[Any] = []  # the optimizers' step-hook handles while training
        self._warned_unguarded = False
        self._fallback: Any = None

    # -- the checkpointer ------------------------------------------------------------------

    @property
    def checkpointer(self) -> SyncCheckpointer:
        """The underlying :class:`~lazyckpt.SyncCheckpointer`, opened on first use.

        Each ``fit``/``validate``/``test`` closes it at its end (:meth:`teardown`), and the
        next use opens a new one, on fresh copies of the tiers: hold on to this object
        only within a run."""
        if self._closed:
            raise ConfigurationError("this LazyCheckpointIO is closed; create a new one")
        return self._life.open()

    def metrics(self) -> dict[str, Any]:
        """:meth:`~lazyckpt.SyncCheckpointer.metrics` of the Checkpointer open now or,
        between runs, of the one the last run closed (its snapshots, their timings, the
        failures): ``checkpointer.metrics()`` after a run would open a new one."""
        return self._life.metrics()

    def __enter__(self) -> LazyCheckpointIO:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for every save, write its pointer, and close the tiers. Idempotent; after
        it, the object cannot be used again (each ``fit`` already releases the tiers at its
        end, so closing is needed only after a save outside ``fit``)."""
        if self._closed:
            return
        self._drain()
        self._closed = True
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        try:
            self._life.close()
        except LazyCkptError:
            log.exception("lazyckpt: a checkpoint failed while closing")

    # -- CheckpointIO ----------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Snapshot ``checkpoint`` at step ``checkpoint["global_step"]``; ``path`` appears
        (as a pointer file) once the step is durable. Never raises for a failed save."""
        if storage_options is not None:
            raise TypeError(
                "LazyCheckpointIO.save_checkpoint takes no storage_options (got "
                f"{storage_options!r}); storage is configured by its tiers"
            )
        path = os.fspath(path)
        try:
            self._save(checkpoint, path)
        except Exception:
            # the run goes on without this checkpoint: a failed save must never stop training
            log.exception("lazyckpt: checkpoint %r was NOT saved; training continues", path)

    def _save(self, checkpoint: dict[str, Any], path: str) -> None:
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ConfigurationError(
                f"checkpoint for {path!r} has no non-negative int 'global_step' ({step!r}); "
                "LazyCheckpointIO maps paths to steps by the Trainer's global step"
            )
        ckpt = self.checkpointer
        with self._lock:
            mine = step in self._written
            pending = self._pending.get(step)
        if mine:
            # the same global step again (save_last next to a top-k file): same state, one step
            self._track(path, step, pending)
            return
        stored = ckpt.steps()
        if step == self._resumed and step in stored:
            # the state just restored from that step, saved again under another name
            self._track(path, step, None)
            return
        stale = self._abandoned(step, stored)
        state = _encode_keys(checkpoint)
        if stale:
            self._retire(step, stale, path)
        metrics = _scalar_metrics(self._metrics_of)
        try:
            handle = ckpt.snapshot(state, step=step, metrics=metrics)
        except LazyCkptError as exc:
            if getattr(exc, "step", step) == step:
                raise
            # an earlier snapshot's failure surfaced here; report it and take this one
            log.error("lazyckpt: an earlier checkpoint failed: %s", exc)
            handle = ckpt.snapshot(state, step=step, metrics=metrics)
        if handle.skipped:
            log.warning("lazyckpt: checkpoint %r skipped (pipeline busy, when_busy='skip')", path)
            return
        with self._lock:
            self._written.add(step)
        if not (self._guarded and self._training):
            # no optimizer-step hook will wait for this capture (outside fit, or no
            # callback): wait for it here so the caller may change the tensors at once
            if not self._guarded and not self._warned_unguarded:
                self._warned_unguarded = True
                warnings.warn(
                    "LazyCheckpointIO is not registered as a callback, so each save waits "
                    "for its capture; pass it as Trainer(plugins=[io], callbacks=[io]) to "
                    "overlap the capture with training",
                    UserWarning,
                    stacklevel=3,
                )
            handle.wait("captured")
        with self._lock:
            self._pending[step] = handle
        self._track(path, step, handle)

    def _abandoned(self, step: int, stored: list[int]) -> list[int]:
        """The stored steps a save of ``step`` replaces (:func:`abandoned_steps`)."""
        with self._lock:
            written = set(self._written)
        return abandoned_steps(step, stored, written, self._resumed)

    def _retire(self, step: int, stale: list[int], path: str) -> None:
        """Delete the steps ``stale`` of another run, the newest first (each deletion lets
        the checkpointer take that step number again), and the pointers naming them, so
        that the save of ``step`` replaces them."""
        resumed = self._resumed
        log.warning(
            "lazyckpt: the store holds step(s) %s from another run (this run resumed from "
            "step %s); deleting them and the pointer files naming them, so that this run's "
            "checkpoint %r (step %d) and later ones replace them, as Lightning overwrites "
            "files of the same name",
            stale, resumed if resumed is not None else "no lazyckpt step", path, step,
        )
        ckpt = self.checkpointer
        gone = set(stale)
        keep = resumed if resumed is not None and resumed in ckpt.steps() else None
        with self._lock:
            # first the pointers (a crash between leaves steps no path names, not paths
            # naming nothing), under the lock the writer thread writes pointers under
            directories = {os.path.dirname(p) for p in self._paths} | {os.path.dirname(path)}
            for p in [p for p, s in self._paths.items() if s in gone]:
                del self._paths[p]
            for directory in sorted(directories):
                self._drop_pointers(directory, gone, keep)
        for s in sorted(stale, reverse=True):
            with contextlib.suppress(SnapshotNotFoundError):  # already gone: retention
                ckpt.delete(s)
        self._resumed = None

    @staticmethod
    def _drop_pointers(directory: str, gone: set[int], keep: int | None) -> None:
        """Remove the pointer files in ``directory`` that name a step in ``gone``; a
        ``last*`` file is pointed at ``keep`` instead if given (what ``ckpt_path="last"``
        resumes from until the new run's first save lands: the step it rolled back to)."""
        where = directory or "."
        fs = _filesystem(where)
        if not fs.isdir(where):
            return
        for entry in fs.ls(where, detail=False):
            try:
                named = read_pointer(entry)
            except (OSError, LazyCkptError):
                continue
            if named not in gone:
                continue
            if keep is not None and os.path.basename(entry).startswith("last"):
                _write_pointer(entry, keep)
            else:
                fs.rm(entry)

    def _track(self, path: str, step: int, handle: SnapshotHandle | None) -> None:
        """Map ``path`` to ``step`` and write its pointer once the step is committed.

        The steps ``path`` named before (in this object's map, and in the pointer file on
        disk, perhaps from an earlier run) are released only once the new pointer is down:
        until then the file on disk still names them, and a crash must leave it loadable."""
        with self._lock:
            previous = {self._paths.get(path)}
        with contextlib.suppress(OSError, LazyCkptError):
            previous.add(read_pointer(path))
        olds = sorted(s for s in previous if s is not None and s != step)
        with self._lock:
            self._paths[path] = step
            if self._writer is None:
                self._writer = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="lazyckpt-lightning"
                )
            self._jobs = [j for j in self._jobs if not j.done()]
            self._jobs.append(self._writer.submit(self._commit_path, path, step, handle, olds))

    def _commit_path(
        self, path: str, step: int, handle: SnapshotHandle | None, olds: list[int]
    ) -> None:
        """Writer thread: wait for ``step`` to be durable, then write ``path``'s pointer,
        then release the steps ``olds`` the path named before (a failed save keeps them:
        the pointer on disk still names one)."""
        try:
            if handle is not None:
                handle.wait("committed")
        except Exception:
            log.exception("lazyckpt: checkpoint %r (step %d) FAILED; training continues", path, step)
            with self._lock:
                self._pending.pop(step, None)
                if self._paths.get(path) == step:
                    del self._paths[path]
            return
        try:
            with self._lock:
                self._pending.pop(step, None)
                # under the lock, so that remove_checkpoint sees either no pointer and no
                # mapping, or both (and removes the file)
                wanted = self._paths.get(path) == step
                if wanted:
                    _write_pointer(path, step)
            if not wanted:
                # removed (or remapped) while in flight: delete it now that it landed
                self._release(step, os.path.dirname(path))
            for old in olds:  # each kept while any pointer file on disk still names it
                self._release(old, os.path.dirname(path))
        except Exception:
            log.exception("lazyckpt: could not write the pointer %r to step %d", path, step)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Restore the step ``path`` points to (tensors on ``map_location``, default CPU).

        A file that is not a lazyckpt pointer is loaded with Lightning's ``torch.load``.

        Raises:
            SnapshotNotFoundError: the step the pointer names is on no tier.
        """
        path = os.fspath(path)
        step = read_pointer(path)
        if step is None:
            if self._fallback is None:
                self._fallback = _PL[0].plugins.TorchCheckpointIO()
            loaded: dict[str, Any] = self._fallback.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
            return loaded
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        try:
            state = self.checkpointer.restore(step, map_location=device)
        except SnapshotNotFoundError as exc:
            raise SnapshotNotFoundError(
                f"{path!r} points to lazyckpt step {step}, which no tier holds ({exc}); "
                "was it deleted by a tier's retention or another run?"
            ) from exc
        with self._lock:
            self._paths.setdefault(path, step)
            self._resumed = step
        later = [s for s in self.checkpointer.steps() if s > step]
        if later:
            log.warning(
                "lazyckpt: loading step %d while the store holds later steps %s: if training "
                "resumes from it, the first save of a step up to %d deletes them (they belong "
                "to the run being abandoned) and saves the new state",
                step, later, later[-1],
            )
        if not isinstance(state, dict):
            raise SnapshotNotFoundError(f"step {step} ({path!r}) is not a Lightning checkpoint")
        decoded: dict[str, Any] = _decode_keys(state)
        return decoded

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` and delete its step once no other path names it."""
        path = os.fspath(path)
        try:
            with self._lock:
                step = self._paths.pop(path, None)
            fs = _filesystem(path)
            if step is None:
                step = read_pointer(path)
            if fs.exists(path):
                fs.rm(path)
            if step is not None:
                self._release(step, os.path.dirname(path))
        except Exception:
            log.exception("lazyckpt: could not remove checkpoint %r; training continues", path)

    def _release(self, step: int, directory: str) -> None:
        """Delete ``step`` if no path names it any more and it is not in flight; pointers
        from earlier runs (not in this object's map) are looked for in ``directory``."""
        with self._lock:
            if step in self._paths.values() or step in self._pending:
                return
        if self._named_in(directory, step):
            return
        # already gone is fine: a tier's retention, or another path's removal
        with contextlib.suppress(SnapshotNotFoundError):
            self.checkpointer.delete(step)

    def _named_in(self, directory: str, step: int) -> bool:
        """Whether a pointer file in ``directory`` names ``step``: one from an earlier run,
        or one of this object's whose new step has not committed yet (the file on disk is
        what a restarted job loads, so it counts until it is overwritten)."""
        where = directory or "."
        fs = _filesystem(where)
        if not fs.isdir(where):
            return False
        for entry in fs.ls(where, detail=False):
            with contextlib.suppress(OSError, LazyCkptError):
                if read_pointer(entry) == step:
                    return True
        return False

    def teardown(self, *_args: Any, **_kwargs: Any) -> None:
        """End of ``fit``/``validate``/``test`` (called as the plugin's ``teardown()`` and
        as the callback's ``teardown(trainer, pl_module, stage)``): wait for every pending
        save and its pointer, then close the tiers, so that the location is free for
        another Checkpointer (a new ``LazyCheckpointIO`` in the next cell of a notebook).
        The next use of this object opens them again (:attr:`checkpointer`)."""
        self._drain()
        if not self._guarded:
            # no on_train_start tells a plugin alone where a run begins: the next save may
            # be a new run's, so the steps in the store are no longer this run's own
            with self._lock:
                self._written = set()
        if self._closed:
            return
        self._life.release_at_run_end()

    def _drain(self) -> None:
        while True:
            with self._lock:
                jobs = [j for j in self._jobs if not j.done()]
                self._jobs = jobs
            if not jobs:
                return
            concurrent.futures.wait(jobs)

    # -- Callback --------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Install this object as the strategy's ``CheckpointIO`` if it is not, and check
        that the tiers' retention cannot drop a step a ``ModelCheckpoint`` still keeps."""
        strategy = trainer.strategy
        if any(
            _isinstance_any(strategy, name)
            for name in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy")
        ):
            raise ConfigurationError(
                f"{type(strategy).__name__} saves without its CheckpointIO, so "
                "LazyCheckpointIO would never be called; use lazyckpt's DCP backend with it"
            )
        io = strategy.checkpoint_io
        if io is not self:
            if type(io).__name__ != "TorchCheckpointIO":
                raise ConfigurationError(
                    f"the strategy already has a {type(io).__name__} as its CheckpointIO; "
                    "pass LazyCheckpointIO as the only CheckpointIO plugin"
                )
            strategy.checkpoint_io = self
        self._guarded = True
        self._metrics_of = trainer
        self._check_retention(trainer)
        if trainer.is_global_zero and stage == "fit":
            # open now (arena allocated and pre-faulted, tiers opened) rather than inside
            # the first save; other ranks only load, and open when they do
            _ = self.checkpointer

    def _check_retention(self, trainer: Any) -> None:
        """Refuse tiers whose retention would delete a step a ``ModelCheckpoint`` keeps.

        A tier keeping every step leaves the deleting to ModelCheckpoint (it removes its
        files, and this CheckpointIO the steps no file names). Where every durable tier
        has retention, the tiers must keep what the callbacks keep: the last k steps for
        ``save_top_k`` by recency, and for ``monitor=`` the best by that metric, which a
        tier keeps with ``Retention(keep_best=KeepBest(monitor, top_k, mode))`` (each
        save carries the trainer's scalar callback metrics, so lazyckpt judges the steps
        by the same numbers)."""
        durable = [t for t in self._tiers if t.level != TierLevel.HOST]
        if not durable or any(not t.retention.describe() for t in durable):
            return  # some tier keeps every step: ModelCheckpoint alone decides what goes
        needed = 0
        for cb in trainer.checkpoint_callbacks:
            if not _isinstance_any(cb, "ModelCheckpoint") or cb.save_top_k == 0:
                needed += int(bool(getattr(cb, "save_last", False)))
                continue
            if cb.monitor is not None and cb.save_top_k > 0:
                lacking = [t.name for t in durable if not _keeps_best(t, cb)]
                if lacking:
                    raise ConfigurationError(
                        f"ModelCheckpoint(monitor={cb.monitor!r}, save_top_k={cb.save_top_k}, "
                        f"mode={cb.mode!r}) keeps the best steps by {cb.monitor!r}, but the "
                        f"retention of tier(s) {lacking} may delete them; give them "
                        f"Retention(keep_best=KeepBest({cb.monitor!r}, {cb.save_top_k}, "
                        f"{cb.mode!r})) (with keep_last for the newest), or no retention "
                        "and let ModelCheckpoint delete"
                    )
                needed += int(bool(cb.save_last))
                continue
            if cb.save_top_k < 0:
                raise ConfigurationError(
                    f"ModelCheckpoint(save_top_k={cb.save_top_k}) keeps every step, but every "
                    "durable tier has retention that would delete them; give the last tier "
                    "no retention"
                )
            needed += cb.save_top_k + int(bool(cb.save_last))
        recency = [t.retention.keep_last for t in durable if t.retention.keep_last is not None]
        if not recency:
            return  # no tier deletes by recency
        kept = max(recency)
        if needed > kept:
            raise ConfigurationError(
                f"the ModelCheckpoint callbacks keep up to {needed} checkpoints but the tiers "
                f"keep at most the last {kept} steps; raise keep_last to at least {needed} or "
                "drop it and let ModelCheckpoint delete"
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """From here on the optimizer-step hook waits for captures. The optimizers are
        also guarded (:meth:`~lazyckpt.SyncCheckpointer.guard`, waiting after Lightning's
        closure, as the hook does), which tells lazyckpt which tensors only an optimizer
        step changes: those are captured lazily, small others are copied at the save."""
        self._training = True
        with self._lock:
            self._written = set()  # a new run: the steps in the store are not its own yet
        ckpt = None if self._closed else self._life.current
        if ckpt is not None:
            for opt in trainer.optimizers:
                self._guards.append(ckpt.guard(opt))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Saves after training (``trainer.save_checkpoint`` by hand) wait for their capture."""
        self._end_training()

    def _end_training(self) -> None:
        self._training = False
        for handle in self._guards:
            handle.remove()
        self._guards.clear()
        self._drain()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """After backward, before the update: wait for pending captures of the parameters
        and optimizer state, which the update is about to change."""
        ckpt = None if self._closed else self._life.current
        if ckpt is None:
            return
        try:
            ckpt.wait_captured()
        except LazyCkptError:
            log.exception("lazyckpt: a checkpoint failed; training continues")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Training failed: still let the saves already taken reach their tiers."""
        self._end_training()
