"""The built-in storage tiers of lazyckpt.

Each registers under the ``lazyckpt.tiers`` entry-point group, the same way a third-party
tier does; ``lazyckpt`` itself never imports this package.
"""

from .file.tier import FileTier
from .host import HostMemoryTier
from .peer.tier import PeerTier
from .zarr.tier import ZarrTier

__all__ = ["FileTier", "HostMemoryTier", "PeerTier", "ZarrTier"]
