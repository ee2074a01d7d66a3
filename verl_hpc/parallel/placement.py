"""Where Megatron's groups landed on the nodes: one log line, and a warning for a bad layout.

On a cluster, tensor-parallel groups exchange activations every layer and belong inside one node
(NVLink); data-parallel groups exchange gradients once per step and may cross nodes. Megatron's
default order puts consecutive ranks into a TP group, so `srun --ntasks-per-node=G` with TP <= G
and TP dividing G keeps each TP group inside a node. A layout that splits a TP group across
nodes still runs, only much slower: it is worth a warning, not an error.
"""
from __future__ import annotations

import dataclasses
import logging
import socket

import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    hosts: tuple[str, ...]  # host of every rank, by global rank
    tp_groups: tuple[tuple[int, ...], ...]
    dp_groups: tuple[tuple[int, ...], ...]

    def nodes_of(self, group) -> list[str]:
        return sorted({self.hosts[r] for r in group})

    @property
    def tp_inside_nodes(self) -> bool:
        return all(len(self.nodes_of(g)) == 1 for g in self.tp_groups)

    def describe(self) -> str:
        n = len(set(self.hosts))
        dp_nodes = max(len(self.nodes_of(g)) for g in self.dp_groups)
        return (f"placement: {len(self.hosts)} ranks on {n} node(s); TP groups "
                + ("each inside one node" if self.tp_inside_nodes else "SPLIT ACROSS NODES")
                + f" {list(self.tp_groups)}; DP groups span up to {dp_nodes} node(s) {list(self.dp_groups)}")


def gather_placement() -> Placement:
    """Collective over the world: every rank's host and its TP and DP group members."""
    from megatron.core import parallel_state as ps

    mine = (socket.gethostname(),
            tuple(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())),
            tuple(dist.get_process_group_ranks(ps.get_data_parallel_group())))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return Placement(hosts=tuple(e[0] for e in everyone),
                     tp_groups=tuple(sorted({e[1] for e in everyone})),
                     dp_groups=tuple(sorted({e[2] for e in everyone})))


def log_placement() -> Placement:
    p = gather_placement()
    if dist.get_rank() == 0:
        log.info(p.describe())
        if not p.tp_inside_nodes:
            log.warning("tensor-parallel groups span nodes: every layer's all-reduce crosses the "
                        "inter-node network; use tasks_per_node divisible by parallel.tp")
    return p
