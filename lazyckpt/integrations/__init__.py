"""Adapters that plug lazyckpt into the frameworks people train with.

Each integration is a module of its own, imported by its full path, so a framework that is
not installed never breaks ``import lazyckpt``::

    from lazyckpt.integrations.dcp import LazyStorageWriter, LazyStorageReader
    from lazyckpt.integrations.torchtitan import LazyCheckpointManager
    from lazyckpt.integrations.lightning import LazyCheckpointIO
    from lazyckpt.integrations.huggingface import LazyCheckpointCallback
    from lazyckpt.integrations.deepspeed import LazyCheckpointEngine

See ``docs/integrations.md``.
"""
