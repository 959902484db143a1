"""Which tiers take which snapshot: the chain's cadences (``Checkpointer(cadence=...)``).

Every snapshot lands in host memory and on the first tier of the chain; each later tier
takes the steps its :class:`~lazyckpt.Cadence` picks (all of them without one). The choice
is made once per snapshot, at ``snapshot()``, and fixed on the flight (``Flight.decide``)
before any tier sees it: the flight then runs through exactly those stages, with a state
table built for them (``_tiering.states.build_table``), so a skipped tier is never an
``if`` inside a shard's flow.

Across ranks every rank must take the same steps on the same tiers, since a step is
committed on a tier only when every rank's part is there. A cadence by step number
(``every``) is the same function of the step everywhere. A cadence by time is not (each
rank has its own clock), so each rank proposes which of those tiers are due and the ranks
agree, on a gloo group of its own, in snapshot order: a tier takes the step when any rank
found it due (see :meth:`Cadences.agreed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from .._errors import ConfigurationError
from .._options import Cadence, CheckpointerOptions
from .._tiering.states import StateTable, build_table
from .flight import Stage

__all__ = ["Cadences"]


class Cadences:
    """The cadence of each durable stage, the time each last took a snapshot, and the
    state tables of the stage sets snapshots take (built once each)."""

    def __init__(self, options: CheckpointerOptions, stages: Sequence[Stage], *, host: bool) -> None:
        self._stages = list(stages)
        names = [s.name for s in self._stages if s.tier is not None]
        first = names[0]
        index = {s.name: s.index for s in self._stages if s.tier is not None}
        by_stage: dict[int, Cadence] = {}
        for name, cadence in options.cadence.items():
            if name not in index:
                raise ConfigurationError(
                    f"cadence names tier {name!r}, which is not in the chain; tiers: {names}"
                )
            if name == first:
                raise ConfigurationError(
                    f"cadence: {name!r} is the first tier of the chain, where every snapshot "
                    "lands first; it takes every snapshot. Give the cadence to a later tier, "
                    "or put a tier that takes every step in front of it"
                )
            assert isinstance(cadence, Cadence)  # the options made every value one
            by_stage[index[name]] = cadence
        self.by_stage = MappingProxyType(by_stage)
        self.durable = tuple(s.index for s in self._stages if s.durable)
        self.always = frozenset(k for k in self.durable if k not in by_stage)
        self.timed = any(c.seconds is not None for c in by_stage.values())
        self.host = host
        wanted = options.emergency_tiers
        if wanted is None:
            self.emergency = frozenset(by_stage)
        else:
            unknown = [n for n in wanted if n not in index or index[n] == 0]
            if unknown:
                durable = [s.name for s in self._stages if s.durable]
                raise ConfigurationError(
                    f"emergency_tiers names {unknown}, not a durable tier of the chain; "
                    f"durable tiers: {durable}"
                )
            self.emergency = frozenset(index[n] for n in wanted if index[n] in by_stage)
        self._last: dict[int, float] = {}
        self._tables: dict[frozenset[int], StateTable] = {}

    @property
    def any(self) -> bool:
        """Whether some tier skips snapshots."""
        return bool(self.by_stage)

    def propose(self, step: int, now: float) -> dict[int, bool]:
        """Which cadenced stages find ``step`` due at ``now`` (monotonic seconds), by this
        process's clock. A stage proposed due counts as having taken it from now on, so
        that the next snapshot's proposal does not find it due again while the ranks are
        still agreeing on this one."""
        due = {k: c.due(step, self._since(k, now)) for k, c in self.by_stage.items()}
        for k, yes in due.items():
            if yes:
                self._last[k] = now
        return due

    def agreed(self, due: Sequence[bool], now: float) -> frozenset[int]:
        """The stages that take a snapshot, once every rank proposed (``due``: per
        cadenced stage in stage order, whether any rank found it due); the stages taken
        count as having taken it at ``now``."""
        cadenced = sorted(self.by_stage)
        taken = {k for k, yes in zip(cadenced, due, strict=True) if yes}
        for k in taken:
            self._last[k] = max(self._last.get(k, now), now)
        return self.always | taken

    def takes(self, due: dict[int, bool]) -> frozenset[int]:
        """The stages that take a snapshot, from one process's proposal."""
        return self.always | {k for k, yes in due.items() if yes}

    def table(self, takes: frozenset[int]) -> StateTable:
        """The state table of a snapshot that goes to the stages ``takes``."""
        table = self._tables.get(takes)
        if table is None:
            levels = []
            for k in sorted(takes):
                tier = self._stages[k].tier
                assert tier is not None
                levels.append(tier.level)
            table = self._tables[takes] = build_table(levels)
        return table

    def _since(self, stage: int, now: float) -> float | None:
        last = self._last.get(stage)
        return None if last is None else now - last
