"""The FSDP engine on held-out architectures (tests/arch_matrix.py: tiny, from transformers' own
config classes) against float64 transformers (tests/update_reference.py): log-probs and entropy
within 2e-5 and one update within 1e-5, one rank in this process. GPT-2 (Conv1D, n_head/n_layer),
BLOOM (ALiBi, no SDPA path in transformers: its eager attention runs), Falcon (multi-query,
parallel attention, no intermediate_size), GPT-NeoX (embed_out, partial rotary), Gemma 2 and
Cohere 2 (sliding-window layers of 6 tokens, past which the prompts run)."""
import pytest

from arch_matrix import make_arch
from update_reference import hf_forward64, hf_update64, max_diff, policy_batch

LOGP_TOL, WEIGHT_TOL = 2e-5, 1e-5
ARCHS = ("gpt2", "bloom", "falcon", "gpt_neox", "gemma2", "cohere2")


def _loss(outs, mb, counts):
    return -(outs["log_probs"] * mb["advantages"] * mb["response_mask"]).sum() / counts.tokens, {}


def _engine(path, **changes):
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.fsdp import FsdpEngine
    from verl_hpc.engines.options import default_options

    optim = OptimConfig(lr=0.5, eps=1.0, clip_grad=0.0)
    return FsdpEngine(default_options(str(path), engine="fsdp", optim=optim, micro_batch_size=4, **changes)), optim


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_one_update_equal_float64_transformers(arch, one_rank_world, tmp_path):
    path = make_arch(tmp_path / arch, arch, tied=arch in ("gpt2", "bloom", "gemma2", "cohere2"))
    batch = policy_batch(5, n=6)  # prompts of 2-8 tokens, responses of 1-10: most rows pass the window
    engine, optim = _engine(path)
    got = engine.forward(batch)
    logp, ent, _ = hf_forward64(path, batch)
    assert float((got["log_probs"].double() - logp).abs().max()) <= LOGP_TOL
    assert float((got["entropy"].double() - ent).abs().max()) <= LOGP_TOL
    want, norm = hf_update64(path, batch, _loss, optim)
    metrics = engine.train_step(batch, _loss)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert max_diff({n: p.detach().full_tensor() for n, p in engine.model.named_parameters()}, want) <= WEIGHT_TOL


def test_gpt_oss_runs_its_eager_attention_and_gives_transformers_log_probs(one_rank_world, tmp_path):
    """GPT-OSS (attention sinks, MoE): transformers has no SDPA path for it, and 85ec11b asked for SDPA
    (a ValueError outside the one-line wrapper). Its experts' grouped GEMM takes no float64, so the
    reference is transformers in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from update_reference import response_outputs

    path = make_arch(tmp_path / "gpt_oss", "gpt_oss")
    engine, _ = _engine(path)
    assert engine.hf_config._attn_implementation == "eager" and engine._sharing is None
    batch = policy_batch(5, n=6)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(batch["input_ids"]).logits
    logp, _, _ = response_outputs(logits.double(), batch)
    assert float((engine.forward(batch)["log_probs"].double() - logp).abs().max()) <= LOGP_TOL


def test_a_model_transformers_cannot_build_is_one_line_even_on_the_meta_device(one_rank_world, tmp_path, monkeypatch):
    """BLOOM asked for SDPA (what 85ec11b always asked for): transformers' ValueError, raised while
    every rank builds the architecture on the meta device, is the engine's one line."""
    from verl_hpc.config.errors import ConfigError
    from verl_hpc.engines.fsdp import build

    path = make_arch(tmp_path / "bloom", "bloom")
    monkeypatch.setattr(build, "attention_implementation", lambda cls, config: "sdpa")
    with pytest.raises(ConfigError) as err:
        _engine(path)
    text = str(err.value)
    assert text.startswith(f"model.path: transformers cannot build the model of '{path}' (BloomConfig): ")
    assert "scaled_dot_product_attention" in text and "\n" not in text
