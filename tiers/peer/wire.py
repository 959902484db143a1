"""The peer tier's wire protocol: frames on a TCP connection, and the kinds of error a
holder's refusal carries (see ``peer.tier`` for how the ranks talk).

A frame is a 12-byte prefix (header bytes, payload bytes), a JSON header, then the payload.
The sockets are driven with the loop's ``sock_*`` calls, not streams, so a payload moves
between the kernel and its final buffer with no copy in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from lazyckpt.tier import (
    CorruptionError,
    LazyCkptError,
    SnapshotNotFoundError,
    TierBrokenError,
    TierFullError,
)

_FRAME = struct.Struct("!IQ")  # header bytes, payload bytes: 12 bytes
_MAX_HEADER = 1 << 16
_MAX_PAYLOAD = 1 << 34  # a manifest or one shard; the real bound is checked per request
_ERRORS: dict[str, Callable[[str, str], LazyCkptError]] = {
    "not_found": lambda msg, tier: SnapshotNotFoundError(msg),
    "corrupt": lambda msg, tier: CorruptionError(msg),
    "full": lambda msg, tier: TierFullError(msg, tier=tier),
    "broken": lambda msg, tier: TierBrokenError(msg, tier=tier),
}


def _kind(exc: LazyCkptError) -> str:
    if isinstance(exc, SnapshotNotFoundError):
        return "not_found"
    if isinstance(exc, CorruptionError):
        return "corrupt"
    if isinstance(exc, TierFullError):
        return "full"
    return "broken"


class _Conn:
    """One TCP connection, driven with the loop's ``sock_*`` calls. Frames are a 12-byte
    prefix (header bytes, payload bytes), a JSON header, then the payload."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        with contextlib.suppress(OSError):  # requests are small and answered at once
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    async def send(self, header: dict[str, Any], payload: Any = b"") -> None:
        loop = asyncio.get_running_loop()
        doc = json.dumps(header).encode()
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        await loop.sock_sendall(self.sock, _FRAME.pack(len(doc), size) + doc)
        if size:
            await loop.sock_sendall(self.sock, payload)

    async def receive_into(self, view: memoryview | bytearray) -> None:
        """Fill ``view`` exactly; EOFError if the peer closes first."""
        loop = asyncio.get_running_loop()
        view = memoryview(view).cast("B")
        done = 0
        while done < len(view):
            n = await loop.sock_recv_into(self.sock, view[done:])
            if n == 0:
                raise EOFError(f"connection closed after {done} of {len(view)} bytes")
            done += n

    async def receive(self, size: int) -> bytearray:
        buf = bytearray(size)
        if size:
            await self.receive_into(buf)
        return buf

    async def receive_header(self) -> tuple[dict[str, Any], int]:
        n, size = _FRAME.unpack(await self.receive(_FRAME.size))
        if n > _MAX_HEADER or size > _MAX_PAYLOAD:
            raise ValueError(f"a frame of {n} + {size} bytes is not lazyckpt's peer protocol")
        header = json.loads(await self.receive(n))
        if not isinstance(header, dict):
            raise ValueError("a frame whose header is not a JSON object")
        return header, size

    async def skip(self, size: int) -> None:
        """Read and drop a payload the request may not have, keeping the connection in step."""
        while size:
            size -= len(await self.receive(min(size, 1 << 20)))

def _own_address() -> str:
    """The address of this host that reaches ``MASTER_ADDR`` (a UDP socket's route: no
    packet is sent); else the host name's address."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return str(s.getsockname()[0])
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

