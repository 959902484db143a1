"""The engine: the scheduler that moves every shard of every snapshot down the tier chain.

- ``scheduler``: :class:`Engine`, one per Checkpointer: joins the flows, the commits and the
  records on the engine loop.
- ``loop``: the engine's own event loop on a thread of its own.
- ``flight``: a snapshot in flight, the engine's bookkeeping of it, and its timings.
- ``flows``: the host stage and each shard's way through the tiers (capture, checksum, the
  host tier, each durable tier in chain order).
- ``commit``: committing a flight's manifest on a stage, the ranks' agreement per step,
  retention passes and deletes.
- ``records``: how a flight ends: aborts, blocks given back, history, counters.
- ``incremental``: which shards a tier already holds and which need no capture, decided
  per flight (it reads and writes the flight's bookkeeping, so it lives beside it).

May import: ``_errors``, ``hooks``, ``_distributed``, ``_format``, ``_options``, ``_tiering``,
``_capture``, ``_restore``.
The engine re-reads stored shards through restore's verified fetch.
"""
