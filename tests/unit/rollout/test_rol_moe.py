"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) in the rollout engines.

- HF generate: greedy tokens identical to transformers' plain decode, before and after a weight
  update in checkpoint names (the names the resharding sync sends; the model keeps its experts
  fused, models/moe.checkpoint_views).
- vLLM (CPU build): greedy tokens identical to transformers' as loaded and after each of three
  weight syncs with changed weights (0.32: vllm_compat handler 7 repacks the experts on every reload;
  0.25 repacks them itself); and what the reload does without that handler (0.32: stale experts, or
  a shape error where the expert FFN is padded for the kernel; 0.25: right), so that the handler is
  revisited when a vLLM release changes it; on 0.25 that padded width is served on every CPU
  through handler 10 (test_rol_moe_width.py).
"""
import importlib.util

import pytest
from rol_helpers import MAX_NEW, MAX_PROMPT, assert_matches, hf_greedy, load_hf, perturbed_state, prompts_of_lengths

from verl_hpc.rollout.sampling import default_spec
from verl_hpc.rollout.vllm import versions

GREEDY = default_spec(temperature=0, max_tokens=MAX_NEW)
PROMPTS = prompts_of_lengths(3, 17, 40)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
RELEASE = versions.release() if importlib.util.find_spec("vllm") else None


@pytest.fixture(scope="module", params=FAMILIES)
def moe_model(request, tmp_path_factory):
    from verl_hpc.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("rol_moe") / request.param, request.param, seed=21))


def test_hf_rollout_greedy_tokens_equal_transformers_across_a_weight_update(moe_model):
    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    engine = HFRollout(moe_model, **default_engine_args("hf", max_prompt_length=MAX_PROMPT,
                                                        max_response_length=MAX_NEW))
    try:
        assert_matches(engine.generate(PROMPTS, GREEDY), hf_greedy(load_hf(moe_model), PROMPTS, MAX_NEW))
        state = perturbed_state(moe_model, seed=5, scale=0.05)
        assert any(".experts." in n for n in state)
        info = engine.load_weights(iter(state.items()))
        assert info["tensors"] == len(state)
        assert_matches(engine.generate(PROMPTS, GREEDY), hf_greedy(load_hf(moe_model, state), PROMPTS, MAX_NEW))
    finally:
        engine.close()


def _vllm(path):
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    return VLLMRollout(path, **default_engine_args("vllm", max_prompt_length=MAX_PROMPT,
                                                   max_response_length=MAX_NEW))


def _reference(path, state=None):
    """transformers' greedy tokens, ending at the model's EOS as vLLM's do."""
    hf = load_hf(path, state)
    return hf_greedy(hf, PROMPTS, MAX_NEW, eos=hf.config.eos_token_id)


@pytest.mark.heavy
def test_vllm_cpu_greedy_tokens_equal_transformers_after_three_weight_syncs(moe_model):
    engine = _vllm(moe_model)
    try:
        assert_matches(engine.generate(PROMPTS, GREEDY), _reference(moe_model))
        for seed in (5, 6, 7):  # three syncs, each with other weights
            state = perturbed_state(moe_model, seed=seed, scale=0.05)
            assert engine.load_weights(iter(state.items()))["tensors"] == len(state)
            assert_matches(engine.generate(PROMPTS, GREEDY), _reference(moe_model, state))
    finally:
        engine.close()


@pytest.fixture
def unpatched_reload(monkeypatch):
    """vLLM's own _setup_kernel in place of handler 7's wrapper, for the length of a test (the
    engine's construction installs the wrapper: call the returned function after it). On a release
    without handler 7 (0.25: its CPU experts repack on every reload), checks it was not installed."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    def unpatch():
        wrapper = UnquantizedFusedMoEMethod.__dict__["_setup_kernel"]
        if not RELEASE.moe_reload_repack:
            assert not getattr(wrapper, "_verl_hpc_moe_repack", False), f"handler 7 installed on vLLM {RELEASE.version}"
            return
        assert wrapper._verl_hpc_moe_repack, "handler 7 was not installed by the engine's construction"
        monkeypatch.setattr(UnquantizedFusedMoEMethod, "_setup_kernel", wrapper.__wrapped__)
    return unpatch


@pytest.mark.heavy
def test_without_the_repack_vllm_cpu_reloads_moe_experts_stale(tmp_path, unpatched_reload):
    """vllm-cpu 0.32's own reload: even the loaded weights, reloaded unchanged, answer otherwise.
    When this fails, vLLM repacks on reload itself: handler 7 would then pack twice (remove it).
    vllm-cpu 0.25 repacks on reload itself: there the unchanged weights answer as before, unhandled."""
    from verl_hpc.models.tiny import make_tiny_model

    path = str(make_tiny_model(tmp_path / "m", "qwen3_moe", seed=21))
    engine = _vllm(path)
    try:
        reference = _reference(path)
        assert_matches(engine.generate(PROMPTS, GREEDY), reference)
        unpatched_reload()
        same = perturbed_state(path, seed=5, scale=0.0)
        engine.load_weights(iter(same.items()))
        if RELEASE.moe_reload_repack:
            assert engine.generate(PROMPTS, GREEDY).response_ids != [t for t, _ in reference]
        else:
            assert_matches(engine.generate(PROMPTS, GREEDY), reference)
    finally:
        engine.close()


@pytest.mark.heavy
def test_padded_expert_ffn_reloads_with_the_repack_and_fails_without(tmp_path, unpatched_reload):
    """An expert FFN of 48 (vllm-cpu 0.32's kernel pads it to 64 at load): the repack pads again on
    every reload; vLLM's own reload copies the unpadded weights into the padded tensors and fails.
    vllm-cpu 0.25 neither pads nor needs the repack: its own reload serves the new weights. On 0.25
    an FFN of 48 (16 modulo 32) is the width its AVX-512 builds' vector kernel aborts on, so on an
    AVX-512 CPU this engine is served by handler 10's torch path (on an AVX2 one by the same path,
    the build having no such kernel): test_rol_moe_width.py holds the rule for each CPU kind."""
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout.vllm import cpu_moe

    path = str(make_tiny_model(tmp_path / "m", "mixtral", seed=21, expert_ffn=48))
    engine = _vllm(path)
    try:
        assert not RELEASE.cpu_moe_width_guard or cpu_moe.width_guard_installed()
        state = perturbed_state(path, seed=6, scale=0.05)
        engine.load_weights(iter(state.items()))
        assert_matches(engine.generate(PROMPTS, GREEDY), _reference(path, state))
        unpatched_reload()
        if RELEASE.moe_reload_repack:
            with pytest.raises(RuntimeError, match="must match the size"):
                engine.load_weights(iter(state.items()))
        else:
            state = perturbed_state(path, seed=7, scale=0.05)
            engine.load_weights(iter(state.items()))
            assert_matches(engine.generate(PROMPTS, GREEDY), _reference(path, state))
    finally:
        engine.close()


@pytest.mark.heavy
def test_factory_builds_vllm_for_moe_on_cpu(moe_model):
    from verl_hpc.config import load_config
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.factory import build_rollout, choose_engine
    from verl_hpc.trainer.roles import rollout_options

    lengths = ["data.max_prompt_length=64", "rollout.max_tokens=16"]
    cfg = load_config(None, [f"model.path={moe_model}", "rollout.engine=auto", *lengths])
    assert choose_engine(rollout_options(cfg)) == ("vllm", "vllm is installed")
    if not moe_model.endswith("qwen2_moe"):  # one engine built is enough (the others are above)
        return
    cfg = load_config(None, [f"model.path={moe_model}", "rollout.engine=vllm", *lengths])
    engine = build_rollout(rollout_options(cfg))
    try:
        assert isinstance(engine, VLLMRollout)
    finally:
        engine.close()


@pytest.mark.parametrize("sampling", [GREEDY, default_spec(temperature=1.0, max_tokens=MAX_NEW, n=2, seed=4)],
                         ids=["greedy", "sampled_shared_prefill"])
def test_hf_rollout_records_the_routes_a_full_forward_takes(moe_model, sampling):
    """Routing replay's record side: each row's routes (prompt and response tokens but the last)
    equal the routers' choices in one transformers forward of the whole sequence."""
    import torch

    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.hf.routes import RouteRecorder

    engine = HFRollout(moe_model, **default_engine_args("hf", max_prompt_length=MAX_PROMPT,
                                                        max_response_length=MAX_NEW), record_routes=True)
    try:
        res = engine.generate(PROMPTS, sampling)
    finally:
        engine.close()
    model = load_hf(moe_model)
    reference = RouteRecorder(model)
    for i in range(len(res)):
        seq = res.sequence(i)
        reference.start()
        with torch.no_grad():
            model(input_ids=torch.tensor([seq]))
        reference.stop()
        full = reference.joined(1, len(seq))[0]
        assert res.routes[i].dtype == torch.uint8 and res.routes[i].shape == (len(seq) - 1, 2, 2)
        assert torch.equal(res.routes[i].sort(-1).values, full[:-1].sort(-1).values), i


def test_deepseek_v3_rolls_out_with_hf_generate_on_cpu_and_vllm_is_refused_in_one_line(tmp_path):
    """HF generate serves DeepSeek-V3 (latent attention, the biased router) exactly, across a weight
    update that includes the router's bias; vllm-cpu's latent attention takes no float32 weights (0.25:
    none at all), so
    auto picks HF generate and rollout.engine=vllm is one line naming why and the ways out."""
    from verl_hpc.config import load_config
    from verl_hpc.config.errors import ConfigError
    from verl_hpc.models.tiny import make_tiny_model
    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args
    from verl_hpc.rollout.factory import build_rollout, choose_engine
    from verl_hpc.trainer.roles import rollout_options

    path = str(make_tiny_model(tmp_path / "ds", "deepseek_v3", seed=21))
    engine = HFRollout(path, **default_engine_args("hf", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW))
    try:
        assert_matches(engine.generate(PROMPTS, GREEDY), hf_greedy(load_hf(path), PROMPTS, MAX_NEW))
        state = perturbed_state(path, seed=5, scale=0.05)
        assert "model.layers.1.mlp.gate.e_score_correction_bias" in state
        engine.load_weights(iter(state.items()))
        assert_matches(engine.generate(PROMPTS, GREEDY), hf_greedy(load_hf(path, state), PROMPTS, MAX_NEW))
    finally:
        engine.close()
    lengths = ["data.max_prompt_length=64", "rollout.max_tokens=16"]
    engine_name, why = choose_engine(rollout_options(load_config(None, [f"model.path={path}", "rollout.engine=auto",
                                                                         *lengths])))
    assert engine_name == "hf" and "latent attention" in why, why
    with pytest.raises(ConfigError) as e:
        build_rollout(rollout_options(load_config(None, [f"model.path={path}", "rollout.engine=vllm", *lengths])))
    line = str(e.value)
    assert "\n" not in line and "DeepseekV3ForCausalLM" in line and "rollout.engine=hf" in line
    # vllm-cpu 0.32's MLA takes no float32 weights; 0.25's has no CPU kernel at all
    assert ("float32" if versions.release().cpu_mla_dtypes else "no CPU kernel") in line, line
