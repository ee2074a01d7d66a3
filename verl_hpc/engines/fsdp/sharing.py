"""Prompt sharing on the FSDP engine: the packed rows of engines/prefix.py (one row per prompt, its
responses after it, each at the positions of its own sequence) with their visibility as a dense 4D
attention mask, which transformers hands to SDPA as it is (a custom 4D mask is used unchanged).

Where the packed layout is exact. transformers uses a 4D mask it is given for *every* layer, as it
is: a sliding-window layer then attends to everything the mask allows, with no window (the window
would have to be counted within each sample's own positions, which the mask cannot say), and the
same holds for chunked attention. So packing is allowed only for an architecture whose every layer
is plain causal attention over the mask, and only for the model types the tests prove equal to the
plain layout (tests/unit/engines/test_fsdp_sharing_archs.py); any other falls back to one sequence
per row, with the reason in the log once (`actor.share_prompts=on` is then refused, naming it, by
the submitter's checks before the queue too: share_prompts_problems).

The Megatron engine runs packed rows through segmented attention (two SDPA calls per layer,
engines/megatron/sdpa.py); a transformers model's own attention takes only a mask, so here every
(query, key) pair of the packed row is computed, masked ones included, where the plain layout's
causal kernel computes half of them. `DenseMaskCost` weighs that against the prompt tokens saved,
in the units of prefix.CostModel (prefix.PromptSharing decides with it), and a micro-batch is packed
only where it pays (`on`: wherever a prompt has two responses in it). A value head never packs (its
sequence scores read the last token, which packed rows leave out), and neither does a model whose
attention is not SDPA's.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Sequence

from verl_hpc.config.errors import ConfigError
from verl_hpc.engines.prefix import PromptSharing

log = logging.getLogger(__name__)
MASK_PENALTY = 5.0  # as prefix.CostModel: attention next to the GEMMs runs at lower efficiency

# model types (config.model_type) whose packed rows the tests show equal to the plain layout: every
# layer causal attention over the given mask, positions from position_ids. A type not here (or one of
# these with a window switched on in its config) runs one sequence per row.
EXACT_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                     "deepseek_v3", "phi3", "olmo2", "starcoder2", "granite", "smollm3")
_logged = set()  # (model type, reason): each said once per process


def why_not_exact(hf_config) -> str:
    """'' when the model's attention honours the packed rows' mask on every layer, else why not."""
    text = getattr(hf_config, "text_config", None) or hf_config
    kind = getattr(text, "model_type", "?")
    kinds = sorted(set(getattr(text, "layer_types", None) or ()) - {"full_attention"})
    if kinds:
        return (f"{kind} has {', '.join(kinds)} layers (layer_types): their window would be counted along "
                "the packed row, not within each sample")
    window = getattr(text, "sliding_window", None)
    if window and getattr(text, "use_sliding_window", True) is not False:
        return (f"{kind} attends within a sliding window (sliding_window = {window}), which a packed row's "
                "mask cannot express per sample")
    if getattr(text, "attention_chunk_size", None):
        return f"{kind} attends in chunks (attention_chunk_size = {text.attention_chunk_size})"
    if kind not in EXACT_MODEL_TYPES:
        return (f"{kind} is not among the architectures whose attention is proven to honour a packed row's "
                f"mask ({', '.join(EXACT_MODEL_TYPES)})")
    return ""


def why_not_packed(hf_config, attn_implementation: str) -> str:
    """'' where the engine may pack the model's rows (why_not_exact, and SDPA attention, which takes
    the packed mask), else why not: the engine's rule at build and the submitter's before the queue."""
    why = why_not_exact(hf_config)
    if not why and attn_implementation != "sdpa":
        why = f"attention runs through {attn_implementation}, which takes no packed mask"
    return why


def on_refused(why: str, what: str = "this model") -> str:
    """The one line that refuses actor.share_prompts=on for `what`, saying why."""
    return f"actor.share_prompts=on: cannot pack prompts for {what}: {why}; valid: auto (packs where exact) or off"


def share_prompts_problems(folder: str, field: str, trust_remote_code: bool) -> List[str]:
    """actor.share_prompts=on with a folder the FSDP engine runs for a language-model role: refused
    before the queue where the engine would refuse it at build (config.json through transformers)."""
    from verl_hpc.engines.fsdp.build import _auto_class, attention_implementation, hf_config

    try:
        config = hf_config(folder, trust_remote_code, field)
        why = why_not_packed(config, attention_implementation(_auto_class("lm", config), config))
    except ConfigError:
        return []  # the model checks name an unreadable config.json
    return [on_refused(why, f"{field} '{folder}'")] if why else []


def _ffn_width(text, hidden: int) -> int:
    """The MLP's inner width by whatever name the family gives it (intermediate_size, Falcon's
    ffn_hidden_size, GPT-2's n_inner), else the classic 4 x hidden (GPT-2 with n_inner null, BLOOM)."""
    for name in ("intermediate_size", "ffn_hidden_size", "n_inner"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 4 * hidden


@dataclasses.dataclass(frozen=True)
class DenseMaskCost:
    """Cost of a micro-batch in units of one token's linear-layer work: plain rows run causal SDPA
    (half the pairs), packed rows a dense masked SDPA (all pairs of the longest packed row)."""

    pair_weight: float

    @classmethod
    def for_config(cls, cfg) -> "DenseMaskCost":
        # transformers' config objects answer the common names through their attribute_map (GPT-2's
        # n_head, n_embd); the MLP's width has no common name
        text = getattr(cfg, "text_config", None) or cfg
        h, heads = text.hidden_size, text.num_attention_heads
        d = getattr(text, "head_dim", None) or h // heads
        kv = d * (getattr(text, "num_key_value_heads", None) or heads)
        linear = 2 * (h * (d * heads + 2 * kv) + d * heads * h + 3 * h * _ffn_width(text, h))
        return cls(pair_weight=MASK_PENALTY * 4 * d * heads / linear)

    def plain(self, lengths: Sequence[int]) -> float:
        s = max(lengths)
        return len(lengths) * (s + self.pair_weight * s * s / 2)

    def packed(self, lengths: Sequence[int], prompt_lengths=None, response_lengths=None) -> float:
        s = max(lengths)
        return len(lengths) * (s + self.pair_weight * s * s)


def prompt_sharing(options, hf_config, model=None) -> Optional[PromptSharing]:
    """The engine's packing decision for its options (None: never pack)."""
    if options.head != "lm" or options.share_prompts == "off":
        return None
    why = why_not_packed(hf_config, getattr(hf_config, "_attn_implementation", "sdpa"))
    if why:
        if options.share_prompts == "on":
            raise ConfigError(on_refused(why))
        if why not in _logged:
            _logged.add(why)
            log.info("shared prompts off: %s (one sequence per row)", why)
        return None
    # prefix.py's decision and packing, with this engine's cost of attention
    return PromptSharing(DenseMaskCost.for_config(hf_config), force=options.share_prompts == "on")
