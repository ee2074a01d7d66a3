"""HFRollout (transformers generate) against the same independent reference as VLLMRollout."""
import logging

import pytest
from rol_helpers import (MAX_NEW, MAX_PROMPT, TOL, assert_matches, eos_first, hf_greedy,
                         load_hf, max_diff, perturbed_state, pick_stop_string, prompts_of_lengths,
                         teacher_forced_logprobs)

from verl_hpc.rollout.sampling import default_spec
from verl_hpc.rollout import engine as engine_mod


GREEDY = default_spec(temperature=0, max_tokens=MAX_NEW)
EOS = 2
PROMPTS = prompts_of_lengths(3, 17, 64, 160)


def _build(path, **kw):
    from verl_hpc.rollout import HFRollout
    from verl_hpc.rollout.engine_config import default_engine_args

    # batch_size 3: 4 prompts make two batches, each left-padded to its longest prompt
    return HFRollout(path, batch_size=3,
                     **default_engine_args("hf", max_prompt_length=MAX_PROMPT, max_response_length=MAX_NEW, **kw))


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = _build(tiny_model)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(hf):
    """transformers' greedy tokens and logprobs for PROMPTS on the original weights."""
    return hf_greedy(hf, PROMPTS)


def _column_major(engine) -> bool:
    import torch

    linears = [m.weight for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    return bool(linears) and all(w.t().is_contiguous() and not w.is_contiguous() for w in linears)


def test_greedy_matches_transformers_reference(engine, reference):
    assert _column_major(engine)  # the CPU decode layout (column_major_linear_weights), same results
    diff = assert_matches(engine.generate(PROMPTS, GREEDY), reference)
    print(f"HFRollout greedy vs reference: max |logprob diff| = {diff:.2e}")
    two = engine.generate(PROMPTS[:2], default_spec(n=2, temperature=0, max_tokens=MAX_NEW))
    assert two.response_ids[0] == two.response_ids[1] and two.sample_index == [0, 1, 0, 1]


def test_sampling_is_seeded_ordered_and_logprobs_are_processed(engine, hf):
    spec = default_spec(n=3, temperature=0.7, top_k=20, max_tokens=MAX_NEW, seed=5)
    first, again = engine.generate(PROMPTS[:3], spec), engine.generate(PROMPTS[:3], spec)
    assert first.response_ids == again.response_ids and first.logprobs == again.logprobs
    assert first.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2] and first.sample_index == [0, 1, 2] * 3
    assert len({tuple(r) for r in first.response_ids[:3]}) == 3
    assert engine.generate(PROMPTS[:3], spec.for_step(1)).response_ids != first.response_ids
    for row in (0, 4, 8):
        ref = teacher_forced_logprobs(hf, PROMPTS[first.prompt_index[row]], first.response_ids[row],
                                      temperature=0.7, top_k=20)
        assert max_diff([first.logprobs[row]], [ref]) <= TOL, row


def test_shared_prefill_draws_what_hf_expansion_draws(engine, tiny_model, hf):
    """The n samples share one prefill of their prompt: same tokens and logprobs as HF's own
    num_return_sequences expansion (which runs the prompt n times), left padding and a 1-token
    prompt (nothing to prefill) included; the shared path is the one that ran."""
    plain = _build(tiny_model, share_prefill=False)
    prompts = PROMPTS[:3] + prompts_of_lengths(1, 5, seed=3)
    spec = default_spec(n=4, temperature=0.9, top_k=30, max_tokens=MAX_NEW, seed=11)
    calls = []
    original = engine._shared_prefill
    engine._shared_prefill = lambda *a: calls.append(a[0].shape) or original(*a)
    try:
        shared = engine.generate(prompts, spec)
    finally:
        del engine._shared_prefill
    expanded = plain.generate(prompts, spec)
    assert len(calls) == 2  # both batches of 3 prompts (batch_size 3)
    assert shared.response_ids == expanded.response_ids
    assert max_diff(shared.logprobs, expanded.logprobs) <= TOL
    for row in (0, 13, 19):  # the 1-token prompt's samples are rows 12..15
        ref = teacher_forced_logprobs(hf, prompts[shared.prompt_index[row]], shared.response_ids[row],
                                      temperature=0.9, top_k=30)
        assert max_diff([shared.logprobs[row]], [ref]) <= TOL, row
    plain.close()


def test_raw_logprobs_ignore_temperature(tiny_model, hf):
    raw = _build(tiny_model, logprobs_mode="raw")
    result = raw.generate(PROMPTS[:2], default_spec(n=2, temperature=0.7, top_k=20,
                                                    max_tokens=MAX_NEW))
    for row in range(len(result)):
        ref = teacher_forced_logprobs(hf, PROMPTS[result.prompt_index[row]], result.response_ids[row])
        assert max_diff([result.logprobs[row]], [ref]) <= TOL


def test_stop_strings(engine, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    greedy = engine.generate(PROMPTS, GREEDY)
    picks = [pick_stop_string(tok, r) for r in greedy.response_ids]
    row = next(i for i, p in enumerate(picks) if p)
    stop, count = picks[row]
    result = engine.generate([PROMPTS[row], PROMPTS[row]], default_spec(
        temperature=0, max_tokens=MAX_NEW, stop=(stop, "never-seen")))
    assert result.finish_reason == ["stop", "stop"]
    assert result.response_ids[0] == greedy.response_ids[row][:count]


def test_eos_and_min_tokens(engine, hf, tiny_model, original):
    state, model = eos_first(hf, tiny_model, original, PROMPTS[0], EOS)
    engine.load_weights(iter(state.items()))
    try:
        result = engine.generate(PROMPTS[:2], GREEDY)
        assert result.response_ids[0] == [EOS] and result.finish_reason[0] == "stop"
        assert_matches(result, hf_greedy(model, PROMPTS[:2], eos=EOS))
        held = engine.generate(PROMPTS[:1], default_spec(temperature=0, max_tokens=MAX_NEW,
                                                         min_tokens=3))
        assert_matches(held, hf_greedy(model, PROMPTS[:1], eos=EOS, min_tokens=3))
    finally:
        engine.load_weights(iter(original.items()))


def test_load_weights_is_strict_and_a_full_update_repairs(engine, tiny_model, original,
                                                          reference):
    new_state = perturbed_state(tiny_model)
    info = engine.load_weights(iter(new_state.items()))
    assert info["tensors"] == len(original)
    assert_matches(engine.generate(PROMPTS, GREEDY),
                    hf_greedy(load_hf(tiny_model, new_state), PROMPTS))
    name = "model.norm.weight"
    bad_updates = {
        "not a weight": [("model.nrom.weight", original[name])],
        "came twice": [(name, original[name]), (name, original[name])],
        "has shape": [(name, original[name][:-1])],
        "lacks 20 of the model's 21": [(name, original[name])],
    }
    for needle, update in bad_updates.items():
        with pytest.raises(ValueError, match=needle):
            engine.load_weights(iter(update))
        with pytest.raises(RuntimeError, match="call load_weights again with every weight"):
            engine.generate(PROMPTS[:1], GREEDY)
    engine.load_weights(iter(original.items()))
    assert_matches(engine.generate(PROMPTS, GREEDY), reference)
    assert _column_major(engine)  # loading copies into the weights: their layout stays


def test_tied_model_accepts_lm_head_or_not(tmp_path):
    from verl_hpc.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "tied", "qwen2", tied=True)
    eng = _build(str(path))
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    assert "lm_head.weight" in state
    eng.load_weights(iter(state.items()))
    eng.load_weights((k, v) for k, v in state.items() if k != "lm_head.weight")
    assert eng.generate([[5, 6]], GREEDY).finish_reason


def test_sleep_noop_logged_once(engine, caplog, monkeypatch):
    monkeypatch.setattr(engine_mod, "_said", set())
    with caplog.at_level(logging.INFO, logger="verl_hpc.rollout.engine"):
        engine.sleep(), engine.wake(), engine.sleep(), engine.wake()
    assert sum("no-ops" in r.getMessage() for r in caplog.records) == 1
