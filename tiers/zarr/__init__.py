"""ZarrTier: snapshots as Zarr v3 groups on a local or Lustre path or on S3, readable by
plain zarr and tensorstore.

- ``tier``: :class:`ZarrTier` itself.
- ``core``: its construction and options, the store it writes through, the array writes.
- ``location``: opening a location: refuse a foreign one, create the root, take the writer.
- ``writer``: one writer per location (a lock on a path, a lease on S3) and the commit
  index it writes.
- ``layout``: where a snapshot lives in the store, and the metadata documents.
- ``codec``: a shard encoded as the chunk object Zarr stores.
- ``dtype``: Zarr v3 data types for torch dtypes.
- ``store``: a Zarr store over a directory whose writes survive a crash.
- ``s3``: S3 settings: options, environment variables, the object store built from them.

Imports ``lazyckpt.tier`` (and ``lazyckpt.hooks``), ``tiers._fs`` and zarr.
"""
