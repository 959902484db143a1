"""The timeline: events recorded from a real run, the JSON format, and the PNG drawn from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from lazyckpt import ConfigurationError, SnapshotStats, SyncCheckpointer
from lazyckpt.cli import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, main
from lazyckpt.timeline import FORMAT, TimelineRecorder, _lanes, draw, load_events
from tiers import FileTier, HostMemoryTier

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def short_run(tmp_path: Path) -> dict[str, Any]:
    """Six iterations of a tiny model, a snapshot every other one, through host and file."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    rec = TimelineRecorder()
    tiers = [HostMemoryTier(8 << 20), FileTier(tmp_path / "ckpt")]
    with SyncCheckpointer(tiers, shard_size=64 << 10) as ckpt:
        ckpt.guard(opt)
        handles = []
        for i in range(6):
            with rec.iteration(i):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()  # type: ignore[no-untyped-call]
                opt.step()
                opt.zero_grad()
                if i % 2 == 0:
                    state = {"model": model, "optim": opt, "step": i}
                    handles.append(rec.snapshot(ckpt.snapshot(state, step=i)))
        for h in handles:
            h.wait()
    path = rec.save(tmp_path / "events.json")
    return load_events(path)


def by_kind(doc: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in doc["events"] if e["event"] == kind]


def test_recorder_writes_every_stage_of_a_real_run(tmp_path: Path) -> None:
    doc = short_run(tmp_path)
    assert doc["format"] == FORMAT
    assert doc["tiers"] == ["host", "file"]
    starts = by_kind(doc, "iteration_start")
    ends = by_kind(doc, "iteration_end")
    assert [e["iteration"] for e in starts] == list(range(6))
    assert [e["iteration"] for e in ends] == list(range(6))
    for start, end in zip(starts, ends, strict=True):
        assert start["t"] <= end["t"]
    times = [e["t"] for e in doc["events"]]
    assert times == sorted(times)
    for step in (0, 2, 4):
        (requested,) = [e for e in by_kind(doc, "snapshot_requested") if e["step"] == step]
        (returned,) = [e for e in by_kind(doc, "snapshot_returned") if e["step"] == step]
        (captured,) = [e for e in by_kind(doc, "snapshot_captured") if e["step"] == step]
        reached = {e["tier"]: e["t"] for e in by_kind(doc, "snapshot_reached") if e["step"] == step}
        assert set(reached) == {"host", "file"}
        assert requested["t"] <= returned["t"] <= captured["t"] <= reached["file"]
        # The snapshot was requested inside its iteration.
        assert starts[step]["t"] <= requested["t"] <= ends[step]["t"]
    assert not by_kind(doc, "snapshot_failed")


def test_timeline_command_draws_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short_run(tmp_path)
    out = tmp_path / "timeline.png"
    assert main(["timeline", str(tmp_path / "events.json"), "--out", str(out)]) == EXIT_OK
    assert f"wrote {out}" in capsys.readouterr().err
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    image = imread(out)
    assert image.shape[1] == 12 * 120  # 12 inches at 120 dpi
    assert image.shape[0] > 300
    # Not a blank canvas: bars in several colours were drawn.
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 20


class StubHandle:
    """What the recorder reads from a handle: ``step``, ``stats`` and ``state()``."""

    def __init__(self, stats: SnapshotStats | None, state: str = "committed") -> None:
        self.step = stats.step if stats is not None else -1
        self.stats = stats
        self._state = state

    def state(self) -> str:
        return self._state


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recorder_places_stage_durations_on_its_clock() -> None:
    clock = FakeClock()
    rec = TimelineRecorder(clock=clock)
    stats = SnapshotStats(
        step=3,
        bytes=10,
        shards=1,
        snapshot_s=0.25,
        guard_s=0.5,
        capture_s=2.0,
        reached_s={"host": 2.5, "file": 9.0},
    )
    with rec.iteration(0):
        clock.now = 101.0
        rec.snapshot(StubHandle(stats))  # type: ignore[arg-type]
        rec.snapshot(StubHandle(None))  # type: ignore[arg-type]  # skipped: nothing recorded
        clock.now = 104.0
    failing = SnapshotStats(step=4, bytes=1, shards=1, snapshot_s=0.0)
    rec.snapshot(StubHandle(failing, state="failed"))  # type: ignore[arg-type]
    clock.now = 110.0
    events = [
        {k: v for k, v in e.items() if k != "t"} | {"t": round(e["t"], 6)}
        for e in rec.events()["events"]
    ]
    assert events == [
        {"event": "iteration_start", "iteration": 0, "t": 0.0},
        {"event": "snapshot_requested", "step": 3, "t": 0.75},
        {"event": "snapshot_returned", "step": 3, "t": 1.0},
        {"event": "guard_wait", "step": 3, "seconds": 0.5, "t": 2.5},
        {"event": "snapshot_captured", "step": 3, "t": 3.0},
        {"event": "snapshot_reached", "step": 3, "tier": "host", "t": 3.5},
        {"event": "iteration_end", "iteration": 0, "t": 4.0},
        {"event": "snapshot_requested", "step": 4, "t": 4.0},
        {"event": "snapshot_returned", "step": 4, "t": 4.0},
        {"event": "snapshot_reached", "step": 3, "tier": "file", "t": 10.0},
        {"event": "snapshot_failed", "step": 4, "t": 10.0},
    ]
    assert rec.events()["tiers"] == ["host", "file"]


def test_draw_takes_a_bare_event_list(tmp_path: Path) -> None:
    events = [
        {"t": 0.0, "event": "iteration_start", "iteration": 0},
        {"t": 1.0, "event": "iteration_end", "iteration": 0},
        {"t": 0.9, "event": "snapshot_requested", "step": 0},
        {"t": 0.91, "event": "snapshot_returned", "step": 0},
        {"t": 1.2, "event": "snapshot_captured", "step": 0},
        {"t": 2.0, "event": "snapshot_reached", "step": 0, "tier": "s3"},
        {"t": 2.1, "event": "a_kind_from_the_future", "step": 0},
        {"t": 2.2, "event": "snapshot_failed", "step": 1},
    ]
    out = draw(events, tmp_path / "t.png", title="bare")
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def test_overlapping_bars_get_separate_lanes() -> None:
    assert _lanes([(0.0, 2.0), (1.0, 2.0), (3.0, 1.0), (1.5, 0.2)]) == [0, 1, 0, 2]
    assert _lanes([]) == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not JSON"),
        ('{"format": "other"}', "not a lazyckpt timeline"),
        ('{"format": "lazyckpt-timeline", "version": 99, "events": []}', "version 99"),
        ('{"format": "lazyckpt-timeline", "version": 1, "events": [{"event": "x"}]}', "'t'"),
        (
            '{"format": "lazyckpt-timeline", "version": 1, '
            '"events": [{"t": 1, "event": "iteration_start"}]}',
            "'iteration'",
        ),
    ],
)
def test_malformed_event_files_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    path = tmp_path / "events.json"
    path.write_text(content)
    with pytest.raises(ConfigurationError, match=message):
        load_events(path)
    assert main(["timeline", str(path), "--out", str(tmp_path / "x.png")]) == EXIT_USAGE
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_missing_event_file(tmp_path: Path) -> None:
    code = main(["timeline", str(tmp_path / "none.json"), "--out", str(tmp_path / "x.png")])
    assert code == EXIT_NOT_FOUND


def test_saved_file_is_plain_json(tmp_path: Path) -> None:
    rec = TimelineRecorder()
    with rec.iteration(7):
        pass
    doc = json.loads(rec.save(tmp_path / "e.json").read_text())
    assert [e["event"] for e in doc["events"]] == ["iteration_start", "iteration_end"]
    assert doc["version"] == 1
