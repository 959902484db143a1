"""The snapshot format: what a state becomes on the way to storage, and the manifest that
records it.

- ``walk``: walking a user's state into tensors and tagged JSON (the state walk).
- ``values``: tagged JSON, the value tree a state walks into, and building it back.
- ``manifest``: the layout (how tensors are cut into shards) and the manifest recording it.
- ``entries``: the manifest's entries (tensor, segment, shard) and the checks of their fields.
- ``columns``: the column encoding of a manifest (format version 5).
- ``crc``: joining crc32c checksums of pieces into the checksum of the whole.

May import: ``_errors``, ``_gcpause``, ``_distributed``.
Nothing here does I/O or knows a tier; a tier that must read manifests gets them from
``lazyckpt.tier``.
"""
