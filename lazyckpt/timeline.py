"""A run's checkpointing on one time axis: record the events, then draw them.

A training loop records what happened with a :class:`TimelineRecorder`::

    rec = TimelineRecorder()
    for i in range(steps):
        with rec.iteration(i):
            loss = model(batch).loss
            loss.backward()
            optimizer.step()
            if i % every == 0:
                rec.snapshot(ckpt.snapshot(state, step=i))   # right as it returns
    rec.save("events.json")

and :func:`draw` (or ``lazyckpt timeline events.json --out timeline.png``) turns the file into
a PNG: the iterations on top, then for each snapshot a bar per stage (the capture into host
memory, then each tier of the chain, ending where the snapshot is committed there), and the
time the loop was blocked (inside ``snapshot()``, and in the guard waiting for a capture).

The event file
--------------
JSON, one object::

    {"format": "lazyckpt-timeline", "version": 1,
     "started": 1732940000.25,            # Unix time of t = 0
     "tiers": ["host", "file"],           # the chain, fastest first
     "events": [{"t": 0.0, "event": "iteration_start", "iteration": 0}, ...]}

``t`` is seconds since ``started``. The events:

=====================  ==============================================================
``iteration_start``    ``iteration``: a training iteration begins
``iteration_end``      ``iteration``: it ends
``snapshot_requested`` ``step``: ``snapshot()`` was called
``snapshot_returned``  ``step``: ``snapshot()`` returned (the loop goes on)
``snapshot_captured``  ``step``: every shard is in host memory
``snapshot_reached``   ``step``, ``tier``: committed on that tier
``snapshot_failed``    ``step``: the snapshot failed (``t`` is when it was noticed)
``guard_wait``         ``step``, ``seconds``: the loop waited this long for the capture,
                       from ``t``
=====================  ==============================================================

The stage times come from :attr:`SnapshotHandle.stats`, measured by the engine relative to the
request; the recorder places them on its own clock at :meth:`TimelineRecorder.save` time.
Readers ignore event kinds they do not know.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._errors import ConfigurationError

if TYPE_CHECKING:
    from ._checkpointer.handle import SnapshotHandle

__all__ = ["FORMAT", "VERSION", "TimelineRecorder", "draw", "load_events"]

FORMAT = "lazyckpt-timeline"
VERSION = 1

_KINDS = frozenset(
    {
        "iteration_start",
        "iteration_end",
        "snapshot_requested",
        "snapshot_returned",
        "snapshot_captured",
        "snapshot_reached",
        "snapshot_failed",
        "guard_wait",
    }
)


class TimelineRecorder:
    """Records training iterations and snapshots on one clock, and writes the event file.

    Args:
        clock: a monotonic clock in seconds (``time.perf_counter``, the engine's clock).
    """

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._t0 = clock()
        self._started = time.time()
        self._events: list[dict[str, Any]] = []
        self._snapshots: list[tuple[SnapshotHandle, float]] = []

    def _now(self) -> float:
        return self._clock() - self._t0

    @contextlib.contextmanager
    def iteration(self, index: int) -> Iterator[None]:
        """Record the start and end of training iteration ``index`` around the block."""
        self._events.append({"t": self._now(), "event": "iteration_start", "iteration": index})
        try:
            yield
        finally:
            self._events.append({"t": self._now(), "event": "iteration_end", "iteration": index})

    def snapshot(self, handle: SnapshotHandle) -> SnapshotHandle:
        """Record a snapshot; call it as ``snapshot()`` returns. Returns ``handle``.

        Only the return time is taken now; the stages are read from ``handle.stats`` when
        the events are written, so the loop pays nothing more here.
        """
        self._snapshots.append((handle, self._now()))
        return handle

    def events(self) -> dict[str, Any]:
        """The event document as it stands (stages not yet reached are left out)."""
        events = list(self._events)
        tiers: list[str] = []
        now = self._now()
        for handle, returned in self._snapshots:
            stats = handle.stats
            if stats is None:  # skipped while the pipeline was busy: no snapshot was taken
                continue
            step = handle.step
            events.append(
                {"t": returned - stats.snapshot_s, "event": "snapshot_requested", "step": step}
            )
            events.append({"t": returned, "event": "snapshot_returned", "step": step})
            # The engine measures stages from its submission, which is the return from
            # snapshot(): the call hands the snapshot over as its last act.
            if stats.capture_s is not None:
                captured = returned + stats.capture_s
                events.append({"t": captured, "event": "snapshot_captured", "step": step})
                if stats.guard_s > 0:
                    # The guard waits for the capture, so its wait ends when the capture does.
                    events.append(
                        {
                            "t": captured - stats.guard_s,
                            "event": "guard_wait",
                            "step": step,
                            "seconds": stats.guard_s,
                        }
                    )
            for tier, seconds in dict(stats.reached_s).items():
                if tier not in tiers:
                    tiers.append(tier)
                events.append(
                    {
                        "t": returned + seconds,
                        "event": "snapshot_reached",
                        "step": step,
                        "tier": tier,
                    }
                )
            if handle.state() == "failed":
                events.append({"t": now, "event": "snapshot_failed", "step": step})
        events.sort(key=lambda e: e["t"])
        return {
            "format": FORMAT,
            "version": VERSION,
            "started": self._started,
            "tiers": tiers,
            "events": events,
        }

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the event document to ``path`` as JSON; return the path."""
        target = Path(path)
        target.write_text(json.dumps(self.events(), indent=1) + "\n")
        return target


def load_events(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check an event file.

    Raises:
        ConfigurationError: the file is not a lazyckpt timeline.
    """
    try:
        doc = json.loads(Path(path).read_text())
    except ValueError as exc:
        raise ConfigurationError(f"{path} is not JSON: {exc}") from None
    _check(doc, str(path))
    return dict(doc)


def _check(doc: Any, source: str) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigurationError(f"{source} is not a lazyckpt timeline (no format {FORMAT!r})")
    version = doc.get("version")
    if type(version) is not int or version > VERSION:
        raise ConfigurationError(
            f"{source} has timeline version {version!r}; this lazyckpt reads up to {VERSION}"
        )
    events = doc.get("events")
    if not isinstance(events, list):
        raise ConfigurationError(f"{source}: 'events' must be a list")
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not isinstance(e.get("t"), int | float):
            raise ConfigurationError(f"{source}: event {i} needs a number 't'")
        if e.get("event") in _KINDS and e["event"] != "snapshot_failed":
            need = "iteration" if e["event"].startswith("iteration") else "step"
            if type(e.get(need)) is not int:
                raise ConfigurationError(f"{source}: event {i} ({e['event']}) needs {need!r}")


# -- drawing ---------------------------------------------------------------------------------


@dataclass
class _Snapshot:
    step: int
    requested: float | None = None
    returned: float | None = None
    captured: float | None = None
    reached: dict[str, float] = field(default_factory=dict)
    failed: float | None = None
    waits: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class _Run:
    iterations: list[tuple[int, float, float]]
    snapshots: list[_Snapshot]
    tiers: list[str]


def _parse(doc: Mapping[str, Any]) -> _Run:
    starts: dict[int, float] = {}
    iterations: list[tuple[int, float, float]] = []
    snaps: dict[int, _Snapshot] = {}
    tiers = [str(t) for t in doc.get("tiers", [])]
    for e in sorted(doc["events"], key=lambda e: e["t"]):
        kind, t = e.get("event"), float(e["t"])
        if kind == "iteration_start":
            starts[e["iteration"]] = t
        elif kind == "iteration_end" and e["iteration"] in starts:
            iterations.append((e["iteration"], starts.pop(e["iteration"]), t))
        elif kind in _KINDS and isinstance(e.get("step"), int):
            s = snaps.setdefault(e["step"], _Snapshot(e["step"]))
            if kind == "snapshot_requested":
                s.requested = t
            elif kind == "snapshot_returned":
                s.returned = t
            elif kind == "snapshot_captured":
                s.captured = t
            elif kind == "snapshot_reached":
                tier = str(e.get("tier"))
                s.reached[tier] = t
                if tier not in tiers:
                    tiers.append(tier)
            elif kind == "snapshot_failed":
                s.failed = t
            elif kind == "guard_wait":
                s.waits.append((t, float(e.get("seconds", 0.0))))
    return _Run(iterations, sorted(snaps.values(), key=lambda s: s.step), tiers)


def _lanes(bars: Sequence[tuple[float, float]]) -> list[int]:
    """A lane per bar so that bars in one lane do not overlap (first fit, by start)."""
    ends: list[float] = []
    lanes = [0] * len(bars)
    for i in sorted(range(len(bars)), key=lambda i: bars[i][0]):
        start, width = bars[i]
        for lane, end in enumerate(ends):
            if start >= end:
                ends[lane] = start + width
                lanes[i] = lane
                break
        else:
            ends.append(start + width)
            lanes[i] = len(ends) - 1
    return lanes


def _tier_label(name: str) -> str:
    return "host staging" if name == "<staging>" else f"tier {name}"


def draw(
    events: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
) -> Path:
    """Draw a run's events as a PNG at ``path``; return the path.

    ``events`` is an event document (see the module docstring) or just its list of events.
    Uses matplotlib's Agg renderer without touching pyplot's global state.

    Raises:
        ConfigurationError: matplotlib is missing, or the events are malformed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigurationError(
            "drawing a timeline needs matplotlib: pip install 'lazyckpt[plots]'"
        ) from None
    doc: Mapping[str, Any]
    if isinstance(events, Mapping):
        doc = events
    else:
        doc = {"format": FORMAT, "version": VERSION, "events": list(events)}
    _check(doc, "the events")
    run = _parse(doc)

    rows = ["training", "capture", *(_tier_label(t) for t in run.tiers)]
    height = 0.8
    fig = Figure(figsize=(12, 1.6 + 0.7 * len(rows)), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_ylim(len(rows) - 0.4, -0.6)
    ax.set_yticks(range(len(rows)), rows)
    ax.grid(axis="x", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlabel("seconds since the recorder started")
    times = [float(e["t"]) for e in doc["events"]] or [0.0, 1.0]
    span = max(times) - min(times) or 1.0
    ax.set_xlim(min(times) - 0.01 * span, max(times) + 0.02 * span)
    # Stages shorter than this would not show at all: they are drawn this wide.
    tick = span / 600
    # Red means "the loop waited" and grey means "training": snapshots get the other colours.
    palette = ["C0", "C1", "C2", "C4", "C5", "C6", "C8", "C9"]
    colors = [palette[i % len(palette)] for i in range(len(run.snapshots))]

    # Training row: iterations in alternating greys, then what blocked the loop on top.
    for k, (_, first, last) in enumerate(run.iterations):
        ax.broken_barh(
            [(first, last - first)],
            (-height / 2, height),
            facecolors="0.78" if k % 2 else "0.62",
            edgecolor="white",
            linewidth=0.5,
        )
        if len(run.iterations) <= 60:
            ax.text(
                (first + last) / 2,
                0,
                str(run.iterations[k][0]),
                ha="center",
                va="center",
                fontsize=6,
                color="0.25",
            )
    for s in run.snapshots:
        for start, seconds in s.waits:
            ax.broken_barh([(start, seconds)], (-height / 2, height), facecolors="tab:red")
        if s.requested is not None and s.returned is not None:
            ax.broken_barh(
                [(s.requested, max(s.returned - s.requested, tick))],
                (-height / 2, height),
                facecolors="black",
            )

    # One row per stage: a bar from the end of the stage before to the end of this one.
    for row, stage in enumerate(["<capture>", *run.tiers], start=1):
        bars: list[tuple[float, float]] = []
        owners: list[int] = []
        for k, s in enumerate(run.snapshots):
            begin: float | None = s.returned if s.returned is not None else s.requested
            end: float | None
            if stage == "<capture>":
                end = s.captured
            else:
                end = s.reached.get(stage)
                before = run.tiers.index(stage)
                if before > 0 and run.tiers[before - 1] in s.reached:
                    begin = s.reached[run.tiers[before - 1]]
                elif s.captured is not None:
                    begin = s.captured
            if begin is None or end is None:
                continue
            bars.append((begin, max(end - begin, tick)))
            owners.append(k)
        lanes = _lanes(bars)
        count = max(lanes, default=0) + 1
        lane_height = height / count
        for (start, width), lane, k in zip(bars, lanes, owners, strict=True):
            y = row - height / 2 + lane * lane_height
            ax.broken_barh(
                [(start, width)], (y, lane_height * 0.9), facecolors=colors[k], alpha=0.9
            )
            if row == 1 and len(run.snapshots) <= 40:
                ax.text(
                    start,
                    y + lane_height * 0.45,
                    f" {run.snapshots[k].step}",
                    va="center",
                    ha="left",
                    fontsize=7,
                    color="black",
                )
    for k, s in enumerate(run.snapshots):
        if s.failed is not None:
            ax.plot([s.failed], [1], marker="x", color="tab:red", markersize=9, mew=2)
        if s.requested is not None:
            ax.axvline(s.requested, color=colors[k], alpha=0.25, linewidth=0.8, zorder=0)

    legend = [
        Patch(facecolor="0.62", label="training iteration"),
        Patch(facecolor="black", label="inside snapshot()"),
        Patch(facecolor="tab:red", label="waiting for a capture (guard)"),
        Patch(
            facecolor="C0", label="a snapshot's stage, from the end of the one above (label: step)"
        ),
    ]
    ax.legend(
        handles=legend,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 / (len(rows) ** 0.5)),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    n_iter, n_snap = len(run.iterations), len(run.snapshots)
    ax.set_title(title or f"lazyckpt timeline: {n_iter} iterations, {n_snap} snapshots")
    fig.tight_layout()
    target = Path(path)
    fig.savefig(target, format="png")
    return target
