"""rollout.engine=auto: HF generate for tiny models on CPU (measured faster there); above that on CPU
the engine with fewer cost-weighted token passes; vLLM on GPU; with the reason given."""

from verl_hpc.config import load_config
from verl_hpc.rollout import factory


def _cfg(path, *overrides):
    return load_config(None, [f"model.path={path}", "rollout.engine=auto", *overrides])


def test_auto_picks_hf_for_a_tiny_model_on_cpu(tmp_path, monkeypatch):
    from verl_hpc.models.tiny import make_tiny_model

    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: False)
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    engine, why = factory.choose_engine(_cfg(make_tiny_model(tmp_path / "tiny", "llama", layers=2)))
    assert engine == "hf" and "parameters on CPU" in why


def test_auto_picks_vllm_for_a_larger_model_a_gpu_or_an_unknown_size(tmp_path, monkeypatch):
    from verl_hpc.models.tiny import make_tiny_model

    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: False)
    big = make_tiny_model(tmp_path / "big", "llama", layers=4, vocab_size=500, hidden=512, heads=8, kv_heads=4,
                          head_dim=64, ffn=1408)
    assert factory.choose_engine(_cfg(big))[0] == "vllm"
    assert factory.choose_engine(_cfg(tmp_path / "missing"))[0] == "vllm"
    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: True)
    tiny = make_tiny_model(tmp_path / "tiny", "llama", layers=2)
    assert factory.choose_engine(_cfg(tiny)) == ("vllm", "a GPU is present")
    monkeypatch.setattr(factory, "vllm_available", lambda: False)
    assert factory.choose_engine(_cfg(tiny)) == ("hf", "vllm is not installed")


def test_auto_on_cpu_weighs_vllms_repeated_prefill_against_hfs_decode_cost(tmp_path, monkeypatch):
    from verl_hpc.models.tiny import make_tiny_model

    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: False)
    model = make_tiny_model(tmp_path / "m", "llama", layers=4, vocab_size=500, hidden=512, heads=8, kv_heads=4,
                            head_dim=64, ffn=1408)  # ~10M: above the tiny-model rule
    # 8 samples of 32-token prompts, 24 new tokens: vLLM 8 x 56 = 448 passes, HF 32 + 8 x 24 = 224
    short = _cfg(model, "rollout.n=8", "data.max_prompt_length=32", "data.max_response_length=24")
    assert factory.rollout_token_passes(short) == (448, 224)
    engine, why = factory.choose_engine(short)
    assert engine == "hf" and "vLLM runs 448 token passes" in why and "HF 224" in why
    # 128 new tokens: 8 x 160 = 1280 against 1.35 x (32 + 1024) = 1426 -> vLLM
    long = _cfg(model, "rollout.n=8", "data.max_prompt_length=32", "data.max_response_length=128")
    assert factory.choose_engine(long)[0] == "vllm"
    # one sample per prompt: nothing repeated, vLLM
    assert factory.choose_engine(_cfg(model, "rollout.n=1", "data.max_response_length=24"))[0] == "vllm"
    # the boundary sits at HF_TOKEN_COST
    monkeypatch.setattr(factory, "HF_TOKEN_COST", 448 / 224 + 0.01)
    assert factory.choose_engine(short)[0] == "vllm"
