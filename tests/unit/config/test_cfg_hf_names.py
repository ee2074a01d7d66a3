"""config.json's numbers under the names transformers' config classes map (config/hf_model.py):
GPT-2 and BLOOM say n_head / n_layer (/ n_embd / n_positions), Falcon counts its KV heads by
multi_query / new_decoder_architecture and names its MLP ffn_hidden_size. 85ec11b refused GPT-2 and
BLOOM folders before the queue ("config.json has no num_attention_heads, num_hidden_layers"). The
expected numbers are those of the transformers config object (and of the model it builds)."""
import pytest

from arch_matrix import make_arch


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("names")
    return {a: make_arch(root / a, a) for a in ("gpt2", "bloom", "falcon", "gpt_neox")}


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "falcon", "gpt_neox"])
def test_the_shape_is_what_transformers_reads(arch, folders):
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_hpc.config.hf_model import read_model_shape
    from verl_hpc.planning.model_shape import fsdp_arch

    cfg = AutoConfig.from_pretrained(folders[arch])
    m = read_model_shape(str(folders[arch]))
    assert (m.heads, m.layers, m.vocab_size) == (cfg.num_attention_heads, cfg.num_hidden_layers, cfg.vocab_size) == (4, 2, 500)
    model = AutoModelForCausalLM.from_config(cfg)
    attn = next(mod for name, mod in model.named_modules() if name.endswith(("attn", "attention", "self_attention")))
    kv = getattr(attn, "num_kv_heads", None) or getattr(attn, "num_key_value_heads", None) or cfg.num_attention_heads
    assert m.kv_heads == kv  # Falcon's multi-query attention: 1
    assert fsdp_arch(str(folders[arch])).num_query_groups == kv
    assert m.head_dim == 32


def test_a_gpt2_job_passes_the_model_checks_before_the_queue(folders, tmp_path):
    from verl_hpc.config import load_config
    from verl_hpc.config.validate import _model

    cfg = load_config(None, [f"model.path={folders['gpt2']}", "parallel.engine=fsdp", "rollout.tp=1",
                             "data.max_prompt_length=128", "data.max_response_length=64"])
    assert _model(cfg, str(folders["gpt2"]), "model.path") == []
