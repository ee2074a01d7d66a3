"""What the kit's checks run: the model, the batch, the loss, the trainable engine's options and the
transformers reference, shared by the one-process checks (checks.py, fsdp_checks.py) and the
two-rank check (multi_gpu.py)."""
from __future__ import annotations


def batch(seed: int = 0, rows: int = 4, prompt: int = 24, response: int = 40, full: bool = False):
    """Random token rows; response lengths differ per row unless `full` (the memory plan's worst
    case: every row as long as the config allows)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 500, (rows, prompt + response), generator=g)
    plen = torch.full((rows,), prompt)
    rlen = torch.full((rows,), response) if full else torch.tensor([response - 3 * i for i in range(rows)])
    return {"input_ids": ids, "prompt_lengths": plen, "response_lengths": rlen}


def loss_fn(out, mb, counts):
    loss = -(out["log_probs"] * mb["response_mask"]).sum() / counts.tokens
    return loss, {"nll": loss.detach()}


def train_options(model_path: str, dtype: str, *, use_distributed_optimizer: bool):
    """A trainable engine's options: the default config's actor, Adam at lr 1e-3."""
    from verl_hpc.config.schema import OptimConfig
    from verl_hpc.engines.megatron import default_options

    return default_options(model_path=model_path, dtype=dtype, micro_batch_size=2, total_steps=4,
                           use_distributed_optimizer=use_distributed_optimizer,
                           optim=OptimConfig(lr=1e-3, weight_decay=0.01))


def tiny_model(kit) -> str:
    """The kit's model folder (a 2-layer Llama made on the spot, once per run)."""
    if kit.model_path is None:
        from verl_hpc.models.tiny import make_tiny_model

        kit.model_path = str(make_tiny_model(kit.out / "tiny_llama", "llama", layers=2))
    return kit.model_path


def hf_log_probs(path: str, batch, dtype, device):
    """transformers' log-probs of the response tokens, the folder loaded in `dtype` on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"].to(device)).logits.float()
    logp = torch.log_softmax(logits, -1)
    plen, rlen = batch["prompt_lengths"], batch["response_lengths"]
    width = int(rlen.max())
    out = torch.zeros(len(plen), width)
    for b in range(len(plen)):
        p, r = int(plen[b]), int(rlen[b])
        toks = batch["input_ids"][b, p:p + r].to(device)
        out[b, :r] = logp[b, p - 1:p + r - 1].gather(1, toks[:, None]).squeeze(1).cpu()
    del model
    return out
