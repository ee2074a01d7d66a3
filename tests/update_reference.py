"""The independent reference of the training engines' parity tests: a plain transformers model in
float64, the whole batch in one forward, and torch's AdamW.

    batch = policy_batch(seed, n=8)                          # sequences + the policy loss's inputs
    logp, ent, mask = hf_forward64(folder, batch, temperature=0.7)
    weights, grad_norm = hf_update64(folder, batch, loss_fn, optim, temperature=0.7)

`hf_update64` is what an engine's train_step must equal: the loss of the whole batch at once
(`loss_fn` called once, with the batch's own counts), its float64 gradient, torch's gradient-norm
clipping, and one step of torch's AdamW with the engines' grouping (no weight decay on 1-D
parameters: norms, biases). No micro-batches, no sharding, no engine code.

Used from the pytest side (tests/ is on sys.path there) and from rank scripts (which put tests/ on
sys.path themselves).
"""
import torch


def policy_batch(seed: int, n: int = 8, vocab: int = 480, zero_rows=()):
    """n random sequences in the engines' batch format (prompts of 2-8 tokens, responses of 1-10),
    with response_mask and the policy loss's inputs: advantages, old_log_probs, ref_log_probs
    `[B, T]`, zero on padding; the rows in `zero_rows` have all-zero advantages."""
    from verl_hpc.engines.batch import get_response_mask, pack_sequences

    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, 9, (n,), generator=g)
    rlen = torch.randint(1, 11, (n,), generator=g)
    prompts = [torch.randint(5, vocab, (int(p),), generator=g).tolist() for p in plen]
    resps = [torch.randint(5, vocab, (int(r),), generator=g).tolist() for r in rlen]
    batch = pack_sequences(prompts, resps)
    mask = get_response_mask(batch)
    batch["response_mask"] = mask
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["advantages"][list(zero_rows)] = 0.0
    batch["old_log_probs"] = (-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    batch["ref_log_probs"] = (-6.0 + 0.3 * torch.randn(mask.shape, generator=g)) * mask
    return batch


def response_outputs(logits, batch, temperature: float = 1.0):
    """(log p of each response token, entropy there, mask), `[B, T]`, from full-sequence logits:
    response token t is predicted at position p + t - 1, from logits / temperature."""
    from verl_hpc.engines.batch import get_response_mask, response_positions, response_tokens

    mask = get_response_mask(batch).to(logits.dtype)
    pos = response_positions(batch["prompt_lengths"], mask.shape[1], batch["input_ids"].shape[1])
    rows = logits[torch.arange(len(pos)).unsqueeze(1), pos] / temperature
    logp_all = torch.log_softmax(rows, dim=-1)
    tok = response_tokens(batch["input_ids"], batch["prompt_lengths"], mask.shape[1])
    logp = logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp * mask, ent * mask, mask


def _model64(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)


def hf_forward64(folder, batch, temperature: float = 1.0):
    """float64 log-probs and entropy of the response tokens (no grad)."""
    with torch.no_grad():
        return response_outputs(_model64(folder)(batch["input_ids"]).logits, batch, temperature)


def _as64(batch):
    return {k: v.double() if torch.is_floating_point(v) else v for k, v in batch.items()}


def hf_update64(folder, batch, loss_fn, optim, temperature: float = 1.0):
    """({HF name: float64 weight} after one step of `loss_fn` on the whole batch (see the module
    docstring), the gradient's global norm before clipping); `optim` is an OptimConfig (lr,
    betas, eps, weight_decay, clip_grad). A tied lm_head is left out (the engines export the
    embedding once)."""
    from verl_hpc.engines.base import GlobalCounts

    model = _model64(folder)
    logp, ent, mask = response_outputs(model(batch["input_ids"]).logits, batch, temperature)
    mb = dict(_as64(batch), response_mask=mask)
    counts = GlobalCounts(tokens=float(mask.sum()), seqs=float(mask.shape[0]), norm_len=float(mask.shape[1]))
    loss, _ = loss_fn({"log_probs": logp, "entropy": ent}, mb, counts)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad or float("inf"))
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() > 1 and not n.endswith(".bias")]
    flat = [p for n, p in named if not (p.dim() > 1 and not n.endswith(".bias"))]
    torch.optim.AdamW([{"params": decay, "weight_decay": optim.weight_decay},
                       {"params": flat, "weight_decay": 0.0}],
                      lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps).step()
    out = {n: p.detach().clone() for n, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight")
    return out, float(norm)


def max_diff(got, want) -> float:
    """The largest |got - want| over the tensors of two {name: tensor} dicts with the same names."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    return max(float((got[k].double() - want[k].double()).abs().max()) for k in got)
