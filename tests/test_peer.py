"""PeerTier: replicas of every rank's shards on ranks of other nodes.

The multi-process tests run 4 real ranks (gloo on loopback) as 2 simulated nodes ("a":
ranks 0, 1; "b": ranks 2, 3), each node with its own local tier and replica directory, all
sharing a counted "parallel file system" tier. The in-process tests drive two PeerTier
instances in one event loop through a stand-in for the rendezvous collective.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lazyckpt
from lazyckpt import ConfigurationError, CorruptionError, SnapshotNotFoundError, TierBrokenError
from lazyckpt.testing._oracle import build_snapshot
from lazyckpt.tier import SupportsRendezvous, node_identity, place_replicas
from tiers import PeerTier

WORKER = Path(__file__).parent / "helpers" / "peer_worker.py"
sys.path.insert(0, str(Path(__file__).parent))
from helpers.ranks import launch_ranks, rank_results  # noqa: E402

WORLD = 4
NODE_A, NODE_B = [0, 1], [2, 3]


# -- placement and node identity ------------------------------------------------------------


def test_placement_puts_each_rank_on_other_nodes_and_balances() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    placement = place_replicas(nodes, 2)
    for rank, holders in enumerate(placement):
        assert len(set(holders)) == 2
        assert all(nodes[h] != nodes[rank] for h in holders)
        assert len({nodes[h] for h in holders}) == 2  # two different other nodes
    held = [sum(r in hs for hs in placement) for r in range(len(nodes))]
    assert held == [2] * len(nodes)  # every rank holds exactly k replicas
    assert place_replicas(["a", "a", "b", "b"], 1) == [(2,), (3,), (0,), (1,)]


@given(
    st.lists(st.sampled_from("abcde"), min_size=2, max_size=24),
    st.integers(min_value=1, max_value=4),
)
def test_placement_never_keeps_a_replica_on_its_own_node(nodes: list[str], k: int) -> None:
    if k > len(set(nodes)) - 1:
        with pytest.raises(ConfigurationError, match="nodes"):
            place_replicas(nodes, k)
        return
    placement = place_replicas(nodes, k)
    assert placement == place_replicas(list(nodes), k)  # every rank computes the same
    for rank, holders in enumerate(placement):
        assert len({nodes[h] for h in holders}) == k
        assert nodes[rank] not in {nodes[h] for h in holders}


def test_node_identity_order() -> None:
    env = {"LAZYCKPT_NODE": "x", "GROUP_RANK": "3", "RANK": "9", "LOCAL_WORLD_SIZE": "4"}
    assert node_identity("given", env) == "given"
    assert node_identity(None, env) == "x"
    del env["LAZYCKPT_NODE"]
    assert node_identity(None, env) == "group-3"
    del env["GROUP_RANK"]
    assert node_identity(None, env) == "group-2"  # rank 9 of nodes of 4
    assert node_identity(None, {}) != ""  # the host name


async def test_a_single_process_is_refused_with_a_reason(tmp_path: Path) -> None:
    from tiers import FileTier, HostMemoryTier

    chain = [HostMemoryTier(4 << 20), FileTier(tmp_path / "f"), PeerTier(tmp_path / "p")]
    with pytest.raises(ConfigurationError, match="several ranks"):
        async with lazyckpt.Checkpointer(chain, distributed=False):
            pass
    assert isinstance(PeerTier(tmp_path / "p"), SupportsRendezvous)
    assert PeerTier(tmp_path / "p").level is lazyckpt.TierLevel.PEER


def test_the_peer_tier_registers_under_the_entry_point_group() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["lazyckpt.tiers"]["peer"] == "tiers:PeerTier"


# -- two tiers in one loop --------------------------------------------------------------------


class _Gather:
    """``all_gather`` among ``n`` coroutines of one loop: what the control group does."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.rounds: list[dict[int, Any]] = []
        self.calls = [0] * n
        self.changed = asyncio.Condition()

    def exchange(self, rank: int) -> Any:
        async def call(value: Any) -> list[Any]:
            i = self.calls[rank]
            self.calls[rank] += 1
            async with self.changed:
                while len(self.rounds) <= i:
                    self.rounds.append({})
                self.rounds[i][rank] = value
                self.changed.notify_all()
                await self.changed.wait_for(lambda: len(self.rounds[i]) == self.n)
            return [self.rounds[i][r] for r in range(self.n)]

        return call


async def _pair(root: Path, **kwargs: Any) -> list[PeerTier]:
    tiers = []
    for rank, node in enumerate(["a", "b"]):
        tier = PeerTier(root / node, node=node, address="127.0.0.1", timeout=5.0, linger=1.0, **kwargs)
        tier.bind(rank, 2)
        await tier.open()
        tiers.append(tier)
    gather = _Gather(2)
    await asyncio.gather(*(t.rendezvous(gather.exchange(t.rank)) for t in tiers))
    return tiers


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[list[PeerTier]]:
    tiers = await _pair(tmp_path)
    try:
        yield tiers
    finally:
        await asyncio.gather(*(t.aclose() for t in tiers))


def _snapshot(step: int, rank: int) -> tuple[lazyckpt.Manifest, list[bytes]]:
    g = torch.Generator().manual_seed(step)
    manifest, payloads = build_snapshot(step, {"w": torch.randn(64, 200, generator=g)})
    return replace(manifest, rank=rank, world_size=2), payloads


async def _write(tier: PeerTier, manifest: lazyckpt.Manifest, payloads: list[bytes]) -> None:
    await tier.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await tier.put_shard(manifest, shard, memoryview(data))
    await tier.commit(manifest)
    await tier.commit_global(manifest.step, 2)


async def test_a_rank_reads_back_what_its_peer_holds(pair: list[PeerTier], tmp_path: Path) -> None:
    owner, holder = pair
    assert owner.holders == (1,) and holder.holders == (0,)
    manifest, payloads = _snapshot(5, rank=0)
    assert len(manifest.shards) > 2
    await owner.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await owner.put_shard(manifest, shard, memoryview(data))
    await owner.commit(manifest)
    assert await owner.steps() == []  # this rank's part only: not committed before the record
    await owner.commit_global(5, 2)
    assert await owner.steps() == [5]
    assert await holder.steps() == []  # rank 1 wrote nothing
    # the replica is a file tier's committed step on node b, in rank 0's directory
    assert (tmp_path / "b" / "rank-00000" / "step-000000000005" / "manifest.json").exists()
    again = await owner.read_manifest(5)
    assert again.shards == manifest.shards
    for shard, data in zip(manifest.shards, payloads, strict=True):
        out = bytearray(shard.length)
        await owner.read_shard(again, shard, memoryview(out))
        assert bytes(out) == data
    await owner.delete(5)
    assert await owner.steps() == []
    with pytest.raises(SnapshotNotFoundError):
        await owner.read_manifest(5)


async def test_a_shard_of_a_step_not_yet_committed_reads_back(pair: list[PeerTier]) -> None:
    # what the engine does when the arena evicted a block before the next tier took it
    owner, _ = pair
    manifest, payloads = _snapshot(8, rank=0)
    await owner.begin(manifest)
    await owner.put_shard(manifest, manifest.shards[1], memoryview(payloads[1]))
    out = bytearray(manifest.shards[1].length)
    await owner.read_shard(manifest, manifest.shards[1], memoryview(out))
    assert bytes(out) == payloads[1]
    await owner.abort(8)
    assert await owner.steps() == []
    # and between this rank's commit and the commit record (the next tier may be behind)
    manifest, payloads = _snapshot(9, rank=0)
    await owner.begin(manifest)
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await owner.put_shard(manifest, shard, memoryview(data))
    await owner.commit(manifest)
    await owner.read_shard(manifest, manifest.shards[0], memoryview(out))
    assert bytes(out) == payloads[0]
    await owner.commit_global(9, 2)
    await owner.read_shard(manifest, manifest.shards[0], memoryview(out))
    assert bytes(out) == payloads[0]


async def test_a_shard_damaged_in_transit_is_refused(pair: list[PeerTier]) -> None:
    owner, _ = pair
    manifest, payloads = _snapshot(1, rank=0)
    await owner.begin(manifest)
    bad = bytearray(payloads[0])
    bad[7] ^= 0x10
    with pytest.raises(CorruptionError, match="damaged"):
        await owner.put_shard(manifest, manifest.shards[0], memoryview(bad))
    # the connection stays usable: the good bytes go through, the step commits
    for shard, data in zip(manifest.shards, payloads, strict=True):
        await owner.put_shard(manifest, shard, memoryview(data))
    await owner.commit(manifest)
    await owner.commit_global(1, 2)
    assert await owner.steps() == [1]


async def test_a_stranger_without_the_jobs_secret_is_dropped(pair: list[PeerTier]) -> None:
    owner, holder = pair
    manifest, payloads = _snapshot(2, rank=0)
    await _write(owner, manifest, payloads)
    assert holder.address is not None
    import socket

    from tiers.peer.tier import _Conn

    conn = _Conn(socket.socket())
    await asyncio.get_running_loop().sock_connect(conn.sock, holder.address)
    await conn.send({"op": "hello", "token": "not-the-secret", "rank": 0})
    with pytest.raises(EOFError):
        await conn.receive_header()  # closed without an answer
    conn.close()
    assert await owner.steps() == [2]  # nothing changed for the job


async def test_a_corrupt_replica_fails_the_read_as_corruption(pair: list[PeerTier], tmp_path: Path) -> None:
    owner, _ = pair
    manifest, payloads = _snapshot(3, rank=0)
    await _write(owner, manifest, payloads)
    data = tmp_path / "b" / "rank-00000" / "step-000000000003" / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(raw)
    out = bytearray(manifest.shards[0].length)
    # the only holder's bytes are handed over: the engine's check against the manifest's
    # crc32c rejects them (read_verified) and falls back to the next tier
    await owner.read_shard(manifest, manifest.shards[0], memoryview(out))
    import crc32c

    assert crc32c.crc32c(out) != manifest.shards[0].crc32c


async def test_with_two_replicas_a_damaged_copy_moves_the_read_on(tmp_path: Path) -> None:
    import crc32c

    tiers = []
    gather = _Gather(3)
    for rank, node in enumerate(["a", "b", "c"]):
        tier = PeerTier(tmp_path / node, node=node, address="127.0.0.1", replicas=2, timeout=5.0, linger=1.0)
        tier.bind(rank, 3)
        await tier.open()
        tiers.append(tier)
    try:
        await asyncio.gather(*(t.rendezvous(gather.exchange(t.rank)) for t in tiers))
        owner = tiers[0]
        assert sorted(owner.holders) == [1, 2]
        manifest, payloads = _snapshot(4, rank=0)
        manifest = replace(manifest, world_size=3)
        await owner.begin(manifest)
        for shard, data in zip(manifest.shards, payloads, strict=True):
            await owner.put_shard(manifest, shard, memoryview(data))
        await owner.commit(manifest)
        await owner.commit_global(4, 3)
        assert await owner.steps() == [4]
        first = owner._candidates(4)[0]
        node = "abc"[first]
        path = tmp_path / node / "rank-00000" / "step-000000000004" / "rank-00000.data"
        raw = bytearray(path.read_bytes())
        raw[1] ^= 0xFF
        path.write_bytes(raw)
        out = bytearray(manifest.shards[0].length)
        await owner.read_shard(manifest, manifest.shards[0], memoryview(out))
        assert crc32c.crc32c(out) == manifest.shards[0].crc32c  # from the other holder
        assert bytes(out) == payloads[0]
    finally:
        await asyncio.gather(*(t.aclose() for t in tiers))


async def test_an_unreachable_holder_is_a_tier_error_within_the_timeout(tmp_path: Path) -> None:
    owner, holder = await _pair(tmp_path)
    owner.timeout = 2.0
    try:
        await holder.aclose()  # its server is gone
        manifest, _ = _snapshot(6, rank=0)
        with pytest.raises(TierBrokenError, match="peer rank 1"):
            await owner.begin(manifest)
        assert await owner.steps() == []  # listed as nothing, and logged
        with pytest.raises(CorruptionError, match="no peer holds"):
            await owner.read_shard(manifest, manifest.shards[0], memoryview(bytearray(manifest.shards[0].length)))
    finally:
        await owner.aclose()


# -- four real ranks on two simulated nodes ---------------------------------------------------


def _launch(scenario: str, root: Path, out: Path) -> dict[int, dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    launch_ranks(WORKER, [scenario, str(root), str(out)], WORLD, timeout=200)
    return rank_results(out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four ranks snapshot steps 0..3 through host, local, peer and the shared slow tier."""
    root = tmp_path_factory.mktemp("peer") / "job"
    results = _launch("save", root, root.parent / "out-save")
    for rank, r in results.items():
        assert r["errors"] == [], (rank, r["errors"])
        assert r["steps"] == [0, 1, 2, 3]
        assert r["holders"] == [(rank + 2) % 4]
        assert r["served"]["put"] >= 4 * 7  # every shard of every step of its owner
    # the arena evicted shards before the slow tier took them: they were read back from
    # the peers (what reached the slow tier is checked by the restores from it below)
    assert sum(r["served"].get("read", 0) for r in results.values()) > 0
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "job"
    shutil.copytree(saved, root, ignore=shutil.ignore_patterns("*.lock"))
    return root


@pytest.mark.slow
def test_replicas_sit_on_the_other_node_under_retention(saved: Path) -> None:
    for owner, node in ((0, "b"), (1, "b"), (2, "a"), (3, "a")):
        held = saved / f"node-{node}" / "peer" / f"rank-{owner:05d}"
        steps = sorted(p.name for p in held.glob("step-*") if (p / "manifest.json").exists())
        assert steps == ["step-000000000002", "step-000000000003"]  # keep_last=2
        assert (held / "step-000000000003" / f"rank-{owner:05d}.data").stat().st_size > 0
    # nothing of a node's own ranks is kept among its replicas
    assert not (saved / "node-a" / "peer" / "rank-00000").exists()


@pytest.mark.slow
def test_a_replaced_node_restores_from_peer_replicas_without_reading_the_slow_tier(
    saved: Path, tmp_path: Path
) -> None:
    root = _copy(saved, tmp_path)
    shutil.rmtree(root / "node-a")  # node a was replaced: its disks and memory are empty
    results = _launch("restore", root, tmp_path / "out")
    for rank in NODE_A + NODE_B:
        r = results[rank]
        assert r["restored_step"] == 3 and r["restored_ok"], (rank, r)
        assert r["pfs_calls"].get("read_shard", 0) == 0, (rank, r["pfs_calls"])
        assert r["pfs_calls"].get("read_manifest", 0) == 0, (rank, r["pfs_calls"])
    for rank in NODE_A:  # from the replicas their peers on node b hold
        assert results[rank]["local_calls"].get("read_shard", 0) == 0
        assert results[rank + 2]["served"].get("read", 0) >= 6  # all of its shards
        assert results[rank + 2]["served"].get("manifest", 0) >= 1
    for rank in NODE_B:  # node b kept its local tier
        assert results[rank]["local_calls"].get("read_shard", 0) > 0
        assert results[rank - 2]["served"].get("read", 0) == 0


@pytest.mark.slow
def test_a_lost_replica_falls_back_to_the_slow_tier(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    shutil.rmtree(root / "node-a")
    shutil.rmtree(root / "node-b" / "peer")  # the peer's copies are gone too
    results = _launch("restore", root, tmp_path / "out")
    for rank in NODE_A + NODE_B:
        assert results[rank]["restored_step"] == 3 and results[rank]["restored_ok"]
    for rank in NODE_A:
        assert results[rank]["pfs_calls"].get("read_shard", 0) > 0
    for rank in NODE_B:
        assert results[rank]["pfs_calls"].get("read_shard", 0) == 0


@pytest.mark.slow
def test_a_corrupt_replica_is_caught_by_its_checksum_and_read_from_the_slow_tier(
    saved: Path, tmp_path: Path
) -> None:
    root = _copy(saved, tmp_path)
    shutil.rmtree(root / "node-a")
    data = root / "node-b" / "peer" / "rank-00000" / "step-000000000003" / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01  # one bit of rank 0's first shard
    data.write_bytes(raw)
    results = _launch("restore", root, tmp_path / "out")
    for rank in NODE_A + NODE_B:
        assert results[rank]["restored_step"] == 3 and results[rank]["restored_ok"]
    # rank 0: only the damaged shard came from the slow tier, the rest from the replica
    assert results[0]["pfs_calls"].get("read_shard", 0) == 1
    assert results[2]["served"].get("read", 0) >= 6
    assert results[1]["pfs_calls"].get("read_shard", 0) == 0


@pytest.mark.slow
def test_the_peer_replicas_example_runs() -> None:
    import subprocess

    example = Path(__file__).resolve().parent.parent / "examples" / "peer_replicas.py"
    out = subprocess.run(
        [sys.executable, str(example), "--ranks-per-node", "1"],
        capture_output=True, text=True, timeout=400, check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "every rank restored bit for bit" in out.stdout
    for rank in (1,):  # node b's rank served node a's rank's shards
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"  rank {rank} (node b) restored"))
        assert "served 0 shard" not in line


def test_the_peer_loopback_bench_reads_back_what_it_wrote() -> None:
    import json
    import subprocess

    bench = Path(__file__).resolve().parent.parent / "bench" / "recovery.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--peer-loopback", "--model-mib", "4"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]  # it asserts the bytes read back
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mib"] == 4 and len(result["read_mib_s"]) == 3
    assert all(rate > 0 for rate in result["read_mib_s"])
