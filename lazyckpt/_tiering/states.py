"""The shard state machine: every rule about where a shard may go next, and nothing else.

Theory of operation
-------------------
A snapshot is cut into shards (see ``_layout``). Each shard moves through

    CAPTURED ──► COPIED ──► ON_HOST ──► ON_LOCAL ──► ON_PEER ──► ON_PFS
        └──────────┴──────────┴───────────┴───────────┴──────────┴──► FAILED

CAPTURED
    ``snapshot()`` recorded the tensor references and their version counters; no byte has
    been copied. The capture backend moves the shard out, with CAPTURE_DONE once its bytes
    sit in a host buffer and its version counters still match.
COPIED
    The bytes are in a host block and the source tensors may change now: a snapshot whose
    shards are all here (or further) counts as captured, and the guard lets the optimizer
    step go. The shard has no checksum yet; the scheduler's checksum stage computes it from
    the host block and moves the shard on with CHECKSUM_DONE. Nothing leaves host memory
    from here: no tier accepts a shard without its checksum.
ON_HOST
    The bytes are in host memory (the arena) and their crc32c is known. The host tier may
    keep the shard now. The scheduler moves it on with PERSISTED once the next tier of the
    chain reports it durable.
ON_LOCAL / ON_PEER / ON_PFS
    Durable on a tier of that level (fsync'd; acknowledged by the peer ranks holding the
    replicas; acknowledged by the object store).
FAILED
    Any non-terminal state can fail (FAIL). A failed shard never becomes part of a committed
    snapshot.

Which durable states exist depends on the chain of tiers: ``[host, file]`` ends at ON_LOCAL,
``[host, zarr]`` goes from ON_HOST straight to ON_PFS. That is a different *table*, built
by :func:`build_table`, never an ``if`` in the scheduler. Restore has its own small table.

This module does no I/O and awaits nothing; it is pure and property-tested.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from .._errors import ConfigurationError, InvalidTransitionError

__all__ = [
    "Event",
    "RestoreEvent",
    "RestoreState",
    "ShardState",
    "StateTable",
    "TierLevel",
    "advance",
    "build_table",
]


class TierLevel(enum.IntEnum):
    """Where a tier sits in the hierarchy; a chain lists them in increasing order."""

    HOST = 1
    LOCAL = 2
    PEER = 3  # replicas on other nodes' ranks (tiers.PeerTier)
    PFS = 4


class ShardState(enum.Enum):
    """Where a shard's bytes are. See the module docstring."""

    CAPTURED = "captured"
    COPIED = "copied"
    ON_HOST = "on_host"
    ON_LOCAL = "on_local"
    ON_PEER = "on_peer"
    ON_PFS = "on_pfs"
    FAILED = "failed"


class Event(enum.Enum):
    """What happened to a shard."""

    CAPTURE_DONE = "capture_done"
    CHECKSUM_DONE = "checksum_done"
    PERSISTED = "persisted"
    FAIL = "fail"


_STATE_OF_LEVEL: Mapping[TierLevel, ShardState] = MappingProxyType(
    {
        TierLevel.HOST: ShardState.ON_HOST,
        TierLevel.LOCAL: ShardState.ON_LOCAL,
        TierLevel.PEER: ShardState.ON_PEER,
        TierLevel.PFS: ShardState.ON_PFS,
    }
)


@dataclass(frozen=True)
class StateTable:
    """A frozen transition table for one chain of tiers.

    ``transitions`` maps ``(state, event)`` to the next state; ``terminal`` is the state a
    shard ends in when it reached the last tier; ``levels`` the chain's tier levels.
    """

    levels: tuple[TierLevel, ...]
    transitions: Mapping[tuple[ShardState, Event], ShardState]
    terminal: ShardState


def build_table(levels: Sequence[TierLevel]) -> StateTable:
    """Build the table for a chain of tier levels, host (staging) first.

    ``levels`` lists the durable levels after the host stage; the host stage is always
    there, because a capture always lands in host memory (a chain without a host tier stages
    through the engine's own arena). Levels must strictly increase.
    """
    chain = tuple(levels)
    if any(level is TierLevel.HOST for level in chain):
        raise ConfigurationError(
            "only the first tier of a chain may be a host-memory tier; "
            f"got levels {[lv.name for lv in chain]}"
        )
    if any(b <= a for a, b in itertools.pairwise(chain)):
        raise ConfigurationError(
            "tier levels must strictly increase along the chain (host, then local, then "
            f"peer, then pfs), one tier per level; got {[lv.name for lv in chain]}"
        )
    transitions: dict[tuple[ShardState, Event], ShardState] = {
        (ShardState.CAPTURED, Event.CAPTURE_DONE): ShardState.COPIED,
        (ShardState.CAPTURED, Event.FAIL): ShardState.FAILED,
        (ShardState.COPIED, Event.CHECKSUM_DONE): ShardState.ON_HOST,
        (ShardState.COPIED, Event.FAIL): ShardState.FAILED,
    }
    previous = ShardState.ON_HOST
    for level in chain:
        nxt = _STATE_OF_LEVEL[level]
        transitions[(previous, Event.PERSISTED)] = nxt
        transitions[(previous, Event.FAIL)] = ShardState.FAILED
        previous = nxt
    return StateTable(
        levels=(TierLevel.HOST, *chain),
        transitions=MappingProxyType(transitions),
        terminal=previous,
    )


def advance(table: StateTable, state: ShardState, event: Event) -> ShardState:
    """Apply ``event`` to a shard in ``state``; raise :class:`InvalidTransitionError` if the
    table has no such edge."""
    try:
        return table.transitions[(state, event)]
    except KeyError:
        raise InvalidTransitionError(
            f"no transition from {state.name} on {event.name} in a chain of "
            f"{[lv.name for lv in table.levels]}"
        ) from None


class RestoreState(enum.Enum):
    """A shard being restored: PENDING, then READING from one tier, then VERIFIED or, after
    a bad read, back to PENDING for the next tier; EXHAUSTED when no tier had a good copy."""

    PENDING = "pending"
    READING = "reading"
    VERIFIED = "verified"
    EXHAUSTED = "exhausted"


class RestoreEvent(enum.Enum):
    START_READ = "start_read"
    CHECKSUM_OK = "checksum_ok"
    BAD_COPY = "bad_copy"
    NO_MORE_TIERS = "no_more_tiers"


RESTORE_TABLE: Mapping[tuple[RestoreState, RestoreEvent], RestoreState] = MappingProxyType(
    {
        (RestoreState.PENDING, RestoreEvent.START_READ): RestoreState.READING,
        (RestoreState.PENDING, RestoreEvent.NO_MORE_TIERS): RestoreState.EXHAUSTED,
        (RestoreState.READING, RestoreEvent.CHECKSUM_OK): RestoreState.VERIFIED,
        (RestoreState.READING, RestoreEvent.BAD_COPY): RestoreState.PENDING,
    }
)


def advance_restore(state: RestoreState, event: RestoreEvent) -> RestoreState:
    """Apply a restore event; raise :class:`InvalidTransitionError` on a missing edge."""
    try:
        return RESTORE_TABLE[(state, event)]
    except KeyError:
        raise InvalidTransitionError(
            f"no restore transition from {state.name} on {event.name}"
        ) from None
