"""Replicas in a peer's memory: a replaced node restores from its peers, not from the PFS.

Every rank's checkpoint goes to its node-local disk, then (``PeerTier``) to a rank on
another node, which keeps it in its own memory (a tmpfs directory) or on its local disk,
then to the shared file system. When a node dies and the job restarts on a new one, the
new node's ranks find no local copy; they read their shards from the peers' replicas,
each checked against the manifest's crc32c, and touch the shared file system only for a
shard no peer has a good copy of.

Run it as ``python examples/peer_replicas.py [--ranks-per-node 2]``: it plays a job of 4
ranks on 2 nodes on this machine (gloo on loopback; ``LAZYCKPT_NODE`` tells the simulated nodes apart, as
torchrun's ``GROUP_RANK`` or the host name do on a cluster). The job trains and
checkpoints; then node "a" is replaced (its local disk and memory wiped), the job restarts,
restores the newest step, and checks it bit for bit against what it saved.

On a cluster the per-rank part (:func:`rank_main`) is the script, launched by torchrun on
every node, with ``PeerTier("/dev/shm/<job>-replicas")`` for replicas in memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import lazyckpt
from tiers import FileTier, HostMemoryTier, PeerTier, ZarrTier

NODES = ("a", "b")


def make_model(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
    optim.zero_grad()
    torch.autograd.backward(torch.nn.functional.mse_loss(model(x), y))
    optim.step()


def chain(root: Path, node: str) -> list[lazyckpt.Tier]:
    here = root / f"node-{node}"  # what lives on this node: its disk, its memory
    return [
        HostMemoryTier(16 << 20),
        FileTier(here / "nvme", name="local", keep_last=2),
        PeerTier(here / "shm", name="peer", replicas=1, keep_last=2, address="127.0.0.1"),
        ZarrTier(root / "pfs", name="pfs"),  # the shared file system, every rank sees it
    ]


def rank_main(rank: int, world: int, root: Path, phase: str, port: int) -> None:
    node = NODES[rank * len(NODES) // world]  # consecutive ranks share a node, as torchrun
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        LAZYCKPT_NODE=node, GLOO_SOCKET_IFNAME="lo",
    )
    dist.init_process_group("gloo")
    model, optim = make_model(rank)
    tiers = chain(root, node)
    peer = tiers[2]
    assert isinstance(peer, PeerTier)
    report: dict[str, Any] = {"rank": rank, "node": node}
    with lazyckpt.SyncCheckpointer(tiers) as ckpt:
        ckpt.guard(optim)
        if phase == "train":
            for step in range(1, 7):
                train_step(model, optim, rank, step)
                if step % 2 == 0:
                    ckpt.snapshot({"model": model, "optim": optim, "step": step}, step=step)
            ckpt.drain()
            torch.save({"model": model.state_dict(), "optim": optim.state_dict()},
                       root / f"expected-rank{rank}.pt")
        else:
            train_step(model, optim, rank, 0)  # the optimizer's state exists: restore into it
            state = {"model": model, "optim": optim, "step": 0}
            t0 = time.perf_counter()
            ckpt.restore(into=state)
            report["restore_s"] = time.perf_counter() - t0
            report["step"] = state["step"]
            expected = torch.load(root / f"expected-rank{rank}.pt")
            report["bit_exact"] = all(
                torch.equal(a, b) for a, b in zip(
                    _tensors(expected), _tensors({"model": model.state_dict(), "optim": optim.state_dict()}),
                    strict=True,
                )
            )
        report["holds_replicas_of"] = peer.holding
        dist.barrier()  # everyone has read what it needed from this rank's replicas
        report["shard_reads_served"] = peer.served.get("read", 0)
    (root / f"report-{phase}-rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(root: Path, phase: str, world: int) -> list[dict[str, Any]]:
    """Start the job's ranks (as torchrun would) and wait for all of them."""
    port = str(free_port())
    ranks = [
        subprocess.Popen([sys.executable, __file__, str(r), str(world), str(root), phase, port])
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=300) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        sys.exit(f"the {phase} job failed: exit codes {codes}")
    return [json.loads((root / f"report-{phase}-rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-node", type=int, default=2)
    world = len(NODES) * parser.parse_args().ranks_per_node
    root = Path(tempfile.mkdtemp(prefix="lazyckpt-peers-"))
    try:
        print(f"training {world} ranks on nodes a and b, a snapshot every 2 steps")
        for r in run_job(root, "train", world):
            print(f"  rank {r['rank']} (node {r['node']}) holds replicas of rank(s) {r['holds_replicas_of']}")
        print("node a is replaced: its local disk and its memory are empty")
        shutil.rmtree(root / "node-a")
        reports = run_job(root, "resume", world)
        for r in reports:
            print(
                f"  rank {r['rank']} (node {r['node']}) restored step {r['step']} in "
                f"{r['restore_s']:.2f} s; it served {r['shard_reads_served']} shard reads to its peers"
            )
        if not all(r["bit_exact"] for r in reports):
            sys.exit("a restored state differs from the saved one")
        print("every rank restored bit for bit; node a's ranks read their shards from node b's replicas")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 6:  # one rank of the job
        rank_main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    else:
        main()
