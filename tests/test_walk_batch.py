"""The walk's batch path for mappings of plain tensors gives exactly what the general loop
gives, and leaves every unusual case to it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from lazyckpt import UnsupportedStateError, _tree
from lazyckpt._tree import KeyCache, walk_state


def _walk(state: Any, batch: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    with monkeypatch.context() as m:
        m.setattr(_tree, "_BATCH_MIN", 1 if batch else 10**9)
        used: list[bool] = []
        real = _tree._Walker._tensor_mapping

        def spy(self: Any, obj: Any, key: str) -> Any:
            found = real(self, obj, key)
            used.append(found is not None)
            return found

        m.setattr(_tree._Walker, "_tensor_mapping", spy)
        keys = KeyCache()
        walk_state(state, allow_pickle=False, keys=keys)  # the second walk uses the caches
        tree, refs = walk_state(state, allow_pickle=False, keys=keys)
    described = [(r.key, r.tensor.data_ptr(), r.version, r.alias_of, r.dist) for r in refs]
    return (tree, described), used


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


CASES: dict[str, Callable[[], dict[Any, Any]]] = {
    "plain": lambda: {"model": _plain(20), "step": 3},
    "parameters": lambda: {"m": dict(torch.nn.Linear(3, 3).named_parameters()) | _plain(8)},
    "int keys": lambda: {"optim": {i: torch.randn(2) for i in range(12)}},
    "tied": _tied,
    "empties": lambda: {**_plain(9), "e1": torch.empty(0), "e2": torch.empty(0)},
    "inference": _with_inference_tensor,
    "bool key": lambda: {"d": {True: torch.ones(1), **{i + 2: torch.ones(1) for i in range(9)}}},
    "view": _view,
    "mixed": lambda: {**_plain(9), "lr": 0.1},
}


@pytest.mark.parametrize("case", list(CASES))
def test_batch_path_walks_as_the_loop_does(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    state = CASES[case]()
    batch, used = _walk(state, True, monkeypatch)
    loop, _ = _walk(state, False, monkeypatch)
    assert batch == loop
    if case in ("plain", "parameters", "int keys"):
        assert any(used)  # the batch path took these


@pytest.mark.parametrize(
    "bad",
    [
        {**_plain(9), "..": torch.ones(1)},  # a key no tier may turn into a path
        {**_plain(9), "s": torch.ones(2, 2).to_sparse()},  # not a dense tensor
        {**_plain(9), "m": torch.empty(2, device="meta")},
    ],
)
def test_batch_path_refuses_what_the_loop_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedStateError):
        walk_state({"model": bad}, allow_pickle=False)
