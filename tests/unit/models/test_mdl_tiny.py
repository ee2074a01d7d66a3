"""The tiny model factory: a real HF folder that transformers loads, deterministic, offline."""
import hashlib
import json

import pytest
import torch

from verl_hpc.models.config_mapping import load_arch
from verl_hpc.models.tiny import make_tiny_model


def _digest(folder):
    h = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_folder_loads_in_transformers_and_is_deterministic(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = make_tiny_model(tmp_path / "a", "qwen2", tied=True, seed=3)
    b = make_tiny_model(tmp_path / "b", "qwen2", tied=True, seed=3)
    assert _digest(a) == _digest(b), "same arguments, same bytes"
    assert _digest(make_tiny_model(tmp_path / "c", "qwen2", tied=True, seed=4)) != _digest(a)

    model = AutoModelForCausalLM.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (128, 4, 2)
    assert cfg.hidden_size // cfg.num_attention_heads >= 32, "vLLM's CPU attention needs >= 32"
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert len(tok) <= cfg.vocab_size == 500
    assert {tok.bos_token, tok.eos_token, tok.pad_token} == {"<|bos|>", "<|eos|>", "<|pad|>"}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    ids = tok("What is 12 + 34? The answer is 46.")["input_ids"]
    assert tok.decode(ids) == "What is 12 + 34? The answer is 46." and len(ids) < 20
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")
    norm = model.model.layers[0].input_layernorm.weight.detach()
    assert 0.5 < float(norm.mean()) < 1.5 and float(norm.std()) > 0.05  # not all ones


def test_sharded_checkpoint_has_an_index(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "m", "llama", shards=2, layers=4)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert "lm_head.weight" in index["weight_map"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 4
    assert load_arch(folder).num_layers == 4


def test_cli(tmp_path, capsys):
    """`python -m verl_hpc.models.tiny OUT --family llama --tied`, driven in-process (a
    subprocess would spend its time importing transformers)."""
    from verl_hpc.models import tiny

    out = tmp_path / "cli"
    tiny.main([str(out), "--family", "llama", "--tied"])
    assert capsys.readouterr().out.strip() == str(out)
    arch = load_arch(out)
    assert arch.family == "llama" and arch.tie_word_embeddings
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}
    with pytest.raises(SystemExit):
        tiny.main([str(out), "--family", "gpt2"])
    assert "invalid choice: 'gpt2'" in capsys.readouterr().err


@pytest.mark.parametrize("family,cls", [("gemma3", "Gemma3ForCausalLM"), ("phi3", "Phi3ForCausalLM"),
                                        ("olmo2", "Olmo2ForCausalLM")])
def test_families_megatron_does_not_map_are_transformers_own(tmp_path, family, cls):
    """Gemma 3 (text), Phi-3 and OLMo 2: transformers' own config class and model with tiny shapes,
    the shared tokenizer, seeded weights; the Megatron mapping refuses them (the FSDP engine's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_hpc.config import ConfigError

    a = make_tiny_model(tmp_path / "a", family, seed=3)
    assert _digest(a) == _digest(make_tiny_model(tmp_path / "b", family, seed=3))
    model = AutoModelForCausalLM.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    cfg = model.config
    assert type(model).__name__ == cls and cfg.architectures == [cls] and cfg.num_hidden_layers == 2
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head_dim == 32 and model.model.layers[0].self_attn.head_dim == 32  # vLLM's CPU attention takes it
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (cfg.bos_token_id, cfg.eos_token_id,
                                                                      cfg.pad_token_id)
    assert tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    # the weights are the file's, not transformers' initialisation: a norm's scale is 1 + N(0, 0.1)
    # (Gemma stores the offset from 1)
    norm = model.model.layers[0].post_attention_layernorm.weight.detach()
    centre = 0.0 if family == "gemma3" else 1.0
    assert abs(float(norm.mean()) - centre) < 0.05 and 0.05 < float(norm.std()) < 0.2
    if family == "gemma3":
        assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 16
    if family == "phi3":
        assert "model.layers.0.self_attn.qkv_proj.weight" in model.state_dict()
    with pytest.raises(ConfigError, match="is not mapped into Megatron"):
        load_arch(a)


def test_cli_builds_a_family_megatron_does_not_map(tmp_path, capsys):
    from verl_hpc.models import tiny

    assert tiny.main([str(tmp_path / "g"), "--family", "gemma3", "--tied"]) == 0
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["tie_word_embeddings"]
