"""The memory plan of a split job (placement.mode = split): one plan per group of ranks.

The rollout ranks hold only vLLM (weights at rollout.tp, its KV cache share, its activations: its
whole budget, awake for the whole run, since nothing else shares the device and generation goes
on while new weights load); the training ranks hold only the Megatron roles, laid out with
parallel.tp/pp over the training ranks' data parallel. Each group is checked against the limit on
its own; where one node holds ranks of both groups (the rollout ranks end inside a node), that
node's host memory is checked too, with each group's ranks at their own peak (the two groups run
their phases at the same time, in no fixed order).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from verl_hpc.planning.memory_plan import MemoryPlan  # each group's plan, built by phases.plan_job

GROUPS = ("rollout", "training")


def ranks_on_nodes(rollout_ranks: int, world: int, per_node: int, hetjob: bool) -> List[Tuple[int, int]]:
    """(rollout ranks, training ranks) on each node: ranks fill nodes in order (srun's block
    distribution), the rollout ranks first; a heterogeneous job's rollout nodes hold no training rank."""
    if hetjob:
        return [(per_node, 0)] * (rollout_ranks // per_node) + [(0, per_node)] * ((world - rollout_ranks) // per_node)
    nodes = []
    for first in range(0, world, per_node):
        ranks = range(first, min(first + per_node, world))
        rollout = sum(1 for r in ranks if r < rollout_ranks)
        nodes.append((rollout, len(ranks) - rollout))
    return nodes


@dataclasses.dataclass
class SplitPlan:
    rollout: MemoryPlan
    training: MemoryPlan
    nodes: List[Tuple[int, int]]  # (rollout ranks, training ranks) per node

    @property
    def groups(self) -> Dict[str, MemoryPlan]:
        return {"rollout": self.rollout, "training": self.training}

    @property
    def limit(self) -> float:
        return self.training.limit

    @property
    def device(self) -> str:
        return self.training.device

    @property
    def host_limit(self) -> float:
        return self.training.host_limit

    def shared_node(self) -> Optional[Tuple[int, int]]:
        """(rollout ranks, training ranks) of a node that holds both groups, if any."""
        return next(((r, t) for r, t in self.nodes if r and t), None)

    def shared_node_host(self) -> float:
        """Host bytes of a node holding both groups: each group's ranks at that group's host peak."""
        shared = self.shared_node()
        if shared is None:
            return 0.0
        return sum(n * g.host_peak / g.ranks_per_node for n, g in zip(shared, (self.rollout, self.training)))

    def _headrooms(self) -> Dict[str, Optional[float]]:
        h = {name: g.headroom() for name, g in self.groups.items()}
        if self.shared_node() is not None and self.device == "cpu" and self.host_limit > 0:
            h["shared node"] = 1.0 - self.shared_node_host() / self.host_limit
        return h

    @property
    def binding(self) -> str:
        """The check with the least headroom: 'rollout', 'training' or 'shared node'."""
        known = {k: v for k, v in self._headrooms().items() if v is not None}
        return min(known, key=known.get) if known else "training"

    def headroom(self) -> Optional[float]:
        return self._headrooms().get(self.binding)

    def checked_peak(self) -> float:
        if self.binding == "shared node":
            return self.shared_node_host()
        return self.groups[self.binding].checked_peak()

    @property
    def blocking(self) -> List[str]:
        return [f"{name} group: {line}" for name, g in self.groups.items() for line in g.blocking]

    def fits(self, margin: float = 0.0) -> bool:
        return not self.blocking and self.fits_memory(margin)

    def fits_memory(self, margin: float = 0.0) -> bool:
        return all(h is None or h >= margin for h in self._headrooms().values())
