"""An S3 server for the tests: moto's server mode on 127.0.0.1, one free port, one bucket.

Import the fixtures into a test module (``from conftest_s3 import s3, s3_server``). The
server is a plain (sync) session fixture: obstore clients are not bound to an event loop,
so every test's loop can use it.
"""

from __future__ import annotations

import logging
import selectors
import socket
import struct
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

BUCKET = "lazyckpt-tests"
REGION = "us-east-1"
ACCESS_KEY_ID = "AKIDLAZYCKPTTEST"
SECRET_ACCESS_KEY = "s3cr3t-lazyckpt-never-print-me"


@dataclass(frozen=True)
class S3Server:
    """Where the test server listens and how to reach it."""

    endpoint: str
    bucket: str = BUCKET

    def client(self) -> Any:
        """A boto3 client: the oracle that reads the bucket without lazyckpt's code."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY_ID,
            aws_secret_access_key=SECRET_ACCESS_KEY,
        )

    def tier_options(self) -> dict[str, Any]:
        """ZarrTier keyword arguments for this server."""
        return {
            "endpoint_url": self.endpoint,
            "region": REGION,
            "access_key_id": ACCESS_KEY_ID,
            "secret_access_key": SECRET_ACCESS_KEY,
            "allow_http": True,
        }

    def keys(self, prefix: str) -> list[str]:
        """Every object key under ``prefix`` (paged, bounded by the bucket's size)."""
        client = self.client()
        keys: list[str] = []
        token: dict[str, str] = {}
        while True:
            page = client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, **token)
            keys += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            token = {"ContinuationToken": page["NextContinuationToken"]}


def start_server() -> tuple[Any, S3Server]:
    """Start a moto server on a free loopback port with the test bucket; the caller stops it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        info = S3Server(f"http://{host}:{port}")
        info.client().create_bucket(Bucket=BUCKET)
    except BaseException:
        server.stop()
        raise
    return server, info


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server for the whole session, on 127.0.0.1 only."""
    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)  # one access-log line per request drowns real output
    server, info = start_server()
    try:
        yield info
    finally:
        server.stop()
        werkzeug.setLevel(level)


@dataclass(frozen=True)
class S3Location:
    """A fresh prefix in the test bucket."""

    server: S3Server
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.server.bucket}/{self.prefix}"

    def keys(self) -> list[str]:
        """Every object key under this prefix."""
        return self.server.keys(self.prefix + "/")


@pytest.fixture
def s3(s3_server: S3Server) -> S3Location:
    """A prefix no other test uses."""
    return S3Location(s3_server, f"t-{uuid.uuid4().hex[:12]}")


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
