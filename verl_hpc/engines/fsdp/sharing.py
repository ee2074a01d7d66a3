"""Prompt sharing on the FSDP engine: the packed rows of engines/prefix.py (one row per prompt, its
responses after it, each at the positions of its own sequence) with their visibility as a dense 4D
attention mask, which transformers hands to SDPA as it is (a custom 4D mask is used unchanged).

The Megatron engine runs packed rows through segmented attention (two SDPA calls per layer,
engines/megatron/sdpa.py); a transformers model's own attention takes only a mask, so here every
(query, key) pair of the packed row is computed, masked ones included, where the plain layout's
causal kernel computes half of them. `DenseMaskCost` weighs that against the prompt tokens saved,
in the units of prefix.CostModel, and a micro-batch is packed only where it pays (`on`: wherever a
prompt has two responses in it). A value head never packs (its sequence scores read the last token,
which packed rows leave out), and neither does a model whose attention is not SDPA's.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from verl_hpc.engines.prefix import MAX_PACKED_LEN, PromptSharing, packed_lengths, prompt_groups

MASK_PENALTY = 5.0  # as prefix.CostModel: attention next to the GEMMs runs at lower efficiency


@dataclasses.dataclass(frozen=True)
class DenseMaskCost:
    """Cost of a micro-batch in units of one token's linear-layer work: plain rows run causal SDPA
    (half the pairs), packed rows a dense masked SDPA (all pairs of the longest packed row)."""

    pair_weight: float

    @classmethod
    def for_config(cls, cfg) -> "DenseMaskCost":
        text = getattr(cfg, "text_config", None) or cfg
        h, heads = text.hidden_size, text.num_attention_heads
        d = getattr(text, "head_dim", None) or h // heads
        kv = d * (getattr(text, "num_key_value_heads", None) or heads)
        linear = 2 * (h * (d * heads + 2 * kv) + d * heads * h + 3 * h * text.intermediate_size)
        return cls(pair_weight=MASK_PENALTY * 4 * h / linear)

    def plain(self, lengths: Sequence[int]) -> float:
        s = max(lengths)
        return len(lengths) * (s + self.pair_weight * s * s / 2)

    def packed(self, lengths: Sequence[int], prompt_lengths=None, response_lengths=None) -> float:
        s = max(lengths)
        return len(lengths) * (s + self.pair_weight * s * s)


class DensePromptSharing(PromptSharing):
    """prefix.PromptSharing with the dense-mask cost (the packing itself is prefix.pack_rows)."""

    def __call__(self, sub, width: int, pad_to: int = 1):
        groups = prompt_groups(sub["input_ids"], sub["prompt_lengths"])
        plens, rlens = sub["prompt_lengths"].tolist(), sub["response_lengths"].tolist()
        if max(len(g) for g in groups) < 2:
            return None
        packed = packed_lengths(groups, plens, rlens)
        plain = [plens[i] + rlens[i] for g in groups for i in g]
        if max(packed) > MAX_PACKED_LEN or len(packed) * max(packed) > len(plain) * max(plain):
            return None
        if not self.force and self.cost.packed(packed) >= 0.9 * self.cost.plain(plain):
            return None
        from verl_hpc.engines.prefix import pack_rows

        return pack_rows(sub, groups, width, pad_to)


def prompt_sharing(options, hf_config, model) -> Optional[DensePromptSharing]:
    """The engine's packing decision for its options (None: never pack)."""
    if options.head != "lm" or options.share_prompts == "off":
        return None
    if getattr(hf_config, "_attn_implementation", "sdpa") != "sdpa":
        return None
    return DensePromptSharing(DenseMaskCost.for_config(hf_config), force=options.share_prompts == "on")
