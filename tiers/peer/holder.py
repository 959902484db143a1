"""The holder's side of the peer tier: the replica server that keeps other ranks' replicas
on this node and answers their requests (see ``peer.tier``)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
from dataclasses import replace
from typing import Any

import crc32c

from lazyckpt.tier import (
    CorruptionError,
    LazyCkptError,
    Manifest,
    SnapshotNotFoundError,
    Tier,
    TierBrokenError,
)

from ..file.tier import FileTier
from .wire import _MAX_HEADER, _Conn, _kind

log = logging.getLogger("lazyckpt")


class _ReplicaHolder(Tier):
    """What :class:`~tiers.PeerTier` does for its peers: accept their connections and run
    their requests on the replica stores it keeps for them. The state is set up by
    ``PeerTier.__init__`` and its rendezvous."""

    _listener: socket.socket | None
    _token: str
    _stores: dict[int, FileTier]  # owner rank -> its replicas held here
    _writing: dict[tuple[int, int], Manifest]
    _manifests: dict[tuple[int, int], Manifest]
    _serving: set[asyncio.Task[None]]
    served: dict[str, int]

    async def _accept(self) -> None:
        """Accept peers' connections until the tier closes; each is served by a task of its
        own, which :meth:`aclose` waits for (or cancels after ``linger``)."""
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors, say: keep the server up
                log.warning("peer tier %s: accept failed: %s", self.name, exc)
                await asyncio.sleep(0.1)
                continue
            task = loop.create_task(self._serve(_Conn(sock)), name=f"lazyckpt-{self.name}-serve")
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)

    async def _serve(self, conn: _Conn) -> None:
        try:
            header, size = await conn.receive_header()
            if size or header.get("op") != "hello" or not hmac.compare_digest(
                str(header.get("token", "")), self._token or secrets.token_hex(16)
            ):
                return  # not this job's: drop it without a word
            await conn.send({"ok": True})
            while True:
                try:
                    header, size = await conn.receive_header()
                except EOFError:
                    return  # the peer closed the connection
                try:
                    reply, data = await self._answer(header, size, conn)
                except LazyCkptError as exc:
                    reply, data = {"error": _kind(exc), "message": str(exc)}, b""
                await conn.send(reply, data)
        except (OSError, EOFError, ValueError) as exc:
            log.debug("peer tier %s: connection ended: %r", self.name, exc)
        finally:
            conn.close()

    def _store(self, owner: int, writing: bool) -> FileTier | None:
        store = self._stores.get(owner)
        if store is None and writing:
            raise TierBrokenError(
                f"rank {self.rank} holds no replicas of rank {owner} (placements differ? "
                "every rank must give PeerTier the same replicas)",
                tier=self.name,
            )
        return store

    async def _answer(
        self, header: dict[str, Any], size: int, conn: _Conn
    ) -> tuple[dict[str, Any], bytes | bytearray]:
        """Run one request of a peer on the replica store it names."""
        op, owner, step = header.get("op"), int(header.get("owner", -1)), int(header.get("step", -1))
        self.served[str(op)] = self.served.get(str(op), 0) + 1
        key = (owner, step)
        if op == "put":
            store = self._store(owner, writing=True)
            assert store is not None
            manifest = self._writing.get(key)
            index = int(header["index"])
            if manifest is None or not 0 <= index < len(manifest.shards):
                await conn.skip(size)
                raise TierBrokenError(f"put of rank {owner}'s step {step} before its begin", tier=self.name)
            shard = manifest.shards[index]
            if size != shard.length:
                await conn.skip(size)
                raise TierBrokenError(f"shard {index} of rank {owner}: {size} bytes, not {shard.length}", tier=self.name)
            data = await conn.receive(size)
            if crc32c.crc32c(data) != header["crc32c"]:
                raise CorruptionError(
                    f"shard {index} of rank {owner}'s step {step} arrived damaged (checksum)"
                )
            await store.put_shard(manifest, replace(shard, crc32c=header["crc32c"]), memoryview(data))
            return {"ok": True}, b""
        if size > _MAX_HEADER * 1024:  # a manifest: large, but not a shard's size
            await conn.skip(size)
            raise TierBrokenError(f"request {op!r} with {size} bytes refused", tier=self.name)
        payload = await conn.receive(size)
        if op in ("begin", "commit"):
            store = self._store(owner, writing=True)
            assert store is not None
            manifest = Manifest.from_json(bytes(payload), source=f"rank {owner}'s step {step}")
            if manifest.rank != owner or manifest.step != step:
                raise CorruptionError(f"rank {owner} sent rank {manifest.rank}'s step {manifest.step}")
            if op == "begin":
                await store.begin(manifest)
            else:
                await store.commit(manifest)
            self._writing[key] = manifest
            return {"ok": True}, b""
        if op == "global":
            store = self._store(owner, writing=True)
            assert store is not None
            await store.commit_global(step, int(header["world_size"]))
            committed = self._writing.pop(key, None)
            if committed is not None:
                self._manifests[key] = committed
            return {"ok": True}, b""
        store = self._store(owner, writing=False)
        if op == "abort":
            self._writing.pop(key, None)
            if store is not None:
                await store.abort(step)
            return {"ok": True}, b""
        if op == "delete":
            self._manifests.pop(key, None)
            self._writing.pop(key, None)
            if store is not None:
                await store.delete(step)
            return {"ok": True}, b""
        if op == "steps":
            return {"steps": await store.steps() if store is not None else []}, b""
        if op not in ("manifest", "read"):
            raise TierBrokenError(f"unknown request {op!r}", tier=self.name)
        if store is None:
            raise SnapshotNotFoundError(f"rank {self.rank} holds no replica of rank {owner}")
        manifest = self._writing.get(key) or self._manifests.get(key)
        if manifest is None:
            manifest = await store.read_rank_manifest(step, owner)
            self._manifests[key] = manifest
            while len(self._manifests) > 64:
                self._manifests.pop(next(iter(self._manifests)))
        if op == "manifest":
            return {"ok": True}, manifest.to_json()
        index = int(header["index"])
        if not 0 <= index < len(manifest.shards):
            raise CorruptionError(f"rank {owner}'s step {step} has no shard {index}")
        shard = manifest.shards[index]
        out = bytearray(shard.length)
        await store.read_shard(manifest, shard, memoryview(out))
        return {"ok": True}, out
