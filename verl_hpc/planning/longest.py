"""`--longest`: the longest response each layout can train on the job's GPUs, with and without
splitting each sequence over more ranks.

The layouts: the config's own, and the same ranks with the sequence split over 1, 2, 4 and 8 ranks
(Megatron: parallel.cp, context parallelism, taken out of the data-parallel size; FSDP: fsdp.sp,
Ulysses). A split the rules refuse (cp not dividing the data-parallel ranks, sp not dividing the
heads, cp on a CPU job, a mini-batch that no longer divides) is no row: it is named under the table
with its rule. For each layout a bisection over data.max_response_length (the prompt as
configured) finds the longest response whose plan fits the GPU's memory (--gpu-memory-gb or
slurm.gpu_type; node RAM for a CPU job), judged as --suggest judges a candidate
(suggest.plan_or_refusal).

Why a bisection finds it: the plan's peak never falls as the response grows. Every term that
depends on the length (activations, logits, a cp rank's share of a row, the micro-batches in
flight) grows with a micro-batch's tokens and with the number of micro-batches. Under dynamic
batching (max_tokens_per_microbatch) a micro-batch holds floor(budget / row) full-length rows, so
below the budget its tokens saw-tooth under the budget, and a row of the budget itself (one per
micro-batch, the most micro-batches) is the worst of them; a job of shorter responses packs its
micro-batches up to the budget anyway (rows of any length), so a length below the budget is judged
by the plan at the budget. Judged so, "fits" holds at every length below the longest found and at
none above it (tests/unit/planning/test_plan_longest.py walks the peak along the lengths).

The search stops at the model's max_position_embeddings (the plan refuses a longer sequence): a
row that reaches it names that limit instead of a phase.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import List, Optional, Tuple

from verl_hpc.config.errors import ConfigError
from verl_hpc.config.sections.fsdp import MEGATRON
from verl_hpc.config.validate import validate
from verl_hpc.planning.fsdp import shard_size
from verl_hpc.planning.model_shape import job_arch, role_engine
from verl_hpc.planning.report import gib
from verl_hpc.planning.split import SplitPlan
from verl_hpc.planning.suggest import plan_or_refusal

SPLITS = (1, 2, 4, 8)  # ranks per sequence tried besides the config's own
SEARCH_CAP = 1 << 20  # tokens searched up to where the model names no position limit
ROLES = ("actor", "critic", "prm")  # the roles with a micro-batch token budget


def rounded(tokens: int) -> int:
    """Rounded down to a multiple of 1024 tokens, exact below 1024."""
    return tokens if tokens < 1024 else tokens // 1024 * 1024


@dataclasses.dataclass
class Row:
    label: str
    overrides: List[str]  # what turns the config's layout into this one
    own: bool  # the config's own layout
    longest: int  # the longest response that fits, exact; 0: not even one token
    binds: str  # what stops it: the phase over the limit one token further, or the position limit
    peak: float  # bytes at `shown` (at one token where nothing fits)
    peak_phase: str
    length_overrides: List[str] = dataclasses.field(default_factory=list)  # what sets `shown`

    @property
    def shown(self) -> int:
        return rounded(self.longest)


@dataclasses.dataclass
class Longest:
    rows: List[Row]
    refused: List[Tuple[str, str]]  # (layout, the rule's line)
    prompt: int
    limit: float  # bytes per GPU (node RAM for a CPU job)
    device: str
    margin: float


def length_overrides(cfg, response: int) -> List[str]:
    """data.max_response_length = response, and each role's token budget raised to one full row
    where the row outgrows it: the config check refuses a budget below one sequence, and the plan
    of such a row is the same either way (a longer row is a micro-batch of its own)."""
    seq = cfg.data.max_prompt_length + response
    return [f"data.max_response_length={response}"] + [
        f"{role}.max_tokens_per_microbatch={seq}" for role in ROLES
        if 0 < getattr(cfg, role).max_tokens_per_microbatch < seq]


def _with_length(cfg, response: int):
    """The config with `length_overrides` applied (rollout.max_tokens follows the length where it
    was the length's own, its auto value; an explicit shorter one is kept, at most the length)."""
    c = copy.deepcopy(cfg)
    for item in length_overrides(cfg, response):
        key, value = item.split("=")
        section, field = key.split(".")
        setattr(getattr(c, section), field, int(value))
    follows = cfg.rollout.max_tokens >= cfg.data.max_response_length
    c.rollout.max_tokens = response if follows else min(cfg.rollout.max_tokens, response)
    return c


def _budget_floor(cfg) -> int:
    """The response length at which a full-length row is one micro-batch's whole token budget (the
    largest of the roles that train or score): shorter lengths are judged there (module docstring)."""
    roles = [cfg.actor] + ([cfg.critic] if cfg.critic.enable else [])
    roles += [cfg.prm] if cfg.trainer.job == "rl" and cfg.prm.enable else []
    budget = max(r.max_tokens_per_microbatch for r in roles)
    return max(0, budget - cfg.data.max_prompt_length)


def _groups(plan) -> list:
    return list(plan.groups.values()) if isinstance(plan, SplitPlan) else [plan]


def _binding(plan) -> str:
    if plan.blocking:
        return "vLLM's KV cache (one sequence does not fit)"
    if isinstance(plan, SplitPlan):
        group = plan.groups[plan.binding] if plan.binding in plan.groups else None
        return f"{plan.binding}: {group.peak_phase}" if group is not None else plan.binding
    return plan.peak_phase


def _label(c, engine: str) -> str:
    if engine == MEGATRON:
        p = c.parallel
        parts = [f"tp {p.tp}", f"pp {p.pp}"] + ([f"vpp {p.vpp}"] if p.vpp else []) + [f"cp {p.cp}", f"dp {c.dp}"]
        parts += [f"ep {p.ep}"] if p.ep > 1 else []
        return " ".join(parts)
    return f"fsdp sp {c.fsdp.sp} (shard {shard_size(c)}, dp {c.train_world_size // c.fsdp.sp})"


def _variants(cfg, engine: str):
    """(label, overrides, config, own) of every layout to search, and (label, rule) of those refused."""
    field = "parallel.cp" if engine == MEGATRON else "fsdp.sp"
    own = cfg.parallel.cp if engine == MEGATRON else cfg.fsdp.sp
    out, refused = [], []
    for n in [own] + [n for n in SPLITS if n != own]:
        c = copy.deepcopy(cfg)
        if engine == MEGATRON:
            c.parallel.cp = n
        else:
            c.fsdp.sp = n
        try:
            validate(c, check_model=False)  # the layout rules (tiling, cp's, sp's ranks)
            job_arch(c)  # the rules on the model's shape (sp's heads), as the plan applies them
        except ConfigError as err:
            refused.append((f"{field} = {n}", "; ".join(err.problems)))
            continue
        out.append((_label(c, engine), [] if n == own else [f"{field}={n}"], c, n == own))
    return out, refused


def _search(c, kw, margin: float) -> Tuple[int, str, object]:
    """(the longest response that fits, what binds one token further, the plan shown at the
    rounded length, or at one token where nothing fits) by bisection; the plan is monotone in the
    length as judged here (module docstring)."""
    arch = job_arch(c)
    cap = arch.max_position_embeddings - c.data.max_prompt_length if arch.max_position_embeddings else SEARCH_CAP
    floor = min(_budget_floor(c), cap)

    def judge(length: int):
        plan, err = plan_or_refusal(_with_length(c, max(length, floor)), **kw)
        if plan is None:
            return False, plan, err
        if length < floor:  # vLLM's KV cache holds the sequence itself: its rule at the length's own
            own, _ = plan_or_refusal(_with_length(c, max(length, 1)), **kw)
            for group, at_length in zip(_groups(plan), _groups(own) if own is not None else []):
                group.blocking = at_length.blocking
        return not plan.blocking and plan.fits_memory(margin), plan, err

    if judge(cap)[0]:
        best = cap
        binds = (f"max_position_embeddings {arch.max_position_embeddings}" if arch.max_position_embeddings
                 else f"the search's cap of {SEARCH_CAP} tokens")
    else:
        lo, hi = 0, cap  # fits at lo (0: nothing yet), not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if judge(mid)[0]:
                lo = mid
            else:
                hi = mid
        _, plan, err = judge(hi)
        best, binds = lo, (_binding(plan) if plan is not None else f"refused: {'; '.join(err.problems)}")
        if not best and floor > 1:  # judged at the budget's micro-batch (module docstring)
            budget = _budget_floor(c) + c.data.max_prompt_length
            binds += f" (at a micro-batch of the {budget}-token budget, max_tokens_per_microbatch)"
    return best, binds, judge(max(rounded(best), 1))[1]


def longest(cfg, *, gpu_memory_gb: Optional[float] = None, node_memory_gb: Optional[float] = None,
            margin: float = 0.0) -> Longest:
    """Every layout's longest response (module docstring); `margin`: the headroom a fit keeps."""
    kw = dict(gpu_memory_gb=gpu_memory_gb, node_memory_gb=node_memory_gb)
    variants, refused = _variants(cfg, role_engine(cfg, cfg.model.path))
    rows, limit, device = [], 0.0, "gpu"
    for label, overrides, c, own in variants:
        best, binds, plan = _search(c, kw, margin)
        peak, phase = (plan.checked_peak(), _binding(plan)) if plan is not None else (0.0, "")
        rows.append(Row(label, overrides, own, best, binds, peak, phase,
                        length_overrides(c, rounded(best)) if best else []))
        if plan is not None:
            limit, device = plan.limit, plan.device
    return Longest(rows, refused, cfg.data.max_prompt_length, limit, device, margin)


def print_longest(result: Longest, command: str) -> None:
    what = "per GPU" if result.device == "gpu" else "of node RAM (a CPU job)"
    keep = f", keeping {result.margin:.0%} headroom" if result.margin else ""
    print(f"--longest: the longest data.max_response_length each layout fits in {gib(result.limit)} GiB {what}"
          f"{keep} (prompts of {result.prompt} tokens; rounded down to a multiple of 1024)")
    width = max(len(r.label) for r in result.rows) + len(" (config)") if result.rows else 10
    print(f"  {'layout':<{width}}  {'longest response':>16}  {'peak GiB (phase) there':<30}  "
          "what binds one token further")
    for r in result.rows:
        label = r.label + (" (config)" if r.own else "")
        tokens = f"{r.shown}" if r.longest else "does not fit"
        peak = f"{gib(r.peak)} ({r.peak_phase})"
        print(f"  {label:<{width}}  {tokens:>16}  {peak:<30}  {r.binds}")
    for label, rule in result.refused:
        print(f"  not listed: {label}: {rule}")
    for r in result.rows:
        if r.overrides and r.longest:
            print(f"  e.g. {command} {' '.join(r.overrides + r.length_overrides)}")
