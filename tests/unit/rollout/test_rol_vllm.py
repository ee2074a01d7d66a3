"""VLLMRollout in one process (vLLM world size 1) against an independent transformers reference.

One engine serves the whole module (building one takes 3-20 s); tests that change its weights put
the original ones back, and the test that breaks it on purpose runs last and closes it.
"""
import logging

import pytest
import torch
from rol_helpers import (MAX_NEW, MAX_PROMPT, TOL, assert_matches, eos_first, hf_greedy,
                         load_hf, max_diff, perturbed_state, pick_stop_string, prompts_of_lengths,
                         teacher_forced_logprobs)

from verl_hpc.rollout import PromptTooLongError
from verl_hpc.rollout.sampling import default_spec
from verl_hpc.rollout import engine as engine_mod


GREEDY = default_spec(temperature=0, max_tokens=MAX_NEW)
EOS = 2  # tiny tokenizer's <|eos|>
PROMPTS = prompts_of_lengths(3, 17, 64, 160)  # 160 > one 128-token KV block: it gets cached


@pytest.fixture(scope="module")
def built(tiny_model):
    """The engine, plus what construction did to the process's RNG and thread setter."""
    import random

    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    import torch.distributed as dist

    setter, dist_before = torch.set_num_threads, dist.is_initialized()
    torch.manual_seed(1234), random.seed(1234)
    expected = torch.rand(3).tolist(), random.random()
    torch.manual_seed(1234), random.seed(1234)
    engine = VLLMRollout(tiny_model,
                         **default_engine_args("vllm", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW,
                                               collective_timeout_s=321, max_num_batched_tokens=5000))
    after = torch.rand(3).tolist(), random.random()
    yield dict(engine=engine, rng_kept=after == expected, setter_kept=torch.set_num_threads is setter,
               dist_before=dist_before)
    engine.close()


@pytest.fixture(scope="module")
def engine(built):
    return built["engine"]


@pytest.fixture(scope="module")
def reference(hf):
    """transformers' greedy tokens and logprobs for PROMPTS on the original weights."""
    return hf_greedy(hf, PROMPTS)


def test_vllms_own_process_groups_take_the_jobs_collective_timeout(engine):
    """vLLM's TP/PP groups (device and gloo) time out with trainer.collective_timeout_s, not torch's
    defaults (issue 27, 7): the engine's own config carries it."""
    parallel = engine.llm.llm_engine.vllm_config.parallel_config
    assert (parallel.distributed_timeout_seconds, parallel.cpu_distributed_timeout_seconds) == (321, 321)


def test_the_scheduler_is_the_configs_and_chunked_prefill_is_off_on_cpu(engine, tiny_model):
    """rollout.max_num_batched_tokens reaches vLLM's scheduler; chunked prefill follows the machine
    (auto: off without a GPU), and asked for on CPU it is refused before vLLM starts."""
    from verl_hpc.config import ConfigError
    from verl_hpc.rollout import VLLMRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    scheduler = engine.llm.llm_engine.vllm_config.scheduler_config
    assert scheduler.max_num_batched_tokens == 5000 and not scheduler.enable_chunked_prefill
    with pytest.raises(ConfigError, match="rollout.enable_chunked_prefill = true on a machine without a GPU"):
        VLLMRollout(tiny_model, chunked_prefill=True,
                    **default_engine_args("vllm", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW))


def test_the_cpu_kv_cache_holds_every_sequence_of_a_step_at_full_length(engine):
    """The KV cache sized on CPU (compat.cpu_kv_cache_bytes) gives max_num_seqs sequences their
    whole blocks at once, besides the null block vLLM keeps: without it the last sequence of a full
    step waited for the others to finish (issue 96)."""
    vllm_config = engine.llm.llm_engine.vllm_config
    blocks = -(-vllm_config.model_config.max_model_len // vllm_config.cache_config.block_size)
    assert vllm_config.cache_config.num_gpu_blocks >= engine._kwargs["max_num_seqs"] * blocks + 1


def test_construction_leaves_rng_and_threads_alone(built):
    assert built["rng_kept"], "engine construction changed the global RNG"
    assert built["setter_kept"], "torch.set_num_threads was left replaced"


@pytest.mark.numerics  # greedy tokens of vLLM and transformers, log-probs within 1e-4: make test-portable
def test_greedy_matches_transformers(engine, reference):
    ref = reference  # ends where the model's greedy path meets EOS, if it does
    torch.manual_seed(7)
    before = torch.rand(2)
    torch.manual_seed(7)
    result = engine.generate(PROMPTS, GREEDY)
    assert torch.equal(torch.rand(2), before), "generate changed the global RNG"
    diff = assert_matches(result, ref)
    print(f"greedy vs transformers: max |logprob diff| = {diff:.2e}")
    assert result.finish_reason == ["stop" if toks[-1] == EOS else "length" for toks, _ in ref]
    assert result.prompts == PROMPTS
    assert result.prompt_index == [0, 1, 2, 3] and result.sample_index == [0] * 4


def test_sampling_is_seeded_ordered_and_logprobs_are_the_sampled_distribution(engine, hf):
    spec = default_spec(n=3, temperature=0.7, top_k=20, max_tokens=MAX_NEW, seed=5)
    first, again = engine.generate(PROMPTS[:3], spec), engine.generate(PROMPTS[:3], spec)
    assert first.response_ids == again.response_ids and first.logprobs == again.logprobs
    assert first.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2] and first.sample_index == [0, 1, 2] * 3
    assert len({tuple(r) for r in first.response_ids[:3]}) == 3, "n samples of one prompt alike"
    other = engine.generate(PROMPTS[:3], spec.for_step(1))
    assert other.response_ids != first.response_ids
    for row in (0, 4, 8):  # processed logprobs: log-softmax of top-20 of logits / 0.7
        ref = teacher_forced_logprobs(hf, PROMPTS[first.prompt_index[row]], first.response_ids[row],
                                      temperature=0.7, top_k=20)
        assert max_diff([first.logprobs[row]], [ref]) <= TOL


def test_stop_strings_end_a_response_at_the_completing_token(engine, hf, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    greedy = engine.generate(PROMPTS, GREEDY)
    picks = [pick_stop_string(tok, r) for r in greedy.response_ids]
    row = next(i for i, p in enumerate(picks) if p)
    stop, count = picks[row]
    result = engine.generate([PROMPTS[row]], default_spec(temperature=0, max_tokens=MAX_NEW,
                                                          stop=(stop,)))
    assert result.finish_reason == ["stop"]
    assert result.response_ids[0] == greedy.response_ids[row][:count]
    assert result.logprobs[0] == pytest.approx(greedy.logprobs[row][:count], abs=TOL)


def test_truncate_keeps_the_end_of_a_long_prompt(engine, hf):
    long = prompts_of_lengths(MAX_PROMPT + 8, seed=3)[0]
    result = engine.generate([long, PROMPTS[0]], GREEDY)
    assert result.num_truncated == 1 and result.prompts[0] == long[-MAX_PROMPT:]
    assert_matches(result, hf_greedy(hf, [long[-MAX_PROMPT:], PROMPTS[0]]))


def test_reject_names_the_prompt(engine, monkeypatch):
    monkeypatch.setattr(engine, "prompt_overflow", "reject")
    with pytest.raises(PromptTooLongError, match=f"prompt 1 has {MAX_PROMPT + 1} tokens"):
        engine.generate([[5], [5] * (MAX_PROMPT + 1)], GREEDY)


def test_sleep_and_wake_are_a_noop_logged_once_on_cpu(engine, caplog, monkeypatch):
    monkeypatch.setattr(engine_mod, "_said", set())
    with caplog.at_level(logging.INFO, logger="verl_hpc.rollout.engine"):
        for _ in range(3):
            engine.sleep()
            engine.wake()
    said = [r.getMessage() for r in caplog.records if "no-ops" in r.getMessage()]
    assert len(said) == 1 and "vllm" in said[0]
    assert len(engine.generate(PROMPTS[:1], GREEDY)) == 1  # still usable


def test_load_weights_updates_the_engine_and_resets_the_prefix_cache(engine, tiny_model, original,
                                                                     reference):
    new_state = perturbed_state(tiny_model)
    new_ref = hf_greedy(load_hf(tiny_model, new_state), PROMPTS)
    long = len(PROMPTS) - 1
    engine.generate(PROMPTS, GREEDY)  # the long prompt's first KV block is now cached

    # vLLM's reload alone (no reset_prefix_cache) serves the cached prompt from stale keys/values
    engine.llm.collective_rpc("reload_weights", kwargs=dict(
        weights_iterator=iter(new_state.items()), is_checkpoint_format=True))
    stale = engine.generate([PROMPTS[long]], GREEDY)
    stale_diff = max(abs(a - b) for a, b in zip(stale.logprobs[0], new_ref[long][1]))
    assert stale_diff > 1e-3, "expected stale prefix-cache output without the reset"

    torch.manual_seed(3)
    before = torch.rand(2)
    torch.manual_seed(3)
    info = engine.load_weights(iter(new_state.items()))
    assert torch.equal(torch.rand(2), before), "load_weights changed the global RNG"
    assert info["tensors"] == len(original) and info["bytes"] == sum(
        t.numel() * 4 for t in original.values())
    diff = assert_matches(engine.generate(PROMPTS, GREEDY), new_ref)
    print(f"after load_weights: max |logprob diff| = {diff:.2e}; without reset: {stale_diff:.2e}")

    engine.load_weights(iter(original.items()))  # and back: the other tests expect these
    assert_matches(engine.generate(PROMPTS, GREEDY), reference)


def test_eos_ends_with_stop_and_min_tokens_holds_it_back(engine, hf, tiny_model, original):
    state, model = eos_first(hf, tiny_model, original, PROMPTS[0], EOS)
    engine.load_weights(iter(state.items()))
    try:
        result = engine.generate(PROMPTS[:1], GREEDY)
        assert result.response_ids == [[EOS]] and result.finish_reason == ["stop"]
        assert_matches(result, hf_greedy(model, PROMPTS[:1], eos=EOS))
        held = engine.generate(PROMPTS[:1], default_spec(temperature=0, max_tokens=MAX_NEW,
                                                         min_tokens=3))
        ref = hf_greedy(model, PROMPTS[:1], eos=EOS, min_tokens=3)
        assert len(held.response_ids[0]) >= 4 and EOS not in held.response_ids[0][:3]
        assert_matches(held, ref)
        assert held.finish_reason == ["stop" if ref[0][0][-1] == EOS else "length"]
    finally:
        engine.load_weights(iter(original.items()))


@pytest.mark.heavy
def test_bad_update_breaks_the_engine_and_close_is_safe(built, engine, original):
    """Last: leaves the engine unusable on purpose."""
    import torch.distributed as dist

    bad = [("model.embed_tokens.weight", original["model.embed_tokens.weight"]),
           ("model.layers.0.mlp.gate_projj.weight", original["model.layers.0.mlp.gate_proj.weight"])]
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_projj.weight' is not a weight"
                                         r".*did you mean model.layers.0.mlp.gate_proj.weight"):
        engine.load_weights(iter(bad))
    with pytest.raises(RuntimeError, match="undefined after a failed load_weights"):
        engine.generate(PROMPTS[:1], GREEDY)
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="after close"):
        engine.generate(PROMPTS[:1], GREEDY)
    # A default group that existed before the engine (the job's) survives close(); one that vLLM
    # made itself (a plain process) goes with it. tests/dist/rollout runs the first case.
    assert dist.is_initialized() == built["dist_before"]
