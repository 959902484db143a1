"""Walking states and the tagged-JSON value codec."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lazyckpt import CorruptionError, UnsupportedStateError
from lazyckpt._format.values import INLINE_ARRAY_BYTES, decode_tree
from lazyckpt._format.walk import walk_state

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
safe_text = st.text(
    st.characters(min_codepoint=32, blacklist_characters="/"), min_size=1, max_size=4
).filter(lambda k: k not in (".", ".."))
keys = st.none() | st.booleans() | st.integers(-5, 5) | safe_text
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(keys, inner, max_size=4),
    max_leaves=20,
)


@given(st.dictionaries(safe_text, values, max_size=5))
def test_plain_values_round_trip_exactly(state: dict[str, Any]) -> None:
    tree, refs = walk_state(state, allow_pickle=False)
    assert refs == []
    back = decode_tree(json.loads(json.dumps(tree)), [], allow_pickle=False)
    assert back == state
    assert _types(back) == _types(state)


def _types(v: Any) -> Any:
    if isinstance(v, dict):
        return ("dict", [(type(k), _types(x)) for k, x in v.items()])
    if isinstance(v, list | tuple):
        return (type(v), [_types(x) for x in v])
    return type(v)


def test_special_floats_numpy_and_torch_values() -> None:
    state = {
        "nan": float("nan"),
        "inf": float("-inf"),
        "np": np.float32(1.5),
        "npi": np.int64(7),
        "dt": torch.float16,
        "dev": torch.device("cpu"),
    }
    tree, _ = walk_state(state, allow_pickle=False)
    back = decode_tree(json.loads(json.dumps(tree)), [], allow_pickle=False)
    assert back["nan"] != back["nan"] and back["inf"] == float("-inf")
    assert type(back["np"]) is np.float32 and back["np"] == np.float32(1.5)
    assert back["dt"] is torch.float16 and back["dev"] == torch.device("cpu")


def test_tensors_and_aliases() -> None:
    w = torch.zeros(3)
    _tree, refs = walk_state({"a": w, "b": [w, w[1:]], "c": w.clone()}, allow_pickle=False)
    assert [r.key for r in refs] == ["a", "b/0", "b/1", "c"]
    assert [r.alias_of for r in refs] == [None, 0, None, None]
    assert refs[0].version == w._version


def test_views_at_the_same_address_are_aliases_only_when_identical() -> None:
    w = torch.arange(12.0).reshape(3, 4)
    state = {
        "w": w,
        "row0": w[0],  # same data pointer, other shape: its own tensor
        "flat": w.view(12),  # same pointer, other shape and strides
        "t": w.t(),  # same pointer and numel, other strides
        "again": w.detach(),  # another object, same elements: a tied weight
        "bytes": w.view(torch.int32),  # same pointer and shape, other dtype
    }
    _tree, refs = walk_state(state, allow_pickle=False)
    assert [r.alias_of for r in refs] == [None, None, None, None, 0, None]


def test_key_checks_and_paths_are_the_same_on_every_walk() -> None:
    # the second walk of the same keys takes the cached path; it must answer identically
    state = {"a/b": {"50%": torch.zeros(1)}, "c": {"d": torch.zeros(1)}}
    for _ in range(2):
        _tree, refs = walk_state(state, allow_pickle=False)
        assert [r.key for r in refs] == ["a%2Fb/50%25", "c/d"]
    for _ in range(2):
        with pytest.raises(UnsupportedStateError, match="not allowed"):
            walk_state({"c": {"..": torch.zeros(1)}}, allow_pickle=False)


def test_cycles_and_bad_keys_are_refused() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    with pytest.raises(UnsupportedStateError, match="cycle"):
        walk_state(loop, allow_pickle=False)
    with pytest.raises(UnsupportedStateError, match="key"):
        walk_state({"d": {object(): 1}}, allow_pickle=False)


def test_keys_are_escaped_unambiguously() -> None:
    _, refs = walk_state({"a/b": torch.zeros(1), "a": {"b": torch.zeros(1)}}, allow_pickle=False)
    assert refs[0].key != refs[1].key


@pytest.mark.parametrize(
    "tree",
    [
        {"$nope": 1},
        {"$tensor": 5},
        {"$float": "1.0"},
        {"$dict": [[1]]},
        {"$bytes": "***"},
        {"$dtype": "float128"},
        {"a": 1, "b": 2},
    ],
)
def test_damaged_trees_raise_corruption(tree: Any) -> None:
    with pytest.raises(CorruptionError):
        decode_tree(tree, [], allow_pickle=False)


@pytest.mark.parametrize("key", ["..", ".", "", "/etc/passwd", "a\x00b", "tab\there", "x" * 2000])
def test_hostile_keys_are_refused(key: str) -> None:
    with pytest.raises(UnsupportedStateError, match="key"):
        walk_state({"model": {key: torch.zeros(1)}}, allow_pickle=False)


def test_slashes_inside_keys_stay_inside_one_component() -> None:
    _, refs = walk_state({"a/../../b": torch.zeros(1)}, allow_pickle=False)
    assert refs[0].key == "a%2F..%2F..%2Fb"


# -- trainer state beside tensors ------------------------------------------------------------

array_dtypes = st.sampled_from(
    ["?", "u1", "i1", "<i2", ">i2", "<u4", "<i8", ">f8", "<f2", "<f4", "<c8", "<c16",
     "<M8[ns]", "<m8[s]", "S3", "<U2", ">U1"]
)


@given(
    dtype=array_dtypes,
    shape=st.lists(st.integers(0, 6), max_size=3),
    data=st.data(),
    big=st.booleans(),
)
def test_numpy_arrays_round_trip_with_dtype_and_shape(
    dtype: str, shape: list[int], data: st.DataObject, big: bool
) -> None:
    if big:  # past the inline limit: the array becomes a tensor of the snapshot
        shape = [*shape, 1000]
    array = data.draw(hnp.arrays(np.dtype(dtype), tuple(shape)))
    tree, refs = walk_state({"a": array}, allow_pickle=False)
    inline = array.nbytes <= INLINE_ARRAY_BYTES
    assert len(refs) == (0 if inline else 1)
    # the shards hold the tensor's bytes; restore reads them into a new tensor
    stored = [r.tensor.clone() for r in refs]
    back = decode_tree(json.loads(json.dumps(tree)), stored, allow_pickle=False)["a"]
    assert type(back) is np.ndarray
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()  # bit for bit, NaNs and NaTs included


@dataclass
class Fields:
    a: int


def test_plain_decoding_gives_builtins_and_tensors_only() -> None:
    state: dict[str, Any] = {
        "gen": torch.Generator().manual_seed(0),
        "np_rng": np.random.default_rng(1),
        "py": random.Random(2),
        "big": np.zeros(10_000, dtype=np.float32),
        "fields": Fields(1),
    }
    tree, refs = walk_state(state, allow_pickle=False)
    back = decode_tree(tree, [r.tensor for r in refs], allow_pickle=False, plain=True)
    assert torch.equal(back["gen"], state["gen"].get_state())
    assert back["np_rng"] == state["np_rng"].bit_generator.state
    assert back["py"] == state["py"].getstate()
    assert isinstance(back["big"], torch.Tensor) and back["big"].dtype == torch.float32
    assert type(back["fields"]) is dict and back["fields"] == {"a": 1}


@pytest.mark.parametrize(
    "tree",
    [
        {"$ndarray": ["|O", [1], {"$bytes": "AAAAAAAAAAA="}]},  # object arrays hold pointers
        {"$ndarray": ["<f4,<i4", [1], {"$bytes": "AAAAAAAAAAA="}]},
        {"$ndarray": ["<f4", [3], {"$bytes": "AAAA"}]},  # too few bytes for the shape
        {"$ndarray": ["<f4", [-1], {"$bytes": ""}]},
        {"$np_generator": {"$dict": [["bit_generator", "os.system"]]}},
        {"$generator": ["cpu", 5]},
        {"$dataclass": [1, {"$dict": []}]},
    ],
)
def test_damaged_trainer_state_nodes_raise_corruption(tree: Any) -> None:
    with pytest.raises(CorruptionError):
        decode_tree(tree, [], allow_pickle=False)


def test_lenient_walks_leave_arrays_and_generators_alone() -> None:
    """An into= target's arrays and generators are loaded after the read, not filled."""
    state = {"a": np.zeros(100_000), "g": torch.Generator(), "t": torch.zeros(2)}
    _, refs = walk_state(state, allow_pickle=False, lenient=True)
    assert [r.key for r in refs] == ["t"]


def test_modules_give_their_parameters_undetached_and_overrides_are_called_as_written() -> None:
    """A module with torch's own ``state_dict`` is walked through ``keep_vars=True`` (its
    parameters themselves, no new detached tensor per snapshot); a class overriding
    ``state_dict`` without that keyword is called as written; both restore the same bytes,
    frozen and trainable alike, and the tied weight stays an alias."""

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(6, 4)
            self.head = torch.nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight
            self.norm = torch.nn.BatchNorm1d(4)
            self.norm.weight.requires_grad_(False)

    class Overrides(Tied):
        def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
            return {k: v.clone() for k, v in super().state_dict().items()}

    plain, custom = Tied(), Overrides()
    custom.load_state_dict(plain.state_dict())
    _tree, refs = walk_state({"m": plain}, allow_pickle=False)
    by_key = {r.key: r for r in refs}
    assert by_key["m/emb.weight"].tensor is plain.emb.weight
    assert by_key["m/head.weight"].alias_of is not None
    assert by_key["m/norm.running_mean"].tensor is plain.norm.running_mean
    _tree2, refs2 = walk_state({"m": custom}, allow_pickle=False)
    assert [r.key for r in refs2] == [r.key for r in refs]
    for a, b in zip(refs, refs2, strict=True):
        assert torch.equal(a.tensor, b.tensor)
        assert type(b.tensor) is torch.Tensor
