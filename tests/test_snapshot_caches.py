"""What ``snapshot()`` keeps from one call to the next is dropped as soon as what it was made
from changes: the plan (the layout, reused while every tensor keeps its key, dtype, shape,
aliasing and placement), the eager policy's choice kept with it (re-read against the data
pointers the guarded optimizers own at each snapshot), and the faster construction of the
plan's entries (equal to the constructors')."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import lazyckpt
from lazyckpt import LayoutOptions, Segment, TensorMeta
from lazyckpt._engine.flight import Flight
from lazyckpt._format import manifest as _manifest
from lazyckpt._format.manifest import plan_layout
from lazyckpt._format.walk import Columns, walk_state
from tiers import HostMemoryTier

SMALL = {"shard_size": 1 << 16, "pack_bytes": 4096}


def _open(**options: Any) -> lazyckpt.SyncCheckpointer:
    ckpt = lazyckpt.SyncCheckpointer([HostMemoryTier(8 << 20)], **{**SMALL, **options})
    ckpt.open()
    return ckpt


def _prepare(ckpt: lazyckpt.SyncCheckpointer, state: dict[str, Any], step: int) -> Flight:
    """snapshot()'s synchronous half, without handing the snapshot to the engine."""
    flight = ckpt._core.prepare(state, step)
    assert isinstance(flight, Flight)
    ckpt._core.withdraw(flight, None)
    return flight


def _copied(flight: Flight) -> set[str]:
    return {r.key for r in flight.refs if r.copied}


def test_the_plan_is_reused_while_the_structure_holds_and_dropped_when_it_changes() -> None:
    ckpt = _open()
    try:
        state: dict[str, Any] = {"w": torch.zeros(4, 8), "b": torch.zeros(8), "n": 1}
        first = _prepare(ckpt, state, 1).manifest
        again = _prepare(ckpt, {**state, "n": 2}, 2).manifest
        # reused: the same entries, this snapshot's own step and tree
        assert again.tensors is first.tensors and again.shards is first.shards
        assert (again.step, first.step) == (2, 1) and again.tree != first.tree

        changes: list[tuple[str, dict[str, Any]]] = [
            ("shape", {"w": torch.zeros(8, 8), "b": state["b"]}),
            ("dtype", {"w": torch.zeros(4, 8, dtype=torch.float16), "b": state["b"]}),
            ("key", {"w2": torch.zeros(4, 8), "b": state["b"]}),
            ("alias", {"w": state["w"], "b": state["w"]}),
            ("count", {"w": state["w"], "b": state["b"], "c": torch.zeros(2)}),
        ]
        step = 2
        for what, tensors in changes:
            step += 1
            before = ckpt._core._plan_cache
            manifest = _prepare(ckpt, tensors, step).manifest
            assert ckpt._core._plan_cache is not before, what
            refs = walk_state(tensors, allow_pickle=False)[1]
            expected = plan_layout(step, manifest.tree, refs, ckpt._core.engine.layout)
            assert manifest.tensors == expected.tensors, what
            assert manifest.shards == expected.shards, what
            assert manifest.stream_bytes == expected.stream_bytes, what
    finally:
        ckpt.close()


def test_the_kept_eager_choice_follows_what_the_guarded_optimizer_owns() -> None:
    """The choice kept with the plan only says which tensors are candidates; whether each is
    owned is read again at every snapshot."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = _open()
    try:
        ckpt.guard(opt)
        loose = torch.zeros(2, 3)  # the weight's shape and dtype, owned by nobody
        owned = _copied(_prepare(ckpt, {"t": model.weight}, 1))
        assert owned == set()  # the optimizer's own parameter: lazy
        cache = ckpt._core._plan_cache
        # the same structure (key, dtype, shape): the plan is kept, ownership is not
        assert _copied(_prepare(ckpt, {"t": loose}, 2)) == {"t"}
        assert ckpt._core._plan_cache is cache
        assert _copied(_prepare(ckpt, {"t": model.weight}, 3)) == set()
        # the optimizer's parameters change (load_state_dict, a new param group): followed
        extra = torch.nn.Parameter(torch.zeros(2, 3))
        opt.add_param_group({"params": [extra]})
        assert _copied(_prepare(ckpt, {"t": extra}, 4)) == set()
        assert _copied(_prepare(ckpt, {"t": loose}, 5)) == {"t"}
        # grown past eager_bytes: a new plan, and no longer a candidate
        big = torch.zeros(1 << 19)
        assert _copied(_prepare(ckpt, {"t": big}, 6)) == set()
        assert ckpt._core._plan_cache is not cache
    finally:
        ckpt.close()


def test_eager_patterns_and_aliases_keep_their_choice_through_the_cache() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = _open(eager=("forced*",), lazy=("never*",))
    try:
        ckpt.guard(opt)
        loose = torch.zeros(3)
        for step in (1, 2):  # a new plan, then the kept one
            state = {
                "forced": model.weight,  # owned, but the pattern copies it
                "forced_alias": model.weight,
                "never": loose,  # not owned, but the pattern keeps it lazy
                "small": loose[:2],  # a candidate, not owned: copied
                "small_alias": loose[:2],
            }
            flight = _prepare(ckpt, state, step)
            assert _copied(flight) == {"forced", "forced_alias", "small", "small_alias"}
            by_key = {r.key: r for r in flight.refs}
            assert by_key["forced_alias"].tensor is by_key["forced"].tensor
            assert by_key["small_alias"].tensor is by_key["small"].tensor
    finally:
        ckpt.close()


def test_the_kept_choice_is_the_policys_choice_over_many_states() -> None:
    """Random states and random ownership, snapshot after snapshot, structure kept or
    changed: the indexes copied are exactly ``EagerPolicy.choose``'s."""
    rng = random.Random(7)
    params = [torch.nn.Parameter(torch.zeros(rng.choice([1, 4, 600]))) for _ in range(12)]
    opt = torch.optim.SGD(params, lr=0.1)
    loose = [torch.zeros(rng.choice([1, 4, 600])) for _ in range(12)]
    ckpt = _open(eager_bytes=1024, eager=("k1*",), lazy=("k2*",))
    try:
        ckpt.guard(opt)
        core = ckpt._core
        layout = [rng.randrange(24) for _ in range(10)]
        for step in range(1, 40):
            if rng.random() < 0.3:  # a new structure now and then
                layout = [rng.randrange(24) for _ in range(rng.randrange(1, 12))]
            pool = params + loose
            state = {f"k{i}": pool[j] for i, j in enumerate(layout)}
            if rng.random() < 0.5:  # swap which tensor of the same shape is under a key
                state = {
                    k: next((t for t in pool if t.shape == v.shape and rng.random() < 0.5), v)
                    for k, v in state.items()
                }
            columns = Columns()
            _, refs = walk_state(state, allow_pickle=False, keys=core._keys, columns=columns)
            expected = core.policy.choose(refs, core.owned_pointers())
            core._plan(step, {}, refs, [r.dist for r in refs], columns)
            assert core._eager(columns.pointers) == expected, (step, state.keys())
    finally:
        ckpt.close()


def test_plan_entries_built_faster_equal_the_constructors() -> None:
    assert _manifest._FAST_ENTRIES  # else the test below checks only the fallback
    for cls in (TensorMeta, Segment):
        assert all(f.default_factory is dataclasses.MISSING for f in dataclasses.fields(cls))
    tensors: dict[str, Any] = {
        "packed": torch.arange(6.0),
        "rows": torch.zeros(64, 32),  # 8 KiB over 4 KiB shards: chunked by rows
        "flat": torch.zeros(2, 2048),  # a row larger than a shard: flat chunks
        "empty": torch.zeros(0),
        "alias": None,
    }
    tensors["alias"] = tensors["packed"]
    tree, refs = walk_state(tensors, allow_pickle=False)
    manifest = plan_layout(1, tree, refs, LayoutOptions(4096, 256))
    assert {t.mode for t in manifest.tensors} == {"pack", "rows", "flat", "empty", "alias"}
    for meta in manifest.tensors:
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(TensorMeta)}
        rebuilt = TensorMeta(**fields)
        assert meta == rebuilt and hash(meta) == hash(rebuilt) and repr(meta) == repr(rebuilt)
        with pytest.raises(dataclasses.FrozenInstanceError):
            meta.key = "changed"  # type: ignore[misc]
    for shard in manifest.shards:
        for seg in shard.segments:
            assert seg == Segment(seg.tensor, seg.offset, seg.start, seg.stop)
            with pytest.raises(dataclasses.FrozenInstanceError):
                seg.start = 1  # type: ignore[misc]
    # and the manifest round-trips through its encoding like a constructed one
    encoded = manifest.with_checksums([0] * len(manifest.shards)).to_json()
    assert _manifest.Manifest.from_json(encoded).tensors == manifest.tensors


def test_plan_entries_fall_back_to_the_constructors(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {"a": torch.arange(6.0), "b": torch.zeros(64, 32)}
    tree, refs = walk_state(tensors, allow_pickle=False)
    fast = plan_layout(1, tree, refs, LayoutOptions(4096, 256))
    monkeypatch.setattr(_manifest, "_FAST_ENTRIES", False)
    slow = plan_layout(1, tree, refs, LayoutOptions(4096, 256))
    assert fast.tensors == slow.tensors and fast.shards == slow.shards


def test_a_snapshot_after_a_structure_change_restores_bit_for_bit(tmp_path: Path) -> None:
    """End to end: states alternate between two structures (new plan, kept plan, new plan)
    and every snapshot restores as it was taken."""
    ckpt = _open()
    try:
        states = []
        for step in range(6):
            width = 4 if step % 3 else 8
            state = {"w": torch.full((width, 3), float(step)), "b": torch.arange(float(step + 1))}
            states.append(state)
            ckpt.snapshot(state, step=step).wait()
        for step, state in enumerate(states):
            got = ckpt.restore(step)
            assert got.keys() == state.keys()
            for k in state:
                assert torch.equal(got[k], state[k]), (step, k)
    finally:
        ckpt.close()


class _Opaque:
    """A value only a pickle can store."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque)

    __hash__ = object.__hash__


def test_the_manifest_says_pickled_exactly_when_a_value_was_pickled() -> None:
    """Whether a snapshot holds a pickle comes from its own walk, also when its plan is
    reused: a value turning into one (or back) with every tensor unchanged is seen."""
    ckpt = _open(allow_pickle=True)
    try:
        tensors = {f"t{i}": torch.zeros(4) for i in range(10)}
        saw = []
        for step, extra in enumerate([1, _Opaque(), _Opaque(), 2, [_Opaque()]], start=1):
            flight = _prepare(ckpt, {"model": tensors, "extra": extra}, step)
            saw.append(flight.manifest.pickled)
        assert saw == [False, True, True, False, True]
    finally:
        ckpt.close()
    plain = _open()
    try:
        assert not _prepare(plain, {"model": {"t": torch.zeros(2)}}, 1).manifest.pickled
    finally:
        plain.close()
