"""Watching a Checkpointer from outside: Prometheus metrics and log records with context.

:func:`export_prometheus` registers a collector that reads ``ckpt.metrics()`` each time
Prometheus scrapes, so nothing is counted twice and nothing runs between scrapes. It needs
``prometheus-client`` (``pip install lazyckpt[prometheus]``), imported only when called.

The engine logs to the ``lazyckpt`` logger with ``extra={"step": ..., "tier": ...}``.
:class:`StepTierFilter` gives every record both attributes (``"-"`` where a record has none),
so a handler can put them in its format, :data:`LOG_FORMAT`, even for records from other
libraries. :class:`StepTierAdapter` adds them to a training loop's own records.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Protocol

from ._errors import ConfigurationError

__all__ = [
    "LOG_FORMAT",
    "CheckpointerCollector",
    "StepTierAdapter",
    "StepTierFilter",
    "SupportsMetrics",
    "export_prometheus",
    "install_log_context",
]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [step=%(step)s tier=%(tier)s] %(message)s"
"""A ``logging`` format that shows the step and the tier of every record."""


class SupportsMetrics(Protocol):
    """Anything with ``metrics()`` like :meth:`lazyckpt.Checkpointer.metrics`."""

    def metrics(self) -> dict[str, Any]: ...


class CheckpointerCollector:
    """A Prometheus collector over one Checkpointer's ``metrics()``.

    Every metric name starts with ``prefix`` (default ``lazyckpt``); ``labels`` are added to
    every sample (e.g. ``{"rank": "0"}`` when several processes share a registry). The
    metrics:

    - ``<prefix>_tier_bytes_total{tier}``, ``<prefix>_tier_busy_seconds_total{tier}``:
      bytes each tier received and seconds it spent writing (counters);
      ``<prefix>_tier_throughput_bytes_per_second{tier}`` (gauge, when known).
    - ``<prefix>_shards_in_flight{state}``, ``<prefix>_snapshots_in_flight``,
      ``<prefix>_snapshots_skipped_total``.
    - ``<prefix>_arena_{capacity,held,evictable,peak}_bytes``,
      ``<prefix>_arena_waits_total``, ``<prefix>_arena_evictions_total``.
    - Of the newest finished snapshot: ``<prefix>_last_snapshot_step``,
      ``<prefix>_last_snapshot_bytes``, ``<prefix>_last_snapshot_stall_seconds`` (time the
      training loop was blocked: in ``snapshot()`` plus in the guard),
      ``<prefix>_last_snapshot_capture_seconds``, and
      ``<prefix>_last_snapshot_reached_seconds{tier}`` (from the request).
    """

    def __init__(
        self,
        ckpt: SupportsMetrics,
        *,
        prefix: str = "lazyckpt",
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self._ckpt = ckpt
        self._prefix = prefix
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Any]:
        """Yield the metric families (called by the registry on every scrape)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        data = self._ckpt.metrics()
        fixed = list(self._labels)
        fixed_values = list(self._labels.values())
        p = self._prefix

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return GaugeMetricFamily(f"{p}_{name}", doc, labels=[*fixed, *extra])

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return CounterMetricFamily(f"{p}_{name}", doc, labels=[*fixed, *extra])

        tier_bytes = counter("tier_bytes", "Bytes moved into each tier.", ("tier",))
        tier_busy = counter("tier_busy_seconds", "Seconds each tier spent writing.", ("tier",))
        tier_rate = gauge(
            "tier_throughput_bytes_per_second", "Bytes per busy second, per tier.", ("tier",)
        )
        for tier, stats in data.get("tiers", {}).items():
            tier_bytes.add_metric([*fixed_values, tier], float(stats["bytes"]))
            tier_busy.add_metric([*fixed_values, tier], float(stats["busy_s"]))
            if stats.get("throughput_bytes_per_s") is not None:
                tier_rate.add_metric([*fixed_values, tier], float(stats["throughput_bytes_per_s"]))
        yield tier_bytes
        yield tier_busy
        yield tier_rate

        shards = gauge("shards_in_flight", "Shards of unfinished snapshots, by state.", ("state",))
        for state, count in sorted(data.get("shards_in_flight", {}).items()):
            shards.add_metric([*fixed_values, state], float(count))
        yield shards
        in_flight = gauge("snapshots_in_flight", "Snapshots not yet finished.")
        in_flight.add_metric(fixed_values, float(data.get("snapshots_in_flight", 0)))
        yield in_flight
        skipped = counter("snapshots_skipped", "Snapshots dropped because the pipeline was busy.")
        skipped.add_metric(fixed_values, float(data.get("snapshots_skipped", 0)))
        yield skipped

        arena = data.get("arena", {})
        for key, doc in (
            ("capacity", "Size of the host arena."),
            ("held", "Arena bytes held by shards in flight."),
            ("evictable", "Arena bytes kept for fast restore that may be reclaimed."),
            ("peak", "Most arena bytes ever held at once."),
        ):
            if key in arena:
                family = gauge(f"arena_{key}_bytes", doc)
                family.add_metric(fixed_values, float(arena[key]))
                yield family
        for key, doc in (
            ("waits", "Times a capture waited for arena space (backpressure)."),
            ("evictions", "Kept blocks the arena reclaimed."),
        ):
            if key in arena:
                family = counter(f"arena_{key}", doc)
                family.add_metric(fixed_values, float(arena[key]))
                yield family

        yield from self._last_snapshot(data.get("snapshots", []), gauge, fixed_values)

    def _last_snapshot(
        self, snapshots: list[dict[str, Any]], gauge: Any, fixed_values: list[str]
    ) -> Iterator[Any]:
        if not snapshots:
            return
        last = snapshots[-1]
        step = gauge("last_snapshot_step", "Step of the newest finished snapshot.")
        step.add_metric(fixed_values, float(last["step"]))
        size = gauge("last_snapshot_bytes", "Tensor bytes of the newest finished snapshot.")
        size.add_metric(fixed_values, float(last["bytes"]))
        stall = gauge(
            "last_snapshot_stall_seconds",
            "Seconds the training loop was blocked by the newest snapshot (call + guard).",
        )
        stall.add_metric(fixed_values, float(last["snapshot_s"]) + float(last["guard_s"]))
        yield from (step, size, stall)
        if last.get("capture_s") is not None:
            capture = gauge(
                "last_snapshot_capture_seconds",
                "Seconds from request to every shard in host memory, newest snapshot.",
            )
            capture.add_metric(fixed_values, float(last["capture_s"]))
            yield capture
        reached = gauge(
            "last_snapshot_reached_seconds",
            "Seconds from request to commit on each tier, newest snapshot.",
            ("tier",),
        )
        for tier, seconds in last.get("reached_s", {}).items():
            reached.add_metric([*fixed_values, tier], float(seconds))
        yield reached


def export_prometheus(
    ckpt: SupportsMetrics,
    registry: Any = None,
    *,
    prefix: str = "lazyckpt",
    labels: Mapping[str, str] | None = None,
) -> CheckpointerCollector:
    """Publish ``ckpt.metrics()`` to Prometheus.

    Registers a :class:`CheckpointerCollector` in ``registry`` (default: prometheus-client's
    global ``REGISTRY``) and returns it; ``registry.unregister(collector)`` undoes it. Serve
    the registry as usual, e.g. ``prometheus_client.start_http_server(9100)``.

    Raises:
        ConfigurationError: prometheus-client is not installed.
    """
    try:
        import prometheus_client
    except ImportError:
        raise ConfigurationError(
            "export_prometheus needs prometheus-client: pip install 'lazyckpt[prometheus]'"
        ) from None
    collector = CheckpointerCollector(ckpt, prefix=prefix, labels=labels)
    target = prometheus_client.REGISTRY if registry is None else registry
    target.register(collector)
    return collector


class StepTierFilter(logging.Filter):
    """Gives every record ``step`` and ``tier`` attributes (``"-"`` when it has none).

    Attach it to a handler so that a format naming ``%(step)s`` and ``%(tier)s`` works for
    every record that handler sees. It never drops a record.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        for name in ("step", "tier"):
            if getattr(record, name, None) is None:
                setattr(record, name, "-")
        return True


class StepTierAdapter(logging.LoggerAdapter[logging.Logger]):
    """A logger that adds a fixed step and tier to its records, unless a call gives its own.

    ``log = StepTierAdapter(logging.getLogger("train"), step=100)`` then
    ``log.info("saved")``; ``log.bind(step=101)`` gives one for the next step.
    """

    def __init__(self, logger: logging.Logger, *, step: int | None = None, tier: str | None = None):
        super().__init__(logger, {"step": step, "tier": tier})

    def bind(self, *, step: int | None = None, tier: str | None = None) -> StepTierAdapter:
        """A new adapter with ``step``/``tier`` replaced where given."""
        return StepTierAdapter(
            self.logger,
            step=step if step is not None else self.step,
            tier=tier if tier is not None else self.tier,
        )

    @property
    def step(self) -> int | None:
        """The step this adapter adds to its records."""
        value = (self.extra or {}).get("step")
        return value if isinstance(value, int) else None

    @property
    def tier(self) -> str | None:
        """The tier this adapter adds to its records."""
        value = (self.extra or {}).get("tier")
        return value if isinstance(value, str) else None

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


def install_log_context(
    handler: logging.Handler | None = None,
    *,
    level: int = logging.INFO,
    fmt: str = LOG_FORMAT,
) -> logging.Handler:
    """Send the ``lazyckpt`` logger's records to ``handler`` with step and tier shown.

    Without a handler, a ``StreamHandler`` on stderr. The handler gets a
    :class:`StepTierFilter` and, unless it has a formatter, ``fmt``. Returns the handler.
    """
    if handler is None:
        handler = logging.StreamHandler()
    handler.addFilter(StepTierFilter())
    if handler.formatter is None:
        handler.setFormatter(logging.Formatter(fmt))
    logger = logging.getLogger("lazyckpt")
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
