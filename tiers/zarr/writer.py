"""One writer per location, and the commit index it writes: an ``flock`` on a path, a lease
object on S3 (conditional PUTs), and the root index, fenced by that lease on S3."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import Iterable
from typing import Any

from lazyckpt.tier import (
    FORMAT_VERSION,
    ConfigurationError,
    LocationInUseError,
    TierBrokenError,
)

from .._fs import WriterLock, lock_name
from .core import ZarrCore
from .layout import _group_doc, _json
from .s3 import _lease_holder, backoff


class ZarrWriter(ZarrCore):
    """A ZarrTier's writing side of the location: the writer's lock or lease and the index."""

    async def _update_index(
        self,
        add: int | None = None,
        remove: int | None = None,
        *,
        retire: bool = False,
        unretire: Iterable[int] = (),
        group: str | None = None,
    ) -> None:
        """Add a step to the commit index (``group``: its group, when not the plain name),
        or remove one (with ``retire``: into the list of retired steps, whose objects
        committed incremental steps still read), or drop steps from that list: one atomic
        write of the root ``zarr.json``."""
        groups = {} if add is None or group is None else {add: group}
        if self._leased:
            await self._update_fenced_index(
                () if add is None else (add,), remove, claim=False, retire=retire,
                unretire=unretire, groups=groups,
            )
            return
        async with self._index_lock:
            root = await self._read_root()
            if root is None:
                root = json.loads(_group_doc({"lazyckpt": {}}))
            assert root is not None
            steps = set(self._committed(root))
            if add is not None:
                steps.add(add)
            if remove is not None:
                steps.discard(remove)
            lazy = root["attributes"]["lazyckpt"]
            lazy["format_version"] = max(int(lazy.get("format_version", 0)), FORMAT_VERSION)
            lazy["committed"] = sorted(steps)
            _retire(lazy, self._retired(root), remove if retire else None, unretire)
            _regroup(lazy, self._group_names(root), groups, None if retire else remove, unretire)
            # The commit point: one atomic object write (an S3 PUT, a rename on a path).
            await self._put("zarr.json", _json(root))

    async def _update_fenced_index(
        self,
        add: Iterable[int],
        remove: int | None,
        *,
        claim: bool,
        retire: bool = False,
        unretire: Iterable[int] = (),
        groups: dict[int, str] | None = None,
    ) -> None:
        """The index of a leased (S3) location, fenced: it names the lease token of the
        writer that owns it, and is only replaced with ``If-Match`` on the ETag just read.
        A writer that took the location over ``claim``s it (writes its own token) before it
        deletes anything, so a writer that lost its lease, however long it stalled after its
        last lease check, finds another token or a changed ETag and never writes the index:
        the commit point cannot be reached by two writers, whatever the hosts' clocks say."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        token = self._lease[0] if self._lease is not None else None
        async with self._index_lock:
            for attempt in range(self._retries + 3):
                if token is None:
                    raise self._lost_lease()
                try:
                    got = await self._request(obstore.get_async(self._backend_store, "zarr.json"))
                    raw, etag = bytes(await got.bytes_async()), got.meta["e_tag"]
                except FileNotFoundError:  # what obstore raises for a missing object
                    raw, etag = None, None
                root = self._parse_root(raw) if raw is not None else None
                if root is None:
                    if not claim:  # the taker always writes one: it is not ours any more
                        raise self._lost_lease()
                    root = json.loads(_group_doc({"lazyckpt": {}}))
                    assert root is not None
                lazy = root["attributes"]["lazyckpt"]
                if not claim and lazy.get("writer") != token:
                    raise self._lost_lease()
                steps = set(self._committed(root)).union(add)
                if remove is not None:
                    steps.discard(remove)
                lazy["format_version"] = max(int(lazy.get("format_version", 0)), FORMAT_VERSION)
                lazy["committed"] = sorted(steps)
                _retire(lazy, self._retired(root), remove if retire else None, unretire)
                _regroup(
                    lazy, self._group_names(root), groups or {}, None if retire else remove,
                    unretire,
                )
                lazy["writer"] = token
                mode: Any = "create" if etag is None else {"e_tag": etag}
                try:
                    await self._request(
                        obstore.put_async(self._backend_store, "zarr.json", _json(root), mode=mode)
                    )
                    return
                except (PreconditionError, AlreadyExistsError):
                    continue  # written since the read: read again (was it the taker?)
                except Exception:
                    if attempt >= self._retries:
                        raise
                    # S3 clients do not retry conditional PUTs; a lost reply of one that
                    # landed shows up on the next read as this token's own index
                    await asyncio.sleep(backoff(attempt))
            raise TierBrokenError(
                f"the commit index {self.location}/zarr.json kept changing under this writer",
                tier=self.name,
            )

    async def _confirm_owner(self) -> None:
        """Before deleting what this writer listed: the index still names this writer (a
        leased location; elsewhere the lock is held for good). A writer that takes the
        location over claims the index before it writes anything, so every object it
        writes is newer than this check, and never in a listing made before it."""
        if not self._leased:
            return
        token = self._lease[0] if self._lease is not None else None
        root = await self._read_root()
        if token is None or root is None or root["attributes"]["lazyckpt"].get("writer") != token:
            raise self._lost_lease()

    @property
    def _incarnation(self) -> str | None:
        """The token naming this writer's step groups on a leased location (single rank)."""
        if not self._leased or self._lease is None or self.world_size > 1:
            return None
        return self._lease[0]

    def _lost_lease(self) -> LocationInUseError:
        self._lease = None  # lost for good: every later write stops too
        return LocationInUseError(
            f"{self.location}: this writer's lease expired and another writer took the "
            "location over; this one stops writing here",
            location=self.location,
            holder=None,
        )

    # -- one writer per location -----------------------------------------------------------

    async def _take_writer_lock(self) -> None:
        if self._local is not None:
            lock = WriterLock(self._local / lock_name(self.rank), self.location)

            def take() -> None:
                assert self._local is not None
                self._local.mkdir(parents=True, exist_ok=True)
                lock.acquire()

            await asyncio.to_thread(take)
            self._writer_lock = lock
        elif self._s3 is not None:
            await self._acquire_lease()
        # any other Store: the caller's to keep to one writer (docs/zarr.md)

    async def _drop_writer_lock(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None
        if self._lease is not None:
            with contextlib.suppress(Exception):  # it expires anyway
                import obstore

                # renewed first, so that what is deleted is surely this writer's lease: a
                # taker gets in only once it expired, and a lease lost already stays put
                await self._renew_lease(force=True)
                await self._request(obstore.delete_async(self._backend_store, self._lease_key()))
            self._lease = None

    @property
    def _backend_store(self) -> Any:
        return self._store.store  # type: ignore[attr-defined]  # zarr's ObjectStore wrapper

    def _lease_key(self) -> str:
        return f".lazyckpt-writer-rank-{self.rank:05d}.json"

    def _lease_document(self, token: str) -> bytes:
        return _json(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "expires": time.time() + self.lease_seconds,
                "token": token,
            }
        )

    async def _lease_put(self, token: str, mode: Any) -> str | None:
        """PUT this writer's lease conditionally; its ETag, or ``None`` when the condition
        failed because someone else's lease is there. S3 clients do not retry conditional
        PUTs, so a dropped connection is retried here; a retry that finds the lease its own
        earlier attempt wrote (same token) counts as done."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        key = self._lease_key()
        for attempt in range(self._retries + 1):
            try:
                put = await self._request(
                    obstore.put_async(
                        self._backend_store, key, self._lease_document(token), mode=mode
                    )
                )
                return str(put["e_tag"])
            except (AlreadyExistsError, PreconditionError, FileNotFoundError):
                # a lease there (someone else's, or this one's own earlier attempt), or, for
                # If-Match, none any more: AWS answers 404 there, SeaweedFS 412
                try:
                    held = await self._request(obstore.get_async(self._backend_store, key))
                except FileNotFoundError:
                    return None
                if _lease_holder(await held.bytes_async()).get("token") == token:
                    return str(held.meta["e_tag"])
                return None
            except Exception:
                if attempt == self._retries:
                    raise
                await asyncio.sleep(backoff(attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _probe_conditional_writes(self) -> None:
        """Refuse a server that does not honour conditional writes: everything that keeps
        one writer per location (the lease, the fenced index) rests on ``If-None-Match``
        and ``If-Match``, which some S3-compatible servers accept and ignore. A probe object
        is created twice; the second create must fail."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        key = f".lazyckpt-probe-{secrets.token_hex(8)}"
        await self._request(obstore.put_async(self._backend_store, key, b"1", mode="create"))
        try:
            try:
                await self._request(
                    obstore.put_async(self._backend_store, key, b"2", mode="create")
                )
            except (AlreadyExistsError, PreconditionError):
                return  # honoured
            s3 = self._s3
            where = f" at {s3.public_endpoint}" if s3 is not None and s3.public_endpoint else ""
            raise ConfigurationError(
                f"{self.location}: the S3 server{where} does not honour conditional writes "
                f"(a second create-if-absent of {key} succeeded). Without them lazyckpt "
                "cannot keep one writer per location: two writers could both take the lease "
                "and overwrite each other's commits. Use a server that honours If-None-Match "
                "and If-Match (AWS S3, MinIO, SeaweedFS), or pass "
                "require_conditional_writes=False to write without that guarantee"
            )
        finally:
            with contextlib.suppress(Exception):
                await self._request(obstore.delete_async(self._backend_store, key))

    async def _acquire_lease(self) -> None:
        """Create the lease object, or take over one that expired; never overwrite a live
        one (conditional PUTs: ``If-None-Match: *``, then ``If-Match`` on its ETag)."""
        import obstore

        if self.require_conditional_writes:
            await self._probe_conditional_writes()

        key, token = self._lease_key(), secrets.token_hex(8)
        etag = await self._lease_put(token, "create")
        if etag is None:
            held = await self._request(obstore.get_async(self._backend_store, key))
            holder = _lease_holder(await held.bytes_async())
            expires = holder.get("expires")
            if not isinstance(expires, int | float) or expires > time.time():
                raise self._in_use(key, holder)
            # expired: its writer died; take it over unless someone else just did
            etag = await self._lease_put(token, {"e_tag": held.meta["e_tag"]})
            if etag is None:
                raise self._in_use(key, None)
        self._lease = (token, etag, time.monotonic())
        self._leased = True

    def _in_use(self, key: str, holder: dict[str, Any] | None) -> LocationInUseError:
        who = (
            f"process {holder.get('pid')} on host {holder.get('host')!r} (lease until "
            f"{time.strftime('%H:%M:%S UTC', time.gmtime(float(holder.get('expires', 0))))})"
            if holder
            else "another process"
        )
        return LocationInUseError(
            f"{self.location} is being written by {who}, lease {self.location}/{key}: two "
            "writers on one location corrupt each other. Stop the other writer or use another "
            "location; if it was killed, its lease expires after lease_seconds. Restoring and "
            "the lazyckpt command line can read beside it.",
            location=self.location,
            holder={k: v for k, v in holder.items() if k != "token"} if holder else None,
        )

    async def _renew_lease(self, *, force: bool = False) -> None:
        """Before writing: renew the lease once a third of it has passed (``force``: now,
        before removing objects that may not be this writer's any more); a lease another
        writer took over (this one stalled past it) stops this writer here."""
        if not self._leased:
            return
        if self._lease is None:
            raise self._lost_lease()
        token, etag, renewed = self._lease
        if not force and time.monotonic() - renewed < self.lease_seconds / 3:
            return
        new_etag = await self._lease_put(token, {"e_tag": etag})
        if new_etag is None:
            raise self._lost_lease()
        self._lease = (token, new_etag, time.monotonic())


def _regroup(
    lazy: dict[str, Any],
    old: dict[int, str],
    add: dict[int, str],
    remove: int | None,
    drop: Iterable[int],
) -> None:
    """Update the index's map of steps to groups not named plainly (absent while there are
    none): ``add`` new ones, forget a step removed for good or dropped from the retired list;
    a retired step keeps its group (incremental steps read its objects there)."""
    groups = {**old, **add}
    for step in (remove, *drop):
        if step is not None:
            groups.pop(step, None)
    if groups:
        lazy["groups"] = {str(k): v for k, v in sorted(groups.items())}
    else:
        lazy.pop("groups", None)


def _retire(
    lazy: dict[str, Any], retired: list[int], add: int | None, drop: Iterable[int]
) -> None:
    """Update the index's list of retired steps (absent while there are none, so that an
    index without incremental steps stays as it was)."""
    steps = set(retired) - set(drop)
    if add is not None:
        steps.add(add)
    if steps:
        lazy["retired"] = sorted(steps)
    else:
        lazy.pop("retired", None)
