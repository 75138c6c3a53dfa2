"""Which node each launched rank runs on, and which node holds the launch's store: what a
lost node is named by. The ranks say it at the start (see agreements.py); before that, or for
a rank that never said, the launcher's own numbering stands in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from harness.common.launch_detect import Launch


@dataclass(frozen=True)
class Nodes:
    """The launch's nodes as the ranks said them ("node 1 (host n2)")."""

    launch: Launch
    said: Mapping[int, str] = field(default_factory=dict)  # rank -> its node
    store_node: str = ""  # the node that holds the launch's store ("" if unknown)

    def node_of(self, rank: int) -> str:
        """`rank`'s node as it said; else as the launcher numbers nodes, each running
        LOCAL_WORLD_SIZE consecutive ranks ("" where even that is unknown)."""
        said = self.said.get(rank)
        if said is not None:
            return said
        launch = self.launch
        if launch.node is None or launch.world_size % launch.local_world_size:
            return ""
        return f"node {rank // launch.local_world_size}"

    def ranks_on(self, node: str) -> list[int]:
        return [r for r in range(self.launch.world_size) if self.node_of(r) == node]

    def store_rank(self) -> int | None:
        """The lowest rank on the store's node (None where that node is unknown)."""
        ranks = self.ranks_on(self.store_node) if self.store_node else []
        return ranks[0] if ranks else None

    def leads_node(self, rank: int) -> bool:
        """Whether `rank` is the lowest of its node's (it speaks for its node)."""
        ranks = self.ranks_on(self.node_of(rank))
        return bool(ranks) and ranks[0] == rank

    def named(self, ranks: list[int]) -> str:
        """The nodes of `ranks`, each once ("node unknown" for a rank that never said)."""
        return ", ".join(dict.fromkeys(self.said.get(r, "node unknown") for r in ranks))
