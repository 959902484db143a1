"""ZarrTier on S3 (SeaweedFS on 127.0.0.1): configuration from the environment, the commit seen
from outside, retries through dropped connections, a server that goes away, secrets kept."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest_s3 import (
    ACCESS_KEY_ID,
    SECRET_ACCESS_KEY,
    DroppingProxy,
    S3Location,
    s3,
    s3_server,
)
from helpers.seaweed import SeaweedHandle, seaweed_handle

from lazyckpt import Checkpointer, SnapshotFailedError, SyncCheckpointer, TierBrokenError
from lazyckpt.testing import build_snapshot
from tiers import HostMemoryTier, ZarrTier

__all__ = ["s3", "s3_server", "seaweed_handle"]  # the fixtures, imported for pytest

SMALL = {"shard_size": 64 << 10, "pack_bytes": 4 << 10}


def _every_text(exc: BaseException) -> str:
    """The messages of an error, its causes, contexts and group members."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    texts = []
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        texts.append(f"{type(e).__name__}: {e}")
        stack += [x for x in (e.__cause__, e.__context__) if x is not None]
        if isinstance(e, BaseExceptionGroup):
            stack += list(e.exceptions)
    return "\n".join(texts)


def test_settings_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, s3: S3Location
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    tier = ZarrTier(s3.url)
    info = tier.describe()
    assert info["location"] == s3.url and info["endpoint"] == s3.server.endpoint
    assert SECRET_ACCESS_KEY not in repr(info) + repr(tier) + repr(vars(tier))
    # a keyword argument wins over its environment variable
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert ZarrTier(s3.url, endpoint_url=s3.server.endpoint).describe()["endpoint"] == (
        s3.server.endpoint
    )


async def test_environment_alone_is_enough(monkeypatch: pytest.MonkeyPatch, s3: S3Location) -> None:
    for name, value in {
        "AWS_ENDPOINT_URL": s3.server.endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "1",
    }.items():
        monkeypatch.setenv(name, value)
    state = {"w": torch.randn(200, 100), "b": torch.randn(5)}
    async with Checkpointer([ZarrTier(s3.url)], staging_bytes=1 << 20, **SMALL) as ckpt:
        await (await ckpt.snapshot(state, step=1)).committed()
        restored = await ckpt.restore()
    assert torch.equal(restored["w"], state["w"]) and torch.equal(restored["b"], state["b"])


async def test_commit_is_one_object_written_last(s3: S3Location) -> None:
    manifest, payloads = build_snapshot(3, {"w": torch.randn(100, 100), "b": torch.randn(9)})
    client = s3.server.client()

    def committed() -> list[int]:  # the oracle: the index as anyone reading S3 sees it
        body = client.get_object(Bucket=s3.server.bucket, Key=f"{s3.prefix}/zarr.json")["Body"]
        return list(json.loads(body.read())["attributes"]["lazyckpt"]["committed"])

    tier = ZarrTier(s3.url, **s3.server.tier_options())
    await tier.open()
    try:
        await tier.begin(manifest)
        for shard, data in zip(manifest.shards, payloads, strict=True):
            await tier.put_shard(manifest, shard, memoryview(data))
        assert committed() == [] and await tier.steps() == []
        await tier.commit(manifest)
        assert committed() == [3] and await tier.steps() == [3]
        keys = s3.keys()
        assert f"{s3.prefix}/{s3.group(3)}/zarr.json" in keys  # the step's commit record
        await tier.delete(3)
        remaining = s3.keys()
        lease = f"{s3.prefix}/.lazyckpt-writer-rank-00000.json"  # the writer's, while open
        assert committed() == [] and remaining == [lease, f"{s3.prefix}/zarr.json"]
    finally:
        await tier.aclose()
    assert s3.keys() == [f"{s3.prefix}/zarr.json"]  # the lease goes with the writer


async def test_dropped_connections_are_retried(s3: S3Location) -> None:
    state = {"w": torch.randn(300, 100), "b": torch.randn(10)}
    with DroppingProxy(s3.server.endpoint, drop=4) as proxy:
        options = {**s3.server.tier_options(), "endpoint_url": proxy.endpoint, "retries": 10}
        async with Checkpointer([ZarrTier(s3.url, **options)], staging_bytes=1 << 20, **SMALL) as c:
            await (await c.snapshot(state, step=1)).committed()
            restored = await c.restore()
        assert proxy.dropped == 4
    assert torch.equal(restored["w"], state["w"])


async def test_server_gone_fails_the_snapshot_not_the_training(
    caplog: pytest.LogCaptureFixture, seaweed_handle: SeaweedHandle
) -> None:
    info = seaweed_handle.info  # a server of this test's own: it crashes mid-run
    tier = ZarrTier(
        f"s3://{info.bucket}/run",
        **info.tier_options(),
        retries=1,  # one retry, a second after the first failure: it still fails quickly
        retry_timeout=1,
        connect_timeout=1,
    )
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    caplog.set_level(logging.DEBUG)
    # no engine-level retries on top of the tier's own: the failure comes quickly
    async with Checkpointer([HostMemoryTier(4 << 20), tier], retries=0, **SMALL) as ckpt:
        ckpt.guard(opt)
        await (await ckpt.snapshot({"model": model.state_dict()}, step=1)).committed()
        committed = model.weight.detach().clone()
        seaweed_handle.kill()  # SIGKILL: the server is gone, mid-run
        for step in (2, 3):  # training goes on; each snapshot still reaches the host
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            handle = await ckpt.snapshot({"model": model.state_dict()}, step=step)
            await handle.reached("host")
            with pytest.raises(SnapshotFailedError) as failure:
                await handle.committed()
            assert failure.value.tiers == ("zarr",)
            assert any(isinstance(e, TierBrokenError) for e in failure.value.exceptions)
            text = _every_text(failure.value)
            assert SECRET_ACCESS_KEY not in text and ACCESS_KEY_ID not in text
            assert "zarr" in text
        # a snapshot that failed on a durable tier is dropped from the host tier too:
        # the newest snapshot is the last one committed everywhere
        assert await ckpt.steps() == [1]
        restored = await ckpt.restore()
    assert torch.equal(restored["model"]["weight"], committed)
    assert not torch.equal(committed, model.weight.detach())  # training went on
    assert SECRET_ACCESS_KEY not in caplog.text


def test_plain_zarr_reads_from_s3(s3: S3Location) -> None:
    import zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    g = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(300, 64, generator=g).bfloat16(), "b": torch.randn(9, generator=g)}
    tier = ZarrTier(s3.url, **s3.server.tier_options())
    with SyncCheckpointer([tier], staging_bytes=1 << 20, **SMALL) as ckpt:
        ckpt.snapshot(state, step=5).wait()

    # docs/zarr.md's recipe, with the test server's settings spelled out
    backend = S3Store(
        s3.server.bucket,
        prefix=s3.prefix,
        config={
            "endpoint": s3.server.endpoint,
            "access_key_id": ACCESS_KEY_ID,
            "secret_access_key": SECRET_ACCESS_KEY,
            "region": "us-east-1",
            "virtual_hosted_style_request": False,
        },
        client_options={"allow_http": True},
    )
    root = zarr.open_group(ObjectStore(backend, read_only=True), mode="r")
    lazy = root.attrs["lazyckpt"]
    step = lazy["committed"][-1]
    # a step written on S3 may live in a group named after its writer (the index names it)
    snap = root[lazy.get("groups", {}).get(str(step), f"step-{step:012d}")]
    arr = snap["tensors/w"]
    w = torch.from_numpy(arr[:]).view(getattr(torch, arr.attrs["lazyckpt"]["dtype"]))
    assert torch.equal(w, state["w"])
    e = snap["packed"].attrs["lazyckpt"]["index"]["b"]
    b = snap["packed"][e["offset"] : e["offset"] + e["nbytes"]].view(e["data_type"])
    assert torch.equal(torch.from_numpy(b.reshape(e["shape"])), state["b"])
