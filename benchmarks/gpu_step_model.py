"""The model and batch of benchmarks/bench_gpu_step.py: its shapes (the GPU's ~1B Llama and the
rehearsal's tiny one), the parameter count and FLOP formula MFU rests on (bench_gpu_step.py's
docstring), the board's peak, and the HF folder of seeded random weights every side loads."""
from __future__ import annotations

import dataclasses
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int  # tokens per sequence
    seqs: int  # sequences per step (one micro-batch)
    prompt: int  # prompt tokens of each sequence; the rest is the response the loss reads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def tokens(self) -> int:
        return self.seq * self.seqs


GPU_SHAPE = Shape(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32000, seq=2048,
                  seqs=8, prompt=64)
REHEARSAL_FREE_BYTES = 64 << 20  # the device memory a rehearsal pretends is free at the output layer
REHEARSAL_SHAPE = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512, seq=64, seqs=2,
                        prompt=8)


def param_counts(s: Shape) -> dict:
    """Parameters of the untied Llama of shape s: all, and those that multiply (not the input
    embedding table, a lookup)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = s.hidden * (q + 2 * kv) + q * s.hidden + 3 * s.hidden * s.ffn + 2 * s.hidden
    embed = s.vocab * s.hidden
    total = s.layers * layer + 2 * embed + s.hidden  # + lm_head, + final norm
    return {"total": total, "matmul": total - embed}


def model_flops(s: Shape, matmul_params: int) -> dict:
    """Model FLOPs of one step (module docstring)."""
    attn = s.layers * s.heads * s.head_dim * s.seq * s.tokens
    return {"train": 6 * matmul_params * s.tokens + 12 * attn,
            "forward": 2 * matmul_params * s.tokens + 4 * attn}


def peak_of(device: str):
    """(dense bf16 TFLOP/s, table key) of the board torch names, or (None, None)."""
    from verl_hpc.config.gpus import GPUS, gpu_type_for_device

    g = gpu_type_for_device(device)
    if g is None:
        return None, None
    return g.bf16_tflops, next(k for k, v in GPUS.items() if v is g)


def make_model_folder(out: Path, s: Shape, dtype, device):
    """An HF Llama folder of shape s with seeded random weights in `dtype`, drawn on `device`
    (a ~1B model's weights take seconds on a GPU, minutes on the host). Matrices N(0, 0.02), norm
    weights 1 + N(0, 0.1) as in verl_hpc.models.tiny; no tokenizer (neither side needs one).
    Returns (folder, parameter count)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_hpc.models.tiny import hf_config, save_safetensors

    config = hf_config("llama", layers=s.layers, vocab_size=s.vocab, hidden=s.hidden, heads=s.heads,
                       kv_heads=s.kv_heads, head_dim=s.head_dim, ffn=s.ffn, max_positions=s.seq)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen, device=device)
        state[name] = ((1.0 + 0.1 * noise) if "norm" in name else 0.02 * noise).to(dtype).cpu()
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_safetensors(state, out)
    return out, sum(t.numel() for t in state.values())


def make_batch(s: Shape):
    import torch

    from verl_hpc.engines.batch import pack_sequences

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, s.vocab, (s.seqs, s.seq), generator=g)
    return pack_sequences([r[:s.prompt].tolist() for r in ids], [r[s.prompt:].tolist() for r in ids])
