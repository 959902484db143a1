"""Agreeing across ranks: is step s committed on tier k?

Every rank runs its own Checkpointer over its own shards. A step is committed on a tier only
when every rank's part is durable there. The protocol, per (step, tier), in step order:

1. each rank commits its own part locally (its rank manifest, durable) or fails;
2. ``all_reduce`` (max) of (step, -step, failed) over a gloo group of lazyckpt's own, one
   group per tier, so a background commit can never interleave with the trainer's
   collectives (the trainer's groups are never used), nor a slow tier's commit hold up a
   fast tier's;
3. if every rank is ok, the tier's ``commit_global`` writes the commit record: ``FileTier``
   on every rank (idempotent on a shared file system, needed on node-local disks),
   ``ZarrTier`` on rank 0 only (its root index is a read-modify-write object);
4. a second such ``all_reduce`` confirms it was written; only then does the step count as
   committed, and the handle's awaitable for that tier resolves.

Collectives run on one thread per group, in the order the coordinator issues them, which is
the same order on every rank (steps are snapshotted in the same order everywhere). A rank
that dies or hangs makes the others' collectives fail (the groups' timeout is the longest a
healthy peer may take for one tier operation with its retries): they get
:class:`DeadlineExceededError` and the step is not committed.
After a timeout a group cannot be trusted again, so later commits on that tier fail fast.

Costs per committed step and tier: two ``all_reduce`` of 24 bytes (no pickling; a failed
rank adds one ``all_gather`` to name it), plus one small file per rank (its manifest) and
one commit record. ``docs/distributed.md`` models this up to 16,000 ranks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from .._errors import ConfigurationError, CoordinationError, DeadlineExceededError

__all__ = ["Coordinator", "distributed_context"]

T = TypeVar("T")


def distributed_context(requested: bool | None) -> tuple[int, int] | None:
    """(rank, world size) when this process is one of several, else None."""
    if requested is False:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if requested:
            raise ConfigurationError(
                "distributed=True needs torch.distributed initialized "
                "(torch.distributed.init_process_group) before the Checkpointer opens"
            )
        return None
    world = dist.get_world_size()
    if world == 1 and not requested:
        return None
    return dist.get_rank(), world


class Coordinator:
    """The collectives of one Checkpointer: one gloo group per durable tier, a control
    group for ``steps()``/``restore()`` agreement, and one for the shards a restore sends
    between ranks; with ``schedule``, one more (channel :attr:`schedule`) on which the ranks
    agree, in snapshot order, which tiers a snapshot goes to when a cadence is by time, and
    which step an emergency copy is of. Must be created on every rank, in the
    same order relative to other ``new_group`` calls (it is, inside ``Checkpointer.open``)."""

    def __init__(
        self, rank: int, world_size: int, stages: int, timeout: float, *, schedule: bool = False
    ) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        span = timedelta(seconds=timeout)
        channels = stages + 1 + (1 if schedule else 0)
        #: the channel of the cadence and emergency agreements (None: not created)
        self.schedule: int | None = stages + 1 if schedule else None
        self._groups: list[Any] = [
            dist.new_group(backend="gloo", timeout=span) for _ in range(channels)
        ]
        self._threads = [
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"lazyckpt-coord-{i}")
            for i in range(channels)
        ]
        # restores that read a shard once and send it to the other ranks needing it
        self._transfers: Any = dist.new_group(backend="gloo", timeout=span)
        self.sent_bytes = 0
        self.received_bytes = 0
        self._broken: list[BaseException | None] = [None] * channels
        self._busy = [0] * channels  # collectives submitted and not yet returned
        self.collectives = 0

    def _done(self, channel: int) -> None:
        self._busy[channel] -= 1

    def _gather(self, channel: int, value: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._groups[channel])
        return out

    def _max(self, channel: int, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._groups[channel])
        return [int(v) for v in t.tolist()]

    async def _collective(self, channel: int, fn: Callable[..., T], *args: Any) -> T:
        """Run one collective on the channel's thread; a timeout breaks the channel."""
        broken = self._broken[channel]
        if broken is not None:
            raise DeadlineExceededError(
                f"an earlier collective on this channel failed ({broken}); commits on it are "
                "disabled until the Checkpointer is reopened"
            ) from broken
        loop = asyncio.get_running_loop()
        self.collectives += 1
        self._busy[channel] += 1
        future = loop.run_in_executor(self._threads[channel], fn, channel, *args)
        # the thread is free once the collective itself returns, not when a cancelled
        # caller stops waiting for it
        future.add_done_callback(lambda _f: self._done(channel))
        try:
            return await future
        except RuntimeError as exc:  # gloo: timeouts and dead peers surface as RuntimeError
            self._broken[channel] = exc
            raise DeadlineExceededError(
                f"rank {self.rank}: another rank did not answer within {self.timeout}s "
                f"(dead or hung?): {exc}"
            ) from exc

    async def gather(self, channel: int, value: Any) -> list[Any]:
        """``all_gather`` of a small picklable value on a channel (0: control, k: tier k)."""
        return await self._collective(channel, self._gather, value)

    async def agree(self, channel: int, step: int, ok: bool) -> list[bool]:
        """Every rank's ``ok`` for ``step``; raises if the ranks are not at the same step.

        One ``all_reduce`` (max) of three integers: the highest step, minus the lowest step,
        and whether any rank failed. Only when one did (rare) does a second collective learn
        which, for the error message; every rank sees the same reduction, so every rank
        takes the same path and the collectives stay matched.
        """
        high, neg_low, failed = await self._collective(
            channel, self._max, [step, -step, 0 if ok else 1]
        )
        if high != -neg_low:
            raise CoordinationError(
                f"ranks are committing different steps (from {-neg_low} to {high}): every "
                "rank must snapshot the same steps in the same order"
            )
        if not failed:
            return [True] * self.world_size
        return [bool(v) for v in await self.gather(channel, ok)]

    async def maximum(self, channel: int, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (one ``all_reduce``; every
        rank passes as many)."""
        return await self._collective(channel, self._max, values)

    async def barrier(self) -> None:
        await self.gather(0, None)

    # -- shards sent between ranks (a restore reading each stored byte once) ----------------

    def isend(self, tensor: Any, dst: int, tag: int) -> Any:
        """Start sending a CPU tensor to rank ``dst`` on the transfer group (non-blocking)."""
        import torch.distributed as dist

        self.sent_bytes += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, dst, group=self._transfers, tag=tag)

    def irecv(self, tensor: Any, src: int, tag: int) -> Any:
        """Start receiving into a CPU tensor from rank ``src`` (non-blocking)."""
        import torch.distributed as dist

        self.received_bytes += tensor.numel() * tensor.element_size()
        return dist.irecv(tensor, src, group=self._transfers, tag=tag)

    async def wait(self, works: list[Any]) -> list[BaseException | None]:
        """Wait for started sends and receives, off the loop; each one's error or ``None``
        (a peer that died or hung past the timeout fails its transfers, not the wait)."""

        def wait_all() -> list[BaseException | None]:
            out: list[BaseException | None] = []
            for work in works:
                try:
                    work.wait()
                    out.append(None)
                except Exception as exc:  # gloo: a timeout or a dead peer
                    out.append(exc)
            return out

        return await asyncio.to_thread(wait_all)

    def close(self) -> None:
        """Stop the collective threads and destroy lazyckpt's own gloo groups, so that
        none of their threads is alive when the process exits (gloo aborts the process,
        "terminate called without an active exception", when one is torn down at exit).

        A channel whose thread may still be inside a collective (one that timed out, or
        one a cancelled close left waiting for a peer) is left alone: destroying its group
        under it would be worse, and waiting for it could take the whole timeout; the
        process group's own shutdown takes it."""
        import torch.distributed as dist

        for pool in self._threads:
            pool.shutdown(wait=False, cancel_futures=True)
        for channel, (pool, group) in enumerate(zip(self._threads, self._groups, strict=True)):
            if self._broken[channel] is not None or self._busy[channel]:
                continue
            pool.shutdown(wait=True)  # idle after the drain: returns at once
            if dist.is_available() and dist.is_initialized():
                # the trainer may have destroyed every group already
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(group)
        self._groups = []
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._transfers)
