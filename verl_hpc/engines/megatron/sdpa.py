"""Core attention through `torch.nn.functional.scaled_dot_product_attention` for the local spec.

Megatron's local-spec `DotProductAttention` materialises the GQA key/value repeat, the
`[b*np, s, s]` scores, a masked_fill and a softmax, then a second bmm. On CPU (where the
Transformer Engine spec is unavailable) PyTorch's fused SDPA kernel computes the same causal
attention with less memory traffic (0.96x -> 0.99x of transformers' fwd+bwd:
docs/platform-notes.md, "megatron-core 0.16.1 on CPU").

`use_sdpa_core_attention(chunks)` swaps each layer's `self_attention.core_attention` for
`SdpaCoreAttention`, which keeps the replaced module's sizes and scale and accepts exactly the cases
the engine uses: causal self-attention with `attention_mask=None` (right-padded rows), or a boolean
`[b, 1, s, s]` mask in Megatron's convention, True = masked out (rows of packed prompts,
prefix.py); no dropout, no THD packed sequences, no attention bias. Anything else raises instead
of computing something different. The engine
applies it only to the local spec (the TE spec has its own fused attention).
"""
from __future__ import annotations

import torch


class SdpaCoreAttention(torch.nn.Module):
    def __init__(self, replaced):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if replaced.attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPA core attention handles causal masks; got {replaced.attn_mask_type}")
        if getattr(replaced, "softmax_offset", None) is not None:
            raise ValueError("SDPA core attention does not implement Megatron's softmax offsets")
        if replaced.config.attention_dropout:
            raise ValueError("SDPA core attention is used without attention dropout")
        self.scale = replaced.softmax_scale
        self.heads = replaced.num_attention_heads_per_partition
        self.groups = replaced.num_query_groups_per_partition
        self.hidden = replaced.hidden_size_per_partition

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPA core attention: no attention bias or THD packed sequences")
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError(f"SDPA core attention: a boolean mask (True = masked); got "
                             f"{attention_mask.dtype}")
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=self.scale,
            enable_gqa=self.groups != self.heads)
        # [b, n, s, d] -> [s, b, n * d]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden)


def use_sdpa_core_attention(chunks) -> int:
    """Replace the core attention of every layer of `chunks` (GPTModels); returns the count."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    count = 0
    for gpt in chunks:
        for layer in gpt.decoder.layers:
            attn = layer.self_attention
            if type(attn.core_attention) is DotProductAttention:
                attn.core_attention = SdpaCoreAttention(attn.core_attention)
                count += 1
    return count
