"""ZarrTier on a real S3 server (SeaweedFS on loopback): what a mock cannot show.

A writer that stalls past its lease while another takes the location over, a writer killed
mid-upload, a server restarted mid-upload, credentials the server refuses, a server that
ignores conditional writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from obstore.store import S3Store
from zarr.storage import ObjectStore

from lazyckpt import ConfigurationError, SyncCheckpointer, TierBrokenError
from tiers import ZarrTier

sys.path.insert(0, str(Path(__file__).parent))
from helpers.s3_writer_child import LOST, state
from helpers.seaweed import (
    SeaweedHandle,
    SeaweedLocation,
    seaweed,
    seaweed_handle,
    seaweed_server,
    step_group,
)

__all__ = ["seaweed", "seaweed_handle", "seaweed_server"]  # the fixtures, imported for pytest

pytestmark = pytest.mark.s3

CHILD = Path(__file__).parent / "helpers" / "s3_writer_child.py"


def _writer(loc: SeaweedLocation, name: str, first: int, steps: int, lease: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [
            sys.executable, str(CHILD), loc.url, json.dumps(loc.server.tier_options()), name,
            str(first), str(steps), str(lease),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first line of ``proc``'s output starting with ``prefix``, within ``timeout``."""
    assert proc.stdout is not None
    found: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(line.strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, f"no {prefix!r} line from the writer within {timeout} s"
    return found[0]


def _plain_zarr(loc: SeaweedLocation, step: int) -> dict[str, np.ndarray]:
    """A committed step's tensors as plain zarr reads them (no lazyckpt code)."""
    s = loc.server
    backend = S3Store(
        s.bucket,
        prefix=loc.prefix,
        config={
            "endpoint": s.endpoint,
            "region": s.region,
            "access_key_id": s.access_key_id,
            "secret_access_key": s.secret_access_key,
            "virtual_hosted_style_request": False,
        },
        client_options={"allow_http": True},
    )
    root = zarr.open_group(ObjectStore(backend, read_only=True), mode="r")
    snap = root[step_group({"attributes": dict(root.attrs)}, step)]
    out = {}
    for key in [f"layer{i}.weight" for i in range(6)]:
        out[key] = np.asarray(snap[f"tensors/{key}"][:])
    return out


@pytest.mark.slow
def test_a_stale_writer_damages_nothing_the_taker_commits(seaweed: SeaweedLocation) -> None:
    """Writer D is stopped (SIGSTOP) while it writes, its lease runs out, writer E takes the
    location over and writes other data under the same step numbers, then D runs on
    (SIGCONT). D must stop without touching anything E committed: every committed step
    restores bit for bit, through lazyckpt and through plain zarr."""
    lease = 3.0
    d = _writer(seaweed, "D", 0, 0, lease)
    try:
        _wait_for_line(d, "committed 2", 120)
        time.sleep(0.05)  # into the upload of the next step
        os.kill(d.pid, signal.SIGSTOP)
        time.sleep(lease + 1.5)  # D's lease runs out while it is stopped
        tier = ZarrTier(seaweed.url, lease_seconds=30, **seaweed.server.tier_options())
        with SyncCheckpointer([tier], shard_size=1 << 20) as ckpt:
            from_d = ckpt.steps()
            first = (from_d[-1] + 1) if from_d else 0
            # E writes the step D was writing when it stopped, and the next ones
            written = list(range(first, first + 3))
            for step in written[:1]:
                ckpt.snapshot(state("E", step), step=step).wait()
            os.kill(d.pid, signal.SIGCONT)  # D runs on: its uploads land, it tries to go on
            for step in written[1:]:
                ckpt.snapshot(state("E", step), step=step).wait()
            out, err = d.communicate(timeout=120)
            assert d.returncode == LOST, (d.returncode, out[-500:], err[-2000:])
            later = first + 3
            ckpt.snapshot(state("E", later), step=later).wait()
            written.append(later)
            assert ckpt.steps() == [*from_d, *written]
            for step in ckpt.steps():
                name = "E" if step in written else "D"
                restored = ckpt.restore(step=step)
                for key, want in state(name, step).items():
                    assert torch.equal(restored[key], want), (step, key)
        for step in [*from_d, *written]:
            name = "E" if step in written else "D"
            plain = _plain_zarr(seaweed, step)
            for key, got in plain.items():
                assert np.array_equal(got, state(name, step)[key].numpy()), (step, key)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.pid, signal.SIGCONT)
            d.kill()
        d.communicate(timeout=30)


@pytest.mark.slow
def test_a_writer_killed_mid_upload_leaves_no_unfinished_upload(
    seaweed: SeaweedLocation,
) -> None:
    """Chunks over 5 MiB went up as multipart uploads, and a killed writer left their parts
    behind, invisible to listings; every object now goes up in one PUT."""
    script = (
        "import sys, torch, json\n"
        "from lazyckpt import SyncCheckpointer\n"
        "from tiers import ZarrTier\n"
        "t = ZarrTier(sys.argv[1], **json.loads(sys.argv[2]))\n"
        "with SyncCheckpointer([t], shard_size=16 << 20) as c:\n"
        "    for step in range(100):\n"
        "        c.snapshot({'w': torch.randn(4096, 4096)}, step=step).wait()\n"
        "        print('committed', step, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, seaweed.url, json.dumps(seaweed.server.tier_options())],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        _wait_for_line(proc, "committed 0", 120)
        time.sleep(0.3)  # mid-upload of the next 64 MiB step (chunks of 16 MiB)
    finally:
        proc.kill()
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert seaweed.server.multipart_uploads(seaweed.prefix + "/") == []
    # and what was committed reads fine beside the dead writer's lease
    tier = ZarrTier(seaweed.url, readonly=True, **seaweed.server.tier_options())
    with SyncCheckpointer([tier]) as ckpt:
        assert ckpt.steps()[:1] == [0]


@pytest.mark.slow
def test_a_server_restart_mid_upload_is_ridden_out(seaweed_handle: SeaweedHandle) -> None:
    """The default retries give up in under a second; a server gone for a few seconds in
    the middle of an upload must cost time, not the snapshot."""
    info = seaweed_handle.info
    url = f"s3://{info.bucket}/restart"
    state_ = {f"w{i}": torch.randn(1024, 1024) for i in range(24)}  # 96 MiB: a few seconds
    tier = ZarrTier(url, **info.tier_options())
    with SyncCheckpointer([tier], shard_size=4 << 20) as ckpt:
        handle = ckpt.snapshot(state_, step=1)
        time.sleep(0.5)
        seaweed_handle.restart(crash=True, down_seconds=4)
        handle.wait()
        restored = ckpt.restore(step=1)
    for key, want in state_.items():
        assert torch.equal(restored[key], want), key


def test_wrong_credentials_say_what_the_server_answered(seaweed: SeaweedLocation) -> None:
    options: dict[str, Any] = seaweed.server.tier_options()
    wrong = ZarrTier(seaweed.url, **{**options, "secret_access_key": "nope"})
    with pytest.raises(TierBrokenError, match="SignatureDoesNotMatch") as info, SyncCheckpointer([wrong]):
        pass
    assert options["secret_access_key"] not in str(info.value)
    unknown = ZarrTier(seaweed.url, **{**options, "access_key_id": "AKIDNOBODY"})
    with pytest.raises(TierBrokenError, match="InvalidAccessKeyId"), SyncCheckpointer([unknown]):
        pass


def test_no_credentials_is_said_at_once(
    seaweed: SeaweedLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_WEB_IDENTITY_TOKEN_FILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(var, raising=False)
    options = {k: v for k, v in seaweed.server.tier_options().items()
               if k not in ("access_key_id", "secret_access_key")}
    with pytest.raises(ConfigurationError, match=r"no credentials found for s3://.*AWS_ACCESS_KEY_ID"):
        ZarrTier(seaweed.url, **options)
    with pytest.raises(ConfigurationError, match="secret_access_key is not"):
        ZarrTier(seaweed.url, access_key_id="AKID", **options)


def test_a_server_that_ignores_conditional_writes_is_refused(
    seaweed: SeaweedLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a mock can make this server ignore If-None-Match: the probe's second create
    goes out without its condition, as a server that drops it would take it."""
    import obstore

    real = obstore.put_async

    def ignoring(store: Any, path: str, data: Any, **kwargs: Any) -> Any:
        if ".lazyckpt-probe-" in path:
            kwargs.pop("mode", None)
        return real(store, path, data, **kwargs)

    monkeypatch.setattr(obstore, "put_async", ignoring)
    tier = ZarrTier(seaweed.url, **seaweed.server.tier_options())
    with pytest.raises(ConfigurationError, match="does not honour conditional writes"), SyncCheckpointer([tier]):
        pass
    assert not [k for k in seaweed.server.keys(seaweed.prefix + '/') if "probe" in k]
    tier = ZarrTier(seaweed.url, require_conditional_writes=False, **seaweed.server.tier_options())
    with SyncCheckpointer([tier]) as ckpt:
        ckpt.snapshot({"x": torch.ones(3)}, step=1).wait()
        assert ckpt.steps() == [1]


def test_the_real_server_honours_the_probe(seaweed: SeaweedLocation) -> None:
    tier = ZarrTier(seaweed.url, **seaweed.server.tier_options())
    with SyncCheckpointer([tier]) as ckpt:
        ckpt.snapshot({"x": torch.arange(4.0)}, step=3).wait()
    assert not [k for k in seaweed.server.keys(seaweed.prefix + '/') if "probe" in k]
    index = seaweed.index()
    group = step_group(index, 3)
    assert group.startswith("step-000000000003-")  # a group of this writer's own
    assert any(k.startswith(f"{seaweed.prefix}/{group}/") for k in seaweed.server.keys(seaweed.prefix + '/'))


def test_unfinished_uploads_are_shown_and_aborted(
    seaweed: SeaweedLocation, run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uploads other tools or earlier versions left unfinished: ``ls`` shows their count and
    bytes, ``gc --dry-run`` says it would abort them, ``gc`` (a writer's open) aborts them."""
    options = seaweed.server.tier_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_REGION", options["region"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    with SyncCheckpointer([ZarrTier(seaweed.url, **options)]) as ckpt:
        ckpt.snapshot({"x": torch.arange(8.0)}, step=1).wait()
    client = seaweed.server.client()
    for i in range(2):
        key = f"{seaweed.prefix}/step-000000000002/tensors/w/c/{i}/0"
        upload = client.create_multipart_upload(Bucket=seaweed.server.bucket, Key=key)
        client.upload_part(
            Bucket=seaweed.server.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1,
            Body=b"x" * (5 << 20),
        )
    code, out, err = run("ls", seaweed.url)
    assert code == 0, err
    assert "2 unfinished multipart uploads holding 10.0 MiB" in err
    code, out, err = run("gc", seaweed.url, "--keep-last", "5", "--dry-run")
    assert code == 0, err
    assert "would abort 2 unfinished multipart uploads" in out
    assert len(seaweed.server.multipart_uploads(seaweed.prefix + "/")) == 2
    code, out, err = run("gc", seaweed.url, "--keep-last", "5")
    assert code == 0, err
    assert "aborted 2 unfinished multipart uploads holding 10.0 MiB" in out
    assert seaweed.server.multipart_uploads(seaweed.prefix + "/") == []
    code, out, err = run("ls", seaweed.url)
    assert "unfinished" not in err
