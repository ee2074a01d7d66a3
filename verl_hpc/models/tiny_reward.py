"""Tiny reward-model folders for tests and demos: a *ForSequenceClassification scorer built on a
tiny causal LM's backbone (its tokenizer kept, so it reads the policy's token ids).

    folder = make_tiny_classifier(src_folder, out, seed=5)   # num_labels 1, score.weight drawn from seed
"""
from __future__ import annotations

import shutil
from pathlib import Path


def make_tiny_classifier(src, out, *, seed: int = 5, scale: float = 0.3) -> Path:
    """`src`'s backbone (model.*) with a seeded scalar head `score.weight` [1, hidden], saved as
    <Arch>ForSequenceClassification with one label, the tokenizer files copied."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from verl_hpc.models.tiny import save_safetensors

    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(src)
    arch = cfg.architectures[0].replace("ForCausalLM", "ForSequenceClassification")
    cfg.architectures, cfg.num_labels = [arch], 1
    cfg.save_pretrained(out)
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != "lm_head.weight"}
    state["score.weight"] = scale * torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    save_safetensors(state, out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, out / f.name)
    return out
