"""States of many tensors: the collector held off during the per-tensor bursts, the key
cache sized past 65,536 keys, the manifest's checksum checked on the bytes as read, and
restore(into=) handing back the very tensors it filled."""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

import crc32c
import pytest
import torch

import lazyckpt
from lazyckpt import CorruptionError, LayoutOptions, Manifest, UnsupportedStateError
from lazyckpt._checkpointer import core as _core
from lazyckpt._format.manifest import plan_layout
from lazyckpt._format.walk import KeyCache, walk_state
from lazyckpt._gcpause import collector_paused
from tiers import FileTier


@pytest.fixture
def collector_on() -> None:
    # the tests below are about switching it: start from the usual state
    assert gc.isenabled()


def test_collector_paused_restores_the_previous_state(collector_on: None) -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError, match="inside"), collector_paused():
        raise ValueError("raised inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's choice stands
    finally:
        gc.enable()


def test_snapshot_walks_with_the_collector_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, collector_on: None
) -> None:
    seen: list[bool] = []
    real = _core.walk_state

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(gc.isenabled())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_core, "walk_state", spy)
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        ckpt.snapshot({"w": torch.ones(3)}, step=1).wait()
        assert gc.isenabled()
        with pytest.raises(UnsupportedStateError):
            ckpt.snapshot({"w": torch.ones(3), "bad": object()}, step=2)
        assert gc.isenabled()  # a failed walk leaves it on too
    assert seen == [False, False]


def test_key_cache_holds_more_than_65536_keys() -> None:
    n = 70_000
    state = {f"expert{i}.w": torch.empty(0) for i in range(n)}
    keys = KeyCache()
    walk_state(state, allow_pickle=False, keys=keys)
    tree, _ = walk_state(state, allow_pickle=False, keys=keys)
    # every path of the first walk is still cached: the second walk shares its tree items
    again, _ = walk_state(state, allow_pickle=False, keys=keys)
    assert all(a is b for a, b in zip(tree["$dict"], again["$dict"], strict=True))
    assert len(tree["$dict"]) == n


def _manifest() -> Manifest:
    tree, refs = walk_state({"a": torch.zeros(3, 5), "b": {"c": 1.5}}, allow_pickle=False)
    return plan_layout(3, tree, refs, LayoutOptions()).with_checksums([123])


def test_manifest_bytes_are_what_older_readers_check() -> None:
    raw = _manifest().to_json()
    doc = json.loads(raw)
    assert list(doc)[-1] == "checksum"
    checksum = doc.pop("checksum")
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    assert crc32c.crc32c(body) == checksum
    assert json.dumps({**doc, "checksum": checksum}, separators=(",", ":")).encode() == raw


def test_manifest_in_another_spelling_is_still_read() -> None:
    m = _manifest()
    respelled = json.dumps(json.loads(m.to_json()), indent=2).encode()
    assert Manifest.from_json(respelled) == m
    tampered = respelled.replace(b'"step": 3', b'"step": 4')
    assert tampered != respelled
    with pytest.raises(CorruptionError, match="checksum"):
        Manifest.from_json(tampered)


def test_restore_into_hands_back_the_same_tensors(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(50)])
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        ckpt.snapshot({"model": model.state_dict(), "opt": {0: {"m": torch.ones(4)}}}, step=1).wait()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        target = {"model": model.state_dict(keep_vars=True), "opt": {0: {"m": torch.zeros(4)}}}
        before = {k: id(v) for k, v in target["model"].items()}
        m_before = target["opt"][0]["m"]
        out = ckpt.restore(1, into=target)
    assert out is target
    assert {k: id(v) for k, v in target["model"].items()} == before
    assert target["opt"][0]["m"] is m_before and torch.equal(m_before, torch.ones(4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert all(p.requires_grad for p in model.parameters())


def test_many_tiny_tensors_round_trip(tmp_path: Path) -> None:
    n = 5_000
    with warnings.catch_warnings():  # creating one is "experimental"; restoring must not warn
        warnings.simplefilter("ignore", UserWarning)
        c32 = torch.ones(2, dtype=torch.complex32)
    state = {
        "model": {f"layers.{i}.bias": torch.full((3,), float(i)) for i in range(n)},
        "optim": {i: {"exp_avg": torch.full((2,), -float(i))} for i in range(n)},
        "c32": c32,
    }
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)]) as ckpt:
        for step in range(3):
            ckpt.snapshot(state, step=step).wait()
        back = ckpt.restore(2)
    assert back["model"].keys() == state["model"].keys()
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
    assert all(torch.equal(back["optim"][i]["exp_avg"], state["optim"][i]["exp_avg"]) for i in range(n))
    assert torch.equal(back["c32"].view(torch.uint8), state["c32"].view(torch.uint8))


def test_file_tier_reads_a_shard_in_pieces_side_by_side(tmp_path: Path) -> None:
    with pytest.raises(lazyckpt.ConfigurationError, match="read_threads"):
        FileTier(tmp_path, read_threads=0)
    state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(7)}
    tier = FileTier(tmp_path, piece_bytes=4096, read_threads=3)  # 98 pieces
    with lazyckpt.SyncCheckpointer([tier]) as ckpt:
        ckpt.snapshot(state, step=1).wait()
        back = ckpt.restore(1)
        assert all(torch.equal(back[k], v) for k, v in state.items())
        data = next(tmp_path.glob("step-*/rank-*.data"))
        with open(data, "r+b") as f:  # half of the pieces now lie past the end
            f.truncate(200_000)
        with pytest.raises(CorruptionError, match="no tier holds a good copy"):
            ckpt.restore(1)
