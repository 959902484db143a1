"""The tier contract, and what the engine hands a tier: host blocks and shard states.

- ``interface``: the :class:`Tier` base class, its optional capabilities (``Supports*``),
  retention, the entry-point registry; ``lazyckpt.tier`` is its public face.
- ``states``: the shard state machine (h11's rule: every transition in one table, no I/O),
  and the restore table.
- ``arena``: the host arena, one pre-faulted buffer handed out in blocks; the blocks are
  what tiers read from and write into.
- ``calls``: one tier operation under a deadline, retried with back-off, as the engine and
  the command line call a tier.

May import: ``_errors``, ``hooks``, ``_distributed``, ``_format``.
The arena and the states sit here rather than in ``_engine`` because the contract names them
(a tier gets a ``Block``, reports a ``TierLevel``): the engine, capture and restore all
build on the contract, so the contract cannot build on them.
"""
