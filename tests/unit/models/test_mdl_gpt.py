"""verl_hpc.models.gpt pieces that need no process group: RoPE scaling, the padded-vocabulary
mask, the output layer's position selection, and the clear errors of the layer-spec choice."""
import pytest
import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.config_mapping import parse_hf_config
from verl_hpc.models.gpt import _mask_padded_vocab, layer_spec, per_row_positions, select_output_positions


def test_llama3_rope_inv_freq_matches_transformers():
    """build_gpt_model recomputes inv_freq with all four llama3 parameters (Megatron's GPTModel
    forwards only `factor`); compare with transformers' own function."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from verl_hpc.models.config_mapping import parse_hf_config
    from verl_hpc.models.gpt import _apply_llama3_scaling

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 2.0,
            "high_freq_factor": 8.0, "original_max_position_embeddings": 1024}
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, rope_parameters=rope)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    arch = parse_hf_config({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})

    class Holder:
        rotary_pos_emb = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_base=500000,
                                         use_cpu_initialization=True)

    _apply_llama3_scaling(Holder, arch)
    assert torch.allclose(Holder.rotary_pos_emb.inv_freq, expected.float(), rtol=1e-6, atol=0)


class _FakeOutputLayer(torch.nn.Module):
    def forward(self, x):
        return x, None


class _FakeModel:
    def __init__(self, padded):
        self.vocab_size = padded
        self.output_layer = _FakeOutputLayer()


@pytest.mark.parametrize("tp_rank, width, masked_from", [
    (0, 256, None),  # rank 0 of 2 holds ids 0..255: all real
    (1, 256, 500 - 256),  # rank 1 holds 256..511: 500..511 are padding
    (0, 512, 500),  # gathered (parallel_output=False): the full padded vocabulary
])
def test_padded_vocab_logits_are_minus_inf(tp_rank, width, masked_from):
    arch = parse_hf_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 500,
                            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                            "num_attention_heads": 2})
    model = _FakeModel(512)
    _mask_padded_vocab(model, arch, tp_rank, tp=2)
    logits, _ = model.output_layer(torch.zeros(3, 2, width, requires_grad=True))
    if masked_from is None:
        assert torch.isfinite(logits).all()
        return
    assert torch.isneginf(logits[..., masked_from:]).all()
    assert torch.isfinite(logits[..., :masked_from]).all()
    logits[..., :masked_from].sum().backward()  # the mask is differentiable where it matters


class _Projection(torch.nn.Module):
    """Megatron's output-layer calling convention: (input [s, b, h], weight=...) -> (logits, bias)."""

    def __init__(self, h, v):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(v, h))

    def forward(self, x, weight=None, runtime_gather_output=None):
        return x @ (self.weight if weight is None else weight).t(), None


def test_selected_positions_give_those_rows_and_their_gradients():
    torch.manual_seed(0)
    s, b, h, v = 7, 3, 5, 11
    layer = _Projection(h, v)
    select_output_positions(layer)
    hidden = torch.randn(s, b, h, requires_grad=True)
    positions = torch.tensor([[1, 2, 3], [4, 5, 6], [0, 0, 6]])  # [b, T], clamped padding included
    full, _ = layer(hidden, runtime_gather_output=False)  # unset: untouched, [s, b, v]
    assert full.shape == (s, b, v)
    expected = torch.stack([full[positions[r], r] for r in range(b)], dim=1)  # [T, b, v]
    (g_ref,) = torch.autograd.grad((expected ** 2).sum(), hidden)
    layer.selected_positions = positions
    picked, _ = layer(hidden, weight=layer.weight)
    torch.testing.assert_close(picked, expected, rtol=1e-6, atol=1e-6)
    (g,) = torch.autograd.grad((picked ** 2).sum(), hidden)
    torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)  # repeated positions add up
    assert g[:, 1][[0, 1, 2, 3]].abs().sum() == 0  # row 1 read 4..6 only: no gradient elsewhere


def test_selected_rows_take_each_output_row_from_its_input_row():
    """Packed prompts: output row i comes from input row selected_rows[i]."""
    torch.manual_seed(0)
    s, b, h, v = 9, 2, 5, 11
    layer = _Projection(h, v)
    select_output_positions(layer)
    hidden = torch.randn(s, b, h)
    full, _ = layer(hidden)
    positions = torch.tensor([[2, 3], [2, 5], [1, 8]])  # three samples, two share input row 0
    rows = torch.tensor([0, 0, 1])
    layer.selected_positions, layer.selected_rows = positions, rows
    picked, _ = layer(hidden)
    expected = torch.stack([full[positions[i], rows[i]] for i in range(3)], dim=1)  # [T, n, v]
    torch.testing.assert_close(picked, expected, rtol=1e-6, atol=1e-6)


class _Rope(torch.nn.Module):
    """Megatron's RotaryEmbedding calling convention: (seq_len) -> [s, 1, 1, d] angles."""

    def forward(self, seq_len):
        return (torch.arange(seq_len, dtype=torch.float32)[:, None] * torch.tensor([1.0, 0.5]))[:, None, None, :]


def test_per_row_positions_reindex_the_rotary_angles():
    model = torch.nn.Module()
    model.rotary_pos_emb = _Rope()
    per_row_positions(model)
    plain = model.rotary_pos_emb(5)
    assert plain.shape == (5, 1, 1, 2)  # unset: untouched
    positions = torch.tensor([[0, 1, 2, 2, 3], [0, 1, 1, 2, 2]])
    model.rotary_pos_emb.row_positions = positions
    got = model.rotary_pos_emb(5)
    assert got.shape == (5, 2, 1, 2)
    for r in range(2):
        for i in range(5):
            assert torch.equal(got[i, r, 0], plain[positions[r, i], 0, 0])


def test_fp8_without_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="model.fp8=true needs a CUDA GPU"):
        layer_spec(fp8=True)
    spec = layer_spec()  # the local spec on CPU
    assert "TENorm" not in repr(spec) and "TELayerNorm" not in repr(spec)
