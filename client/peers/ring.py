"""Who keeps whose copies: the job's nodes in a ring, in their declared order; each node's copies are
kept by the `replicas` nodes after it. Neighbours in the declared order are often on one machine (the
ranks of a host): name the nodes so that the next ones run elsewhere — docs/operations.md, "Peer replicas"."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["holders_of", "held_by"]


def holders_of(node: str, nodes: Sequence[str], replicas: int) -> list[str]:
    """The nodes that keep `node`'s copies, nearest first (none when `node` is not in `nodes`)."""
    if node not in nodes:
        return []
    at = list(nodes).index(node)
    return [nodes[(at + step) % len(nodes)] for step in range(1, min(replicas, len(nodes) - 1) + 1)]


def held_by(node: str, nodes: Sequence[str], replicas: int) -> list[str]:
    """The nodes whose copies `node` keeps: those it is a holder of."""
    return [other for other in nodes if node in holders_of(other, nodes, replicas)]
