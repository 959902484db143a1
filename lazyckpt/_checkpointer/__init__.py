"""The user-facing Checkpointer: the facades and what they share.

- ``facades``: :class:`Checkpointer` (async) and :class:`SyncCheckpointer`, both bridging to
  one core.
- ``core``: the engine and the synchronous half of every operation, which both facades share.
- ``steps``: the operations on committed steps: restore (eager, lazy, resharding), verify,
  list and delete, run on the engine loop.
- ``lifecycle``: how a Checkpointer ends: close, drain, the preemption signal's drain, the
  close of one dropped unclosed, the close at interpreter exit.
- ``handle``: a snapshot's handle, its progress as awaitables per stage.
- ``holders``: the Checkpointers of this process that are open, and where each was opened,
  for the error a second writer of the same process gets on a location.

Its options are ``lazyckpt._options``, one level down: the engine and capture read them too.

May import: ``_errors``, ``hooks``, ``_gcpause``, ``_distributed``, ``_format``, ``_options``,
``_tiering``, ``_capture``, ``_restore``, ``_engine``.
"""
