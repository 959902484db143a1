"""Retention beyond keep_last: keep every n-th step, the best n by a metric recorded with the
snapshot, the steps newer than a duration; combined as a union, the newest step always kept,
nothing deleted that cannot be judged. Then ``lazyckpt gc`` with those policies and the
"kept because" column of ``lazyckpt ls``."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Run

import lazyckpt
import lazyckpt.tier
from lazyckpt import ConfigurationError, KeepBest, Manifest, Retention, StepInfo
from lazyckpt._format.manifest import check_metrics
from lazyckpt.cli import EXIT_OK, EXIT_USAGE
from lazyckpt.testing import build_snapshot
from tiers import FileTier, HostMemoryTier

NOW = 1_000_000.0
HOUR = 3600.0


def infos(
    steps: list[int], *, age: dict[int, float] | None = None, **metrics: dict[int, float]
) -> dict[int, StepInfo]:
    """Each step's info: created ``age[step]`` seconds before NOW (default: a day per step
    back from the newest), with ``metrics[name][step]`` where given."""
    newest = max(steps)
    ages = age or {s: (newest - s) * 86400.0 for s in steps}
    return {
        s: StepInfo(
            s,
            NOW - ages[s],
            {name: values[s] for name, values in metrics.items() if s in values},
        )
        for s in steps
    }


# -- each policy ---------------------------------------------------------------------------------


def test_no_policy_keeps_everything() -> None:
    r = Retention()
    assert not r.needs_info()
    assert r.to_delete([5, 1, 3]) == []
    assert r.reasons([1, 3]) == {1: ["no retention policy"], 3: ["no retention policy"]}
    assert r.describe() == {}
    assert r.to_delete([]) == [] and r.reasons([]) == {}


def test_keep_last_and_keep_every_as_before() -> None:
    r = Retention(keep_last=1, keep_every=100)
    assert not r.needs_info()
    assert r.to_delete([3, 7, 200, 9]) == [3, 7, 9]
    assert Retention(keep_last=2).to_delete([1, 2, 3, 4]) == [1, 2]
    assert Retention(keep_every=3).reasons([2, 3, 6, 7]) == {
        2: [],
        3: ["every 3rd"],
        6: ["every 3rd"],
        7: ["newest"],
    }
    assert Retention(keep_last=3).reasons([1, 2, 3]) == {
        1: ["last 3"],
        2: ["last 3"],
        3: ["newest", "last 3"],
    }


def test_every_names_its_step() -> None:
    steps = [100, 150, 200, 201]
    assert Retention(keep_every=100).reasons(steps)[100] == ["every 100th"]
    assert Retention(keep_every=1).reasons([5, 6])[5] == ["every step"]
    assert Retention(keep_every=2).reasons([2, 3])[2] == ["every 2nd"]
    assert Retention(keep_every=11).reasons([11, 12])[11] == ["every 11th"]
    assert Retention(keep_every=21).reasons([21, 22])[21] == ["every 21st"]


def test_keep_best_min_and_max() -> None:
    steps = [1, 2, 3, 4, 5]
    loss = {1: 3.0, 2: 1.5, 3: 2.5, 4: 1.0, 5: 4.0}
    info = infos(steps, val_loss=loss, acc={s: -v for s, v in loss.items()})
    low = Retention(keep_best=KeepBest("val_loss", 2))
    assert low.needs_info()
    assert low.to_delete(steps, info) == [1, 3]  # 5 is the newest
    assert low.reasons(steps, info)[4] == ["best 2 by val_loss (min): 1"]
    assert low.reasons(steps, info)[2] == ["best 2 by val_loss (min): 1.5"]
    high = Retention(keep_best=KeepBest("acc", 1, "max"))
    assert high.to_delete(steps, info) == [1, 2, 3]
    assert high.reasons(steps, info)[4] == ["best 1 by acc (max): -1"]


def test_keep_best_ties_go_to_the_newer_step() -> None:
    steps = [1, 2, 3, 4]
    info = infos(steps, loss={1: 1.0, 2: 1.0, 3: 1.0, 4: 9.0})
    assert Retention(keep_best=KeepBest("loss", 2)).to_delete(steps, info) == [1]


def test_steps_without_the_metric_are_kept_only_by_the_other_policies() -> None:
    # evaluation every other step: the steps in between have no val_loss
    steps = [1, 2, 3, 4, 5, 6]
    info = infos(steps, val_loss={2: 2.0, 4: 1.0, 6: 3.0})
    r = Retention(keep_last=1, keep_best=KeepBest("val_loss", 1))
    assert r.to_delete(steps, info) == [1, 2, 3, 5]
    both = Retention(keep_last=2, keep_best=KeepBest("val_loss", 1))
    assert both.to_delete(steps, info) == [1, 2, 3]


def test_keep_best_on_steps_none_of_which_has_the_metric_deletes_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    steps = [1, 2, 3, 4]
    info = infos(steps, loss={1: 1.0, 2: 2.0})
    r = Retention(keep_last=1, keep_best=KeepBest("val_los", 1))  # misspelt
    with caplog.at_level(logging.WARNING, logger="lazyckpt"):
        assert r.to_delete(steps, info) == []
        assert r.to_delete(steps, info) == []  # warned once, not per pass
    warnings = [rec for rec in caplog.records if rec.name == "lazyckpt"]
    assert len(warnings) == 1
    assert "val_los" in warnings[0].getMessage() and "1, 2, 3" in warnings[0].getMessage()
    assert r.reasons(steps, info)[1] == ["no step has val_los"]
    # once a step has it, the rule applies as written
    info[2] = StepInfo(2, info[2].created, {"val_los": 0.5})
    assert r.to_delete(steps, info) == [1, 3]


def test_no_warning_when_the_other_policies_keep_every_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    steps = [1, 2]
    r = Retention(keep_last=5, keep_best=KeepBest("val_loss", 1))
    with caplog.at_level(logging.WARNING, logger="lazyckpt"):
        assert r.to_delete(steps, infos(steps)) == []
    assert not [rec for rec in caplog.records if rec.name == "lazyckpt"]


def test_keep_best_ignores_values_that_are_not_finite_numbers() -> None:
    steps = [1, 2, 3, 4]
    info = infos(steps)
    info[1] = StepInfo(1, NOW, {"loss": math.nan})
    info[2] = StepInfo(2, NOW, {"loss": 5.0})
    info[3] = StepInfo(3, NOW, {"loss": True})
    assert Retention(keep_best=KeepBest("loss", 1)).to_delete(steps, info) == [1, 3]


def test_keep_within() -> None:
    steps = [1, 2, 3, 4]
    age = {1: 10 * HOUR, 2: 2 * HOUR, 3: 0.5 * HOUR, 4: 0.0}
    r = Retention(keep_within=HOUR)
    assert r.needs_info()
    info = infos(steps, age=age)
    assert r.to_delete(steps, info, now=NOW) == [1, 2]
    assert r.reasons(steps, info, now=NOW)[3] == ["within 1h"]
    # later, fewer are within the hour
    assert r.to_delete(steps, info, now=NOW + HOUR) == [1, 2, 3]
    # exactly at the edge is within
    assert Retention(keep_within=2 * HOUR).to_delete(steps, info, now=NOW) == [1]
    # a clock that went back: a step from the "future" is within
    future = {1: StepInfo(1, NOW + 60), 2: StepInfo(2, NOW - 10 * HOUR)}
    assert r.to_delete([1, 2], future, now=NOW) == []


def test_keep_within_counts_from_the_current_time_by_default() -> None:
    import time

    info = {
        1: StepInfo(1, time.time() - 7200),
        2: StepInfo(2, time.time() - 7200),
        3: StepInfo(3, time.time()),
    }
    assert Retention(keep_within=HOUR).to_delete([1, 2, 3], info) == [1, 2]


def test_keep_within_duration_text() -> None:
    info = infos([1, 2], age={1: 0.0, 2: 0.0})
    said = {
        30 * 60: "within 30m",
        6 * HOUR: "within 6h",
        2 * 86400: "within 2d",
        90: "within 90s",
        1.5: "within 1.5s",
    }
    for seconds, text in said.items():
        assert Retention(keep_within=seconds).reasons([1, 2], info, now=NOW)[1] == [text]


# -- combinations, the newest, missing info ------------------------------------------------------


def test_policies_combine_as_a_union() -> None:
    steps = list(range(1, 13))
    info = infos(
        steps, age={s: (12 - s) * HOUR for s in steps}, loss={s: abs(s - 4) for s in steps}
    )
    r = Retention(keep_last=2, keep_every=5, keep_best=KeepBest("loss", 1), keep_within=3 * HOUR)
    why = r.reasons(steps, info, now=NOW)
    assert why[4] == ["best 1 by loss (min): 0"]
    assert why[5] == ["every 5th"]
    assert why[9] == ["within 3h"]
    assert why[10] == ["every 5th", "within 3h"]
    assert why[11] == ["last 2", "within 3h"]
    assert why[12] == ["newest", "last 2", "within 3h"]
    assert r.to_delete(steps, info, now=NOW) == [1, 2, 3, 6, 7, 8]
    # each policy alone keeps a subset of what the union keeps
    kept = set(steps) - set(r.to_delete(steps, info, now=NOW))
    for alone in (
        Retention(keep_last=2),
        Retention(keep_every=5),
        Retention(keep_best=KeepBest("loss", 1)),
        Retention(keep_within=3 * HOUR),
    ):
        assert set(steps) - set(alone.to_delete(steps, info, now=NOW)) <= kept


def test_the_newest_step_is_always_kept() -> None:
    steps = [1, 2, 3]
    info = infos(steps, age={1: 0.0, 2: 0.0, 3: 100 * HOUR}, loss={1: 0.0, 2: 1.0, 3: 9.0})
    assert Retention(keep_within=HOUR).to_delete(steps, info, now=NOW) == []
    assert Retention(keep_best=KeepBest("loss", 1)).to_delete(steps, info) == [2]
    assert Retention(keep_every=2).to_delete(steps) == [1]
    assert Retention(keep_best=KeepBest("loss", 1)).reasons([7], infos([7]))[7][0] == "newest"


def test_a_step_without_info_is_kept() -> None:
    steps = [1, 2, 3, 4]
    info = infos(steps, age={1: 9 * HOUR, 2: 9 * HOUR, 3: 9 * HOUR, 4: 0.0})
    del info[2]
    r = Retention(keep_last=1, keep_within=HOUR)
    assert r.to_delete(steps, info, now=NOW) == [1, 3]
    assert r.reasons(steps, info, now=NOW)[2] == ["no info"]
    best = Retention(keep_last=1, keep_best=KeepBest("loss", 1))
    scored = infos(steps, loss={1: 1.0, 3: 2.0})
    del scored[3]
    assert best.to_delete(steps, scored) == [2]  # 1 is the best, 3 cannot be judged
    assert best.reasons(steps, scored)[3] == ["no info"]
    # info is ignored when no policy needs it
    assert Retention(keep_last=1).to_delete(steps, {}) == [1, 2, 3]


def test_info_is_required_when_a_policy_judges_by_it() -> None:
    for r in (Retention(keep_within=HOUR), Retention(keep_best=KeepBest("loss", 1))):
        with pytest.raises(ValueError, match="StepInfo"):
            r.to_delete([1, 2])
        with pytest.raises(ValueError, match="StepInfo"):
            r.reasons([1, 2])
        assert r.to_delete([]) == []  # nothing to judge


# -- describe, validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "retention",
    [
        Retention(),
        Retention(keep_last=3),
        Retention(keep_every=100),
        Retention(keep_best=KeepBest("val_loss", 2)),
        Retention(keep_best=KeepBest("acc", 1, "max")),
        Retention(keep_within=6 * HOUR),
        Retention(keep_last=2, keep_every=10, keep_best=KeepBest("a:b", 3, "max"), keep_within=90),
    ],
)
def test_describe_round_trips_through_json(retention: Retention) -> None:
    doc = json.loads(json.dumps(retention.describe()))
    assert Retention.from_description(doc) == retention
    assert Retention.from_description(doc).describe() == retention.describe()


def test_describe_spells_each_policy() -> None:
    r = Retention(keep_last=2, keep_every=10, keep_best=KeepBest("loss", 3), keep_within=60)
    assert r.describe() == {
        "keep_last": 2,
        "keep_every": 10,
        "keep_best": {"metric": "loss", "n": 3, "mode": "min"},
        "keep_within": 60.0,
    }
    assert Retention.from_description({"keep_best": ["loss", 3, "max"]}).keep_best == KeepBest(
        "loss", 3, "max"
    )
    assert Retention.from_description({"keep_best": {"metric": "x", "n": 1}}).keep_best == KeepBest(
        "x", 1
    )


@pytest.mark.parametrize(
    ("doc", "named"),
    [
        ({"keep_forever": 1}, "keep_forever"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_best": {"metric": "x"}}, "keep_best"),
        ({"keep_best": {"metric": "x", "n": 1, "how": "min"}}, "keep_best"),
        ({"keep_best": "x:1"}, "keep_best"),
        ({"keep_within": "1h"}, "keep_within"),
        (["keep_last"], "mapping"),
    ],
)
def test_a_bad_description_is_refused(doc: Any, named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        Retention.from_description(doc)


def test_keep_best_tuples_are_normalised() -> None:
    pair: Any = ("loss", 2)
    triple: Any = ("acc", 2, "max")
    assert Retention(keep_best=pair).keep_best == KeepBest("loss", 2, "min")
    assert Retention(keep_best=triple).keep_best == KeepBest("acc", 2, "max")
    as_list: Any = list(triple)
    assert Retention(keep_best=as_list).keep_best == KeepBest("acc", 2, "max")
    assert Retention(keep_within=60) == Retention(keep_within=60.0)
    assert isinstance(Retention(keep_within=60).keep_within, float)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": -1}, "keep_last"),
        ({"keep_last": 2.0}, "keep_last"),
        ({"keep_last": True}, "keep_last"),
        ({"keep_every": 0}, "keep_every"),
        ({"keep_every": "10"}, "keep_every"),
        ({"keep_best": ("loss", 0)}, "keep_best: n"),
        ({"keep_best": ("loss", -2)}, "keep_best: n"),
        ({"keep_best": ("loss", 1.5)}, "keep_best: n"),
        ({"keep_best": ("", 1)}, "keep_best: the metric"),
        ({"keep_best": (None, 1)}, "keep_best: the metric"),
        ({"keep_best": ("loss", 1, "lowest")}, "keep_best: mode"),
        ({"keep_best": "loss"}, "keep_best must be"),
        ({"keep_best": ("loss",)}, "keep_best must be"),
        ({"keep_best": {"metric": "loss", "n": 1}}, "keep_best must be"),
        ({"keep_within": 0}, "keep_within"),
        ({"keep_within": -5.0}, "keep_within"),
        ({"keep_within": math.inf}, "keep_within"),
        ({"keep_within": math.nan}, "keep_within"),
        ({"keep_within": True}, "keep_within"),
        ({"keep_within": "6h"}, "keep_within"),
    ],
)
def test_bad_policies_name_their_option(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        Retention(**kwargs)


def test_keep_best_checks_itself() -> None:
    with pytest.raises(ConfigurationError, match="keep_best: n"):
        KeepBest("loss", 0)
    with pytest.raises(ConfigurationError, match="keep_best: mode"):
        KeepBest("loss", 1, "MIN")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="keep_best: the metric"):
        KeepBest("", 1)


def test_retention_stays_a_frozen_comparable_value() -> None:
    r = Retention(keep_last=2, keep_best=KeepBest("loss", 1))
    with pytest.raises(AttributeError):
        r.keep_last = 3  # type: ignore[misc]
    assert r == Retention(keep_last=2, keep_best=("loss", 1))  # type: ignore[arg-type]
    assert hash(r) == hash(Retention(keep_last=2, keep_best=KeepBest("loss", 1)))
    assert "_warned" not in repr(r)
    assert hash(StepInfo(1, 2.0, {"a": 1.0})) == hash(StepInfo(1, 2.0, {"a": 2.0}))


def test_exported_where_retention_is() -> None:
    for module in (lazyckpt, lazyckpt.tier):
        for name in ("Retention", "KeepBest", "StepInfo"):
            assert name in module.__all__ and hasattr(module, name)


# -- on tiers ------------------------------------------------------------------------------------


def test_tiers_take_a_whole_retention(tmp_path: Path) -> None:
    policy = Retention(keep_last=2, keep_best=KeepBest("val_loss", 1), keep_within=HOUR)
    assert FileTier(tmp_path, retention=policy).retention is policy
    assert HostMemoryTier(1 << 20, retention=policy).retention is policy
    assert FileTier(tmp_path, keep_last=3).retention == Retention(keep_last=3)
    assert FileTier(tmp_path).retention == Retention()
    with pytest.raises(ConfigurationError, match="not both"):
        FileTier(tmp_path, keep_last=3, retention=policy)
    with pytest.raises(ConfigurationError, match="not both"):
        HostMemoryTier(1 << 20, keep_every=3, retention=policy)
    with pytest.raises(ConfigurationError, match="retention must be"):
        FileTier(tmp_path, retention={"keep_last": 2})  # type: ignore[arg-type]


def test_other_builtin_tiers_take_retention(tmp_path: Path) -> None:
    policy = Retention(keep_every=10)
    kinds = lazyckpt.available_tiers()
    if "peer" in kinds:
        assert kinds["peer"](tmp_path / "peer", retention=policy).retention is policy
    if "zarr" in kinds:
        assert kinds["zarr"](tmp_path / "z", retention=policy).retention is policy
        with pytest.raises(ConfigurationError, match="not both"):
            kinds["zarr"](tmp_path / "z", keep_last=1, retention=policy)


def _snapshot(
    step: int, *, created: float, metrics: dict[str, float] | None = None, **extra: Any
) -> tuple[Manifest, list[bytes]]:
    manifest, payloads = build_snapshot(step, {"w": torch.full((8,), float(step))})
    return replace(manifest, created=created, metrics=metrics or {}, extra=extra), payloads


async def test_host_tier_applies_keep_best_from_its_manifests() -> None:
    tier = HostMemoryTier(1 << 20, retention=Retention(keep_last=1, keep_best=KeepBest("loss", 1)))
    await tier.open()
    try:
        for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 5.0)):
            manifest, payloads = _snapshot(step, created=NOW, metrics={"loss": loss})
            await tier.begin(manifest)
            for shard, payload in zip(manifest.shards, payloads, strict=True):
                await tier.put_shard(manifest, shard, memoryview(payload))
            await tier.commit(manifest)
        assert await tier.steps() == [2, 4]
    finally:
        await tier.aclose()


# -- manifests carry the metrics -----------------------------------------------------------------


def test_manifest_metrics_round_trip_and_stay_absent_when_empty() -> None:
    manifest, _ = build_snapshot(3, {"w": torch.ones(4)})
    plain = manifest.to_json()
    assert b'"metrics"' not in plain
    assert Manifest.from_json(plain).metrics == {}
    scored = replace(manifest, metrics={"val_loss": 2.1, "acc": 0.5})
    for compact in (False, True):
        encoded = scored.to_json(compact=compact)
        assert json.loads(encoded)["metrics"] == {"val_loss": 2.1, "acc": 0.5}
        assert Manifest.from_json(encoded) == scored
    assert StepInfo.from_manifest(scored) == StepInfo(
        3, scored.created, {"val_loss": 2.1, "acc": 0.5}
    )


@pytest.mark.parametrize("bad", [{"a": "1"}, {"a": True}, {"a": None}, [1.0], {"a": 1e400}])
def test_damaged_metrics_are_refused(bad: Any) -> None:
    manifest, _ = build_snapshot(3, {"w": torch.ones(4)})
    doc = json.loads(replace(manifest, metrics={"x": 1.0}).to_json())
    doc.pop("checksum")
    doc["metrics"] = bad
    import crc32c

    body = json.dumps(doc, separators=(",", ":"))
    raw = body[:-1] + f',"checksum":{crc32c.crc32c(body.encode())}}}'
    with pytest.raises(lazyckpt.CorruptionError, match="metrics"):
        Manifest.from_json(raw)


def test_check_metrics() -> None:
    assert check_metrics({"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}
    assert type(check_metrics({"a": 1})["a"]) is float
    for bad, said in (
        ({"a": math.nan}, "finite"),
        ({"a": math.inf}, "finite"),
        ({"a": "x"}, "number"),
        ({"a": False}, "number"),
        ({"": 1.0}, "name"),
        ({3: 1.0}, "name"),
        ([("a", 1.0)], "mapping"),
    ):
        with pytest.raises(ConfigurationError, match=said):
            check_metrics(bad)


# -- the command line ----------------------------------------------------------------------------


async def _write(
    root: Path, snapshots: dict[int, dict[str, Any]], retention: Retention | None = None
) -> None:
    """Commit steps in a file tier through the tier API, each with the ``created`` time and
    ``metrics`` given (and, with ``retention``, the policy recorded as the engine does)."""
    tier = FileTier(root)
    await tier.open()
    try:
        for step, spec in snapshots.items():
            extra = {} if retention is None else {"retention": retention.describe()}
            manifest, payloads = _snapshot(
                step, created=spec["created"], metrics=spec.get("metrics"), **extra
            )
            await tier.begin(manifest)
            for shard, payload in zip(manifest.shards, payloads, strict=True):
                await tier.put_shard(manifest, shard, memoryview(payload))
            await tier.commit(manifest)
    finally:
        await tier.aclose()


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def _run_of(root: Path, retention: Retention | None = None) -> None:
    import time

    now = time.time()
    loss = {1: 3.0, 2: 1.0, 3: 2.0, 4: 4.0, 5: 5.0, 6: 6.0}
    asyncio.run(
        _write(
            root,
            {
                # a step a day, each a minute younger than whole days
                s: {
                    "created": now - (6 - s) * 86400 + 60,
                    "metrics": {"val_loss": v} if s != 5 else {},
                }
                for s, v in loss.items()
            },
            retention,
        )
    )


def test_gc_keep_best_dry_run_then_delete(run: Run, tmp_path: Path) -> None:
    root = tmp_path / "run"
    _run_of(root)
    code, out, err = run("gc", root, "--keep-best", "val_loss:2", "--dry-run")
    assert code == EXIT_OK, err
    assert out.splitlines() == ["would delete step 1", "would delete step 4", "would delete step 5"]
    assert "would keep 3 of 6" in err
    assert _steps(root) == [1, 2, 3, 4, 5, 6]
    code, out, err = run("gc", root, "--keep-best", "val_loss:1:max", "--keep-last", "2")
    assert code == EXIT_OK, err
    assert out.splitlines() == [
        "deleted step 1",
        "deleted step 2",
        "deleted step 3",
        "deleted step 4",
    ]
    assert _steps(root) == [5, 6]


def test_gc_keep_best_of_a_metric_no_step_has_deletes_nothing(
    run: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    _run_of(root)
    with caplog.at_level(logging.WARNING, logger="lazyckpt"):
        code, out, _ = run("gc", root, "--keep-best", "val_los:1", "--keep-last", "1")
    assert code == EXIT_OK
    assert out == ""
    # the warning, through the lazyckpt logger (on stderr, where logging is not set up)
    assert any("'val_los'" in rec.getMessage() for rec in caplog.records)
    assert _steps(root) == [1, 2, 3, 4, 5, 6]


def test_gc_keep_within(run: Run, tmp_path: Path) -> None:
    root = tmp_path / "run"
    _run_of(root)  # one step a day, the newest now
    code, out, _ = run("gc", root, "--keep-within", "2d", "--dry-run")
    assert code == EXIT_OK
    assert out.splitlines() == [f"would delete step {s}" for s in (1, 2, 3)]
    code, out, _ = run("gc", root, "--keep-within", "36h", "--keep-every", "2")
    assert code == EXIT_OK
    assert out.splitlines() == ["deleted step 1", "deleted step 3"]
    assert _steps(root) == [2, 4, 5, 6]
    code, out, _ = run("gc", root, "--keep-within", "60", "--dry-run")  # seconds
    assert out.splitlines() == [f"would delete step {s}" for s in (2, 4, 5)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--keep-best", "val_loss"],
        ["--keep-best", "val_loss:0"],
        ["--keep-best", "val_loss:x"],
        ["--keep-best", ":2"],
        ["--keep-best", "val_loss:2:lowest"],
        ["--keep-within", "0"],
        ["--keep-within", "6 hours"],
        ["--keep-within", "-1h"],
        ["--keep-within", "inf"],
        [],
    ],
)
def test_gc_refuses_bad_policies(run: Run, tmp_path: Path, argv: list[str]) -> None:
    root = tmp_path / "run"
    _run_of(root)
    code, _, err = run("gc", root, *argv)
    assert code == EXIT_USAGE, err
    assert _steps(root) == [1, 2, 3, 4, 5, 6]


def test_gc_metric_names_may_hold_colons(run: Run, tmp_path: Path) -> None:
    root = tmp_path / "run"
    asyncio.run(
        _write(root, {s: {"created": NOW, "metrics": {"eval:loss": float(s)}} for s in (1, 2, 3)})
    )
    code, out, _ = run("gc", root, "--keep-best", "eval:loss:1:max", "--dry-run")
    assert code == EXIT_OK
    assert out.splitlines() == ["would delete step 1", "would delete step 2"]


def test_ls_says_why_each_step_is_kept(run: Run, tmp_path: Path) -> None:
    root = tmp_path / "run"
    policy = Retention(
        keep_last=1, keep_every=3, keep_best=KeepBest("val_loss", 2), keep_within=2 * 86400
    )
    _run_of(root, policy)
    code, out, err = run("ls", root)
    assert code == EXIT_OK, err
    lines = out.splitlines()
    header = lines[0]
    assert header.split()[:5] == ["STEP", "SIZE", "TENSORS", "RANKS", "CREATED"]
    assert "METRICS" in header and header.rstrip().endswith("KEPT BECAUSE")
    kept = {
        int(line.split()[0]): line[header.index("KEPT BECAUSE") :].strip() for line in lines[1:]
    }
    assert kept[1] == "-"  # what the next retention pass deletes
    assert kept[2] == "best 2 by val_loss (min): 1"
    assert kept[3] == "every 3rd, best 2 by val_loss (min): 2"
    assert kept[4] == kept[5] == "within 2d"
    assert kept[6] == "newest, last 1, every 3rd, within 2d"
    metrics = {int(line.split()[0]): line for line in lines[1:]}
    assert "val_loss=1" in metrics[2] and "val_loss=6" in metrics[6]

    code, out, _ = run("ls", root, "--json")
    entries = {e["step"]: e for e in json.loads(out)}
    assert entries[1]["kept_because"] == {"file": []}
    assert entries[2]["kept_because"] == {"file": ["best 2 by val_loss (min): 1"]}
    assert entries[2]["metrics"] == {"val_loss": 1.0}
    assert entries[5]["metrics"] == {}


@pytest.mark.parametrize("recorded", [None, Retention()])
def test_ls_without_a_policy_that_deletes_has_no_column(
    run: Run, tmp_path: Path, recorded: Retention | None
) -> None:
    # nothing recorded (an older writer), or a tier that keeps everything
    root = tmp_path / "run"
    asyncio.run(_write(root, {s: {"created": NOW} for s in (1, 2)}, recorded))
    code, out, _ = run("ls", root)
    assert code == EXIT_OK
    assert out.splitlines()[0].split() == ["STEP", "SIZE", "TENSORS", "RANKS", "CREATED", "TIERS"]
    code, out, _ = run("ls", root, "--json")
    assert all("kept_because" not in e and e["metrics"] == {} for e in json.loads(out))


def test_ls_tolerates_a_retention_it_cannot_read(run: Run, tmp_path: Path) -> None:
    root = tmp_path / "run"

    async def write() -> None:
        tier = FileTier(root)
        await tier.open()
        try:
            for step in (1, 2):
                manifest, payloads = _snapshot(step, created=NOW, retention={"keep_forever": True})
                await tier.begin(manifest)
                for shard, payload in zip(manifest.shards, payloads, strict=True):
                    await tier.put_shard(manifest, shard, memoryview(payload))
                await tier.commit(manifest)
        finally:
            await tier.aclose()

    asyncio.run(write())
    code, out, err = run("ls", root)
    assert code == EXIT_OK
    assert "KEPT" not in out
    assert "keep_forever" in err


def test_ls_of_several_locations_says_whose_retention(run: Run, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    asyncio.run(_write(a, {s: {"created": NOW} for s in (1, 2, 3)}, Retention(keep_last=2)))
    asyncio.run(_write(b, {s: {"created": NOW} for s in (2, 3)}, Retention(keep_every=2)))
    code, out, _ = run("ls", a, b, "--json")
    assert code == EXIT_OK
    by_step = {e["step"]: e["kept_because"] for e in json.loads(out)}
    assert by_step[1] == {str(a): []}
    assert by_step[2] == {str(a): ["last 2"], str(b): ["every 2nd"]}
    assert by_step[3] == {str(a): ["newest", "last 2"], str(b): ["newest"]}
    code, out, _ = run("ls", a, b)
    line = next(line for line in out.splitlines() if line.split()[0] == "2")
    assert f"{a}: last 2; {b}: every 2nd" in line
