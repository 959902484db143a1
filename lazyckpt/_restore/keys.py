"""Matching an ``into=`` target's keys to a snapshot's, before any byte is read.

:func:`align_into` checks the target against the snapshot: a key the target has and the
snapshot lacks, or a module whose state-dict keys differ, raises
:class:`StateMismatchError`, except that the key prefixes wrappers add (``_orig_mod.`` from
``torch.compile``, ``module.`` from DDP) are mapped, so a compiled model's snapshot restores
into the plain model and back. :func:`strip_prefix` does that renaming by hand for a state
restored without ``into=``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, MutableMapping
from dataclasses import replace
from typing import Any, TypeVar

import torch

from .._errors import ConfigurationError
from .._format.entries import TensorMeta
from .._format.manifest import Manifest
from .._format.values import decode_tree
from .._format.walk import JSON, _escape
from .into import _mismatch, _stateful

__all__ = ["WRAPPER_PREFIXES", "align_into", "strip_prefix"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# What wrappers put in front of a module's state-dict keys: torch.compile's OptimizedModule
# and DistributedDataParallel / DataParallel. restore(into=...) maps them when that is the
# only difference between the target's keys and the snapshot's.
WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def strip_prefix(state: Mapping[K, V], prefix: str) -> dict[K, V]:
    """A copy of ``state`` with ``prefix`` taken off every string key that starts with it.

    For a state dict restored without ``into=`` from a compiled model's snapshot::

        model.load_state_dict(lazyckpt.strip_prefix(state["model"], "_orig_mod."))

    Only the top-level keys are renamed; values are the same objects. Raises
    :class:`ConfigurationError` when two keys would become one.
    """
    out: dict[Any, V] = {}
    for k, v in state.items():
        new: Any = k[len(prefix) :] if isinstance(k, str) and k.startswith(prefix) else k
        if new in out:
            raise ConfigurationError(
                f"strip_prefix({prefix!r}): {k!r} and another key both become {new!r}"
            )
        out[new] = v
    return out


def align_into(manifest: Manifest, into: Any, *, rename: bool = True) -> Manifest:
    """Check the keys of an ``into=`` target against ``manifest`` before anything is read,
    and map wrapper prefixes (:data:`WRAPPER_PREFIXES`) where that is the only difference.

    Returns the manifest itself when nothing is renamed, else a copy whose tree and tensor
    keys use the target's names. Raises :class:`StateMismatchError` on other differences,
    and on prefix differences too when ``rename`` is false (a resharding restore, which
    matches other ranks' manifests by the saved keys).
    """
    if into is None:
        return manifest
    renames: dict[str, str] = {}
    tree = _align(manifest.tree, into, "", renames if rename else None)
    if not renames:
        return manifest
    tensors = tuple(_renamed(meta, renames) for meta in manifest.tensors)
    return replace(manifest, tree=tree, tensors=tensors)


def _renamed(meta: TensorMeta, renames: dict[str, str]) -> TensorMeta:
    key = meta.key
    cut = len(key)
    while cut > 0:  # the key itself, then each enclosing path
        new = renames.get(key[:cut])
        if new is not None:
            return replace(meta, key=new + key[cut:])
        cut = key.rfind("/", 0, cut)
    return meta


def _items(node: JSON) -> tuple[list[Any], bool] | None:
    """The ``[key, value]`` items of a mapping node, and whether it is a Stateful's."""
    stateful = isinstance(node, dict) and len(node) == 1 and "$stateful" in node
    inner = node["$stateful"] if stateful else node
    if isinstance(inner, dict) and len(inner) == 1 and isinstance(inner.get("$dict"), list):
        return inner["$dict"], stateful
    return None


def _key_of(node: JSON) -> Any:
    if type(node) is str or type(node) is int:  # the usual keys, JSON scalars as they are
        return node
    return decode_tree(node, [], allow_pickle=False)


# The whole prefixes a module's keys may carry: compiled, wrapped in DDP, or both (in either
# order: DDP(torch.compile(m)) or torch.compile(DDP(m))).
_PREFIX_CHAINS = ("", *WRAPPER_PREFIXES, "module._orig_mod.", "_orig_mod.module.")


def _prefix_map(have: list[Any], want: list[Any]) -> dict[Any, Any] | None:
    """How to rename keys of ``have`` (the snapshot's) so that every key of ``want`` is there,
    when one wrapper prefix in front of all of them is the difference; None when that is
    not so, or when two different prefixes would both fit."""
    if not all(isinstance(k, str) for k in (*have, *want)):
        return None
    have_set, want_set = set(have), set(want)
    found: dict[Any, Any] | None = None
    for saved in _PREFIX_CHAINS:
        for wanted in _PREFIX_CHAINS:
            if saved == wanted or not all(w.startswith(wanted) for w in want):
                continue
            mapping = {saved + w[len(wanted) :]: w for w in want}
            # a name taken by a key that stays as it is would then be there twice
            clash = any(k in want_set and k not in mapping for k in have)
            if mapping.keys() <= have_set and not clash:
                if found is not None and found != mapping:
                    return None
                found = mapping
    return found


def _align(node: JSON, into: Any, path: str, renames: dict[str, str] | None) -> JSON:
    if isinstance(into, torch.Tensor):  # the usual leaf, answered before the ABC checks
        return node
    plain = type(into) is dict  # answered before the ABC checks, once per container
    module = not plain and isinstance(into, torch.nn.Module)
    if plain or module or (isinstance(into, MutableMapping) and not _stateful(into)):
        found = _items(node)
        if found is None:
            return node
        items, stateful = found
        have = [_key_of(k) for k, _ in items]
        want = list(into.state_dict().keys() if module else into.keys())
        have_set, want_set = set(have), set(want)  # once: per element they made this O(n²)
        changed = False
        if not want_set <= have_set or (module and have_set != want_set):
            mapping = _prefix_map(have, want) if renames is not None else None
            if mapping is not None and renames is not None:
                for old, new in mapping.items():
                    renames[_child(path, old)] = _child(path, new)
                items = [[mapping.get(k, k), v] for k, (_, v) in zip(have, items, strict=True)]
                have = [mapping.get(k, k) for k in have]
                have_set = set(have)
                changed = True
        missing = [k for k in want if k not in have_set]
        unexpected = [k for k in have if k not in want_set]
        if missing or (module and unexpected):
            what = f"module {type(into).__qualname__}" if module else "the mapping"
            raise _mismatch(path, what, missing, unexpected)
        if not module:
            aligned: list[Any] = []
            for k, item in zip(have, items, strict=True):
                target = into.get(k)
                if target is None or isinstance(target, torch.Tensor):  # a leaf: as it is
                    aligned.append(item)
                    continue
                v = item[1]
                new_v = _align(v, target, _child(path, k), renames)
                if new_v is not v:
                    item = [item[0], new_v]
                    changed = True
                aligned.append(item)
            items = aligned
        if not changed:  # nothing renamed at or below this node: the node itself
            return node
        inner = {"$dict": items}
        return {"$stateful": inner} if stateful else inner
    return node


def _child(path: str, k: Any) -> str:
    part = _escape(str(k))
    return f"{path}/{part}" if path else part
