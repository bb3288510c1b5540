"""Where the ranks are: nodes and ranks per node, from torchrun's environment (this module
imports no torch).

A profile records the world as torchrun lays it out (``--nnodes`` nodes of
``--nproc-per-node`` ranks), read from the variables torchrun gives every rank:
``GROUP_RANK`` (the node's index) and ``LOCAL_WORLD_SIZE`` (ranks on this node), not from
hostnames (containers on different machines often share one). Every rank contributes its
:class:`Place` to the gather the profiler does anyway; :func:`topology` then checks, alike on
every rank, that every node has the same number of ranks and that the ranks are numbered node
by node (node ``k`` holds global ranks ``k*G .. k*G+G-1``, as torchrun numbers them), and
refuses anything else in one line. Without torchrun's variables (a process group of the
caller's, ``usbyte-opt profile --nproc-per-node`` on this host) the world is one node.

Example::

    >>> places = [Place(0, 2), Place(0, 2), Place(1, 2), Place(1, 2)]
    >>> topology(places)
    Topology(nodes=2, ranks_per_node=2)
    >>> try:
    ...     topology([Place(0, 2), Place(0, 2), Place(1, 1)])
    ... except DistributedError as e:
    ...     print(str(e).split("; ")[0])
    topology: nodes have different numbers of ranks (LOCAL_WORLD_SIZE): node 0 has 2, node 1 has 1
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import DistributedError


@dataclass(frozen=True, slots=True)
class Place:
    """One rank's place as torchrun tells it: its node (``GROUP_RANK``) and the ranks on that
    node (``LOCAL_WORLD_SIZE``); ``local_world == 0``: not told (no torchrun variables)."""

    node: int = 0
    local_world: int = 0


@dataclass(frozen=True, slots=True)
class Topology:
    """``nodes`` nodes of ``ranks_per_node`` ranks each."""

    nodes: int = 1
    ranks_per_node: int = 1

    @property
    def hierarchical(self) -> bool:
        """Several nodes with several ranks on each: the intra- and inter-node sweeps run."""
        return self.nodes > 1 and self.ranks_per_node > 1


def place_from_env(env: Mapping[str, str]) -> Place:
    """This rank's :class:`Place` from torchrun's variables in ``env``; ``Place()`` when they are
    absent or not integers.

    Example::

        >>> place_from_env({"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "8"})
        Place(node=1, local_world=8)
        >>> place_from_env({})
        Place(node=0, local_world=0)
    """
    try:
        node, local = int(env["GROUP_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return Place()
    return Place(node, local) if node >= 0 and local >= 1 else Place()


def topology(places: Sequence[Place]) -> Topology:
    """The nodes of a world whose rank ``r`` is at ``places[r]``; one node of every rank when
    any rank was not told its place.

    Raises:
        DistributedError: nodes with different numbers of ranks, or ranks not numbered node by
            node (every rank raises the same, as every rank has every place).

    Example::

        >>> try:
        ...     topology([Place(0, 2), Place(1, 2), Place(0, 2), Place(1, 2)])
        ... except DistributedError as e:
        ...     print(str(e).split(", ")[0])
        topology: ranks are not numbered node by node: rank 1 is on node 1 (GROUP_RANK)
        >>> topology([Place(), Place()])
        Topology(nodes=1, ranks_per_node=2)
    """
    world = len(places)
    if world == 0 or any(p.local_world < 1 for p in places):
        return Topology(1, max(world, 1))
    per_node: dict[int, int] = {}
    for p in places:
        per_node.setdefault(p.node, p.local_world)
    sizes = sorted(set(p.local_world for p in places))
    if len(sizes) > 1:
        shown = ", ".join(f"node {n} has {g}" for n, g in sorted(per_node.items())[:4])
        raise DistributedError("topology: nodes have different numbers of ranks (LOCAL_WORLD_SIZE): "
                               f"{shown}; a profile needs the same number on every node")
    G = sizes[0]
    for r, p in enumerate(places):
        if p.node != r // G:
            raise DistributedError(
                f"topology: ranks are not numbered node by node: rank {r} is on node {p.node} "
                f"(GROUP_RANK), expected node {r // G} (with {G} ranks per node, node k holds "
                f"ranks k*{G} .. k*{G}+{G - 1}, as torchrun numbers them)")
    if world % G:
        raise DistributedError(f"topology: {world} ranks do not fill nodes of {G} "
                               "(LOCAL_WORLD_SIZE)")
    return Topology(world // G, G)


__all__ = ["Place", "Topology", "place_from_env", "topology"]
