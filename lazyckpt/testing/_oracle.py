"""An oracle for tier tests: a snapshot's manifest and shard bytes built without the engine.

Needs only lazyckpt (no pytest), like :class:`~lazyckpt.testing.FaultyTier`.
"""

from __future__ import annotations

from typing import Any

import crc32c
import torch

from .._format.manifest import LayoutOptions, Manifest, plan_layout
from .._format.walk import walk_state

__all__ = ["build_snapshot"]


def build_snapshot(
    step: int,
    state: dict[str, Any],
    *,
    shard_size: int = 1 << 14,
    pack_bytes: int = 2048,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Manifest, list[bytes]]:
    """A manifest (with checksums) and each shard's bytes for ``state``, computed in the
    simplest possible way (no engine): an oracle for tier tests. ``rank`` and
    ``world_size`` make it one rank's part of a snapshot written by several ranks."""
    tree, refs = walk_state(state, allow_pickle=False)
    manifest = plan_layout(
        step, tree, refs, LayoutOptions(shard_size, pack_bytes), rank=rank, world_size=world_size
    )
    payloads = []
    for shard in manifest.shards:
        buf = bytearray(shard.length)
        for seg in shard.segments:
            meta = manifest.tensors[seg.tensor]
            src = refs[seg.tensor].tensor
            # spelled out here on purpose rather than through Manifest.tensor_part: an oracle
            # that reused the code it checks could not catch that code's mistakes
            if meta.mode == "rows":
                src = src[seg.start : seg.stop]
            elif meta.mode == "flat":
                src = src.reshape(-1)[seg.start : seg.stop]
            raw = src.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            buf[seg.offset : seg.offset + len(raw)] = raw
        payloads.append(bytes(buf))
    manifest = manifest.with_checksums([crc32c.crc32c(p) for p in payloads])
    return manifest, payloads
