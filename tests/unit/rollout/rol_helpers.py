"""Helpers of the rollout unit tests: test data and comparisons; the transformers reference itself
is tests/hf_reference.py (shared with the dist tests), re-exported here."""
import torch
import hf_reference
from hf_reference import load_hf, perturbed_state  # noqa: F401 (re-exported)

MAX_PROMPT = 192  # > vLLM's CPU KV block of 128 tokens, so a long prompt leaves a cached block
MAX_NEW = 16
TOL = 1e-4


def hf_greedy(model, prompts, max_new=MAX_NEW, eos="model", min_tokens=0):
    """hf_reference.hf_greedy with these tests' response length (ending at the model's EOS)."""
    return hf_reference.hf_greedy(model, prompts, max_new, eos=eos, min_tokens=min_tokens)


def prompts_of_lengths(*lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 480, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def teacher_forced_logprobs(model, prompt, response, temperature=1.0, top_k=-1):
    """log-softmax of (logits / temperature) restricted to the top_k, at each response token:
    the 'processed' distribution a token was sampled from."""
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0].tolist()


def max_diff(a, b):
    return max((abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)), default=0.0)


def assert_matches(result, reference):
    """A rollout result equals a (tokens, logprobs)-per-prompt reference: tokens exactly, logprobs
    within TOL; returns the largest logprob difference."""
    assert result.response_ids == [toks for toks, _ in reference]
    diff = max_diff(result.logprobs, [lps for _, lps in reference])
    assert diff <= TOL, diff
    return diff


def pick_stop_string(tokenizer, response, min_count=3):
    """A 2-character stop string that the response's text first contains after `count` tokens
    (min_count <= count < len(response)); None if the text offers none."""
    texts = [tokenizer.decode(response[:k], skip_special_tokens=True) for k in range(len(response) + 1)]
    for count in range(min_count, len(response)):
        stop = texts[count][-2:]
        if len(stop) == 2 and stop.strip() and "\ufffd" not in stop and stop not in texts[count - 1]:
            return stop, count
    return None


def eos_first(hf, path, original, prompt, eos, factor=10.0):
    """Weights whose greedy first token after `prompt` is EOS, and their transformers model: the
    lm_head row of EOS becomes factor x the row of the token the original weights pick first
    (where that token has the largest, positive logit, EOS now wins)."""
    top_token = hf_greedy(hf, [prompt], max_new=1)[0][0][0]
    state = dict(original)
    head = state["lm_head.weight"].clone()
    head[eos] = factor * head[top_token]
    state["lm_head.weight"] = head
    return state, load_hf(path, state)
