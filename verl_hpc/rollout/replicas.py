"""Inference replicas: which prompts this rank generates, and putting the shards back together.

`rollout.tp` consecutive ranks form one inference tensor-parallel group, which is one data-parallel
replica: ranks [0, tp) are replica 0, [tp, 2tp) replica 1, ... (the order vLLM's external launcher
gives its TP groups). With R replicas and P prompts, replica r generates the contiguous shard
[start_r, end_r); the first P % R replicas take one prompt more. All TP ranks of a replica generate
the same shard together (vLLM's TP needs identical input on them); its TP rank 0 (the leader)
contributes the rows, and one all_gather over the default group gives every rank all shards in
replica order, which is prompt order.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from verl_hpc.config.errors import ConfigError, raise_if_any
from verl_hpc.config.layout import inference_tp_problems
from verl_hpc.rollout.result import ShardOutput


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    rank: int
    world_size: int
    tp: int

    def __post_init__(self):
        if self.tp < 1:
            raise ConfigError(f"inference tensor-parallel size must be > 0, got {self.tp}")
        raise_if_any(inference_tp_problems(self.world_size, self.tp))

    @classmethod
    def detect(cls, tp: int, ctx=None) -> "ReplicaLayout":
        """From a RankContext, else from torch.distributed if initialised, else one process."""
        if ctx is not None:
            return cls(ctx.rank, ctx.world_size, tp)

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), tp)
        return cls(0, 1, tp)

    @property
    def replica(self) -> int:
        return self.rank // self.tp

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    def shard(self, num_prompts: int, replica: int | None = None) -> range:
        r = self.replica if replica is None else replica
        base, extra = divmod(num_prompts, self.num_replicas)
        start = r * base + min(r, extra)
        return range(start, start + base + (1 if r < extra else 0))


def gather_shards(layout: ReplicaLayout, local: ShardOutput) -> ShardOutput:
    """Every rank gets all replicas' rows in prompt order. A collective over the default group
    when world_size > 1: every rank must call it, the same number of times."""
    parts, _ = gather_replicas(layout, local, None)
    return merged(parts)


def gather_replicas(layout: ReplicaLayout, local: Optional[ShardOutput], fault) -> Tuple[Dict[int, ShardOutput], list]:
    """({replica: its rows}, every rank's fault): one all_gather over the default group, in which a
    rank sends its replica's rows (the leader, when its engine did not fail) and its fault (an
    rollout.recovery.EngineFault, or None). Every rank gets the same answer, so all decide alike
    what to do about a failed replica (rollout/recovery.py). A replica with a fault on any of its
    ranks gives no rows. A collective when world_size > 1."""
    if layout.world_size == 1:
        return ({layout.replica: local} if fault is None and local is not None else {}), [f for f in (fault,) if f]
    gathered: List[object] = [None] * layout.world_size
    dist.all_gather_object(gathered, (layout.replica, local if layout.is_leader and fault is None else None, fault))
    faults = [f for _, _, f in gathered if f is not None]
    failed = {f.replica for f in faults}
    parts = {replica: rows for replica, rows, _ in gathered if rows is not None and replica not in failed}
    return parts, faults


def merged(parts: Dict[int, ShardOutput]) -> ShardOutput:
    """The replicas' rows in replica order, which is prompt order."""
    out = ShardOutput.empty()
    for replica in sorted(parts):
        out.extend(parts[replica])
    return out
