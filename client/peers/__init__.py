"""Peer replicas: each committed local copy also kept on the local tiers of other nodes of the job, so
that a node back on a new machine restores from a peer's disk instead of the durable tier.

Each training process with a local tier serves it read-only over HTTP (`blob_server`); the nodes that
hold a node's copies (`ring`) pull them through a filesystem over that server (`filesystem`), every
blob verified on arrival, and record them with the service as `peer` copies (`replication`); a
restoring node reads the copy a peer holds through the same filesystem (`tier`)."""

__all__: list[str] = []
