"""Test kit for tier authors and for lazyckpt's own tests.

- :class:`TierTests`: the conformance suite every tier passes (subclass it with a
  ``make_tier`` fixture). Importing it needs pytest.
- :func:`build_snapshot`: a manifest and shard payloads built without the engine (an oracle).
- :class:`FaultyTier`: wraps a tier and injects slowness, transient or permanent failures,
  hangs and a full device.

``FaultyTier`` and ``build_snapshot`` need only lazyckpt: a trainer can use them to rehearse
failures without pytest installed; ``TierTests`` is imported from pytest on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._faults import FaultyTier
from ._oracle import build_snapshot

if TYPE_CHECKING:
    from ._conformance import TierTests

__all__ = ["FaultyTier", "TierTests", "build_snapshot"]


def __getattr__(name: str) -> Any:
    if name == "TierTests":
        from ._conformance import TierTests

        return TierTests
    raise AttributeError(f"module 'lazyckpt.testing' has no attribute {name!r}")
