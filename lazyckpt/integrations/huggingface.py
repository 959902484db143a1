"""Hugging Face ``transformers.Trainer``: :class:`LazyCheckpointCallback`.

::

    cb = LazyCheckpointCallback(tiers=[HostMemoryTier(1 << 30), FileTier("/ckpt")])
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.checkpoint_dir())  # None on the first run
    cb.close()  # train() released the tiers at its end; this also covers one that raised

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
- **Resume from an earlier step.** The store may hold steps this run did not write: those of
  a run resumed from an earlier step (a rollback), or of another run on the same tiers. The
  first save that reaches such a step replaces that run's later steps, as the Trainer
  overwrites its ``checkpoint-N`` folders: the steps after the one resumed from (or from the
  saved step on, if the run did not resume through :meth:`checkpoint_dir`) are deleted,
  with a WARNING naming them, and the new state is saved. A save of the step resumed from,
  or of a step this run already saved, is taken once.

- **Metrics.** The numbers the Trainer logged for the saved step (``loss``, and the
  ``eval_*`` metrics of an evaluation at that step) go with the snapshot, so a tier can
  keep the best steps by the Trainer's ``metric_for_best_model``:
  ``FileTier(path, retention=Retention(keep_last=2, keep_best=KeepBest("eval_loss", 3)))``.

A failed snapshot never stops training: it is logged (logger
``lazyckpt.integrations.huggingface``, level ERROR).
"""

from __future__ import annotations

import contextlib
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

from .._checkpointer.facades import SyncCheckpointer
from .._checkpointer.handle import SnapshotHandle
from .._errors import ConfigurationError, LazyCkptError, SnapshotNotFoundError
from .._tiering.interface import Tier
from ._lifetime import Lifetime
from ._rollback import abandoned_steps

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

    Each ``train()`` opens the tiers and closes them at its end, once every snapshot is
    committed: the location is then free for another Checkpointer of the process, and the
    next use opens fresh copies of these tiers (taken before their first opening).

    The model's parameters, the optimizer and scheduler are those the callback receives;
    other stateful callbacks (``EarlyStoppingCallback``) keep the state the
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
        self._life = Lifetime(tiers, options)  # validates tiers and options now
        self.every_step = every_step
        self.keep_trainer_save = keep_trainer_save
        self._closed = False
        self._due = False
        self._handles: list[SnapshotHandle] = []
        self._written: set[int] = set()  # steps this run snapshotted (since on_train_begin)
        self._resumed: int | None = None  # the step checkpoint_dir last wrote for a resume
        self._resume_dirs: list[str] = []
        self._guard: Any = None  # the optimizer's step-hook handle while training

    # -- the checkpointer ------------------------------------------------------------------

    @property
    def checkpointer(self) -> SyncCheckpointer:
        """The underlying :class:`~lazyckpt.SyncCheckpointer`, opened on first use.

        The end of each ``train()`` (:meth:`on_train_end`) closes it, and the next use
        opens a new one, on fresh copies of the tiers: hold on to this object only until
        then."""
        if self._closed:
            raise ConfigurationError("this LazyCheckpointCallback is closed; create a new one")
        return self._life.open()

    def metrics(self) -> dict[str, Any]:
        """:meth:`~lazyckpt.SyncCheckpointer.metrics` of the Checkpointer open now or,
        between runs, of the one the last run closed (its snapshots, their timings, the
        failures): ``checkpointer.metrics()`` after a run would open a new one."""
        return self._life.metrics()

    def close(self) -> None:
        """Wait for every snapshot, close the tiers, remove resume folders. Idempotent;
        after it, the callback cannot be used again (each ``train()`` already releases the
        tiers at its end)."""
        if self._closed:
            return
        self._drain()
        self._remove_resume_dirs()
        self._closed = True
        try:
            self._life.close()
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
        later = [s for s in ckpt.steps() if s > step]
        if later:
            log.warning(
                "lazyckpt: resuming from step %d while the store holds later steps %s: the "
                "first save of a step up to %d deletes them (they belong to the run being "
                "abandoned) and saves the new state",
                step, later, later[-1],
            )
        self._resumed = step
        self._written = {s for s in self._written if s <= step}
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
        self._written = set()  # a new run: the steps in the store are not its own yet
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
        ckpt = None if self._closed else self._life.current
        if ckpt is None:
            return
        try:
            ckpt.wait_captured()
        except LazyCkptError:
            log.exception("lazyckpt: a checkpoint failed; training continues")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Snapshot a save due from the last step, wait until every snapshot is committed
        (so ``train()`` returns with its checkpoints durable), then close the tiers, so that
        the location is free for another Checkpointer of the process (a new callback in a
        notebook's next cell). The next use of this callback opens them again."""
        self._snapshot_if_due(state, control, kw)
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self._drain()
        self._remove_resume_dirs()
        self._resumed = None
        if self._closed:
            return
        self._life.release_at_run_end()

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
        if step in self._written:
            # the same step's save decided twice (at a step's and at the epoch's end): this
            # run saved this very state already
            log.debug("lazyckpt: step %d already saved by this run", step)
            return
        ckpt = self.checkpointer
        stored = ckpt.steps()
        if step == self._resumed and step in stored:
            log.debug("lazyckpt: step %d is the step this run resumed from", step)
            return  # the state restored from it, not changed since
        stale = self._abandoned(step, stored)
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
        if stale:
            self._retire(step, stale)
        metrics = _step_metrics(state.log_history, step)
        try:
            handle = ckpt.snapshot(snapshot, step=step, metrics=metrics)
        except LazyCkptError as exc:
            if getattr(exc, "step", step) == step:
                raise
            log.error("lazyckpt: an earlier checkpoint failed: %s", exc)
            handle = ckpt.snapshot(snapshot, step=step, metrics=metrics)
        if handle.skipped:
            log.warning("lazyckpt: snapshot of step %d skipped (pipeline busy)", step)
            return
        self._written.add(step)
        self._handles = [h for h in self._handles if not h.done()]
        self._handles.append(handle)

    def _abandoned(self, step: int, stored: list[int]) -> list[int]:
        """The stored steps a save of ``step`` replaces (:func:`abandoned_steps`)."""
        return abandoned_steps(step, stored, self._written, self._resumed)

    def _retire(self, step: int, stale: list[int]) -> None:
        """Delete ``stale``, the newest first (each deletion lets the checkpointer take that
        step number again), so that the save of ``step`` replaces them."""
        log.warning(
            "lazyckpt: the store holds step(s) %s from another run (this run resumed from "
            "step %s); deleting them so that this run's save of step %d and later ones "
            "replace them, as the Trainer overwrites its checkpoint-N folders",
            stale, self._resumed if self._resumed is not None else "no lazyckpt step", step,
        )
        ckpt = self.checkpointer
        for s in sorted(stale, reverse=True):
            with contextlib.suppress(SnapshotNotFoundError):  # already gone: retention
                ckpt.delete(s)
        self._resumed = None

    def _drain(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            try:
                handle.wait("committed")
            except LazyCkptError:
                log.exception("lazyckpt: the checkpoint of step %d FAILED", handle.step)


def _step_metrics(history: list[dict[str, Any]], step: int) -> dict[str, float] | None:
    """The finite numbers logged for ``step`` (the training loss, an evaluation's
    ``eval_*`` metrics), as a snapshot's ``metrics``; None when there are none."""
    metrics: dict[str, float] = {}
    for entry in reversed(history):
        if entry.get("step") != step:
            if metrics or (isinstance(entry.get("step"), int) and entry["step"] < step):
                break
            continue
        for name, value in entry.items():
            if name == "step" or name in metrics or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and value == value and abs(value) != float("inf"):
                metrics[name] = float(value)
    return metrics or None
