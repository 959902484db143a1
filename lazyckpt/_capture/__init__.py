"""Capture: getting a snapshot's bytes off the training tensors into host blocks.

- ``cpu``: the capture backends of the CPU path (eager and lazy copies, version checks of
  the source tensors) and the checksum stage that follows them.
- ``cuda/``: the CUDA path: side-stream device-to-host copies polled through events, the
  device behind a seam, and the stream guard's optimizer step pre-hook.
- ``optimizers``: the optimizers a guard watches (the torch optimizer behind a wrapper, the
  wait moved behind a step's closure, shape changes), and those a lazy restore fills.

May import: ``_errors``, ``hooks``, ``_distributed``, ``_format``, ``_options``, ``_tiering``.
"""
