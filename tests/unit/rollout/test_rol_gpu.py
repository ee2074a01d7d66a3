"""GPU-only paths of VLLMRollout: sleep mode between phases and model.dtype. Skipped without a
CUDA device (tests/conftest.py); not yet run by this project (no GPU in its CI so far)."""
import importlib.util

import pytest
from rol_helpers import MAX_NEW, MAX_PROMPT, hf_greedy, load_hf, perturbed_state, prompts_of_lengths

from verl_hpc.rollout.sampling import default_spec

# a GPU machine without vLLM (the kit's carried wheels leave it out) skips them with the reason
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                  reason="vLLM is not installed on this GPU machine")]

GREEDY = default_spec(temperature=0, max_tokens=MAX_NEW)
PROMPTS = prompts_of_lengths(3, 17, 64)


def test_sleep_wake_and_update_on_gpu(tiny_model):
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    engine = VLLMRollout(tiny_model, sleep_between_phases=True,
                         **default_engine_args("vllm", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW,
                                               gpu_memory_utilization=0.2))
    try:
        assert engine._sleep_enabled
        first = engine.generate(PROMPTS, GREEDY)
        engine.sleep()
        with pytest.raises(RuntimeError, match="asleep"):
            engine.generate(PROMPTS, GREEDY)
        engine.wake()
        assert engine.generate(PROMPTS, GREEDY).response_ids == first.response_ids
        state = perturbed_state(tiny_model)
        engine.sleep()
        engine.wake()
        engine.load_weights(iter(state.items()))
        ref = hf_greedy(load_hf(tiny_model, state), PROMPTS)
        got = engine.generate(PROMPTS, GREEDY)
        # fp32 on a GPU: different kernels than transformers on the CPU, so a looser bound
        assert got.response_ids == [t for t, _ in ref]
        assert max(abs(a - b) for g, (_, r) in zip(got.logprobs, ref) for a, b in zip(g, r)) < 1e-3
    finally:
        engine.close()


def test_bf16_on_gpu_builds_and_generates(tiny_model):
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    engine = VLLMRollout(tiny_model, **default_engine_args("vllm", dtype="bfloat16", max_prompt_length=MAX_PROMPT,
                                                           max_response_length=MAX_NEW, gpu_memory_utilization=0.2))
    try:
        result = engine.generate(PROMPTS, GREEDY)
        assert len(result) == len(PROMPTS) and all(1 <= len(r) <= MAX_NEW for r in result.response_ids)
    finally:
        engine.close()
