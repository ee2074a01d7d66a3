"""Core attention through `torch.nn.functional.scaled_dot_product_attention` for the local spec.

Megatron's local-spec `DotProductAttention` materialises the GQA key/value repeat, the
`[b*np, s, s]` scores, a masked_fill and a softmax, then a second bmm. On CPU (where the
Transformer Engine spec is unavailable) PyTorch's fused SDPA kernel computes the same causal
attention with less memory traffic (0.96x -> 0.99x of transformers' fwd+bwd:
docs/platform-notes.md, "megatron-core 0.16.1 on CPU").

`use_sdpa_core_attention(chunks)` swaps each layer's `self_attention.core_attention` for
`SdpaCoreAttention`, which keeps the replaced module's sizes and scale and accepts exactly the cases
the engine uses: causal self-attention with `attention_mask=None` (right-padded rows), a
`prefix.SegmentedAttention` in the mask's place (rows of packed prompts: `segmented_attention`),
or a boolean `[b, 1, s, s]` mask in Megatron's convention, True = masked out; no dropout, no THD
packed sequences, no attention bias. Anything else raises instead of computing something
different. The engine applies it only to the local spec (the TE spec has its own fused attention).
"""
from __future__ import annotations

import torch

from verl_hpc.engines.prefix import SegmentedAttention


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
        if isinstance(attention_mask, SegmentedAttention):
            out = segmented_attention(query, key, value, attention_mask, self.scale,
                                      gqa=self.groups != self.heads)
            return out.view(query.shape[0], query.shape[1], self.hidden)
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


def segmented_attention(query, key, value, seg: SegmentedAttention, scale: float, gqa: bool):
    """Attention of packed rows ([s, g, heads, d] query, [s, g, groups, d] key and value) as two
    SDPA calls (prefix.py's docstring); returns [s, g, heads, d]. Gathers and the final scatter
    are index_select, so gradients flow back to every position a response read."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    s, g = query.shape[:2]
    p = seg.prompt_len
    # prompts: causal over the first P positions of every row -> [P * g, heads, d]
    head = sdpa(*(t[:p].permute(1, 2, 0, 3) for t in (query, key, value)), is_causal=True,
                scale=scale, enable_gqa=gqa)
    head = head.permute(2, 0, 1, 3).reshape(p * g, *query.shape[2:])
    # responses: own queries against [prompt | own tokens] -> [n * Q, heads, d]
    flat = lambda t: t.reshape(s * g, *t.shape[2:])  # noqa: E731
    n, q_len = seg.query_index.shape
    q = flat(query).index_select(0, seg.query_index.view(-1)).view(n, q_len, *query.shape[2:])
    k, v = (flat(t).index_select(0, seg.kv_index.view(-1)).view(n, -1, *t.shape[2:]) for t in (key, value))
    tail = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=seg.allowed,
                scale=scale, enable_gqa=gqa)
    tail = tail.transpose(1, 2).reshape(n * q_len, *query.shape[2:])
    zero = tail.new_zeros((1,) + tuple(query.shape[2:]))
    return torch.cat([head, tail, zero]).index_select(0, seg.source).view(query.shape)


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
