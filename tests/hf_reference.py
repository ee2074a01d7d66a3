"""The independent reference of the rollout and resharding tests: plain transformers in fp32, one
prompt at a time, token by token, no cache, no padding; and a stand-in for an actor update.

    state = perturbed_state(model_dir)                    # every tensor moved a little
    ref = hf_greedy(load_hf(model_dir, state), prompts, max_new=16)  # ends at the model's EOS
    ref = hf_greedy_from(model_dir, prompts, 16)          # the same, from the folder, on one thread

Used from the pytest side (tests/ is on sys.path there) and from rank scripts (which put tests/
on sys.path themselves).
"""
import torch


def perturbed_state(path, seed=11, scale=0.02):
    """Every checkpoint tensor changed a little (norms too): a stand-in for an actor update."""
    from safetensors.torch import load_file

    state = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in sorted(state.items())}


def load_hf(path, state=None):
    """The transformers model of a folder (fp32, eval), with `state` loaded over it if given: every
    tensor must be the model's, and only a tied lm_head may be missing."""
    import shutil
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if state is not None and any(".experts." in k for k in state):
        # a mixture-of-experts checkpoint has one tensor per expert, which transformers fuses on
        # load (not in load_state_dict): load it from a folder as a checkpoint
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(f"{path}/config.json", tmp)
            save_file({k: v.contiguous() for k, v in state.items()}, f"{tmp}/model.safetensors",
                      metadata={"format": "pt"})
            return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        model.tie_weights()
    return model


@torch.no_grad()
def hf_greedy(model, prompts, max_new, eos="model", min_tokens=0):
    """The plainest greedy decode. EOS is masked for the first min_tokens tokens and ends a response
    (kept in it); by default it is the model's own (config.eos_token_id), where the rollout engines
    stop too, so a reference agrees with them whether or not a greedy path meets EOS (None: no EOS,
    every response runs to max_new). Returns (tokens, logprobs) per prompt."""
    if eos == "model":
        eos = model.config.eos_token_id
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


def hf_greedy_from(path, prompts, max_new, state=None):
    """hf_greedy of a model folder (with `state` over it), ending at the model's EOS, on one torch
    thread (2 threads on 2 busy cores: 600 ms per forward instead of 8)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_hf(path, state)
        return hf_greedy(model, prompts, max_new)
    finally:
        torch.set_num_threads(threads)
