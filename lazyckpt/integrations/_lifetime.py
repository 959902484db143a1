"""An integration's Checkpointer over the framework's runs: opened at the first use, closed
when a run ends (which lets the location go, so that another Checkpointer of the same
process can open it: a notebook's next cell), and opened again at the next use, on fresh
copies of the tiers.

A tier is opened and closed once (its ``aclose`` is final), so a reopening needs new tier
objects. The integrations take tier *instances*; :class:`Lifetime` keeps a copy of them as
they were just before their first opening (:func:`copy_tiers`: a deep copy, in which a
``threading`` lock is made anew rather than copied) and opens each later run on a copy of
that copy. A chain that cannot be copied so (a third-party tier holding an open connection
from its constructor) is not released at a run's end: it stays open until ``close()``, as
it would without this module.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Sequence
from typing import Any

from .._checkpointer.facades import SyncCheckpointer
from .._errors import LazyCkptError
from .._tiering.interface import Tier

__all__ = ["Lifetime", "copy_tiers"]

log = logging.getLogger("lazyckpt.integrations")

_LOCKS: dict[type, Any] = {
    type(threading.Lock()): threading.Lock,
    type(threading.RLock()): threading.RLock,
}


def _copy(obj: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(obj, memo)``, except that a ``threading`` lock anywhere inside is a
    new lock (deepcopy refuses locks): an object whose deep copy fails is rebuilt from its
    ``__dict__`` and slots (a list, tuple, set or dict from its items), each part copied
    so, if it copies as ``object`` does (:func:`_plain`); otherwise the failure stands."""
    if id(obj) in memo:
        return memo[id(obj)]
    if type(obj) in _LOCKS:
        fresh = _LOCKS[type(obj)]()
        memo[id(obj)] = fresh
        return fresh
    trial = dict(memo)  # a failed deepcopy leaves half-built objects in its memo
    try:
        result = copy.deepcopy(obj, trial)
    except Exception:
        pass
    else:
        memo.update(trial)
        return result
    if type(obj) in (list, set, dict, tuple):
        if isinstance(obj, dict):
            out: Any = {}
            memo[id(obj)] = out
            for k, v in obj.items():
                out[_copy(k, memo)] = _copy(v, memo)
            return out
        items = [_copy(v, memo) for v in obj]
        out = type(obj)(items)
        memo[id(obj)] = out
        return out
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict) or not _plain(type(obj)):
        # an object with copying of its own that refused, or no attributes to copy
        raise TypeError(f"cannot copy {type(obj).__qualname__}")
    slots = [
        name
        for cls in type(obj).__mro__
        for name in _slots(cls)
        if name not in ("__dict__", "__weakref__")
    ]
    clone = object.__new__(type(obj))
    memo[id(obj)] = clone
    for name in slots:
        if hasattr(obj, name):
            object.__setattr__(clone, name, _copy(getattr(obj, name), memo))
    clone.__dict__.update({k: _copy(v, memo) for k, v in state.items()})
    return clone


def _plain(cls: type) -> bool:
    """Whether ``cls`` copies as ``object`` does (no ``__deepcopy__``, ``__reduce__``,
    ``__reduce_ex__`` or ``__getstate__`` of its own): then copying its ``__dict__`` part
    by part is what ``copy.deepcopy`` would have done."""
    return (
        getattr(cls, "__deepcopy__", None) is None
        and cls.__reduce_ex__ is object.__reduce_ex__  # type: ignore[comparison-overlap]
        and cls.__reduce__ is object.__reduce__  # type: ignore[comparison-overlap]
        and getattr(cls, "__getstate__", None) is getattr(object, "__getstate__", None)
    )


def _slots(cls: type) -> tuple[str, ...]:
    names = vars(cls).get("__slots__", ())
    return (names,) if isinstance(names, str) else tuple(names)


def copy_tiers(tiers: Sequence[Tier]) -> list[Tier]:
    """Unopened copies of ``tiers`` (see the module docstring). Raises what copying raised
    (``TypeError`` for an object that cannot be copied)."""
    memo: dict[int, Any] = {}
    return [_copy(t, memo) for t in tiers]


class Lifetime:
    """The Checkpointer of an integration object, across the framework's runs.

    Args:
        tiers: the chain the user passed (opened as it is the first time).
        options: the Checkpointer's options.
    """

    def __init__(self, tiers: Sequence[Tier], options: dict[str, Any]) -> None:
        self.tiers = list(tiers)
        self._options = dict(options)
        # the Checkpointer to open next, or open now; None after a release (the next is
        # built on copies of the template when needed)
        self._ckpt: SyncCheckpointer | None = SyncCheckpointer(self.tiers, **self._options)
        self._opened = False
        # the last Checkpointer built: its metrics stay readable after it was closed
        self._last: SyncCheckpointer = self._ckpt
        # copies of the chain as it was before its first opening; None until then, or when
        # it could not be copied (then the chain is never released before close())
        self._template: list[Tier] | None = None
        self._copied = False
        self._lock = threading.RLock()

    @property
    def current(self) -> SyncCheckpointer | None:
        """The open Checkpointer, or None between runs."""
        return self._ckpt if self._opened else None

    def metrics(self) -> dict[str, Any]:
        """The metrics of the Checkpointer open now or, between runs, of the one the last
        run closed."""
        return self._last.metrics()

    def open(self) -> SyncCheckpointer:
        """The open Checkpointer: the one open now, or one opened now (on fresh copies of
        the tiers after a release)."""
        with self._lock:
            if self._opened and self._ckpt is not None:
                return self._ckpt
            if not self._copied:
                self._copied = True
                try:
                    self._template = copy_tiers(self.tiers)
                except Exception as exc:
                    log.info(
                        "lazyckpt: the tiers cannot be copied (%s: %s), so they stay open "
                        "between runs until close()",
                        type(exc).__name__,
                        exc,
                    )
            if self._ckpt is None:
                assert self._template is not None
                self._ckpt = SyncCheckpointer(copy_tiers(self._template), **self._options)
                self._last = self._ckpt
            ckpt = self._ckpt
            try:
                ckpt.open()
            except BaseException:
                if self._template is not None:
                    # a clean start next time (after the holder of a location in use was
                    # closed, say): this one may have opened some of its tiers
                    self._ckpt = None
                    with contextlib.suppress(Exception):
                        ckpt.close()
                raise
            self._opened = True
            return ckpt

    def release(self) -> None:
        """Close the open Checkpointer (every snapshot drained, the tiers closed, the
        location free) if the chain can be opened again; otherwise leave it open. Raises
        what ``close()`` raises (a failure nobody had seen)."""
        with self._lock:
            if not self._opened or self._template is None or self._ckpt is None:
                return
            ckpt, self._ckpt, self._opened = self._ckpt, None, False
            ckpt.close()

    def release_at_run_end(self) -> None:
        """:meth:`release` when a framework's run ends: a failure nobody had seen is
        logged, not raised into the framework's teardown."""
        try:
            self.release()
        except LazyCkptError:
            log.exception("lazyckpt: a checkpoint failed while closing the tiers")

    def close(self) -> None:
        """Close the Checkpointer for good. Raises what its ``close()`` raises."""
        with self._lock:
            ckpt, self._ckpt = self._ckpt, None
            opened, self._opened = self._opened, False
            self._template = None
            if ckpt is not None and opened:
                ckpt.close()
