"""lazyckpt: lazy asynchronous checkpointing for PyTorch with pluggable storage tiers.

``await ckpt.snapshot(state, step=N)`` records references and returns; the bytes are copied
off the tensors in the background while the next forward and backward passes run, and then
flow down a chain of tiers (host memory, local files, Zarr on a parallel file system or S3).
See ``docs/index.md``.
"""

from ._checkpointer.facades import Checkpointer, SyncCheckpointer
from ._checkpointer.handle import SnapshotHandle
from ._distributed.preemption import DrainReport
from ._engine.flight import SnapshotStats
from ._errors import (
    CheckpointerClosedError,
    ConfigurationError,
    CoordinationError,
    CorruptionError,
    DeadlineExceededError,
    ForeignLocationError,
    ImmutabilityViolationError,
    InvalidTransitionError,
    LazyCkptError,
    LocationInUseError,
    SnapshotFailedError,
    SnapshotInFlightError,
    SnapshotNotFoundError,
    SnapshotSkippedError,
    SnapshotSkippedWarning,
    StateMismatchError,
    TierBrokenError,
    TierClosedError,
    TierError,
    TierFullError,
    TierSkippedError,
    UnsupportedStateError,
)
from ._format.entries import Segment, ShardMeta, TensorMeta
from ._format.manifest import FORMAT_VERSION, LayoutOptions, Manifest
from ._format.walk import Stateful
from ._metrics import (
    LOG_FORMAT,
    StepTierAdapter,
    StepTierFilter,
    export_prometheus,
    install_log_context,
)
from ._options import Cadence, CheckpointerOptions
from ._restore.keys import strip_prefix
from ._restore.reshard import Replicated
from ._restore.verify import VerifyReport
from ._tiering.arena import ArenaStats, Block, HostArena
from ._tiering.interface import (
    ENTRY_POINT_GROUP,
    KeepBest,
    Retention,
    StepInfo,
    SupportsStaging,
    Tier,
    available_tiers,
    load_tier,
    translate_os_error,
)
from ._tiering.states import ShardState, TierLevel

__version__ = "0.1.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "FORMAT_VERSION",
    "LOG_FORMAT",
    "ArenaStats",
    "Block",
    "Cadence",
    "Checkpointer",
    "CheckpointerClosedError",
    "CheckpointerOptions",
    "ConfigurationError",
    "CoordinationError",
    "CorruptionError",
    "DeadlineExceededError",
    "DrainReport",
    "ForeignLocationError",
    "HostArena",
    "ImmutabilityViolationError",
    "InvalidTransitionError",
    "KeepBest",
    "LayoutOptions",
    "LazyCkptError",
    "LocationInUseError",
    "Manifest",
    "Replicated",
    "Retention",
    "Segment",
    "ShardMeta",
    "ShardState",
    "SnapshotFailedError",
    "SnapshotHandle",
    "SnapshotInFlightError",
    "SnapshotNotFoundError",
    "SnapshotSkippedError",
    "SnapshotSkippedWarning",
    "SnapshotStats",
    "StateMismatchError",
    "Stateful",
    "StepInfo",
    "StepTierAdapter",
    "StepTierFilter",
    "SupportsStaging",
    "SyncCheckpointer",
    "TensorMeta",
    "Tier",
    "TierBrokenError",
    "TierClosedError",
    "TierError",
    "TierFullError",
    "TierLevel",
    "TierSkippedError",
    "UnsupportedStateError",
    "VerifyReport",
    "__version__",
    "available_tiers",
    "export_prometheus",
    "install_log_context",
    "load_tier",
    "strip_prefix",
    "translate_os_error",
]
