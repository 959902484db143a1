"""Hugging Face ``transformers.Trainer``: :class:`LazyCheckpointCallback`.

::

    cb = LazyCheckpointCallback(tiers=[HostMemoryTier(1 << 30), FileTier("/ckpt")])
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.checkpoint_dir())  # None on the first run
    cb.close()

What it does, and where in the Trainer's loop:

- **When.** On the Trainer's own save schedule (``save_strategy``/``save_steps``: the
  ``should_save`` flag the Trainer sets at the end of a step or an epoch), or after every
  optimizer step with ``every_step=True``. The Trainer's own save of that step is switched
  off (``keep_trainer_save=True`` keeps it), so the checkpoint costs only a snapshot.
- **What.** Model, optimizer, learning-rate scheduler, gradient scaler, the Python / NumPy /
  torch (CPU and CUDA) RNG states and the ``TrainerState`` (its ``trainer_state.json``), the
  same pieces the Trainer writes into a ``checkpoint-N`` folder, as lazyckpt step ``N`` (the
  global step).
- **The snapshot point.** The Trainer logs and evaluates after a step's save decision, and
  resumes the RNG after it has fetched the next batches; the snapshot is taken just before
  the next step (``on_step_begin``; ``on_epoch_begin`` at an epoch boundary, where the
  Trainer restores the RNG before shuffling), so the log history is complete and the RNG is
  exactly what the next step would have used.
- **The guard.** ``on_pre_optimizer_step`` (after backward, before accelerate's wrapped
  ``optimizer.step()``) waits for pending captures, so the copy overlaps forward and backward.
- **Resume.** :meth:`LazyCheckpointCallback.checkpoint_dir` restores a step and writes it
  once as a Trainer checkpoint folder in a temporary directory (removed at the end of
  training or by :meth:`close`); ``trainer.train(resume_from_checkpoint=...)`` then resumes
  exactly as from its own checkpoint: data skipping, RNG, scheduler, callbacks' state.

A failed snapshot never stops training: it is logged (logger
``lazyckpt.integrations.huggingface``, level ERROR).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._checkpointer import SnapshotHandle, SyncCheckpointer
from .._errors import ConfigurationError, LazyCkptError, SnapshotNotFoundError
from .._tier import Tier

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lazyckpt.integrations.huggingface needs transformers and accelerate: "
        "pip install 'lazyckpt[huggingface]'"
    ) from exc

__all__ = ["LazyCheckpointCallback"]

log = logging.getLogger(__name__)

FORMAT = "lazyckpt.huggingface/1"

# the Trainer's file names in a checkpoint folder (transformers.trainer)
WEIGHTS_NAME = "pytorch_model.bin"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
SCALER_NAME = "scaler.pt"
RNG_NAME = "rng_state.pth"
TRAINER_STATE_NAME = "trainer_state.json"


def rng_state() -> dict[str, Any]:
    """The RNG states the Trainer saves, in plain data and tensors."""
    legacy: Any = np.random.get_state(legacy=True)  # a tuple: (name, keys, pos, gauss, cached)
    name, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _trainer_rng_file(state: dict[str, Any]) -> dict[str, Any]:
    """:func:`rng_state` as the Trainer's ``rng_state.pth`` holds it."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    out = {
        "python": _tuples(state["python"]),
        "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached),
        "cpu": state["cpu"],
    }
    if "cuda" in state:
        out["cuda"] = state["cuda"]
    return out


def _tuples(value: Any) -> Any:
    # random.setstate wants the nested tuples it gave; a round trip may hand back lists
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


class LazyCheckpointCallback(TrainerCallback):
    """Snapshots a ``transformers.Trainer``'s whole training state through lazyckpt.

    Args:
        tiers: the lazyckpt tier chain, fastest first (see :class:`lazyckpt.Checkpointer`).
        every_step: snapshot after every optimizer step instead of on the Trainer's save
            schedule (pair it with ``when_busy="skip"`` to drop a snapshot rather than wait).
        keep_trainer_save: also let the Trainer write its own checkpoint folder when it
            saves (needed for ``load_best_model_at_end``).
        **options: :class:`lazyckpt.Checkpointer` options. ``distributed`` defaults to
            ``False``: the main process saves, as the Trainer does.

    The tiers stay open until :meth:`close` (each snapshot is committed when ``train()``
    returns). The model's parameters, the optimizer and scheduler are those the callback
    receives; other stateful callbacks (``EarlyStoppingCallback``) keep the state the
    Trainer last recorded in ``TrainerState.stateful_callbacks``, since a callback cannot
    reach its peers.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        every_step: bool = False,
        keep_trainer_save: bool = False,
        **options: Any,
    ) -> None:
        options.setdefault("distributed", False)
        self._ckpt = SyncCheckpointer(tiers, **options)
        self.every_step = every_step
        self.keep_trainer_save = keep_trainer_save
        self._opened = False
        self._closed = False
        self._due = False
        self._handles: list[SnapshotHandle] = []
        self._newest: int | None = None
        self._resume_dirs: list[str] = []
        self._guard: Any = None  # the optimizer's step-hook handle while training

    # -- the checkpointer ------------------------------------------------------------------

    @property
    def checkpointer(self) -> SyncCheckpointer:
        """The underlying :class:`~lazyckpt.SyncCheckpointer`, opened on first use."""
        if self._closed:
            raise ConfigurationError("this LazyCheckpointCallback is closed; create a new one")
        if not self._opened:
            self._ckpt.open()
            self._opened = True
            steps = self._ckpt.steps()
            self._newest = steps[-1] if steps else None
        return self._ckpt

    def close(self) -> None:
        """Wait for every snapshot, close the tiers, remove resume folders. Idempotent."""
        if self._closed:
            return
        self._drain()
        self._remove_resume_dirs()
        self._closed = True
        if self._opened:
            try:
                self._ckpt.close()
            except LazyCkptError:
                log.exception("lazyckpt: a checkpoint failed while closing")

    def __enter__(self) -> LazyCheckpointCallback:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- resume ------------------------------------------------------------------------------

    def checkpoint_dir(self, step: int | None = None, *, dir: str | None = None) -> str | None:
        """Write lazyckpt ``step`` (default: the newest; ``None`` if there is none) as a
        Trainer checkpoint folder and return its path, for
        ``trainer.train(resume_from_checkpoint=...)``.

        The folder lives in a temporary directory (under ``dir`` if given) that is removed
        at the end of training or by :meth:`close`.

        Raises:
            SnapshotNotFoundError: ``step`` is on no tier, or is not a Trainer snapshot.
        """
        ckpt = self.checkpointer
        if step is None:
            steps = ckpt.steps()
            if not steps:
                return None
            step = steps[-1]
        state = ckpt.restore(step)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise SnapshotNotFoundError(
                f"lazyckpt step {step} was not written by LazyCheckpointCallback"
            )
        if self._newest is not None and step < self._newest:
            log.warning(
                "lazyckpt: resuming from step %d while the store holds up to step %d: "
                "snapshots of steps up to %d will be refused (steps only increase) unless "
                "the newer steps are deleted", step, self._newest, self._newest,
            )
        root = tempfile.mkdtemp(prefix="lazyckpt-resume-", dir=dir)
        self._resume_dirs.append(root)
        folder = os.path.join(root, f"checkpoint-{step}")
        os.mkdir(folder)
        torch.save(state["model"], os.path.join(folder, WEIGHTS_NAME))
        torch.save(state["optimizer"], os.path.join(folder, OPTIMIZER_NAME))
        torch.save(state["scheduler"], os.path.join(folder, SCHEDULER_NAME))
        if state["scaler"] is not None:
            torch.save(state["scaler"], os.path.join(folder, SCALER_NAME))
        torch.save(_trainer_rng_file(state["rng"]), os.path.join(folder, RNG_NAME))
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
            f.write(state["trainer_state"])
        return folder

    def _remove_resume_dirs(self) -> None:
        for root in self._resume_dirs:
            shutil.rmtree(root, ignore_errors=True)
        self._resume_dirs.clear()

    # -- TrainerCallback -------------------------------------------------------------------

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Check the arguments; open the tiers before the first step."""
        if args.load_best_model_at_end and not self.keep_trainer_save:
            raise ConfigurationError(
                "load_best_model_at_end needs the Trainer's own checkpoint folders; pass "
                "LazyCheckpointCallback(..., keep_trainer_save=True) or turn it off"
            )
        self._due = False
        if args.should_save:
            try:
                ckpt = self.checkpointer
            except LazyCkptError:
                log.exception("lazyckpt: could not open the tiers; training continues unsaved")
                return
            try:
                # the guard waits at the same point as on_pre_optimizer_step; registering
                # the optimizer tells lazyckpt which tensors only its step changes (those
                # are captured lazily; small others are copied at the snapshot)
                self._guard = ckpt.guard(kw["optimizer"])
            except LazyCkptError:
                log.exception(
                    "lazyckpt: could not guard the optimizer; on_pre_optimizer_step still "
                    "waits for captures, and small tensors are copied at each snapshot"
                )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """The step's save decision: take it over (the snapshot follows after logging and
        evaluation, at the next step's start)."""
        self._decide(args, control, always=self.every_step)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """The epoch's save decision (``save_strategy="epoch"``)."""
        self._decide(args, control, always=False)

    def _decide(self, args: TrainingArguments, control: TrainerControl, *, always: bool) -> None:
        if not args.should_save:
            return
        if control.should_save or always:
            self._due = True
            if not self.keep_trainer_save:
                control.should_save = False

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Snapshot a save due from the previous epoch's end, before the next shuffle."""
        self._snapshot_if_due(state, control, kw)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Snapshot a save due from the previous step, before this step's forward."""
        self._snapshot_if_due(state, control, kw)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """After backward, before the update: wait for pending captures."""
        if not self._opened or self._closed:
            return
        try:
            self._ckpt.wait_captured()
        except LazyCkptError:
            log.exception("lazyckpt: a checkpoint failed; training continues")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Snapshot a save due from the last step, then wait until every snapshot is
        committed (so ``train()`` returns with its checkpoints durable)."""
        self._snapshot_if_due(state, control, kw)
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self._drain()
        self._remove_resume_dirs()

    # -- snapshots -------------------------------------------------------------------------

    def _snapshot_if_due(
        self, state: TrainerState, control: TrainerControl, kw: dict[str, Any]
    ) -> None:
        if not self._due:
            return
        self._due = False
        try:
            self._snapshot(state, control, kw)
        except Exception:
            # the run goes on without this checkpoint: a failed save must never stop training
            log.exception(
                "lazyckpt: the checkpoint of step %d was NOT saved; training continues",
                state.global_step,
            )

    def _snapshot(self, state: TrainerState, control: TrainerControl, kw: dict[str, Any]) -> None:
        step = state.global_step
        ckpt = self.checkpointer
        if self._newest is not None and step <= self._newest:
            if step in ckpt.steps():
                return  # this very state is already saved (a resume at this step)
            raise ConfigurationError(
                f"global step {step} is older than step {self._newest} already in the store, "
                "and lazyckpt steps only increase; after resuming from an older step, delete "
                "the newer ones (lazyckpt gc / delete()) or use new tiers"
            )
        optimizer, scheduler, model = kw["optimizer"], kw["lr_scheduler"], kw["model"]
        trainer_state = dataclasses.asdict(state)
        # as the Trainer does before writing trainer_state.json: its control's current state
        trainer_state["stateful_callbacks"] = {
            **(trainer_state.get("stateful_callbacks") or {}),
            "TrainerControl": control.state(),
        }
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer
        snapshot = {
            "format": FORMAT,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": rng_state(),
            "trainer_state": json.dumps(trainer_state, indent=2, sort_keys=True) + "\n",
        }
        try:
            handle = ckpt.snapshot(snapshot, step=step)
        except LazyCkptError as exc:
            if getattr(exc, "step", step) == step:
                raise
            log.error("lazyckpt: an earlier checkpoint failed: %s", exc)
            handle = ckpt.snapshot(snapshot, step=step)
        if handle.skipped:
            log.warning("lazyckpt: snapshot of step %d skipped (pipeline busy)", step)
            return
        self._newest = step
        self._handles = [h for h in self._handles if not h.done()]
        self._handles.append(handle)

    def _drain(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            try:
                handle.wait("committed")
            except LazyCkptError:
                log.exception("lazyckpt: the checkpoint of step %d FAILED", handle.step)
