"""The Checkpointer's options: one frozen dataclass, checked when it is built."""

from __future__ import annotations

import dataclasses
import re
import signal
from pathlib import Path
from typing import Any

import pytest

import lazyckpt
from lazyckpt import CheckpointerOptions, ConfigurationError
from tiers import FileTier, HostMemoryTier

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_api_page_lists_every_option_and_nothing_else() -> None:
    text = (DOCS / "api.md").read_text()
    section = text.split("## `lazyckpt.Checkpointer(tiers, **options)`", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(CheckpointerOptions))


def test_every_option_is_documented_on_the_class() -> None:
    doc = CheckpointerOptions.__doc__ or ""
    for f in dataclasses.fields(CheckpointerOptions):
        assert f"        {f.name}: " in doc, f.name


@pytest.mark.parametrize(
    ("option", "value", "accepted"),
    [
        ("shard_size", 1000, "multiple of 4096"),
        ("shard_size", 4096 * 3 + 1, "multiple of 4096"),
        ("shard_size", "16M", "multiple of 4096"),
        ("pack_bytes", -1, "int >= 0"),
        ("allow_pickle", 1, "True or False"),
        ("capture_threads", 0, "int >= 1"),
        ("capture_threads", 2.0, "int >= 1"),
        ("checksum_threads", 0, "int >= 1"),
        ("io_concurrency", 0, "int >= 1"),
        ("deadline", 0, "seconds > 0 or None"),
        ("deadline", float("nan"), "seconds > 0 or None"),
        ("retries", -1, "int >= 0"),
        ("retry_backoff", -0.1, "seconds >= 0"),
        ("when_busy", "drop", "'wait' or 'skip'"),
        ("staging_bytes", 0, "int >= 1"),
        ("use_uvloop", "yes", "True, False or None"),
        ("distributed", 1, "True, False or None"),
        ("on_failure", "ignore", "'warn' or 'raise'"),
        ("eager_bytes", -1, "int >= 0"),
        ("eager", "model/ema", "list or tuple of key patterns"),
        ("lazy", [1], "list or tuple of key patterns"),
        ("verify_sources", None, "True or False"),
        ("exit_timeout", -1, "seconds >= 0"),
        ("preemption_signals", signal.SIGTERM, "tuple of signals"),
        ("preemption_grace", 0, "seconds > 0"),
    ],
)
def test_a_bad_value_names_the_option_and_what_it_accepts(
    option: str, value: Any, accepted: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"^{option} must be .*{re.escape(accepted)}.*got"):
        CheckpointerOptions(**{option: value})


def test_the_checkpointer_checks_through_the_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"^when_busy must be 'wait' or 'skip', got 'drop'"):
        lazyckpt.Checkpointer([FileTier(tmp_path)], when_busy="drop")
    with pytest.raises(ConfigurationError, match=r"unknown Checkpointer options: \['shardsize'\]"):
        lazyckpt.SyncCheckpointer([FileTier(tmp_path)], shardsize=4096)


def test_values_are_normalised_and_frozen() -> None:
    opts = CheckpointerOptions(
        eager=["model/ema.*"], preemption_signals=[signal.SIGUSR1, signal.SIGUSR1], preemption_grace=5
    )
    assert opts.eager == ("model/ema.*",)
    assert opts.preemption_signals == (signal.SIGUSR1,)
    assert opts.preemption_grace == 5.0 and type(opts.preemption_grace) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.retries = 1  # type: ignore[misc]


def test_layout_defaults_follow_the_arena() -> None:
    assert CheckpointerOptions().layout(1 << 30) == lazyckpt.LayoutOptions(16 << 20, 1 << 20)
    # a small arena: a quarter of it per shard, a quarter of a shard per packed tensor
    small = CheckpointerOptions().layout(1 << 20)
    assert small == lazyckpt.LayoutOptions(256 << 10, 64 << 10)
    given = CheckpointerOptions(shard_size=1 << 16, pack_bytes=0).layout(1 << 30)
    assert given == lazyckpt.LayoutOptions(1 << 16, 0)


def test_a_checkpointer_shows_its_options_and_they_rebuild_one(tmp_path: Path) -> None:
    ckpt = lazyckpt.SyncCheckpointer([HostMemoryTier(1 << 20)], retries=1, eager=("x",))
    assert ckpt.options.retries == 1 and ckpt.options.eager == ("x",)
    again = lazyckpt.SyncCheckpointer([HostMemoryTier(1 << 20)], **dataclasses.asdict(ckpt.options))
    assert again.options == ckpt.options
    # the resolved layout: a quarter of the 1 MiB host arena per shard
    assert ckpt._core.engine.layout.shard_size == 256 << 10
