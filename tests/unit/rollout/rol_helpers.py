"""Helpers of the rollout unit tests: an independent transformers reference and test data."""
import torch

MAX_PROMPT = 192  # > vLLM's CPU KV block of 128 tokens, so a long prompt leaves a cached block
MAX_NEW = 16
TOL = 1e-4


def prompts_of_lengths(*lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 480, (n,), generator=gen).tolist() for n in lengths]


def load_hf(path, state=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model


@torch.no_grad()
def hf_greedy(model, prompts, max_new=MAX_NEW, eos=None, min_tokens=0):
    """Token by token, one prompt at a time, no cache, no padding: the plainest greedy decode.
    EOS (if given) is masked for the first min_tokens tokens and ends a response (kept in it).
    Returns (tokens, logprobs) per prompt."""
    out = []
    for prompt in prompts:
        ids, lps = list(prompt), []
        for step in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if eos is not None and step < min_tokens:
                logits[eos] = float("-inf")
            logp = torch.log_softmax(logits, -1)
            tok = int(logp.argmax())
            ids.append(tok)
            lps.append(float(logp[tok]))
            if tok == eos:
                break
        out.append((ids[len(prompt):], lps))
    return out


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


def perturbed_state(path, seed=11, scale=0.02):
    """Every checkpoint tensor changed a little (norms too): a stand-in for an actor update."""
    from safetensors.torch import load_file

    state = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def pick_stop_string(tokenizer, response, min_count=3):
    """A 2-character stop string that the response's text first contains after `count` tokens
    (min_count <= count < len(response)); None if the text offers none."""
    texts = [tokenizer.decode(response[:k], skip_special_tokens=True) for k in range(len(response) + 1)]
    for count in range(min_count, len(response)):
        stop = texts[count][-2:]
        if len(stop) == 2 and stop.strip() and "\ufffd" not in stop and stop not in texts[count - 1]:
            return stop, count
    return None


def eos_first_state(state, top_token, eos, factor=10.0):
    """lm_head row of EOS = factor x the row of `top_token`: where that token has the largest
    (positive) logit, EOS now wins."""
    state = dict(state)
    head = state["lm_head.weight"].clone()
    head[eos] = factor * head[top_token]
    state["lm_head.weight"] = head
    return state
