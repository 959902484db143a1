"""A writer process on an S3 location, for the stale-writer tests (tests/test_s3_real.py).

``python s3_writer_child.py URL OPTIONS_JSON NAME FIRST_STEP STEPS LEASE_SECONDS``: snapshots
steps FIRST_STEP, FIRST_STEP+1, ... (STEPS of them; 0: until stopped) of :func:`state`
(NAME and the step decide every byte) through a ZarrTier, printing ``committed N`` after
each. A writer that lost its location exits with status 3 and ``lost`` on its last line.
"""

from __future__ import annotations

import json
import sys
import zlib

import torch

from lazyckpt import LocationInUseError, SnapshotFailedError, SyncCheckpointer
from tiers import ZarrTier

LOST = 3


def state(name: str, step: int) -> dict[str, torch.Tensor]:
    """Six tensors of 1 MiB and one small one, each byte decided by ``name`` and ``step``."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}-{step}".encode()))
    out = {f"layer{i}.weight": torch.randn(512, 512, generator=g) for i in range(6)}
    out["bias"] = torch.randn(64, generator=g)
    return out



def main() -> int:
    url, options, name, first, steps, lease = sys.argv[1:7]
    tier = ZarrTier(url, lease_seconds=float(lease), **json.loads(options))
    try:
        with SyncCheckpointer([tier], shard_size=1 << 20) as ckpt:
            step = int(first)
            while int(steps) == 0 or step < int(first) + int(steps):
                try:
                    ckpt.snapshot(state(name, step), step=step).wait()
                except SnapshotFailedError as exc:
                    if any(isinstance(e, LocationInUseError) for e in exc.exceptions):
                        print("lost", flush=True)
                        return LOST
                    raise
                print(f"committed {step}", flush=True)
                step += 1
    except LocationInUseError:
        print("lost", flush=True)
        return LOST
    return 0


if __name__ == "__main__":
    sys.exit(main())
