"""Which node a rank is on, and on which nodes its files' copies live.

Node identity comes from the launcher: every node runs the same number of ranks, numbered node
by node (torchrun, the ``deepspeed`` launcher, mpirun and Slurm all do), so rank r is on node
``r // ranks_per_node``. Rank r's replicas go to the same local rank on the next `replicas`
nodes, never to its own node (a copy on the node that dies with it protects nothing): with
nodes 0..N-1, node n's files are copied to nodes n+1, ..., n+replicas (mod N). A job with
fewer other nodes than `replicas` keeps a copy on each of them (`replicas_for`): a job relaunched
on fewer nodes after a failure runs with the config it was started with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """How a job's ranks sit on its nodes: `world_size` ranks, `ranks_per_node` on each."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"the node-local tier needs every node to run the same number of ranks: "
                f"{self.world_size} ranks do not split into nodes of {self.ranks_per_node}")

    @classmethod
    def of(cls, local_world_sizes: Sequence[int]) -> NodeLayout:
        """From every rank's local world size (an all-gather: the same answer on every rank);
        ValueError names the ranks that differ."""
        sizes = list(local_world_sizes)
        if not sizes:
            raise ValueError("no ranks")
        odd = [rank for rank, size in enumerate(sizes) if size != sizes[0]]
        if odd:
            raise ValueError(
                f"the node-local tier needs every node to run the same number of ranks: rank 0 "
                f"has {sizes[0]} on its node, rank {odd[0]} has {sizes[odd[0]]}")
        return cls(world_size=len(sizes), ranks_per_node=sizes[0])

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def rank_at(self, node: int, local_rank: int) -> int:
        return node * self.ranks_per_node + local_rank % self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node)

    def replica_nodes(self, node: int, replicas: int) -> list[int]:
        """The nodes that hold copies of node `node`'s files, nearest first."""
        return [(node + k) % self.nodes for k in range(1, replicas_for(replicas, self.nodes) + 1)]

    def replica_ranks(self, rank: int, replicas: int) -> list[int]:
        """The ranks that receive rank `rank`'s files: its local rank on each replica node."""
        return [self.rank_at(node, self.local_rank(rank))
                for node in self.replica_nodes(self.node_of(rank), replicas)]

    def holders(self, rank: int, replicas: int) -> list[int]:
        """The nodes that hold rank `rank`'s files after a save: its own, then its replicas'."""
        node = self.node_of(rank)
        return [node, *self.replica_nodes(node, replicas)]


def replicas_for(replicas: int, nodes: int) -> int:
    """The copies a job of `nodes` nodes keeps of each file when `replicas` are asked for: as
    many, or one on every other node where there are fewer (none on a single node)."""
    return max(0, min(replicas, nodes - 1))


__all__ = ["NodeLayout", "replicas_for"]
