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
