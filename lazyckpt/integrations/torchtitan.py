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

Hugging Face checkpoints, as torchtitan's own manager writes and reads them, through the
model's state-dict adapter (``sd_adapter``) and the safetensors package:

- ``last_save_in_hf``: the last step saves the model only, in ``export_dtype``, converted to
  Hugging Face names by ``sd_adapter.to_hf``, as sharded safetensors files with
  ``model.safetensors.index.json`` in ``<checkpoint.folder>/hf/step-<N>/``; add the model's
  ``config.json`` and ``transformers``' ``from_pretrained`` loads it. The files follow the
  adapter's ``fqn_to_index_mapping`` (the layout of ``model.hf_assets_path``'s checkpoint)
  when it has one, else hold up to ``hf_max_shard_bytes`` each. Distributed tensors are
  gathered one file at a time, and the ranks take turns writing the files.
- ``initial_load_in_hf``: with no committed step in the folder, the model's weights are
  loaded from the Hugging Face directory ``initial_load_path`` (else the adapter's
  ``hf_assets_path``), converted by ``sd_adapter.from_hf``, each distributed tensor onto its
  live layout. Every rank reads the tensors it needs whole, into host memory.

Not supported: ``initial_load_in_hf_quantized``, and the Hugging Face options with pipeline
parallelism (ranks holding different parts of the model); they raise
:class:`~lazyckpt.ConfigurationError` at construction.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

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
from .._errors import ConfigurationError, SnapshotFailedError, StateMismatchError
from .._tiering.interface import Tier, load_tier
from ..cli._formats import (
    DEFAULT_MAX_SHARD_BYTES,
    HF_INDEX,
    HF_SHARD,
    index_document,
    plan_shards,
    shard_file_names,
)

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

        cadence: dict[str, int] = field(default_factory=dict)
        """Which saves each tier of the chain takes, by tier name: ``{"pfs": 100}``
        writes every 100th step there (``lazyckpt.Cadence(every=100)``) while the tiers
        not named take every save ``interval`` schedules; the step of a preemption, of
        the last save and of ``close()`` also goes to a tier that skipped it (an
        emergency copy). With the default chain (host memory, then the folder) the folder
        is the first durable tier and takes every save; name tiers of a chain passed as
        ``tiers=``."""

        hf_max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
        """With ``last_save_in_hf``: the most tensor data one safetensors file holds (a
        larger tensor gets a file of its own), unless the state-dict adapter's
        ``fqn_to_index_mapping`` says which file each tensor goes in."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            if self.hf_max_shard_bytes < 1:
                raise ConfigurationError(
                    f"checkpoint.hf_max_shard_bytes must be at least 1 byte, not "
                    f"{self.hf_max_shard_bytes}"
                )

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
        _check_hf_options(config, sd_adapter)
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
        self.last_save_in_hf = config.last_save_in_hf
        self.initial_load_in_hf = config.initial_load_in_hf
        self.hf_max_shard_bytes = config.hf_max_shard_bytes

        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers})
        self.states[LR_SCHEDULER] = lr_schedulers
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        if self.last_save_in_hf or self.initial_load_in_hf:
            _check_same_model_everywhere(self.states[MODEL].state_dict())
        for key in self.exclude_from_loading:
            if key not in self.states:
                raise ConfigurationError(
                    f"checkpoint.exclude_from_loading names {key!r}, which is not saved; "
                    f"saved: {sorted(self.states)}"
                )

        if tiers is None:
            tiers = self._default_tiers(config)
        options: dict[str, Any] = {"when_busy": config.when_busy}
        if config.cadence:
            options["cadence"] = dict(config.cadence)
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
        return {MODEL: self._model_in_export_dtype()}

    def _model_in_export_dtype(self) -> dict[str, Any]:
        """The model's state dict, each floating-point tensor in ``export_dtype`` (a copy,
        as torchtitan's export makes; integer buffers stay as they are)."""
        return {
            k: v.to(self.export_dtype)
            if isinstance(v, torch.Tensor)
            and v.is_floating_point()
            and v.dtype != self.export_dtype
            else v
            for k, v in self.states[MODEL].state_dict().items()
        }

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Snapshot the state at ``curr_step`` (on the save schedule) and return at once."""
        if not self._should_save(curr_step, last_step):
            return False
        if self.save_future is not None and (last_step or self.save_future.done()):
            self._wait_for_saving()  # report how the previous save ended
        if last_step and self.last_save_in_hf:
            self._save_hf(curr_step)
            return True
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

    def _save_hf(self, curr_step: int) -> None:
        """The last step, model only, as a Hugging Face checkpoint directory (synchronous,
        as torchtitan's last save is)."""
        directory = Path(self.folder) / "hf" / f"step-{curr_step}"
        state = self.sd_adapter.to_hf(self._model_in_export_dtype())
        files = _save_hf_checkpoint(
            state,
            directory,
            file_of=getattr(self.sd_adapter, "fqn_to_index_mapping", None),
            max_shard_bytes=self.hf_max_shard_bytes,
        )
        logger.info(
            "lazyckpt: saved the model of step %d in Hugging Face format to %s (%d files)",
            curr_step,
            directory,
            files,
        )

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

        With no committed step, loads the model from a Hugging Face checkpoint directory
        with ``initial_load_in_hf``, else ``initial_load_path`` (another lazyckpt folder) if
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
        if self.initial_load_in_hf:
            path = self.initial_load_path or self.sd_adapter.hf_assets_path
            _load_hf_checkpoint(self.states[MODEL], self.sd_adapter, path)
            logger.info("lazyckpt: loaded the model from the Hugging Face checkpoint %s", path)
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


# -- Hugging Face checkpoints ---------------------------------------------------------------


def _check_hf_options(config: LazyCheckpointManager.Config, sd_adapter: Any) -> None:
    """What the Hugging Face options need, checked before anything is built."""
    if config.initial_load_in_hf_quantized:
        raise ConfigurationError(
            "LazyCheckpointManager does not load quantized Hugging Face checkpoints: unset "
            "checkpoint.initial_load_in_hf_quantized"
        )
    wanted = [
        f"checkpoint.{name}"
        for name in ("last_save_in_hf", "initial_load_in_hf")
        if getattr(config, name)
    ]
    if wanted and sd_adapter is None:
        raise ConfigurationError(
            f"{' and '.join(wanted)}: the model's weights are converted by its state-dict "
            "adapter (the model spec's state_dict_adapter), and this model has none"
        )
    if config.initial_load_in_hf and not (
        config.initial_load_path or getattr(sd_adapter, "hf_assets_path", None)
    ):
        raise ConfigurationError(
            "checkpoint.initial_load_in_hf loads the directory checkpoint.initial_load_path, "
            "else the model's hf_assets_path: set one"
        )


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_same_model_everywhere(model: Mapping[str, Any]) -> None:
    """Every rank must hold the same model keys (no pipeline parallelism): the Hugging Face
    files are planned alike on every rank, and each tensor gathered by all of them."""
    _, world = _rank_world()
    if world == 1:
        return
    keys = sorted(model)
    every: list[list[str] | None] = [None] * world
    dist.all_gather_object(every, keys)
    if any(other != keys for other in every):
        raise ConfigurationError(
            "checkpoint.last_save_in_hf and checkpoint.initial_load_in_hf need every rank to "
            "hold the whole model's keys (not pipeline parallelism); the ranks' model parts "
            "differ"
        )


def _shard_groups(
    keys: list[str], sizes: list[int], file_of: Mapping[str, int] | None, max_bytes: int
) -> list[list[int]]:
    """Which tensors go in which file: as ``file_of`` (a file number per key, from the
    original checkpoint's index) says when it names every key, else by size."""
    if file_of and all(k in file_of for k in keys):
        numbers = sorted({file_of[k] for k in keys})
        groups: list[list[int]] = [[] for _ in numbers]
        position = {n: i for i, n in enumerate(numbers)}
        for i, key in enumerate(keys):
            groups[position[file_of[key]]].append(i)
        return groups
    return plan_shards(sizes, max_bytes)


def _save_hf_checkpoint(
    state: Mapping[str, Any],
    directory: Path,
    *,
    file_of: Mapping[str, int] | None,
    max_shard_bytes: int,
) -> int:
    """Write ``state`` (Hugging Face names: tensors or DTensors) as sharded safetensors files
    ``model-0000K-of-0000N.safetensors`` and ``model.safetensors.index.json`` in
    ``directory``, called by every rank alike. A file's distributed tensors are gathered
    whole by every rank, and rank ``K % world`` writes it; rank 0 writes the index once every
    file is in place and removes shard files of an earlier write the index does not name.
    Returns the number of files."""
    rank, world = _rank_world()
    keys = list(state)
    values = []
    for key in keys:
        value = state[key]
        if not isinstance(value, torch.Tensor):
            raise ConfigurationError(
                f"the state-dict adapter's to_hf gave {key!r} a {type(value).__name__}, not "
                "a tensor; a safetensors file holds tensors only"
            )
        values.append(value)
    sizes = [v.numel() * v.element_size() for v in values]  # a DTensor's: global
    groups = _shard_groups(keys, sizes, file_of, max_shard_bytes)
    names = shard_file_names(len(groups))
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for number, (group, name) in enumerate(zip(groups, names, strict=True)):
        writer = number % world
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for i in group:
            weight_map[keys[i]] = name
            value = values[i]
            if isinstance(value, DTensor):
                value = value.full_tensor()  # a collective: every rank, in the same order
            if rank != writer:
                continue
            value = value.detach().to("cpu").contiguous()
            storage = value.untyped_storage().data_ptr()
            if storage in storages:  # safetensors refuses tensors that share memory
                value = value.clone()
            storages.add(storage)
            tensors[keys[i]] = value
        if rank == writer:
            partial = directory / f".{name}.partial"
            safetensors.torch.save_file(tensors, str(partial), metadata={"format": "pt"})
            os.replace(partial, directory / name)
        del tensors
    if world > 1:
        dist.barrier()
    if rank == 0:
        total = sum(sizes)
        partial = directory / f".{HF_INDEX}.partial"
        partial.write_bytes(index_document(weight_map, total))
        os.replace(partial, directory / HF_INDEX)
        for stale in directory.iterdir():
            if HF_SHARD.match(stale.name) and stale.name not in names:
                stale.unlink()
    if world > 1:
        dist.barrier()
    return len(names)


def _hf_files(directory: Path) -> dict[str, Path]:
    """Each tensor of a Hugging Face checkpoint directory, and the file holding it: as its
    ``model.safetensors.index.json`` says, else every ``*.safetensors`` file's own keys."""
    index = directory / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigurationError(f"{index} is not a safetensors index: {exc}") from exc
        return {key: directory / name for key, name in weight_map.items()}
    found: dict[str, Path] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safetensors.safe_open(str(file), "pt") as f:
            found.update((key, file) for key in f.keys())  # noqa: SIM118 - no __iter__
    if not found:
        raise ConfigurationError(
            f"{directory} holds no safetensors files, so it is no Hugging Face checkpoint"
        )
    return found


def _wanted_hf_names(sd_adapter: Any, model: Mapping[str, Any]) -> dict[str, Any]:
    """The Hugging Face names (and shapes) the model's weights are loaded from: ``to_hf`` of
    the model's state dict, worked out on meta tensors (no copy, no collective) where the
    adapter allows."""
    try:
        shapes = {
            k: torch.empty(v.shape, dtype=v.dtype, device="meta")
            for k, v in model.items()
            if isinstance(v, torch.Tensor)
        }
        wanted: dict[str, Any] = sd_adapter.to_hf(shapes)
    except (NotImplementedError, RuntimeError):  # an adapter that needs the values
        wanted = sd_adapter.to_hf(dict(model))
    return wanted


def _load_hf_checkpoint(model_wrapper: Any, sd_adapter: Any, path: str) -> None:
    """Load the model's weights from the Hugging Face checkpoint directory ``path``: each
    tensor ``to_hf`` names, read whole, converted by ``from_hf``, then each onto its live
    layout (a DTensor sharded as the live one is) in the live dtype."""
    directory = Path(path)
    if not directory.is_dir():
        raise ConfigurationError(f"{path} is not a directory holding a Hugging Face checkpoint")
    model = model_wrapper.state_dict()
    wanted = _wanted_hf_names(sd_adapter, model)
    files = _hf_files(directory)
    missing = sorted(k for k in wanted if k not in files)
    if missing:
        raise StateMismatchError(
            f"the Hugging Face checkpoint {path} lacks {len(missing)} tensor(s) the model "
            f"needs: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
            key="",
            missing=missing,
            unexpected=[],
        )
    by_file: dict[Path, list[str]] = {}
    for key in wanted:
        by_file.setdefault(files[key], []).append(key)
    loaded: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with safetensors.safe_open(str(file), "pt") as f:
            for key in keys:
                tensor = f.get_tensor(key)
                shape = tuple(wanted[key].shape)
                if tuple(tensor.shape) != shape:
                    raise ConfigurationError(
                        f"{file}: {key!r} has shape {tuple(tensor.shape)}, the model {shape}"
                    )
                loaded[key] = tensor
    native = sd_adapter.from_hf(loaded)
    converted: dict[str, Any] = {}
    for key, live in model.items():
        if not isinstance(live, torch.Tensor):
            continue
        value = native.get(key)
        if value is None:
            raise StateMismatchError(
                f"the state-dict adapter's from_hf gave no {key!r} from {path}",
                key="",
                missing=[key],
                unexpected=[],
            )
        if tuple(value.shape) != tuple(live.shape):
            raise ConfigurationError(
                f"{key!r} from {path} has shape {tuple(value.shape)}, the model {tuple(live.shape)}"
            )
        value = value.to(live.dtype)
        if isinstance(live, DTensor):
            # every rank holds the whole tensor: each keeps its own part, no collective
            value = distribute_tensor(
                value.to(live.device), live.device_mesh, live.placements, src_data_rank=None
            )
        else:
            value = value.to(live.device)
        converted[key] = value
    model_wrapper.load_state_dict(converted)
