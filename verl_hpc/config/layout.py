"""The parallel layout rules, written once: how tp x cp x pp tiles the world (tp * cp * pp * dp =
the training ranks; cp = Megatron's context parallel), the data-parallel size that follows, and
how a model's heads, FFN and layers must split across tp and pp (cp splits sequences, not weights:
its ranks hold replicas, like dp's).

Experts (a mixture-of-experts model) follow Megatron-Core's second tiling of the same ranks: within
each pipeline stage the tp * cp * dp ranks are regrouped as etp * ep * edp (expert tensor parallel,
expert parallel, expert data parallel), so ep * etp must divide tp * cp * dp; the experts split
over ep (whole experts per rank), each expert's FFN over etp (default: etp = tp).

Config validation (before submission), Megatron's process-group set-up and the model mapping all
call these, so a rule and its message cannot drift between the login node and the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from verl_hpc.config.errors import ConfigError, raise_if_any
from verl_hpc.config.hf_model import ModelShape


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    vpp: Optional[int] = None
    world_words: str = ""  # how the world size was formed, for messages
    ep: int = 1  # expert parallel
    etp: Optional[int] = None  # expert tensor parallel; None = tp
    # fsdp.sp: the FSDP engine's sequence-parallel groups. Its ranks shard the weights with the
    # others (FSDP) but share their micro-batches, so a group is one data-parallel rank
    sp: int = 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def edp(self) -> int:
        """Expert data-parallel size (replicas of each expert); 0 when the experts do not tile."""
        per_stage, experts = self.tp * self.cp * self.dp, self.ep * self.expert_tp
        return per_stage // experts if experts > 0 and per_stage and per_stage % experts == 0 else 0

    @property
    def model_size(self) -> int:
        """Ranks that share one data-parallel rank's micro-batches (a model replica's, or an FSDP
        sequence-parallel group's)."""
        return self.tp * self.pp * self.cp * self.sp

    @property
    def tiles(self) -> bool:
        return min(self.world_size, self.tp, self.pp, self.cp, self.sp) > 0 and self.world_size % self.model_size == 0

    @property
    def dp(self) -> int:
        """Data-parallel size; only meaningful when `tiles` (0 otherwise)."""
        return self.world_size // self.model_size if self.tiles else 0

    @property
    def dp_words(self) -> str:
        cp = f" * parallel.cp {self.cp}" if self.cp > 1 else ""
        sp = f" * fsdp.sp {self.sp}" if self.sp > 1 else ""
        return (f"the data-parallel size {self.dp} (world size {self.world_size} / "
                f"(parallel.tp {self.tp}{cp} * parallel.pp {self.pp}{sp}))")

    def problems(self) -> List[str]:
        """Tiling: positive sizes whose product divides the world."""
        p = [f"parallel.{name}: must be > 0, got {value}" for name, value in
             (("tp", self.tp), ("pp", self.pp), ("cp", self.cp)) if not isinstance(value, int) or value < 1]
        if self.vpp is not None and self.vpp <= 0:
            p.append(f"parallel.vpp: must be > 0 (or null), got {self.vpp}")
        if p or self.world_size <= 0:
            return p
        if not self.tiles:
            names, values = ["parallel.tp", "parallel.pp"], [self.tp, self.pp]
            if self.cp > 1:
                names, values = names + ["parallel.cp"], values + [self.cp]
            if self.sp > 1:
                names, values = names + ["fsdp.sp"], values + [self.sp]
            valid = ""
            if self.cp > 1 and self.sp == 1 and self.world_size % (self.tp * self.pp) == 0:
                rest = self.world_size // (self.tp * self.pp)
                valid = f"; valid parallel.cp: {', '.join(str(d) for d in range(1, rest + 1) if rest % d == 0)}"
            p.append(f"{' * '.join(names)} = {' * '.join(map(str, values))} = {self.model_size} does not "
                     f"divide {self.world_words or f'the world size {self.world_size}'}{valid}")
        if self.vpp is not None and self.pp <= 1:
            p.append(f"parallel.vpp = {self.vpp} needs parallel.pp > 1 (got {self.pp}): it interleaves "
                     "pipeline stages")
        p += [f"parallel.{name}: must be > 0, got {value}" for name, value in
              (("ep", self.ep), ("etp", self.expert_tp)) if not isinstance(value, int) or value < 1]
        if self.tiles and self.ep > 0 and self.expert_tp > 0 and self.edp == 0:
            p.append(f"parallel.ep * parallel.etp = {self.ep} * {self.expert_tp} does not divide the "
                     f"{self.tp * self.cp * self.dp} ranks of a pipeline stage (parallel.tp {self.tp} * "
                     f"{'parallel.cp ' + str(self.cp) + ' * ' if self.cp > 1 else ''}data parallel "
                     f"{self.dp}): expert parallelism regroups those ranks")
        return p

    def model_problems(self, m: ModelShape) -> List[str]:
        """The model's heads, KV heads and FFN split over tp; its layers over pp (x vpp)."""
        p = [f"parallel.tp = {self.tp} does not divide the model's {name} = {count} {m.source}"
             for name, count in (("num_attention_heads", m.heads), ("num_key_value_heads", m.kv_heads),
                                 ("intermediate_size", m.ffn))
             if self.tp > 0 and count and count % self.tp]
        if self.ep > 1 and not m.experts:
            p.append(f"parallel.ep = {self.ep} needs a mixture-of-experts model; the model has no experts "
                     f"{m.source}")
        if m.experts and self.ep > 0 and m.experts % self.ep:
            valid = ", ".join(str(d) for d in range(1, m.experts + 1) if m.experts % d == 0)
            p.append(f"parallel.ep = {self.ep} does not divide the model's number of experts = {m.experts} "
                     f"{m.source}: each expert-parallel rank holds whole experts; valid: {valid}")
        if m.expert_ffn and self.expert_tp > 0 and m.expert_ffn % self.expert_tp:
            p.append(f"parallel.etp = {self.expert_tp} does not divide the model's expert intermediate size "
                     f"= {m.expert_ffn} {m.source}")
        if m.shared_ffn and self.tp > 0 and m.shared_ffn % self.tp:
            p.append(f"parallel.tp = {self.tp} does not divide the model's shared_expert_intermediate_size "
                     f"= {m.shared_ffn} {m.source}")
        stages = self.pp * (self.vpp or 1)
        if stages > 0 and m.layers % stages:
            what = "parallel.pp" if self.vpp is None else f"parallel.pp * parallel.vpp = {self.pp} * {self.vpp}"
            p.append(f"{what} = {stages} does not divide the model's num_hidden_layers = {m.layers} {m.source}")
        return p

    def require(self, model: Optional[ModelShape] = None) -> int:
        """The data-parallel size, or a ConfigError listing every broken rule."""
        raise_if_any(self.problems() + (self.model_problems(model) if model else []))
        return self.dp


def inference_tp_problems(world_size: int, rollout_tp: int, world_words: str = "") -> List[str]:
    """Each group of rollout.tp consecutive ranks is one inference replica: it must tile the world."""
    if world_size <= 0 or rollout_tp <= 0 or world_size % rollout_tp == 0:
        return []
    valid = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
    return [f"rollout.tp = {rollout_tp} does not divide {world_words or f'the world size {world_size}'}: each "
            f"group of rollout.tp consecutive ranks is one inference replica; valid: {valid}"]


def rollout_tp_problems(rollout_tp: int, m: ModelShape) -> List[str]:
    """vLLM's rule: query heads split evenly; KV heads split evenly, or are replicated when the
    inference TP is a multiple of them."""
    kv_ok = m.kv_heads % rollout_tp == 0 if rollout_tp <= m.kv_heads else rollout_tp % m.kv_heads == 0
    if rollout_tp > 0 and (m.heads % rollout_tp or not kv_ok):
        return [f"rollout.tp = {rollout_tp} does not fit the model's num_attention_heads = {m.heads} / "
                f"num_key_value_heads = {m.kv_heads} {m.source}: it must divide both, or be a multiple of "
                "the KV heads"]
    return []


__all__ = ["ConfigError", "Layout", "inference_tp_problems", "rollout_tp_problems"]
