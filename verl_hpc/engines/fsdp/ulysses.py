"""Ulysses sequence parallelism for the FSDP engine (`fsdp.sp`): `sp` consecutive ranks share each
sequence of their micro-batches.

    group = SequenceGroup.build(sp)                 # collective: every rank builds every group
    install(model, group)                           # the model's attention now runs over the group
    ids, pos = group.slice(input_ids), group.slice(position_ids)   # this rank's tokens
    full = group.assemble(local_values)             # [B, T] per-token results of the whole sequence

Outside attention every layer works token by token, so each rank runs embeddings, norms, MLPs and
the output layer on its own contiguous slice of S/sp tokens (with their global position ids, so
RoPE is the unsplit model's). Attention needs every earlier token: an all-to-all regroups q, k, v
from "my tokens, all heads" to "all tokens, my heads" ([B, H, S/sp, D] -> [B, H/sp, S, D]), the
model's own attention kernel runs on the whole sequence for its heads (SDPA on CPU, flash
attention on GPUs: whatever `attn_implementation` the model was built with), and a second
all-to-all brings the output back to "my tokens, all heads". Per layer that is 4 all-to-alls in the
forward (q, k, v, out) of (sp-1)/sp of each tensor; the backward mirrors them.

Grouped-query attention: the KV heads are split over the group like the query heads. A model with
fewer KV heads than `sp` has each KV head repeated sp / kv times first (so every rank has the KV
head its query heads read); kv must then divide sp, or sp divide kv. Rows are right-padded and
causal: a real token never attends to a pad, so no mask travels (packing and sliding windows are
refused where the engine is built).

The loss sees the whole sequence on every rank of the group: `assemble` sums the ranks' per-token
results (each rank fills its own positions), and only this rank's own positions carry its autograd
graph; the others are detached copies. Each rank's backward so gives the gradient of the loss with
respect to its own tokens, and FSDP's sum over all ranks adds the group's parts into the whole
gradient: the same update as one rank holding the whole sequence.

Written here rather than taken from a library: the Ulysses implementations in the field (DeepSpeed's
`DistributedAttention`, verl's monkey patch of flash attention) are tied to their own engines or
to one kernel; transformers' attention interface lets the regrouping wrap any kernel in ~100 lines.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from verl_hpc.config.errors import ConfigError, raise_if_any
from verl_hpc.config.sections.fsdp import sp_head_problems
from verl_hpc.runtime import collectives

ATTENTION = "verl_hpc_ulysses"  # the name the wrapped attention is registered under in transformers
# what each module of an installed model carries (attributes, not config fields: a config is
# saved with the model and deep-copied, a process group cannot be)
GROUP_ATTR, INNER_ATTR = "_verl_hpc_sp_group", "_verl_hpc_sp_inner"


@dataclasses.dataclass(frozen=True)
class SequenceGroup:
    size: int
    rank: int  # this rank's place in its group: which slice of each sequence it holds
    group: object  # the torch process group of this rank's sp ranks

    @classmethod
    def build(cls, sp: int) -> "SequenceGroup":
        """Consecutive ranks form a group ([0..sp-1], [sp..2sp-1], ...): on a GPU node these are
        the GPUs of one node, where the all-to-alls are cheapest. Collective: dist.new_group must
        be called by every rank for every group, in the same order."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if sp < 1 or world % sp:
            raise ConfigError(f"fsdp.sp = {sp} must divide the {world} training ranks")
        mine = None
        for start in range(0, world, sp):
            g = dist.new_group(list(range(start, start + sp)))
            if start <= rank < start + sp:
                mine = g
        collectives.name_group(mine, "sp")  # its all-to-alls counted as @sp (benchmarks/bench_scaling.py)
        return cls(size=sp, rank=rank % sp, group=mine)

    def bounds(self, length: int):
        """(first, end) positions of this rank's slice of a sequence of `length` (a multiple of sp)."""
        step = length // self.size
        return self.rank * step, (self.rank + 1) * step

    def slice(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of dim 1 (the sequence) of a [B, S] tensor, S a multiple of sp."""
        first, end = self.bounds(x.shape[1])
        return x[:, first:end]

    def assemble(self, local: torch.Tensor) -> torch.Tensor:
        """The group's sum of per-rank results that are zero outside each rank's own positions,
        with autograd through this rank's own part only (module docstring)."""
        total = local.detach().clone()
        dist.all_reduce(total, group=self.group)
        return local + (total - local.detach())


def _exchange(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """all_to_all_single over the group on dim 0 (x[j] goes to rank j; out[j] came from rank j),
    with autograd (the backward is the same exchange of the gradients): torch's functional
    collective, which torch.distributed.nn's deprecated form now points to. (That module's list
    form falls back to scatters on gloo that name the source by its group rank as if it were a
    global one, and fails in any group but the world.)"""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group.group))


def seq_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[B, H, S/sp, D] (my tokens, all heads) -> [B, H/sp, S, D] (all tokens, my heads)."""
    b, h, s, d = x.shape
    sp = group.size
    parts = _exchange(x.view(b, sp, h // sp, s, d).permute(1, 0, 2, 3, 4), group)  # [sp, B, H/sp, S/sp, D]
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def heads_to_seq(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[B, H/sp, S, D] -> [B, H, S/sp, D]: the inverse of seq_to_heads."""
    b, h, s, d = x.shape
    sp = group.size
    parts = _exchange(x.view(b, h, sp, s // sp, d).permute(2, 0, 1, 3, 4), group)  # [sp, B, H/sp, S/sp, D]
    return parts.permute(1, 0, 2, 3, 4).reshape(b, sp * h, s // sp, d)


class _HeadView:
    """The attention module as the inner kernel should see it: its own attributes, but the
    query/KV head ratio of the heads this rank holds after the regrouping."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def kv_repeats(kv_heads: int, sp: int) -> int:
    """How many times each KV head is repeated before the regrouping (1 when kv divides over sp)."""
    if kv_heads % sp == 0:
        return 1
    return sp // kv_heads


def check_heads(config, sp: int) -> None:
    """The model's heads against sp: query heads split evenly, KV heads split or repeated."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        raise ConfigError(f"fsdp.sp = {sp}: {type(config).__name__} names no num_attention_heads to split")
    raise_if_any(sp_head_problems(sp, heads, kv))
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and getattr(config, "layer_types", None) is not None \
            and any(t != "full_attention" for t in config.layer_types):
        raise ConfigError(f"fsdp.sp = {sp}: {type(config).__name__} uses sliding-window attention layers, "
                          "which the sequence-parallel attention does not mask; set fsdp.sp=1")


def ulysses_attention(module, query, key, value, attention_mask=None, **kwargs):
    """transformers' attention interface: q [B, H, S/sp, D], k/v [B, KV, S/sp, D] on each rank;
    returns [B, S/sp, H, D] as every attention function does."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    group = getattr(module, GROUP_ATTR)
    repeat = kv_repeats(key.shape[1], group.size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    inner = ALL_ATTENTION_FUNCTIONS[getattr(module, INNER_ATTR)]
    # causal over the whole sequence, no mask: rows are right-padded (module docstring)
    out, weights = inner(_HeadView(module, q.shape[1] // k.shape[1]), q, k, v, None, **kwargs)
    # out: [B, S, H/sp, D] -> [B, H/sp, S, D] -> my tokens, all heads -> [B, S/sp, H, D]
    out = heads_to_seq(out.transpose(1, 2), group)
    return out.transpose(1, 2).contiguous(), weights


def _no_mask(*args, **kwargs):
    """The mask builder for the wrapped attention: none (causal and right-padded)."""
    return None


def install(model: torch.nn.Module, group: SequenceGroup) -> None:
    """Route the model's attention through ulysses_attention over `group`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    inner = model.config._attn_implementation
    if inner == ATTENTION:
        raise ConfigError("fsdp.sp: the model's attention is already sequence-parallel")
    for m in model.modules():
        setattr(m, GROUP_ATTR, group)
        setattr(m, INNER_ATTR, inner)
    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)
    model.set_attn_implementation(ATTENTION)


def setup(options, model, vision: bool) -> SequenceGroup:
    """The engine's sequence-parallel group for `options.fsdp.sp`, with the model's attention
    routed through it; what it does not cover yet is refused here, one line each, before any
    weights move."""
    sp, why = options.fsdp.sp, f"fsdp.sp = {options.fsdp.sp}"
    if options.head != "lm":
        raise ConfigError(f"{why}: a critic or reward model (value head) under sequence parallelism is not "
                          "built yet; set fsdp.sp=1 or train the value model on the Megatron engine")
    if options.lora is not None:
        raise ConfigError(f"{why} with LoRA (lora.rank > 0): not built yet; set fsdp.sp=1 or lora.rank=0")
    if vision:
        raise ConfigError(f"{why}: a vision-language model under sequence parallelism is not built yet "
                          "(its M-RoPE positions are laid out over the whole sequence); set fsdp.sp=1")
    check_heads(model.config, sp)
    group = SequenceGroup.build(sp)
    install(model, group)
    return group
