"""Restore: reading committed snapshots back, every byte verified.

- ``restore``: restoring a snapshot from the fastest tier with a good copy, shard by shard
  (eager and lazy), into new tensors or an ``into=`` target.
- ``fetch``: the one verified read every reader takes (restore, verify, the command line).
- ``keys``: matching an ``into=`` target's keys to the snapshot's, before any byte is read.
- ``into``: loading restored state into live objects (``restore(into=...)``'s last step).
- ``lazy``: the lazy restores in progress (guarded optimizers whose state is still loading).
- ``reshard``: distributed state on restore: DTensor chunks onto another layout, and which
  rank writes a replicated tensor.
- ``verify``: verifying a step, every shard on every tier that lists it.
- ``device``: restoring straight into CUDA tensors.

May import: ``_errors``, ``hooks``, ``_gcpause``, ``_distributed``, ``_format``, ``_options``,
``_tiering``, ``_capture``.
Restore uses capture's optimizers (a lazy restore fills guarded ones) and its CUDA device
seam (a restore into device tensors).
"""
