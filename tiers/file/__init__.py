"""FileTier: durable local storage (NVMe, or any POSIX file system), one data file and one
manifest per step and rank.

- ``tier``: :class:`FileTier` itself (open, stage, put, commit, read, retention).
- ``location``: the layout of a root and the survey ``open()`` makes of it.
- ``io``: positional writes through an aligned bounce buffer, and their durability.
- ``read``: reading shards back in pieces side by side, each checksummed as it lands.

Imports ``lazyckpt.tier`` (and ``lazyckpt.hooks`` for the named crash points) and
``tiers._fs``, as any third-party tier could.
"""
