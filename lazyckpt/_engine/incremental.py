"""Incremental snapshots: which shards a tier already holds, and which need no capture.

A shard is written to a tier only if its bytes differ from the same shard (same stream
offset and length) of the flight's base there: the newest manifest this engine committed
on that tier. "The same bytes" means the same crc32c *and* the same 128-bit SHA-256 digest;
the crc32c alone would take a changed shard for an unchanged one once in 2**32
comparisons. The new manifest then names, in the shard's ``stored_in``, the step whose data
holds those bytes (references are flattened: never a chain). The base is pinned while the
flight runs, so retention does not delete it; the base's own references are to data that
the (committed) base keeps alive on the tier.

:class:`Increments` is that bookkeeping, without I/O: the engine asks it which base a
flight compares with, whether a shard is on a tier already, and (``incremental=
"versions"``) which shards need no capture at all; the engine does the writing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._format.entries import ShardMeta
from .._format.manifest import Manifest
from .._format.walk import TensorRef
from .._tiering.interface import SupportsReferences
from .flight import Flight, Stage

__all__ = ["Increments"]


class Increments:
    """The incremental bookkeeping of one engine (see the module docstring).

    Args:
        mode: the ``incremental`` option (False, True or ``"versions"``).
        stages: the engine's stages; the durable ones that can refer to stored data
            (:class:`SupportsReferences`) are compared with their bases.
    """

    def __init__(self, mode: Any, stages: Sequence[Stage]) -> None:
        self.mode = mode
        self.stages = list(stages)
        # digests are computed only where a tier can refer to stored data
        self.digesting = bool(mode) and any(
            isinstance(stage.tier, SupportsReferences) for stage in self.stages[1:]
        )
        # per durable stage: the newest manifest committed there (the base the next
        # snapshots are compared with), how many flights in flight compare with each step
        # (a pinned step is not deleted), and the steps being deleted
        durable = range(1, len(self.stages))
        self.bases: dict[int, Manifest | None] = dict.fromkeys(durable, None)
        self.pins: dict[int, dict[int, int]] = {k: {} for k in durable}
        self.removing: dict[int, set[int]] = {k: set() for k in durable}
        # incremental="versions": per shard index, what its last capture recorded
        self.last_captures: dict[int, _Captured] = {}
        self.uncaptured_bytes = 0  # incremental="versions": bytes not captured at all

    def choose_bases(self, flight: Flight) -> None:
        """Pin, per durable tier, the committed manifest this flight is compared with."""
        m = flight.manifest
        flight.manifest = replace(m, extra={**m.extra, "incremental": True})
        for k in flight.stages:  # the tiers that take it (Checkpointer(cadence=...))
            self.take_base(flight, k)

    def take_base(self, flight: Flight, stage: int) -> None:
        """Compare the flight with the newest step committed on the tier, if that is newer
        than its base so far (a flight started before its predecessor committed takes the
        predecessor once it has). Every base a flight took stays pinned until it is done:
        shards it already referred to may name steps only that base keeps alive."""
        base = self.bases[stage]
        current = flight.bases[stage]
        m = flight.manifest
        if (
            base is None
            or (current is not None and base.step <= current.step)
            or not isinstance(self.stages[stage].tier, SupportsReferences)
            or base.step == m.step
            or base.rank != m.rank
            or base.step in self.removing[stage]
        ):
            return
        flight.bases[stage] = base
        flight.pinned.append((stage, base))
        self.pins[stage][base.step] = self.pins[stage].get(base.step, 0) + 1

    def unpin(self, flight: Flight) -> None:
        for stage, base in flight.pinned:
            pins = self.pins[stage]
            pins[base.step] -= 1
            if not pins[base.step]:
                del pins[base.step]
        flight.pinned = []
        flight.bases = [None] * len(flight.bases)

    def reuse(self, flight: Flight, stage: int, i: int) -> bool:
        """Whether shard ``i`` is on the tier already (then the flight refers to it)."""
        if i not in flight.uncaptured:  # a skipped shard keeps the base it was planned with
            self.take_base(flight, stage)
        base = flight.bases[stage]
        digest = flight.digests[i]
        if base is None or digest is None or i >= len(base.shards):
            return False
        had, shard = base.shards[i], flight.manifest.shards[i]
        if (
            had.digest != digest
            or had.crc32c != flight.crcs[i]
            or had.offset != shard.offset
            or had.length != shard.length
            or had.segments != shard.segments
        ):
            return False
        # the same tensors there too (the usual case shares one planned tuple): so a tier
        # that stores tensors by key (Zarr) finds this shard under the same names in the base
        if base.tensors is not flight.manifest.tensors and any(
            base.tensors[g.tensor] != flight.manifest.tensors[g.tensor] for g in shard.segments
        ):
            return False
        flight.stored_in[stage][i] = base.step if had.stored_in is None else had.stored_in
        return True

    def new_base(self, flight: Flight, stage: int) -> None:
        """A flight committed on a durable tier: its manifest is the next snapshots' base."""
        manifest = flight.committed_as[stage]
        if stage == 0 or not self.digesting or manifest is None:
            return
        if not isinstance(self.stages[stage].tier, SupportsReferences):
            return
        current = self.bases[stage]
        if current is None or manifest.step > current.step:
            self.bases[stage] = manifest

    def in_use(self, stage: int, flights: Iterable[Flight]) -> set[int]:
        """The steps whose stored data flights in flight may refer to on a durable tier."""
        keep: set[int] = set()
        for flight in flights:
            for pinned_at, base in flight.pinned:
                if pinned_at == stage:
                    keep.add(base.step)
                    keep |= base.references()
        return keep

    def fingerprint(self, flight: Flight) -> None:
        """What each shard's tensors look like now (storage, view, version counter), and
        which shards to digest: all but those whose tensors' version counters moved since
        their last capture. A moved counter means a write happened, so the shard is written
        without comparing (a digest would almost never match); a counter that did not move
        proves nothing (a write through ``.data`` does not move it), so those shards, and
        those never captured before, are digested and compared byte for byte. A full
        fine-tune thus costs no hashing after its first snapshot."""
        m = flight.manifest
        flight.prints = [_prints(shard, flight.refs) for shard in m.shards]
        if self.mode == "versions":
            flight.holds = [
                tuple(flight.refs[g.tensor].tensor for g in shard.segments) for shard in m.shards
            ]
        hashing = []
        for i, shard in enumerate(m.shards):
            last = self.last_captures.get(i)
            moved = (
                last is not None
                and flight.prints[i] is not None
                and last.offset == shard.offset
                and last.length == shard.length
                and last.prints != flight.prints[i]
            )
            hashing.append(not moved)
        flight.hashing = hashing

    def plan_uncaptured(self, flight: Flight) -> None:
        """``incremental="versions"``: the shards not to capture at all, because every
        tensor in them has the version counter and storage it had at the shard's last
        capture, and every durable tier's base holds that capture's bytes (see
        docs/guarantees.md for when a version counter misses a write)."""
        m = flight.manifest
        stages = flight.stages
        # a snapshot that only the host tier keeps (none else takes it) is captured whole
        if flight.kept_mode or not stages or any(flight.bases[k] is None for k in stages):
            return
        for i, shard in enumerate(m.shards):
            last = self.last_captures.get(i)
            prints = flight.prints[i]
            if (
                last is None
                or prints is None
                or last.prints != prints
                or last.offset != shard.offset
                or last.length != shard.length
            ):
                continue
            flight.crcs[i], flight.digests[i] = last.crc, last.digest
            if all(self.reuse(flight, k, i) for k in stages):
                flight.uncaptured.add(i)
                self.uncaptured_bytes += shard.length
            else:
                for refs in flight.stored_in:
                    refs.pop(i, None)
                flight.crcs[i], flight.digests[i] = 0, None

    def record_capture(self, flight: Flight, i: int) -> None:
        prints = flight.prints[i] if flight.prints else None
        shard = flight.manifest.shards[i]
        if prints is None:
            self.last_captures.pop(i, None)
            return
        self.last_captures[i] = _Captured(
            shard.offset, shard.length, prints, flight.crcs[i], flight.digests[i],
            flight.holds[i] if flight.holds else (),
        )


@dataclass(frozen=True)
class _Captured:
    """What the last capture of a shard recorded (``incremental="versions"``)."""

    offset: int
    length: int
    prints: tuple[Any, ...]
    crc: int
    digest: str | None
    # the captured tensors themselves (views, no copy): while they live, no other tensor
    # can be allocated at their address and be taken for them
    holds: tuple[torch.Tensor, ...]


def _print(ref: TensorRef) -> tuple[Any, ...] | None:
    """What must be unchanged for a tensor's bytes to be taken as unchanged: its storage,
    view and version counter as ``snapshot()`` recorded it; None if that is unknown (no
    recorded version), the tensor is a copy taken at ``snapshot()`` (the eager policy: a
    new tensor every time, whose counter says nothing about the state's own), or it is
    trainable (``requires_grad``)."""
    t = ref.tensor
    if ref.version is None or ref.copied or t.requires_grad:
        return None
    return (
        ref.key, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
        t.stride(), t.dtype, t.device, ref.version,
    )


def _prints(shard: ShardMeta, refs: Sequence[TensorRef]) -> tuple[tuple[Any, ...], ...] | None:
    found = []
    for seg in shard.segments:
        p = _print(refs[seg.tensor])
        if p is None:
            return None
        found.append((seg.tensor, seg.start, seg.stop, p))
    return tuple(found)
