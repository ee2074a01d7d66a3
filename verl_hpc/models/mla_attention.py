"""Core attention of multi-head latent attention (DeepSeek-V3) for Megatron's local spec.

megatron-core 0.16.1's MLA builds its core attention with `k_channels` and `v_channels` (the query/
key head is nope + rope wide, the value head v_head_dim), which only Transformer Engine's
attention accepts: the local `DotProductAttention` has no such arguments, so the local spec's MLA
cannot be built at all. `MLACoreAttention` takes them and computes causal attention through
`torch.nn.functional.scaled_dot_product_attention` (which allows a value width other than the key's),
for the cases the engine uses: `attention_mask=None` (causal, right-padded rows) or a boolean
`[b, 1, s, s]` mask in Megatron's convention (True = masked out); no dropout, no THD packing, no
attention bias, no packed prompts (the engine does not pack prompts for latent attention).
Anything else raises.
"""
from __future__ import annotations

import torch


class MLACoreAttention(torch.nn.Module):
    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"MLA core attention handles causal masks; got {attn_mask_type}")
        if config.attention_dropout if attention_dropout is None else attention_dropout:
            raise ValueError("MLA core attention is used without attention dropout")
        if config.context_parallel_size > 1:
            raise ValueError("MLA core attention on the local spec has no context parallelism")
        tp = pg_collection.tp.size() if pg_collection is not None else ps.get_tensor_model_parallel_world_size()
        self.config = config
        self.heads = config.num_attention_heads // tp
        self.v_channels = v_channels
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("MLA core attention: no attention bias or THD packed sequences")
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError(f"MLA core attention: a boolean mask (True = masked); got {attention_mask.dtype}")
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=allowed is None, scale=self.scale)
        # [b, n, s, dv] -> [s, b, n * dv]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.heads * self.v_channels)


def use_local_mla(te_importable: bool) -> None:
    """megatron-core 0.16.1's multi_latent_attention sets HAVE_TE = True whenever its TE extension
    module imports, which it does without Transformer Engine (TELinear is then a MagicMock), and
    then asks `isinstance(linear_proj, TELinear)`: a TypeError on every MLA layer. Without TE
    installed (`te_importable` False), its HAVE_TE is made False, which is what the module means by it."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not te_importable:
        mla.HAVE_TE = False


def with_split_latent_down_projections(block_spec):
    """A Transformer Engine block spec whose MLA down projections (q_a, kv_a) are column-parallel
    (`TEColumnParallelLinear`, split over TP and gathered by MLA), as on the local spec, instead of
    TE's replicated `TELinear`: one weight layout for both specs (models/weight_rules.py's `Rows`),
    so load, export and the sliced sync need no second rule. MLA accepts both. Not run here (no GPU)."""
    import dataclasses

    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    layers = []
    for spec in block_spec.layer_specs:
        attn = spec.submodules.self_attention
        if attn.module is MLASelfAttention:
            sub = dataclasses.replace(attn.submodules, linear_q_down_proj=TEColumnParallelLinear,
                                      linear_kv_down_proj=TEColumnParallelLinear)
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(
                spec.submodules, self_attention=dataclasses.replace(attn, submodules=sub)))
        layers.append(spec)
    return dataclasses.replace(block_spec, layer_specs=layers)


def with_mla_core_attention(block_spec, te_importable: bool):
    """A local-spec block spec whose MLA layers use MLACoreAttention (copies; the input is untouched)."""
    import dataclasses

    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    use_local_mla(te_importable)
    layers = []
    for spec in block_spec.layer_specs:
        attn = spec.submodules.self_attention
        if attn.module is MLASelfAttention:
            attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules,
                                                                            core_attention=MLACoreAttention))
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
        layers.append(spec)
    return dataclasses.replace(block_spec, layer_specs=layers)
