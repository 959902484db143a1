"""Several ranks, one job: what they agree on and where each rank stands among the others.

- ``coordinator``: the ranks' agreement on each step (is step s committed on tier k?) over
  lazyckpt's own process group, and the context a Checkpointer runs in.
- ``chunks``: what a DTensor's local chunk or a replicated tensor looks like in a snapshot
  (the records the state walk writes), nothing about restoring them.
- ``placement``: which node a rank is on and which ranks hold its replicas (peer tiers).
- ``preemption``: draining on demand and on a preemption signal.

May import: ``_errors``.
Everything above builds on it; it knows nothing of the format, the tiers or the engine.
"""
