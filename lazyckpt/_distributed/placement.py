"""Replicas on other nodes: which node a rank is on, which ranks hold its replicas, and the
hook through which a tier meets its peers.

A tier that keeps copies of a rank's shards on other ranks (``tiers.PeerTier``) needs two
things the tier interface does not give: the other ranks' addresses, and an agreement on
who holds whose copies. Both come from one hook, :class:`SupportsRendezvous`: after every
tier is open, a distributed Checkpointer calls ``rendezvous(exchange)`` on each tier that
has it, on every rank, in chain order, where ``exchange(value)`` is an ``all_gather`` of a
small picklable value over lazyckpt's own control process group (never the trainer's).
The tier then talks to its peers over a channel of its own; the process group only
bootstraps it.

Placement (:func:`place_replicas`) is a pure function of the ranks' node names, so every
rank computes the same answer without another collective: rank ``r``, the ``j``-th rank of
the ``i``-th node, keeps its ``m``-th replica (``m = 1..k``) on the ``j``-th rank (modulo
its size) of node ``i + m`` (modulo the number of nodes). With nodes of equal size every
rank holds exactly ``k`` other ranks' replicas, and a node's ranks spread theirs over ``k``
other nodes, so losing one node loses no rank's last copy when ``k >= 1``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .._errors import ConfigurationError

__all__ = [
    "NODE_ENV",
    "Exchange",
    "SupportsRendezvous",
    "join_peers",
    "node_identity",
    "place_replicas",
]

# The environment variable that names this process's node, over anything else: a test (or
# a launcher that knows better) simulates or states nodes with it.
NODE_ENV = "LAZYCKPT_NODE"

Exchange = Callable[[Any], Awaitable[list[Any]]]


@runtime_checkable
class SupportsRendezvous(Protocol):
    """A tier that must meet the same tier on the other ranks before it is used.

    A distributed Checkpointer calls :meth:`rendezvous` once, after ``open()`` and before
    the first snapshot, on every rank, in chain order. ``exchange(value)`` returns every
    rank's ``value`` (a small picklable object), indexed by rank; the tier may call it
    several times, as long as it does so the same number of times on every rank. A
    single-process Checkpointer never calls it: such a tier must then refuse in ``open()``
    or work alone.
    """

    async def rendezvous(self, exchange: Exchange) -> None: ...


def node_identity(override: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The name of the node this process runs on.

    In order: ``override``; the ``LAZYCKPT_NODE`` environment variable; torchrun's
    ``GROUP_RANK`` (the node's rank in the job); ``RANK // LOCAL_WORLD_SIZE`` when both are
    set (torchrun and most launchers give a node consecutive ranks); the host name.
    """
    env = os.environ if env is None else env
    if override is not None:
        if not isinstance(override, str) or not override:
            raise ConfigurationError(f"node must be a non-empty string, got {override!r}")
        return override
    if env.get(NODE_ENV):
        return env[NODE_ENV]
    if env.get("GROUP_RANK"):
        return f"group-{env['GROUP_RANK']}"
    rank, local_world = env.get("RANK"), env.get("LOCAL_WORLD_SIZE")
    if rank and local_world and rank.isdigit() and local_world.isdigit() and int(local_world) > 0:
        return f"group-{int(rank) // int(local_world)}"
    return socket.gethostname()


def place_replicas(nodes: Sequence[str], replicas: int) -> list[tuple[int, ...]]:
    """For every rank, the ranks that hold its ``replicas`` copies (see the module docstring).

    ``nodes[r]`` is rank ``r``'s node name. Nodes are numbered in the order of their lowest
    rank. Raises :class:`ConfigurationError` when there are not ``replicas`` other nodes.
    """
    if type(replicas) is not int or replicas < 1:
        raise ConfigurationError(f"replicas must be a positive integer, got {replicas!r}")
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        if node not in members:
            order.append(node)
            members[node] = []
        members[node].append(rank)
    if replicas > len(order) - 1:
        raise ConfigurationError(
            f"{replicas} replica(s) on other nodes need at least {replicas + 1} nodes, but the "
            f"{len(nodes)} ranks run on {len(order)} ({', '.join(order[:4])}"
            f"{', ...' if len(order) > 4 else ''}); lower replicas, or check how nodes are "
            f"told apart (torchrun's GROUP_RANK, the host name, or {NODE_ENV})"
        )
    index = {node: i for i, node in enumerate(order)}
    placement: list[tuple[int, ...]] = []
    for rank, node in enumerate(nodes):
        i, j = index[node], members[node].index(rank)
        holders = []
        for m in range(1, replicas + 1):
            ranks = members[order[(i + m) % len(order)]]
            holders.append(ranks[j % len(ranks)])
        placement.append(tuple(holders))
    return placement


async def join_peers(tiers: Sequence[object], exchange: Exchange) -> None:
    """Call :meth:`SupportsRendezvous.rendezvous` on each tier that has it, in chain order."""
    for tier in tiers:
        if isinstance(tier, SupportsRendezvous):
            await tier.rendezvous(exchange)
