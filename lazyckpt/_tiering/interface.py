"""The tier interface: what every storage tier must do, and the optional extras.

A tier stores snapshots, shard by shard, and makes one visible only when it is committed.
The required surface is small (see :class:`Tier`); optional abilities are separate
protocols checked with ``isinstance`` (:class:`SupportsStaging` and the others). Backend
errors are mapped once, at the tier boundary, by :func:`backend_errors`. The public face of
this module is :mod:`lazyckpt.tier`.

Built-in tiers live in the top-level package ``tiers`` and register through the entry-point
group ``lazyckpt.tiers``, exactly as a third-party tier does; ``lazyckpt`` never imports
``tiers``. ``docs/tiers.md`` explains how to write one, and ``lazyckpt.testing.TierTests`` is
the conformance suite it should pass.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import logging
import math
import re
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from .._errors import (
    ConfigurationError,
    LazyCkptError,
    TierBrokenError,
    TierError,
    TierFullError,
)
from .states import TierLevel

if TYPE_CHECKING:
    from .._format.entries import ShardMeta
    from .._format.manifest import Manifest
    from .arena import Block, HostArena

__all__ = [
    "ENTRY_POINT_GROUP",
    "KeepBest",
    "Retention",
    "StepInfo",
    "SupportsBatchPut",
    "SupportsBlockRead",
    "SupportsChecksummedRead",
    "SupportsGlobalCommit",
    "SupportsRankManifests",
    "SupportsReferences",
    "SupportsStaging",
    "Tier",
    "available_tiers",
    "backend_errors",
    "load_tier",
    "puts_batches",
    "reads_checksummed",
    "translate_os_error",
]

ENTRY_POINT_GROUP = "lazyckpt.tiers"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


_log = logging.getLogger("lazyckpt")
_MODES = ("min", "max")
# the policies a Retention combines, in the order describe() writes them
_POLICIES = ("keep_last", "keep_every", "keep_best", "keep_within")


@dataclass(frozen=True)
class StepInfo:
    """What retention may judge a committed step by, beside its number.

    Attributes:
        step: the step.
        created: when the snapshot was taken, in Unix seconds (``Manifest.created``).
        metrics: the metrics passed with the snapshot (``Manifest.metrics``); empty when
            it had none.
    """

    step: int
    created: float
    metrics: Mapping[str, float] = field(default_factory=dict, hash=False)

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> StepInfo:
        """The info of a committed step, from its manifest."""
        return cls(manifest.step, manifest.created, dict(manifest.metrics))


@dataclass(frozen=True)
class KeepBest:
    """Keep the best ``n`` steps by ``metric``: the lowest values with ``mode="min"`` (a
    loss), the highest with ``"max"`` (an accuracy). Ties go to the newer step.

    Raises:
        ConfigurationError: an empty metric name, an ``n`` that is not a positive integer,
            or a mode other than ``"min"`` and ``"max"``.
    """

    metric: str
    n: int
    mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigurationError(
                f"keep_best: the metric must be a non-empty string, got {self.metric!r}"
            )
        if type(self.n) is not int or self.n < 1:
            raise ConfigurationError(f"keep_best: n must be a positive integer, got {self.n!r}")
        if self.mode not in _MODES:
            raise ConfigurationError(
                f"keep_best: mode must be 'min' or 'max', got {self.mode!r}"
            )


@dataclass(frozen=True)
class Retention:
    """Which committed snapshots a tier keeps.

    Each policy keeps some steps; a step is kept when any policy keeps it (the union), and
    the others are deleted. No policy at all keeps everything. The newest committed step is
    always kept.

    - ``keep_last``: the newest k steps.
    - ``keep_every``: every step divisible by n, forever.
    - ``keep_best``: the best n steps by a metric passed with the snapshot
      (:class:`KeepBest`; a tuple ``(metric, n)`` or ``(metric, n, mode)`` is accepted
      too). Steps without that metric are kept only by the other policies; while *no* step
      has it (a misspelt name, or no evaluation yet), it keeps every step, so that nothing
      is deleted by surprise, and says so once in a warning.
    - ``keep_within``: the steps created less than this many seconds before now.

    ``keep_best`` and ``keep_within`` judge a step by its :class:`StepInfo`; with either set
    (:meth:`needs_info`), a step whose info is missing is kept: retention never deletes
    what it cannot judge.

    Raises:
        ConfigurationError: a policy given a value it cannot keep by (zero, negative, not a
            whole number, a ``keep_within`` that is not a positive finite number of
            seconds), naming the policy.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: KeepBest | None = None
    keep_within: float | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise ConfigurationError(f"{name} must be a positive integer or None, got {v!r}")
        best: object = self.keep_best
        if isinstance(best, tuple | list) and len(best) in (2, 3):
            object.__setattr__(self, "keep_best", KeepBest(*best))
        elif best is not None and not isinstance(best, KeepBest):
            raise ConfigurationError(
                "keep_best must be a lazyckpt.KeepBest, a tuple (metric, n) or "
                f"(metric, n, mode), or None, got {best!r:.80}"
            )
        within: object = self.keep_within
        if within is not None:
            if (
                not isinstance(within, int | float)
                or isinstance(within, bool)
                or not math.isfinite(within)
                or within <= 0
            ):
                raise ConfigurationError(
                    "keep_within must be a positive, finite number of seconds or None, "
                    f"got {within!r:.80}"
                )
            object.__setattr__(self, "keep_within", float(within))
        # the metrics a warning has been given about (once each); not a field
        object.__setattr__(self, "_warned", set())

    def needs_info(self) -> bool:
        """Whether a policy judges steps by their :class:`StepInfo` (``keep_best``,
        ``keep_within``): the caller must then pass ``info`` to :meth:`to_delete` and
        :meth:`reasons`."""
        return self.keep_best is not None or self.keep_within is not None

    def to_delete(
        self,
        steps: Iterable[int],
        info: Mapping[int, StepInfo] | None = None,
        *,
        now: float | None = None,
    ) -> list[int]:
        """Steps to delete, ascending, given the committed ``steps``.

        Args:
            steps: the committed steps (any order).
            info: each step's :class:`StepInfo`; needed when :meth:`needs_info` (a step
                missing from it is kept), ignored otherwise.
            now: the time ``keep_within`` counts back from (default: ``time.time()``).

        Raises:
            ValueError: ``info`` is None and a policy needs it.
        """
        return [step for step, why in self.reasons(steps, info, now=now).items() if not why]

    def reasons(
        self,
        steps: Iterable[int],
        info: Mapping[int, StepInfo] | None = None,
        *,
        now: float | None = None,
    ) -> dict[int, list[str]]:
        """Every one of ``steps``, ascending, with the reasons it is kept (``"newest"``,
        ``"last 3"``, ``"every 100th"``, ``"best 2 by val_loss (min): 2.1"``,
        ``"within 1h"``, ``"no info"``, ``"no retention policy"``); an empty list means
        :meth:`to_delete` deletes it. Arguments and errors as for :meth:`to_delete`."""
        ordered = sorted(set(steps))
        why: dict[int, list[str]] = {step: [] for step in ordered}
        if not ordered:
            return why
        if not self.describe():
            for step in ordered:
                why[step].append("no retention policy")
            return why
        if info is None and self.needs_info():
            raise ValueError(
                "this retention keeps steps by keep_best or keep_within: pass each step's "
                "StepInfo (Retention.needs_info() says when)"
            )
        why[ordered[-1]].append("newest")
        if self.keep_last is not None:
            for step in ordered[-self.keep_last :]:
                why[step].append(f"last {self.keep_last}")
        if self.keep_every is not None:
            every = _every(self.keep_every)
            for step in ordered:
                if step % self.keep_every == 0:
                    why[step].append(every)
        fallback = None
        if info is not None and self.needs_info():
            if self.keep_best is not None:
                fallback = self._keep_best(self.keep_best, ordered, info, why)
            if self.keep_within is not None:
                cutoff = (time.time() if now is None else now) - self.keep_within
                within = f"within {_duration(self.keep_within)}"
                for step in ordered:
                    found = info.get(step)
                    if found is not None and found.created >= cutoff:
                        why[step].append(within)
            for step in ordered:
                if step not in info:
                    why[step].append("no info")
        if fallback is not None:
            self._warn_no_metric([step for step in ordered if why[step] == [fallback]])
        return why

    def _keep_best(
        self,
        best: KeepBest,
        ordered: list[int],
        info: Mapping[int, StepInfo],
        why: dict[int, list[str]],
    ) -> str | None:
        """Add ``keep_best``'s reasons to ``why``; the reason it gave every step when no
        step has the metric, None otherwise."""
        scored: list[tuple[float, int]] = []
        for step in ordered:
            found = info.get(step)
            value = None if found is None else found.metrics.get(best.metric)
            if (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            ):
                scored.append((float(value), step))
        if not scored:
            # no step has the metric: a misspelt name, or none evaluated yet. Keep every
            # step rather than let the other policies delete what this one was meant to keep
            reason = f"no step has {best.metric}"
            for step in ordered:
                why[step].append(reason)
            return reason
        sign = 1.0 if best.mode == "min" else -1.0
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
        for value, step in scored[: best.n]:
            why[step].append(f"best {best.n} by {best.metric} ({best.mode}): {value:g}")
        return None

    def _warn_no_metric(self, spared: list[int]) -> None:
        """Say, once per metric and instance, that ``keep_best`` kept ``spared`` (steps
        no other policy keeps) because no step has its metric."""
        assert self.keep_best is not None
        metric = self.keep_best.metric
        warned: set[str] = self.__dict__["_warned"]
        if not spared or metric in warned:
            return
        warned.add(metric)
        _log.warning(
            "retention keep_best: no committed step has the metric %r, so no step is deleted "
            "until one has it (kept: steps %s); check the name passed in "
            "snapshot(..., metrics=)",
            metric,
            _steps_text(spared),
        )

    def describe(self) -> dict[str, Any]:
        """The policies set, as JSON-able values (what :meth:`from_description` reads);
        ``{}`` when it keeps everything."""
        doc: dict[str, Any] = {}
        if self.keep_last is not None:
            doc["keep_last"] = self.keep_last
        if self.keep_every is not None:
            doc["keep_every"] = self.keep_every
        if self.keep_best is not None:
            best = self.keep_best
            doc["keep_best"] = {"metric": best.metric, "n": best.n, "mode": best.mode}
        if self.keep_within is not None:
            doc["keep_within"] = self.keep_within
        return doc

    @classmethod
    def from_description(cls, doc: Mapping[str, Any]) -> Retention:
        """The retention :meth:`describe` described.

        Raises:
            ConfigurationError: ``doc`` is not such a description (a policy this lazyckpt
                does not know, or a bad value), naming what is wrong.
        """
        if not isinstance(doc, Mapping):
            raise ConfigurationError(f"a retention description is a mapping, got {doc!r:.80}")
        unknown = sorted(str(k) for k in doc if k not in _POLICIES)
        if unknown:
            raise ConfigurationError(f"retention description: unknown policies {unknown}")
        best: Any = doc.get("keep_best")
        if isinstance(best, Mapping):
            odd = sorted(str(k) for k in best if k not in ("metric", "n", "mode"))
            if odd or "metric" not in best or "n" not in best:
                raise ConfigurationError(f"retention description: bad keep_best {best!r:.80}")
            best = KeepBest(best["metric"], best["n"], best.get("mode", "min"))
        elif isinstance(best, list):
            best = tuple(best)  # normalised (or refused) by the constructor
        return cls(
            keep_last=doc.get("keep_last"),
            keep_every=doc.get("keep_every"),
            keep_best=best,
            keep_within=doc.get("keep_within"),
        )


def _every(n: int) -> str:
    """``keep_every``'s reason: ``"every 100th"``, ``"every 2nd"``, ``"every step"``."""
    if n == 1:
        return "every step"
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"every {n}{suffix}"


def _duration(seconds: float) -> str:
    """A duration the way ``--keep-within`` takes it: ``2d``, ``6h``, ``30m``, ``90s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _steps_text(steps: Sequence[int]) -> str:
    """Steps for a message, the middle elided past a few."""
    shown = [str(s) for s in steps]
    if len(shown) > 6:
        shown = [*shown[:3], "...", *shown[-2:]]
    return ", ".join(shown)


class Tier(abc.ABC):
    """Base class of every storage tier.

    A subclass sets ``level`` and implements the abstract coroutines. Constructors do no I/O;
    :meth:`open` does (create directories, clean up what a crash left behind). Retention is
    given as ``keep_last``/``keep_every`` or as one :class:`Retention` (``retention=``, which
    also holds ``keep_best`` and ``keep_within``), not both; it is :attr:`retention`.

    ``readonly`` (set by the constructor of a tier that offers it, or by whoever opens the
    tier for reading only, before :meth:`open`) asks for a tier that only reads: ``open``
    then creates, deletes and locks nothing, a missing location is
    :class:`~lazyckpt.SnapshotNotFoundError`, and the writing coroutines refuse. A tier that
    ignores it keeps working; it then simply opens as it always did.

    Contract for ``open`` when writing: clean up only what the tier can prove is its own
    uncommitted leftover, refuse a location another kind of store wrote
    (:class:`~lazyckpt.ForeignLocationError`), and refuse a second writer on the same location
    (:class:`~lazyckpt.LocationInUseError`).

    Contract for the coroutines, which the conformance suite checks:

    - ``begin(m)`` then any number of ``put_shard(m, shard, data)`` (concurrently, in any
      order), then ``commit(m)`` makes step ``m.step`` visible to ``steps()`` atomically:
      before ``commit`` returns it is not listed, after it is, with every shard durable.
    - ``abort(step)`` drops whatever an uncommitted step wrote; it is idempotent.
    - ``read_shard(m, shard, out)`` fills ``out`` (exactly ``shard.length`` bytes) with the
      stored bytes. It need not verify checksums (the engine does) but must raise
      :class:`~lazyckpt.CorruptionError` for missing or short data.
    - ``delete(step)`` un-commits first, then removes the data.
    - Backend failures are raised as :class:`~lazyckpt.TierError` subclasses, mapped once
      at the tier's boundary (:func:`backend_errors`).

    Which rank of how many ranks the instance serves is handed in with :meth:`bind` (by a
    distributed Checkpointer, before :meth:`open`) and read as :attr:`rank` and
    :attr:`world_size`; an instance never bound serves rank 0 of 1.
    """

    level: TierLevel = TierLevel.LOCAL
    default_name: str = "tier"
    #: The URL schemes whose locations the ``lazyckpt`` command opens with this tier, given
    #: the whole URL (``("s3",)``); ``"file"`` means local paths, given as the path.
    url_schemes: ClassVar[tuple[str, ...]] = ()
    #: A file at the root of a local directory that says the directory is in this tier's
    #: format (``"zarr.json"``): the command opens such a directory with this tier.
    location_marker: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        name: str | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        retention: Retention | None = None,
    ) -> None:
        self.name = self.default_name if name is None else name
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigurationError(
                f"tier name must be 1-64 letters, digits, '_', '.' or '-', got {self.name!r}"
            )
        if retention is None:
            retention = Retention(keep_last=keep_last, keep_every=keep_every)
        elif keep_last is not None or keep_every is not None:
            raise ConfigurationError(
                f"tier {self.name!r}: give either retention= or keep_last=/keep_every=, not "
                "both (Retention(keep_last=..., keep_every=...) holds them all)"
            )
        elif not isinstance(retention, Retention):
            raise ConfigurationError(
                f"tier {self.name!r}: retention must be a lazyckpt.Retention, got "
                f"{retention!r:.80}"
            )
        #: which committed steps this tier keeps (:class:`Retention`)
        self.retention = retention
        self._rank = 0
        self._world_size = 1
        self.readonly = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    @property
    def rank(self) -> int:
        """The rank this instance serves (0 unless :meth:`bind` said otherwise)."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many ranks write through instances of this tier (1 unless bound)."""
        return self._world_size

    def bind(self, rank: int, world_size: int) -> None:
        """Hand the tier the rank it serves and the number of ranks.

        A distributed Checkpointer calls this on every tier of its chain before
        :meth:`open`, once it knows its place in the job; a tier used by a single process is
        never bound and serves rank 0 of 1. A tier that keeps per-rank state (a lock per
        rank, a data file per rank) reads :attr:`rank` and :attr:`world_size` from
        :meth:`open` on. A tier that wraps another forwards the call (override it, and call
        ``super().bind``).

        Raises:
            ConfigurationError: ``rank`` is not in ``range(world_size)``.
        """
        if (
            type(rank) is not int
            or type(world_size) is not int
            or world_size < 1
            or not 0 <= rank < world_size
        ):
            raise ConfigurationError(
                f"tier {self.name!r}: rank {rank!r} of world size {world_size!r} is not a "
                "rank of the job; bind(rank, world_size) needs 0 <= rank < world_size"
            )
        self._rank, self._world_size = rank, world_size

    async def open(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Prepare the backend (I/O allowed); called once by the Checkpointer.

        With ``self.readonly`` set, it must not create, delete or lock anything.
        """

    @abc.abstractmethod
    async def begin(self, manifest: Manifest) -> None:
        """Get ready to receive the shards of ``manifest.step``."""

    @abc.abstractmethod
    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        """Store ``data`` (``shard.length`` bytes) durably. Do not keep ``data`` afterwards."""

    @abc.abstractmethod
    async def commit(self, manifest: Manifest) -> None:
        """Make the snapshot visible, atomically, with its manifest."""

    @abc.abstractmethod
    async def abort(self, step: int) -> None:
        """Remove what an uncommitted snapshot of ``step`` left; idempotent."""

    @abc.abstractmethod
    async def steps(self) -> list[int]:
        """Committed steps, ascending."""

    @abc.abstractmethod
    async def read_manifest(self, step: int) -> Manifest:
        """The manifest of a committed step; :class:`SnapshotNotFoundError` if there is none."""

    @abc.abstractmethod
    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        """Fill ``out`` with the shard's stored bytes."""

    @abc.abstractmethod
    async def delete(self, step: int) -> None:
        """Un-commit, then remove, a committed step."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the backend. Further calls raise :class:`TierClosedError`."""

    def describe(self) -> dict[str, Any]:
        """What the manifest records about this tier (never credentials)."""
        return {"name": self.name, "type": type(self).__qualname__, "level": self.level.name}


@runtime_checkable
class SupportsStaging(Protocol):
    """A host-memory tier whose arena receives captures directly (zero copy).

    The engine allocates blocks from ``arena``, captures into them, then hands each to the
    tier with :meth:`adopt`; ``commit`` then keeps the snapshot for fast restore until the
    arena needs the space (the arena reports that through :meth:`evicted`).
    """

    @property
    def arena(self) -> HostArena: ...

    def adopt(self, manifest: Manifest, shard: ShardMeta, block: Block) -> None: ...

    def evicted(self, block: Block) -> None:
        """The arena reclaimed an adopted block: its snapshot is no longer whole here."""

    def forget(self, step: int) -> None:
        """Drop a snapshot whose capture failed, giving its blocks back to the arena."""


@runtime_checkable
class SupportsBatchPut(Protocol):
    """A tier that stores several shards of one snapshot in one call.

    The engine hands a durable tier the shards that were captured together (up to 64 MiB)
    in one :meth:`put_shards` instead of one :meth:`Tier.put_shard` each: one job for the
    tier's I/O thread and one wake-up of the engine's loop for the lot, which is what a
    launch-bound training thread pays for (docs/design.md, "Staying out of the training
    thread's way"). It is used on the first durable tier of a chain only, and only where
    the class that defines ``put_shards`` also defines the ``put_shard`` in effect: a
    subclass that overrides ``put_shard`` alone still gets every shard through it.
    """

    async def put_shards(
        self, manifest: Manifest, shards: Sequence[ShardMeta], data: Sequence[memoryview]
    ) -> None:
        """Store ``data[j]`` as ``shards[j]`` for every ``j``, as :meth:`Tier.put_shard` of
        each would: when it returns, every one is as durable as ``put_shard`` leaves a
        shard. When it raises, any of them may be stored or not; the engine then retries
        the whole call or fails the snapshot on this tier. Do not keep ``data``."""


def _variant_in_effect(tier: object, plain: str, variant: str) -> bool:
    """Whether the method ``variant`` of ``tier`` is defined by the class defining the
    ``plain`` method in effect, or by a subclass of it: a subclass that overrides ``plain``
    alone (a test's counting or slow tier, a user's hook) keeps every call going through
    its ``plain``."""
    mro = type(tier).__mro__
    owner = {name: next((c for c in mro if name in vars(c)), None) for name in (plain, variant)}
    fast, single = owner[variant], owner[plain]
    return fast is not None and single is not None and issubclass(fast, single)


def puts_batches(tier: object) -> bool:
    """Whether the engine hands ``tier`` batches of shards (:class:`SupportsBatchPut`):
    only where ``put_shards`` is defined by the class defining the ``put_shard`` in effect,
    or a subclass of it (a subclass overriding ``put_shard`` alone keeps it in use)."""
    return isinstance(tier, SupportsBatchPut) and _variant_in_effect(tier, "put_shard", "put_shards")


def reads_checksummed(tier: object) -> bool:
    """Whether a verified read takes ``tier``'s checksummed read
    (:class:`SupportsChecksummedRead`): only where ``read_shard_checksummed`` is defined by
    the class defining the ``read_shard`` in effect, or a subclass of it (a subclass
    overriding ``read_shard`` alone keeps it in use)."""
    return isinstance(tier, SupportsChecksummedRead) and _variant_in_effect(
        tier, "read_shard", "read_shard_checksummed"
    )


@runtime_checkable
class SupportsGlobalCommit(Protocol):
    """A tier that can hold a snapshot written by several ranks.

    With ``world_size > 1``, :meth:`Tier.commit` only makes *this rank's* part durable (its
    manifest); the step becomes visible to ``steps()`` when :meth:`commit_global` writes the
    commit record, which the engine does on every rank once all ranks' parts are durable.
    ``read_manifest(step)`` then returns this tier's rank's manifest (``tier.rank``).
    """

    async def commit_global(self, step: int, world_size: int) -> None:
        """Make ``step``, written by ``world_size`` ranks, visible to :meth:`Tier.steps`.

        Called on every rank, once every rank's :meth:`Tier.commit` returned and the ranks
        agreed; rank 0 (``self.rank == 0``) writes the commit record, the others may check
        what they can see of it and write nothing. Idempotent: a retry, or a call for a
        step already committed, succeeds. With ``world_size == 1`` :meth:`Tier.commit`
        already published the step, and this does nothing.
        """
        ...


@runtime_checkable
class SupportsBlockRead(Protocol):
    """A tier that lends the host block holding a shard instead of copying it out (the
    host-memory tier): a rollback then goes from the pinned arena to the device directly."""

    def borrow_shard(self, manifest: Manifest, shard: ShardMeta) -> Block | None:
        """The block holding ``shard``, held for the caller; None if it is not here."""
        ...

    def return_shard(self, block: Block) -> None:
        """Drop the hold :meth:`borrow_shard` took."""
        ...


@runtime_checkable
class SupportsChecksummedRead(Protocol):
    """A tier that computes a shard's crc32c while it reads it (the file tier).

    Reading a shard and then checksumming it reads every byte twice, the second time from
    memory after it has left the cache; a tier with this capability checksums each piece as
    soon as it has landed in ``out``, on the thread that read it, and returns the whole
    shard's crc32c (:func:`crc32c_combine` joins the pieces' checksums). The reader compares
    it with the manifest's, as for any tier: the checksum must be computed over the bytes
    in ``out`` after they landed there (not taken from the stored copy's metadata), so that
    it still checks the copy end to end.

    ``read_alignment`` says where ``out`` should start for the tier to read into it without
    a copy (a file read with ``O_DIRECT`` needs block-aligned memory): a restore allocates
    the tensors it creates at that alignment. 1 means any address.
    """

    read_alignment: int

    async def read_shard_checksummed(
        self, manifest: Manifest, shard: ShardMeta, out: memoryview
    ) -> int:
        """Fill ``out`` as :meth:`Tier.read_shard` does and return the crc32c of the bytes
        that landed in it."""
        ...


@runtime_checkable
class SupportsRankManifests(Protocol):
    """A tier that can read any rank's part of a multi-rank step (one shared store).

    ``read_rank_manifest(step, r)`` returns rank ``r``'s manifest; ``read_shard`` with it
    reads rank ``r``'s data. Replicated tensors are written once only when every durable
    tier has this, and resharding reads other ranks' chunks through it.
    """

    async def read_rank_manifest(self, step: int, rank: int) -> Manifest: ...


@runtime_checkable
class SupportsReferences(Protocol):
    """A tier that stores incremental snapshots (``Checkpointer(incremental=True)``).

    A shard of a committed manifest may name, in ``ShardMeta.stored_in``, an earlier step
    whose stored data holds its bytes, at the same place (the same stream offset, in the
    data of the same rank). The engine then calls no ``put_shard`` for it. Such a tier:

    - ``read_shard(m, shard, out)`` reads a referring shard from the step it names;
    - ``delete(step)`` un-commits the step but keeps its stored data while any committed
      step refers to it;
    - :meth:`collect` removes the stored data that nothing needs any more;
    - ``begin(m)`` refuses a step number whose stored data a committed step refers to;
    - ``open()`` sweeps what a crash left only when no committed step refers to it.
    """

    async def collect(self, keep: Collection[int] = ()) -> list[int]:
        """Remove the stored data of every step that is not committed, that no committed
        step refers to, and that is not in ``keep`` (the steps snapshots still in flight
        refer to); the steps whose data was removed, ascending."""
        ...


def translate_os_error(
    exc: OSError, tier: str, what: str, *, scrub: Callable[[str], str] | None = None
) -> TierError:
    """An ``OSError`` as the lazyckpt error a user can act on (cause kept by the caller): out
    of space or quota is :class:`~lazyckpt.TierFullError`, anything else
    :class:`~lazyckpt.TierBrokenError`. The message names the file the call failed on, when
    the error says which; ``scrub`` removes secrets from the text."""
    where = f" ({exc.filename})" if exc.filename is not None else ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text = f"out of space ({exc.strerror}){where}"
        return TierFullError(f"{what}: {scrub(text) if scrub else text}", tier=tier)
    if exc.strerror is None:  # an OSError subclass of a client library: its own words
        return TierBrokenError(f"{what}: {_summary(exc, scrub)}{where}", tier=tier)
    text = f"{exc.strerror}{where}"
    return TierBrokenError(f"{what}: {scrub(text) if scrub else text}", tier=tier)


_XML_CODE = re.compile(r"<Code>\s*([^<]{1,100}?)\s*</Code>")
_XML_MESSAGE = re.compile(r"<Message>\s*([^<]{1,300}?)\s*</Message>")


def _summary(exc: BaseException, scrub: Callable[[str], str] | None) -> str:
    """The type and first line of an exception, at most 300 characters, scrubbed. An
    object store's XML error body (S3 and its clones answer ``<Error><Code>...``) may sit
    on later lines, after the status line: its code and message are what a user acts on
    (``SignatureDoesNotMatch``, ``InvalidAccessKeyId``, ``NoSuchBucket``), so they are
    added wherever they are in the text."""
    full = str(exc).strip()
    text = (full.splitlines() or [""])[0]
    code, message = _XML_CODE.search(full), _XML_MESSAGE.search(full)
    if code is not None:
        text = text.removesuffix('<?xml version="1.0" encoding="UTF-8"?>').rstrip(" :")
        detail = code.group(1) + (f" ({message.group(1)})" if message is not None else "")
        text = f"{text}: {detail}" if text else detail
    if scrub is not None:
        text = scrub(text)
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


@contextlib.contextmanager
def backend_errors(
    tier: str,
    what: str,
    *,
    scrub: Callable[[str], str] | None = None,
    refine: Callable[[Exception], LazyCkptError | None] | None = None,
) -> Iterator[None]:
    """Map what a backend raises inside the block into lazyckpt's error tree, once.

    The one translation of backend errors, used at the boundary of every tier (and by the
    engine around each tier call, for a tier that does not use it)::

        with backend_errors(self.name, f"write shard {shard.index} to {path}"):
            await self._write(...)

    Errors of lazyckpt's tree pass unchanged (a tier raises those on purpose); ``refine``,
    when given, maps what only this backend can recognise (a missing bucket, say); an
    ``OSError`` goes through :func:`translate_os_error` (out of space is
    :class:`~lazyckpt.TierFullError`); any other ``Exception`` becomes
    :class:`~lazyckpt.TierBrokenError` naming its type and first line. The original is the
    new error's ``__cause__`` (``refine``'s errors carry none: they say all there is).
    Cancellation and other ``BaseException`` pass untouched.

    Args:
        tier: the tier's name, which the error carries.
        what: the operation, for the message (``"read manifest /ckpt/step-.../x.json"``).
        scrub: removes secrets (credentials in a URL, say) from backend messages.
        refine: a backend's own mapping, tried first; ``None`` from it means "not mine".
    """
    try:
        yield
    except LazyCkptError:
        raise
    except Exception as exc:
        refined = refine(exc) if refine is not None else None
        if refined is not None:
            raise refined from None
        if isinstance(exc, OSError):
            raise translate_os_error(exc, tier, what, scrub=scrub) from exc
        raise TierBrokenError(f"{what}: {_summary(exc, scrub)}", tier=tier) from exc


def available_tiers() -> dict[str, Callable[..., Tier]]:
    """Tier classes registered under the ``lazyckpt.tiers`` entry-point group, by name."""
    found: dict[str, Callable[..., Tier]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            found[ep.name] = ep.load()
        except Exception as exc:  # a broken plugin must not hide the others
            raise ConfigurationError(
                f"tier plugin {ep.name!r} ({ep.value}) failed to load: {exc}"
            ) from exc
    return found


def load_tier(kind: str, *args: Any, **kwargs: Any) -> Tier:
    """Build a registered tier by its entry-point name: ``load_tier("file", "/nvme/run1")``."""
    tiers = available_tiers()
    try:
        cls = tiers[kind]
    except KeyError:
        raise ConfigurationError(
            f"no tier named {kind!r} is registered; available: {sorted(tiers)}"
        ) from None
    tier = cls(*args, **kwargs)
    if not isinstance(tier, Tier):
        raise ConfigurationError(f"entry point {kind!r} did not produce a lazyckpt Tier")
    return tier

