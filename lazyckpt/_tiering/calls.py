"""One tier operation under a deadline, retried with back-off: how the engine and the
command line call a tier."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from .._errors import DeadlineExceededError, TierBrokenError
from .interface import backend_errors

__all__ = ["RetryPolicy", "call_tier"]

log = logging.getLogger("lazyckpt")
T = TypeVar("T")


class RetryPolicy(Protocol):
    """How long one tier operation may take and how often it is retried (the options)."""

    @property
    def deadline(self) -> float | None: ...

    @property
    def retries(self) -> int: ...

    @property
    def retry_backoff(self) -> float: ...


async def call_tier(
    tier: str,
    what: str,
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    retry: bool = True,
    scale: int = 1,
) -> T:
    """Run one operation on a tier under the policy's deadline, retrying transient failures
    (a broken backend, a missed deadline) with jittered exponential back-off, and
    translating whatever is not yet a lazyckpt error. Every write the engine makes goes
    through here; so do the command line's (``import``, ``copy``).

    Args:
        tier: the tier's name, for messages and logs.
        what: the operation, for messages (``"put shard 3"``).
        call: makes a fresh awaitable for each attempt.
        policy: ``deadline`` (seconds per attempt, None for none), ``retries`` and
            ``retry_backoff`` (the first back-off, doubled for each retry).
        retry: False runs it once (an operation that must not be repeated).
        scale: how many operations the call does at once (several shards in one
            ``put_shards``): the deadline is that many times the policy's.

    Raises:
        DeadlineExceededError: the last attempt took longer than the deadline.
        TierError: the last attempt failed (an ``OSError`` or any other exception comes
            as :class:`TierBrokenError`, with it as the cause).
    """
    attempts = 1 + (policy.retries if retry else 0)
    delay = policy.retry_backoff
    deadline = None if policy.deadline is None else policy.deadline * max(1, scale)
    for attempt in range(1, attempts + 1):
        try:
            return await _call_once(tier, what, call, deadline)
        except (TierBrokenError, DeadlineExceededError) as exc:
            if attempt == attempts:
                raise
            log.info(
                "%s on %s failed (attempt %d of %d), retrying in %.2fs: %s",
                what, tier, attempt, attempts, delay, exc, extra={"tier": tier},
            )
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay *= 2
    raise AssertionError("unreachable")  # pragma: no cover


async def _call_once(
    tier: str, what: str, call: Callable[[], Awaitable[T]], deadline: float | None
) -> T:
    async def mapped() -> T:
        # a tier maps its backend's errors at its own boundary; this covers a tier that lets
        # one through, with the same one mapping (out of space stays TierFullError)
        with backend_errors(tier, what):
            return await call()

    try:
        if deadline is None:
            return await mapped()
        async with asyncio.timeout(deadline):
            return await mapped()
    except TimeoutError as exc:
        raise DeadlineExceededError(
            f"tier {tier!r}: {what} took longer than the {deadline}s deadline"
        ) from exc
