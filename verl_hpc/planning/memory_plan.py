"""One group of ranks' memory plan: bytes per rank for each phase x component, the limits it is
checked against, and the checks. plan_job (phases.py) fills it in; a split job holds one per group
(split.py), the reports render it (report.py).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional


@dataclasses.dataclass
class MemoryPlan:
    table: Dict[str, Dict[str, float]]  # phase -> component -> bytes (one rank)
    host: Dict[str, float]  # phase -> bytes per node
    limit: float  # device bytes per rank (GPU) or node RAM (CPU job)
    host_limit: float  # node RAM (0 = unknown)
    device: str  # gpu | cpu
    stage: int  # the pipeline stage the table describes
    ranks_per_node: int
    notes: List[str]
    group: str = "colocated"  # colocated | rollout | training (placement.mode = split)
    ranks: int = 0  # ranks of this group in the job
    # what stops the job whatever its peak (vLLM's KV cache below one sequence): no fit
    blocking: List[str] = dataclasses.field(default_factory=list)

    def phase_total(self, phase: str) -> float:
        return sum(self.table[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.table, key=self.phase_total)

    @property
    def peak(self) -> float:
        return self.phase_total(self.peak_phase)

    @property
    def largest_component(self) -> str:
        row = self.table[self.peak_phase]
        return max(row, key=row.get)

    @property
    def host_peak(self) -> float:
        return max(self.host.values()) if self.host else 0.0

    def checked_peak(self) -> float:
        """What is compared against the limit: the device peak on GPUs, the node's host peak on CPUs."""
        return self.peak if self.device == "gpu" else self.host_peak

    def headroom(self) -> Optional[float]:
        """Fraction of the limit left at the peak; None when the limit is unknown."""
        if self.limit <= 0:
            return None
        return 1.0 - self.checked_peak() / self.limit

    def fits(self, margin: float = 0.0) -> bool:
        return not self.blocking and self.fits_memory(margin)

    def fits_memory(self, margin: float = 0.0) -> bool:
        """The peak against the limit alone (`blocking` aside)."""
        h = self.headroom()
        return h is None or h >= margin
