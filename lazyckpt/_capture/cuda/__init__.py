"""Capture on CUDA, one concern per module.

``device``: the device behind a seam (:class:`DeviceRuntime`) and the waiting primitives;
``capture``: side-stream device-to-host captures (:class:`CudaCapture`); ``guard``: the
stream guard's optimizer step pre-hook. The names are re-exported here. Restoring straight
into device tensors is restore's (``lazyckpt._restore.restore.device``), built on ``device``.
"""

from .capture import CudaCapture, PendingCapture
from .device import (
    DeviceRuntime,
    EventLike,
    InflightWindow,
    PollOptions,
    StreamLike,
    TorchCudaRuntime,
    in_pool,
    wait_for_event,
)
from .guard import GuardMode, resolve_guard_mode, stream_guard_hook

__all__ = [
    "CudaCapture",
    "DeviceRuntime",
    "EventLike",
    "GuardMode",
    "InflightWindow",
    "PendingCapture",
    "PollOptions",
    "StreamLike",
    "TorchCudaRuntime",
    "in_pool",
    "resolve_guard_mode",
    "stream_guard_hook",
    "wait_for_event",
]
