"""Recovery time: from a restarted process to its first optimizer step.

    python bench/recovery.py                  # about two minutes on 2 CPUs
    python bench/recovery.py --model-mib 16 --rounds 1     # a quick look

A model of ``--model-mib`` MiB (fp32 MLP) with AdamW, whose state is twice the model, is
trained one step and checkpointed once through a chain of a node-local ``FileTier`` and a
"parallel file system" tier (a ``FileTier`` behind a throttle: ``--pfs-mib-s`` MiB/s per
process, shared by its concurrent reads, and ``--pfs-latency-ms`` per call, a model of a shared PFS under load; this
machine has none), and once with ``torch.distributed.checkpoint.save``. Then each case
runs in a fresh process, as a restarted job does:

- ``local eager`` / ``local lazy``: the restarted job's chain is host, local, PFS; the host
  tier is empty, the local tier survived, so the restore reads it (eager or
  ``lazy=True``);
- ``pfs eager`` / ``pfs lazy``: the node was replaced, the local copy is gone: the
  restore reads the PFS tier;
- ``dcp.load``: ``torch.distributed.checkpoint.load`` from the local directory, then
  ``set_state_dict``.

With ``--peers`` it measures peer replicas instead (``tiers.PeerTier``): a job of 2 ranks on
2 simulated nodes (gloo and the replica traffic on loopback) checkpoints once through host,
local, peer and the throttled PFS tier; then each case restarts the whole job, and rank 0
(node "a") is measured:

- ``local eager``: nothing lost; rank 0 reads its local tier;
- ``peer eager`` / ``peer lazy``: node "a" was replaced (rank 0's local tier and replica
  directory are new, empty ones): rank 0 reads its shards from rank 1's replica;
- ``pfs eager`` / ``pfs lazy``: node "a" replaced and node "b"'s replicas gone too: rank 0
  reads the PFS tier.

``--peer-loopback`` measures the peer tier's read path alone: both ranks' tiers in one
process, ``--model-mib`` MiB written to the holder and read back three times (MiB/s).

Each case reports: process start to first optimizer step (``start_to_step``, which includes
importing torch), and from the restore call: to its return, to the end of the first
forward and backward pass (``to_forward``), and to the end of the first optimizer step
(``to_step``). Cases alternate in order between rounds. The page cache is not dropped:
the local tier reads from memory, as a tmpfs one would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CASES = ["local eager", "local lazy", "pfs eager", "pfs lazy", "dcp.load"]
PEER_CASES = ["local eager", "peer eager", "peer lazy", "pfs eager", "pfs lazy"]


def build(model_mib: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    width = 1024
    layers = max(1, model_mib * (1 << 20) // (4 * width * width))
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: Any, optim: Any, forward_done: list[float] | None = None) -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1024, generator=g)
    optim.zero_grad()
    torch.autograd.backward(model(x).square().mean())
    if forward_done is not None:
        forward_done.append(time.perf_counter())
    optim.step()


def chain(root: Path, args: argparse.Namespace, with_local: bool) -> list[Any]:
    import asyncio

    from lazyckpt import TierLevel
    from lazyckpt.testing import FaultyTier
    from tiers import FileTier, HostMemoryTier

    class ThrottledTier(FaultyTier):
        """Reads at ``--pfs-mib-s`` MiB/s in all (concurrent reads share it) with
        ``--pfs-latency-ms`` per call."""

        free_at = 0.0  # when the link is free again (engine loop time)

        async def read_shard(self, manifest: Any, shard: Any, out: memoryview) -> None:
            now = asyncio.get_running_loop().time()
            self.free_at = max(now, self.free_at) + len(out) / (args.pfs_mib_s * (1 << 20))
            await asyncio.sleep(self.free_at - now)
            await super().read_shard(manifest, shard, out)

    pfs = ThrottledTier(FileTier(root / "pfs", name="pfs"))
    pfs.delay_s = args.pfs_latency_ms / 1000
    pfs.level = TierLevel.PFS  # a shared file system, behind the local tier
    tiers: list[Any] = [HostMemoryTier(32 << 20)]
    if with_local:
        tiers.append(FileTier(root / "local", name="local"))
    return [*tiers, pfs]


def peer_chain(root: Path, args: argparse.Namespace, rank: int, case: str, run: str) -> list[Any]:
    """The chain of rank ``rank`` (node "a" for rank 0, "b" for rank 1) in a peer case; a
    replaced node's directories are new, empty ones (``run`` names them)."""
    import asyncio

    from lazyckpt import Manifest, ShardMeta, TierLevel
    from tiers import FileTier, HostMemoryTier, PeerTier

    class ThrottledFileTier(FileTier):
        """The PFS model of :func:`chain`, as a FileTier (several ranks commit through it)."""

        level = TierLevel.PFS
        free_at = 0.0

        async def read_manifest(self, step: int) -> Manifest:
            await asyncio.sleep(args.pfs_latency_ms / 1000)
            return await super().read_manifest(step)

        async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
            now = asyncio.get_running_loop().time()
            self.free_at = max(now, self.free_at) + len(out) / (args.pfs_mib_s * (1 << 20))
            await asyncio.sleep(self.free_at - now + args.pfs_latency_ms / 1000)
            await super().read_shard(manifest, shard, out)

    node = "a" if rank == 0 else "b"
    local, peer = root / f"node-{node}" / "local", root / f"node-{node}" / "peer"
    fresh = root / "replaced" / run
    if node == "a" and case.split()[0] in ("peer", "pfs"):
        local, peer = fresh / "local", fresh / "peer"
    if node == "b" and case.split()[0] == "pfs":
        peer = fresh / "peer-b"
    return [
        HostMemoryTier(32 << 20),
        FileTier(local, name="local"),
        PeerTier(peer, node=node, address="127.0.0.1", name="peer"),
        ThrottledFileTier(root / "pfs", name="pfs"),
    ]


def peer_rank(root: Path, case: str, started: float, rank: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rank of a 2-rank job: ``setup`` checkpoints once; a case restores and steps."""
    import torch.distributed as dist

    import lazyckpt

    dist.init_process_group("gloo")
    try:
        model, optim = build(args.model_mib)
        if case == "setup":
            train_step(model, optim)
            with lazyckpt.SyncCheckpointer(peer_chain(root, args, rank, case, ""), shard_size=8 << 20) as ckpt:
                ckpt.snapshot({"model": model, "optim": optim}, step=1).wait()
            return {"model_bytes": sum(p.numel() * 4 for p in model.parameters())}
        forward: list[float] = []
        t0 = time.perf_counter()
        tiers = peer_chain(root, args, rank, case, f"{case.replace(' ', '-')}-{started}")
        with lazyckpt.SyncCheckpointer(tiers, shard_size=8 << 20) as ckpt:
            ckpt.guard(optim)
            opened = time.perf_counter()
            ckpt.restore(1, into={"model": model, "optim": optim}, lazy=case.endswith("lazy"))
            returned = time.perf_counter()
            train_step(model, optim, forward)
            stepped = time.perf_counter()
            dist.barrier()  # the peer keeps serving until every rank is through
            served = dict(tiers[2].served)
        return {
            "start_to_step": time.time() - started - (time.perf_counter() - stepped),
            "open": opened - t0,
            "restore_returned": returned - t0,
            "to_forward": forward[0] - t0,
            "to_step": stepped - t0,
            "restore_only": returned - opened,
            "restore_to_step": stepped - opened,
            "served_reads": served.get("read", 0),
        }
    finally:
        dist.destroy_process_group()


def run_peer_job(root: Path, case: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    common = [
        "--model-mib", str(args.model_mib),
        "--pfs-mib-s", str(args.pfs_mib_s),
        "--pfs-latency-ms", str(args.pfs_latency_ms),
    ]
    started = time.time()
    procs = []
    for rank in range(2):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(subprocess.Popen(
            [sys.executable, __file__, *common, "--peer-child", str(root), case, repr(started), str(rank)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        ))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            if p.returncode:
                raise SystemExit(f"{case}: {err[-3000:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def peer_main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="lazyckpt-recovery-peers-"))
    try:
        model_bytes = run_peer_job(root, "setup", args)[0]["model_bytes"]
        results: dict[str, list[dict[str, float]]] = {c: [] for c in PEER_CASES}
        for r in range(args.rounds):
            order = PEER_CASES[r % len(PEER_CASES):] + PEER_CASES[: r % len(PEER_CASES)]
            for case in order:
                rank0, rank1 = run_peer_job(root, case, args)
                rank0["rank1_served_reads"] = rank1["served_reads"]
                results[case].append(rank0)
                print(case, rank0, flush=True)
        summary = {
            "ranks": 2,
            "model_bytes": model_bytes,
            "state_bytes": model_bytes * 3,
            "pfs_mib_s": args.pfs_mib_s,
            "pfs_latency_ms": args.pfs_latency_ms,
            "rounds": args.rounds,
            "median": {
                case: {k: sorted(x[k] for x in runs)[len(runs) // 2] for k in runs[0]}
                for case, runs in results.items()
            },
            "runs": results,
        }
        print(json.dumps(summary["median"], indent=1))
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def peer_loopback(args: argparse.Namespace) -> None:
    """The peer tier's read path alone: rank 0's and rank 1's tiers in one process and one
    loop (no other rank, no throttle), ``--model-mib`` MiB written to rank 1, then read back
    three times; MiB/s of each read."""
    import asyncio

    from lazyckpt.tier import Exchange
    from tiers import PeerTier

    async def run(root: Path) -> list[float]:
        tiers = [PeerTier(root / n, node=n, address="127.0.0.1", linger=1.0) for n in "ab"]
        rounds: list[dict[int, Any]] = [{}, {}]
        ready = [asyncio.Event(), asyncio.Event()]

        def exchange(rank: int) -> Exchange:
            calls = [0]

            async def call(value: Any) -> list[Any]:
                i = calls[0]
                calls[0] += 1
                rounds[i][rank] = value
                if len(rounds[i]) == 2:
                    ready[i].set()
                await ready[i].wait()
                return [rounds[i][0], rounds[i][1]]

            return call

        for rank, tier in enumerate(tiers):
            tier.bind(rank, 2)
            await tier.open()
        await asyncio.gather(*(t.rendezvous(exchange(r)) for r, t in enumerate(tiers)))
        import dataclasses

        import torch

        from lazyckpt.testing._oracle import build_snapshot

        numel = (args.model_mib << 20) // 4
        state = {"w": torch.randn(numel, generator=torch.Generator().manual_seed(0))}
        manifest, payloads = build_snapshot(1, state, shard_size=8 << 20)
        manifest = dataclasses.replace(manifest, rank=0, world_size=2)
        shards = manifest.shards
        owner = tiers[0]
        await owner.begin(manifest)
        for s, payload in zip(shards, payloads, strict=True):
            await owner.put_shard(manifest, s, memoryview(payload))
        await owner.commit(manifest)
        await owner.commit_global(1, 2)
        outs = [bytearray(s.length) for s in shards]
        rates = []
        for _ in range(3):
            t0 = time.perf_counter()
            await asyncio.gather(*(
                owner.read_shard(manifest, s, memoryview(o)) for s, o in zip(shards, outs, strict=True)
            ))
            rates.append(args.model_mib / (time.perf_counter() - t0))
        assert [bytes(o) for o in outs] == payloads
        await asyncio.gather(*(t.aclose() for t in tiers))
        return rates

    root = Path(tempfile.mkdtemp(prefix="lazyckpt-peer-loopback-"))
    try:
        print(json.dumps({"mib": args.model_mib, "read_mib_s": asyncio.run(run(root))}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def setup(root: Path, args: argparse.Namespace) -> int:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import lazyckpt

    model, optim = build(args.model_mib)
    train_step(model, optim)
    tiers = chain(root, args, with_local=True)
    tiers[-1].delay_s = 0.0
    with lazyckpt.SyncCheckpointer(tiers, shard_size=8 << 20) as ckpt:
        ckpt.snapshot({"model": model, "optim": optim}, step=1).wait()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "dcp"))
    return sum(p.numel() * 4 for p in model.parameters())


def child(root: Path, case: str, started: float, args: argparse.Namespace) -> dict[str, float]:
    """One restarted process: restore, first forward/backward, first step."""
    import lazyckpt

    model, optim = build(args.model_mib)
    forward: list[float] = []
    t0 = time.perf_counter()
    if case == "dcp.load":
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        model_sd, optim_sd = get_state_dict(model, optim)
        dcp_load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(root / "dcp"))
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        returned = time.perf_counter()
        train_step(model, optim, forward)
    else:
        where, mode = case.split()
        tiers = chain(root, args, with_local=where == "local")
        with lazyckpt.SyncCheckpointer(tiers, shard_size=8 << 20) as ckpt:
            ckpt.guard(optim)
            ckpt.restore(1, into={"model": model, "optim": optim}, lazy=mode == "lazy")
            returned = time.perf_counter()
            train_step(model, optim, forward)
    stepped = time.perf_counter()
    return {
        "start_to_step": time.time() - started - (time.perf_counter() - stepped),
        "restore_returned": returned - t0,
        "to_forward": forward[0] - t0,
        "to_step": stepped - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pfs-mib-s", type=float, default=400.0)
    parser.add_argument("--pfs-latency-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--peers", action="store_true", help="peer replicas: 2 ranks on 2 simulated nodes")
    parser.add_argument("--peer-loopback", action="store_true", help="the peer read path alone, one process")
    parser.add_argument("--child", nargs=3, metavar=("ROOT", "CASE", "STARTED"), help=argparse.SUPPRESS)
    parser.add_argument("--peer-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_child:
        root, case, started, rank = args.peer_child
        print(json.dumps(peer_rank(Path(root), case, float(started), int(rank), args)))
        return
    if args.peer_loopback:
        peer_loopback(args)
        return
    if args.peers:
        peer_main(args)
        return
    if args.child:
        root, case, started = args.child
        print(json.dumps(child(Path(root), case, float(started), args)))
        return

    root = Path(tempfile.mkdtemp(prefix="lazyckpt-recovery-"))
    try:
        model_bytes = setup(root, args)
        results: dict[str, list[dict[str, float]]] = {c: [] for c in CASES}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        for r in range(args.rounds):
            order = CASES[r % len(CASES):] + CASES[: r % len(CASES)]
            for case in order:
                common = [
                    "--model-mib", str(args.model_mib),
                    "--pfs-mib-s", str(args.pfs_mib_s),
                    "--pfs-latency-ms", str(args.pfs_latency_ms),
                ]
                started = time.time()
                out = subprocess.run(
                    [sys.executable, __file__, *common, "--child", str(root), case, repr(started)],
                    capture_output=True, text=True, env=env, timeout=600, check=False,
                )
                if out.returncode:
                    raise SystemExit(f"{case}: {out.stderr[-3000:]}")
                results[case].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(case, results[case][-1], flush=True)
        summary = {
            "model_bytes": model_bytes,
            "state_bytes": model_bytes * 3,
            "pfs_mib_s": args.pfs_mib_s,
            "pfs_latency_ms": args.pfs_latency_ms,
            "rounds": args.rounds,
            "median": {
                case: {k: sorted(x[k] for x in runs)[len(runs) // 2] for k in runs[0]}
                for case, runs in results.items()
            },
            "runs": results,
        }
        print(json.dumps(summary["median"], indent=1))
        if args.out is not None:
            args.out.write_text(json.dumps(summary, indent=1) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
