"""The built-in storage tiers of lazyckpt.

Each registers under the ``lazyckpt.tiers`` entry-point group, the same way a third-party
tier does; ``lazyckpt`` itself never imports this package.
"""

from ._file import FileTier
from ._host import HostMemoryTier
from ._peer import PeerTier
from ._zarr import ZarrTier

__all__ = ["FileTier", "HostMemoryTier", "PeerTier", "ZarrTier"]
