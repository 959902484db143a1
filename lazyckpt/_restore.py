"""Restoring a snapshot: from the fastest tier that has a good copy, shard by shard.

For each shard the restore walks its own small state table (``_state.RESTORE_TABLE``):
PENDING, READING from the next tier that holds the step, then VERIFIED when the crc32c
matches the manifest, or back to PENDING for the next tier on a bad or missing copy, and
EXHAUSTED when no tier is left (a :class:`CorruptionError` naming the tensors and tiers).

Bytes go straight into the destination tensor when it is a contiguous CPU tensor (an
``into=`` target or a new tensor); otherwise through a temporary buffer and ``copy_``.

An ``into=`` target is checked against the snapshot before any byte is read
(:func:`align_into`): a key the target has and the snapshot lacks, or a module whose
state-dict keys differ, raises :class:`StateMismatchError`, except that the key prefixes
wrappers add (``_orig_mod.`` from ``torch.compile``, ``module.`` from DDP) are mapped, so a
compiled model's snapshot restores into the plain model and back.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import random
import warnings
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Hashable,
    Mapping,
    MutableMapping,
    Sequence,
)
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import torch

from ._cuda.restore import restore_into
from ._errors import (
    ConfigurationError,
    CorruptionError,
    SnapshotNotFoundError,
    StateMismatchError,
    TierError,
    first_error,
)
from ._fetch import (
    Checksum,
    byte_view,
    committed_steps,
    find_step,
    read_copy,
    read_verified,
    shard_keys,
    thread_checksum,
)
from ._gc import collector_paused
from ._manifest import Manifest, ShardMeta, TensorMeta
from ._tier import Tier
from ._tree import (
    JSON,
    DataclassValue,
    Stateful,
    StatefulValue,
    _escape,
    decode_tree,
    walk_state,
)

__all__ = [
    "WRAPPER_PREFIXES",
    "VerifyReport",
    "align_into",
    "apply_into",
    "committed_steps",
    "read_manifest",
    "restore_lazily",
    "restore_state",
    "strip_prefix",
    "verify_step",
]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# What wrappers put in front of a module's state-dict keys: torch.compile's OptimizedModule
# and DistributedDataParallel / DataParallel. restore(into=...) maps them when that is the
# only difference between the target's keys and the snapshot's.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def strip_prefix(state: Mapping[K, V], prefix: str) -> dict[K, V]:
    """A copy of ``state`` with ``prefix`` taken off every string key that starts with it.

    For a state dict restored without ``into=`` from a compiled model's snapshot::

        model.load_state_dict(lazyckpt.strip_prefix(state["model"], "_orig_mod."))

    Only the top-level keys are renamed; values are the same objects. Raises
    :class:`ConfigurationError` when two keys would become one.
    """
    out: dict[Any, V] = {}
    for k, v in state.items():
        new: Any = k[len(prefix) :] if isinstance(k, str) and k.startswith(prefix) else k
        if new in out:
            raise ConfigurationError(
                f"strip_prefix({prefix!r}): {k!r} and another key both become {new!r}"
            )
        out[new] = v
    return out


async def read_manifest(
    tiers: Sequence[Tier], step: int | None
) -> tuple[Manifest, list[Tier], list[Exception]]:
    """The manifest of ``step`` (the latest committed if None), the tiers holding it (fastest
    first), and the problems met on the way."""
    step, sources = await find_step(tiers, step)
    problems: list[Exception] = []
    for tier in sources:
        try:
            return await tier.read_manifest(step), sources, problems
        except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
            problems.append(exc)
    raise CorruptionError(
        f"step {step}: no tier holds a readable manifest: " + "; ".join(map(str, problems))
    )


def _empty(meta: TensorMeta) -> torch.Tensor:
    dtype = meta.torch_dtype
    if dtype is not torch.complex32:
        return torch.empty(meta.shape, dtype=dtype)
    # only here: entering catch_warnings costs more than the allocation of a small tensor
    with warnings.catch_warnings():  # torch calls complex32 "experimental"; it round-trips
        warnings.simplefilter("ignore", UserWarning)
        return torch.empty(meta.shape, dtype=dtype)


class _Destinations:
    """Where each tensor of the manifest goes."""

    def __init__(
        self, manifest: Manifest, into: Any, map_location: torch.device | str | None
    ) -> None:
        self.manifest = manifest
        self.device = torch.device(map_location) if map_location is not None else None
        targets: dict[str, torch.Tensor] = {}
        self.wrappers: dict[int, torch.Tensor] = {}  # tensor index -> DTensor target
        # tensor index -> the into= tensor itself: returned as it is, so that apply_into
        # finds the very object it holds and copies nothing
        self.given: dict[int, torch.Tensor] = {}
        dtensors: dict[str, torch.Tensor] = {}
        if into is not None:
            _, refs = walk_state(into, allow_pickle=False, lenient=True)
            targets = {r.key: r.tensor for r in refs}  # a DTensor's local chunk
            dtensors = {r.key: r.dtensor for r in refs if r.dtensor is not None}
        self.final: list[torch.Tensor | None] = []
        self.staging: list[torch.Tensor | None] = []  # contiguous CPU tensor read into
        for meta in manifest.tensors:
            if meta.mode == "alias":
                self.final.append(None)
                self.staging.append(None)
                continue
            target = targets.get(meta.key)
            if target is not None and (
                tuple(target.shape) != meta.shape or target.dtype != meta.torch_dtype
            ):
                raise ConfigurationError(
                    f"into[{meta.key!r}] is {target.dtype}{list(target.shape)} but the "
                    f"checkpoint has {meta.dtype}{list(meta.shape)}"
                )
            if meta.key in dtensors:  # its local chunk is filled; the state holds the DTensor
                self.wrappers[len(self.final)] = dtensors[meta.key]
            if target is not None:
                self.given[len(self.final)] = target
                final = target.detach()
                direct = final.device.type == "cpu" and final.is_contiguous()
                staging = final if direct else _empty(meta)
            else:
                staging = _empty(meta)
                final = staging
            self.final.append(final)
            self.staging.append(staging)

    def finish(self) -> list[torch.Tensor]:
        """Move staged bytes to their final tensors; resolve aliases."""
        out: list[torch.Tensor] = []
        for i, meta in enumerate(self.manifest.tensors):
            if meta.alias_of is not None:
                out.append(out[meta.alias_of])
                continue
            final, staging = self.final[i], self.staging[i]
            assert final is not None and staging is not None
            if final is not staging:
                final.copy_(staging)
            given = self.given.get(i)
            if given is not None:  # filled in place (a DTensor target: through its chunk)
                out.append(self.wrappers.get(i, given))
                continue
            if self.device is not None and self.device != final.device:
                final = final.to(self.device)
            out.append(final)
        return out


async def _restore_shard(
    manifest: Manifest,
    shard: ShardMeta,
    sources: Sequence[Tier],
    dests: _Destinations,
    problems: list[Exception],
    checksum: Checksum,
) -> None:
    direct = None
    if shard.kind == "chunk":  # one piece of one tensor: read straight into its bytes
        (seg,) = shard.segments
        staging = dests.staging[seg.tensor]
        assert staging is not None
        start, nbytes = manifest.segment_span(seg)
        direct = byte_view(staging)[start : start + nbytes]
    buffer = None
    if direct is None:
        buffer = torch.empty(shard.length, dtype=torch.uint8)
        out = byte_view(buffer)
    else:
        out = direct
    await read_verified(manifest, shard, sources, out, checksum=checksum, problems=problems)
    if buffer is not None:
        tensors, all_staging = manifest.tensors, dests.staging
        base = buffer.data_ptr()
        for seg in shard.segments:
            meta = tensors[seg.tensor]
            staging = all_staging[seg.tensor]
            assert staging is not None
            if meta.mode == "pack":  # the usual case, thousands per shard
                # a staging tensor is contiguous host memory of the tensor's size, and the
                # manifest's decoder checked that the segment lies inside the shard: one
                # memmove, where three tensor operations cost some 10 µs per tiny tensor
                ctypes.memmove(staging.data_ptr(), base + seg.offset, staging.nbytes)
                continue
            manifest.tensor_part(seg, staging).copy_(manifest.shard_part(seg, buffer))


async def restore_state(
    manifest: Manifest,
    sources: Sequence[Tier],
    *,
    into: Any,
    map_location: torch.device | str | None,
    allow_pickle: bool,
    concurrency: int = 4,
    checksum: Checksum = thread_checksum,
) -> Any:
    """Read every shard of ``manifest`` (falling back tier by tier) and rebuild the state;
    ``checksum`` computes each shard's crc32c (the Checkpointer's checksum pool)."""
    if manifest.pickled and not allow_pickle:
        decode_tree(manifest.tree, [None] * len(manifest.tensors), allow_pickle=False)
    with collector_paused():  # a few objects per tensor, none cyclic: see _gc.py
        manifest = align_into(manifest, into)
        dests = _Destinations(manifest, into, map_location)
    problems: list[Exception] = []
    shards: Sequence[ShardMeta] = manifest.shards
    if any(t is not None and t.device.type == "cuda" for t in dests.final):
        # device targets: in place, host to device
        await restore_into(
            manifest, sources, dests.final, concurrency=concurrency, checksum=checksum
        )
        dests.staging = list(dests.final)  # every tensor is filled: nothing left to copy
        shards = ()

    await _read_shards(manifest, shards, sources, dests, problems, concurrency, checksum)
    with collector_paused():
        tensors = dests.finish()
        state = decode_tree(manifest.tree, tensors, allow_pickle=allow_pickle)
    if into is not None:
        apply_into(into, state)  # outside the pause: it runs the objects' load_state_dict
        return into
    return state


async def restore_lazily(
    manifest: Manifest,
    sources: Sequence[Tier],
    *,
    into: Mapping[Any, Any],
    deferred: Collection[Any],
    map_location: torch.device | str | None,
    allow_pickle: bool,
    concurrency: int = 4,
    checksum: Checksum = thread_checksum,
) -> Callable[[], Awaitable[None]] | None:
    """Restore everything but the top-level entries ``deferred`` of ``into`` now, and
    return the coroutine function that restores those (the guarded optimizers' state).

    The shards holding any tensor outside ``deferred`` are read first and those tensors
    loaded into ``into``; the rest is left for the returned function, which loads only the
    deferred entries (so it never overwrites what the caller changed meanwhile: a forward
    pass updates BatchNorm statistics). Returns None, having read nothing, where the
    restore cannot be split (device targets are restored in one pass): restore eagerly."""
    if manifest.pickled and not allow_pickle:
        decode_tree(manifest.tree, [None] * len(manifest.tensors), allow_pickle=False)
    manifest = align_into(manifest, into)
    dests = _Destinations(manifest, into, map_location)
    if any(t is not None and t.device.type == "cuda" for t in dests.final):
        return None
    later = {_escape(str(k)) for k in deferred}
    tensors = manifest.tensors
    first = {
        i for i, meta in enumerate(tensors) if meta.key.split("/", 1)[0] not in later
    }
    for i in sorted(first):  # an early tensor aliasing a later one needs the later one now
        target = tensors[i].alias_of
        while target is not None:
            first.add(target)
            target = tensors[target].alias_of
    now = [sh for sh in manifest.shards if any(seg.tensor in first for seg in sh.segments)]
    rest = [sh for sh in manifest.shards if not any(seg.tensor in first for seg in sh.segments)]
    problems: list[Exception] = []
    done: list[Any] = [None] * len(tensors)
    await _read_shards(manifest, now, sources, dests, problems, concurrency, checksum)
    _finish_some(dests, done, first)
    state = decode_tree(manifest.tree, done, allow_pickle=allow_pickle)
    lacking = [k for k in deferred if k not in state]
    if lacking:
        raise _mismatch("", "the mapping", lacking, [])
    _apply_part(into, state, [k for k in into if k not in deferred])

    async def finish() -> None:
        await _read_shards(manifest, rest, sources, dests, problems, concurrency, checksum)
        _finish_some(dests, done, set(range(len(tensors))) - first)
        full = decode_tree(manifest.tree, done, allow_pickle=allow_pickle)
        _apply_part(into, full, [k for k in into if k in deferred])

    return finish


def _apply_part(into: Mapping[Any, Any], restored: Mapping[Any, Any], keys: Sequence[Any]) -> None:
    """:func:`apply_into` for the top-level entries ``keys`` of ``into`` only (with the same
    key checks below them): a lazy restore loads its two parts one after the other."""
    part = {k: into[k] for k in keys}
    apply_into(part, {k: restored[k] for k in keys if k in restored})
    if isinstance(into, MutableMapping):
        for k, v in part.items():  # plain values are replaced, not loaded in place
            if into[k] is not v:
                into[k] = v


async def _read_shards(
    manifest: Manifest,
    shards: Sequence[ShardMeta],
    sources: Sequence[Tier],
    dests: _Destinations,
    problems: list[Exception],
    concurrency: int,
    checksum: Checksum,
) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(shard: ShardMeta) -> None:
        async with sem:
            await _restore_shard(manifest, shard, sources, dests, problems, checksum)

    try:
        async with asyncio.TaskGroup() as tg:
            for shard in shards:
                tg.create_task(one(shard))
    except ExceptionGroup as group:
        raise first_error(group) from None


def _finish_some(dests: _Destinations, out: list[Any], indices: Collection[int]) -> None:
    """:meth:`_Destinations.finish` for the tensors ``indices`` only, into ``out``."""
    tensors = dests.manifest.tensors
    for i in sorted(indices):  # an alias refers to an earlier tensor
        meta = tensors[i]
        if meta.alias_of is not None:
            out[i] = out[meta.alias_of]
            continue
        final, staging = dests.final[i], dests.staging[i]
        assert final is not None and staging is not None
        if final is not staging:
            final.copy_(staging)
        elif dests.device is not None and dests.device != final.device:
            final = final.to(dests.device)
        out[i] = dests.wrappers.get(i, final)


def apply_into(into: Any, restored: Any, key: str = "") -> None:
    """Load ``restored`` into ``into`` in place: tensors were already copied into; Stateful
    objects get ``load_state_dict``; generators get their state; dataclass instances their
    fields; other values of a mutable mapping are replaced.

    Every key is checked first (:class:`StateMismatchError`), so a mismatch changes nothing.
    """
    _check_keys(into, restored, key)
    if not _load(into, restored, key):
        raise ConfigurationError(
            f"cannot restore into {type(into).__qualname__} at {key or '<root>'!r}; "
            "into= takes a mutable mapping of tensors, Stateful objects and values"
        )


def _stateful(obj: Any) -> bool:
    """A Stateful object that is not a mapping (a module, an optimizer). Plain dicts and
    tensors are answered at once: the Protocol's isinstance is slow, and it would be asked
    once per container and per tensor (``docs/design.md``, "Figures behind choices in the
    code")."""
    if type(obj) in _NEVER_STATEFUL or obj is None:
        return False
    return isinstance(obj, Stateful) and not isinstance(obj, Mapping)


_NEVER_STATEFUL = (dict, list, tuple, torch.Tensor, torch.nn.Parameter, str, int, float, bool)


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _mismatch(key: str, what: str, missing: list[Any], unexpected: list[Any]) -> StateMismatchError:
    where = repr(key) if key else "the top level"
    parts = []
    if missing:
        parts.append(f"missing from the snapshot: {_names(missing)}")
    if unexpected:
        parts.append(f"in the snapshot but not in the target: {_names(unexpected)}")
    return StateMismatchError(
        f"restore(into=...): the keys of {what} at {where} do not match the snapshot's ("
        + "; ".join(parts)
        + "). Rename the target's keys to the snapshot's (lazyckpt inspect lists them), or "
        "restore without into= and load what you need.",
        key=key,
        missing=missing,
        unexpected=unexpected,
    )


def _names(keys: list[Any]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _check_keys(into: Any, restored: Any, key: str) -> None:
    """Raise :class:`StateMismatchError` where ``into`` wants what ``restored`` lacks."""
    if isinstance(into, torch.Tensor):  # the usual leaf, answered before the ABC checks
        return
    if isinstance(into, torch.nn.Module) and isinstance(restored, Mapping):
        want = list(into.state_dict().keys())
        want_set = set(want)  # once, not per key
        missing = [k for k in want if k not in restored]
        unexpected = [k for k in restored if k not in want_set]
        if missing or unexpected:
            raise _mismatch(key, f"module {type(into).__qualname__}", missing, unexpected)
    elif _stateful(into):
        return  # its own load_state_dict decides what it accepts
    elif isinstance(into, MutableMapping) and isinstance(restored, Mapping):
        missing = [k for k in into if k not in restored]
        if missing:
            unexpected = [k for k in restored if k not in into]
            raise _mismatch(key, "the mapping", missing, unexpected)
        for k in into:
            _check_keys(into[k], restored[k], _join(key, k))
    elif _is_dataclass_instance(into) and isinstance(restored, DataclassValue):
        names = [f.name for f in dataclasses.fields(into)]
        names_set = set(names)
        missing = [n for n in names if n not in restored]
        unexpected = [n for n in restored if n not in names_set]
        if missing or unexpected:
            raise _mismatch(key, f"dataclass {type(into).__qualname__}", missing, unexpected)
        for n in names:
            _check_keys(getattr(into, n), restored[n], _join(key, n))


def _join(key: str, k: Any) -> str:
    return f"{key}/{k}" if key else str(k)


def _load(current: Any, value: Any, key: str) -> bool:
    """Load ``value`` into the live object ``current`` in place; False when ``current`` is
    not something that loads in place (the caller then replaces it with ``value``)."""
    if isinstance(current, torch.Tensor):
        if isinstance(value, torch.Tensor) and value is not current:
            current.copy_(value)
        return isinstance(value, torch.Tensor)
    if _stateful(current):
        current.load_state_dict(dict(value) if isinstance(value, StatefulValue) else value)
        return True
    if isinstance(current, MutableMapping) and isinstance(value, Mapping):
        for k, v in value.items():
            if k not in current or not _load(current[k], v, _join(key, k)):
                current[k] = _plain(v)
        return True
    if _is_dataclass_instance(current) and isinstance(value, DataclassValue):
        for name, v in value.items():
            if not _load(getattr(current, name), v, _join(key, name)):
                try:
                    setattr(current, name, _plain(v))
                except dataclasses.FrozenInstanceError:
                    raise ConfigurationError(
                        f"restore(into=...): {type(current).__qualname__} at {key!r} is a "
                        f"frozen dataclass, so its field {name!r} cannot be loaded in place; "
                        "restore without into= and build a new instance from the fields"
                    ) from None
        return True
    if isinstance(current, torch.Generator) and isinstance(value, torch.Generator):
        current.set_state(value.get_state())
        return True
    if isinstance(current, np.random.Generator) and isinstance(value, np.random.Generator):
        if type(current.bit_generator) is not type(value.bit_generator):
            return False  # another algorithm: the restored generator replaces it
        current.bit_generator.state = value.bit_generator.state
        return True
    if isinstance(current, np.random.RandomState) and isinstance(value, np.random.RandomState):
        current.set_state(value.get_state(legacy=False))
        return True
    if type(current) is random.Random and type(value) is random.Random:
        current.setstate(value.getstate())
        return True
    if (
        type(current) is np.ndarray
        and type(value) is np.ndarray
        and current.shape == value.shape
        and current.dtype == value.dtype
        and current.flags.writeable
    ):
        np.copyto(current, value)
        return True
    return False


def _plain(value: Any) -> Any:
    # lazyckpt's marker types stay inside the restore; what lands in a target is a dict
    if isinstance(value, StatefulValue | DataclassValue):
        return dict(value)
    return value


def align_into(manifest: Manifest, into: Any, *, rename: bool = True) -> Manifest:
    """Check the keys of an ``into=`` target against ``manifest`` before anything is read,
    and map wrapper prefixes (:data:`WRAPPER_PREFIXES`) where that is the only difference.

    Returns the manifest itself when nothing is renamed, else a copy whose tree and tensor
    keys use the target's names. Raises :class:`StateMismatchError` on other differences,
    and on prefix differences too when ``rename`` is false (a resharding restore, which
    matches other ranks' manifests by the saved keys).
    """
    if into is None:
        return manifest
    renames: dict[str, str] = {}
    tree = _align(manifest.tree, into, "", renames if rename else None)
    if not renames:
        return manifest
    tensors = tuple(_renamed(meta, renames) for meta in manifest.tensors)
    return replace(manifest, tree=tree, tensors=tensors)


def _renamed(meta: TensorMeta, renames: dict[str, str]) -> TensorMeta:
    key = meta.key
    cut = len(key)
    while cut > 0:  # the key itself, then each enclosing path
        new = renames.get(key[:cut])
        if new is not None:
            return replace(meta, key=new + key[cut:])
        cut = key.rfind("/", 0, cut)
    return meta


def _items(node: JSON) -> tuple[list[Any], bool] | None:
    """The ``[key, value]`` items of a mapping node, and whether it is a Stateful's."""
    stateful = isinstance(node, dict) and len(node) == 1 and "$stateful" in node
    inner = node["$stateful"] if stateful else node
    if isinstance(inner, dict) and len(inner) == 1 and isinstance(inner.get("$dict"), list):
        return inner["$dict"], stateful
    return None


def _key_of(node: JSON) -> Any:
    return node if isinstance(node, str) else decode_tree(node, [], allow_pickle=False)


# The whole prefixes a module's keys may carry: compiled, wrapped in DDP, or both (in either
# order: DDP(torch.compile(m)) or torch.compile(DDP(m))).
_PREFIX_CHAINS = ("", *WRAPPER_PREFIXES, "module._orig_mod.", "_orig_mod.module.")


def _prefix_map(have: list[Any], want: list[Any]) -> dict[Any, Any] | None:
    """How to rename keys of ``have`` (the snapshot's) so that every key of ``want`` is there,
    when one wrapper prefix in front of all of them is the difference; None when that is
    not so, or when two different prefixes would both fit."""
    if not all(isinstance(k, str) for k in (*have, *want)):
        return None
    have_set, want_set = set(have), set(want)
    found: dict[Any, Any] | None = None
    for saved in _PREFIX_CHAINS:
        for wanted in _PREFIX_CHAINS:
            if saved == wanted or not all(w.startswith(wanted) for w in want):
                continue
            mapping = {saved + w[len(wanted) :]: w for w in want}
            # a name taken by a key that stays as it is would then be there twice
            clash = any(k in want_set and k not in mapping for k in have)
            if mapping.keys() <= have_set and not clash:
                if found is not None and found != mapping:
                    return None
                found = mapping
    return found


def _align(node: JSON, into: Any, path: str, renames: dict[str, str] | None) -> JSON:
    if isinstance(into, torch.Tensor):  # the usual leaf, answered before the ABC checks
        return node
    module = isinstance(into, torch.nn.Module)
    if module or (isinstance(into, MutableMapping) and not _stateful(into)):
        found = _items(node)
        if found is None:
            return node
        items, stateful = found
        have = [_key_of(k) for k, _ in items]
        want = list(into.state_dict().keys() if module else into.keys())
        if not set(want) <= set(have) or (module and set(have) != set(want)):
            mapping = _prefix_map(have, want) if renames is not None else None
            if mapping is not None and renames is not None:
                for old, new in mapping.items():
                    renames[_child(path, old)] = _child(path, new)
                items = [[mapping.get(k, k), v] for k, (_, v) in zip(have, items, strict=True)]
                have = [mapping.get(k, k) for k in have]
        have_set, want_set = set(have), set(want)  # once: per element they made this O(n²)
        missing = [k for k in want if k not in have_set]
        unexpected = [k for k in have if k not in want_set]
        if missing or (module and unexpected):
            what = f"module {type(into).__qualname__}" if module else "the mapping"
            raise _mismatch(path, what, missing, unexpected)
        if not module:
            items = [
                [k_node, _align(v, into[k], _child(path, k), renames) if k in into else v]
                for k, (k_node, v) in zip(have, items, strict=True)
            ]
        inner = {"$dict": items}
        return {"$stateful": inner} if stateful else inner
    return node


def _child(path: str, k: Any) -> str:
    part = _escape(str(k))
    return f"{path}/{part}" if path else part


@dataclass
class VerifyReport:
    """What :meth:`Checkpointer.verify` found: per tier, the problems with one step.

    ``problems[tier]`` is empty when every shard of the step on that tier matched its
    checksum. ``ok`` is true when at least one tier holds a complete good copy.
    """

    step: int
    problems: dict[str, list[str]] = field(default_factory=dict)
    shards: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return any(not p for p in self.problems.values())

    @property
    def damaged_tiers(self) -> list[str]:
        return [name for name, p in self.problems.items() if p]


async def verify_step(
    tiers: Sequence[Tier], step: int | None, *, checksum: Checksum = thread_checksum
) -> VerifyReport:
    """Read every shard of ``step`` on every tier that lists it and check its crc32c."""
    step, holders = await find_step(tiers, step)
    report = VerifyReport(step)
    for tier in holders:
        problems = report.problems.setdefault(tier.name, [])
        try:
            manifest = await tier.read_manifest(step)
        except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
            problems.append(f"manifest: {exc}")
            continue
        report.shards = len(manifest.shards)
        report.bytes = sum(s.length for s in manifest.shards)
        for shard in manifest.shards:
            out = memoryview(bytearray(shard.length))
            try:
                await read_copy(manifest, shard, tier, out, checksum=checksum)
            except (CorruptionError, TierError) as exc:
                problems.append(f"shard {shard.index} ({shard_keys(manifest, shard)}): {exc}")
    return report
