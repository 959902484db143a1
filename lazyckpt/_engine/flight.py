"""A snapshot in flight: the engine's bookkeeping of one snapshot, and its timings."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._format.manifest import Manifest
from .._format.walk import TensorRef
from .._tiering.arena import Block
from .._tiering.interface import Tier
from .._tiering.states import ShardState, StateTable

__all__ = ["Flight", "SnapshotStats", "Stage"]


@dataclass(frozen=True, eq=False)
class Stage:
    """One stage of a chain, as the engine numbers them: ``index`` 0 is the host stage
    (``tier`` is the host tier, or None for the engine's private staging arena, named
    ``"<staging>"``); 1, 2, ... are the durable tiers in chain order. Every per-stage list
    and mapping of the engine and of a :class:`Flight` is indexed by this ``index``."""

    index: int
    name: str
    tier: Tier | None

    @property
    def durable(self) -> bool:
        return self.index > 0


@dataclass
class SnapshotStats:
    """Where the time of one snapshot went (seconds)."""

    step: int
    bytes: int
    shards: int
    snapshot_s: float = 0.0
    guard_s: float = 0.0
    capture_s: float | None = None
    reached_s: dict[str, float] = field(default_factory=dict)


class Flight:
    """A snapshot on its way through the tiers."""

    def __init__(
        self,
        manifest: Manifest,
        refs: Sequence[TensorRef],
        tier_names: Sequence[str],
        tensor_bytes: int | None = None,
    ) -> None:
        self.manifest = manifest
        self.refs = refs
        n = len(manifest.shards)
        self.states = [ShardState.CAPTURED] * n
        self.crcs: list[int] = [0] * n
        # incremental snapshots: each shard's content digest; per stage, the committed
        # manifest its shards are compared with (the base, pinned while this flight runs),
        # the shards it refers to instead of writing (index -> the step holding them), and
        # which shards were not captured at all (unchanged since the last capture)
        self.digests: list[str | None] = [None] * n
        self.bases: list[Manifest | None] = [None] * len(tier_names)
        self.pinned: list[tuple[int, Manifest]] = []  # (stage, base): every base it used
        self.stored_in: list[dict[int, int]] = [{} for _ in tier_names]
        self.uncaptured: set[int] = set()
        # incremental="versions": per shard, what must stay unchanged to skip its next
        # capture, and its tensors (see the engine's _Captured)
        self.prints: list[tuple[Any, ...] | None] = []
        self.holds: list[tuple[torch.Tensor, ...]] = []
        self.hashing: list[bool] = []  # per shard: compute its digest (engine._fingerprint)
        self.committed_as: list[Manifest | None] = [None] * len(tier_names)
        self.blocks: list[Block | None] = [None] * n
        self.captured_count = 0
        self.checksummed_count = 0
        self.persisted = [0] * len(tier_names)
        self.failed_from: int | None = None  # first stage index that failed (0 = capture)
        self.errors: list[Exception] = []
        self.t_submit = time.perf_counter()
        nbytes = manifest.tensor_bytes if tensor_bytes is None else tensor_bytes
        self.stats = SnapshotStats(step=manifest.step, bytes=nbytes, shards=n)
        # per durable stage (by index): its begin(), running beside the capture; True once
        # it succeeded
        self.begun: dict[int, asyncio.Task[bool]] = {}
        # a host-only chain: the blocks this snapshot keeps, held until it commits or fails,
        # and whether it is finished (its blocks are given back in step order)
        self.kept: list[Block] = []
        self.finished = False
        self.captured: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.reached: dict[str, concurrent.futures.Future[None]] = {
            name: concurrent.futures.Future() for name in tier_names
        }
        self.done = asyncio.Event()
        self.reported = False
        self.recorded = False
        # distributed mode: this rank's outcome per stage, then the ranks' agreement
        self.local_ok = [False] * len(tier_names)
        self.settled = asyncio.Event()
        self.coordinated = [asyncio.Event() for _ in tier_names]
        # the durable stages that take this snapshot (Checkpointer(cadence=...)): decided at
        # snapshot() from the step, or on the engine loop where ranks agree on a time-based
        # cadence (``proposal``: this rank's view of which cadenced tiers are due, at
        # ``t_taken``); the flight's state table, built for exactly those stages; whether
        # the host tier is its only home (no durable stage takes it); whether it is an
        # emergency copy of a committed step (read back, not captured)
        self.takes: frozenset[int] | None = None
        self.stages: tuple[int, ...] = ()
        self.proposal: dict[int, bool] = {}
        self.t_taken = time.monotonic()
        self._table: StateTable | None = None
        self.kept_mode = False
        self.emergency = False
        # committed on every stage that takes it (the last of them resolves it)
        self.committed: concurrent.futures.Future[None] = concurrent.futures.Future()

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def last_stage(self) -> int:
        """The last stage that takes this snapshot (0: none of the durable ones)."""
        return self.stages[-1] if self.stages else 0

    def decide(self, takes: frozenset[int], table: StateTable, *, host: bool) -> None:
        """Fix the durable stages that take this snapshot and its state table; ``host``:
        the chain starts with a host tier (then a snapshot no durable stage takes lives
        in the host tier alone)."""
        self.takes = takes
        self.stages = tuple(sorted(takes))
        self._table = table
        self.kept_mode = host and not takes

    @property
    def table(self) -> StateTable:
        """The state table of the stages this snapshot goes to (once decided)."""
        if self._table is None:
            raise AssertionError(f"step {self.step}: its stages are not decided yet")
        return self._table
