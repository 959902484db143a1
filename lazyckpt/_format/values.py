"""Tagged JSON: the value tree a state walks into (``_format.walk``), and building it back.

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
from numpy's own list of them. The walk that writes these tags is ``_format.walk``'s.
"""

from __future__ import annotations

import base64
import itertools
import math
import operator
import pickle
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._errors import CorruptionError, UnsupportedStateError

__all__ = [
    "INLINE_ARRAY_BYTES",
    "JSON",
    "DataclassValue",
    "StatefulValue",
    "decode_tree",
    "dtype_from_name",
    "dtype_name",
    "has_tag",
]

JSON = Any  # a JSON-compatible value; kept loose because JSON is recursive

_DTYPES: dict[str, torch.dtype] = {}
for _name in ["float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32", "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]:
    _dt = getattr(torch, _name, None)
    if isinstance(_dt, torch.dtype):
        _DTYPES[_name] = _dt
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def has_tag(tree: JSON, tag: str) -> bool:
    """Whether a tagged-JSON value tree holds a node tagged ``tag`` (``"$pickle"``,
    ``"$tensor"``, ...) anywhere; iterative, so a deep tree cannot exhaust the stack."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if tag in node:
                return True
            stack.extend(node.values())
    return False


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

# numpy arrays at most this big are stored in the manifest's JSON (np.random.get_state()'s
# key is 2,496 bytes); bigger ones become a tensor of the snapshot, in the shards.
INLINE_ARRAY_BYTES = 4096
# numpy dtype kinds stored without pickle: bool, ints, floats, complex, timedelta,
# datetime, bytes and unicode strings (all fixed-size, so the raw bytes are the array)
_ARRAY_KINDS = "biufcmMSU"
# the bit generators a numpy Generator can be rebuilt with, by the name its state carries
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


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


_BULK_MIN = 8  # below this, setting the passes up costs more than the loop
_PLAIN_KEYS = {str, int}  # decoded as themselves (not bool: True is no int key here)
_LIST, _DICT, _INT, _PAIR, _ONE = {list}, {dict}, {int}, {2}, {1}
_KEY = operator.itemgetter(0)
_NODE = operator.itemgetter(1)


def _tensors_of(dec: _Decoder, nodes: list[Any]) -> list[Any] | None:
    """The tensors ``nodes`` refer to if every one is a ``{"$tensor": i}`` in range, else None."""
    if set(map(type, nodes)) != _DICT or set(map(len, nodes)) != _ONE:
        return None
    indexes: list[Any] = list(map(dict.get, nodes, itertools.repeat("$tensor")))
    if set(map(type, indexes)) != _INT or min(indexes) < 0 or max(indexes) >= len(dec.tensors):
        return None
    return list(map(dec.tensors.__getitem__, indexes))


def _items_of(value: list[Any]) -> tuple[list[Any], list[Any]] | None:
    """The keys and value nodes of a ``$dict``'s items if each is a ``[key, node]`` with a
    str or int key, else None."""
    if set(map(type, value)) != _LIST or set(map(len, value)) != _PAIR:
        return None
    keys = list(map(_KEY, value))
    if not set(map(type, keys)) <= _PLAIN_KEYS:
        return None
    return keys, list(map(_NODE, value))


def _tensor_dict(dec: _Decoder, value: list[Any]) -> dict[Any, Any] | None:
    """A ``$dict`` of tensor references (a module's state dict) or of ``$dict``s of them (an
    optimizer's per-parameter state) decoded in passes that each run in C, as
    ``_Walker._tensor_mapping`` walked it; None, for the general decoding, when it is
    neither or anything in it looks unusual (damage included)."""
    found = _items_of(value)
    if found is None:
        return None
    keys, nodes = found
    tensors = _tensors_of(dec, nodes)
    if tensors is not None:
        return dict(zip(keys, tensors, strict=True))
    if set(map(type, nodes)) != _DICT or set(map(len, nodes)) != _ONE:
        return None
    inner: list[Any] = list(map(dict.get, nodes, itertools.repeat("$dict")))
    if set(map(type, inner)) != _LIST:
        return None
    sizes = list(map(len, inner))
    flat = _items_of(list(itertools.chain.from_iterable(inner)))
    if flat is None:  # an unusual item, or no item at all
        return None
    names, leaves = flat
    tensors = _tensors_of(dec, leaves)
    if tensors is None:
        return None
    pairs = zip(names, tensors, strict=True)
    return {k: dict(itertools.islice(pairs, size)) for k, size in zip(keys, sizes, strict=True)}


def _decode_builtin(dec: _Decoder, tag: str, value: Any) -> Any:
    """The tags of plain values, containers and tensors."""
    if tag == "$dict":
        if type(value) is list and len(value) >= _BULK_MIN:
            found = _tensor_dict(dec, value)
            if found is not None:
                return found
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
