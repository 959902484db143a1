"""Walking a user's state into tensors and tagged JSON.

A state is a nested structure of mappings, lists, tuples, tensors, ``Stateful`` objects
(anything with ``state_dict()``/``load_state_dict()``) and plain values. Walking it yields

- a JSON document (the *tree*) in which every tensor is replaced by ``{"$tensor": i}``;
- a list of :class:`TensorRef`, one per distinct tensor, in walk order.

Plain values are stored as *tagged JSON* (``_format.values`` lists the tags and decodes them),
so that restoring never executes code. numpy arrays are copied when ``snapshot()`` walks the
state, not captured lazily: numpy writes bypass torch's version counter, so a later in-place
write could not be detected.
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import math
import operator
import pickle
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import torch

from .._distributed.chunks import DistInfo, ReplicatedMarker, local_chunk, replicated_info
from .._errors import UnsupportedStateError
from .values import (
    _ARRAY_KINDS,
    _DTYPE_NAMES,
    INLINE_ARRAY_BYTES,
    dtype_name,
)
from .values import JSON as JSON  # re-exported: the format modules import it from here

__all__ = ["Columns", "KeyCache", "Stateful", "TensorRef", "walk_state"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: a module, an optimizer, a
    learning-rate scheduler, a data loader with state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


@dataclass(slots=True)
class TensorRef:
    """A tensor found in the state, with what ``snapshot()`` recorded about it.

    For a DTensor, ``tensor`` is its local chunk (a view), ``dtensor`` the DTensor itself and
    ``dist`` where the chunk lies in the global tensor; ``dist`` is also set for a plain
    tensor under :class:`~lazyckpt.Replicated`.
    """

    key: str
    tensor: torch.Tensor
    version: int | None
    alias_of: int | None = None
    dist: DistInfo | None = None
    dtensor: torch.Tensor | None = None
    # ``tensor`` is a copy taken at snapshot() (the eager policy), not the state's own
    copied: bool = False

def _escape(part: str) -> str:
    return part.replace("%", "%25").replace("/", "%2F")


_MAX_KEY = 1024
_CONTROL = re.compile(r"[\x00-\x1f]")


def _check_key(k: Any, parent: str) -> None:
    """Refuse keys that could name something outside a tier's root when a tier turns keys
    into paths (Zarr does): traversal, absolute paths, NUL and control characters."""
    if not isinstance(k, str):
        return
    where = f"under {parent!r}" if parent else "at the top level"
    if k in ("", ".", "..") or k.startswith("/") or _CONTROL.search(k) is not None:
        raise UnsupportedStateError(
            f"key {k!r} {where} is not allowed: keys may not be empty, '.', '..', start "
            "with '/', or contain control characters (NUL included)"
        )
    if len(k) > _MAX_KEY:
        raise UnsupportedStateError(f"key {k[:40]!r}... {where} is longer than {_MAX_KEY}")


def _check_tensor(key: str, t: torch.Tensor) -> None:
    # one cheap test for the usual case; the detailed ones only when it fails
    if (
        t.layout is torch.strided
        and not t.is_quantized
        and not t.is_meta
        and t.dtype in _DTYPE_NAMES
    ):
        return
    if t.layout != torch.strided:
        raise UnsupportedStateError(
            f"tensor {key!r} has layout {t.layout}; only dense (strided) tensors can be "
            "checkpointed. Convert it with .to_dense() first."
        )
    if t.is_quantized:
        raise UnsupportedStateError(
            f"tensor {key!r} is quantized; dequantize it or store its int_repr() and scales."
        )
    if t.is_meta:
        raise UnsupportedStateError(f"tensor {key!r} is on the meta device and has no data")
    raise UnsupportedStateError(f"tensor {key!r} has unsupported dtype {t.dtype}")


def _identity(t: torch.Tensor) -> tuple[Any, ...]:
    # data_ptr() already includes the storage offset; with dtype, shape and strides it names
    # exactly the same elements (a tied weight seen under two keys)
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)


class KeyCache:
    """What walking a state's keys produces, kept from one walk to the next.

    A model's state has the same keys every step. With a cache held across walks (the
    Checkpointer keeps one), the per-key checks, escaping and formatting of a child path
    become one dict lookup after the first ``snapshot()``, and the tree's
    ``[key, {"$tensor": i}]`` items are shared between snapshots (trees are never modified
    after the walk), which keeps ``snapshot()`` from allocating, and the garbage collector
    from scanning, a new list and dict per tensor per snapshot. A mapping walked in passes
    (``_Walker._tensor_mapping``) keeps one record instead (:class:`_MappingShape`): its
    keys, its tensors' paths and its whole tree node, reused while its keys stay the same.

    Args:
        limit: entries kept per table before it is cleared and refilled. The default has
            room for the keys of a state of some 250,000 tensors; a state with more keys
            than the limit pays the full per-key cost on every walk (``docs/design.md``,
            "Figures behind choices in the code").
    """

    def __init__(self, limit: int = 1 << 18) -> None:
        self.limit = limit
        self._child: dict[tuple[str, str | int], str] = {}
        # per (parent path, key) of a tensor: [its path, its index in the last walk, the
        # tree's item for that index]; one lookup in a table of every tensor of the state
        # gives both (at 100,000 tensors each lookup is a cache miss)
        self.items: dict[tuple[str, str | int], list[Any]] = {}
        # per path of a mapping walked in passes: what its keys gave in the last walk
        self.mappings: dict[str, _MappingShape] = {}

    def child_path(self, parent: str, k: str | int) -> str:
        """The path of key ``k`` (a str, checked, or an int) under ``parent``."""
        found = self._child.get((parent, k))
        if found is not None:
            return found
        if type(k) is str:
            _check_key(k, parent)
            name = _escape(k)
        else:  # an int (never a bool: the callers test the type): digits need no escaping
            name = str(k)
        child = f"{parent}/{name}" if parent else name
        if len(self._child) >= self.limit:
            self._child.clear()
        self._child[(parent, k)] = child
        return child

    def tensor_entry(self, parent: str, k: str | int) -> list[Any]:
        """A new ``items`` entry for the tensor under key ``k`` of ``parent``."""
        if len(self.items) >= self.limit:
            self.items.clear()
        entry = self.items[(parent, k)] = [self.child_path(parent, k), -1, None]
        return entry

    def mapping_shape(
        self, parent: str, keys: list[Any], sizes: list[int] | None, inner: list[Any] | None
    ) -> _MappingShape:
        """Check the keys of a mapping walked in passes (at path ``parent``; ``sizes`` and
        ``inner``: its dicts' sizes and keys, for a mapping of dicts) and keep what follows
        from them for the next walk."""
        outer = _plain_names(keys)
        if outer is None:  # a key to escape, or one to refuse: the per-key checks
            outer = [_escape(k) if type(k) is str else str(k) for k in keys]
            for k in keys:
                self.child_path(parent, k)  # raises for a key no tier may turn into a path
        prefix = f"{parent}/" if parent else ""
        paths = list(map(prefix.__add__, outer))
        if sizes is not None and inner is not None:
            names = _plain_names(inner)
            if names is None:
                names = [_escape(k) if type(k) is str else str(k) for k in inner]
                repeated = itertools.chain.from_iterable(map(itertools.repeat, paths, sizes))
                for path, k in zip(repeated, inner, strict=True):
                    self.child_path(path, k)
            # each dict's path and a slash, once per key of that dict, then the key's name
            slashed = map(operator.add, paths, itertools.repeat("/"))
            starts = itertools.chain.from_iterable(map(itertools.repeat, slashed, sizes))
            paths = list(map(operator.add, starts, names))
        if len(self.mappings) >= self.limit:
            self.mappings.clear()
        shape = self.mappings[parent] = _MappingShape(keys, sizes, inner, paths)
        return shape


def _plain_names(keys: list[Any]) -> list[str] | None:
    """The path parts of str or int keys that need no escaping, checked in passes as
    :func:`_check_key` checks one key; None if any key needs escaping or is refused."""
    kinds = set(map(type, keys))
    if kinds == _INT:
        return list(map(str, keys))  # digits: nothing to check or escape
    if kinds != _STR:
        return None
    joined = "".join(keys)
    if (
        "/" in joined  # no "/" anywhere: none starts with one, none needs escaping
        or "%" in joined
        or _CONTROL.search(joined) is not None
        or not _SPECIAL.isdisjoint(keys)
        or max(map(len, keys), default=0) > _MAX_KEY
    ):
        return None
    return keys


_INT = {int}
_STR = {str}
_SPECIAL = {"", ".", ".."}


class _MappingShape:
    """What the last walk found in a mapping it walked in passes (``_Walker._tensor_mapping``):
    its keys (for a mapping of dicts also each dict's size and keys, in order), the paths of
    its tensors, and its tree node with the tensor indexes of that walk, ``base`` the first.

    Only the keys decide whether a record still fits: everything about the tensors
    themselves is read again on every walk. A node is never changed once made (earlier
    trees hold it); :meth:`place` makes a new one when the indexes move.
    """

    __slots__ = ("base", "inner", "keys", "node", "paths", "sizes")

    def __init__(
        self, keys: list[Any], sizes: list[int] | None, inner: list[Any] | None, paths: list[str]
    ) -> None:
        self.keys = keys
        self.sizes = sizes
        self.inner = inner
        self.paths = paths
        self.base = -1
        self.node: JSON = None

    def place(self, base: int) -> None:
        """A new tree node for tensors numbered from ``base``."""
        index = itertools.count(base)
        if self.sizes is None or self.inner is None:
            items = [[k, {"$tensor": next(index)}] for k in self.keys]
        else:
            names = iter(self.inner)
            items = [
                [k, {"$dict": [[next(names), {"$tensor": next(index)}] for _ in range(size)]}]
                for k, size in zip(self.keys, self.sizes, strict=True)
            ]
        self.node = {"$dict": items}
        self.base = base


_Parameter = torch.nn.Parameter
# A module whose class keeps torch's own ``state_dict`` is asked for its parameters as they
# are (``keep_vars=True``): the same tensors, without detaching each into a new tensor object
# at every snapshot (a fifth of ``model.state_dict()``'s time, and fewer objects for the
# collector). The walk reads what a detached view would give (data, shape, version counter;
# the capture detaches where torch copies). A class that overrides ``state_dict`` is called
# as written.
_MODULE_STATE_DICT = torch.nn.Module.state_dict
_STRIDED = torch.strided
# what _Walker._tensor_mapping takes in its passes
_BATCH_MIN = 8  # below this, setting the passes up costs more than the loop
_PLAIN_TENSORS = {torch.Tensor, _Parameter}
_PLAIN_KEYS = {str, int}  # not bool: True is no int key here
_DICT = {dict}
_STRIDED_ONLY = {_STRIDED}
_LAYOUT = operator.attrgetter("layout")
_DTYPE = operator.attrgetter("dtype")
_IS_META = operator.attrgetter("is_meta")
_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr


class _Walker:
    def __init__(self, allow_pickle: bool, lenient: bool, keys: KeyCache) -> None:
        self.allow_pickle = allow_pickle
        self.lenient = lenient
        self.keys = keys
        self.tensors: list[TensorRef] = []
        # per tensor, as the walk found them (see Columns)
        self.columns = Columns()
        self._by_ptr: dict[int, int | list[int]] = {}  # data pointer -> first tensor(s) there
        self._active: set[int] = set()
        self._replicated = 0  # depth of Replicated markers around the value being walked

    def encode(self, obj: Any, key: str) -> JSON:
        kind = type(obj)
        if obj is None or kind in (bool, int, str):
            return obj
        if kind is dict:  # before the other tests: the nesting of a state is mostly dicts
            return self._container(obj, key)
        if type(obj) is float:
            if math.isfinite(obj):
                return obj
            return {"$float": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"$tensor": self._add_tensor(obj, key)}
        if type(obj) is torch.Size:
            return {"$size": list(obj)}
        if isinstance(obj, torch.dtype):
            return {"$dtype": dtype_name(obj)}
        if isinstance(obj, torch.device):
            return {"$device": str(obj)}
        if isinstance(obj, bytes | bytearray):
            return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
            return {"$np": [obj.dtype.str, self.encode(obj.item(), key)]}
        if type(obj) in (list, tuple) or (
            isinstance(obj, Mapping) and not isinstance(obj, Stateful)
        ):
            return self._container(obj, key)
        if isinstance(obj, Stateful):
            marker = isinstance(obj, ReplicatedMarker)
            self._replicated += marker
            try:
                if getattr(type(obj), "state_dict", None) is _MODULE_STATE_DICT:
                    state = cast(torch.nn.Module, obj).state_dict(keep_vars=True)
                else:
                    state = obj.state_dict()
                return {"$stateful": self.encode(state, key)}
            finally:
                self._replicated -= marker
        found = self._encode_object(obj, key)
        if found is not None:
            return found
        if self.lenient:
            return None
        if self.allow_pickle:
            try:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise UnsupportedStateError(f"value at {key!r} cannot be pickled: {exc}") from exc
            self.columns.pickled = True
            return {"$pickle": base64.b64encode(data).decode("ascii")}
        raise UnsupportedStateError(
            f"value at {key!r} of type {type(obj).__qualname__} is not a tensor, a Stateful "
            "object, a plain value (dict, list, tuple, str, int, float, bool, None, bytes) or "
            "trainer state lazyckpt stores without pickle (numpy arrays, torch/numpy/random "
            "generators, dataclasses: see docs/api.md). Convert it, or pass allow_pickle=True "
            "to the Checkpointer on both save and restore if you trust every reader of this "
            "checkpoint."
        )

    def _container(self, obj: Any, key: str) -> JSON:
        if id(obj) in self._active:
            raise UnsupportedStateError(f"the state contains a cycle at {key!r}")
        self._active.add(id(obj))
        try:
            return self._encode_container(obj, key)
        except RuntimeError as exc:  # e.g. "dictionary changed size during iteration"
            raise UnsupportedStateError(
                f"the state at {key!r} changed while snapshot() was reading it: {exc}"
            ) from exc
        finally:
            self._active.discard(id(obj))

    def _encode_object(self, obj: Any, key: str) -> JSON:
        """The trainer-state objects that have a tag of their own; None for any other."""
        # with pickle allowed, a dataclass is pickled, so that it comes back as its own class
        if (
            not self.allow_pickle
            and dataclasses.is_dataclass(obj)
            and not isinstance(obj, type)
        ):
            cls = type(obj)
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            name = f"{cls.__module__}.{cls.__qualname__}"
            return {"$dataclass": [name, self.encode(fields, key)]}
        if self.lenient:
            # an into= target: arrays and generator states are restored into new objects and
            # then loaded into the live ones, so none of them is a tensor to fill in place
            return None
        if type(obj) is np.ndarray:
            return {"$ndarray": self._encode_array(obj, key)}
        if isinstance(obj, torch.Generator):
            state = obj.get_state()  # a new CPU tensor, whatever the generator's device
            return {"$generator": [str(obj.device), {"$tensor": self._add_tensor(state, key)}]}
        if isinstance(obj, np.random.Generator):
            return {"$np_generator": self.encode(obj.bit_generator.state, key)}
        if isinstance(obj, np.random.RandomState):
            return {"$np_random_state": self.encode(obj.get_state(legacy=False), key)}
        if type(obj) is random.Random:  # not SystemRandom: it has no state to save
            return {"$random": self.encode(obj.getstate(), key)}
        return None

    def _encode_array(self, obj: np.ndarray[Any, Any], key: str) -> JSON:
        dtype = obj.dtype
        if dtype.hasobject or dtype.kind not in _ARRAY_KINDS or dtype.fields is not None:
            raise UnsupportedStateError(
                f"numpy array at {key!r} has dtype {dtype}; only arrays of bool, numbers, "
                "datetimes and fixed-size strings can be stored without pickle. Convert it, "
                "or pass allow_pickle=True on both save and restore."
            )
        shape = list(obj.shape)
        if obj.nbytes <= INLINE_ARRAY_BYTES:
            data = base64.b64encode(obj.tobytes(order="C")).decode("ascii")
            return [dtype.str, shape, {"$bytes": data}]
        # copied now: the copy is what the capture reads later, so no write to ``obj`` after
        # snapshot() returns can reach the checkpoint
        copy = np.array(obj, order="C", copy=True)
        if dtype.isnative and dtype.kind in "biufc":
            t = torch.from_numpy(copy)  # its own dtype and shape: export shows it as it is
        else:  # no torch dtype (strings, datetimes, other byte order): the raw bytes
            t = torch.from_numpy(copy.reshape(-1).view(np.uint8))
        return [dtype.str, shape, {"$tensor": self._add_tensor(t, key)}]

    def _encode_container(self, obj: Any, key: str) -> JSON:
        if isinstance(obj, list):
            return [self.encode(v, f"{key}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v, f"{key}/{i}") for i, v in enumerate(obj)]}
        if len(obj) >= _BATCH_MIN and not self._replicated:
            batch = self._tensor_mapping(obj, key)
            if batch is not None:
                return batch
        items = []
        encode, add_tensor = self.encode, self._add_tensor
        child_path, table = self.keys.child_path, self.keys.items
        for k, v in obj.items():
            kind = type(k)
            if kind is str or kind is int:  # the usual cases: the key encodes as itself
                if isinstance(v, torch.Tensor):
                    # one lookup for the path and the tree's item (see KeyCache.items)
                    entry = table.get((key, k))
                    if entry is None:
                        entry = self.keys.tensor_entry(key, k)
                    index = add_tensor(v, entry[0])
                    if entry[1] != index:  # a new list: earlier trees keep theirs as they were
                        entry[1], entry[2] = index, [k, {"$tensor": index}]
                    items.append(entry[2])
                else:
                    items.append([k, encode(v, child_path(key, k))])
                continue
            if not (k is None or type(k) in (bool, int, float, tuple)):
                raise UnsupportedStateError(
                    f"key {k!r} under {key!r} is of type {type(k).__qualname__}; "
                    "mapping keys must be str, int, float, bool, None or tuples of them"
                )
            child = f"{key}/{_escape(str(k))}" if key else _escape(str(k))
            items.append([encode(k, key), encode(v, child)])
        return {"$dict": items}

    def _tensor_mapping(self, obj: Any, key: str) -> JSON | None:
        """A mapping walked in a few passes that each run in C, rather than one Python loop
        body per tensor: a mapping of str or int keys to plain tensors (a module's state
        dict), or to plain dicts of those (an unflattened optimizer state, ``{i: {"exp_avg":
        t, ...}}``). None, having changed nothing but the key cache, when the mapping is
        neither or a tensor needs a closer look (an unusual tensor, no version counter, a
        data pointer shared with a tensor outside it or by two different views): the
        general loop then walks it. Aliases within it (a tied weight under two keys) are
        recorded here as the loop records them.

        Every tensor's type, layout, dtype, version counter and data pointer are read on
        every walk; what is kept from the last walk (:class:`_MappingShape`) is only what
        follows from the keys: the tensors' paths and the tree node.
        """
        values = list(obj.values())
        kinds = set(map(type, values))
        if kinds <= _PLAIN_TENSORS:
            sizes: list[int] | None = None
            inner: list[Any] | None = None
            tensors = values
        elif kinds == _DICT:  # exactly dict: its own order is the one dict.values gives
            sizes = list(map(len, values))
            inner = list(itertools.chain.from_iterable(values))
            tensors = list(itertools.chain.from_iterable(map(dict.values, values)))
            if len(tensors) != len(inner) or not set(map(type, inner)) <= _PLAIN_KEYS:
                return None
            if not set(map(type, tensors)) <= _PLAIN_TENSORS:
                return None
        else:
            return None
        keys = list(obj)
        if not set(map(type, keys)) <= _PLAIN_KEYS:
            return None
        dtypes = list(map(_DTYPE, tensors))
        if (
            not set(map(_LAYOUT, tensors)) <= _STRIDED_ONLY
            or not set(dtypes) <= _DTYPE_NAMES.keys()
            or any(map(_IS_META, tensors))
        ):
            return None
        try:
            versions = list(map(_VERSION, tensors))
        except (RuntimeError, AttributeError):  # an inference tensor: no version counter
            return None
        base = len(self.tensors)
        pointers = list(map(_DATA_PTR, tensors))
        found = dict(zip(pointers, range(base, base + len(tensors)), strict=True))
        aliases: list[tuple[int, int]] = []
        if len(found) != len(tensors):  # a data pointer seen twice in here: a tied weight?
            tied = _tied(tensors, pointers, base)
            if tied is None:
                return None  # not only exact aliases: the general loop sorts them out
            found, aliases = tied
        if not self._by_ptr.keys().isdisjoint(found):
            return None  # shares a data pointer with an earlier tensor: perhaps an alias
        shape = self.keys.mappings.get(key)
        # the key types are checked above, so equal lists are the same keys (1 == True and
        # 1 == 1.0 cannot pass for one another here)
        if shape is None or shape.keys != keys or shape.sizes != sizes or shape.inner != inner:
            shape = self.keys.mapping_shape(key, keys, sizes, inner)
        if shape.base != base:  # the tree's tensor indexes moved (or a new shape)
            shape.place(base)
        self._by_ptr.update(found)
        self.tensors.extend(map(TensorRef, shape.paths, tensors, versions))
        columns = self.columns
        columns.keys.extend(shape.paths)
        columns.tensors.extend(tensors)
        columns.dtypes.extend(dtypes)
        columns.pointers.extend(pointers)
        columns.dists.extend(itertools.repeat(None, len(tensors)))
        columns.aliases.extend(itertools.repeat(None, len(tensors)))
        for index, first in aliases:  # the indexes are the refs', and so the columns'
            self.tensors[index].alias_of = columns.aliases[index] = first
        return shape.node

    def _add_tensor(self, t: torch.Tensor, key: str) -> int:
        key = key or "<root>"
        dist: DistInfo | None = None
        dtensor: torch.Tensor | None = None
        if type(t) is not torch.Tensor and type(t) is not _Parameter:
            found = local_chunk(t, key)
            if found is not None:
                dtensor = t
                t, dist = found
        # the usual case in one test (a quantized tensor's dtype is not in _DTYPE_NAMES)
        if t.layout is not _STRIDED or t.dtype not in _DTYPE_NAMES or t.is_meta:
            _check_tensor(key, t)
        if dist is None and self._replicated:
            dist = replicated_info(t)
        # aliases share a data pointer: the full identity is compared only on a shared one
        ptr = t.data_ptr()
        index = len(self.tensors)
        first: int | None = None
        sharing = self._by_ptr.setdefault(ptr, index)  # the usual case: one lookup, no list
        if sharing is not index:
            ident = _identity(t)
            candidates = (sharing,) if isinstance(sharing, int) else sharing
            first = next((j for j in candidates if _identity(self.tensors[j].tensor) == ident), None)
            if first is None:
                if isinstance(sharing, int):
                    self._by_ptr[ptr] = [sharing, index]
                else:
                    sharing.append(index)
        try:
            version: int | None = t._version
        except (RuntimeError, AttributeError):  # inference tensors carry no version counter
            version = None
        self.tensors.append(TensorRef(key, t, version, first, dist, dtensor))
        columns = self.columns
        columns.keys.append(key)
        columns.tensors.append(t)
        columns.dtypes.append(t.dtype)
        columns.pointers.append(ptr)
        columns.aliases.append(first)
        columns.dists.append(dist)
        return index


def _tied(
    tensors: list[torch.Tensor], pointers: list[int], base: int
) -> tuple[dict[int, int], list[tuple[int, int]]] | None:
    """For tensors (numbered from ``base``; ``pointers``: their data pointers) some of
    which share a data pointer: each data
    pointer's first tensor, and the (index, first index) of every later one, when each
    later one is an alias of the first there (what ``_Walker._add_tensor`` finds: a tied
    weight seen under a second key). None if one is not (a view of other shape or dtype at
    the same address): the general loop then records it as a tensor of its own."""
    n = len(pointers)
    # reversed, so that each data pointer keeps its first position
    first = dict(zip(reversed(pointers), range(n - 1, -1, -1), strict=True))
    later = [j for j, i in enumerate(map(first.__getitem__, pointers)) if i != j]
    aliases = []
    for j in later:
        i = first[pointers[j]]
        if _identity(tensors[j]) != _identity(tensors[i]):
            return None
        aliases.append((base + j, base + i))
    return {p: base + i for p, i in first.items()}, aliases


class Columns:
    """What a walk found, per tensor, in lists in the refs' order: each
    :class:`TensorRef`'s ``keys``, ``tensors``, ``aliases`` (``alias_of``) and ``dists``
    as the walk made them, and what it read of each tensor besides, its ``dtypes`` and
    ``pointers`` (data pointers); and whether it stored a value as a pickle (``pickled``,
    rather than searching the tree for the tag). ``snapshot()``'s plan and eager choice
    use them rather than going over the refs, or reading every tensor, a second time;
    they hold until the refs are changed (the eager copies are made after both, and a
    distributed snapshot's writers are assigned on the refs: ``dists`` is then stale)."""

    __slots__ = ("aliases", "dists", "dtypes", "keys", "pickled", "pointers", "tensors")

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.dtypes: list[torch.dtype] = []
        self.pointers: list[int] = []
        self.aliases: list[int | None] = []
        self.dists: list[DistInfo | None] = []
        self.pickled = False


def walk_state(
    state: Any,
    *,
    allow_pickle: bool,
    lenient: bool = False,
    keys: KeyCache | None = None,
    columns: Columns | None = None,
) -> tuple[JSON, list[TensorRef]]:
    """Walk ``state`` into its tagged-JSON tree and its tensors (see the module docstring).

    ``lenient`` (used to find the tensors of an ``into=`` target) skips values it cannot
    encode instead of refusing them. A tensor seen a second time under another key (same
    storage, offset, shape, strides and dtype: a tied weight) becomes an alias of the first
    and is stored once. ``keys``: a :class:`KeyCache` kept across walks of the same state
    (none: a fresh one, for this walk only). ``columns``, if given, receives each tensor's
    dtype and data pointer as the walk read them, and whether it pickled a value (see
    :class:`Columns`).
    """
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"the state must be a mapping (a dict of tensors, Stateful objects and plain "
            f"values), got {type(state).__qualname__}"
        )
    walker = _Walker(allow_pickle, lenient, KeyCache() if keys is None else keys)
    tree = walker.encode(state, "")
    if columns is not None:
        for name in Columns.__slots__:
            setattr(columns, name, getattr(walker.columns, name))
    return tree, walker.tensors
