"""The options of a Checkpointer, defined, defaulted, documented and validated here only.

``Checkpointer(tiers, **options)`` and ``SyncCheckpointer(tiers, **options)`` turn their
keyword arguments into one frozen :class:`CheckpointerOptions` (:meth:`from_kwargs`); the
engine, the capture policy and the preemption handler read that object and never check an
option again. Every check raises :class:`ConfigurationError` naming the option, the values
it accepts and the value it got.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._errors import ConfigurationError
from ._format.manifest import SHARD_ALIGN, LayoutOptions

__all__ = ["Cadence", "CheckpointerOptions", "compile_patterns"]

_DEFAULT_SHARD = 16 << 20


@dataclass(frozen=True)
class Cadence:
    """Which snapshots a tier of the chain takes (``Checkpointer(cadence={name: ...})``).

    A tier with a cadence takes a snapshot when its step is a multiple of ``every``, or
    when at least ``seconds`` have passed since the last snapshot it took in this run (the
    first snapshot of a run counts as due); either condition is enough when both are
    given. A tier without one takes every snapshot. Across ranks, a step decided by
    ``every`` needs no agreement (every rank computes the same answer); a time-based
    choice is agreed (a step is taken when any rank finds it due), so that every rank
    takes the same steps. See docs/design.md ("A cadence per tier").

    Attributes:
        every: take the steps divisible by this (``every=100``: 0, 100, 200, ...).
        seconds: take at most about one snapshot per this many seconds of wall time.
    """

    every: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.every is not None and (type(self.every) is not int or self.every < 1):
            raise _bad("cadence every", "a positive int (take every n-th step) or None", self.every)
        if self.seconds is not None:
            number = not isinstance(self.seconds, bool) and isinstance(self.seconds, int | float)
            if not number or not math.isfinite(self.seconds) or self.seconds <= 0:
                raise _bad("cadence seconds", "seconds > 0 or None", self.seconds)
            object.__setattr__(self, "seconds", float(self.seconds))
        if self.every is None and self.seconds is None:
            raise ConfigurationError(
                "a Cadence needs every=<steps>, seconds=<interval> or both; a tier that "
                "takes every snapshot needs no cadence"
            )

    def due(self, step: int, since_last: float | None) -> bool:
        """Whether ``step`` is taken, ``since_last`` seconds after the last snapshot this
        tier took (None: it took none yet in this run)."""
        if self.every is not None and step % self.every == 0:
            return True
        return self.seconds is not None and (since_last is None or since_last >= self.seconds)

    def describe(self) -> dict[str, Any]:
        """What a manifest records about it (JSON)."""
        doc: dict[str, Any] = {}
        if self.every is not None:
            doc["every"] = self.every
        if self.seconds is not None:
            doc["seconds"] = self.seconds
        return doc

    def __str__(self) -> str:
        parts = [f"every {self.every} steps"] if self.every is not None else []
        if self.seconds is not None:
            parts.append(f"every {self.seconds:g} s")
        return " or ".join(parts)
_DEFAULT_PACK = 1 << 20


@dataclass(frozen=True)
class CheckpointerOptions:
    """Every keyword argument of :class:`Checkpointer` and :class:`SyncCheckpointer`.

    Build it with keyword arguments (``CheckpointerOptions(shard_size=4 << 20)``) or from a
    mapping (:meth:`from_kwargs`); each value is checked when it is built. A Checkpointer's
    options are ``ckpt.options``.

    Attributes:
        shard_size: the unit of copying and writing, in bytes (multiple of 4096). ``None``:
            16 MiB, or a quarter of the host arena if that is smaller.
        pack_bytes: tensors up to this size are packed together into shared shards
            (``None``: 1 MiB or a quarter of ``shard_size``, whichever is smaller).
        allow_pickle: store (and restore) values that are not plain data with pickle. Off by
            default: restoring then never runs code from a checkpoint.
        capture_threads: threads copying CPU tensors into host memory.
        checksum_threads: threads computing the shards' crc32c from host memory after the
            capture, off the guard's path, at a lower scheduling priority (``None``: half
            the cores, at most 8).
        io_concurrency: shards in flight per durable tier.
        deadline: seconds any single tier operation may take before it fails with
            :class:`DeadlineExceededError` (``None``: no deadline); a call that stores
            several shards at once (``put_shards``) has that many times as long.
        retries: how often a failed tier operation (a broken backend, a missed deadline) is
            retried, with exponential back-off from ``retry_backoff`` seconds, before the
            snapshot fails on that tier. A full tier is not retried.
        retry_backoff: the first back-off, in seconds; it doubles with each retry.
        when_busy: ``"wait"`` applies backpressure (the guard waits); ``"skip"`` drops a
            snapshot that could not start at once (a capture is still running, or the host
            arena has no room for it until slower tiers drain), with a
            :class:`SnapshotSkippedWarning`.
        staging_bytes: size of the private arena when the chain has no host tier.
        use_uvloop: run the engine loop on uvloop (``None``: if installed).
        distributed: coordinate commits with the other ranks over torch.distributed
            (``None``: when it is initialized with more than one rank). Then every rank
            must open the Checkpointer, snapshot the same steps in the same order, and
            call ``steps()``/``restore()`` together; see ``docs/distributed.md``.
        on_failure: what a failed snapshot does to training. ``"warn"``: training goes on;
            one warning is logged per failed snapshot and ``metrics()["snapshots_failed"]``
            counts it. ``"raise"``: in addition, the next ``snapshot()`` (or
            ``wait_captured()``, or closing) raises the failure nobody has seen yet. Either
            way the handle's awaitables raise it, no tier it failed on lists it, and the
            guard never raises into the optimizer step.
        eager_bytes: tensors up to this size (bytes) that no guarded optimizer owns are
            copied at ``snapshot()`` instead of lazily: module buffers that the forward pass
            updates (BatchNorm statistics), small frozen tensors, RNG states. See
            ``docs/design.md`` ("Which tensors are captured lazily").
        eager: key patterns (``fnmatch``, e.g. ``"model/ema.*"``) of tensors always copied
            at ``snapshot()``, whatever their size: large tensors changed outside the
            optimizer step.
        lazy: key patterns of tensors never copied at ``snapshot()`` (only ``eager`` wins
            over it): small tensors you know nothing changes before the guard.
        verify_sources: after the last shard of a snapshot is captured, checksum every
            source tensor again and fail the snapshot with ImmutabilityViolationError if
            one changed without its version counter moving (a write through ``.data`` or a
            numpy view). Costs one more read of every captured byte before the guard lets
            go; needs ``guard(mode="cpu")``. See ``docs/guarantees.md``.
        exit_timeout: a Checkpointer never closed (the trainer raised) is closed at
            interpreter exit: its pending snapshots get this many seconds to drain, then
            are abandoned with one warning.
        preemption_signals: signals announcing a preemption (e.g. ``(signal.SIGTERM,)``;
            SIGUSR1 and the like, as schedulers send them). On one of them the handler
            installed at ``open()`` (main thread only) stops taking snapshots (later
            ``snapshot()`` calls return a skipped handle, with a
            :class:`SnapshotSkippedWarning`), drains for at most ``preemption_grace``
            seconds, logs which step is durable on which tier, and then lets the signal
            take its usual course. Closing restores the previous handler. See
            ``docs/guarantees.md`` ("Preemption").
        preemption_grace: seconds the preemption handler drains at most (most schedulers
            kill 30 s after the notice).
        cadence: which snapshots each tier takes, by tier name: ``{"nvme": 10, "s3":
            Cadence(every=100, seconds=1800)}`` (an int n is ``Cadence(every=n)``). A tier
            not named takes every snapshot, and so does the first tier of the chain, always
            (every snapshot lands there first). A tier that skips a step writes nothing for
            it, and its awaitable on the step's handle raises
            :class:`TierSkippedError`; ``committed()`` waits for the tiers that take it.
            See docs/design.md ("A cadence per tier").
        emergency_tiers: the tiers that get an *emergency copy* of the newest snapshot
            when their cadence skipped it, on a preemption signal, ``drain()`` and
            ``close()``: the copy is read back from the fastest tier holding the step,
            verified, and committed within the preemption grace. ``None`` (the default):
            every tier that has a cadence; ``()``: none.
        incremental: write to a durable tier only the shards whose bytes differ from its
            newest committed snapshot (frozen weights, adapters, sparse updates); a step's
            manifest refers to the stored copy of the others and stays restorable on its
            own. ``True``: every shard is still captured, and compared by its crc32c and a
            128-bit SHA-256 digest. ``"versions"``: in addition, a shard whose tensors all
            have the version counter and storage of their last capture (and do not require
            grad) is not captured at all; a write that bypasses the version counter
            (through ``.data``, a numpy view, a custom kernel) is then missed. Tiers that
            cannot refer to stored data (see ``lazyckpt.tier.SupportsReferences``) get
            every shard. See ``docs/guarantees.md`` ("Incremental snapshots").
    """

    shard_size: int | None = None
    pack_bytes: int | None = None
    allow_pickle: bool = False
    capture_threads: int = 2
    checksum_threads: int | None = None
    io_concurrency: int = 4
    deadline: float | None = 300.0
    retries: int = 3
    retry_backoff: float = 0.05
    when_busy: Literal["wait", "skip"] = "wait"
    staging_bytes: int = 256 << 20
    use_uvloop: bool | None = None
    distributed: bool | None = None
    on_failure: Literal["warn", "raise"] = "warn"
    eager_bytes: int = 1 << 20
    eager: tuple[str, ...] = ()
    lazy: tuple[str, ...] = ()
    verify_sources: bool = False
    exit_timeout: float = 10.0
    preemption_signals: tuple[signal.Signals, ...] = ()
    preemption_grace: float = 25.0
    incremental: bool | Literal["versions"] = False
    cadence: Mapping[str, Cadence | int] = dataclasses.field(default_factory=dict)
    emergency_tiers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard_size is not None:
            _integer("shard_size", self.shard_size, SHARD_ALIGN, f"a multiple of {SHARD_ALIGN}")
            if self.shard_size % SHARD_ALIGN:
                raise _bad("shard_size", f"a positive multiple of {SHARD_ALIGN} or None", self.shard_size)
        if self.pack_bytes is not None:
            _integer("pack_bytes", self.pack_bytes, 0, "bytes, or None")
        _flag("allow_pickle", self.allow_pickle)
        _integer("capture_threads", self.capture_threads, 1, "a thread count")
        if self.checksum_threads is not None:
            _integer("checksum_threads", self.checksum_threads, 1, "a thread count, or None")
        _integer("io_concurrency", self.io_concurrency, 1, "a count of shards")
        if self.deadline is not None:
            _seconds("deadline", self.deadline, positive=True, more=" or None")
        _integer("retries", self.retries, 0, "a count")
        _seconds("retry_backoff", self.retry_backoff, positive=False)
        _choice("when_busy", self.when_busy, ("wait", "skip"))
        _integer("staging_bytes", self.staging_bytes, 1, "bytes")
        _optional_flag("use_uvloop", self.use_uvloop)
        _optional_flag("distributed", self.distributed)
        _choice("on_failure", self.on_failure, ("warn", "raise"))
        _integer("eager_bytes", self.eager_bytes, 0, "bytes")
        object.__setattr__(self, "eager", _patterns("eager", self.eager))
        object.__setattr__(self, "lazy", _patterns("lazy", self.lazy))
        _flag("verify_sources", self.verify_sources)
        _seconds("exit_timeout", self.exit_timeout, positive=False)
        object.__setattr__(self, "preemption_signals", _signals(self.preemption_signals))
        _seconds("preemption_grace", self.preemption_grace, positive=True)
        object.__setattr__(self, "preemption_grace", float(self.preemption_grace))
        if type(self.incremental) is not bool and self.incremental != "versions":
            raise _bad("incremental", "False, True or 'versions'", self.incremental)
        object.__setattr__(self, "cadence", _cadences(self.cadence))
        if self.emergency_tiers is not None:
            object.__setattr__(
                self, "emergency_tiers", _names("emergency_tiers", self.emergency_tiers)
            )

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> CheckpointerOptions:
        """The options a Checkpointer was given as keyword arguments; an unknown name raises
        :class:`ConfigurationError` listing the known ones."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigurationError(
                f"unknown Checkpointer options: {unknown}; known: {sorted(known)}"
            )
        return cls(**options)

    def layout(self, arena_capacity: int) -> LayoutOptions:
        """The shard layout for a chain whose host arena holds ``arena_capacity`` bytes:
        the defaults of ``shard_size`` and ``pack_bytes`` resolved."""
        shard_size = self.shard_size
        if shard_size is None:
            # small enough that the arena holds at least four shards at once
            quarter = arena_capacity // 4 // SHARD_ALIGN * SHARD_ALIGN
            shard_size = max(SHARD_ALIGN, min(_DEFAULT_SHARD, quarter))
        pack = min(_DEFAULT_PACK, shard_size // 4) if self.pack_bytes is None else self.pack_bytes
        return LayoutOptions(shard_size=shard_size, pack_bytes=pack)

    def retry_window(self) -> float:
        """The longest a tier operation may take with every retry: ``deadline`` (300 s when
        there is none) per attempt, plus the back-offs."""
        per_call = float(self.deadline or 300.0)
        return per_call * (1 + self.retries) + self.retry_backoff * 2.0 ** (self.retries + 1)


def compile_patterns(patterns: Sequence[str], option: str) -> re.Pattern[str] | None:
    """One regular expression matching any of the shell-style key ``patterns`` (None for
    none); ``option`` names them in the error a bad value raises."""
    found = _patterns(option, patterns)
    if not found:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in found))


def _bad(option: str, accepted: str, value: Any) -> ConfigurationError:
    return ConfigurationError(f"{option} must be {accepted}, got {value!r}")


def _integer(option: str, value: Any, minimum: int, what: str) -> None:
    if type(value) is not int or value < minimum:
        raise _bad(option, f"an int >= {minimum} ({what})", value)


def _seconds(option: str, value: Any, *, positive: bool, more: str = "") -> None:
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not (value > 0 if positive else value >= 0) or value != value:
        raise _bad(option, f"seconds {'> 0' if positive else '>= 0'}{more}", value)


def _flag(option: str, value: Any) -> None:
    if type(value) is not bool:
        raise _bad(option, "True or False", value)


def _optional_flag(option: str, value: Any) -> None:
    if value is not None and type(value) is not bool:
        raise _bad(option, "True, False or None", value)


def _choice(option: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise _bad(option, " or ".join(repr(a) for a in accepted), value)


def _patterns(option: str, value: Any) -> tuple[str, ...]:
    if (
        isinstance(value, str)
        or not isinstance(value, Sequence)
        or not all(isinstance(p, str) for p in value)
    ):
        raise _bad(option, "a list or tuple of key patterns such as 'model/ema.*'", value)
    return tuple(value)


def _cadences(value: Any) -> Mapping[str, Cadence]:
    if not isinstance(value, Mapping):
        raise _bad("cadence", "a mapping of tier names to Cadence(...) or an int", value)
    found: dict[str, Cadence] = {}
    for name, c in value.items():
        if not isinstance(name, str):
            raise _bad("cadence", "keyed by tier names (str)", name)
        if type(c) is int:
            if c < 1:
                raise _bad(f"cadence[{name!r}]", "a positive int (every n-th step)", c)
            c = Cadence(every=c)
        if not isinstance(c, Cadence):
            raise _bad(f"cadence[{name!r}]", "a Cadence(every=..., seconds=...) or an int", c)
        found[name] = c
    return found


def _names(option: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise _bad(option, "a list of tier names, or None", value)
    names = tuple(value)
    if not all(isinstance(n, str) for n in names):
        raise _bad(option, "a list of tier names, or None", value)
    return names


def _signals(value: Any) -> tuple[signal.Signals, ...]:
    if value is None:
        return ()
    if isinstance(value, int) or not isinstance(value, Iterable):
        raise _bad("preemption_signals", "a tuple of signals, e.g. (signal.SIGTERM,)", value)
    found: list[signal.Signals] = []
    for s in value:
        try:
            sig = signal.Signals(s)
        except (ValueError, TypeError):
            raise ConfigurationError(f"preemption_signals: {s!r} is not a signal") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigurationError(f"preemption_signals: {sig.name} cannot be caught")
        found.append(sig)
    return tuple(dict.fromkeys(found))
