"""Text renderings of a MemoryPlan: the phase x component table, the host table, one-line verdicts."""
from __future__ import annotations

from typing import List

from verl_hpc.planning import hardware
from verl_hpc.planning.phases import COMPONENTS, MemoryPlan

MARGIN = 0.10  # headroom the shipped configs keep (and --suggest asks for)


def gib(x: float) -> str:
    return f"{x / hardware.GiB:.1f}"


def device_table(plan: MemoryPlan) -> str:
    cols = [c for c in COMPONENTS if any(r[c] for r in plan.table.values())]
    where = "GPU" if plan.device == "gpu" else "host (CPU job)"
    head = f"memory per rank, {where}, GiB (pipeline stage {plan.stage})"
    width = {c: max(8, len(c) + 2) for c in cols}  # narrow columns: the table stays within ~110 chars
    lines = [head, f"{'phase':<14}" + "".join(f"{c:>{width[c]}}" for c in cols) + f"{'total':>8}"]
    for phase, r in plan.table.items():
        mark = "  <- peak" if phase == plan.peak_phase else ""
        lines.append(f"{phase:<14}" + "".join(f"{gib(r[c]):>{width[c]}}" for c in cols)
                     + f"{gib(plan.phase_total(phase)):>8}{mark}")
    return "\n".join(lines)


def host_table(plan: MemoryPlan) -> str:
    lines = [f"host memory per node ({plan.ranks_per_node} ranks), GiB"]
    lines += [f"  {phase:<14}{gib(b):>10}" for phase, b in plan.host.items()]
    if plan.host_limit:
        lines.append(f"  node RAM      {gib(plan.host_limit):>10}")
    return "\n".join(lines)


def verdict(plan: MemoryPlan) -> str:
    what = "GPU" if plan.device == "gpu" else "node RAM"
    peak = plan.checked_peak()
    if plan.limit <= 0:
        return f"memory plan: peak {gib(peak)} GiB per rank ({plan.peak_phase}); {what} size unknown"
    h = plan.headroom()
    state = "fits" if h >= 0 else "DOES NOT FIT"
    return (f"memory plan: peak {gib(peak)} GiB ({plan.peak_phase}) of {gib(plan.limit)} GiB {what}: "
            f"{state}, headroom {h:.0%}")


def refusal(plan: MemoryPlan, suggest_cmd: str) -> str:
    what = "GPU" if plan.device == "gpu" else "node RAM"
    comp = plan.largest_component
    size = plan.table[plan.peak_phase][comp]
    return (f"memory plan: peak {gib(plan.checked_peak())} GiB ({plan.peak_phase}) exceeds the "
            f"{gib(plan.limit)} GiB {what}; largest component {comp} {gib(size)} GiB; "
            f"see `{suggest_cmd}`")


def full_report(plan: MemoryPlan) -> str:
    parts: List[str] = [device_table(plan), "", host_table(plan), "", verdict(plan)]
    parts += [f"  note: {n}" for n in plan.notes]
    parts.append("assumptions: " + "; ".join(f"{k} = {v}" for k, v in hardware.assumptions().items()))
    return "\n".join(parts)
