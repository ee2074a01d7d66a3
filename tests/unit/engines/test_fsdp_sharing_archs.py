"""Prompt sharing (the packed layout) per architecture, against the plain layout and float64
transformers: every architecture the docs name and the held-out ones (tests/arch_matrix.py), tiny,
from transformers' own config classes.

- the architectures of sharing.EXACT_MODEL_TYPES pack (`share_prompts=on`): log-probs and entropy
  within 1e-5 of one sequence per row, the gradients within 1e-5, and the weights after one step too;
- sliding-window and local/global ones (Gemma 2 and 3, Cohere 2, Starcoder2 with a window) and the
  unproven ones never pack: `auto` runs them one sequence per row (the reason logged once) and gives
  transformers' float64 log-probs; `on` is refused in one line naming the cause. Their windows are a
  few tokens, so that the test prompts slide.
"""
import dataclasses
import logging

import pytest
import torch

from arch_matrix import make_arch
from engine_states import grpo_batch
from update_reference import hf_forward64

TOL = 1e-5
EXACT = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v3", "phi3",
         "olmo2", "starcoder2", "granite", "smollm3")
PLAIN = {"gemma2": "sliding_attention", "gemma3": "sliding_attention", "cohere2": "sliding_attention",
         "starcoder2_window": "sliding_window = 6", "gpt2": "not among", "falcon": "not among"}


def _loss(outs, mb, counts):
    return -(outs["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / counts.tokens, {}


def _engine(path, share):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    o = default_options(str(path), engine="fsdp", optim=OptimConfig(lr=1e-2, eps=1.0), micro_batch_size=12)
    return FsdpEngine(dataclasses.replace(o, share_prompts=share))


def _weights(engine):
    return {n: p.detach().full_tensor() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("arch", EXACT)
def test_packed_rows_equal_the_plain_layout(arch, one_rank_world, tmp_path):
    path = make_arch(tmp_path / arch, arch)
    packed, plain = _engine(path, "on"), _engine(path, "off")
    batch = grpo_batch(prompt=18)
    a, b = packed.forward(batch), plain.forward(batch)
    for key in ("log_probs", "entropy"):
        assert float((a[key] - b[key]).abs().max()) <= TOL, key
    ma, mb = packed.train_step(batch, _loss), plain.train_step(batch, _loss)
    assert ma["packed_microbatches"] == 1.0 and mb["packed_microbatches"] == 0.0
    ga = {n: p.grad.full_tensor() for n, p in packed.model.named_parameters()}
    gb = {n: p.grad.full_tensor() for n, p in plain.model.named_parameters()}
    assert max(float((ga[k] - gb[k]).abs().max()) for k in ga) <= TOL
    assert max(float(g.abs().max()) for g in gb.values()) > 1e-3  # not all ~0
    wa, wb = _weights(packed), _weights(plain)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= TOL


@pytest.mark.parametrize("arch", list(PLAIN))
def test_windowed_and_unproven_attention_runs_one_sequence_per_row(arch, one_rank_world, tmp_path, caplog):
    """On 85ec11b `auto` packed these rows (the prompts dominate: the cost model packs) and the
    sliding layers attended past their window: log-probs 0.5-3.5 away from transformers'."""
    from verl_hpc.config.errors import ConfigError
    from verl_hpc.engines.fsdp import sharing

    path = make_arch(tmp_path / arch, arch)
    sharing._logged.clear()
    with caplog.at_level(logging.INFO, logger=sharing.__name__):
        auto, again = _engine(path, "auto"), _engine(path, "auto")
    said = [r.getMessage() for r in caplog.records if "shared prompts off" in r.getMessage()]
    assert len(said) == 1 and PLAIN[arch] in said[0], said
    assert auto._sharing is None and again._sharing is None
    batch = grpo_batch(prompt=18)
    logp, _, mask = hf_forward64(path, batch)
    got = auto.forward(batch)["log_probs"].double()
    assert float((got - logp).abs().max()) <= TOL
    assert auto.train_step(batch, _loss)["packed_microbatches"] == 0.0
    with pytest.raises(ConfigError) as err:
        _engine(path, "on")
    assert "actor.share_prompts=on" in str(err.value) and PLAIN[arch] in str(err.value)
    assert "\n" not in str(err.value)


def test_the_cost_model_reads_the_widths_by_each_familys_names():
    """GPT-2 (n_embd, n_head, n_inner null), Falcon (ffn_hidden_size), BLOOM (no MLP width at all):
    the cost model builds from each config object, where 85ec11b read config.intermediate_size."""
    import transformers as tf

    from verl_hpc.engines.fsdp.sharing import DenseMaskCost

    llama = DenseMaskCost.for_config(tf.LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                                                    intermediate_size=512))
    for cfg in (tf.GPT2Config(n_embd=128, n_head=4), tf.BloomConfig(hidden_size=128, n_head=4),
                tf.FalconConfig(hidden_size=128, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=512)):
        assert DenseMaskCost.for_config(cfg) == llama, type(cfg).__name__
