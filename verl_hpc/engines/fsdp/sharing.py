"""Prompt sharing on the FSDP engine: the packed rows of engines/prefix.py (one row per prompt, its
responses after it, each at the positions of its own sequence) with their visibility as a dense 4D
attention mask, which transformers hands to SDPA as it is (a custom 4D mask is used unchanged).

The Megatron engine runs packed rows through segmented attention (two SDPA calls per layer,
engines/megatron/sdpa.py); a transformers model's own attention takes only a mask, so here every
(query, key) pair of the packed row is computed, masked ones included, where the plain layout's
causal kernel computes half of them. `DenseMaskCost` weighs that against the prompt tokens saved,
in the units of prefix.CostModel (prefix.PromptSharing decides with it), and a micro-batch is packed only where it pays (`on`: wherever a
prompt has two responses in it). A value head never packs (its sequence scores read the last token,
which packed rows leave out), and neither does a model whose attention is not SDPA's.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from verl_hpc.engines.prefix import PromptSharing

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


def prompt_sharing(options, hf_config, model) -> Optional[PromptSharing]:
    """The engine's packing decision for its options (None: never pack)."""
    if options.head != "lm" or options.share_prompts == "off":
        return None
    if getattr(hf_config, "_attn_implementation", "sdpa") != "sdpa":
        return None
    # prefix.py's decision and packing, with this engine's cost of attention
    return PromptSharing(DenseMaskCost.for_config(hf_config), force=options.share_prompts == "on")
