"""The walk's batch path for mappings of plain tensors, and of dicts of them, gives exactly
what the general loop gives, leaves every unusual case to it, and on a warm walk notices
every change a walk with empty caches would."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lazyckpt
from lazyckpt import CorruptionError, UnsupportedStateError
from lazyckpt._format import values as _tree_values
from lazyckpt._format import walk as _tree
from lazyckpt._format.values import decode_tree
from lazyckpt._format.walk import Columns, KeyCache, walk_state
from tiers import FileTier


def _spy_passes(m: pytest.MonkeyPatch) -> list[bool]:
    """Record, per mapping the walk offers to its passes, whether the passes took it."""
    used: list[bool] = []
    real = _tree._Walker._tensor_mapping

    def spy(self: Any, obj: Any, key: str) -> Any:
        found = real(self, obj, key)
        used.append(found is not None)
        return found

    m.setattr(_tree._Walker, "_tensor_mapping", spy)
    return used


def _walk(state: Any, batch: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    with monkeypatch.context() as m:
        m.setattr(_tree, "_BATCH_MIN", 1 if batch else 10**9)
        used = _spy_passes(m)
        keys = KeyCache()
        walk_state(state, allow_pickle=False, keys=keys)  # the second walk uses the caches
        columns = Columns()
        tree, refs = walk_state(state, allow_pickle=False, keys=keys, columns=columns)
    _check_columns(refs, columns)
    described = [(r.key, r.tensor.data_ptr(), r.version, r.alias_of, r.dist) for r in refs]
    return (tree, described), used


def _check_columns(refs: list[Any], columns: Columns) -> None:
    """What the walk says it read of each tensor is what the tensor has."""
    assert columns.dtypes == [r.tensor.dtype for r in refs]
    assert columns.pointers == [r.tensor.data_ptr() for r in refs]
    assert columns.keys == [r.key for r in refs]
    assert len(columns.tensors) == len(refs)
    assert all(map(operator.is_, columns.tensors, [r.tensor for r in refs]))
    assert columns.aliases == [r.alias_of for r in refs]
    assert columns.dists == [r.dist for r in refs]


def test_columns_follow_every_kind_of_tensor() -> None:
    gen = torch.Generator().manual_seed(1)
    state = {
        "model": _tied(),
        "optim": {"state": _optimizer_state(9), "groups": [{"lr": 0.1, "params": [0, 1]}]},
        "loose": [torch.ones(2, dtype=torch.float16), (torch.arange(3),)],
        "array": np.arange(1000.0),  # large enough to be copied into a tensor
        "rng": gen,
        "replicated": lazyckpt.Replicated({f"r{i}": torch.ones(2) for i in range(9)}),
    }
    keys = KeyCache()
    for _ in range(2):  # cold, then warm
        columns = Columns()
        _, refs = walk_state(state, allow_pickle=False, keys=keys, columns=columns)
        assert len(refs) == 10 + 27 + 2 + 1 + 1 + 9  # model, optimizer, loose, array, rng, ...
        assert columns.dists.count(None) == len(refs) - 9
        _check_columns(refs, columns)
    state["model"]["layer3.weight"].data = torch.zeros(3, dtype=torch.float64)
    columns = Columns()
    _, refs = walk_state(state, allow_pickle=False, keys=keys, columns=columns)
    _check_columns(refs, columns)
    assert torch.float64 in columns.dtypes


def _plain(n: int) -> dict[Any, Any]:
    return {f"layer{i}.weight": torch.randn(3) for i in range(n)}


def _with_inference_tensor() -> dict[str, Any]:
    with torch.inference_mode():
        frozen = torch.ones(2)
    return {**_plain(9), "frozen": frozen}


def _view() -> dict[str, Any]:
    base = torch.randn(4)
    return {**_plain(9), "a": base, "b": base[:2]}  # a view at the same data pointer


def _tied() -> dict[str, Any]:
    state = _plain(9)
    state["head"] = state["layer0.weight"]
    return state


def _tied_twice() -> dict[str, Any]:
    state = _tied()
    state["head2"] = state["layer0.weight"]
    state["out"] = state["layer4.weight"]
    return state


def _tied_and_viewed() -> dict[str, Any]:
    state = _tied()
    state["view"] = state["layer0.weight"][:2]  # at the alias's address, not an alias
    return state


CASES: dict[str, Callable[[], dict[Any, Any]]] = {
    "plain": lambda: {"model": _plain(20), "step": 3},
    "parameters": lambda: {"m": dict(torch.nn.Linear(3, 3).named_parameters()) | _plain(8)},
    "int keys": lambda: {"optim": {i: torch.randn(2) for i in range(12)}},
    "tied": _tied,
    "tied twice": _tied_twice,
    "tied and viewed": _tied_and_viewed,
    "empties": lambda: {**_plain(9), "e1": torch.empty(0), "e2": torch.empty(0)},
    "inference": _with_inference_tensor,
    "bool key": lambda: {"d": {True: torch.ones(1), **{i + 2: torch.ones(1) for i in range(9)}}},
    "view": _view,
    "mixed": lambda: {**_plain(9), "lr": 0.1},
    "keys to escape": lambda: {"m": {f"a/{i}%": torch.ones(1) for i in range(9)}},
    "str and int keys": lambda: {"m": {**_plain(5), **{i: torch.ones(1) for i in range(5)}}},
    "dots in keys": lambda: {"m": {f"...{i}": torch.ones(1) for i in range(9)}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_path_walks_as_the_loop_does(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = CASES[case]()
    batch, used = _walk(state, True, monkeypatch)
    loop, _ = _walk(state, False, monkeypatch)
    assert batch == loop
    if case in ("plain", "parameters", "int keys", "tied", "tied twice"):
        assert any(used)  # the batch path took these
    if case.startswith("tied"):
        assert any(alias is not None for *_, alias, _dist in batch[1])


@pytest.mark.parametrize(
    "bad",
    [
        {**_plain(9), "..": torch.ones(1)},  # a key no tier may turn into a path
        {**_plain(9), "s": torch.ones(2, 2).to_sparse()},  # not a dense tensor
        {**_plain(9), "m": torch.empty(2, device="meta")},
        {**_plain(9), "/abs": torch.ones(1)},
        {**_plain(9), "nul\x00": torch.ones(1)},
        {**_plain(9), "x" * 1025: torch.ones(1)},
        {**_plain(9), "": torch.ones(1)},
        {i: {"m": torch.ones(1), "..": torch.ones(1)} for i in range(9)},
        {i: {"m": torch.ones(1), "/m": torch.ones(1)} for i in range(9)},
        {i: {"m": torch.ones(1), "a\nb": torch.ones(1)} for i in range(9)},
        {i: {"m": torch.ones(1), "y" * 1025: torch.ones(1)} for i in range(9)},
        {**{f"p{i}": {"m": torch.ones(1)} for i in range(9)}, ".": {"m": torch.ones(1)}},
    ],
)
def test_batch_path_refuses_what_the_loop_refuses(bad: dict[Any, Any]) -> None:
    with pytest.raises(UnsupportedStateError, match=r"not allowed|longer than|layout|meta"):
        walk_state({"model": bad}, allow_pickle=False)


# -- mappings of dicts (an unflattened optimizer state) and what a warm walk must notice ----


def _optimizer_state(n: int = 12) -> dict[Any, Any]:
    return {
        i: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 2), "exp_avg_sq": torch.randn(2, 2)}
        for i in range(n)
    }


NESTED: dict[str, Callable[[], dict[Any, Any]]] = {
    "optimizer state": lambda: {"optim": {"state": _optimizer_state()}},
    "str outer keys": lambda: {"s": {f"p{i}": {"m": torch.randn(2)} for i in range(9)}},
    "uneven and empty": lambda: {
        "s": {i: {f"m{j}": torch.randn(1) for j in range(i % 3)} for i in range(10)}
    },
    "a plain value inside": lambda: {"s": {**_optimizer_state(9), 9: {"step": 3}}},
    "an OrderedDict inside": lambda: {
        "s": {**_optimizer_state(9), 9: OrderedDict(m=torch.ones(1))}
    },
    "a bool key inside": lambda: {"s": {**_optimizer_state(9), 9: {True: torch.ones(1)}}},
    "an alias inside": lambda: _nested_alias(),
    "inner keys to escape": lambda: {"s": {f"p/{i}": {"a%b": torch.ones(1)} for i in range(9)}},
    "str and int inner keys": lambda: {"s": {i: {"m": torch.ones(1), 1: torch.ones(1)} for i in range(9)}},
}


def _nested_alias() -> dict[str, Any]:
    state = _optimizer_state(9)
    state[8]["exp_avg"] = state[0]["exp_avg_sq"]
    return {"s": state}


@pytest.mark.parametrize("case", list(NESTED))
def test_batch_path_walks_mappings_of_dicts_as_the_loop_does(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = NESTED[case]()
    batch, used = _walk(state, True, monkeypatch)
    loop, _ = _walk(state, False, monkeypatch)
    assert batch == loop
    if case in ("optimizer state", "str outer keys", "uneven and empty", "an alias inside"):
        assert any(used)


def _describe(tree: Any, refs: list[Any]) -> tuple[Any, list[Any]]:
    return tree, [
        (r.key, id(r.tensor), r.tensor.data_ptr(), r.version, r.alias_of, r.dist,
         r.tensor.dtype, r.tensor.shape, r.tensor.stride())
        for r in refs
    ]


def _set_data(t: torch.Tensor, new: torch.Tensor) -> None:
    t.data = new  # the same tensor object over other storage: no version bump


# each changes the state after a first walk filled the caches; the second walk must give
# what a walk with empty caches gives
CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "new tensor object": lambda s: s["optim"].__setitem__(3, {**s["optim"][3], "m": torch.ones(2, 2)}),
    "model tensor replaced": lambda s: s["model"].__setitem__("w3", torch.zeros(2, 2)),
    "data pointer": lambda s: _set_data(s["optim"][5]["m"], torch.ones(2, 2)),
    "model data pointer": lambda s: _set_data(s["model"]["w1"], torch.ones(2, 2)),
    "version": lambda s: s["optim"][2]["m"].add_(1),
    "model version": lambda s: s["model"]["w2"].mul_(2),
    "dtype": lambda s: _set_data(s["optim"][4]["v"], torch.ones(2, 2, dtype=torch.float64)),
    "model dtype": lambda s: _set_data(s["model"]["w4"], torch.ones(2, 2, dtype=torch.bfloat16)),
    "shape": lambda s: _set_data(s["optim"][1]["m"], torch.ones(3)),
    "model shape": lambda s: _set_data(s["model"]["w5"], torch.ones(7)),
    "stride": lambda s: _set_data(s["optim"][6]["v"], torch.randn(2, 2).t()),
    "model stride": lambda s: _set_data(s["model"]["w6"], torch.randn(2, 2).t()),
    "inner key added": lambda s: s["optim"][7].__setitem__("w", torch.ones(1)),
    "inner key removed": lambda s: s["optim"][7].pop("v"),
    "inner key renamed": lambda s: s["optim"].__setitem__(0, {"M": s["optim"][0]["m"], "v": s["optim"][0]["v"]}),
    "inner keys reordered": lambda s: s["optim"].__setitem__(0, {"v": s["optim"][0]["v"], "m": s["optim"][0]["m"]}),
    "outer key added": lambda s: s["optim"].__setitem__(99, {"m": torch.ones(1)}),
    "outer key removed": lambda s: s["optim"].pop(9),
    "outer key as str": lambda s: s["optim"].__setitem__("3", s["optim"].pop(3)),
    "outer key as bool": lambda s: s["optim"].__setitem__(True, s["optim"].pop(1)),
    "model key renamed": lambda s: s["model"].__setitem__("w0b", s["model"].pop("w0")),
    "model key added": lambda s: s["model"].__setitem__("extra", torch.ones(1)),
    "value type": lambda s: s["optim"][8].__setitem__("m", 0.5),
    "model value type": lambda s: s["model"].__setitem__("w7", [torch.ones(1)]),
    "inner dict type": lambda s: s["optim"].__setitem__(2, OrderedDict(s["optim"][2])),
    "alias": lambda s: s["optim"][9].__setitem__("v", s["optim"][0]["m"]),
    "alias of a model tensor": lambda s: s["optim"][9].__setitem__("v", s["model"]["w0"]),
    "model tied": lambda s: s["model"].__setitem__("w9", s["model"]["w0"]),
    "model view at a tensor's address": lambda s: s["model"].__setitem__("w9", s["model"]["w0"][0]),
    "indexes moved": lambda s: s.__setitem__("aaa", {"first": torch.ones(1)}),
    "inference tensor": lambda s: s["optim"][3].__setitem__("m", _inference()),
}


def _inference() -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones(2)


def _sweep_state() -> dict[str, Any]:
    model = {f"w{i}": torch.randn(2, 2) for i in range(10)}
    optim = {i: {"m": torch.randn(2, 2), "v": torch.randn(2, 2)} for i in range(10)}
    return {"model": model, "optim": optim, "step": 1}


@pytest.mark.parametrize("change", list(CHANGES))
def test_warm_walk_sees_every_change(change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _sweep_state()
    keys = KeyCache()
    used = _spy_passes(monkeypatch)
    walk_state(state, allow_pickle=False, keys=keys)
    first = _describe(*walk_state(state, allow_pickle=False, keys=keys))
    assert used == [True, True] * 2  # both mappings took the passes, cold and warm
    CHANGES[change](state)
    warm = _describe(*walk_state(state, allow_pickle=False, keys=keys))
    cold = _describe(*walk_state(state, allow_pickle=False, keys=KeyCache()))
    assert warm == cold
    if change == "inner dict type":  # the same output, but the passes must leave it
        assert used[4:6] == [True, False]
    else:
        assert warm != first  # the change is one the walk's output shows
    # and once more, now that the caches hold the changed state
    assert _describe(*walk_state(state, allow_pickle=False, keys=keys)) == cold


def test_warm_trees_share_unchanged_nodes() -> None:
    state = _sweep_state()
    keys = KeyCache()
    a, _ = walk_state(state, allow_pickle=False, keys=keys)
    b, _ = walk_state(state, allow_pickle=False, keys=keys)
    items_a, items_b = dict(a["$dict"]), dict(b["$dict"])
    assert items_a["model"] is items_b["model"] and items_a["optim"] is items_b["optim"]
    state["optim"][0]["m"] = torch.ones(1)  # same keys, new tensor: the node still fits
    c, _ = walk_state(state, allow_pickle=False, keys=keys)
    assert dict(c["$dict"])["optim"] is items_a["optim"]
    state["optim"][0]["x"] = torch.ones(1)  # a new key: a new node, the old one untouched
    d, _ = walk_state(state, allow_pickle=False, keys=keys)
    assert dict(d["$dict"])["optim"] is not items_a["optim"]
    assert a == b == c and len(str(d)) > len(str(a))


def test_snapshot_of_a_changed_optimizer_state_restores_it(tmp_path: Path) -> None:
    state = {"optim": _optimizer_state(10)}
    with lazyckpt.SyncCheckpointer([FileTier(tmp_path)], eager_bytes=0) as ckpt:
        ckpt.snapshot(state, step=1).wait()
        _set_data(state["optim"][4]["exp_avg"], torch.arange(6.0).reshape(3, 2))
        state["optim"][5]["exp_avg_sq"] = torch.full((2, 2), 7.0, dtype=torch.float64)
        ckpt.snapshot(state, step=2).wait()
        got = ckpt.restore(2)
    assert torch.equal(got["optim"][4]["exp_avg"], torch.arange(6.0).reshape(3, 2))
    assert got["optim"][5]["exp_avg_sq"].dtype == torch.float64
    for i, inner in state["optim"].items():
        for name, t in inner.items():
            assert torch.equal(got["optim"][i][name], t), (i, name)


def test_warm_walk_sees_keys_move_between_dicts() -> None:
    # the same keys in the same order overall, split differently between the inner dicts
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    state: dict[str, Any] = {"s": {i: {} for i in range(10)}}
    state["s"][0], state["s"][1] = {"m": a, "v": b}, {"m": c, "v": d}
    keys = KeyCache()
    walk_state(state, allow_pickle=False, keys=keys)
    state["s"][0], state["s"][1], state["s"][2] = {"m": a}, {"v": b, "m": c}, {"v": d}
    warm = _describe(*walk_state(state, allow_pickle=False, keys=keys))
    assert warm == _describe(*walk_state(state, allow_pickle=False, keys=KeyCache()))
    assert [r[0] for r in warm[1]] == ["s/0/m", "s/1/v", "s/1/m", "s/2/v"]


# -- decoding such trees back in passes -----------------------------------------------------


def _decode(tree: Any, n: int, bulk: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``decode_tree`` with the passes on or off; tensors stand in as distinct strings."""
    with monkeypatch.context() as m:
        m.setattr(_tree_values, "_BULK_MIN", 1 if bulk else 10**9)
        try:
            return decode_tree(tree, [f"t{i}" for i in range(n)], allow_pickle=False)
        except CorruptionError as exc:
            return ("refused", type(exc))


def _tensor_node(i: Any) -> dict[str, Any]:
    return {"$tensor": i}


def _flat(n: int = 9, **changes: Any) -> dict[str, Any]:
    items: list[Any] = [[f"k{i}", _tensor_node(i)] for i in range(n)]
    for where, item in changes.items():
        items[int(where[1:])] = item
    return {"$dict": items}


def _nested(n: int = 9, **changes: Any) -> dict[str, Any]:
    items: list[Any] = [[i, {"$dict": [["m", _tensor_node(2 * i)], ["v", _tensor_node(2 * i + 1)]]}] for i in range(n)]
    for where, item in changes.items():
        items[int(where[1:])] = item
    return {"$dict": items}


TREES: dict[str, Any] = {
    "flat": _flat(),
    "nested": _nested(),
    "walked": walk_state(_sweep_state(), allow_pickle=False)[0],
    "walked optimizer state": walk_state({"o": _optimizer_state()}, allow_pickle=False)[0],
    "empty inner dicts": {"$dict": [[i, {"$dict": []}] for i in range(9)]},
    "some empty inner dicts": _nested(i3=[3, {"$dict": []}]),
    "index out of range": _flat(i4=["k4", _tensor_node(99)]),
    "negative index": _flat(i4=["k4", _tensor_node(-1)]),
    "bool index": _flat(i4=["k4", _tensor_node(True)]),
    "float index": _flat(i4=["k4", _tensor_node(1.0)]),
    "a node with two keys": _flat(i4=["k4", {"$tensor": 4, "x": 1}]),
    "an item of three": _flat(i4=["k4", _tensor_node(4), 0]),
    "an item of one": _flat(i4=["k4"]),
    "an item that is no list": _flat(i4=("k4", _tensor_node(4))),
    "a bool key": _flat(i4=[True, _tensor_node(4)]),
    "a float key": _flat(i4=[{"$float": "inf"}, _tensor_node(4)]),
    "a tuple key": _flat(i4=[{"$tuple": [1, 2]}, _tensor_node(4)]),
    "a list key": _flat(i4=[[1], _tensor_node(4)]),
    "a plain value": _flat(i4=["k4", 0.5]),
    "a tagged value": _flat(i4=["k4", {"$bytes": "AA=="}]),
    "an unknown tag": _flat(i4=["k4", {"$what": 1}]),
    "duplicate keys": _flat(i4=["k3", _tensor_node(4)]),
    "inner index out of range": _nested(i2=[2, {"$dict": [["m", _tensor_node(99)]]}]),
    "inner bool key": _nested(i2=[2, {"$dict": [[False, _tensor_node(4)]]}]),
    "inner plain value": _nested(i2=[2, {"$dict": [["m", 3]]}]),
    "inner item of three": _nested(i2=[2, {"$dict": [["m", _tensor_node(4), 1]]}]),
    "inner stateful": _nested(i2=[2, {"$stateful": {"$dict": [["m", _tensor_node(4)]]}}]),
    "inner dict not a list": _nested(i2=[2, {"$dict": {"m": 1}}]),
    "inner tuple": _nested(i2=[2, {"$tuple": [_tensor_node(4)]}]),
}


@pytest.mark.parametrize("case", list(TREES))
def test_decoding_in_passes_gives_what_the_general_decoding_gives(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = TREES[case]
    bulk = _decode(tree, 40, True, monkeypatch)
    assert bulk == _decode(tree, 40, False, monkeypatch)
    if case in ("flat", "nested", "walked", "walked optimizer state"):
        # and the passes did take it: the tensors are the very objects in the list
        with monkeypatch.context() as m:
            calls: list[Any] = []
            real = _tree_values._Decoder.decode

            def spy(self: Any, node: Any) -> Any:
                calls.append(node)
                return real(self, node)

            m.setattr(_tree_values._Decoder, "decode", spy)
            decode_tree(tree, [f"t{i}" for i in range(40)], allow_pickle=False)
        assert len(calls) < 10  # not one call per tensor
