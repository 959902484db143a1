"""Metrics export to Prometheus, and log records that carry the step and the tier."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lazyckpt import (
    LOG_FORMAT,
    ConfigurationError,
    StepTierAdapter,
    StepTierFilter,
    SyncCheckpointer,
    export_prometheus,
    install_log_context,
)
from tiers import FileTier, HostMemoryTier

prometheus_client = pytest.importorskip("prometheus_client")


def sample(registry: Any, name: str, **labels: str) -> float | None:
    value: float | None = registry.get_sample_value(name, labels)
    return value


class FixedMetrics:
    """A stand-in for a Checkpointer whose ``metrics()`` is known exactly."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {
            "tiers": {
                "host": {"bytes": 4096, "busy_s": 0.0, "throughput_bytes_per_s": None},
                "file": {"bytes": 8192, "busy_s": 2.0, "throughput_bytes_per_s": 4096.0},
            },
            "shards_in_flight": {"ON_HOST": 3, "CAPTURED": 1},
            "snapshots_in_flight": 2,
            "snapshots_skipped": 5,
            "arena": {
                "capacity": 1 << 20,
                "held": 4096,
                "evictable": 8192,
                "peak": 65536,
                "waits": 7,
                "evictions": 1,
            },
            "snapshots": [
                {
                    "step": 9,
                    "bytes": 100,
                    "shards": 1,
                    "snapshot_s": 0.25,
                    "guard_s": 0.5,
                    "capture_s": 1.5,
                    "reached_s": {"host": 1.5, "file": 3.0},
                }
            ],
        }

    def metrics(self) -> dict[str, Any]:
        return self.data


def test_every_metric_with_its_value() -> None:
    registry = prometheus_client.CollectorRegistry()
    ckpt = FixedMetrics()
    export_prometheus(ckpt, registry)
    assert sample(registry, "lazyckpt_tier_bytes_total", tier="file") == 8192
    assert sample(registry, "lazyckpt_tier_bytes_total", tier="host") == 4096
    assert sample(registry, "lazyckpt_tier_busy_seconds_total", tier="file") == 2.0
    assert sample(registry, "lazyckpt_tier_throughput_bytes_per_second", tier="file") == 4096
    assert sample(registry, "lazyckpt_tier_throughput_bytes_per_second", tier="host") is None
    assert sample(registry, "lazyckpt_shards_in_flight", state="ON_HOST") == 3
    assert sample(registry, "lazyckpt_snapshots_in_flight") == 2
    assert sample(registry, "lazyckpt_snapshots_skipped_total") == 5
    assert sample(registry, "lazyckpt_arena_capacity_bytes") == 1 << 20
    assert sample(registry, "lazyckpt_arena_peak_bytes") == 65536
    assert sample(registry, "lazyckpt_arena_waits_total") == 7
    assert sample(registry, "lazyckpt_last_snapshot_step") == 9
    assert sample(registry, "lazyckpt_last_snapshot_stall_seconds") == 0.75
    assert sample(registry, "lazyckpt_last_snapshot_capture_seconds") == 1.5
    assert sample(registry, "lazyckpt_last_snapshot_reached_seconds", tier="file") == 3.0
    # Read on every scrape: a change shows at the next one.
    ckpt.data["tiers"]["file"]["bytes"] = 10000
    assert sample(registry, "lazyckpt_tier_bytes_total", tier="file") == 10000


def test_labels_prefix_and_unregister() -> None:
    registry = prometheus_client.CollectorRegistry()
    collector = export_prometheus(FixedMetrics(), registry, prefix="ckpt", labels={"rank": "3"})
    assert sample(registry, "ckpt_tier_bytes_total", rank="3", tier="file") == 8192
    assert sample(registry, "ckpt_snapshots_in_flight", rank="3") == 2
    registry.unregister(collector)
    assert sample(registry, "ckpt_snapshots_in_flight", rank="3") is None


def test_a_real_checkpointer_in_prometheus_text(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    tiers = [HostMemoryTier(4 << 20), FileTier(tmp_path)]
    with SyncCheckpointer(tiers, shard_size=64 << 10) as ckpt:
        export_prometheus(ckpt, registry)
        assert sample(registry, "lazyckpt_tier_bytes_total", tier="file") == 0
        for step in (1, 2):
            ckpt.snapshot({"w": torch.randn(100, 100)}, step=step).wait()
    # Read after close: only then has every snapshot finished its bookkeeping (its timings
    # join the history just after its last stage resolves).
    written = ckpt.metrics()["tiers"]["file"]["bytes"]
    text = prometheus_client.generate_latest(registry).decode()
    assert written >= 2 * 100 * 100 * 4
    assert f'lazyckpt_tier_bytes_total{{tier="file"}} {float(written)}' in text
    assert "lazyckpt_last_snapshot_step 2.0" in text
    assert "# TYPE lazyckpt_tier_bytes_total counter" in text


def test_without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigurationError, match=r"lazyckpt\[prometheus\]"):
        export_prometheus(FixedMetrics())


# -- logging -------------------------------------------------------------------------------------


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def test_engine_records_carry_step_and_tier(tmp_path: Path) -> None:
    handler = ListHandler()
    install_log_context(handler, level=logging.DEBUG, fmt="%(step)s|%(tier)s|%(message)s")
    try:
        tiers = [HostMemoryTier(4 << 20), FileTier(tmp_path)]
        with SyncCheckpointer(tiers, shard_size=64 << 10) as ckpt:
            ckpt.snapshot({"w": torch.ones(10)}, step=4).wait()
    finally:
        logger = logging.getLogger("lazyckpt")
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    reached = [line for line in handler.lines if "reached" in line]
    assert "4|host|step 4 reached host" in reached
    assert "4|file|step 4 reached file" in reached
    assert all(len(line.split("|")) >= 3 for line in handler.lines)


def test_filter_fills_in_what_a_record_lacks() -> None:
    handler = ListHandler()
    handler.addFilter(StepTierFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger = logging.getLogger("lazyckpt.test.filter")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("plain")
        logger.warning("with", extra={"step": 12, "tier": "s3"})
    finally:
        logger.removeHandler(handler)
    assert "[step=- tier=-] plain" in handler.lines[0]
    assert "[step=12 tier=s3] with" in handler.lines[1]


def test_adapter_adds_step_and_tier() -> None:
    handler = ListHandler()
    handler.setFormatter(logging.Formatter("%(step)s %(tier)s %(message)s"))
    logger = logging.getLogger("lazyckpt.test.adapter")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        log = StepTierAdapter(logger, step=7, tier="file")
        log.warning("a")
        log.warning("b", extra={"tier": "host"})
        later = log.bind(step=8)
        later.warning("c")
        assert (later.step, later.tier) == (8, "file")
    finally:
        logger.removeHandler(handler)
    assert handler.lines == ["7 file a", "7 host b", "8 file c"]
