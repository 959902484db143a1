"""The column encoding of the manifest (format version 4): the same manifest as the rows,
a fraction of the size, every damage a CorruptionError, read by every reader."""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lazyckpt
from lazyckpt import CorruptionError, LayoutOptions, LazyCkptError, Manifest
from lazyckpt._format import manifest as _manifest
from lazyckpt._format.manifest import COMPACT_TENSORS, plan_layout
from lazyckpt._format.walk import walk_state
from lazyckpt.cli import main
from tiers import FileTier, ZarrTier

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64])


def _plan(state: dict[str, Any]) -> Manifest:
    tree, refs = walk_state(state, allow_pickle=False)
    m = plan_layout(7, tree, refs, LayoutOptions(4096, 256))
    return m.with_checksums([(i * 2654435761) % 2**32 for i in range(len(m.shards))])


def _encode(doc: dict[str, Any]) -> bytes:
    """A document with its checksum recomputed: damage that only the checks can find."""
    doc = {k: v for k, v in doc.items() if k != "checksum"}
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    return json.dumps({**doc, "checksum": crc32c.crc32c(body.encode())}, separators=(",", ":")).encode()


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(
    tensors=st.lists(st.tuples(shapes, dtypes, st.booleans()), min_size=1, max_size=25),
    names=st.lists(st.text(string.ascii_letters + "._%é", min_size=2, max_size=12).filter(lambda s: s != ".."), min_size=25, max_size=25, unique=True),
)
def test_columns_and_rows_decode_to_the_same_manifest(
    tensors: list[tuple[tuple[int, ...], torch.dtype, bool]], names: list[str]
) -> None:
    state: dict[str, Any] = {}
    previous = None
    for (shape, dtype, tied), name in zip(tensors, names, strict=False):
        # a tied entry repeats the previous tensor: an alias
        state[name] = previous if tied and previous is not None else torch.zeros(shape, dtype=dtype)
        previous = state[name]
    state["meta"] = {"epoch": 3, "lr": [1e-3, float("inf")]}
    m = _plan(state)
    compact, rows = m.to_json(compact=True), m.to_json(compact=False)
    assert json.loads(compact)["format_version"] == 5
    assert json.loads(rows)["format_version"] < 5
    assert Manifest.from_json(compact) == Manifest.from_json(rows) == m
    # another encoder's spelling (a Zarr attribute is re-encoded) is read too
    assert Manifest.from_json(json.dumps(json.loads(compact), indent=1)) == m


def test_many_tensors_get_the_columns_and_few_keep_the_rows() -> None:
    few = _plan({f"t{i}": torch.zeros(2) for i in range(COMPACT_TENSORS - 1)})
    many = _plan({f"t{i}": torch.zeros(2) for i in range(COMPACT_TENSORS)})
    assert json.loads(few.to_json())["format_version"] == 1
    assert json.loads(many.to_json())["format_version"] == 5
    assert len(many.to_json()) < len(many.to_json(compact=False)) / 2


def test_a_field_the_columns_do_not_know_keeps_the_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _plan({f"t{i}": torch.zeros(2) for i in range(COMPACT_TENSORS)})
    monkeypatch.setattr(_manifest, "_COLUMNS_HOLD_EVERY_FIELD", False)
    assert json.loads(m.to_json())["format_version"] == 1
    assert json.loads(m.to_json(compact=True))["format_version"] == 1


def test_incremental_fields_round_trip_in_columns() -> None:
    m = _plan({f"t{i}": torch.full((300,), float(i)) for i in range(COMPACT_TENSORS)})
    assert len(m.shards) > 2
    digested = replace(
        m,
        shards=tuple(
            replace(s, digest=f"{s.index:032x}") if s.index % 2 else s for s in m.shards
        ),
    )
    refers = digested.with_references({1: 3, len(m.shards) - 1: 5})
    encoded = refers.to_json()
    doc = json.loads(encoded)
    assert doc["format_version"] == 5
    assert doc["shards"]["stored_in"] == [[1, 3], [len(m.shards) - 1, 5]]
    assert Manifest.from_json(encoded) == refers
    # the same references in the rows, which an older reader of format 4 understands
    rows = json.loads(refers.to_json(compact=False))
    assert rows["format_version"] == 4
    assert Manifest.from_json(refers.to_json(compact=False)) == refers


@pytest.mark.parametrize("damage", [[[0, 7]], [[0, "3"]], [[0, -1]], [[10**6, 3]]])
def test_damaged_references_in_columns_are_corruption(damage: list[list[Any]]) -> None:
    m = _plan({f"t{i}": torch.zeros(300) for i in range(COMPACT_TENSORS)})
    doc = json.loads(m.to_json())
    doc["shards"]["stored_in"] = damage  # step 7 is the manifest's own step
    with pytest.raises(CorruptionError):
        Manifest.from_json(_encode(doc))


def test_distributed_fields_round_trip_in_columns() -> None:
    m = _plan({"w": torch.zeros(3, 3), "r": torch.zeros(4), "b": torch.zeros(2)})
    w, r, b = m.tensors
    tensors = (
        replace(w, global_shape=(6, 3), global_offset=(3, 0), placements=("shard(0)",)),
        replace(
            r, mode="replica", shards=(), offset=0, writer=0, global_shape=(4,),
            global_offset=(0,), placements=("replicate",),
        ),
        b,
    )
    shards = tuple(
        replace(s, segments=tuple(g for g in s.segments if g.tensor != 1)) for s in m.shards
    )
    dist = replace(m, tensors=tensors, shards=shards, rank=1, world_size=2)
    back = Manifest.from_json(dist.to_json(compact=True))
    assert back == Manifest.from_json(dist.to_json(compact=False)) == dist


def _columns_doc() -> dict[str, Any]:
    m = _plan({"a": torch.zeros(30, 50), "b": [torch.ones(3), torch.ones(5)], "c": torch.zeros(0)})
    doc: dict[str, Any] = json.loads(m.to_json(compact=True))
    return doc


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def damage(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        if last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return damage


@pytest.mark.parametrize(
    "damage",
    [
        _set("tensors.count", 99),
        _set("tensors.key_shared.1", 50),  # shares more than the previous key has
        _set("tensors.key_rest.0", 5),
        _set("tensors.dtype.0", 9),
        _set("tensors.dtypes", ["float99"]),
        _set("tensors.mode", "pzzz"),
        _set("tensors.ndim.0", 7),
        _set("tensors.dims.0", -1),
        _set("tensors.dims.0", 1.5),
        _set("tensors.dims.0", True),
        _set("tensors.shards.0", 40),  # a shard that does not exist
        _set("tensors.offset.0", -8),
        _set("tensors.alias_of", [[0, 0]]),
        _set("tensors.alias_of", [[9, 0]]),
        _set("tensors.writer", [[1, 0]]),  # a writer on a tensor that is not a replica
        _set("tensors.dist", [[0, [30], [0], ["replicate"]]]),
        _set("shards.count", 0),
        _set("shards.kind", "x" * 3),
        _set("shards.crc32c.0", 2**32),
        _set("shards.offset.0", 1 << 40),  # outside the stream
        _set("shards.length.2", 1),  # its segments overrun it
        _set("shards.segment_tensor.0", 50),
        _set("shards.segment_length.0", 10_000),
        _set("shards.segment_offset.0", -1),
        _set("shards", []),
        _set("format_version", 6),
    ],
    ids=lambda d: "",
)
def test_damaged_columns_are_corruption(damage: Callable[[dict[str, Any]], None]) -> None:
    doc = _columns_doc()
    Manifest.from_json(_encode(doc))  # the undamaged document is read
    damage(doc)
    with pytest.raises(CorruptionError):
        Manifest.from_json(_encode(doc))


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_column_bytes_only_raise_corruption(data: st.DataObject) -> None:
    original = replace(
        _plan({"a": torch.zeros(30, 50), "b": [torch.ones(3)], "v": {"x": (1, "y")}}), created=0.0
    )
    raw = bytearray(original.to_json(compact=True))
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
    assert decoded == original  # only white space can change and still be read


def _many_state(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {f"layers.{i}.weight": torch.randn(4, generator=g) for i in range(n)},
        "big": torch.randn(3000, 7, generator=g),
        "step": 9,
    }


def test_file_tier_writes_columns_that_restore_verify_and_the_cli_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = _many_state(COMPACT_TENSORS + 10)
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)], shard_size=64 << 10) as ckpt:
        ckpt.snapshot(state, step=4).wait()
    manifest = tmp_path / "step-000000000004" / "manifest.json"
    assert json.loads(manifest.read_bytes())["format_version"] == 5
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path, readonly=True)]) as ckpt:
        restored = ckpt.restore(4)
        assert ckpt.verify(4).ok
    assert restored["step"] == 9 and torch.equal(restored["big"], state["big"])
    assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())
    assert main(["verify", str(tmp_path)]) == 0
    assert "step 4: ok (3 shards" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path)]) == 0
    assert f"layers.{COMPACT_TENSORS + 9}.weight" in capsys.readouterr().out


def test_zarr_tier_keeps_columns_in_its_attributes(tmp_path: Path) -> None:
    state = _many_state(COMPACT_TENSORS + 10)
    with lazyckpt.SyncCheckpointer([ZarrTier(tmp_path / "z")], shard_size=64 << 10) as ckpt:
        ckpt.snapshot(state, step=2).wait()
    with lazyckpt.SyncCheckpointer([ZarrTier(tmp_path / "z")]) as ckpt:
        restored = ckpt.restore(2)
    assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())
    attrs = json.loads((tmp_path / "z" / "step-000000000002" / "zarr.json").read_text())
    assert attrs["attributes"]["lazyckpt"]["manifest"]["format_version"] == 5


def test_the_plan_text_travels_with_its_manifests_and_never_goes_stale() -> None:
    m = _plan({f"t{i}": torch.zeros(300) for i in range(COMPACT_TENSORS)})
    first = m.to_json()
    again = m.with_checksums([1] * len(m.shards))
    assert again.column_text is m.column_text  # encoded once per plan
    assert json.loads(again.to_json())["shards"]["crc32c"] == [1] * len(m.shards)
    # another manifest sharing the cache object but not the tuples encodes its own tensors
    renamed = replace(m, tensors=tuple(replace(t, key="x" + t.key) for t in m.tensors))
    assert renamed.column_text is m.column_text
    assert Manifest.from_json(renamed.to_json()).tensors == renamed.tensors
    assert Manifest.from_json(first).tensors == m.tensors
