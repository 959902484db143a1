"""PeerTier: every rank's shards also kept in the memory of ranks on other nodes.

- ``tier``: :class:`PeerTier`, the sending side.
- ``holder``: the replica server that keeps other ranks' replicas.
- ``wire``: the wire protocol: frames on a TCP connection and the errors a peer reports.

Imports ``lazyckpt.tier`` and ``tiers.file`` (a holder keeps the replicas it holds in FileTiers).
"""
