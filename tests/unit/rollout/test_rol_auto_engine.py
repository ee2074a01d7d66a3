"""rollout.engine=auto: HF generate for tiny models on CPU (measured faster there), vLLM otherwise,
with the reason given."""
import pytest

from verl_hpc.config import load_config
from verl_hpc.rollout import factory

pytestmark = pytest.mark.unit


def _cfg(path):
    return load_config(None, [f"model.path={path}", "rollout.engine=auto"])


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
