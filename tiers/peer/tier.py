"""PeerTier: every rank's shards, also kept by ranks on other nodes.

A tier of its own in the chain, after the node-local tier and before the parallel file
system or S3 (its level, ``TierLevel.PEER``, sits between them)::

    [HostMemoryTier(...), FileTier("/nvme/run1"), PeerTier("/dev/shm/run1-peers"), ZarrTier(...)]

Each shard, once durable on the local tier, is sent to ``replicas`` ranks on other nodes
(:func:`lazyckpt.tier.place_replicas`), which write it under their own ``root``: a tmpfs
directory keeps the replicas in the peers' memory, a local disk keeps them on disk. Both
outlive the process, which is what a restart needs: a job that lost a node is restarted
whole, and the survivors' new processes find the replicas their predecessors received.

How the ranks talk. The tier never uses the trainer's process group, nor gloo for the
bytes: at the rendezvous (``lazyckpt.tier.SupportsRendezvous``) each rank starts a small
asyncio TCP server on the engine's loop and exchanges its address, its node name and a
per-job secret over lazyckpt's own control group; from then on shards travel over plain
TCP connections, one request at a time per connection, a few connections per peer. A
request is a length-prefixed JSON header and a payload; a connection opens with the job's
secret, so a process of another job (or a stale one) cannot write here. The sockets are
driven with the loop's ``sock_*`` calls, not streams, so a payload moves between the
kernel and its final buffer with no copy in between: a shard to send straight from the
arena block, a shard read back straight into the restore's destination.

What a holder does with a replica: it keeps one :class:`tiers.FileTier` per rank it holds
replicas of, under ``root/rank-NNNNN/``, and runs the owner's requests on it (begin, put,
commit, the commit record, abort, delete, listing, reads). So a replica is stored, made
durable (``fdatasync``), committed (atomic manifest, then the commit record once every rank
agreed) and cleaned up after a crash exactly as a local snapshot is. Each shard's crc32c is
checked when it arrives, before the holder writes it. The owner's view of the tier:

- ``put_shard``/``commit``/``commit_global``: sent to every holder of the current
  placement; durable on this tier means acknowledged by all of them. The engine's commit
  protocol (an agreement of all ranks per step) decides when a step is committed here,
  as on any durable tier, and the tier's retention (``keep_last``, ``keep_every``) deletes
  the owner's old steps on its holders.
- ``steps``/``read_manifest``/``read_shard``: asked of the current holders and of every
  rank that reported, at the rendezvous, holding replicas of this rank (the placement may
  have changed since they were written). A shard read from one holder is checked against
  the manifest's crc32c before another holder is tried; the engine checks the last one
  and falls back to the next tier.

A rank with no replica anywhere (a fresh job) lists nothing here. ``aclose`` stops
accepting connections and keeps serving the peers still connected for up to ``linger``
seconds, so a rank that finished its restore early does not pull the replicas away from
one still reading them.

Here: the tier, its life cycle and the owner's side. The wire protocol (frames, the kinds
of error a refusal carries) is in ``peer.wire``; the holder's side, the replica server
that answers the peers' requests, in ``peer.holder`` (a base class of the tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import crc32c

from lazyckpt.tier import (
    ConfigurationError,
    CorruptionError,
    Exchange,
    Manifest,
    Retention,
    ShardMeta,
    SnapshotNotFoundError,
    TierBrokenError,
    TierClosedError,
    TierLevel,
    backend_errors,
    node_identity,
    place_replicas,
)

from ..file.tier import FileTier
from .holder import _ReplicaHolder
from .wire import _ERRORS, _Conn, _own_address

__all__ = ["PeerTier"]

log = logging.getLogger("lazyckpt")
_OWNER_DIR = re.compile(r"^rank-(\d{5})$")


class PeerTier(_ReplicaHolder):
    """Replicas of this rank's shards on ranks of other nodes (see the module docstring).

    Args:
        root: the directory on this node where this rank keeps the replicas it holds for
            other ranks (the same path on every rank of a node is fine: each rank uses
            ``root/rank-NNNNN/`` per rank it holds). A tmpfs path (``/dev/shm/...``) keeps
            them in memory; a local disk on disk.
        replicas: how many other nodes keep a copy of each rank's shards (default 1).
        node: this process's node name; default: ``LAZYCKPT_NODE``, torchrun's
            ``GROUP_RANK``, ``RANK // LOCAL_WORLD_SIZE``, or the host name
            (:func:`lazyckpt.tier.node_identity`).
        address: the address this rank's replica server listens on and peers connect to.
            Default: ``LAZYCKPT_PEER_ADDR``, else the address this host uses to reach
            ``MASTER_ADDR`` (the interface torch.distributed uses), else the host name's.
        port: the server's port (default 0: any free port; peers learn it at the
            rendezvous).
        timeout: seconds one request to a peer may take (connecting included) before it
            fails with :class:`~lazyckpt.TierBrokenError` and the next holder (or, on a
            restore, the next tier) is tried.
        linger: seconds ``aclose`` keeps serving peers still connected (default 10): a
            rank that finished its restore does not pull its replicas away from a peer
            still reading them. Keep it below a preemption's grace period: a peer whose
            node vanished without closing its connections is waited for that long.
        name, keep_last, keep_every: as for every tier; retention deletes this rank's old
            steps on its holders.
        retention: the whole retention policy as one :class:`lazyckpt.Retention` (which
            also holds ``keep_best`` and ``keep_within``), instead of ``keep_last`` and
            ``keep_every``.
    """

    level = TierLevel.PEER
    default_name = "peer"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        replicas: int = 1,
        node: str | None = None,
        address: str | None = None,
        port: int = 0,
        timeout: float = 60.0,
        linger: float = 10.0,
        name: str | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        retention: Retention | None = None,
    ) -> None:
        super().__init__(
            name=name, keep_last=keep_last, keep_every=keep_every, retention=retention
        )
        if not isinstance(root, str | os.PathLike) or not str(root):
            raise ConfigurationError(f"PeerTier root must be a path, got {root!r}")
        if type(replicas) is not int or replicas < 1:
            raise ConfigurationError(f"replicas must be a positive integer, got {replicas!r}")
        if type(port) is not int or not 0 <= port < 65536:
            raise ConfigurationError(f"port must be 0..65535, got {port!r}")
        if not timeout > 0 or not linger >= 0:
            raise ConfigurationError(
                f"timeout must be positive and linger >= 0 seconds, got {timeout!r}, {linger!r}"
            )
        self.root = Path(root)
        self.replicas = replicas
        self.port = port
        self.timeout = float(timeout)
        self.linger = float(linger)
        self._node_override = node
        self._address_override = address
        self.node = ""
        self.address: tuple[str, int] | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._token = ""
        self._peers: list[tuple[str, int]] = []
        self.nodes: list[str] = []
        self.holders: tuple[int, ...] = ()  # where this rank's replicas go
        self._known: list[int] = []  # ranks that reported holding replicas of this rank
        self._where: dict[int, list[int]] = {}  # step -> holders listing it (last steps())
        self._stores: dict[int, FileTier] = {}  # owner rank -> its replicas held here
        # (owner, step) -> its manifest, from the owner's begin until its commit record:
        # the puts need it, and a read of a step not yet committed everywhere (the engine
        # reads a shard back when the arena evicted its block before the next tier took it)
        self._writing: dict[tuple[int, int], Manifest] = {}
        self._manifests: dict[tuple[int, int], Manifest] = {}  # read cache of held manifests
        self._pools: dict[int, list[_Conn]] = {}
        self._serving: set[asyncio.Task[None]] = set()
        self._joined = False
        self._closed = False
        # requests this rank answered for its peers, by kind ("read", "put", ...)
        self.served: dict[str, int] = {}

    @property
    def holding(self) -> list[int]:
        """The ranks whose replicas this rank keeps (known after the rendezvous)."""
        return sorted(self._stores)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "root": str(self.root), "replicas": self.replicas}

    # -- life cycle --------------------------------------------------------------------------

    async def open(self) -> None:
        """Check the configuration and start the replica server (peers are met later, in
        :meth:`rendezvous`)."""
        if self.world_size < 2:
            raise ConfigurationError(
                f"PeerTier {self.name!r} keeps replicas on other ranks: it needs "
                "torch.distributed initialized with several ranks on at least two nodes; "
                "leave it out of single-process runs"
            )
        if self.readonly:
            raise ConfigurationError(
                f"PeerTier {self.name!r} cannot be opened read-only: it serves its peers"
            )
        self.node = node_identity(self._node_override)
        host = self._address_override or os.environ.get("LAZYCKPT_PEER_ADDR") or _own_address()
        loop = asyncio.get_running_loop()
        try:
            family, kind, proto, _, where = (
                await loop.getaddrinfo(host, self.port, type=socket.SOCK_STREAM)
            )[0]
            listener = socket.socket(family, kind, proto)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(where)
                listener.listen(256)
                listener.setblocking(False)
            except BaseException:
                listener.close()
                raise
        except OSError as exc:
            raise TierBrokenError(
                f"cannot listen on {host}:{self.port} for peer replicas: {exc}; give "
                "PeerTier(address=..., port=...) an address of this host the others reach",
                tier=self.name,
            ) from exc
        self._listener = listener
        self.address = (host, int(listener.getsockname()[1]))
        # the tier owns this task (and the connections' tasks): aclose ends them
        self._accepting = loop.create_task(self._accept(), name=f"lazyckpt-{self.name}-accept")

    async def rendezvous(self, exchange: Exchange) -> None:
        """Meet the peers: addresses, nodes and the job's secret; the placement; the
        replicas this rank holds and who holds this rank's (two ``all_gather``)."""
        assert self.address is not None, "open() first"
        token = secrets.token_hex(16) if self.rank == 0 else ""
        first = await exchange((self.node, self.address, token))
        self.nodes = [node for node, _, _ in first]
        self._peers = [(str(a[0]), int(a[1])) for _, a, _ in first]
        self._token = str(first[0][2])
        placement = place_replicas(self.nodes, self.replicas)  # the same on every rank
        self.holders = placement[self.rank]
        mine = [owner for owner, hs in enumerate(placement) if self.rank in hs]
        # replicas a placement of an earlier run left on this node, which no rank of the
        # node holds now, are served (and aged out by their owners' retention) too
        here = [r for r, node in enumerate(self.nodes) if node == self.node]
        placed_here = {o for o, hs in enumerate(placement) if any(h in here for h in hs)}
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, _owner_dirs, self.root)
        mine += [o for o in sorted(found - placed_here) if here[o % len(here)] == self.rank]
        for owner in mine:
            store = FileTier(self.root / f"rank-{owner:05d}", name=f"{self.name}-rank-{owner}")
            await store.open()
            self._stores[owner] = store
        held = [o for o, store in self._stores.items() if await store.steps()]
        second = await exchange(held)
        self._known = [h for h, owners in enumerate(second) if self.rank in owners]
        self._joined = True
        log.info(
            "peer tier %s: rank %d on node %s keeps its replicas on rank(s) %s and holds "
            "replicas of rank(s) %s", self.name, self.rank, self.node, list(self.holders),
            sorted(self._stores), extra={"tier": self.name},
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pool in self._pools.values():  # ours first: a peer waiting on us may go now
            for conn in pool:
                conn.close()
        self._pools.clear()
        if self._accepting is not None:  # no new connections; those open are served on
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        if self._serving:
            _, late = await asyncio.wait(set(self._serving), timeout=self.linger)
            for task in late:
                task.cancel()
            if late:
                log.warning(
                    "peer tier %s: %d peer connection(s) still open after %.0fs; closed",
                    self.name, len(late), self.linger, extra={"tier": self.name},
                )
                await asyncio.wait(late)
        results = await asyncio.gather(
            *(s.aclose() for s in self._stores.values()), return_exceptions=True
        )
        self._stores.clear()
        for r in results:
            if isinstance(r, BaseException):
                raise r

    # -- the owner's side ----------------------------------------------------------------

    def _ready(self) -> None:
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        if not self._joined:
            raise TierBrokenError(
                "the peer tier has not met its peers (no rendezvous): it works only in a "
                "distributed Checkpointer",
                tier=self.name,
            )

    def _candidates(self, step: int | None = None) -> list[int]:
        """Holders to ask for this rank's replicas: those listing ``step`` at the last
        ``steps()`` first, then the placement's, then those that reported holding some."""
        listed = self._where.get(step, []) if step is not None else []
        return list(dict.fromkeys([*listed, *self.holders, *self._known]))

    async def _all(self, holders: Iterable[int], header: dict[str, Any], payload: Any = b"") -> None:
        """Send one request to each holder, concurrently; every one must succeed."""
        results = await asyncio.gather(
            *(self._request(h, header, payload) for h in holders), return_exceptions=True
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def begin(self, manifest: Manifest) -> None:
        self._ready()
        header = {"op": "begin", "owner": self.rank, "step": manifest.step}
        await self._all(self.holders, header, manifest.to_json())

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        self._ready()
        if len(data) != shard.length:
            raise ConfigurationError(f"shard {shard.index}: {len(data)} bytes, not {shard.length}")
        if shard.crc32c is None:
            raise ConfigurationError(f"shard {shard.index} of step {manifest.step} has no crc32c")
        header = {
            "op": "put", "owner": self.rank, "step": manifest.step,
            "index": shard.index, "crc32c": shard.crc32c,
        }
        await self._all(self.holders, header, data)

    async def commit(self, manifest: Manifest) -> None:
        self._ready()
        header = {"op": "commit", "owner": self.rank, "step": manifest.step}
        await self._all(self.holders, header, manifest.to_json())

    async def commit_global(self, step: int, world_size: int) -> None:
        """Every rank's part is on its holders: each rank has its holders write the step's
        commit record next to its replica (``SupportsGlobalCommit``)."""
        self._ready()
        header = {"op": "global", "owner": self.rank, "step": step, "world_size": world_size}
        await self._all(self.holders, header)

    async def abort(self, step: int) -> None:
        self._ready()
        await self._all(self.holders, {"op": "abort", "owner": self.rank, "step": step})

    async def delete(self, step: int) -> None:
        self._ready()
        await self._all(self._candidates(step), {"op": "delete", "owner": self.rank, "step": step})

    async def steps(self) -> list[int]:
        """The steps committed on at least one reachable holder of this rank's replicas.
        A holder that does not answer is left out (logged), as a tier that is down is."""
        self._ready()
        holders = self._candidates()
        answers = await asyncio.gather(
            *(self._request(h, {"op": "steps", "owner": self.rank}) for h in holders),
            return_exceptions=True,
        )
        where: dict[int, list[int]] = {}
        for holder, answer in zip(holders, answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer
                log.warning(
                    "peer tier %s: rank %d cannot list its replicas on rank %d: %s",
                    self.name, self.rank, holder, answer, extra={"tier": self.name},
                )
                continue
            for step in answer[0]["steps"]:
                where.setdefault(int(step), []).append(holder)
        self._where = where
        return sorted(where)

    async def read_manifest(self, step: int) -> Manifest:
        self._ready()
        problems: list[str] = []
        missing = True
        for holder in self._candidates(step):
            try:
                _, data = await self._request(
                    holder, {"op": "manifest", "owner": self.rank, "step": step}
                )
                manifest = Manifest.from_json(data, source=f"{self.name}: rank {holder}")
            except SnapshotNotFoundError as exc:
                problems.append(f"rank {holder}: {exc}")
                continue
            except (CorruptionError, TierBrokenError) as exc:
                problems.append(f"rank {holder}: {exc}")
                missing = False
                continue
            if manifest.step != step or manifest.rank != self.rank:
                problems.append(f"rank {holder} answered rank {manifest.rank}'s step {manifest.step}")
                missing = False
                continue
            return manifest
        message = (
            f"step {step}: no peer holds a readable replica of rank {self.rank}'s manifest"
            f" ({'; '.join(problems) or 'no holder known'})"
        )
        raise SnapshotNotFoundError(message) if missing else CorruptionError(message)

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        """Fill ``out`` from the first holder with a good copy. Every holder but the last
        one tried is checked against the manifest's crc32c here, so a damaged replica
        sends the read on to the next holder; the engine checks the last one (and falls
        back to the next tier when it is bad)."""
        self._ready()
        holders = self._candidates(manifest.step)
        problems: list[str] = []
        for n, holder in enumerate(holders):
            header = {"op": "read", "owner": manifest.rank, "step": manifest.step, "index": shard.index}
            try:
                reply, _ = await self._request(holder, header, into=out)
            except (CorruptionError, SnapshotNotFoundError, TierBrokenError) as exc:
                problems.append(f"rank {holder}: {exc}")
                continue
            if not reply.get("into"):
                problems.append(f"rank {holder} sent {reply.get('size')} bytes, not {shard.length}")
                continue
            if n < len(holders) - 1 and crc32c.crc32c(out) != shard.crc32c:
                problems.append(f"rank {holder}'s copy fails its checksum")
                continue
            return
        raise CorruptionError(
            f"tier {self.name!r}: no peer holds shard {shard.index} of rank {manifest.rank}, "
            f"step {manifest.step} ({'; '.join(problems) or 'no holder known'})"
        )

    # -- the wire ------------------------------------------------------------------------

    async def _request(
        self, holder: int, header: dict[str, Any], payload: Any = b"", *, into: memoryview | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """One request to ``holder`` and its answer, within ``timeout``. A refusal is raised
        as the error the holder met; a broken connection as TierBrokenError. With ``into``,
        an answer's payload of exactly ``len(into)`` bytes is received into it (the reply
        then says ``"into": True``) instead of being returned."""
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        host, port = self._peers[holder]
        where = f"peer rank {holder} ({host}:{port}), {header['op']} step {header.get('step')}"
        conn = None
        try:
            # the one mapping of backend errors: a dropped connection, a timeout or a
            # garbled frame is TierBrokenError (retried by the engine)
            with backend_errors(self.name, where):
                async with asyncio.timeout(self.timeout):
                    conn = await self._connection(holder)
                    await conn.send(header, payload)
                    reply, size = await conn.receive_header()
                    if into is not None and size == len(into) and "error" not in reply:
                        await conn.receive_into(into)
                        reply["into"], data = True, bytearray()
                    else:
                        data = await conn.receive(size)
                        reply["size"] = size
        except BaseException:  # failed or cancelled mid-request: the connection is out of step
            if conn is not None:
                conn.close()
            raise
        self._pools.setdefault(holder, []).append(conn)  # the answer was read whole
        if "error" in reply:
            make = _ERRORS.get(str(reply["error"]), _ERRORS["broken"])
            raise make(f"{where}: {reply.get('message', '')}", self.name)
        return reply, bytes(data)

    async def _connection(self, holder: int) -> _Conn:
        pool = self._pools.setdefault(holder, [])
        while pool:
            conn = pool.pop()
            if not conn.closed:
                return conn
        host, port = self._peers[holder]
        loop = asyncio.get_running_loop()
        family, kind, proto, _, where = (
            await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        )[0]
        conn = _Conn(socket.socket(family, kind, proto))
        try:
            await loop.sock_connect(conn.sock, where)
            await conn.send({"op": "hello", "token": self._token, "rank": self.rank})
            reply, size = await conn.receive_header()
            await conn.receive(size)
            if "error" in reply:
                raise ValueError(f"refused: {reply.get('message')}")
        except BaseException:
            conn.close()
            raise
        return conn


def _owner_dirs(root: Path) -> set[int]:
    if not root.is_dir():
        return set()
    return {int(m.group(1)) for p in root.iterdir() if (m := _OWNER_DIR.match(p.name)) and p.is_dir()}
