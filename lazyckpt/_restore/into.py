"""Loading restored state into live objects: ``restore(into=...)``'s last step.

Tensors were already filled in place by the read; here Stateful objects get
``load_state_dict``, generators their state, dataclass instances their fields, and plain
values of a mutable mapping are replaced. Every key is checked before anything is loaded
(:class:`StateMismatchError`), so a mismatch changes nothing. What a Stateful object's own
``load_state_dict`` still refuses after those checks is raised as a
:class:`StateMismatchError` too, its error the ``__cause__``; by then the target is partly
restored (see :func:`apply_into`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from .._errors import ConfigurationError, LazyCkptError, StateMismatchError
from .._format.values import DataclassValue, StatefulValue
from .._format.walk import Stateful

__all__ = ["apply_into"]


def apply_into(into: Any, restored: Any, key: str = "") -> None:
    """Load ``restored`` into ``into`` in place: tensors were already copied into; Stateful
    objects get ``load_state_dict``; generators get their state; dataclass instances their
    fields; other values of a mutable mapping are replaced.

    Every key is checked first (:class:`StateMismatchError`), so a mismatch changes nothing.
    Then the entries load depth first in ``restored``'s (the snapshot's) key order; a
    Stateful object whose ``load_state_dict`` raises stops it there, with the entries
    before loaded (and the tensors, filled by the read before this is called), as a
    :class:`StateMismatchError` whose ``__cause__`` is the object's error.
    """
    _check_keys(into, restored, key)
    if not _load(into, restored, key):
        raise ConfigurationError(
            f"cannot restore into {type(into).__qualname__} at {key or '<root>'!r}; "
            "into= takes a mutable mapping of tensors, Stateful objects and values"
        )


def _stateful(obj: Any) -> bool:
    """A Stateful object that is not a mapping (a module, an optimizer). Plain dicts and
    tensors are answered at once: the Protocol's isinstance is slow, and it would be asked
    once per container and per tensor (``docs/design.md``, "Figures behind choices in the
    code")."""
    if type(obj) in _NEVER_STATEFUL or obj is None:
        return False
    return isinstance(obj, Stateful) and not isinstance(obj, Mapping)


_NEVER_STATEFUL = (dict, list, tuple, torch.Tensor, torch.nn.Parameter, str, int, float, bool)


def _mutable_mapping(obj: Any) -> bool:
    """``isinstance(obj, MutableMapping)``, a plain dict answered before the ABC's check
    (which costs about a microsecond, several times per container of a large state)."""
    return type(obj) is dict or isinstance(obj, MutableMapping)


def _mapping(obj: Any) -> bool:
    """``isinstance(obj, Mapping)``, a plain dict answered first (see :func:`_mutable_mapping`)."""
    return type(obj) is dict or isinstance(obj, Mapping)


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _mismatch(key: str, what: str, missing: list[Any], unexpected: list[Any]) -> StateMismatchError:
    where = repr(key) if key else "the top level"
    parts = []
    if missing:
        parts.append(f"missing from the snapshot: {_names(missing)}")
    if unexpected:
        parts.append(f"in the snapshot but not in the target: {_names(unexpected)}")
    return StateMismatchError(
        f"restore(into=...): the keys of {what} at {where} do not match the snapshot's ("
        + "; ".join(parts)
        + "). Rename the target's keys to the snapshot's (lazyckpt inspect lists them), or "
        "restore without into= and load what you need.",
        key=key,
        missing=missing,
        unexpected=unexpected,
    )


def _names(keys: list[Any]) -> str:
    shown = ", ".join(repr(k) for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def _check_keys(into: Any, restored: Any, key: str) -> None:
    """Raise :class:`StateMismatchError` where ``into`` wants what ``restored`` lacks."""
    if isinstance(into, torch.Tensor):  # the usual leaf, answered before the ABC checks
        return
    if type(into) is not dict:  # a plain dict is neither a module nor Stateful
        if isinstance(into, torch.nn.Module) and isinstance(restored, Mapping):
            want = list(into.state_dict().keys())
            want_set = set(want)  # once, not per key
            missing = [k for k in want if k not in restored]
            unexpected = [k for k in restored if k not in want_set]
            if missing or unexpected:
                raise _mismatch(key, f"module {type(into).__qualname__}", missing, unexpected)
            return
        if _stateful(into):
            return  # its own load_state_dict decides what it accepts
    if _mutable_mapping(into) and _mapping(restored):
        missing = [k for k in into if k not in restored]
        if missing:
            unexpected = [k for k in restored if k not in into]
            raise _mismatch(key, "the mapping", missing, unexpected)
        for k, v in into.items():
            if not isinstance(v, torch.Tensor):  # a tensor leaf has nothing to check
                _check_keys(v, restored[k], _join(key, k))
    elif _is_dataclass_instance(into) and isinstance(restored, DataclassValue):
        names = [f.name for f in dataclasses.fields(into)]
        names_set = set(names)
        missing = [n for n in names if n not in restored]
        unexpected = [n for n in restored if n not in names_set]
        if missing or unexpected:
            raise _mismatch(key, f"dataclass {type(into).__qualname__}", missing, unexpected)
        for n in names:
            _check_keys(getattr(into, n), restored[n], _join(key, n))


def _join(key: str, k: Any) -> str:
    return f"{key}/{k}" if key else str(k)


def _load(current: Any, value: Any, key: str) -> bool:
    """Load ``value`` into the live object ``current`` in place; False when ``current`` is
    not something that loads in place (the caller then replaces it with ``value``)."""
    if isinstance(current, torch.Tensor):
        if isinstance(value, torch.Tensor) and value is not current:
            current.copy_(value)
        return isinstance(value, torch.Tensor)
    if _stateful(current):
        _load_stateful(current, dict(value) if isinstance(value, StatefulValue) else value, key)
        return True
    if _mutable_mapping(current) and _mapping(value):
        for k, v in value.items():
            if k not in current:
                current[k] = _plain(v)
                continue
            now = current[k]
            if v is now and isinstance(v, torch.Tensor):  # filled in place by the read
                continue
            if not _load(now, v, _join(key, k)):
                current[k] = _plain(v)
        return True
    if _is_dataclass_instance(current) and isinstance(value, DataclassValue):
        for name, v in value.items():
            if not _load(getattr(current, name), v, _join(key, name)):
                try:
                    setattr(current, name, _plain(v))
                except dataclasses.FrozenInstanceError:
                    raise ConfigurationError(
                        f"restore(into=...): {type(current).__qualname__} at {key!r} is a "
                        f"frozen dataclass, so its field {name!r} cannot be loaded in place; "
                        "restore without into= and build a new instance from the fields"
                    ) from None
        return True
    if isinstance(current, torch.Generator) and isinstance(value, torch.Generator):
        current.set_state(value.get_state())
        return True
    if isinstance(current, np.random.Generator) and isinstance(value, np.random.Generator):
        if type(current.bit_generator) is not type(value.bit_generator):
            return False  # another algorithm: the restored generator replaces it
        current.bit_generator.state = value.bit_generator.state
        return True
    if isinstance(current, np.random.RandomState) and isinstance(value, np.random.RandomState):
        current.set_state(value.get_state(legacy=False))
        return True
    if type(current) is random.Random and type(value) is random.Random:
        current.setstate(value.getstate())
        return True
    if (
        type(current) is np.ndarray
        and type(value) is np.ndarray
        and current.shape == value.shape
        and current.dtype == value.dtype
        and current.flags.writeable
    ):
        np.copyto(current, value)
        return True
    return False


def _load_stateful(target: Any, state: Any, key: str) -> None:
    """``target.load_state_dict(state)``, its failure raised as a :class:`StateMismatchError`
    naming ``key`` (the original as ``__cause__``). What could be checked was checked before
    anything was read; what the object's own method still refuses comes after the tensors
    of ``into=`` were filled and the entries before this one loaded."""
    try:
        target.load_state_dict(state)
    except LazyCkptError:
        raise
    except Exception as exc:
        raise StateMismatchError(
            f"restore(into=...): {type(target).__qualname__}.load_state_dict refused the "
            f"snapshot's state at {key or '<root>'!r}: {type(exc).__name__}: {exc}. The "
            "target is partly restored: its tensors were filled in place and the entries "
            "before this one loaded (in the snapshot's key order), so restore again into "
            "fresh objects, or restore without into= and load what matches.",
            key=key,
            missing=[],
            unexpected=[],
        ) from exc


def _plain(value: Any) -> Any:
    # lazyckpt's marker types stay inside the restore; what lands in a target is a dict
    if isinstance(value, StatefulValue | DataclassValue):
        return dict(value)
    return value
