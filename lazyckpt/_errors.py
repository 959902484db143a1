"""The one error tree of lazyckpt.

Every error lazyckpt raises on purpose derives from :class:`LazyCkptError`, so a trainer can
catch everything the library means with one ``except``. A backend's own exception (an
``OSError``, an S3 client error) is translated once, at the tier boundary, and kept as
``__cause__``.

    LazyCkptError
    ├── ConfigurationError        you asked for something that cannot work (bad arguments)
    │   ├── UnsupportedStateError a state that cannot be checkpointed (sparse tensor, pickle refused)
    │   ├── ForeignLocationError  a tier's location holds what another kind of store wrote, or
    │   │                         something the tier does not understand (nothing is deleted)
    │   ├── LocationInUseError    another writer holds the location (``holder`` says who)
    │   └── StateMismatchError    restore(into=...) names keys the snapshot does not have
    ├── InvalidTransitionError    a shard was moved against the state table (a bug, never your fault)
    ├── ImmutabilityViolationError a tensor changed in place before its capture finished
    ├── CorruptionError           stored bytes or a manifest fail their checksum or do not parse
    ├── SnapshotNotFoundError     no committed snapshot matches the request
    ├── SnapshotFailedError       a snapshot failed; also an ExceptionGroup of the shard failures
    ├── CheckpointerClosedError   the Checkpointer was closed
    ├── DeadlineExceededError     a tier or a peer did not answer in time
    └── TierError                 a tier failed (with the tier's name)
        ├── TierClosedError       you closed the tier
        ├── TierBrokenError       the backend failed; ``__cause__`` says how
        └── TierFullError         the backend is out of space
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CheckpointerClosedError",
    "ConfigurationError",
    "CoordinationError",
    "CorruptionError",
    "DeadlineExceededError",
    "ForeignLocationError",
    "ImmutabilityViolationError",
    "InvalidTransitionError",
    "LazyCkptError",
    "LocationInUseError",
    "SnapshotFailedError",
    "SnapshotInFlightError",
    "SnapshotNotFoundError",
    "SnapshotSkippedError",
    "SnapshotSkippedWarning",
    "StateMismatchError",
    "TierBrokenError",
    "TierClosedError",
    "TierError",
    "TierFullError",
    "TierSkippedError",
    "UnsupportedStateError",
    "first_error",
]


class LazyCkptError(Exception):
    """Root of every error lazyckpt raises on purpose."""


class ConfigurationError(LazyCkptError, ValueError):
    """An argument or a combination of arguments that cannot work."""


class UnsupportedStateError(ConfigurationError, TypeError):
    """Part of the state cannot be checkpointed as given; the message names its key."""


class ForeignLocationError(ConfigurationError):
    """A tier was opened on a location that another kind of store wrote (a Zarr tier's
    directory given to a file tier, say), or that holds something it cannot prove is its own.

    The tier deletes nothing there. ``location`` is the path or URL; the message says what was
    found and what to do.
    """

    def __init__(self, message: str, *, location: str) -> None:
        self.location = location
        super().__init__(message)


class LocationInUseError(ConfigurationError):
    """Another writer holds the location: two writers on one location corrupt each other.

    ``location`` is the path or URL, ``holder`` what the holder recorded about itself (process
    id, host, since when), or ``None`` when it could not be read. Readers (a restore, the
    command line) never need the location to be free.
    """

    def __init__(self, message: str, *, location: str, holder: dict[str, object] | None) -> None:
        self.location = location
        self.holder = holder
        super().__init__(message)


class StateMismatchError(ConfigurationError):
    """The keys of a ``restore(into=...)`` target do not match the snapshot's.

    Raised before anything is loaded. ``key`` is the path of the mapping or module that
    differs (``""`` for the top level), ``missing`` the keys the target has and the snapshot
    lacks, ``unexpected`` the keys the snapshot has and the target lacks. For an optimizer
    whose parameter groups differ from the snapshot's, the keys are parameter indexes.

    Also raised, with the object's error as ``__cause__``, when a Stateful object's own
    ``load_state_dict`` refuses the snapshot's state after every check passed: then the
    target is partly restored (the message says so).
    """

    def __init__(
        self, message: str, *, key: str, missing: Sequence[object], unexpected: Sequence[object]
    ) -> None:
        super().__init__(message)
        self.key = key
        self.missing = list(missing)
        self.unexpected = list(unexpected)


class InvalidTransitionError(LazyCkptError):
    """A shard was asked to move along an edge that its state table does not have."""


class ImmutabilityViolationError(LazyCkptError):
    """A tensor was modified in place before its capture completed.

    The snapshot that held it is never committed. Call ``await ckpt.wait_captured()`` (or use
    ``ckpt.guard(optimizer)``) before mutating snapshotted tensors.
    """

    def __init__(
        self, key: str, step: int, recorded: int, found: int, *, message: str | None = None
    ) -> None:
        self.key = key
        self.step = step
        super().__init__(
            message
            or f"tensor {key!r} of step {step} was modified in place before its capture "
            f"finished (version {recorded} at snapshot(), {found} at capture); the snapshot "
            "is not committed. Await ckpt.wait_captured() or use ckpt.guard(optimizer) "
            "before the optimizer step; a tensor that changes outside the optimizer step (a "
            "buffer updated in forward) must be copied at snapshot(): list its key in "
            "Checkpointer(eager=[...]) or raise eager_bytes."
        )

    @classmethod
    def changed_bytes(cls, key: str, step: int) -> ImmutabilityViolationError:
        """The ``verify_sources`` check found ``key``'s bytes changed after its capture
        although its version counter did not move."""
        return cls(
            key,
            step,
            -1,
            -1,
            message=f"tensor {key!r} of step {step} changed while the snapshot was being "
            "captured, without its version counter moving (a write through .data, a numpy "
            "view or a custom kernel); the snapshot is not committed. Make such writes "
            "after the guard (or wait_captured()), or list the key in "
            "Checkpointer(eager=[...]).",
        )


class CorruptionError(LazyCkptError):
    """Stored data failed its checksum, was truncated or missing, or a manifest is damaged."""


class SnapshotNotFoundError(LazyCkptError, LookupError):
    """No committed snapshot matches what was asked for."""


class CheckpointerClosedError(LazyCkptError):
    """The Checkpointer was closed; open a new one."""


class DeadlineExceededError(LazyCkptError, TimeoutError):
    """A tier or a peer did not finish within its configured deadline."""


class TierError(LazyCkptError):
    """A storage tier failed. ``tier`` names it."""

    def __init__(self, message: str, *, tier: str) -> None:
        self.tier = tier
        super().__init__(f"tier {tier!r}: {message}")


class TierClosedError(TierError):
    """The tier was closed by its owner."""


class TierBrokenError(TierError):
    """The tier's backend failed; the original exception is ``__cause__``."""


class TierFullError(TierError):
    """The tier's backend is out of space (ENOSPC, quota, arena too small)."""


class SnapshotSkippedWarning(UserWarning):
    """A snapshot was dropped because the pipeline was busy (``when_busy="skip"``)."""


class SnapshotSkippedError(LazyCkptError):
    """Raised by the awaitables of a skipped snapshot's handle: it was never taken."""


class TierSkippedError(SnapshotSkippedError):
    """Raised by ``handle.reached(tier)`` (and ``wait(tier)``) for a tier whose cadence
    does not take that snapshot (``Checkpointer(cadence=...)``): the step is not written
    there. ``step`` is the step, ``tier`` the tier's name."""

    def __init__(self, message: str, *, step: int, tier: str) -> None:
        super().__init__(message)
        self.step = step
        self.tier = tier


class SnapshotInFlightError(LazyCkptError):
    """``delete(step)`` was asked for a step that is still on its way through the tiers
    (or being restored). Await its handle's ``committed()`` (or the restore) first."""


class CoordinationError(LazyCkptError):
    """The ranks disagree about what they are committing (different steps, different order),
    or another rank refused a restore the ranks make together (its error is in the message;
    nothing was loaded)."""


class SnapshotFailedError(ExceptionGroup[Exception], LazyCkptError):
    """A snapshot failed. The group holds each shard's or tier's failure.

    ``step`` is the step; ``tiers`` the names of the tiers on which it is not committed.
    """

    step: int
    tiers: tuple[str, ...]

    def __new__(
        cls, message: str, errors: Sequence[Exception], *, step: int, tiers: Sequence[str] = ()
    ) -> SnapshotFailedError:
        self = super().__new__(cls, message, list(errors))
        self.step = step
        self.tiers = tuple(tiers)
        return self

    def __init__(
        self, message: str, errors: Sequence[Exception], *, step: int, tiers: Sequence[str] = ()
    ) -> None:
        super().__init__(message, list(errors))

    def derive(self, excs: Sequence[Exception]) -> SnapshotFailedError:  # type: ignore[override]
        return SnapshotFailedError(self.message, excs, step=self.step, tiers=self.tiers)


def first_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first leaf error of an exception group (nested groups followed to their first
    member): what a task group's failure reports, as ``raise first_error(group) from None``.

    A task group raises every child's failure at once; the first is the one that failed
    first, and the others are usually the cancellations or consequences it caused.
    """
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first
