"""HF config.json -> ModelArch -> TransformerConfig, and the errors for what is not supported."""
import json

import pytest
import torch

from verl_hpc.config.errors import ConfigError
from verl_hpc.models.config_mapping import (
    check_parallel,
    load_arch,
    load_hf_config,
    padded_vocab_size,
    parse_hf_config,
    transformer_config,
)
from verl_hpc.parallel.megatron_init import check_layout


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 500,
         "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
         "tie_word_embeddings": False, "max_position_embeddings": 256}


def cfg(**changes):
    out = dict(LLAMA, **changes)
    return {k: v for k, v in out.items() if v is not ...}


def test_llama_fields_map():
    arch = parse_hf_config(cfg())
    assert (arch.family, arch.num_query_groups, arch.head_dim, arch.heads_per_group) == ("llama", 2, 32, 2)
    assert arch.rope_theta == 5e5 and arch.rope_scaling is None and arch.rms_norm_eps == 1e-5
    assert not arch.qkv_bias and not arch.tie_word_embeddings


def test_qwen2_has_qkv_bias_and_transformers4_rope_spelling():
    arch = parse_hf_config(cfg(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                               rope_parameters=..., rope_theta=1e6, rope_scaling=None,
                               head_dim=..., tie_word_embeddings=True, use_sliding_window=False))
    assert arch.qkv_bias and arch.tie_word_embeddings and arch.rope_theta == 1e6
    assert arch.head_dim == 32  # hidden_size / num_attention_heads when head_dim is absent


def test_defaults_for_optional_fields():
    arch = parse_hf_config(cfg(num_key_value_heads=..., rms_norm_eps=..., rope_parameters=...,
                               tie_word_embeddings=..., max_position_embeddings=..., head_dim=None))
    assert arch.num_query_groups == 4 and arch.rope_theta == 10000.0 and arch.rms_norm_eps == 1e-6
    assert arch.max_position_embeddings == 2048


def test_rope_scaling_types():
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert parse_hf_config(cfg(rope_parameters=llama3)).rope_scaling["factor"] == 8.0
    linear = parse_hf_config(cfg(rope_parameters=..., rope_scaling={"type": "linear", "factor": 2}))
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ConfigError, match=r"rope_parameters.rope_type='yarn' is not implemented"):
        parse_hf_config(cfg(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ConfigError, match="needs low_freq_factor"):
        parse_hf_config(cfg(rope_parameters={"rope_type": "llama3", "factor": 8.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}))


@pytest.mark.parametrize("changes, field", [
    (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
    (dict(architectures=None, model_type="gpt2"), "architectures"),
    (dict(hidden_size=...), "hidden_size"),
    (dict(num_hidden_layers=..., vocab_size=...), "vocab_size, num_hidden_layers"),
    (dict(num_attention_heads=0), "num_attention_heads=0"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=4096), "sliding_window=4096"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "use_sliding_window"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_unsupported_or_broken_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError) as e:
        parse_hf_config(cfg(**changes), source="m/config.json")
    assert field in str(e.value) and "m/config.json" in str(e.value)


def test_missing_folder_and_config_json(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path: no such folder .*nope"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match="model.path: .* has no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg(vocab_size=...)))
    with pytest.raises(ConfigError, match=r"config.json: missing required field\(s\) vocab_size"):
        load_arch(tmp_path)


def test_parallel_layout_errors_name_both_fields():
    arch = parse_hf_config(cfg(), source="m/config.json")
    check_parallel(arch, tp=2, pp=2)
    with pytest.raises(ConfigError) as e:
        check_parallel(arch, tp=4, pp=3)
    msg = str(e.value)
    assert "parallel.tp = 4 does not divide the model's num_key_value_heads = 2 (m/config.json)" in msg
    assert "parallel.pp = 3 does not divide the model's num_hidden_layers = 2 (m/config.json)" in msg
    assert "num_attention_heads" not in msg  # 4 divides 4
    with pytest.raises(ValueError, match=r"parallel.tp \* parallel.pp = 2 \* 2 = 4 does not divide the world size 6"):
        check_layout(6, 2, 2)
    assert check_layout(8, 2, 2) == 2


def test_vocab_padding():
    assert padded_vocab_size(500, 1) == 512 and padded_vocab_size(500, 2) == 512
    assert padded_vocab_size(512, 4) == 512 and padded_vocab_size(151936, 8) == 152576
    assert padded_vocab_size(500, 3, divisible_by=64) == 576


def test_transformer_config():
    arch = parse_hf_config(cfg(architectures=["Qwen2ForCausalLM"]))
    tc = transformer_config(arch, tp=2, pp=2)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size, tc.num_query_groups,
            tc.kv_channels) == (2, 128, 256, 2, 32)
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and tc.add_qkv_bias
    assert not tc.add_bias_linear and tc.layernorm_epsilon == 1e-5
    assert tc.params_dtype == torch.float32 and tc.use_cpu_initialization
    assert not tc.perform_initialization  # weights come from the checkpoint
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
