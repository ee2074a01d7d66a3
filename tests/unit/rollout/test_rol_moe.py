"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) in the rollout engines.

- HF generate (the CPU rollout of MoE jobs): greedy tokens identical to transformers' plain decode,
  before and after a weight update in checkpoint names (the names the resharding sync sends; the
  model keeps its experts fused, models/moe.checkpoint_views).
- vLLM (CPU build): serves the model as loaded with the same greedy tokens; its in-place weight
  reload does not (the reason rollout.factory picks HF for MoE on CPU), shown here so that the
  choice is revisited when a vLLM release fixes it.
"""
import pytest
from rol_helpers import MAX_NEW, MAX_PROMPT, assert_matches, hf_greedy, load_hf, perturbed_state, prompts_of_lengths

from verl_hpc.rollout.spec import default_spec

GREEDY = default_spec(temperature=0, max_tokens=MAX_NEW)
PROMPTS = prompts_of_lengths(3, 17, 40)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


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


def test_vllm_cpu_serves_the_loaded_moe_model_but_not_a_reload(moe_model):
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    engine = VLLMRollout(moe_model, **default_engine_args("vllm", max_prompt_length=MAX_PROMPT,
                                                          max_response_length=MAX_NEW))
    try:
        reference = hf_greedy(load_hf(moe_model), PROMPTS, MAX_NEW)
        assert_matches(engine.generate(PROMPTS, GREEDY), reference)
        state = perturbed_state(moe_model, seed=5, scale=0.05)
        engine.load_weights(iter(state.items()))
        stale = engine.generate(PROMPTS, GREEDY).response_ids
        assert stale != [t for t, _ in hf_greedy(load_hf(moe_model, state), PROMPTS, MAX_NEW)]
    finally:
        engine.close()


def test_factory_picks_hf_for_moe_on_cpu_and_refuses_vllm(moe_model):
    from verl_hpc.config import load_config
    from verl_hpc.rollout.factory import build_rollout, choose_engine
    from verl_hpc.trainer.roles import rollout_options

    cfg = load_config(None, [f"model.path={moe_model}", "rollout.engine=auto"])
    engine, why = choose_engine(rollout_options(cfg))
    assert engine == "hf" and "mixture-of-experts" in why
    cfg = load_config(None, [f"model.path={moe_model}", "rollout.engine=vllm"])
    with pytest.raises(ValueError, match="rollout.engine=vllm with a mixture-of-experts model on CPU"):
        build_rollout(rollout_options(cfg))
