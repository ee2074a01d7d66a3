"""Tiny models of held-out architectures, each built from transformers' own config class with
random weights (verl_hpc.models.tiny draws them), for the tests that check "any HF model": the
families of verl_hpc.models.tiny plus Qwen3, Gemma 2, Cohere 2, Starcoder2, Granite, SmolLM3, Phi-2 and
the GPT-2 / BLOOM / Falcon / GPT-NeoX generation whose configs use other names (n_head, n_layer,
ffn_hidden_size) and other layouts (Conv1D, fused query_key_value, ALiBi). GPT-NeoX's output layer is
stored as `embed_out.weight`, as released folders store it (transformers 5 calls it lm_head).

Windows are WINDOW tokens, so that the test prompts (longer than that) slide, as real prompts slide
past real windows of 512-4,096 tokens.

    folder = make_arch(tmp_path / "gemma2", "gemma2")
"""
from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 6
SHAPES = dict(vocab_size=500, hidden_size=128, num_attention_heads=4, num_hidden_layers=2)
RMS = dict(intermediate_size=256, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
SLIDING = ["sliding_attention", "full_attention"]  # layer 0 slides, layer 1 sees the whole sequence


def _config(arch: str, ids: dict, dropout: float, tied: bool):
    import transformers as tf

    special = dict(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                   tie_word_embeddings=tied)
    if arch == "qwen3":
        return tf.Qwen3Config(**SHAPES, **RMS, **special, head_dim=32, rope_parameters=ROPE,
                              architectures=["Qwen3ForCausalLM"])
    if arch == "gemma2":
        return tf.Gemma2Config(**SHAPES, **RMS, **special, head_dim=32, query_pre_attn_scalar=32,
                               sliding_window=WINDOW, layer_types=SLIDING, rope_parameters=ROPE,
                               architectures=["Gemma2ForCausalLM"])
    if arch == "cohere2":
        rms = {k: v for k, v in RMS.items() if k != "rms_norm_eps"}
        return tf.Cohere2Config(**SHAPES, **rms, **special, sliding_window=WINDOW, layer_types=SLIDING,
                                rope_parameters=ROPE, architectures=["Cohere2ForCausalLM"])
    if arch in ("starcoder2", "starcoder2_window"):
        rms = {k: v for k, v in RMS.items() if k != "rms_norm_eps"}
        return tf.Starcoder2Config(**SHAPES, **rms, **special, rope_parameters=ROPE,
                                   sliding_window=WINDOW if arch.endswith("window") else None,
                                   attention_dropout=dropout, residual_dropout=dropout,
                                   embedding_dropout=dropout, architectures=["Starcoder2ForCausalLM"])
    if arch == "granite":
        return tf.GraniteConfig(**SHAPES, **RMS, **special, rope_parameters=ROPE, embedding_multiplier=2.0,
                                logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=1 / 32,
                                architectures=["GraniteForCausalLM"])
    if arch == "smollm3":  # every 4th layer without RoPE, as released
        return tf.SmolLM3Config(**SHAPES, **RMS, **special, rope_parameters=ROPE, no_rope_layer_interval=2,
                                architectures=["SmolLM3ForCausalLM"])
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=500, n_embd=128, n_head=4, n_layer=2, n_positions=256,
                             resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **special,
                             architectures=["GPT2LMHeadModel"])
    if arch == "bloom":
        return tf.BloomConfig(vocab_size=500, hidden_size=128, n_head=4, n_layer=2, hidden_dropout=dropout,
                              attention_dropout=dropout, **special, architectures=["BloomForCausalLM"])
    if arch == "falcon":  # the 7B layout: multi-query attention, parallel attention and MLP, RoPE
        return tf.FalconConfig(**SHAPES, max_position_embeddings=256, multi_query=True, parallel_attn=True,
                               new_decoder_architecture=False, bias=False, alibi=False, rope_parameters=ROPE,
                               hidden_dropout=dropout, attention_dropout=dropout, **special,
                               architectures=["FalconForCausalLM"])
    if arch == "phi":  # Phi-1/2: parallel attention and MLP, partial rotary, biased linears, a biased head
        return tf.PhiConfig(**SHAPES, intermediate_size=256, num_key_value_heads=4, max_position_embeddings=256,
                            rope_parameters={**ROPE, "partial_rotary_factor": 0.5}, resid_pdrop=dropout,
                            embd_pdrop=dropout, attention_dropout=dropout, **special, architectures=["PhiForCausalLM"])
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**SHAPES, intermediate_size=256, max_position_embeddings=256,
                                rope_parameters={**ROPE, "partial_rotary_factor": 0.25}, hidden_dropout=dropout,
                                attention_dropout=dropout, **special, architectures=["GPTNeoXForCausalLM"])
    if arch in ("stablelm", "stablelm_qknorm"):  # qk_layernorm: per-head LayerNorms of q and k
        return tf.StableLmConfig(**SHAPES, intermediate_size=256, num_key_value_heads=2, max_position_embeddings=256,
                                 rope_parameters={**ROPE, "partial_rotary_factor": 0.25},
                                 qk_layernorm=arch.endswith("qknorm"), hidden_dropout=dropout,
                                 attention_dropout=dropout, **special, architectures=["StableLmForCausalLM"])
    if arch == "gpt_oss":  # attention sinks: no SDPA path in transformers; a sliding layer and a full one
        return tf.GptOssConfig(**SHAPES, num_key_value_heads=2, head_dim=32, intermediate_size=64, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=WINDOW, layer_types=SLIDING,
                               max_position_embeddings=256, **special, architectures=["GptOssForCausalLM"])
    raise ValueError(f"arch_matrix: no config for {arch!r}")


HELD_OUT = ("qwen3", "gemma2", "cohere2", "starcoder2", "starcoder2_window", "granite", "smollm3", "gpt2",
            "bloom", "falcon", "gpt_neox", "gpt_oss", "stablelm", "stablelm_qknorm")
# served by vLLM 0.32 only through its Transformers modelling backend (rollout/vllm/transformers_backend.py); Phi
# is not in HELD_OUT (the 2-rank parity test's list): the suite runs it in the vLLM backend test only
VLLM_BACKEND = ("gpt_neox", "phi", "smollm3", "starcoder2")


def make_arch(out, arch: str, *, seed: int = 0, dropout: float = 0.0, tied: bool = False, weights: bool = True,
              **tiny) -> Path:
    """A tiny folder of `arch`: a family of verl_hpc.models.tiny (with `tiny` passed on) or one of
    HELD_OUT, its sliding windows (Gemma 2, Cohere 2, starcoder2_window) WINDOW tokens wide;
    `dropout` goes into the config's dropout fields (the families that have them here). Without
    `weights` (a held-out architecture): config.json and the tokenizer only, for the config checks."""
    from transformers import AutoModelForCausalLM

    from verl_hpc.models import tiny as tiny_lib

    if arch in tiny_lib.FAMILIES:
        return tiny_lib.make_tiny_model(out, arch, seed=seed, tied=tied, **tiny)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_lib.train_tokenizer()
    ids = {k: tokenizer.convert_tokens_to_ids(f"<|{k}|>") for k in ("bos", "eos", "pad")}
    config = _config(arch, ids, dropout, tied)
    if not weights:
        config.save_pretrained(out)
        tokenizer.save_pretrained(out)
        return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = tiny_lib.random_state_dict(model, seed, norm_offset=arch == "gemma2")
    if tied:
        state.pop("lm_head.weight", None)
    if arch == "gpt_neox" and "lm_head.weight" in state:  # released GPT-NeoX folders (Pythia) store the
        state["embed_out.weight"] = state.pop("lm_head.weight")  # head so; transformers 5 renames it on load
    config.save_pretrained(out)
    tiny_lib.save_safetensors(state, out)
    tokenizer.save_pretrained(out)
    return out
