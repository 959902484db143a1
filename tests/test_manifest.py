"""The layout planner and the manifest codec."""

from __future__ import annotations

import itertools
import json
import string
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazyckpt import CorruptionError, LayoutOptions, LazyCkptError, Manifest
from lazyckpt._format.manifest import SHARD_ALIGN, plan_layout
from lazyckpt._format.walk import walk_state

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(shapes, min_size=1, max_size=12),
    shard_kib=st.sampled_from([4, 8, 16]),
    pack=st.sampled_from([0, 256, 2048]),
)
def test_layout_covers_every_byte_once(shapes: list[tuple[int, ...]], shard_kib: int, pack: int) -> None:
    state = {f"t{i}": torch.zeros(s, dtype=torch.float32) for i, s in enumerate(shapes)}
    tree, refs = walk_state(state, allow_pickle=False)
    options = LayoutOptions(shard_size=shard_kib << 10, pack_bytes=min(pack, shard_kib << 10))
    m = plan_layout(1, tree, refs, options)
    covered: dict[int, int] = {}
    previous_end = 0
    for shard in m.shards:
        assert shard.offset % SHARD_ALIGN == 0 and shard.offset >= previous_end
        assert 0 < shard.length <= options.shard_size
        previous_end = shard.offset + shard.length
        spans = sorted((g.offset, g.offset + m.segment_nbytes(g)) for g in shard.segments)
        for (_a0, a1), (b0, _) in itertools.pairwise(spans):
            assert a1 <= b0  # no overlap inside a shard
        for g in shard.segments:
            covered[g.tensor] = covered.get(g.tensor, 0) + m.segment_nbytes(g)
    assert m.stream_bytes >= previous_end
    for i, meta in enumerate(m.tensors):
        assert covered.get(i, 0) == meta.nbytes
        if meta.mode in ("rows", "flat"):
            lengths = [m.shards[s].length for s in meta.shards]
            assert all(x == lengths[0] for x in lengths[:-1])  # regular chunks


def test_packing_keeps_objects_few() -> None:
    state = {f"bias{i}": torch.zeros(64) for i in range(1000)}
    tree, refs = walk_state(state, allow_pickle=False)
    m = plan_layout(0, tree, refs, LayoutOptions())
    assert len(m.shards) == 1


def test_round_trip_and_checksum() -> None:
    tree, refs = walk_state({"a": torch.zeros(3, 5), "b": {"c": 1.5}}, allow_pickle=False)
    m = plan_layout(3, tree, refs, LayoutOptions()).with_checksums([123])
    back = Manifest.from_json(m.to_json())
    assert back == m
    doc = json.loads(m.to_json())
    doc["step"] = 4  # any edit breaks the manifest's own checksum
    with pytest.raises(CorruptionError, match="checksum"):
        Manifest.from_json(json.dumps(doc))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_manifests_only_raise_corruption(data: st.DataObject) -> None:
    tree, refs = walk_state(
        {"a": torch.zeros(30, 50), "b": [torch.ones(3)], "v": {"x": (1, "y")}}, allow_pickle=False
    )
    original = replace(
        plan_layout(3, tree, refs, LayoutOptions(4096, 256)).with_checksums([1, 2, 3]), created=0.0
    )
    raw = bytearray(original.to_json())
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
    pos = data.draw(st.integers(0, len(raw) - 1))
    if kind == "flip":
        raw[pos] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        del raw[pos:]
    else:
        raw[pos:pos] = data.draw(st.text(string.printable, min_size=1, max_size=5)).encode()
    try:
        decoded = Manifest.from_json(bytes(raw))
    except LazyCkptError:
        return
    # A change that survived must be one that decodes to the same manifest (white space).
    assert decoded == original


def test_manifest_without_checksum_field_is_refused() -> None:
    tree, refs = walk_state({"a": torch.zeros(2)}, allow_pickle=False)
    doc = json.loads(plan_layout(0, tree, refs, LayoutOptions()).with_checksums([0]).to_json())
    del doc["checksum"]
    with pytest.raises(CorruptionError):
        Manifest.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    ("state", "version"),
    [
        ({"a": torch.zeros(2), "s": "{\"$ndarray\": 1}"}, 1),  # a string is never a tag
        ({"a": torch.zeros(2), "rng": np.random.get_state()}, 3),
        ({"g": torch.Generator()}, 3),
    ],
)
def test_manifests_say_the_oldest_format_that_reads_them(state: dict[str, object], version: int) -> None:
    tree, refs = walk_state(state, allow_pickle=False)
    m = plan_layout(0, tree, refs, LayoutOptions())
    doc = json.loads(m.to_json())
    assert doc["format_version"] == version
    assert Manifest.from_json(m.to_json()).tree == tree
