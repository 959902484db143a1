"""Test kit for tier authors and for lazyckpt's own tests.

- :class:`TierTests`: the conformance suite every tier passes (subclass it with a
  ``make_tier`` fixture).
- :func:`build_snapshot`: a manifest and shard payloads built without the engine (an oracle).
- :class:`FaultyTier`: wraps a tier and injects slowness, transient or permanent failures,
  hangs and a full device.

Importing this module needs pytest.
"""

from ._conformance import TierTests, build_snapshot
from ._faults import FaultyTier

__all__ = ["FaultyTier", "TierTests", "build_snapshot"]
