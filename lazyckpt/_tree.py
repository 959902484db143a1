"""Walking a user's state into tensors and tagged JSON, and building it back.

A state is a nested structure of mappings, lists, tuples, tensors, ``Stateful`` objects
(anything with ``state_dict()``/``load_state_dict()``) and plain values. Walking it yields

- a JSON document (the *tree*) in which every tensor is replaced by ``{"$tensor": i}``;
- a list of :class:`TensorRef`, one per distinct tensor, in walk order.

Plain values are stored as *tagged JSON*, so that restoring never executes code:

==================  ==========================================
Python              JSON
==================  ==========================================
None, bool, int,    themselves
str, finite float
nan, inf, -inf      ``{"$float": "nan"}`` etc.
list                a JSON list
tuple               ``{"$tuple": [...]}``
dict                ``{"$dict": [[key, value], ...]}`` (any plain key, order kept)
bytes               ``{"$bytes": "<base64>"}``
torch.dtype         ``{"$dtype": "bfloat16"}``
torch.device        ``{"$device": "cuda:0"}``
torch.Size          ``{"$size": [...]}``
numpy scalar        ``{"$np": ["float32", value]}``
numpy array         ``{"$ndarray": ["<f4", [shape], payload]}``: payload ``{"$bytes": ...}``
                    up to ``INLINE_ARRAY_BYTES``, a ``{"$tensor": i}`` shard above
torch.Generator     ``{"$generator": ["cpu", {"$tensor": i}]}`` (its ``get_state()``)
numpy Generator     ``{"$np_generator": <bit_generator.state, encoded>}``
numpy RandomState   ``{"$np_random_state": <get_state(legacy=False), encoded>}``
random.Random       ``{"$random": <getstate(), encoded>}``
dataclass instance  ``{"$dataclass": ["module.Name", {"$dict": fields}]}`` (pickled instead
                    with ``allow_pickle=True``, to come back as its own class)
Stateful object     ``{"$stateful": <its state_dict, encoded>}``
anything else       ``{"$pickle": "<base64>"}`` only with ``allow_pickle=True``
==================  ==========================================

Restoring builds only the types above and never imports or calls anything named in the
checkpoint: a dataclass comes back as a :class:`DataclassValue` (a dict of its fields, which
``restore(into=...)`` writes into a live instance), numpy bit generators are rebuilt only
from numpy's own list of them.

numpy arrays are copied when ``snapshot()`` walks the state, not captured lazily: numpy
writes bypass torch's version counter, so a later in-place write could not be detected.
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
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ._dist import DistInfo, ReplicatedMarker, local_chunk, replicated_info
from ._errors import CorruptionError, UnsupportedStateError

__all__ = [
    "INLINE_ARRAY_BYTES",
    "DataclassValue",
    "KeyCache",
    "Stateful",
    "StatefulValue",
    "TensorRef",
    "decode_tree",
    "dtype_from_name",
    "dtype_name",
    "walk_state",
]

JSON = Any  # a JSON-compatible value; kept loose because JSON is recursive


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: a module, an optimizer, a
    learning-rate scheduler, a data loader with state."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


_DTYPES: dict[str, torch.dtype] = {}
for _name in ["float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _DTYPES[_name] = _dt
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The stable name lazyckpt stores for a dtype (``"bfloat16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedStateError(f"dtype {dtype} is not supported") from None


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; a name this torch does not know is corruption or a
    checkpoint from a newer torch."""
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptionError(f"unknown dtype {name!r} in manifest") from None


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


# numpy arrays at most this big are stored in the manifest's JSON (np.random.get_state()'s
# key is 2,496 bytes); bigger ones become a tensor of the snapshot, in the shards.
INLINE_ARRAY_BYTES = 4096
# numpy dtype kinds stored without pickle: bool, ints, floats, complex, timedelta,
# datetime, bytes and unicode strings (all fixed-size, so the raw bytes are the array)
_ARRAY_KINDS = "biufcmMSU"
# the bit generators a numpy Generator can be rebuilt with, by the name its state carries
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


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
    from scanning, a new list and dict per tensor per snapshot.

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


_Parameter = torch.nn.Parameter
_STRIDED = torch.strided
# what _Walker._tensor_mapping takes in its passes
_BATCH_MIN = 8  # below this, setting the passes up costs more than the loop
_PLAIN_TENSORS = {torch.Tensor, _Parameter}
_PLAIN_KEYS = {str, int}  # not bool: True is no int key here
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
                return {"$stateful": self.encode(obj.state_dict(), key)}
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
        """A mapping of str or int keys to plain tensors (a module's state dict) walked in a
        few passes that each run in C, rather than one Python loop body per tensor. None,
        having changed nothing but the key cache, when the mapping is not one of those or a
        tensor needs a closer look (an unusual tensor, an alias, no version counter): the
        general loop then walks it."""
        values = list(obj.values())
        if not set(map(type, values)) <= _PLAIN_TENSORS:
            return None
        keys = list(obj)
        if not set(map(type, keys)) <= _PLAIN_KEYS:
            return None
        if (
            set(map(_LAYOUT, values)) != {_STRIDED}
            or not set(map(_DTYPE, values)) <= _DTYPE_NAMES.keys()
            or any(map(_IS_META, values))
        ):
            return None
        try:
            versions = list(map(_VERSION, values))
        except (RuntimeError, AttributeError):  # an inference tensor: no version counter
            return None
        base = len(self.tensors)
        found = dict(zip(map(_DATA_PTR, values), range(base, base + len(values)), strict=True))
        if len(found) != len(values) or not self._by_ptr.keys().isdisjoint(found):
            return None  # a data pointer seen twice: perhaps an alias
        cached = list(map(self.keys.items.get, zip(itertools.repeat(key), keys)))
        # a miss checks the key, as the general loop would
        entries = [
            e if e is not None else self.keys.tensor_entry(key, k)
            for e, k in zip(cached, keys, strict=True)
        ]
        self._by_ptr.update(found)
        self.tensors.extend(map(TensorRef, [e[0] for e in entries], values, versions))
        if [e[1] for e in entries] != list(range(base, base + len(values))):
            for j, entry in enumerate(entries):
                if entry[1] != base + j:  # a new list: earlier trees keep theirs as they were
                    entry[1], entry[2] = base + j, [keys[j], {"$tensor": base + j}]
        return {"$dict": [e[2] for e in entries]}

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
        return index


def walk_state(
    state: Any, *, allow_pickle: bool, lenient: bool = False, keys: KeyCache | None = None
) -> tuple[JSON, list[TensorRef]]:
    """Walk ``state`` into its tagged-JSON tree and its tensors (see the module docstring).

    ``lenient`` (used to find the tensors of an ``into=`` target) skips values it cannot
    encode instead of refusing them. A tensor seen a second time under another key (same
    storage, offset, shape, strides and dtype: a tied weight) becomes an alias of the first
    and is stored once. ``keys``: a :class:`KeyCache` kept across walks of the same state
    (none: a fresh one, for this walk only).
    """
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"the state must be a mapping (a dict of tensors, Stateful objects and plain "
            f"values), got {type(state).__qualname__}"
        )
    walker = _Walker(allow_pickle, lenient, KeyCache() if keys is None else keys)
    tree = walker.encode(state, "")
    return tree, walker.tensors


def decode_tree(
    tree: JSON, tensors: list[Any], *, allow_pickle: bool, plain: bool = False
) -> Any:
    """Build the state back from its tree; ``tensors[i]`` replaces ``{"$tensor": i}``.

    A ``$stateful`` node comes back as its decoded state dict, a ``$dataclass`` as a
    :class:`DataclassValue`. Pickled values are refused unless ``allow_pickle`` is true.
    With ``plain``, no object is built that is not a builtin or a tensor: a generator comes
    back as its state (a torch generator's state tensor, a numpy generator's state dict), and
    an array stored in the shards as that tensor (``tensors[i]`` may then be any tensor of the
    right size: no data is read). Any malformed node raises :class:`CorruptionError`.
    """
    try:
        return _Decoder(tensors, allow_pickle, plain).decode(tree)
    except (CorruptionError, UnsupportedStateError):
        raise
    except Exception as exc:
        raise CorruptionError(f"the manifest's value tree is damaged: {exc!r}") from exc


class StatefulValue(dict[Any, Any]):
    """The decoded state dict of a Stateful object (a dict, marked so ``into=`` knows to call
    ``load_state_dict``)."""


class DataclassValue(dict[str, Any]):
    """The decoded fields of a dataclass instance, by name. ``type_name`` is the class's
    ``module.QualName`` as saved, for information: the class is never imported.
    ``restore(into=...)`` sets these fields on the live instance."""

    def __init__(self, fields: Mapping[str, Any], type_name: str) -> None:
        super().__init__(fields)
        self.type_name = type_name


def _array(dtype_str: Any, shape: Any, data: Any) -> np.ndarray[Any, Any]:
    if type(dtype_str) is not str or not isinstance(shape, list):
        raise CorruptionError(f"bad numpy array node {[dtype_str, shape]!r:.80}")
    dtype = np.dtype(dtype_str)
    # checked again on the way in: bytes of an object array would be read as pointers
    if dtype.hasobject or dtype.kind not in _ARRAY_KINDS or dtype.fields is not None:
        raise CorruptionError(f"numpy dtype {dtype_str!r:.40} is not one lazyckpt stores")
    if any(type(d) is not int or d < 0 for d in shape):
        raise CorruptionError(f"bad numpy array shape {shape!r:.60}")
    if isinstance(data, bytes):
        raw = np.frombuffer(data, dtype=np.uint8).copy()  # writable, like the array saved
    elif isinstance(data, torch.Tensor):
        raw = data.detach().cpu().reshape(-1).view(torch.uint8).numpy()
    else:
        raise CorruptionError("a numpy array's data is neither bytes nor a tensor")
    if raw.nbytes != math.prod(shape) * dtype.itemsize:
        raise CorruptionError(
            f"numpy array of {dtype_str} {shape} has {raw.nbytes} bytes of data"
        )
    return raw.view(dtype).reshape(shape)


def _bit_generator(state: Any) -> Any:
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if name not in _BIT_GENERATORS:
        raise CorruptionError(f"unknown numpy bit generator {name!r:.40}")
    bit_generator = getattr(np.random, name)()
    bit_generator.state = state
    return bit_generator


class _Decoder:
    def __init__(self, tensors: list[Any], allow_pickle: bool, plain: bool) -> None:
        self.tensors = tensors
        self.allow_pickle = allow_pickle
        self.plain = plain

    def decode(self, node: JSON) -> Any:
        kind = type(node)
        if kind is str or kind is int or node is None or isinstance(node, bool | int | str | float):
            return node
        if kind is dict and len(node) == 1:  # the usual node first: a tensor reference
            index = node.get("$tensor", node)
            if type(index) is int and 0 <= index < len(self.tensors):
                return self.tensors[index]
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict) or len(node) != 1:
            raise CorruptionError(f"malformed node in value tree: {node!r:.80}")
        ((tag, value),) = node.items()
        handler = _OBJECT_TAGS.get(tag)
        if handler is not None:
            return handler(self, value)
        return _decode_builtin(self, tag, value)

    def ndarray(self, value: Any) -> Any:
        dtype_str, shape, payload = value
        data = self.decode(payload)
        if data is None:  # a placeholder tensor: the caller only checks the tree
            return None
        if self.plain and isinstance(data, torch.Tensor):
            return data
        return _array(dtype_str, shape, data)

    def generator(self, value: Any) -> Any:
        device, payload = value
        state = self.decode(payload)
        if state is None:  # a placeholder tensor: the caller only checks the tree
            return None
        if not isinstance(state, torch.Tensor) or type(device) is not str:
            raise CorruptionError(f"bad torch generator node {value!r:.80}")
        if self.plain:
            return state
        try:
            generator = torch.Generator(device=device)
        except RuntimeError as exc:  # e.g. a CUDA generator restored where there is no GPU
            raise UnsupportedStateError(
                f"a torch.Generator saved on {device!r} cannot be rebuilt here ({exc}); "
                "restore where that device exists"
            ) from exc
        generator.set_state(state.detach().cpu())
        return generator

    def np_generator(self, value: Any) -> Any:
        state = self.decode(value)
        return state if self.plain else np.random.Generator(_bit_generator(state))

    def np_random_state(self, value: Any) -> Any:
        state = self.decode(value)
        if self.plain:
            return state
        random_state = np.random.RandomState(_bit_generator(state))
        random_state.set_state(state)
        return random_state

    def random(self, value: Any) -> Any:
        state = self.decode(value)
        if self.plain:
            return state
        generator = random.Random()
        generator.setstate(state)
        return generator

    def dataclass(self, value: Any) -> Any:
        name, fields = value
        decoded = self.decode(fields)
        if type(name) is not str or not isinstance(decoded, dict):
            raise CorruptionError(f"bad dataclass node {value!r:.80}")
        return dict(decoded) if self.plain else DataclassValue(decoded, name)


_OBJECT_TAGS: dict[str, Any] = {
    "$ndarray": _Decoder.ndarray,
    "$generator": _Decoder.generator,
    "$np_generator": _Decoder.np_generator,
    "$np_random_state": _Decoder.np_random_state,
    "$random": _Decoder.random,
    "$dataclass": _Decoder.dataclass,
}


def _decode_builtin(dec: _Decoder, tag: str, value: Any) -> Any:
    """The tags of plain values, containers and tensors."""
    if tag == "$dict":
        keys = [dec.decode(k) for k, _ in value]
        values = [dec.decode(v) for _, v in value]
        try:
            return dict(zip(keys, values, strict=True))
        except TypeError as exc:  # keys are encoded hashable: only damage makes one a list
            raise CorruptionError(f"a mapping key of the value tree is not hashable: {exc}") from exc
    if tag == "$tuple":
        return tuple(dec.decode(v) for v in value)
    if tag == "$stateful":
        inner = dec.decode(value)
        if dec.plain:
            return inner
        return StatefulValue(inner) if isinstance(inner, dict) else inner
    if tag == "$tensor":
        if type(value) is not int or not 0 <= value < len(dec.tensors):
            raise CorruptionError(f"tensor reference {value!r} out of range")
        return dec.tensors[value]
    if tag == "$float":
        if value not in ("nan", "inf", "-inf"):
            raise CorruptionError(f"bad float tag {value!r}")
        return float(value)
    if tag == "$bytes":
        return base64.b64decode(value, validate=True)
    if tag == "$dtype":
        return dtype_from_name(value)
    if tag == "$device":
        return torch.device(value)
    if tag == "$size":
        return torch.Size(value)
    if tag == "$np":
        dtype, inner = value
        return np.dtype(dtype).type(dec.decode(inner))
    if tag == "$pickle":
        if not dec.allow_pickle:
            raise UnsupportedStateError(
                "this checkpoint holds a pickled value; restoring it would run code from the "
                "checkpoint. Pass allow_pickle=True if you trust its origin."
            )
        return pickle.loads(base64.b64decode(value, validate=True))
    raise CorruptionError(f"unknown tag {tag!r} in value tree")
