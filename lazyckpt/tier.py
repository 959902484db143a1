"""Everything a tier author needs, from one import.

A tier is a subclass of :class:`Tier` with a handful of coroutines (``begin``,
``put_shard``, ``commit``, ``abort``, ``steps``, ``read_manifest``, ``read_shard``,
``delete``, ``aclose``; ``open`` is optional). What a tier can do beyond that is said by
the optional capability protocols, checked with ``isinstance``:

- :class:`SupportsStaging`: the tier is the host arena the captures land in (the first
  tier of a chain, as :class:`tiers.HostMemoryTier`).
- :class:`SupportsGlobalCommit`: several ranks write one store; once every rank's part is
  durable, ``commit_global(step, world_size)`` makes the step visible (rank 0 writes the
  commit record).
- :class:`SupportsRankManifests`: any rank's part of a step can be read (resharding
  restores, replicated tensors written once).
- :class:`SupportsReferences`: the tier stores incremental snapshots (a shard may be read
  from an earlier step's stored data; retention keeps what committed steps refer to).
- :class:`SupportsBatchPut`: the tier stores several shards of a snapshot in one
  ``put_shards`` call (the engine hands the first durable tier each capture batch at once).
- :class:`SupportsBlockRead`: the tier lends the host block holding a shard instead of
  copying it out (restores into device tensors straight from pinned memory).
- :class:`SupportsChecksummedRead`: the tier computes a shard's crc32c while reading it,
  piece by piece as the bytes land (the file tier); :func:`crc32c_combine` joins the pieces'
  checksums.
- :class:`SupportsRendezvous`: the tier meets the same tier on the other ranks once, after
  ``open()``, through an ``all_gather`` over lazyckpt's own process group (a tier keeping
  replicas on peers: :func:`node_identity`, :func:`place_replicas`).

Which rank a tier instance serves is handed in with :meth:`Tier.bind` before ``open()``.
Backend errors are mapped once, at the tier's boundary, by :func:`backend_errors` (which
uses :func:`translate_os_error` for ``OSError``), with the original as ``__cause__``.
Retention (``keep_last``, ``keep_every``, ``keep_best``, ``keep_within``) is
:class:`Retention`, with :class:`KeepBest` and the :class:`StepInfo` it judges steps by.
A tier registers under the entry-point group :data:`ENTRY_POINT_GROUP`; :func:`load_tier`
and :func:`available_tiers` find it. The conformance suite every tier should pass is
``lazyckpt.testing.TierTests``. See docs/tiers.md.
"""

from __future__ import annotations

from ._distributed.placement import (
    NODE_ENV,
    Exchange,
    SupportsRendezvous,
    node_identity,
    place_replicas,
)
from ._errors import (
    ConfigurationError,
    CorruptionError,
    ForeignLocationError,
    LazyCkptError,
    LocationInUseError,
    SnapshotNotFoundError,
    TierBrokenError,
    TierClosedError,
    TierError,
    TierFullError,
)
from ._format.crc import crc32c_combine
from ._format.entries import Segment, ShardMeta, TensorMeta
from ._format.manifest import FORMAT_VERSION, Manifest
from ._tiering.arena import Block, HostArena
from ._tiering.interface import (
    ENTRY_POINT_GROUP,
    KeepBest,
    Retention,
    StepInfo,
    SupportsBatchPut,
    SupportsBlockRead,
    SupportsChecksummedRead,
    SupportsGlobalCommit,
    SupportsRankManifests,
    SupportsReferences,
    SupportsStaging,
    Tier,
    available_tiers,
    backend_errors,
    load_tier,
    translate_os_error,
)
from ._tiering.states import TierLevel

__all__ = [
    "ENTRY_POINT_GROUP",
    "FORMAT_VERSION",
    "NODE_ENV",
    "Block",
    "ConfigurationError",
    "CorruptionError",
    "Exchange",
    "ForeignLocationError",
    "HostArena",
    "KeepBest",
    "LazyCkptError",
    "LocationInUseError",
    "Manifest",
    "Retention",
    "Segment",
    "ShardMeta",
    "SnapshotNotFoundError",
    "StepInfo",
    "SupportsBatchPut",
    "SupportsBlockRead",
    "SupportsChecksummedRead",
    "SupportsGlobalCommit",
    "SupportsRankManifests",
    "SupportsReferences",
    "SupportsRendezvous",
    "SupportsStaging",
    "TensorMeta",
    "Tier",
    "TierBrokenError",
    "TierClosedError",
    "TierError",
    "TierFullError",
    "TierLevel",
    "available_tiers",
    "backend_errors",
    "crc32c_combine",
    "load_tier",
    "node_identity",
    "place_replicas",
    "translate_os_error",
]
