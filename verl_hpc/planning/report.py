"""Text renderings of a MemoryPlan (or a split job's SplitPlan): the phase x component table, the
host table, one-line verdicts."""
from __future__ import annotations

from typing import List, Union

from verl_hpc.planning import hardware
from verl_hpc.planning.phases import COMPONENTS, MemoryPlan
from verl_hpc.planning.split import SplitPlan

MARGIN = 0.10  # headroom the shipped configs keep (and --suggest asks for)
Plan = Union[MemoryPlan, SplitPlan]


def gib(x: float) -> str:
    return f"{x / hardware.GiB:.1f}"


def _group_words(plan: MemoryPlan) -> str:
    """'' for a colocated plan; 'training group (6 ranks): ' for a group of a split job."""
    if plan.group == "colocated":
        return ""
    return f"{plan.group} group ({plan.ranks} rank{'s' if plan.ranks != 1 else ''}): "


def device_table(plan: MemoryPlan) -> str:
    cols = [c for c in COMPONENTS if any(r[c] for r in plan.table.values())]
    where = "GPU" if plan.device == "gpu" else "host (CPU job)"
    stage = "" if plan.group == "rollout" else f" (pipeline stage {plan.stage})"  # vLLM has no stages
    head = f"{_group_words(plan)}memory per rank, {where}, GiB{stage}"
    width = {c: max(8, len(c) + 2) for c in cols}  # narrow columns: the table stays within ~110 chars
    lines = [head, f"{'phase':<14}" + "".join(f"{c:>{width[c]}}" for c in cols) + f"{'total':>8}"]
    for phase, r in plan.table.items():
        mark = "  <- peak" if phase == plan.peak_phase else ""
        lines.append(f"{phase:<14}" + "".join(f"{gib(r[c]):>{width[c]}}" for c in cols)
                     + f"{gib(plan.phase_total(phase)):>8}{mark}")
    return "\n".join(lines)


def host_table(plan: MemoryPlan) -> str:
    whose = "" if plan.group == "colocated" else f" {plan.group}"
    lines = [f"host memory per node ({plan.ranks_per_node}{whose} ranks), GiB"]
    lines += [f"  {phase:<14}{gib(b):>10}" for phase, b in plan.host.items()]
    if plan.host_limit:
        lines.append(f"  node RAM      {gib(plan.host_limit):>10}")
    return "\n".join(lines)


def _what(plan: Plan) -> str:
    return "GPU" if plan.device == "gpu" else "node RAM"


def _state(plan: Plan) -> str:
    if plan.blocking:
        return "DOES NOT RUN: " + "; ".join(plan.blocking)
    h = plan.headroom()
    return f"{'fits' if h >= 0 else 'DOES NOT FIT'}, headroom {h:.0%}"


def _shared_words(plan: SplitPlan) -> str:
    r, t = plan.shared_node()
    return f"a node of {r} rollout + {t} training rank(s) holds {gib(plan.shared_node_host())} GiB of host memory"


def verdict(plan: Plan) -> str:
    if isinstance(plan, SplitPlan):
        return _split_verdict(plan)
    peak = plan.checked_peak()
    if plan.limit <= 0:
        return f"memory plan: peak {gib(peak)} GiB per rank ({plan.peak_phase}); {_what(plan)} size unknown"
    return (f"memory plan: peak {gib(peak)} GiB ({plan.peak_phase}) of {gib(plan.limit)} GiB {_what(plan)}: "
            f"{_state(plan)}")


def _split_verdict(plan: SplitPlan) -> str:
    peaks = [f"{name} group peak {gib(g.checked_peak())} GiB ({g.peak_phase})" for name, g in plan.groups.items()]
    if plan.device == "cpu" and plan.shared_node() is not None:
        peaks.append(_shared_words(plan))
    if plan.limit <= 0:
        return f"memory plan (split): {'; '.join(peaks)}; {_what(plan)} size unknown"
    return (f"memory plan (split): {'; '.join(peaks)}; of {gib(plan.limit)} GiB {_what(plan)}: {_state(plan)} "
            f"({plan.binding} the tightest)")


def refusal(plan: Plan, suggest_cmd: str) -> str:
    if plan.blocking:
        return f"memory plan: {plan.blocking[0]}"
    if isinstance(plan, SplitPlan):
        if plan.binding == "shared node":
            return (f"memory plan: {_shared_words(plan)}, over the {gib(plan.host_limit)} GiB node RAM; give "
                    f"each group nodes of its own (placement.rollout_nodes) or see `{suggest_cmd}`")
        group = plan.groups[plan.binding]
        return refusal(group, suggest_cmd).replace("memory plan: ", f"memory plan: {plan.binding} group ", 1)
    comp = plan.largest_component
    size = plan.table[plan.peak_phase][comp]
    return (f"memory plan: peak {gib(plan.checked_peak())} GiB ({plan.peak_phase}) exceeds the "
            f"{gib(plan.limit)} GiB {_what(plan)}; largest component {comp} {gib(size)} GiB; "
            f"see `{suggest_cmd}`")


def full_report(plan: Plan) -> str:
    groups = list(plan.groups.values()) if isinstance(plan, SplitPlan) else [plan]
    parts: List[str] = []
    if isinstance(plan, SplitPlan):
        parts += [f"split placement: {plan.rollout.ranks} rollout rank(s) hold only vLLM, {plan.training.ranks} "
                  "training rank(s) only the Megatron roles; each group is checked on its own", ""]
    for g in groups:
        parts += [device_table(g), "", host_table(g), ""]
    parts.append(verdict(plan))
    parts += [f"  note: {g.group + ' group: ' if g.group != 'colocated' else ''}{n}" for g in groups for n in g.notes]
    parts.append("assumptions: " + "; ".join(f"{k} = {v}" for k, v in hardware.assumptions().items()))
    return "\n".join(parts)
