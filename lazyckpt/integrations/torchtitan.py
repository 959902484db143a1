"""lazyckpt as torchtitan's checkpoint manager.

:class:`LazyCheckpointManager` implements torchtitan's ``BaseCheckpointManager`` (0.3 line):
the trainer builds it from ``config.checkpoint`` and calls ``save(step)`` after every step,
``maybe_wait_for_staging()`` right before ``optimizers.step()``, ``load(step)`` before
training and ``close()`` at the end. It saves what torchtitan's DCP manager saves (the
model parts, optimizers, LR schedulers, dataloader and the trainer's ``train_state``) as
one lazyckpt step per save:

- ``save()`` takes a snapshot (references, no copy) and returns; the capture overlaps the
  next forward and backward, and ``maybe_wait_for_staging()`` holds the optimizer step
  until it is done. The step then flows through the tiers (a host-memory tier, then files
  under ``checkpoint.folder``) while training goes on.
- A failed save is logged and training goes on (the step is simply not committed), unless
  ``raise_save_errors`` is set.
- ``load()`` restores in place, through lazyckpt's resharding (another data-parallel size
  loads).
- Retention is the file tier's: ``keep_latest_k`` committed steps are kept.

Not supported: Hugging Face safetensors export and import (``last_save_in_hf``,
``initial_load_in_hf``); they raise :class:`~lazyckpt.ConfigurationError` at construction.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
    from torchtitan.tools.logging import logger
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        "lazyckpt.integrations.torchtitan needs torchtitan 0.3: pip install 'lazyckpt[torchtitan]'"
    ) from exc

from .._checkpointer.facades import SyncCheckpointer
from .._checkpointer.handle import SnapshotHandle
from .._errors import ConfigurationError, SnapshotFailedError
from .._tiering.interface import Tier, load_tier

__all__ = ["LazyCheckpointManager"]


class LazyCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # untyped base
    """torchtitan's checkpoint manager on lazyckpt; select it with
    ``config.checkpoint = LazyCheckpointManager.Config(enable=True, ...)``.

    The keyword arguments are the ones torchtitan's trainer passes every manager (see
    ``BaseCheckpointManager``); ``tiers`` replaces the chain built from the config (e.g. to
    add a ``ZarrTier`` on S3).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's checkpoint policy, plus lazyckpt's options."""

        host_bytes: int = 1 << 30
        """Capacity of the host-memory tier in front of the files, in bytes (0: no host
        tier; captures then stage through a private 64 MiB arena)."""

        when_busy: Literal["wait", "skip"] = "wait"
        """``"skip"``: drop a save while the previous one is still being captured or the
        host tier is full, instead of making the optimizer step wait."""

        raise_save_errors: bool = False
        """Raise a failed save at the next ``save()``/``maybe_wait_for_saving()`` instead of
        logging it and training on."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
        tiers: list[Tier] | None = None,
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        if config.last_save_in_hf or config.initial_load_in_hf:
            raise ConfigurationError(
                "LazyCheckpointManager does not export or import Hugging Face safetensors: "
                "unset checkpoint.last_save_in_hf and checkpoint.initial_load_in_hf"
            )
        self.save_future: concurrent.futures.Future[None] | None = None
        self.folder = filesystem.join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        self.keep_latest_k = config.keep_latest_k
        self.exclude_from_loading = list(config.exclude_from_loading)
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.last_save_model_only = config.last_save_model_only
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.raise_save_errors = config.raise_save_errors
        self.sd_adapter = sd_adapter

        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers})
        self.states[LR_SCHEDULER] = lr_schedulers
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ConfigurationError(
                    f"checkpoint.exclude_from_loading names {key!r}, which is not saved; "
                    f"saved: {sorted(self.states)}"
                )

        if tiers is None:
            tiers = self._default_tiers(config)
        options: dict[str, Any] = {"when_busy": config.when_busy}
        if config.host_bytes == 0:
            options["staging_bytes"] = 64 << 20
        self.checkpointer = SyncCheckpointer(tiers, **options).open()
        self._saving: SnapshotHandle | None = None
        logger.info("lazyckpt checkpointing active: saving to %s", self.folder)

    def _default_tiers(self, config: Config) -> list[Tier]:
        chain: list[Tier] = []
        if config.host_bytes:
            chain.append(load_tier("host", config.host_bytes))
        chain.append(load_tier("file", self.folder, keep_last=self.keep_latest_k or None))
        return chain

    # -- saving ---------------------------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    def _state_to_save(self, last_step: bool) -> dict[str, Any]:
        if not (last_step and self.last_save_model_only):
            return dict(self.states)
        model = self.states[MODEL].state_dict()
        if self.export_dtype != torch.float32:  # a copy, as torchtitan's export makes
            model = {k: v.to(self.export_dtype) for k, v in model.items()}
        return {MODEL: model}

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Snapshot the state at ``curr_step`` (on the save schedule) and return at once."""
        if not self._should_save(curr_step, last_step):
            return False
        if self.save_future is not None and (last_step or self.save_future.done()):
            self._wait_for_saving()  # report how the previous save ended
        try:
            handle = self.checkpointer.snapshot(self._state_to_save(last_step), step=curr_step)
        except SnapshotFailedError as exc:  # an earlier failure nobody has seen yet
            self._failed(exc)
            handle = self.checkpointer.snapshot(self._state_to_save(last_step), step=curr_step)
        if handle.skipped:
            return False
        self._saving = handle
        self.save_future = handle._future("committed")
        if last_step:  # the run ends: the last step must be durable before the trainer exits
            self.maybe_wait_for_saving()
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Block until pending captures are done (the trainer calls it before the optimizer
        step; it returns at once when no capture is running)."""
        try:
            self.checkpointer.wait_captured()
        except SnapshotFailedError as exc:
            self._failed(exc)

    def _wait_for_saving(self) -> None:
        """Block until the last save is committed on every tier (or has failed)."""
        handle, self._saving, self.save_future = self._saving, None, None
        if handle is None:
            return
        try:
            handle.wait("committed")  # through the handle, so the failure counts as seen
        except SnapshotFailedError as exc:
            self._failed(exc)

    def _failed(self, exc: SnapshotFailedError) -> None:
        if self.raise_save_errors:
            raise exc
        logger.warning("lazyckpt: a checkpoint failed, training goes on: %s", exc)

    # -- loading --------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Restore ``step`` (``-1``: the latest committed) into the live state, in place.

        With no committed step, loads ``initial_load_path`` (another lazyckpt folder) if
        set, else returns False (a fresh start)."""
        steps = self.checkpointer.steps()
        if step != -1 and step not in steps:
            raise ConfigurationError(
                f"checkpoint.load_step={step} is not committed in {self.folder}; "
                f"committed steps: {steps}"
            )
        if steps:
            target = steps[-1] if step == -1 else step
            self.checkpointer.restore(target, into=self._states_to_load(model_only=False))
            logger.info("lazyckpt: restored step %d from %s", target, self.folder)
            return True
        if not self.initial_load_path:
            logger.info("No checkpoint was found, this is a fresh start.")
            return False
        with SyncCheckpointer([load_tier("file", self.initial_load_path)]) as initial:
            into = self._states_to_load(model_only=self.initial_load_model_only)
            initial.restore(None, into=into)
        logger.info("lazyckpt: loaded the initial checkpoint %s", self.initial_load_path)
        return True

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return {MODEL: self.states[MODEL]}
        return {k: v for k, v in self.states.items() if k not in self.exclude_from_loading}

    # -- closing --------------------------------------------------------------------------

    def _close(self) -> None:
        """Drain every save (each reaches the last tier or fails) and close the tiers."""
        checkpointer = getattr(self, "checkpointer", None)
        if checkpointer is None:
            return
        try:
            checkpointer.close()
        except SnapshotFailedError as exc:
            self._failed(exc)
